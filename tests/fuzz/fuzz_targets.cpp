// The fuzz targets of issue 16 (see fuzz_targets.h). Each catches exactly what its entry point
// documents to throw for bad input, modalities::Error (ConfigError, ConfigFileError, ...), and
// checks that the rejection names the file where the API promises it. Everything else escapes.
// The SentencePiece target lives in fuzz_sentencepiece.cpp (no Abseil next to its header).
#include "fuzz_targets.h"

#include "fuzz_support.h"

#include <modalities/core/config_tree.h>
#include <modalities/core/data/jinja.h>
#include <modalities/core/data/jsonl.h>
#include <modalities/core/graph.h>
#include <modalities/core/interpolation.h>
#include <modalities/core/registry.h>
#include <modalities/core/yaml_import.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/sdk/formats/safetensors.h>
#include <modalities/sdk/value.h>

// Compiled into the fuzz library from the plugins' sources (tests/fuzz/CMakeLists.txt).
#include "checkpointing/src/format.h"
#include "gpt2/src/huggingface.h"
#include "hf_tokenizer/src/tokenizer_json.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#ifndef MODALITIES_FUZZ_CHECKPOINT_APP_STATE
#error "MODALITIES_FUZZ_CHECKPOINT_APP_STATE must name a valid app_state.safetensors (tests/fuzz/CMakeLists.txt)"
#endif

namespace fs = std::filesystem;

