// `modalities benchmark`: Modalities' sweep tooling (prepare_sweep_configs, list_remaining_runs)
// for TOML configs, plus `summarize`, a results table of a sweep (ours). Semantics follow
// modalities.utils.benchmarking (docs/configs.md, "benchmark").
#include "cli.h"

#include <modalities/core/config_tree.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <openssl/evp.h>
#include <simdjson.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

namespace modalities::cli {
namespace {

namespace fs = std::filesystem;
using core::ConfigNode;

constexpr const char* kResultsFile = "evaluation_results.jsonl";

std::string md5_hex(std::string_view text, std::size_t length = 16) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(text.data(), text.size(), digest, &n, EVP_md5(), nullptr) != 1) throw Error("MD5 failed");
  std::string hex;
  for (unsigned int i = 0; i < n; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex.substr(0, length);
}

// "YYYY-MM-DD__HH-MM-SS", local time (Modalities' datetime.now()).
std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  return fmt::format("{:%Y-%m-%d__%H-%M-%S}", tm);
}

// The cartesian product of a sweep table: nested tables expand recursively, an array lists the
// values, any other value counts as a one-element list (Modalities' _generate_nested_combinations).
std::vector<ConfigNode> expand(const ConfigNode& node, const std::string& path = "sweep") {
  if (node.is_array()) {
    if (node.as_array().empty())
      throw Error(
          fmt::format("{} ({}) is an empty list: the sweep would have no combination", path, node.where().str()));
    return node.as_array();
  }
  if (!node.is_table()) return {node};
  std::vector<ConfigNode> combos = {ConfigNode(ConfigNode::Table{}, node.where())};
  for (const auto& [key, value] : node.as_table()) {
    std::vector<ConfigNode> next;
    for (const ConfigNode& partial : combos)
      for (const ConfigNode& choice : expand(value, path + "." + key)) {
        ConfigNode c = partial;
        std::get<ConfigNode::Table>(c.data()).emplace_back(key, choice);
        next.push_back(std::move(c));
      }
    combos = std::move(next);
  }
  return combos;
}

std::vector<int> parse_world_sizes(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    try {
      std::size_t used = 0;
      const int v = std::stoi(part, &used);
      if (used != part.size() || v < 1) throw std::invalid_argument(part);
      out.push_back(v);
    } catch (const std::exception&) {
      throw Error(
          fmt::format("--world_sizes '{}': expected a comma-separated list of positive integers without "
                      "spaces, e.g. 2,4,8",
                      text));
    }
  }
  if (out.empty()) throw Error("--world_sizes is empty");
  return out;
}

int prepare_sweep_configs(const std::vector<std::string>& args) {
  std::string sweep_path, output_dir, world_sizes = "2";
  po::options_description desc("prepare_sweep_configs options");
  desc.add_options()("help,h", "this help")("sweep_config_path", po::value(&sweep_path)->required(),
                                            "training config with a top-level [sweep] table whose leaves are lists")(
      "output_dir", po::value(&output_dir)->required(), "where the sweep folders are written")(
      "world_sizes", po::value(&world_sizes)->default_value("2"), "comma-separated world sizes, e.g. 2,4,8");
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm,
             "usage: modalities benchmark prepare_sweep_configs --sweep_config_path F --output_dir D "
             "[--world_sizes 2,4]\n\n"
             "Writes one config per combination of the [sweep] values and world size, as\n"
             "D/<timestamp>_<hash of F>/<world size>/<hash of the combination>_<timestamp>/<F's name>, each with\n"
             "[sweep] holding that combination's values (the rest of the config reads them as ${sweep.<key>}).",
             status))
    return status;
  const std::vector<int> sizes = parse_world_sizes(world_sizes);
  const ConfigNode original = core::load_toml_file(sweep_path);
  const ConfigNode* sweep = original.find("sweep");
  if (sweep == nullptr || !sweep->is_table())
    throw Error(fmt::format("{}: no top-level [sweep] table (its leaves are lists of values to sweep)", sweep_path));
  // Generated configs live elsewhere: ${modalities_env:config_folder_path} keeps naming the sweep
  // file's folder (so paths relative to it, such as bundled data, still work).
  const std::string folder = fs::absolute(sweep_path).parent_path().lexically_normal().string();
  std::function<void(ConfigNode&)> pin = [&](ConfigNode& n) {
    if (n.is_string()) {
      std::string& s = std::get<std::string>(n.data());
      for (std::size_t at; (at = s.find("${modalities_env:config_folder_path}")) != std::string::npos;)
        s.replace(at, 36, folder);
    } else if (n.is_table()) {
      for (auto& [k, v] : std::get<ConfigNode::Table>(n.data())) pin(v);
    } else if (n.is_array()) {
      for (auto& v : std::get<ConfigNode::Array>(n.data())) pin(v);
    }
  };
  ConfigNode root = original;
  pin(root);
  const std::vector<ConfigNode> combos = expand(*sweep);
  if (combos.size() < 2)
    print_warning("the sweep has fewer than 2 combinations: this is a single configuration, not a sweep");
  const std::string ts = timestamp();
  const std::string sweep_hash = md5_hex(core::to_toml(original));
  const fs::path base = fs::path(output_dir) / fmt::format("{}_{}", ts, sweep_hash);
  std::size_t written = 0;
  for (const ConfigNode& combo : combos) {
    ConfigNode::Table table = {{"sweep", combo}};
    for (const auto& entry : root.as_table())
      if (entry.first != "sweep") table.push_back(entry);
    const ConfigNode config(std::move(table), root.where());
    ConfigNode only(ConfigNode::Table{{"sweep", combo}}, root.where());
    const std::string hash = md5_hex(core::to_toml(only));
    for (int ws : sizes) {
      const fs::path file =
          base / std::to_string(ws) / fmt::format("{}_{}", hash, ts) / fs::path(sweep_path).filename();
      write_file_atomically(file, core::to_toml(config, /*escape_interpolations=*/false));
      ++written;
    }
  }
  std::cout << fmt::format("Prepared {} combination(s) x {} world size(s): {} configs under {}\n", combos.size(),
                           sizes.size(), written, base.string());
  return kOk;
}

