// Example third-party plugin: adds the variant number_conversion/tokens_per_step
// (global tokens per optimizer step) to an existing component key. Built out
// of tree against the installed SDK; see ../CMakeLists.txt and docs/plugins.md.
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>

#include <cstdint>

namespace example {
namespace {

struct TokensPerStepConfig {
  std::int64_t sequence_length = 0;
  std::int64_t local_micro_batch_size = 0;
  std::int64_t gradient_accumulation_steps = 1;
  std::int64_t dp_degree = 1;
  static void describe(modalities::Schema<TokensPerStepConfig>& s) {
    using C = TokensPerStepConfig;
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().positive();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per step.").positive();
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").positive();
  }
};

}  // namespace

void register_components(modalities::Registrar& r) {
  r.add_value<std::int64_t, TokensPerStepConfig>(
      "number_conversion", "tokens_per_step",
      "sequence_length * local_micro_batch_size * gradient_accumulation_steps * dp_degree.",
      [](const TokensPerStepConfig& c) {
        return modalities::tokens_per_step(c.local_micro_batch_size, c.sequence_length, c.gradient_accumulation_steps,
                                           c.dp_degree);
      });
}

}  // namespace example

MODALITIES_PLUGIN(example_tokens_per_step, MODALITIES_PLUGIN_VERSION, example::register_components)
