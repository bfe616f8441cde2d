// `modalities config import <file.yaml>`: a Modalities YAML config as our TOML (ours; docs/configs.md,
// "Importing Modalities YAML configs"). Component keys, variant keys, field names, `${...}`
// interpolations and resolvers are the same on both sides, so the conversion is structural: the
// YAML tree becomes a TOML tree in document order. Scalars get the types OmegaConf's loader gives
// them (PyYAML's YAML 1.1 safe resolvers with OmegaConf's float rule), quoted scalars stay
// strings, YAML nulls become "${null:}" (TOML has no null), anchors and aliases are expanded.
#include "cli.h"

#include <modalities/core/config_tree.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <filesystem>
#include <iostream>
#include <regex>

namespace modalities::cli {
namespace {

namespace fs = std::filesystem;
using core::ConfigNode;

// PyYAML's SafeLoader implicit resolvers (YAML 1.1) for plain scalars, with OmegaConf's float
// regex (it also takes "1e-5", which PyYAML alone reads as a string).
const std::regex kNull(R"(^(?:~|null|Null|NULL|)$)");
const std::regex kBool(R"(^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$)");
const std::regex kInt(R"(^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$)");
const std::regex kFloat(
    R"(^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$)");

std::string strip_underscores(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  return s;
}

ConfigNode scalar(const YAML::Node& n, const core::SourceLocation& where) {
  const std::string& s = n.Scalar();
  if (n.Tag() != "?") return ConfigNode(s, where);  // quoted or explicitly tagged: a string
  if (std::regex_match(s, kNull)) return ConfigNode(std::monostate{}, where);
  if (std::regex_match(s, kBool)) {
    const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
    return ConfigNode(c == 'y' || c == 't' || (c == 'o' && (s[1] == 'n' || s[1] == 'N')), where);
  }
  if (std::regex_match(s, kInt)) {
    std::string t = strip_underscores(s);
    bool negative = false;
    if (t[0] == '+' || t[0] == '-') {
      negative = t[0] == '-';
      t.erase(0, 1);
    }
    int base = 10;
    if (t.size() > 1 && t[0] == '0' && (t[1] == 'x' || t[1] == 'b')) {
      base = t[1] == 'x' ? 16 : 2;
      t.erase(0, 2);
    } else if (t.size() > 1 && t[0] == '0') {
      base = 8;
    }
    try {
      const std::int64_t v = std::stoll(t, nullptr, base);
      return ConfigNode(negative ? -v : v, where);
    } catch (const std::out_of_range&) {
      throw Error(fmt::format("{}: the integer {} does not fit 64 bits", where.str(), s));
    }
  }
  if (std::regex_match(s, kFloat)) {
    std::string t = strip_underscores(s);
    if (t.find("inf") != std::string::npos || t.find("Inf") != std::string::npos || t.find("INF") != std::string::npos)
      return ConfigNode(t[0] == '-' ? -HUGE_VAL : HUGE_VAL, where);
    if (t.find_first_of("nN") != std::string::npos) return ConfigNode(std::nan(""), where);
    return ConfigNode(std::stod(t[0] == '.' ? "0" + t : t), where);
  }
  return ConfigNode(s, where);
}

ConfigNode convert(const YAML::Node& n, const std::shared_ptr<const std::string>& file_ptr) {
  const std::string& file = *file_ptr;
  const core::SourceLocation where{file_ptr, static_cast<std::uint32_t>(n.Mark().line + 1),
                                   static_cast<std::uint32_t>(n.Mark().column + 1)};
  switch (n.Type()) {
    case YAML::NodeType::Null: return ConfigNode(std::monostate{}, where);
    case YAML::NodeType::Scalar: return scalar(n, where);
    case YAML::NodeType::Sequence: {
      ConfigNode::Array a;
      for (const auto& item : n) a.push_back(convert(item, file_ptr));
      return ConfigNode(std::move(a), where);
    }
    case YAML::NodeType::Map: {
      ConfigNode::Table t;
      for (const auto& kv : n) {
        if (!kv.first.IsScalar())
          throw Error(fmt::format("{}:{}: a mapping key that is not a scalar cannot become a TOML key", file,
                                  kv.first.Mark().line + 1));
        const std::string key = kv.first.Scalar();
        if (key == "<<")
          throw Error(fmt::format("{}:{}: YAML merge keys (<<) are not supported; write the entries out", file,
                                  kv.first.Mark().line + 1));
        for (const auto& [k, v] : t)
          if (k == key) throw Error(fmt::format("{}:{}: duplicate key '{}'", file, kv.first.Mark().line + 1, key));
        t.emplace_back(key, convert(kv.second, file_ptr));
      }
      return ConfigNode(std::move(t), where);
    }
    default: throw Error(fmt::format("{}:{}: undefined YAML node", file, n.Mark().line + 1));
  }
}

}  // namespace

int run_config_import(const std::vector<std::string>& args) {
  std::string input, output;
  bool overwrite = false;
  po::options_description desc("config import options");
  desc.add_options()("help,h", "this help")("config_file_path", po::value(&input)->required(),
                                            "the Modalities YAML config (also the first positional argument)")(
      "output,o", po::value(&output), "TOML file to write (default: standard output)")(
      "overwrite", po::bool_switch(&overwrite), "replace an existing output file");
  po::positional_options_description pos;
  pos.add("config_file_path", 1);
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, pos, vm,
             "usage: modalities config import <file.yaml> [-o file.toml]\n\n"
             "Converts a Modalities YAML config into the equivalent TOML config: same components, keys and\n"
             "${...} interpolations; YAML scalars typed as OmegaConf types them; nulls become \"${null:}\".",
             status))
    return status;
  try {
    YAML::Node doc;
    try {
      doc = YAML::LoadFile(input);
    } catch (const YAML::BadFile&) {
      throw Error(fmt::format("{}: cannot read the file", input));
    } catch (const YAML::Exception& e) {
      throw Error(fmt::format("{}:{}:{}: {}", input, e.mark.line + 1, e.mark.column + 1, e.msg));
    }
    if (!doc.IsMap()) throw Error(fmt::format("{}: the document is not a mapping (a config is a mapping of top-level keys)", input));
    const ConfigNode root = convert(doc, std::make_shared<const std::string>(input));
    const std::string text =
        fmt::format("# Converted from {} by `modalities config import`.\n\n", fs::path(input).filename().string()) +
        core::to_toml(root, /*escape_interpolations=*/false);
    core::load_toml_string(text, "converted");  // what we write must load back
    if (output.empty()) {
      std::cout << text;
      return kOk;
    }
    if (fs::exists(output) && !overwrite)
      throw Error(fmt::format("{} exists; pass --overwrite to replace it", output));
    write_file_atomically(output, text);
    std::cerr << fmt::format("wrote {}\n", output);
    return kOk;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
}

}  // namespace modalities::cli
