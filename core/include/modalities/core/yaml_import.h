// Modalities' YAML configs as TOML (`modalities config import`): see yaml_import.cpp.
#pragma once

#include <string>
#include <string_view>

namespace modalities::core {

/// The tail of the error when the converted TOML does not load back (an importer bug, never the file's fault).
inline constexpr std::string_view kImporterBug = "this is a bug of the importer, please report it with the file";

/// The text of the YAML file `path` with every YAML line break (CR, CRLF, NEL, LS, PS) as "\n".
/// Throws modalities::Error when it cannot be read.
std::string read_yaml_file(const std::string& path);

/// The TOML config equivalent to the YAML config `yaml_text` (from `file`, named in messages):
/// one document, a mapping; scalars typed as OmegaConf's loader types them; aliases expanded
/// (bounded); the result is checked to load back. Throws modalities::Error naming file:line.
std::string yaml_config_to_toml(std::string_view yaml_text, const std::string& file);

}  // namespace modalities::core
