// `modalities data <verb>`: raw index, packing and inspection here; the verbs
// that rewrite packed/JSONL files (merge, shuffles, chunks) in cli_data_tools.cpp.
#include "cli.h"
#include "prelude.h"

#include <modalities/core/data/jsonl.h>
#include <modalities/core/data/packing.h>
#include <modalities/core/progress.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/sdk/interfaces/tokenizer.h>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <thread>

namespace modalities::cli {

namespace {

namespace data = core::data;

constexpr const char* kDataUsage = R"(usage: modalities data <command> [<args>]

Commands (flags as in Modalities; `modalities data <command> --help` for details):
  create_raw_index SRC.jsonl      index the lines of a JSONL file (.idx: byte offset and length per line)
  pack_encoded_data CONFIG.toml   tokenize a JSONL file into a .pbin (settings + tokenizer component)
  inspect_packed_data FILE.pbin   header, document and token counts, a document's tokens and text
  prepare_instruction_tuning_data CONFIG.toml
                                  chat template, train/val/test splits, .idx and .pbin per split
)";

std::string policy_help() {
  return "what to do if the output exists: skip (warn, do nothing), error, override (replace it once the new file is "
         "complete)";
}

std::string mib_per_s(std::uint64_t bytes, double seconds) {
  return fmt::format("{:.1f} MiB/s", static_cast<double>(bytes) / (1 << 20) / std::max(seconds, 1e-9));
}

// --- create_raw_index --------------------------------------------------------

int create_raw_index(const std::vector<std::string>& args) {
  std::string src, index_path, policy = "error";
  bool drop_faulty = false;
  unsigned threads = 0;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("src_path", po::value(&src)->required(),
                                            "the JSONL file (also the first positional argument)")(
      "index_path", po::value(&index_path), "output .idx (default: <src folder>/<src stem>.idx)")(
      "file_existence_policy", po::value(&policy)->default_value("error"), policy_help().c_str())(
      "drop_faulty_entries", po::bool_switch(&drop_faulty),
      "leave invalid lines out of the index (each reported) instead of failing; entry numbers then differ from line "
      "numbers")("num_threads", po::value(&threads)->default_value(0), "validation threads (0 = all cores)");
  po::positional_options_description pos;
  pos.add("src_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm, "usage: modalities data create_raw_index SRC_PATH [--index_path X.idx] [options]",
             status))
    return status;
  const auto pol = data::parse_file_existence_policy(policy);
  const std::filesystem::path src_p(src);
  const std::filesystem::path idx_p =
      index_path.empty() ? data::default_index_path(src_p) : std::filesystem::path(index_path);
  if (std::filesystem::weakly_canonical(src_p) == std::filesystem::weakly_canonical(idx_p))
    throw Error(fmt::format("--index_path '{}' is the source file itself", idx_p.string()));
  if (!std::filesystem::exists(src_p)) throw Error(fmt::format("the source file '{}' does not exist", src));
  if (!data::check_output_path(idx_p, pol)) {
    print_warning(fmt::format("'{}' exists; skipped (--file_existence_policy skip)", idx_p.string()));
    return kOk;
  }
  const auto t0 = std::chrono::steady_clock::now();
  core::ProgressBar bar(fmt::format("indexing {}", src_p.filename().string()), std::filesystem::file_size(src_p),
                        "bytes");
  data::RawIndexOptions opts;
  opts.drop_faulty_entries = drop_faulty;
  opts.num_threads = threads;
  opts.progress = [&](std::uint64_t done, std::uint64_t) { bar.update(done); };
  opts.warn = [](const std::string& m) { print_warning(m); };
  const data::RawIndexResult r = data::index_jsonl(src_p, opts);
  write_file_atomically(idx_p, formats::pickle_index(r.entries));
  bar.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("wrote {} ({} entries{}) in {:.2f} s ({})\n", idx_p.string(), r.entries.size(),
             r.dropped ? fmt::format(", {} invalid lines dropped", r.dropped) : std::string(), secs,
             mib_per_s(std::filesystem::file_size(src_p), secs));
  return kOk;
}