// --- list_remaining_runs ----------------------------------------------------------------------------

std::size_t count_lines(const fs::path& p) {
  std::ifstream in(p);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// Error types recorded by `run --error_log_folder` below a run's folder (error_logs_*.log).
std::vector<std::string> error_types(const fs::path& folder) {
  std::vector<std::string> types;
  for (const auto& e : fs::recursive_directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || !name.starts_with("error_logs_") || !name.ends_with(".log")) continue;
    simdjson::dom::parser p;
    simdjson::dom::element doc;
    std::string_view type;
    if (p.load(e.path().string()).get(doc) || doc["error"]["type"].get_string().get(type)) {
      print_warning(fmt::format("could not parse the error log {}", e.path().string()));
      types.emplace_back("ErrorFileParsingError");
    } else {
      types.emplace_back(type);
    }
  }
  return types;
}

struct RunFolder {
  fs::path config;
  std::string hash, ts;
};

// Config files of a sweep: <exp_root>/**/<world size or any>/<hash>_<timestamp>/<name>.toml, without
// the resolved dumps `run` writes; the most recent folder per (parent, hash).
std::vector<fs::path> find_configs(const fs::path& root, std::optional<int> world_size) {
  std::vector<fs::path> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const fs::path& p = e.path();
    if (!e.is_regular_file() || p.extension() != ".toml" || p.filename().string().ends_with(".resolved.toml")) continue;
    const fs::path ws = p.parent_path().parent_path().filename();
    if (world_size ? ws.string() != std::to_string(*world_size) : ws.empty()) continue;
    if (p.parent_path().parent_path() == root || p.parent_path() == root) continue;
    out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<fs::path> most_recent(const std::vector<fs::path>& configs) {
  static const std::regex pattern(R"(^[a-zA-Z0-9]+_\d{4}-\d{2}-\d{2}__\d{2}-\d{2}-\d{2}$)");
  std::map<fs::path, std::pair<fs::path, std::string>> latest;
  for (const fs::path& c : configs) {
    const std::string folder = c.parent_path().filename().string();
    if (!std::regex_match(folder, pattern))
      throw Error(
          fmt::format("{}: its folder '{}' is not <hash>_YYYY-MM-DD__HH-MM-SS (as prepare_sweep_configs "
                      "writes)",
                      c.string(), folder));
    const auto sep = folder.find('_');
    const fs::path key = c.parent_path().parent_path() / folder.substr(0, sep);
    const std::string ts = folder.substr(sep + 1);
    auto it = latest.find(key);
    if (it == latest.end() || ts > it->second.second) latest[key] = {c, ts};
  }
  std::vector<fs::path> out;
  for (const auto& [key, v] : latest) out.push_back(v.first);
  return out;
}

bool is_done(const fs::path& config, std::size_t expected_steps, const std::set<std::string>& skip) {
  const fs::path results = config.parent_path() / kResultsFile;
  if (fs::exists(results) && count_lines(results) == expected_steps) return true;
  if (!skip.empty())
    for (const std::string& t : error_types(config.parent_path()))
      if (skip.count(t)) return true;
  return false;
}

int list_remaining_runs(const std::vector<std::string>& args) {
  std::string exp_root, file_list_path, skip_types;
  int world_size = 0;
  std::size_t expected_steps = 0;
  po::options_description desc("list_remaining_runs options");
  desc.add_options()("help,h", "this help")("exp_root", po::value(&exp_root)->required(),
                                            "the sweep folder (or a folder above several)")(
      "world_size", po::value(&world_size), "only configs of this world size")(
      "file_list_path", po::value(&file_list_path)->required(), "file to write the config paths still to run into")(
      "expected_steps", po::value(&expected_steps)->required(),
      "a run is done when its evaluation_results.jsonl has this many lines")(
      "create_new_folders_if_partially_done", po::bool_switch(),
      "copy each remaining config into a new <hash>_<timestamp> folder (when some runs have run)")(
      "skip_exception_types", po::value(&skip_types)->default_value(""),
      "comma-separated error types (from error_logs_*.log) that count as done, e.g. OutOfMemoryError");
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm,
             "usage: modalities benchmark list_remaining_runs --exp_root D --file_list_path F --expected_steps N\n\n"
             "Lists the sweep configs whose most recent run is not done (too few result lines and no skipped\n"
             "error type) into F, one path per line.",
             status))
    return status;
  if (!fs::is_directory(exp_root)) throw Error(fmt::format("--exp_root {}: no such folder", exp_root));
  std::set<std::string> skip;
  std::stringstream in(skip_types);
  for (std::string t; std::getline(in, t, ',');)
    if (!t.empty()) skip.insert(t);
  const fs::path root = fs::canonical(exp_root);
  const std::vector<fs::path> all =
      find_configs(root, vm.count("world_size") ? std::optional(world_size) : std::nullopt);
  if (all.empty()) {
    print_warning(fmt::format("no sweep configs under {}; nothing written", root.string()));
    return kOk;
  }
  const std::vector<fs::path> recent = most_recent(all);
  std::vector<fs::path> remaining;
  for (const fs::path& c : recent)
    if (!is_done(c, expected_steps, skip)) remaining.push_back(c);
  std::vector<fs::path> updated = remaining;
  const bool nothing_ran = std::set(remaining.begin(), remaining.end()) == std::set(all.begin(), all.end());
  if (!nothing_ran && vm["create_new_folders_if_partially_done"].as<bool>()) {
    const std::string ts = timestamp();
    updated.clear();
    for (const fs::path& c : remaining) {
      const std::string folder = c.parent_path().filename().string();
      const fs::path target =
          c.parent_path().parent_path() / fmt::format("{}_{}", folder.substr(0, folder.find('_')), ts) / c.filename();
      fs::create_directories(target.parent_path());
      fs::copy_file(c, target, fs::copy_options::overwrite_existing);
      updated.push_back(target);
    }
  }
  std::string text;
  for (const fs::path& c : updated) text += c.string() + "\n";
  write_file_atomically(file_list_path, text);
  std::cout << fmt::format("{} config(s), {} most recent, {} remaining{} -> {}\n", all.size(), recent.size(),
                           remaining.size(), updated != remaining ? " (copied into new folders)" : "", file_list_path);
  return kOk;
}

