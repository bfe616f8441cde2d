// The built-in resolvers (docs/configs.md, "Resolvers"), `${null:}` included.
#include <modalities/core/interpolation.h>

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <thread>

namespace modalities::core {

void ResolverTable::add(ResolverSpec spec) {
  std::string name = spec.name;
  resolvers_.insert_or_assign(std::move(name), std::move(spec));
}

const ResolverSpec* ResolverTable::find(std::string_view name) const {
  auto it = resolvers_.find(name);
  return it == resolvers_.end() ? nullptr : &it->second;
}

std::vector<std::string> ResolverTable::names() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : resolvers_) out.push_back(k);
  return out;
}

namespace {

Value cuda_env(std::string_view name) {
  const std::string var(name);
  const char* raw = std::getenv(var.c_str());
  // The three launcher variables are integers and must be set, as in Modalities.
  if (var == "LOCAL_RANK" || var == "RANK" || var == "WORLD_SIZE") {
    if (raw == nullptr)
      throw Error(
          fmt::format("environment variable {} is not set (launch with torchrun, srun or "
                      "`modalities launch`, or export it)",
                      var));
    std::int64_t v = 0;
    const std::string_view s(raw);
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || p != s.data() + s.size() || v < 0)
      throw Error(fmt::format("environment variable {}='{}' is not a non-negative integer", var, s));
    return Value(v);
  }
  if (raw == nullptr) return Value();
  return Value(std::string(raw));
}

}  // namespace

ResolverTable builtin_resolvers(const ModalitiesEnv& env) {
  ResolverTable t;
  t.add({"cuda_env",
         "Environment variable: LOCAL_RANK, RANK and WORLD_SIZE as integers (must be set); any other name as a "
         "string, or null when unset.",
         cuda_env});
  t.add({"modalities_env",
         "Run information supplied by the command: config_file_path, config_folder_path, experiments_root_path, "
         "experiment_id (which ones exist depends on the command).",
         [values = env.values](std::string_view name) -> Value {
           auto it = values.find(std::string(name));
           if (it == values.end()) {
             std::string known;
             for (const auto& [k, v] : values) known += (known.empty() ? "" : ", ") + k;
             throw Error(fmt::format("unknown modalities_env variable '{}' for this command (available: {})", name,
                                     known.empty() ? "none" : known));
           }
           return Value(it->second);
         }});
  t.add({"node_env", "Facts about this machine: num_cpus (number of CPUs). Other names yield null.",
         [](std::string_view name) -> Value {
           if (name == "num_cpus")
             return Value(static_cast<std::int64_t>(std::max(1u, std::thread::hardware_concurrency())));
           return Value();
         }});
  t.add({"null", "An explicit null: `key = \"${null:}\"` (TOML has no null literal). Takes no argument.",
         [](std::string_view arg) -> Value {
           if (!arg.empty()) throw Error(fmt::format("${{null:}} takes no argument, got '{}'", arg));
           return Value();
         }});
  return t;
}

}  // namespace modalities::core
