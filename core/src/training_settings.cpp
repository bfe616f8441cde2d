// The Settings schema of the training pipeline (docs/training.md) and its
// consistency validators. Settings ignore unknown keys (as in Modalities);
// each validator raises an error when its `enforce_*` flag is true and a
// warning otherwise. Unlike Modalities, a run with no steps left (target
// steps = seen steps) is reported instead of dividing by zero.
#include <modalities/core/graph.h>
#include <modalities/core/training_settings.h>
#include <modalities/sdk/interfaces/dataset.h>

#include <fmt/core.h>

namespace modalities::core {

void check_training_settings(const Value& settings, ParseContext& ctx) {
  TrainingSettings s;
  Schema<TrainingSettings>::instance().parse(settings, s, "", ctx);
}

TrainingSettings parse_training_settings(const Value& settings) {
  std::vector<FieldError> errors;
  ParseContext ctx(false, &errors);
  TrainingSettings s;
  if (Schema<TrainingSettings>::instance().parse(settings, s, "", ctx) != Parsed::kOk || !errors.empty()) {
    std::string message = "invalid settings:";
    for (const auto& e : errors) message += fmt::format("\n  settings.{}: {}", e.path, e.message);
    throw Error(message);
  }
  return s;
}

void check_training_set(const BuiltGraph& built, ParseContext& ctx) {
  // Validator 5: enough tokens in the training dataset.
  const Value* settings = built.get("settings");
  const Value* dataset = built.get("train_dataset");
  if (settings == nullptr || dataset == nullptr || !dataset->is_object() ||
      dataset->as_object().interface != Dataset::kInterface)
    return;
  std::vector<FieldError> ignored;
  ParseContext quiet(false, &ignored);
  TrainingSettings s;
  if (Schema<TrainingSettings>::instance().parse(*settings, s, "", quiet) != Parsed::kOk) return;
  const auto& ds = *std::static_pointer_cast<Dataset>(dataset->as_object().ptr);
  const i64 available = ds.size() * s.step_profile.sequence_length;
  if (available < s.training_target.num_target_tokens) {
    const std::string message =
        fmt::format("train_dataset has {} samples x {} tokens = {} tokens, fewer than num_target_tokens ({})",
                    ds.size(), s.step_profile.sequence_length, available, s.training_target.num_target_tokens);
    if (s.consistency_enforcement.enforce_enough_tokens_in_dataset)
      ctx.fail("settings.training_target.num_target_tokens", message);
    else ctx.warn("settings.training_target.num_target_tokens", message + " (not enforced)");
  }
}

std::vector<FieldInfo> training_settings_fields() { return Schema<TrainingSettings>::instance().fields(); }

}  // namespace modalities::core
