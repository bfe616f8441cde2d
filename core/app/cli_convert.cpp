// `modalities convert_pytorch_to_hf_checkpoint`: Modalities' verb and flags. Builds the config's
// `checkpointed_model` (or `model`) in one process, asks it for its transformers form
// (HuggingFaceExportable, modalities/sdk/huggingface.h) and writes a Hugging Face folder that
// transformers' from_pretrained loads without Modalities: config.json of a standard architecture,
// safetensors weights (sharded above --max_shard_size), generation_config.json and the
// tokenizer's files. Modalities itself writes a pickle of its own model class wrapped in a
// custom HF adapter that needs Modalities to load; docs/huggingface.md says why we differ.
#include "cli.h"
#include "prelude.h"

#include <modalities/core/graph.h>
#include <modalities/sdk/error.h>
#include <modalities/sdk/huggingface.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/tokenizer.h>

#include <fmt/format.h>
#include <simdjson.h>

#include <filesystem>
#include <iostream>
#include <optional>

namespace modalities::cli {
namespace {

namespace fs = std::filesystem;

// Files of a Hugging Face tokenizer folder that AutoTokenizer reads.
constexpr const char* kTokenizerFiles[] = {
    "tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt",         "added_tokens.json",     "tokenizer.model",         "vocab.txt",
    "chat_template.jinja"};

// Special-token ids from tokenizer_config.json (bos_token, eos_token, pad_token as strings or
// {"content": ...}) looked up in tokenizer.json's added_tokens.
struct SpecialIds {
  std::optional<std::int64_t> bos, eos, pad;
};

SpecialIds special_ids(const fs::path& folder) {
  SpecialIds ids;
  simdjson::dom::parser cfg_parser, tok_parser;
  simdjson::dom::element cfg, tok;
  if (cfg_parser.load((folder / "tokenizer_config.json").string()).get(cfg)) return ids;
  if (tok_parser.load((folder / "tokenizer.json").string()).get(tok)) return ids;
  simdjson::dom::array added;
  if (tok["added_tokens"].get_array().get(added)) return ids;
  const auto lookup = [&](const char* key) -> std::optional<std::int64_t> {
    simdjson::dom::element e;
    if (cfg[key].get(e) || e.is_null()) return std::nullopt;
    std::string_view content;
    if (e.get_string().get(content) && e["content"].get_string().get(content)) return std::nullopt;
    for (auto entry : added) {
      std::string_view c;
      std::int64_t id = 0;
      if (!entry["content"].get_string().get(c) && c == content && !entry["id"].get_int64().get(id)) return id;
    }
    std::int64_t id = 0;  // an ordinary vocabulary entry
    if (!tok["model"]["vocab"][content].get_int64().get(id)) return id;
    print_warning(fmt::format("{}: {} '{}' is not a token of tokenizer.json; config.json gets no {}_id",
                              (folder / "tokenizer_config.json").string(), key, content,
                              std::string_view(key).substr(0, std::string_view(key).size() - 6)));
    return std::nullopt;
  };
  ids.bos = lookup("bos_token");
  ids.eos = lookup("eos_token");
  ids.pad = lookup("pad_token");
  return ids;
}

std::optional<c10::ScalarType> parse_dtype(const std::string& s) {
  if (s.empty() || s == "as_stored") return std::nullopt;
  if (s == "float32") return c10::kFloat;
  if (s == "bfloat16") return c10::kBFloat16;
  if (s == "float16") return c10::kHalf;
  throw Error(fmt::format("--dtype {}: expected float32, bfloat16, float16 or as_stored", s));
}

}  // namespace

int run_convert_to_hf(const std::vector<std::string>& args) {
  std::string config_file_path, output_dir, prediction_key, dtype = "as_stored", max_shard_size = "5GB", tokenizer_path;
  core::PluginOptions popts;
  po::options_description desc("Conversion options");
  desc.add_options()("help,h", "this help")(
      "config_file_path", po::value(&config_file_path)->required(),
      "config with a top-level checkpointed_model (e.g. model/fsdp1_checkpointed loading a checkpoint into "
      "model_raw), or a top-level model")("output_hf_checkpoint_dir", po::value(&output_dir)->required(),
                                          "the Hugging Face folder to write (must not exist, or be empty)")(
      "prediction_key", po::value(&prediction_key),
      "Modalities' flag: the model output to export; must be the model's prediction_key (logits)")(
      "dtype", po::value(&dtype)->default_value("as_stored"),
      "weights' dtype in the export: as_stored (the parameters' dtype, float32 for trained checkpoints), "
      "float32, bfloat16 or float16")(
      "max_shard_size", po::value(&max_shard_size)->default_value("5GB"),
      "larger weights are split into model-0000i-of-0000n.safetensors shards with an index (as transformers)")(
      "tokenizer_path", po::value(&tokenizer_path),
      "Hugging Face tokenizer folder to copy into the export (default: the folder of the config's tokenizer)");
  desc.add(plugin_options(popts));
  po::variables_map vm;
  int status = kOk;
  if (!parse(args, desc, {}, vm,
             "usage: modalities convert_pytorch_to_hf_checkpoint --config_file_path F --output_hf_checkpoint_dir D\n\n"
             "Writes the config's checkpointed_model as a Hugging Face transformers folder: config.json of a standard\n"
             "architecture (LlamaForCausalLM for RoPE/SwiGLU/RMSNorm models, MistralForCausalLM with a sliding\n"
             "window, Qwen2ForCausalLM with biases on q/k/v only, GPT2LMHeadModel for learned positions/GELU/\n"
             "LayerNorm), safetensors weights, generation_config.json and the tokenizer's files. Load it with\n"
             "AutoModelForCausalLM.from_pretrained(D); no Modalities code is needed.",
             status))
    return status;
  try {
    const std::optional<c10::ScalarType> export_dtype = parse_dtype(dtype);
    const std::uint64_t shard_bytes = formats::parse_byte_size(max_shard_size);
    VerbPrelude prelude;  // Note [Verb prelude]
    if (const auto stop = prelude.start(popts)) return *stop;
    const core::Registry& registry = prelude.registry();
    const core::ConfigNode root = prelude.config(config_file_path);
    const char* key = root.has("checkpointed_model") ? "checkpointed_model" : "model";
    if (!root.has(key))
      throw Error(fmt::format("{}: no top-level checkpointed_model or model to convert", config_file_path));
    const core::PipelineProfile profile{
        "hf_conversion",
        "`modalities convert_pytorch_to_hf_checkpoint`",
        {{key, "Module", true, "the model with the weights to export"},
         {"tokenizer", "Tokenizer", false, "its Hugging Face folder's files are copied into the export"}}};
    core::ComponentGraph graph(registry, root, &profile);
    const core::BuiltGraph built =
        graph.build([](const std::string&) {}, [](const std::string& line) { std::cerr << line << "\n"; });
    const Value* v = built.get(key);
    if (v == nullptr || !v->is_object() || v->as_object().interface != Module::kInterface)
      throw Error(fmt::format("{} must produce a Module", key));
    auto model = std::static_pointer_cast<Module>(v->as_object().ptr);
    if (!prediction_key.empty() && prediction_key != model->prediction_key())
      throw Error(fmt::format("--prediction_key {}: the model's prediction_key is '{}' (the logits)", prediction_key,
                              model->prediction_key()));
    const auto* exportable = dynamic_cast<const HuggingFaceExportable*>(model.get());
    if (exportable == nullptr)
      throw Error(
          fmt::format("{} is not a model with a Hugging Face form (model/gpt2 and "
                      "model/huggingface_pretrained_model are; wrappers such as fsdp2_wrapped or gpt2_tp are "
                      "not: convert from a config that loads the checkpoint into the plain model)",
                      key));
    HuggingFaceExportOptions options;
    options.dtype = export_dtype;
    std::vector<fs::path> extra;
    // The tokenizer's own files, when it has a Hugging Face form (Tokenizer::huggingface_folder).
    std::optional<fs::path> tok;
    if (!tokenizer_path.empty()) {
      tok = fs::path(tokenizer_path);
    } else if (const Value* t = built.get("tokenizer"); t != nullptr && t->is_object()) {
      if (t->as_object().interface == Tokenizer::kInterface)
        tok = std::static_pointer_cast<Tokenizer>(t->as_object().ptr)->huggingface_folder();
      if (!tok)
        print_warning(
            "the config's tokenizer has no Hugging Face folder, so its files are not copied into the "
            "export (give them with --tokenizer_path)");
    }
    if (tok) {
      if (!fs::is_directory(*tok)) throw Error(fmt::format("tokenizer folder {} does not exist", tok->string()));
      for (const char* f : kTokenizerFiles)
        if (fs::is_regular_file(*tok / f)) extra.push_back(*tok / f);
      const SpecialIds ids = special_ids(*tok);
      options.bos_token_id = ids.bos;
      options.eos_token_id = ids.eos;
      options.pad_token_id = ids.pad;
    } else {
      print_warning(
          "no tokenizer files are written (the config's tokenizer has no Hugging Face folder, or there "
          "is none; give --tokenizer_path to add them)");
    }
    const HuggingFaceCheckpoint checkpoint = exportable->to_huggingface(options);
    formats::write_huggingface_folder(output_dir, checkpoint, shard_bytes, extra);
    std::int64_t numel = 0;
    for (const auto& [name, t] : checkpoint.tensors) numel += t.numel();
    std::cout << fmt::format("Wrote {} ({}, {} tensors, {:.2f} M parameters{}) to {}\n", checkpoint.architecture,
                             dtype == "as_stored" ? "dtype as stored" : dtype, checkpoint.tensors.size(),
                             static_cast<double>(numel) / 1e6, extra.empty() ? "" : ", tokenizer files", output_dir);
    return kOk;
  } catch (const core::ConfigFileError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    print_error(fmt::format("{}: invalid conversion config", config_file_path));
    return kFailed;
  } catch (const std::exception& e) {
    print_error(e.what());
    return kFailed;
  }
}

}  // namespace modalities::cli