// --- components from a config --------------------------------------------------

struct BuiltConfig {
  VerbPrelude prelude;  // Note [Verb prelude]
  core::ConfigNode root;
  core::BuiltGraph built;
};

// Loads plugins and the config, then builds the keys of `profile`. Returns
// nullptr after printing diagnostics when the config is invalid.
std::unique_ptr<BuiltConfig> build_config(const std::string& file, const core::PipelineProfile& profile,
                                          const core::PluginOptions& popts, int& status) {
  auto b = std::make_unique<BuiltConfig>();
  if (const auto stop = b->prelude.start(popts)) {
    status = *stop;
    return nullptr;
  }
  try {
    b->root = b->prelude.config(file);
    core::ComponentGraph graph(b->prelude.registry(), b->root, &profile);
    b->built = graph.build([](const std::string& line) { std::cerr << line << "\n"; });
  } catch (const core::ConfigFileError& e) {
    std::size_t errors = 0;
    for (const auto& d : e.diagnostics()) {
      std::cerr << d.str() << "\n";
      errors += d.warning ? 0 : 1;
    }
    print_error(fmt::format("{}: {} error(s)", file, errors));
    status = kFailed;
    return nullptr;
  }
  return b;
}

std::shared_ptr<Tokenizer> tokenizer_of(const BuiltConfig& b) {
  const Value* v = b.built.get("tokenizer");
  if (v == nullptr || !v->is_object() || v->as_object().interface != Tokenizer::kInterface) return nullptr;
  return std::static_pointer_cast<Tokenizer>(v->as_object().ptr);
}

// --- pack_encoded_data -----------------------------------------------------------

int pack_encoded_data(const std::vector<std::string>& args) {
  std::string config, policy = "error";
  core::PluginOptions popts;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("config_file_path", po::value(&config)->required(),
                                            "the packing config (also the first positional argument)")(
      "file_existence_policy", po::value(&policy)->default_value("error"), policy_help().c_str());
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("config_file_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities data pack_encoded_data CONFIG.toml [--file_existence_policy skip|error|override]\n\n"
             "The config has a [settings] table (src_path, dst_path, index_path, jq_pattern, num_cpus, eod_token,\n"
             "processing_batch_size, raw_samples_queue_size, processed_samples_queue_size, skip_invalid_documents)\n"
             "and a [tokenizer] component; see configs/data_preparation/ for examples.",
             status))
    return status;
  const auto pol = data::parse_file_existence_policy(policy);
  const core::PipelineProfile* profile = core::find_pipeline("packing");
  auto b = build_config(config, *profile, popts, status);
  if (!b) return status;
  data::PackingSettings settings = data::parse_packing_settings(*b->built.get("settings"));
  settings.config_file = config;
  const std::filesystem::path dst = settings.resolved_dst();
  if (!data::check_output_path(dst, pol)) {
    print_warning(fmt::format("'{}' exists; skipped (--file_existence_policy skip)", dst.string()));
    return kOk;
  }
  const auto tokenizer = tokenizer_of(*b);
  data::PackingHooks hooks;
  hooks.warn = [](const std::string& m) { print_warning(m); };
  const data::PackingResult r = data::pack_encoded_data(settings, *tokenizer, hooks);
  const std::uint64_t src_bytes = std::filesystem::file_size(settings.src_path);
  fmt::print("wrote {}: {} documents, {} tokens of {} byte(s){} in {:.3f} s ({}, {} tokens/s)\n",
             r.dst.lexically_normal().string(), r.documents, r.tokens, r.token_size,
             r.skipped ? fmt::format(", {} documents skipped", r.skipped) : "", r.seconds,
             mib_per_s(src_bytes, r.seconds),
             modalities::human_count(static_cast<double>(r.tokens) / std::max(r.seconds, 1e-9)));
  return kOk;
}

