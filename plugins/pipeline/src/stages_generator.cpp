// stages_generator/gpt2_stages_generator (README.md): which modules of a GPT-2 each pipeline
// stage holds. Split points, in model order, each with a compute weight in "blocks": the
// embeddings (transformer.wte, .wpe, .drop; input_layer_equivalence), every block
// transformer.h.<i> (1), the head (transformer.lm_head_norm, .lm_head; output_layer_equivalence).
// num_stages = ceil(total weight / num_layers_per_stage) must be a multiple of the pipeline
// degree; the split points are cut into exactly num_stages contiguous stages whose heaviest is as
// light as possible (Note [Packing stages]).
#include "pipeline.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/stages_generator.h>
#include <modalities/sdk/plugin.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace modalities::plugins::pipeline {
namespace {

using i64 = std::int64_t;

struct SplitPoint {
  std::vector<std::string> fqns;
  i64 weight = 1;
};

// Note [Packing stages]
// Modalities 0.5 packed split points greedily against a capacity of ceil(total / num_stages)
// with a loop of exactly num_stages iterations, so a packing that did not fit silently dropped
// what was left (the head, with uneven weights) and a single split point heavier than the
// capacity was an error; later Modalities versions repair it. Here: the smallest capacity whose
// left-to-right greedy packing needs at most num_stages stages is found by bisection (it
// minimizes the heaviest stage among contiguous packings), and while there are fewer stages than
// asked for, the heaviest stage of several split points is cut where its heavier half is
// lightest. Every split point lands in exactly one stage. For GPT-2's unit weights this gives
// Modalities' stages whenever Modalities' packing fits.
// The first split point of each stage when split points are packed left to right into stages
// of at most `capacity`.
std::vector<std::size_t> greedy(const std::vector<i64>& weights, i64 capacity) {
  std::vector<std::size_t> starts;
  i64 load = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    if (starts.empty() || load + weights[i] > capacity) {
      starts.push_back(i);
      load = 0;
    }
    load += weights[i];
  }
  return starts;
}

// The first split point of each of exactly `num_stages` stages (Note [Packing stages]).
std::vector<std::size_t> pack(const std::vector<i64>& weights, std::size_t num_stages) {
  std::vector<i64> prefix(weights.size() + 1, 0);  // prefix[i]: weight of split points [0, i)
  for (std::size_t i = 0; i < weights.size(); ++i) prefix[i + 1] = prefix[i] + weights[i];
  i64 lo = *std::max_element(weights.begin(), weights.end()), hi = prefix.back();
  while (lo < hi) {  // the smallest capacity that fits into num_stages
    const i64 mid = lo + (hi - lo) / 2;
    if (greedy(weights, mid).size() <= num_stages) hi = mid;
    else lo = mid + 1;
  }
  std::vector<std::size_t> starts = greedy(weights, lo);
  while (starts.size() < num_stages) {
    const auto end_of = [&](std::size_t s) { return s + 1 < starts.size() ? starts[s + 1] : weights.size(); };
    std::size_t heaviest = starts.size();  // the heaviest stage of several split points
    for (std::size_t s = 0; s < starts.size(); ++s)
      if (end_of(s) - starts[s] > 1 &&
          (heaviest == starts.size() ||
           prefix[end_of(s)] - prefix[starts[s]] > prefix[end_of(heaviest)] - prefix[starts[heaviest]]))
        heaviest = s;
    const std::size_t begin = starts[heaviest], end = end_of(heaviest);
    std::size_t cut = begin + 1;  // where the heavier half is lightest (the first such cut)
    for (std::size_t k = begin + 1; k < end; ++k)
      if (std::max(prefix[k] - prefix[begin], prefix[end] - prefix[k]) <
          std::max(prefix[cut] - prefix[begin], prefix[end] - prefix[cut]))
        cut = k;
    starts.insert(starts.begin() + static_cast<std::ptrdiff_t>(heaviest) + 1, cut);
  }
  return starts;
}