// --- summarize (ours) ---------------------------------------------------------------------------------

// "a.b = 1" pairs of the [sweep] table, flattened.
void flatten(const ConfigNode& node, const std::string& prefix, std::vector<std::pair<std::string, std::string>>& out) {
  if (node.is_table()) {
    for (const auto& [k, v] : node.as_table()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  ConfigNode wrapper(ConfigNode::Table{{"v", node}}, node.where());
  std::string t = core::to_toml(wrapper);
  t = t.substr(t.find('=') + 1);
  while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
  while (!t.empty() && t.front() == ' ') t.erase(t.begin());
  out.emplace_back(prefix, t);
}

int summarize(const std::vector<std::string>& args) {
  std::string exp_root, csv;
  po::options_description desc("summarize options");
  desc.add_options()("help,h", "this help")("exp_root", po::value(&exp_root)->required(), "the sweep folder")(
      "csv", po::value(&csv), "also write the table as CSV to this file");
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm,
             "usage: modalities benchmark summarize --exp_root D [--csv F]\n\n"
             "One row per sweep run (the most recent folder of each combination and world size): its sweep values,\n"
             "status, steps, and the last training result's throughput, MFU, loss and peak memory.",
             status))
    return status;
  if (!fs::is_directory(exp_root)) throw Error(fmt::format("--exp_root {}: no such folder", exp_root));
  const std::vector<fs::path> runs = most_recent(find_configs(fs::canonical(exp_root), std::nullopt));
  std::vector<std::string> sweep_keys;
  struct Row {
    std::map<std::string, std::string> cells;
  };
  std::vector<Row> rows;
  const std::vector<std::string> metric_cols = {"train samples/s", "train mfu (16-bit)", "train loss avg",
                                                "peak memory rank 0 (MB)"};
  for (const fs::path& c : runs) {
    Row r;
    r.cells["world_size"] = c.parent_path().parent_path().filename().string();
    r.cells["run"] = c.parent_path().filename().string();
    std::vector<std::pair<std::string, std::string>> sweep;
    const ConfigNode root = core::load_toml_file(c);
    if (const ConfigNode* s = root.find("sweep")) flatten(*s, "", sweep);
    for (const auto& [k, v] : sweep) {
      r.cells["sweep." + k] = v;
      if (std::find(sweep_keys.begin(), sweep_keys.end(), "sweep." + k) == sweep_keys.end())
        sweep_keys.push_back("sweep." + k);
    }
    const fs::path results = c.parent_path() / kResultsFile;
    std::size_t steps = 0;
    if (fs::exists(results)) {
      std::ifstream in(results);
      std::string last_train;
      for (std::string line; std::getline(in, line);) {
        ++steps;
        if (line.find("\"dataloader_tag\": \"train\"") != std::string::npos ||
            line.find("\"dataloader_tag\":\"train\"") != std::string::npos)
          last_train = line;
      }
      simdjson::dom::parser p;
      simdjson::dom::element doc;
      if (!last_train.empty() && !p.parse(last_train).get(doc)) {
        for (const char* group : {"losses", "metrics", "throughput_metrics"}) {
          simdjson::dom::object o;
          if (doc[group].get_object().get(o)) continue;
          for (auto f : o) {
            double d = 0;
            if (!f.value.get_double().get(d)) r.cells[std::string(f.key)] = fmt::format("{:.4g}", d);
          }
        }
        std::int64_t step = 0;
        if (!doc["num_train_steps_done"].get_int64().get(step)) r.cells["step"] = std::to_string(step);
      }
    }
    const std::vector<std::string> errors = error_types(c.parent_path());
    r.cells["status"] = !errors.empty() ? "failed: " + errors.front() : steps > 0 ? "ran" : "not run";
    r.cells["results"] = std::to_string(steps);
    rows.push_back(std::move(r));
  }
  std::vector<std::string> cols = {"world_size"};
  cols.insert(cols.end(), sweep_keys.begin(), sweep_keys.end());
  for (const char* c : {"status", "results", "step"}) cols.emplace_back(c);
  cols.insert(cols.end(), metric_cols.begin(), metric_cols.end());
  cols.emplace_back("run");
  std::map<std::string, std::size_t> width;
  for (const auto& c : cols) width[c] = c.size();
  for (const Row& r : rows)
    for (const auto& c : cols)
      if (auto it = r.cells.find(c); it != r.cells.end()) width[c] = std::max(width[c], it->second.size());
  const auto cell = [](const Row& r, const std::string& c) {
    auto it = r.cells.find(c);
    return it == r.cells.end() ? std::string("-") : it->second;
  };
  std::string header, rule;
  for (const auto& c : cols) {
    header += fmt::format("{:<{}}  ", c, width[c]);
    rule += std::string(width[c], '-') + "  ";
  }
  std::cout << header << "\n" << rule << "\n";
  for (const Row& r : rows) {
    std::string line;
    for (const auto& c : cols) line += fmt::format("{:<{}}  ", cell(r, c), width[c]);
    std::cout << line << "\n";
  }
  if (!csv.empty()) {
    const auto quote = [](const std::string& s) {
      if (s.find_first_of(",\"\n") == std::string::npos) return s;
      std::string q = "\"";
      for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
      return q + "\"";
    };
    std::string text;
    for (std::size_t i = 0; i < cols.size(); ++i) text += (i ? "," : "") + quote(cols[i]);
    text += "\n";
    for (const Row& r : rows) {
      for (std::size_t i = 0; i < cols.size(); ++i) text += (i ? "," : "") + quote(cell(r, cols[i]));
      text += "\n";
    }
    write_file_atomically(csv, text);
  }
  return kOk;
}

}  // namespace

int run_benchmark(const std::vector<std::string>& args) {
  static const char* kHelp =
      "usage: modalities benchmark <command> [<args>]\n\n"
      "  prepare_sweep_configs   one config per combination of a [sweep] table and world size\n"
      "  list_remaining_runs     the sweep configs whose most recent run is not done\n"
      "  summarize               a results table of a sweep (ours)\n";
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::cout << kHelp;
    return args.empty() ? kUsage : kOk;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  try {
    if (args[0] == "prepare_sweep_configs") return prepare_sweep_configs(rest);
    if (args[0] == "list_remaining_runs") return list_remaining_runs(rest);
    if (args[0] == "summarize") return summarize(rest);
  } catch (const core::ConfigFileError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    print_error("invalid TOML");
    return kFailed;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
  print_error(fmt::format("unknown benchmark command '{}'\n\n{}", args[0], kHelp));
  return kUsage;
}

}  // namespace modalities::cli