namespace modalities::fuzz {
namespace {

// --- config -------------------------------------------------------------------------------

constexpr std::string_view kConfigName = "fuzz.toml";

// The built-in resolvers with the environment a command supplies, fixed. cuda_env and node_env
// read the process environment and the machine; they are replaced by resolvers with the same
// contract and fixed answers, so a corpus replays the same way everywhere.
const core::ResolverTable& config_resolvers() {
  static const core::ResolverTable table = [] {
    core::ModalitiesEnv env;
    env.values = {{"config_file_path", std::string(kConfigName)},
                  {"config_folder_path", "."},
                  {"experiments_root_path", "fuzz_experiments"},
                  {"experiment_id", "fuzz"}};
    core::ResolverTable t = core::builtin_resolvers(env);
    t.add({"cuda_env", "fixed for fuzzing: LOCAL_RANK=0, RANK=0, WORLD_SIZE=1, anything else unset",
           [](std::string_view name) -> Value {
             if (name == "LOCAL_RANK" || name == "RANK") return Value(std::int64_t{0});
             if (name == "WORLD_SIZE") return Value(std::int64_t{1});
             return Value();
           }});
    t.add({"node_env", "fixed for fuzzing: num_cpus=4, anything else null", [](std::string_view name) -> Value {
             if (name == "num_cpus") return Value(std::int64_t{4});
             return Value();
           }});
    return t;
  }();
  return table;
}

int fuzz_config(const std::uint8_t* data, std::size_t size) {
  // `modalities run|config ...`: load, resolve, validate the training pipeline (no plugins loaded:
  // every component is unknown, which exercises the graph's error paths on any document).
  core::ConfigNode root;
  try {
    root = core::load_toml_string(as_text(data, size), std::string(kConfigName));
  } catch (const Error& e) {
    expect_names_file("config: load_toml_string", e.what(), kConfigName);
    return 0;
  }
  try {
    core::resolve_interpolations(root, config_resolvers());
  } catch (const Error& e) {
    expect_names_file("config: resolve_interpolations", e.what(), kConfigName);
    return 0;
  }
  (void)core::to_toml(root);  // `modalities config resolve` prints this
  try {
    const core::Registry registry;  // outlives the graph, which keeps a reference
    core::ComponentGraph graph(registry, root, core::find_pipeline("training"));
    for (const core::Diagnostic& d : graph.validate())
      expect_names_file("config: ComponentGraph::validate", d.str(), kConfigName);
  } catch (const Error& e) {
    expect_names_file("config: ComponentGraph::validate", e.what(), kConfigName);
  }
  return 0;
}

// --- pickled index (.idx, index segment of .pbin) ------------------------------------------

constexpr std::string_view kIdxName = "fuzz.idx";
// Size of data/sample/eval.jsonl, which the seed sample_eval.idx indexes.
constexpr std::uint64_t kCoveredJsonlSize = 64420;

int fuzz_pickle_index(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  std::optional<std::vector<formats::IndexEntry>> entries;
  std::optional<std::vector<formats::SignedIndexEntry>> signed_entries;
  try {
    entries = formats::unpickle_index(bytes, std::string(kIdxName));
  } catch (const Error& e) {
    expect_names_file("pickle_index: unpickle_index", e.what(), kIdxName);
  }
  try {
    signed_entries = formats::unpickle_signed_index(bytes, std::string(kIdxName));
  } catch (const Error& e) {
    expect_names_file("pickle_index: unpickle_signed_index", e.what(), kIdxName);
  }
  // The two readers differ only in accepting negative offsets.
  if (entries) {
    bool same = signed_entries && signed_entries->size() == entries->size();
    for (std::size_t k = 0; same && k < entries->size(); ++k)
      same = (*signed_entries)[k].first >= 0 &&
             static_cast<std::uint64_t>((*signed_entries)[k].first) == (*entries)[k].first &&
             static_cast<std::uint64_t>((*signed_entries)[k].second) == (*entries)[k].second;
    if (!same) report_failure("pickle_index: unpickle_index and unpickle_signed_index disagree on an index");
    // What Modalities (and pickle_index) writes reads back unchanged.
    try {
      const std::string pickled = formats::pickle_index(*entries);
      const std::span<const std::byte> again(reinterpret_cast<const std::byte*>(pickled.data()), pickled.size());
      if (formats::unpickle_index(again, "re-pickled") != *entries)
        report_failure("pickle_index: pickle_index/unpickle_index do not round-trip");
    } catch (const Error& e) {
      report_failure(std::string("pickle_index: the re-pickled index is refused: ") + e.what());
    }
  } else if (signed_entries &&
             std::all_of(signed_entries->begin(), signed_entries->end(), [](const auto& e) { return e.first >= 0; })) {
    report_failure(
        "pickle_index: unpickle_signed_index accepts an index without negative offsets that "
        "unpickle_index refuses");
  }

  // The `.idx` file reader (datasets, `modalities data` tools).
  const fs::path file = scratch_dir() / kIdxName;
  write_file(file, data, size);
  try {
    const std::vector<formats::IndexEntry> raw = formats::read_raw_index(file);
    formats::check_raw_index_fits(raw, kCoveredJsonlSize, file, scratch_dir() / "fuzz.jsonl");
  } catch (const Error& e) {
    expect_names_file("pickle_index: read_raw_index", e.what(), kIdxName);
  }
  return 0;
}

// --- .pbin -------------------------------------------------------------------------------

constexpr std::string_view kPbinName = "fuzz.pbin";

int fuzz_pbin(const std::uint8_t* data, std::size_t size) {
  const fs::path file = scratch_dir() / kPbinName;
  write_file(file, data, size);
  try {
    (void)formats::read_packed_header(file);
  } catch (const Error& e) {
    expect_names_file("pbin: read_packed_header", e.what(), kPbinName);
  }
  try {
    formats::PackedFile f(file);
    const std::uint64_t n = f.num_tokens();
    if (n > 0) {
      (void)f.token(0);
      (void)f.token(n - 1);
      const std::uint64_t count = std::min<std::uint64_t>(n, 64);
      std::vector<std::int64_t> buf(count);
      f.copy_tokens(n - count, count, buf.data());
    }
    (void)f.index_bytes();
    (void)f.index();
    (void)f.legacy();
    const std::uint64_t docs = f.num_documents();
    if (docs > 0) {
      (void)f.document(0);
      (void)f.document(docs - 1);
    }
  } catch (const Error& e) {
    expect_names_file("pbin: PackedFile", e.what(), kPbinName);
  }
  return 0;
}

// --- JSONL ---------------------------------------------------------------------------------

constexpr std::string_view kJsonlName = "fuzz.jsonl";

// What `create_raw_index` writes for `jsonl` is whole lines, and the `.idx` readers accept it unchanged.
void check_written_index(std::string_view jsonl, const fs::path& jsonl_file,
                         const std::vector<formats::IndexEntry>& entries, const char* mode) {
  for (std::size_t k = 0; k < entries.size(); ++k)
    if (const auto why = formats::raw_index_entry_mismatch(jsonl, entries[k]))
      report_failure(std::string("jsonl: index_jsonl (") + mode + ") entry " + std::to_string(k) +
                     " is not a whole line: " + *why);
  const fs::path idx = scratch_dir() / "fuzz_jsonl.idx";
  const std::string pickled = formats::pickle_index(entries);
  write_file(idx, reinterpret_cast<const std::uint8_t*>(pickled.data()), pickled.size());
  try {
    if (formats::read_raw_index(idx) != entries)
      report_failure(std::string("jsonl: read_raw_index reads back a different index than create_raw_index (") + mode +
                     ") wrote");
    formats::check_raw_index_fits(entries, jsonl.size(), idx, jsonl_file);
  } catch (const Error& e) {
    report_failure(std::string("jsonl: the index create_raw_index (") + mode + ") writes is refused: " + e.what());
  }
}

int fuzz_jsonl(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = as_text(data, size);
  // The dataset readers: validation and the jq path of every line. JsonLineParser's errors carry
  // no file context by contract (its callers add it), so only "no crash" is checked here.
  static const formats::JqPath kText = formats::JqPath::parse(".text");
  formats::JsonLineParser parser;
  std::optional<formats::JqPath> first_line_path;  // a first line starting with '.' is also tried as a jq program
  std::string why;
  const std::vector<formats::IndexEntry> lines = formats::split_lines(text);
  for (std::size_t k = 0; k < lines.size(); ++k) {
    const std::string_view line = text.substr(lines[k].first, lines[k].second);
    if (k == 0 && line.starts_with('.')) {
      try {
        first_line_path = formats::JqPath::parse(line);
      } catch (const Error&) {
      }
    }
    if (!parser.valid(line, &why)) continue;
    const formats::JqPath* paths[] = {&kText, first_line_path ? &*first_line_path : nullptr};
    for (const formats::JqPath* path : paths) {
      if (path == nullptr) continue;
      try {
        (void)parser.extract_string(line, *path);
      } catch (const Error&) {
      }
    }
  }

  // `modalities data create_raw_index`: the raw index builder, strict and dropping bad lines
  // (one thread, so a run is deterministic).
  const fs::path file = scratch_dir() / kJsonlName;
  write_file(file, data, size);
  core::data::RawIndexOptions strict;
  strict.num_threads = 1;
  std::optional<core::data::RawIndexResult> indexed;
  try {
    indexed = core::data::index_jsonl(file, strict);
  } catch (const Error& e) {
    expect_names_file("jsonl: index_jsonl", e.what(), kJsonlName);
  }
  if (indexed) check_written_index(text, file, indexed->entries, "strict");
  core::data::RawIndexOptions drop = strict;
  drop.drop_faulty_entries = true;
  drop.warn = [](const std::string& m) { expect_names_file("jsonl: index_jsonl warning", m, kJsonlName); };
  indexed.reset();
  try {
    indexed = core::data::index_jsonl(file, drop);
  } catch (const Error& e) {
    expect_names_file("jsonl: index_jsonl (drop_faulty_entries)", e.what(), kJsonlName);
  }
  if (indexed) check_written_index(text, file, indexed->entries, "drop_faulty_entries");
  return 0;
}

// --- tokenizer.json ------------------------------------------------------------------------

constexpr std::string_view kTokenizerName = "tokenizer.json";
// Mixed scripts, digits, whitespace runs, combining marks, an emoji, CRLF and a common special token.
constexpr std::string_view kSampleText =
    "Hello world!  It's 2024-06-01, 3.14159 and 1,000,000.\tTabs\r\nand newlines\n"
    "  caf\xC3\xA9 cafe\xCC\x81 na\xC3\xAFve \xEF\xAC\x81 \xE2\x84\xAB \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E "
    "\xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 \xF0\x9F\x98\x80 <|endoftext|><s></s>[CLS] x";

void exercise_tokenizer(const plugins::hf_tokenizer::TokenizerJson& tok, std::string_view text) {
  std::vector<std::int64_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const Error&) {  // e.g. invalid UTF-8 in the text, or a character the regex tables lack
    return;
  }
  try {
    (void)tok.decode(ids);
  } catch (const Error&) {
  }
  for (std::size_t k = 0; k < ids.size() && k < 8; ++k) (void)tok.id_to_token(ids[k]);
}

int fuzz_tokenizer_json(const std::uint8_t* data, std::size_t size) {
  const fs::path file = scratch_dir() / kTokenizerName;
  write_file(file, data, size);
  std::optional<plugins::hf_tokenizer::TokenizerJson> tok;
  try {
    tok.emplace(file);
  } catch (const Error& e) {
    expect_names_file("tokenizer_json: TokenizerJson", e.what(), kTokenizerName);
    return 0;
  }
  (void)tok->model_vocab_size();
  (void)tok->full_vocab_size();
  (void)tok->unk_token();
  (void)tok->token_to_id("<|endoftext|>");
  (void)tok->id_to_token(0);
  (void)tok->id_to_token(-1);
  exercise_tokenizer(*tok, kSampleText);
  // A slice of the input as text (bounded, so a pathological regex cannot run away with it).
  const std::string_view all = as_text(data, size);
  const std::size_t from = all.size() / 2;
  exercise_tokenizer(*tok, all.substr(from, 256));
  return 0;
}

// --- checkpoint folder / safetensors --------------------------------------------------------

struct CheckpointFolders {
  fs::path plain;  // a folder named by a user
  fs::path named;  // Modalities' folder name, checked against the manifest's progress
  fs::path safetensors;
};

const CheckpointFolders& checkpoint_folders() {
  static const CheckpointFolders* folders = [] {
    // The reader hashes tensors on LibTorch's intra-op pool: one thread keeps runs reproducible.
    at::set_num_threads(1);
    auto* f =
        new CheckpointFolders{scratch_dir() / "fuzz_checkpoint",
                              scratch_dir() / "eid_pyref-seen_steps_2-seen_tokens_64-target_steps_10-target_tokens_320",
                              scratch_dir() / "fuzz_safetensors"};
    std::error_code ec;
    for (const fs::path* dir : {&f->plain, &f->named}) {
      fs::create_directories(*dir, ec);
      if (!ec)
        fs::copy_file(MODALITIES_FUZZ_CHECKPOINT_APP_STATE, *dir / plugins::checkpointing::kAppStateFile,
                      fs::copy_options::overwrite_existing, ec);
      if (ec)
        report_failure("checkpoint: cannot prepare '" + dir->string() + "' from " +
                       MODALITIES_FUZZ_CHECKPOINT_APP_STATE + ": " + ec.message());
    }
    fs::create_directories(f->safetensors, ec);
    if (ec) report_failure("checkpoint: cannot create '" + f->safetensors.string() + "': " + ec.message());
    return f;
  }();
  return *folders;
}

int fuzz_checkpoint(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const CheckpointFolders& folders = checkpoint_folders();
  const int mode = data[0] % 3;
  ++data;
  --size;
  if (mode == 2) {
    const fs::path file = folders.safetensors / plugins::checkpointing::kAppStateFile;
    write_file(file, data, size);
    const std::string name = file.string();
    try {
      (void)formats::read_safetensors_header(file);
      (void)formats::read_safetensors_metadata(file);
      (void)formats::read_safetensors(file);
    } catch (const Error& e) {
      expect_names_file("checkpoint: read_safetensors", e.what(), name);
    }
    return 0;
  }
  const fs::path& folder = mode == 0 ? folders.plain : folders.named;
  write_file(folder / plugins::checkpointing::kManifestFile, data, size);
  try {
    const plugins::checkpointing::CheckpointReader reader(folder);
    (void)reader.progress();
    const StateDict state = reader.read_all();
    reader.check_shapes(state);
  } catch (const Error& e) {
    expect_names_file("checkpoint: CheckpointReader", e.what(), folder.string());
  }
  return 0;
}

// --- YAML import (`modalities config import`) ---------------------------------------------------

int fuzz_yaml(const std::uint8_t* data, std::size_t size) {
  const fs::path file = scratch_dir() / "fuzz.yaml";
  write_file(file, data, size);
  try {
    (void)core::yaml_config_to_toml(core::read_yaml_file(file.string()), file.string());
  } catch (const Error& e) {
    const std::string message = e.what();
    // TOML that does not load back is the importer's bug, whatever the input.
    if (message.find(core::kImporterBug) != std::string::npos) report_failure("yaml: " + message);
    else expect_names_file("yaml: yaml_config_to_toml", message, file.string());
  }
  return 0;
}

// --- Jinja chat templates ---------------------------------------------------------------------

// The context of `data prepare_instruction_tuning_data`: a conversation and chat_template_data.
const core::data::jinja::Dict& jinja_context() {
  static const core::data::jinja::Value context = core::data::jinja::json_loads(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b>"},
                 {"role": "assistant", "content": "Hello!"}],
    "chat_template_data": {"assistant_role": "assistant", "special_tokens": {"b_include_to_loss_token": "^",
                           "e_include_to_loss_token": "$", "e_assistant_token": "\n"}},
    "add_generation_prompt": false})");
  return *context.dict;
}

