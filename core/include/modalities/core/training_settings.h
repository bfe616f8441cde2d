// The training pipeline's Settings schema and consistency checks (spec §4.1).
#pragma once

#include <modalities/sdk/schema.h>

#include <vector>

namespace modalities::core {

struct BuiltGraph;

/// Parses `settings` against the training Settings schema and runs validators
/// 1-4 (tokens per step, last step logged/evaluated/checkpointed).
void check_training_settings(const Value& settings, ParseContext& ctx);
/// Validator 5 over the built set: train_dataset holds enough tokens.
void check_training_set(const BuiltGraph& built, ParseContext& ctx);
/// The schema, for documentation and `--help`.
std::vector<FieldInfo> training_settings_fields();

}  // namespace modalities::core