struct Gpt2StagesConfig {
  i64 num_model_layers = 0;
  i64 input_layer_equivalence = 1;
  i64 output_layer_equivalence = 1;
  static void describe(Schema<Gpt2StagesConfig>& s) {
    using C = Gpt2StagesConfig;
    s.field("num_model_layers", &C::num_model_layers, "Transformer blocks of the model (n_layer).")
        .required()
        .at_least(1);
    s.field("input_layer_equivalence", &C::input_layer_equivalence, "Compute weight of the embeddings, in blocks.")
        .at_least(1);
    s.field("output_layer_equivalence", &C::output_layer_equivalence,
            "Compute weight of the final norm and LM head, in blocks.")
        .at_least(1);
  }
};

class Gpt2StagesGenerator final : public StagesGenerator {
 public:
  explicit Gpt2StagesGenerator(const Gpt2StagesConfig& c) : c_(c) {}

  std::vector<std::vector<std::string>> stages(i64 num_layers_per_stage, i64 pp_degree) const override {
    if (num_layers_per_stage < 1)
      throw Error(
          fmt::format("gpt2_stages_generator: num_layers_per_stage must be >= 1, got {}", num_layers_per_stage));
    if (pp_degree < 1)
      throw Error(fmt::format("gpt2_stages_generator: the pipeline degree must be >= 1, got {}", pp_degree));
    std::vector<SplitPoint> points;
    points.push_back({{"transformer.wte", "transformer.wpe", "transformer.drop"}, c_.input_layer_equivalence});
    for (i64 i = 0; i < c_.num_model_layers; ++i) points.push_back({{fmt::format("transformer.h.{}", i)}, 1});
    points.push_back({{"transformer.lm_head_norm", "transformer.lm_head"}, c_.output_layer_equivalence});
    const i64 total = c_.num_model_layers + c_.input_layer_equivalence + c_.output_layer_equivalence;
    const i64 num_stages = (total + num_layers_per_stage - 1) / num_layers_per_stage;
    if (num_stages % pp_degree != 0)
      throw Error(
          fmt::format("gpt2_stages_generator: {} stages (ceil(({} blocks + {} + {}) / {} per stage)) cannot be "
                      "spread evenly over a pipeline degree of {}; change num_layers_per_stage",
                      num_stages, c_.num_model_layers, c_.input_layer_equivalence, c_.output_layer_equivalence,
                      num_layers_per_stage, pp_degree));
    if (num_stages > static_cast<i64>(points.size()))
      throw Error(
          fmt::format("gpt2_stages_generator: {} stages need at least as many split points, the model has {} "
                      "(embeddings, {} blocks, head); use more layers per stage",
                      num_stages, points.size(), c_.num_model_layers));
    std::vector<i64> weights;
    for (const SplitPoint& p : points) weights.push_back(p.weight);
    std::vector<std::vector<std::string>> out;
    const std::vector<std::size_t> starts = pack(weights, static_cast<std::size_t>(num_stages));
    for (std::size_t i = 0; i < points.size(); ++i) {
      if (out.size() < starts.size() && i == starts[out.size()]) out.emplace_back();
      out.back().insert(out.back().end(), points[i].fqns.begin(), points[i].fqns.end());
    }
    return out;
  }

 private:
  Gpt2StagesConfig c_;
};

}  // namespace

void register_stages_generator(Registrar& r) {
  r.add<StagesGenerator, Gpt2StagesConfig>(
      "gpt2_stages_generator",
      "Module FQNs of each pipeline stage of a GPT-2, balanced by compute weight (embeddings and head count as "
      "input/output_layer_equivalence blocks).",
      [](const Gpt2StagesConfig& c) { return std::make_shared<Gpt2StagesGenerator>(c); });
}

void register_components(Registrar& r) {
  register_stages_generator(r);
  register_pipeline(r);
}

}  // namespace modalities::plugins::pipeline

MODALITIES_PLUGIN(pipeline, MODALITIES_PLUGIN_VERSION, modalities::plugins::pipeline::register_components)