int fuzz_jinja(const std::uint8_t* data, std::size_t size) {
  try {
    const core::data::jinja::Template t(as_text(data, size));
    (void)t.render(jinja_context());
  } catch (const Error& e) {
    // Every refusal names the template position (compile time: "template line N: ..."; run time:
    // the line of the failing tag).
    expect_names_file("jinja: Template", e.what(), "template line ");
  }
  return 0;
}

// --- Hugging Face config.json ---------------------------------------------------------------

int fuzz_hf_config(const std::uint8_t* data, std::size_t size) {
  static const fs::path folder = [] {
    const fs::path f = scratch_dir() / "fuzz_hf";
    std::error_code ec;
    fs::create_directories(f, ec);
    if (ec) report_failure("hf_config: cannot create '" + f.string() + "': " + ec.message());
    return f;
  }();
  const fs::path file = folder / "config.json";
  write_file(file, data, size);
  try {
    (void)plugins::gpt2::hf::read_config(folder);
  } catch (const Error& e) {
    expect_names_file("hf_config: read_config", e.what(), file.string());
  }
  return 0;
}

// --- format-v2 manifest -----------------------------------------------------------------------

// A format-v2 (sharded) checkpoint folder written once by the plugin's own writer (one process, two
// tensors), whose manifest.json each input replaces.
const fs::path& sharded_checkpoint_folder() {
  static const fs::path folder = [] {
    at::set_num_threads(1);
    const fs::path f = scratch_dir() / "fuzz_sharded";
    namespace ck = plugins::checkpointing;
    const at::Tensor w = at::arange(24, at::kFloat).reshape({4, 6});
    std::vector<ck::LocalTensor> tensors = {
        {"model.w", w, {4, 6}, {0, 0}},
        {"model.b", at::ones({3}, at::kBFloat16), {3}, {0}},
    };
    ck::CheckpointInfo info;
    info.experiment_id = "fuzz";
    info.progress.num_seen_steps_current_run = 2;
    info.progress.num_seen_tokens_current_run = 64;
    info.progress.num_target_steps = 10;
    info.progress.num_target_tokens = 320;
    info.writer_variant = "checkpoint_saving_execution/dcp";
    try {
      ck::write_sharded_checkpoint_folder(f, tensors, StateDict{}, info, [] {});
    } catch (const std::exception& e) {
      report_failure(std::string("manifest: cannot write the sharded checkpoint fixture: ") + e.what());
    }
    // The seed corpus' valid manifest comes from here (tests/fuzz/make_corpus.py says how).
    if (const char* seed = std::getenv("MODALITIES_FUZZ_MANIFEST_SEED"); seed != nullptr && *seed != '\0') {
      std::error_code ec;
      fs::copy_file(f / ck::kManifestFile, seed, fs::copy_options::overwrite_existing, ec);
      if (ec)
        report_failure(std::string("manifest: cannot copy the fixture's manifest to ") + seed + ": " + ec.message());
    }
    return f;
  }();
  return folder;
}

