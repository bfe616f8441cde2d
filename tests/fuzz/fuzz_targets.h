// Fuzz targets (issue 16): one function per parser that a user's file reaches, each with the
// shape of libFuzzer's LLVMFuzzerTestOneInput. Every target feeds the bytes through the real
// entry point (the same function the host or the plugin calls) and catches only what that entry
// point documents to throw for bad input (modalities::Error and its subclasses). Anything else,
// a crash, a sanitizer report or a foreign exception, escapes and is a finding.
//
// Besides "no crash", the targets check the acceptance rule of the issue where the API promises
// it: a rejection of a file names that file. A violation calls the failure handler (default:
// print and abort, so libFuzzer records the input; the replay test installs one that fails the
// test instead).
//
// Built twice: with gcc into modalities_fuzz_replay_test (tests/fuzz/replay_test.cpp), which
// replays tests/fuzz/corpus/<target>/*, and with clang + libFuzzer + ASan/UBSan into one
// fuzz_<target> executable per target (scripts/fuzz.sh, CMake option MODALITIES_FUZZ).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// The targets (global namespace, libFuzzer's signature with a distinct name each).

/// TOML text -> config tree (load_toml_string) -> interpolation (builtin resolvers with a
/// fixed environment) -> validation of the "training" pipeline against an empty registry.
int modalities_fuzz_config(const std::uint8_t* data, std::size_t size);

/// The pickled (offset, length) index: formats::unpickle_index and unpickle_signed_index.
int modalities_fuzz_pickle_index(const std::uint8_t* data, std::size_t size);

/// A `.pbin` file: formats::PackedFile, then index(), num_documents(), document(0).
int modalities_fuzz_pbin(const std::uint8_t* data, std::size_t size);

/// A JSONL file: formats::JsonLineParser::valid/extract_string(".text") per line, and the raw
/// index builder of `modalities data create_raw_index` (core::data::index_jsonl).
int modalities_fuzz_jsonl(const std::uint8_t* data, std::size_t size);

/// A tokenizer.json: hf_tokenizer::TokenizerJson, then encode/decode of a fixed text and of a
/// slice of the input.
int modalities_fuzz_tokenizer_json(const std::uint8_t* data, std::size_t size);

/// Checkpoint folder reading. The first byte selects the mode, the rest is the file:
///   byte % 3 == 0: manifest.json of a folder whose app_state.safetensors is the valid fixture
///                  (CheckpointReader, then read_all()),
///   byte % 3 == 1: the same in a folder named like Modalities' checkpoints
///                  (eid_pyref-seen_steps_2-...), so the folder-name/progress check runs,
///   byte % 3 == 2: app_state.safetensors itself (read_safetensors_header, read_safetensors).
int modalities_fuzz_checkpoint(const std::uint8_t* data, std::size_t size);

/// A SentencePiece `.model` file loaded as the sp_tokenizer plugin loads it
/// (SentencePieceProcessor::Load(path)), then the plugin's calls on it.
int modalities_fuzz_sentencepiece(const std::uint8_t* data, std::size_t size);

/// A Modalities YAML config through `modalities config import`'s conversion
/// (core::read_yaml_file, core::yaml_config_to_toml); TOML that does not load back is a finding.
int modalities_fuzz_yaml(const std::uint8_t* data, std::size_t size);

/// A Jinja2 chat template (core::data::Template) rendered with a fixed conversation, as
/// `data prepare_instruction_tuning_data` renders one; a refusal names the template line.
int modalities_fuzz_jinja(const std::uint8_t* data, std::size_t size);

/// A Hugging Face config.json read as `convert_pytorch_to_hf_checkpoint` / the model import read it
/// (plugins/gpt2 hf::read_config): sizes, rope settings, duplicated keys, types.
int modalities_fuzz_hf_config(const std::uint8_t* data, std::size_t size);

/// The manifest.json of a format-v2 (sharded) checkpoint folder written by the plugin itself:
/// CheckpointReader (manifest checksum, chunk placement), read_all(), a region read.
int modalities_fuzz_manifest(const std::uint8_t* data, std::size_t size);

namespace modalities::fuzz {

using FuzzTarget = int (*)(const std::uint8_t* data, std::size_t size);

struct NamedTarget {
  const char* name;  // also the corpus folder tests/fuzz/corpus/<name>/ and the executable fuzz_<name>
  FuzzTarget run;
};

/// All targets, in the order above; `count` receives their number.
const NamedTarget* all_targets(std::size_t* count);

/// Called when an input breaks a promise of the API that is not a crash (e.g. a rejection
/// that does not name the file). The default prints `message` to stderr and aborts.
using FailureHandler = void (*)(const std::string& message);
void set_failure_handler(FailureHandler handler);

}  // namespace modalities::fuzz