// --- inspect_packed_data -----------------------------------------------------------

int inspect_packed_data(const std::vector<std::string>& args) {
  std::string file, tokenizer_config;
  std::int64_t document = 0;
  std::size_t max_tokens = 32;
  core::PluginOptions popts;
  po::options_description desc("Options");
  desc.add_options()("help,h", "this help")("data_path", po::value(&file)->required(),
                                            "the .pbin file (also the first positional argument)")(
      "document", po::value(&document)->default_value(0), "document to show (negative counts from the end)")(
      "max_tokens", po::value(&max_tokens)->default_value(32), "token ids to print")(
      "tokenizer_config", po::value(&tokenizer_config),
      "a TOML file with a [tokenizer] component (e.g. the packing config) to decode the document");
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("data_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities data inspect_packed_data FILE.pbin [--document K] [--tokenizer_config X.toml]", status))
    return status;
  formats::PackedFile f(file);
  const auto& h = f.header();
  fmt::print("file:        {} ({} bytes)\n", file, h.file_size);
  fmt::print("token size:  {} byte(s) per token (max id {})\n", h.token_size,
             h.token_size == 4 ? 4294967295ULL : (1ULL << (8 * h.token_size)) - 1);
  fmt::print("tokens:      {} (data section {} bytes)\n", f.num_tokens(), h.data_len);
  const auto& index = f.index();
  fmt::print("index:       {} bytes, {} documents, {} offsets\n", f.index_bytes().size(), index.size(),
             f.legacy() ? "legacy absolute" : "data-relative");
  if (index.empty()) return kOk;
  std::uint64_t lo = UINT64_MAX, hi = 0;
  for (const auto& [off, len] : index) {
    lo = std::min(lo, len / h.token_size);
    hi = std::max(hi, len / h.token_size);
  }
  fmt::print("doc length:  min {} / mean {:.1f} / max {} tokens\n", lo,
             static_cast<double>(f.num_tokens()) / static_cast<double>(index.size()), hi);
  const std::int64_t n = static_cast<std::int64_t>(index.size());
  const std::int64_t k = document < 0 ? document + n : document;
  if (k < 0 || k >= n) throw Error(fmt::format("--document {} is outside [0, {})", document, n));
  const std::vector<std::int64_t> ids = f.document(static_cast<std::uint64_t>(k));
  std::vector<std::int64_t> head(ids.begin(),
                                 ids.begin() + static_cast<std::ptrdiff_t>(std::min(max_tokens, ids.size())));
  fmt::print("document {}:  {} tokens: [{}{}]\n", k, ids.size(), fmt::join(head, ", "),
             ids.size() > head.size() ? ", ..." : "");
  if (!tokenizer_config.empty()) {
    core::PipelineProfile profile{
        "inspect", "decode with a tokenizer", {{"tokenizer", "Tokenizer", true, "decodes the document"}}};
    auto b = build_config(tokenizer_config, profile, popts, status);
    if (!b) return status;
    fmt::print("decoded:\n{}\n", tokenizer_of(*b)->decode(ids));
  }
  return kOk;
}

}  // namespace

int run_data(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kDataUsage << kDataToolsHelp;
    return args.empty() ? kUsage : kOk;
  }
  const std::string verb = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (verb == "create_raw_index") return create_raw_index(rest);
  if (verb == "pack_encoded_data") return pack_encoded_data(rest);
  if (verb == "inspect_packed_data") return inspect_packed_data(rest);
  if (verb == "prepare_instruction_tuning_data") return run_prepare_instruction_tuning_data(rest);
  const int r = run_data_tools(verb, rest);
  if (r >= 0) return r;
  print_error(fmt::format("unknown data command '{}'\n\n{}{}", verb, kDataUsage, kDataToolsHelp));
  return kUsage;
}

}  // namespace modalities::cli
