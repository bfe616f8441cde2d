// How a run continues from its last checkpoint (RunResumeSpec, modalities/sdk/registrar.h): the
// same edits a warm-start config makes by hand (configs/quickstart/warmstart.toml), made to the
// run config when `run --resume_from_checkpoint_info` names an existing last_checkpoint_info.json.
//   settings.training_progress  read from the checkpoint folder's name by number_conversion's
//                               *_from_checkpoint_path variants (num_seen_samples from the tokens)
//   app_state                   the run's app_state/raw, wrapped in app_state/dcp, which restores
//                               it from the folder
// The checkpointing plugin owns this because it writes the info file and the folder names.
#include "resume.h"

#include "format.h"

#include <modalities/sdk/error.h>

#include <fmt/format.h>
#include <simdjson.h>

#include <string>
#include <utility>

namespace modalities::plugins::checkpointing {
namespace {

// checkpoint_folder_path of last_checkpoint_info.json.
std::string checkpoint_folder_of(const std::string& info_file) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (auto error = parser.load(info_file).get(doc))
    throw Error(fmt::format("{}: not a readable JSON file ({})", info_file, simdjson::error_message(error)));
  std::string_view folder;
  if (!doc.is_object() || doc["checkpoint_folder_path"].get(folder) != simdjson::SUCCESS || folder.empty())
    throw Error(fmt::format("{}: no \"checkpoint_folder_path\" string in it (expected the {} a run writes)", info_file,
                            kLastCheckpointInfoFile));
  return std::string(folder);
}

Value component(std::string component_key, std::string variant_key, Value::Table config) {
  return Value(Value::Table{{"component_key", Value(std::move(component_key))},
                            {"variant_key", Value(std::move(variant_key))},
                            {"config", Value(std::move(config))}});
}

}  // namespace

ResumedRun resume_run(const std::string& info_file, const Value& app_state) {
  const Value* variant = app_state.is_table() ? app_state.find("variant_key") : nullptr;
  const Value* key = app_state.is_table() ? app_state.find("component_key") : nullptr;
  if (variant == nullptr || key == nullptr || !variant->is_string() || !key->is_string() ||
      key->as_string() != "app_state" || variant->as_string() != "raw")
    throw Error("app_state must be app_state/raw (the run config, not a warm-start config)");
  ResumedRun r;
  r.checkpoint_folder = checkpoint_folder_of(info_file);
  const auto from_path = [&](const char* variant_key) {
    return component("number_conversion", variant_key, {{"checkpoint_path", Value(r.checkpoint_folder)}});
  };
  r.training_progress = Value(Value::Table{
      {"global_num_seen_tokens", from_path("global_num_seen_tokens_from_checkpoint_path")},
      {"num_seen_steps", from_path("num_seen_steps_from_checkpoint_path")},
      {"num_seen_samples",
       component("number_conversion", "num_samples_from_num_tokens",
                 {{"num_tokens", Value(std::string("${settings.training_progress.global_num_seen_tokens}"))},
                  {"sequence_length", Value(std::string("${settings.step_profile.sequence_length}"))}})},
      {"last_step", from_path("last_step_from_checkpoint_path")}});
  r.app_state = component("app_state", "dcp",
                          {{"checkpoint_dir_path", Value(r.checkpoint_folder)}, {"raw_app_state", app_state}});
  return r;
}

}  // namespace modalities::plugins::checkpointing
