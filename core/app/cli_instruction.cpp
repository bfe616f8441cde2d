// `modalities data prepare_instruction_tuning_data`: Modalities' create_instruction_tuning_data.
// Applies the config's Jinja2 chat template to each JSONL entry (stored under "chat"), splits the
// entries into train/val/test with Python's random.choices stream, writes the splits and a copy of
// the config into <dst dir>/<src stem>_<first 7 hex of the config's SHA-256>/, then indexes and
// packs every non-empty split with a per-split copy of the packing config. The JSONL, .idx and
// .pbin files are byte-identical to Modalities' (docs/data.md, "Instruction tuning").
#include "cli.h"

#include <modalities/core/config_tree.h>
#include <modalities/core/data/jinja.h>
#include <modalities/core/data/pbin_tools.h>
#include <modalities/core/data/reference_rng.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

namespace modalities::cli {
namespace {

namespace fs = std::filesystem;
namespace jinja = core::data::jinja;
using core::ConfigNode;

// --- pathlib's name arithmetic (Modalities builds the output names with it) -----------------------

std::string py_suffix(const std::string& name) {
  const auto i = name.rfind('.');
  return i != std::string::npos && i > 0 && i + 1 < name.size() ? name.substr(i) : "";
}
std::string py_stem(const std::string& name) { return name.substr(0, name.size() - py_suffix(name).size()); }
std::vector<std::string> py_suffixes(const std::string& name) {
  if (name.ends_with('.')) return {};
  std::string n = name;
  n.erase(0, n.find_first_not_of('.'));
  std::vector<std::string> out;
  std::size_t i = n.find('.');
  while (i != std::string::npos) {
    const std::size_t j = n.find('.', i + 1);
    out.push_back(n.substr(i, j == std::string::npos ? std::string::npos : j - i));
    i = j;
  }
  return out;
}
fs::path py_with_suffix(const fs::path& p, const std::string& suffix) {
  const std::string name = p.filename().string();
  return p.parent_path() / (py_stem(name) + suffix);
}

// --- the config ---------------------------------------------------------------------------------------

const ConfigNode& need(const ConfigNode& parent, const std::string& key, const std::string& path) {
  const ConfigNode* n = parent.is_table() ? parent.find(key) : nullptr;
  if (n == nullptr) throw Error(fmt::format("{}{}: missing", path.empty() ? "" : path + ".", key));
  return *n;
}
std::string need_string(const ConfigNode& parent, const std::string& key, const std::string& path) {
  const ConfigNode& n = need(parent, key, path);
  if (!n.is_string()) throw Error(fmt::format("{}.{} ({}): expected a string", path, key, n.where().str()));
  return n.as_string();
}
std::int64_t need_int(const ConfigNode& parent, const std::string& key, const std::string& path) {
  const ConfigNode& n = need(parent, key, path);
  if (!std::holds_alternative<std::int64_t>(n.data()))
    throw Error(fmt::format("{}.{} ({}): expected an integer", path, key, n.where().str()));
  return std::get<std::int64_t>(n.data());
}

jinja::Value to_value(const ConfigNode& n) {
  return std::visit(
      [](const auto& d) -> jinja::Value {
        using T = std::decay_t<decltype(d)>;
        if constexpr (std::is_same_v<T, std::monostate>) return jinja::Value::none();
        else if constexpr (std::is_same_v<T, bool>) return jinja::Value::boolean(d);
        else if constexpr (std::is_same_v<T, std::int64_t>) return jinja::Value::integer(d);
        else if constexpr (std::is_same_v<T, double>) return jinja::Value::real(d);
        else if constexpr (std::is_same_v<T, std::string>) return jinja::Value::string(d);
        else if constexpr (std::is_same_v<T, ConfigNode::Array>) {
          jinja::List l;
          for (const auto& x : d) l.push_back(to_value(x));
          return jinja::Value::make_list(std::move(l));
        } else {
          jinja::Value v = jinja::Value::make_dict();
          for (const auto& [k, x] : d) v.set(k, to_value(x));
          return v;
        }
      },
      n.data());
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {}", p.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int run_prepare_instruction_tuning_data(const std::vector<std::string>& args) {
  std::string config_file;
  core::PluginOptions popts;
  po::options_description desc("prepare_instruction_tuning_data options");
  desc.add_options()("help,h", "this help")("config_file_path", po::value(&config_file)->required(),
                                            "instruction-tuning config (also the first positional argument)");
  desc.add(plugin_options(popts));
  po::positional_options_description pos;
  pos.add("config_file_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities data prepare_instruction_tuning_data --config_file_path F\n\n"
             "Applies the config's jinja2_chat_template to every entry of settings.src_path (result under \"chat\"),\n"
             "splits the entries by settings.split_config and writes, into <dst dir>/<src stem>_<config hash>/, one\n"
             "JSONL per split, its .idx and its .pbin (packed with settings.pbin_creation_config_file_path), and a\n"
             "copy of the config. Output identical to Modalities' for the same inputs.",
             status))
    return status;
  try {
    core::Registry registry;
    const ConfigNode root = core::load_resolved(config_file, registry, core::env_for_config(config_file));
    const ConfigNode& settings = need(root, "settings", "");
    const fs::path src = need_string(settings, "src_path", "settings");
    const fs::path dst_given = need_string(settings, "dst_path", "settings");
    const std::string messages_key = need_string(settings, "messages_key", "settings");
    if (!fs::is_regular_file(src)) throw Error(fmt::format("settings.src_path: {} does not exist", src.string()));
    const ConfigNode* split = settings.find("split_config");
    if (split == nullptr || !split->is_table())
      throw Error("settings.split_config: missing ({splitting = {train, val, test}, seed}; Modalities needs it too)");
    const ConfigNode& splitting = need(*split, "splitting", "settings.split_config");
    std::vector<std::string> partitions;
    std::vector<double> weights;
    std::int64_t total = 0;
    for (const char* p : {"train", "val", "test"}) {
      const std::int64_t w = need_int(splitting, p, "settings.split_config.splitting");
      if (w < 0) throw Error(fmt::format("settings.split_config.splitting.{}: must be >= 0, got {}", p, w));
      partitions.emplace_back(p);
      weights.push_back(static_cast<double>(w));
      total += w;
    }
    if (total != 100)
      throw Error(fmt::format("settings.split_config.splitting: train + val + test must be 100, got {}", total));
    const std::int64_t seed = need_int(*split, "seed", "settings.split_config");
    if (seed < 0) throw Error("settings.split_config.seed: must be >= 0");
    std::optional<fs::path> pbin_template;
    if (const ConfigNode* p = settings.find("pbin_creation_config_file_path"); p && p->is_string()) {
      pbin_template = p->as_string();
      if (!fs::is_regular_file(*pbin_template))
        throw Error(fmt::format("settings.pbin_creation_config_file_path: {} does not exist", pbin_template->string()));
    }
    std::map<std::string, std::string> role_mapping;
    for (const auto& [k, v] :
         need(need(root, "instruction_data_transformation", ""), "role_mapping", "instruction_data_transformation")
             .as_table()) {
      if (!v.is_string())
        throw Error(fmt::format("instruction_data_transformation.role_mapping.{}: expected a string", k));
      role_mapping[k] = v.as_string();
    }
    // Modalities removes the newlines YAML's "|" puts between tags: "}\n{" -> "}{".
    std::string source = need_string(root, "jinja2_chat_template", "");
    for (std::size_t at; (at = source.find("}\n{")) != std::string::npos;) source.replace(at, 3, "}{");
    const jinja::Template chat_template(source);
    const jinja::Value chat_template_data = to_value(need(root, "chat_template_data", ""));

    // Output names, as Modalities builds them.
    const std::string hash = core::data::sha256_hex(read_bytes(config_file)).substr(0, 7);
    const fs::path folder = dst_given.parent_path() / fmt::format("{}_{}", py_stem(src.filename().string()), hash);
    fs::create_directories(folder);
    write_file_atomically(
        folder / fmt::format("instruction_chat_template_config.{}{}", hash, fs::path(config_file).extension().string()),
        read_bytes(config_file));
    std::string joined;
    for (const auto& s : py_suffixes(dst_given.filename().string())) joined += (joined.empty() ? "" : ".") + s;
    const std::string suffix = "." + hash + joined;
    const fs::path dst = folder / dst_given.filename();
    struct Out {
      std::string partition;
      fs::path path;
      std::unique_ptr<AtomicFile> file;
      std::size_t count = 0;
    };
    std::vector<Out> outs;
    for (std::size_t i = 0; i < partitions.size(); ++i) {
      if (weights[i] == 0) continue;
      const fs::path p =
          py_with_suffix(dst.parent_path() / (py_stem(dst.filename().string()) + "_" + partitions[i]), suffix);
      for (const Out& o : outs)
        if (o.path == p)
          throw Error(
              fmt::format("settings.dst_path '{}': the {} and {} splits would both be written to {} (Modalities "
                          "names them from the part before the last dot; use a name without dots in its stem)",
                          dst_given.string(), o.partition, partitions[i], p.string()));
      outs.push_back({partitions[i], p, std::make_unique<AtomicFile>(p), 0});
    }
    core::data::CPythonRandom rng(static_cast<std::uint64_t>(seed));
    std::ifstream in(src, std::ios::binary);
    std::string line;
    std::size_t line_no = 0;
    while (std::getline(in, line)) {
      ++line_no;
      const std::size_t choice = rng.choice(weights);
      jinja::Value entry;
      try {
        entry = jinja::json_loads(line);
      } catch (const Error& e) {
        throw Error(fmt::format("{}:{}: {}", src.string(), line_no, e.what()));
      }
      jinja::Value* messages = entry.find(messages_key);
      if (entry.kind != jinja::Value::Kind::kDict || messages == nullptr || messages->kind != jinja::Value::Kind::kList)
        throw Error(fmt::format("{}:{}: no list '{}' (settings.messages_key)", src.string(), line_no, messages_key));
      for (jinja::Value& turn : *messages->list) {
        if (turn.kind != jinja::Value::Kind::kDict) continue;
        for (auto& [k, v] : *turn.dict) {
          if (k != "role" && k != "from") continue;
          const auto it = v.kind == jinja::Value::Kind::kString ? role_mapping.find(v.s) : role_mapping.end();
          if (it == role_mapping.end())
            throw Error(fmt::format("{}:{}: role '{}' is not in instruction_data_transformation.role_mapping",
                                    src.string(), line_no, v.kind == jinja::Value::Kind::kString ? v.s : "?"));
          v = jinja::Value::string(it->second);
        }
      }
      jinja::Dict globals = {{"messages", *messages}, {"chat_template_data", chat_template_data}};
      std::string chat;
      try {
        chat = chat_template.render(globals);
      } catch (const Error& e) {
        throw Error(fmt::format("{}:{}: {}", src.string(), line_no, e.what()));
      }
      entry.set("chat", jinja::Value::string(std::move(chat)));
      Out* out = nullptr;
      for (Out& o : outs)
        if (o.partition == partitions[choice]) out = &o;
      out->file->write(jinja::json_dumps(entry) + "\n");
      ++out->count;
    }
    for (Out& o : outs) o.file->commit();
    std::cout << fmt::format("Chat template applied to {} entries:", line_no);
    for (const Out& o : outs) std::cout << fmt::format(" {} {}", o.partition, o.count);
    std::cout << fmt::format(" -> {}\n", folder.string());
    if (!pbin_template) {
      print_warning("settings.pbin_creation_config_file_path is not set: no .idx/.pbin files were made");
      return kOk;
    }
    // Index and pack each split that got entries, with a copy of the packing config whose src/index/dst
    // name the split (resolved against the template's own folder, then written next to the split).
    std::vector<std::string> plugin_args;
    if (vm.count("plugin-path"))
      for (const auto& p : vm["plugin-path"].as<std::vector<std::string>>())
        plugin_args.insert(plugin_args.end(), {"--plugin-path", p});
    if (popts.strict) plugin_args.emplace_back("--strict-plugins");
    const std::string hash_suffix = py_suffixes(outs.front().path.filename().string()).front();
    for (const Out& o : outs) {
      if (o.count == 0) continue;
      const fs::path idx = py_with_suffix(o.path, ".idx"), pbin = py_with_suffix(o.path, ".pbin");
      if (const int r = run_data({"create_raw_index", o.path.string(), "--index_path", idx.string(),
                                  "--file_existence_policy", "override"});
          r != kOk)
        return r;
      ConfigNode cfg = core::load_resolved(*pbin_template, registry, core::env_for_config(*pbin_template));
      ConfigNode* s = nullptr;
      for (auto& [k, v] : std::get<ConfigNode::Table>(cfg.data()))
        if (k == "settings") s = &v;
      if (s == nullptr || !s->is_table())
        throw Error(fmt::format("{}: no [settings] table (a pack_encoded_data config)", pbin_template->string()));
      for (const auto& [k, value] :
           {std::pair{"src_path", o.path}, std::pair{"index_path", idx}, std::pair{"dst_path", pbin}}) {
        auto& table = std::get<ConfigNode::Table>(s->data());
        const ConfigNode node(fs::absolute(value).string(), s->where());
        bool found = false;
        for (auto& [kk, vv] : table)
          if (kk == k) {
            vv = node;
            found = true;
          }
        if (!found) table.emplace_back(k, node);
      }
      const fs::path pbin_config = o.path.parent_path() / (py_stem("pbin_config_" + o.partition) + hash_suffix +
                                                           fs::path(*pbin_template).extension().string());
      write_file_atomically(pbin_config, core::to_toml(cfg));
      std::vector<std::string> pack = {"pack_encoded_data", pbin_config.string(), "--file_existence_policy",
                                       "override"};
      pack.insert(pack.end(), plugin_args.begin(), plugin_args.end());
      if (const int r = run_data(pack); r != kOk) return r;
    }
    return kOk;
  } catch (const core::ConfigFileError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    print_error(fmt::format("{}: invalid instruction-tuning config", config_file));
    return kFailed;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
}

}  // namespace modalities::cli