int fuzz_manifest(const std::uint8_t* data, std::size_t size) {
  const fs::path& folder = sharded_checkpoint_folder();
  write_file(folder / plugins::checkpointing::kManifestFile, data, size);
  try {
    const plugins::checkpointing::CheckpointReader reader(folder);
    (void)reader.progress();
    const StateDict state = reader.read_all();
    reader.check_shapes(state);
    (void)reader.read_regions({{"model.w", plugins::checkpointing::Box{{1, 2}, {2, 3}}}});
  } catch (const Error& e) {
    expect_names_file("manifest: CheckpointReader", e.what(), folder.string());
  }
  return 0;
}

const NamedTarget kTargets[] = {
    {"config", &modalities_fuzz_config},
    {"pickle_index", &modalities_fuzz_pickle_index},
    {"pbin", &modalities_fuzz_pbin},
    {"jsonl", &modalities_fuzz_jsonl},
    {"tokenizer_json", &modalities_fuzz_tokenizer_json},
    {"checkpoint", &modalities_fuzz_checkpoint},
    {"sentencepiece", &modalities_fuzz_sentencepiece},
    {"yaml", &modalities_fuzz_yaml},
    {"jinja", &modalities_fuzz_jinja},
    {"hf_config", &modalities_fuzz_hf_config},
    {"manifest", &modalities_fuzz_manifest},
};

}  // namespace

const NamedTarget* all_targets(std::size_t* count) {
  *count = std::size(kTargets);
  return kTargets;
}

}  // namespace modalities::fuzz

int modalities_fuzz_config(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_config(data, size);
}
int modalities_fuzz_pickle_index(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_pickle_index(data, size);
}
int modalities_fuzz_pbin(const std::uint8_t* data, std::size_t size) { return modalities::fuzz::fuzz_pbin(data, size); }
int modalities_fuzz_jsonl(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_jsonl(data, size);
}
int modalities_fuzz_tokenizer_json(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_tokenizer_json(data, size);
}
int modalities_fuzz_checkpoint(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_checkpoint(data, size);
}
int modalities_fuzz_jinja(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_jinja(data, size);
}
int modalities_fuzz_hf_config(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_hf_config(data, size);
}
int modalities_fuzz_manifest(const std::uint8_t* data, std::size_t size) {
  return modalities::fuzz::fuzz_manifest(data, size);
}
int modalities_fuzz_yaml(const std::uint8_t* data, std::size_t size) { return modalities::fuzz::fuzz_yaml(data, size); }
