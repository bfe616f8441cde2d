// `modalities config import <file.yaml>`: a Modalities YAML config as our TOML (the conversion is
// core::yaml_config_to_toml, core/src/yaml_import.cpp; docs/configs.md, "Importing Modalities YAML configs").
#include "cli.h"

#include <modalities/core/yaml_import.h>
#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>

#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace modalities::cli {
namespace {
namespace fs = std::filesystem;
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
    const std::string text = core::yaml_config_to_toml(core::read_yaml_file(input), input);
    if (output.empty()) {
      std::cout << text;
      return kOk;
    }
    if (fs::exists(output) && !overwrite) throw Error(fmt::format("{} exists; pass --overwrite to replace it", output));
    write_file_atomically(output, text);
    std::cerr << fmt::format("wrote {}\n", output);
    return kOk;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
}

}  // namespace modalities::cli
