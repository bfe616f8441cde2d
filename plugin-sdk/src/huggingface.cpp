// Hugging Face checkpoint folders (modalities/sdk/huggingface.h).
#include <modalities/sdk/huggingface.h>

#include <modalities/sdk/atomic_file.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/formats/safetensors.h>

#include <ATen/core/Tensor.h>
#include <fmt/format.h>
#include <simdjson.h>

#include <unistd.h>
#include <cctype>
#include <cstdint>
#include <fstream>
#include <random>
#include <set>
#include <system_error>

namespace modalities {

HuggingFaceExportable::~HuggingFaceExportable() = default;

namespace formats {
namespace fs = std::filesystem;

namespace {

void write_text(const fs::path& path, const std::string& text) {
  AtomicFile out(path);
  out.write(text);
  out.commit();
}

std::uint64_t tensor_bytes(const at::Tensor& t) {
  return static_cast<std::uint64_t>(t.numel()) * static_cast<std::uint64_t>(t.element_size());
}

}  // namespace

std::uint64_t parse_byte_size(const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  static const std::map<std::string, std::uint64_t> units = {
      {"", 1},       {"B", 1},          {"KB", 1000},     {"MB", 1000'000}, {"GB", 1000'000'000},
      {"KiB", 1024}, {"MiB", 1u << 20}, {"GiB", 1u << 30}};
  const auto u = units.find(unit);
  if (digits == 0 || digits > 15 || u == units.end())
    throw Error(
        fmt::format("'{}' is not a size: expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, "
                    "GiB), e.g. 5GB",
                    text));
  const std::uint64_t count = std::stoull(text.substr(0, digits));
  if (count > UINT64_MAX / u->second) throw Error(fmt::format("'{}' is too large", text));
  const std::uint64_t n = count * u->second;
  if (n == 0) throw Error(fmt::format("'{}': the size must be positive", text));
  return n;
}

void write_huggingface_folder(const fs::path& dir_given, const HuggingFaceCheckpoint& checkpoint,
                              std::uint64_t max_shard_bytes, const std::vector<fs::path>& extra_files) {
  std::error_code ec;
  fs::path dir = dir_given.lexically_normal();  // "out/hf/" names the folder "hf"
  if (dir.filename().empty()) dir = dir.parent_path();
  if (dir.empty() || dir.filename() == "." || dir.filename() == "..")
    throw Error(fmt::format("'{}' is not a folder name to write a checkpoint into", dir_given.string()));
  if (fs::exists(dir, ec) && !(fs::is_directory(dir, ec) && fs::is_empty(dir, ec)))
    throw Error(fmt::format("{} exists and is not an empty directory; choose a new output folder (nothing was written)",
                            dir.string()));
  if (checkpoint.tensors.empty()) throw Error("no tensors to write");
  const fs::path parent = dir.parent_path().empty() ? fs::path(".") : dir.parent_path();
  fs::create_directories(parent);
  std::random_device rd;
  const fs::path tmp = parent / fmt::format(".{}.tmp-{}-{:x}", dir.filename().string(), ::getpid(), rd() & 0xffffff);
  fs::create_directory(tmp);
  try {
    write_text(tmp / "config.json", checkpoint.config_json);
    if (!checkpoint.generation_config_json.empty())
      write_text(tmp / "generation_config.json", checkpoint.generation_config_json);
    // Shards in name order, a new one when the next tensor would pass the limit (a tensor larger
    // than the limit gets a shard of its own, as in transformers).
    std::vector<StateDict> shards(1);
    std::uint64_t in_shard = 0, total = 0;
    for (const auto& [name, t] : checkpoint.tensors) {
      const std::uint64_t n = tensor_bytes(t);
      if (!shards.back().empty() && in_shard + n > max_shard_bytes) {
        shards.emplace_back();
        in_shard = 0;
      }
      shards.back().emplace(name, t);
      in_shard += n;
      total += n;
    }
    const std::map<std::string, std::string> metadata = {{"format", "pt"}};
    if (shards.size() == 1) {
      write_safetensors(tmp / "model.safetensors", shards.front(), metadata);
    } else {
      std::string index =
          fmt::format("{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{", total);
      std::map<std::string, std::string> where;
      for (std::size_t i = 0; i < shards.size(); ++i) {
        const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
        write_safetensors(tmp / file, shards[i], metadata);
        for (const auto& [name, t] : shards[i]) where[name] = file;
      }
      bool first = true;
      for (const auto& [name, file] : where) {
        index += fmt::format("{}\n    {}: {}", first ? "" : ",", json_quote(name), json_quote(file));
        first = false;
      }
      index += "\n  }\n}\n";
      write_text(tmp / "model.safetensors.index.json", index);
    }
    for (const fs::path& f : extra_files) {
      if (!fs::is_regular_file(f)) throw Error(fmt::format("cannot copy {}: no such file", f.string()));
      fs::copy_file(f, tmp / f.filename(), fs::copy_options::overwrite_existing);
    }
    if (fs::exists(dir, ec)) fs::remove(dir);  // the empty directory checked above
    fs::rename(tmp, dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

StateDict read_huggingface_weights(const fs::path& dir) {
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::is_regular_file(single)) return read_safetensors(single);
  if (!fs::is_regular_file(index)) {
    const bool pickle = fs::exists(dir / "pytorch_model.bin") || fs::exists(dir / "pytorch_model.bin.index.json");
    throw Error(fmt::format(
        "{}: no model.safetensors or model.safetensors.index.json{}", dir.string(),
        pickle ? " (pytorch_model.bin is not read: pickle files can run code; convert it to safetensors with "
                 "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                 "safe_serialization=True))"
               : ""));
  }
  const auto bad = [&](const std::string& what) { return Error(fmt::format("{}: {}", index.string(), what)); };
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (parser.load(index.string()).get(root)) throw bad("not valid JSON");
  simdjson::dom::object map;
  if (root["weight_map"].get_object().get(map)) throw bad("has no \"weight_map\" object");
  std::map<std::string, std::set<std::string>> by_file;
  for (auto field : map) {
    std::string_view file;
    if (field.value.get_string().get(file)) throw bad(fmt::format("weight_map[\"{}\"] is not a string", field.key));
    if (file.find('/') != std::string_view::npos || file.find("..") != std::string_view::npos)
      throw bad(fmt::format("weight_map[\"{}\"] = \"{}\" is not a file name in the folder", field.key, file));
    by_file[std::string(file)].insert(std::string(field.key));
  }
  if (by_file.empty()) throw bad("weight_map is empty");
  StateDict out;
  for (const auto& [file, names] : by_file) {
    const fs::path path = dir / file;
    if (!fs::is_regular_file(path)) throw bad(fmt::format("lists {}, which does not exist", file));
    // A reference, not the structured binding itself: clang before 16 cannot capture bindings.
    const auto& wanted = names;
    StateDict part = read_safetensors(path, [&wanted](const std::string& name) { return wanted.count(name) > 0; });
    for (const std::string& name : names)
      if (!part.count(name)) throw bad(fmt::format("says {} holds '{}', but it does not", file, name));
    out.merge(part);
  }
  return out;
}

}  // namespace formats
}  // namespace modalities
