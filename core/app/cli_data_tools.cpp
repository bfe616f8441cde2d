// `modalities data merge_packed_data | shuffle_tokenized_data |
// shuffle_jsonl_data | create_shuffled_dataset_chunk |
// create_shuffled_jsonl_chunk`: option parsing and reporting around
// core/data/pbin_tools.h. Flag names are Modalities' (docs/data.md, "Other verbs").
#include "cli.h"

#include <modalities/core/data/pbin_tools.h>
#include <modalities/sdk/error.h>

#include <fmt/core.h>

#include <chrono>
#include <iostream>
#include <optional>

namespace modalities::cli {

namespace {

namespace data = core::data;
namespace fs = std::filesystem;

constexpr const char* kPolicyHelp =
    "what to do if the output exists: skip (warn, do nothing), error, override (replace it once the new file is "
    "complete)";

// A usage error found after parsing (bad value of a well-formed option).
struct UsageError {
  std::string message;
};

data::PyInt int_option(const std::string& flag, const std::string& text) {
  try {
    return data::PyInt::parse(text);
  } catch (const Error&) {
    throw UsageError{fmt::format("--{}: '{}' is not an integer", flag, text)};
  }
}

std::uint64_t count_option(const std::string& flag, const std::string& text, std::uint64_t min) {
  const data::PyInt v = int_option(flag, text);
  if (v.negative || v.magnitude.size() > 2 || v.to_u64() < min)
    throw UsageError{fmt::format("--{} must be an integer >= {} (got {})", flag, min, text)};
  return v.to_u64();
}

data::FileExistencePolicy policy_option(const std::string& text) {
  try {
    return data::parse_file_existence_policy(text);
  } catch (const Error& e) {
    throw UsageError{e.what()};
  }
}

// The seed given, or a fresh one that is printed so the run can be repeated
// (Modalities draws an unrecorded one from the OS instead).
data::PyInt seed_or_draw(const std::optional<std::string>& given, const std::string& flag, const std::string& what) {
  if (given) return int_option(flag, *given);
  const std::uint64_t s = data::random_seed();
  std::cerr << fmt::format("note: no --{0} given; {1} with --{0} {2} (pass it to reproduce this output)\n", flag, what,
                           s);
  return data::PyInt::from(s);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Warnings and the summary line shared by every verb. Returns the exit status.
int report(const data::ToolResult& r, const std::string& unit, double seconds) {
  if (r.skipped) {
    print_warning(fmt::format("'{}' exists; skipped (--file_existence_policy skip)", r.output.string()));
    return kOk;
  }
  if (r.replaced)
    print_warning(fmt::format("'{}' existed and was replaced (--file_existence_policy override)", r.output.string()));
  if (r.legacy_inputs != 0)
    print_warning(
        fmt::format("{} input file(s) used the legacy .pbin index (absolute offsets, written before mid 2024); "
                    "converted, the output has data-relative offsets",
                    r.legacy_inputs));
  if (r.newline_added != 0)
    print_warning(
        fmt::format("{} line(s) lacked a final newline (last line of a file); one was added so the line stays "
                    "separate (Modalities would glue it to the next line)",
                    r.newline_added));
  fmt::print("wrote {}: {} {}, {} bytes in {:.2f} s\n", r.output.string(), r.documents, unit, r.bytes, seconds);
  return kOk;
}

// --- merge_packed_data ------------------------------------------------------------------

int merge(const std::vector<std::string>& args) {
  std::vector<std::string> paths;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("paths", po::value(&paths)->multitoken(),
                                            "SRC_PATHS... TARGET_PATH (positional)");
  po::positional_options_description pos;
  pos.add("paths", -1);
  po::variables_map vm;
  int status = kOk;
  const std::string usage =
      "usage: modalities data merge_packed_data SRC_PATHS... TARGET_PATH\n\n"
      "Concatenates .pbin files (each SRC is a file or a directory searched recursively for *.pbin, sorted by path)\n"
      "into TARGET_PATH, which must not exist. All inputs must have the same token size (same tokenizer).\n"
      "Unlike Modalities, the merged index has correct offsets for every input (Modalities shifts the documents of\n"
      "the 2nd and later files by 12 bytes per earlier file).";
  if (!parse(args, desc, pos, vm, usage, status)) return status;
  if (paths.size() < 2) throw UsageError{"merge_packed_data needs at least one SRC_PATH and a TARGET_PATH"};
  const std::vector<fs::path> sources(paths.begin(), paths.end() - 1);
  const auto t0 = std::chrono::steady_clock::now();
  const data::ToolResult r = data::merge_packed_data(sources, paths.back());
  return report(r, "documents", seconds_since(t0));
}

// --- shuffles ---------------------------------------------------------------------------------

int shuffle(const std::vector<std::string>& args, bool tokenized) {
  std::string input, output, policy, batch_size;
  std::optional<std::string> seed;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("input_data_path", po::value(&input)->required(),
                                            tokenized ? "the .pbin file to shuffle" : "the JSONL file to shuffle")(
      "output_data_path", po::value(&output)->required(),
      tokenized ? "the shuffled .pbin to write" : "the shuffled JSONL to write");
  if (tokenized)
    desc.add_options()("batch_size", po::value(&batch_size)->default_value("100"),
                       "documents per write batch in Modalities; accepted for compatibility (no effect on the output, "
                       "which is streamed)");
  desc.add_options()("file_existence_policy", po::value(&policy)->default_value("error"), kPolicyHelp)(
      "seed", po::value<std::string>()->notifier([&seed](const std::string& s) { seed = s; }),
      "seed of CPython's random.Random (any integer; same seed = same order as Modalities). Default: a random seed, "
      "printed so the run can be repeated");
  po::variables_map vm;
  int status = kOk;
  const std::string usage =
      tokenized
          ? "usage: modalities data shuffle_tokenized_data --input_data_path IN.pbin --output_data_path OUT.pbin "
            "[--seed N] [--file_existence_policy skip|error|override]\n\n"
            "Writes the documents of IN in a random order (random.Random(seed).shuffle of the index, as Modalities)\n"
            "with a new contiguous index. Same seed and input = byte-identical output to Modalities."
          : "usage: modalities data shuffle_jsonl_data --input_data_path IN.jsonl --output_data_path OUT.jsonl "
            "[--seed N] [--file_existence_policy skip|error|override]\n\n"
            "Writes the lines of IN in a random order (random.Random(seed).shuffle, as Modalities). A last line\n"
            "without a newline gets one (Modalities glues it to the next line); otherwise byte-identical.";
  if (!parse(args, desc, {}, vm, usage, status)) return status;
  const auto pol = policy_option(policy);
  if (tokenized) (void)count_option("batch_size", batch_size, 1);
  const data::PyInt s = seed_or_draw(seed, "seed", "shuffling");
  const auto t0 = std::chrono::steady_clock::now();
  const data::ToolResult r =
      tokenized ? data::shuffle_tokenized_data(input, output, s, pol) : data::shuffle_jsonl_data(input, output, s, pol);
  return report(r, tokenized ? "documents" : "lines", seconds_since(t0));
}

// --- chunks ------------------------------------------------------------------------------------

int chunk(const std::vector<std::string>& args, bool tokenized) {
  std::string list, root, output, chunk_id, num_chunks, policy;
  std::optional<std::string> global_seed;
  const char* kind = tokenized ? ".pbin" : "JSONL";
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")(
      "input_file_list_path", po::value(&list)->required(),
      fmt::format("text file with one input per line, relative to --input_data_root_path; each line's suffix is "
                  "replaced by {}",
                  tokenized ? ".pbin" : ".jsonl")
          .c_str())("input_data_root_path", po::value(&root)->required(), "directory the listed paths are relative to")(
      "output_chunk_file_path", po::value(&output)->required(), fmt::format("the {} chunk to write", kind).c_str())(
      "chunk_id", po::value(&chunk_id)->required(), "which chunk to write, 0 <= chunk_id < num_chunks")(
      "num_chunks", po::value(&num_chunks)->required(), "number of chunks every input is split into")(
      "file_existence_policy", po::value(&policy)->default_value("error"), kPolicyHelp)(
      "global_seed", po::value<std::string>()->notifier([&global_seed](const std::string& s) { global_seed = s; }),
      "any integer; the chunk is shuffled with numpy default_rng(sha256-derived seed of (global_seed, chunk_id)) as in "
      "Modalities. Default: a random global seed, printed so the run can be repeated");
  po::variables_map vm;
  int status = kOk;
  const std::string usage = fmt::format(
      "usage: modalities data {} --input_file_list_path LIST --input_data_root_path DIR --output_chunk_file_path OUT "
      "--chunk_id C --num_chunks K [--global_seed G] [--file_existence_policy skip|error|override]\n\n"
      "Takes chunk C of K of every listed file's {} (in list order), shuffles them together and writes them to OUT.\n"
      "Running C = 0..K-1 with one global seed splits a dataset into K shuffled parts. Same inputs and seed =\n"
      "byte-identical output to Modalities{}.",
      tokenized ? "create_shuffled_dataset_chunk" : "create_shuffled_jsonl_chunk", tokenized ? "documents" : "lines",
      tokenized ? "" : " (except that a last line without a newline gets one)");
  if (!parse(args, desc, {}, vm, usage, status)) return status;
  data::ChunkJob job;
  job.policy = policy_option(policy);
  job.num_chunks = count_option("num_chunks", num_chunks, 1);
  job.chunk_id = count_option("chunk_id", chunk_id, 0);
  if (job.chunk_id >= job.num_chunks)
    throw UsageError{fmt::format("--chunk_id ({}) must be less than --num_chunks ({})", job.chunk_id, job.num_chunks)};
  job.output = output;
  job.global_seed = seed_or_draw(global_seed, "global_seed", "shuffling chunk " + std::to_string(job.chunk_id));
  job.inputs = data::read_chunk_file_list(list, root, tokenized ? ".pbin" : ".jsonl");
  const auto t0 = std::chrono::steady_clock::now();
  const data::ToolResult r =
      tokenized ? data::create_shuffled_dataset_chunk(job) : data::create_shuffled_jsonl_chunk(job);
  return report(r, tokenized ? "documents" : "lines", seconds_since(t0));
}

}  // namespace

const char* const kDataToolsHelp =
    "  merge_packed_data SRC... DST    concatenate .pbin files (or directories of them) into one\n"
    "  shuffle_tokenized_data          shuffle the documents of a .pbin (--input_data_path, --output_data_path, "
    "--seed)\n"
    "  shuffle_jsonl_data              shuffle the lines of a JSONL file (--input_data_path, --output_data_path, "
    "--seed)\n"
    "  create_shuffled_dataset_chunk   chunk C of K of a list of .pbin files, shuffled (--chunk_id, --num_chunks, "
    "...)\n"
    "  create_shuffled_jsonl_chunk     chunk C of K of a list of JSONL files, shuffled (--chunk_id, --num_chunks, "
    "...)\n";

int run_data_tools(const std::string& verb, const std::vector<std::string>& args) {
  try {
    if (verb == "merge_packed_data") return merge(args);
    if (verb == "shuffle_tokenized_data") return shuffle(args, true);
    if (verb == "shuffle_jsonl_data") return shuffle(args, false);
    if (verb == "create_shuffled_dataset_chunk") return chunk(args, true);
    if (verb == "create_shuffled_jsonl_chunk") return chunk(args, false);
  } catch (const UsageError& e) {
    print_error(fmt::format("{}\n(see `modalities data {} --help`)", e.message, verb));
    return kUsage;
  }
  return -1;
}

}  // namespace modalities::cli
