// stages_generator/gpt2_stages_generator (README.md): which modules of a GPT-2 each pipeline
// stage holds. Split points, in model order, each with a compute weight in "blocks": the
// embeddings (transformer.wte, .wpe, .drop; input_layer_equivalence), every block
// transformer.h.<i> (1), the head (transformer.lm_head_norm, .lm_head; output_layer_equivalence).
// num_stages = ceil(total weight / num_layers_per_stage) must be a multiple of the pipeline
// degree; the split points are cut into exactly num_stages contiguous stages whose heaviest is as
// light as possible (Note [Packing stages]).
#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/stages_generator.h>
#include <modalities/sdk/plugin.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
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
std::vector<std::vector<SplitPoint>> greedy(const std::vector<SplitPoint>& points, i64 capacity) {
  std::vector<std::vector<SplitPoint>> stages;
  i64 load = 0;
  for (const SplitPoint& p : points) {
    if (stages.empty() || load + p.weight > capacity) {
      stages.emplace_back();
      load = 0;
    }
    stages.back().push_back(p);
    load += p.weight;
  }
  return stages;
}

i64 weight_of(const std::vector<SplitPoint>& stage) {
  i64 w = 0;
  for (const SplitPoint& p : stage) w += p.weight;
  return w;
}

std::vector<std::vector<SplitPoint>> pack(const std::vector<SplitPoint>& points, i64 num_stages) {
  i64 lo = 0, hi = 0;
  for (const SplitPoint& p : points) {
    lo = std::max(lo, p.weight);
    hi += p.weight;
  }
  while (lo < hi) {  // the smallest capacity that fits into num_stages
    const i64 mid = lo + (hi - lo) / 2;
    if (static_cast<i64>(greedy(points, mid).size()) <= num_stages) hi = mid;
    else lo = mid + 1;
  }
  std::vector<std::vector<SplitPoint>> stages = greedy(points, lo);
  while (static_cast<i64>(stages.size()) < num_stages) {
    std::size_t heaviest = stages.size();
    for (std::size_t s = 0; s < stages.size(); ++s)
      if (stages[s].size() > 1 && (heaviest == stages.size() || weight_of(stages[s]) > weight_of(stages[heaviest])))
        heaviest = s;
    const std::vector<SplitPoint> stage = stages[heaviest];
    const i64 total = weight_of(stage);
    std::size_t best = 1;
    i64 best_cost = total, prefix = 0;
    for (std::size_t k = 1; k < stage.size(); ++k) {
      prefix += stage[k - 1].weight;
      if (const i64 cost = std::max(prefix, total - prefix); cost < best_cost) {
        best_cost = cost;
        best = k;
      }
    }
    stages[heaviest].assign(stage.begin(), stage.begin() + static_cast<std::ptrdiff_t>(best));
    stages.insert(stages.begin() + static_cast<std::ptrdiff_t>(heaviest) + 1,
                  std::vector<SplitPoint>(stage.begin() + static_cast<std::ptrdiff_t>(best), stage.end()));
  }
  return stages;
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
    s.field("input_layer_equivalence", &C::input_layer_equivalence,
            "Compute weight of the embeddings, in blocks.")
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
      throw Error(fmt::format("gpt2_stages_generator: num_layers_per_stage must be >= 1, got {}", num_layers_per_stage));
    if (pp_degree < 1) throw Error(fmt::format("gpt2_stages_generator: the pipeline degree must be >= 1, got {}", pp_degree));
    std::vector<SplitPoint> points;
    points.push_back({{"transformer.wte", "transformer.wpe", "transformer.drop"}, c_.input_layer_equivalence});
    for (i64 i = 0; i < c_.num_model_layers; ++i) points.push_back({{fmt::format("transformer.h.{}", i)}, 1});
    points.push_back({{"transformer.lm_head_norm", "transformer.lm_head"}, c_.output_layer_equivalence});
    const i64 total = c_.num_model_layers + c_.input_layer_equivalence + c_.output_layer_equivalence;
    const i64 num_stages = (total + num_layers_per_stage - 1) / num_layers_per_stage;
    if (num_stages % pp_degree != 0)
      throw Error(fmt::format("gpt2_stages_generator: {} stages (ceil(({} blocks + {} + {}) / {} per stage)) cannot be "
                              "spread evenly over a pipeline degree of {}; change num_layers_per_stage",
                              num_stages, c_.num_model_layers, c_.input_layer_equivalence,
                              c_.output_layer_equivalence, num_layers_per_stage, pp_degree));
    if (num_stages > static_cast<i64>(points.size()))
      throw Error(fmt::format("gpt2_stages_generator: {} stages need at least as many split points, the model has {} "
                              "(embeddings, {} blocks, head); use more layers per stage",
                              num_stages, points.size(), c_.num_model_layers));
    std::vector<std::vector<std::string>> out;
    for (const auto& stage : pack(points, num_stages)) {
      out.emplace_back();
      for (const SplitPoint& p : stage) out.back().insert(out.back().end(), p.fqns.begin(), p.fqns.end());
    }
    return out;
  }

 private:
  Gpt2StagesConfig c_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<StagesGenerator, Gpt2StagesConfig>(
      "gpt2_stages_generator",
      "Module FQNs of each pipeline stage of a GPT-2, balanced by compute weight (embeddings and head count as "
      "input/output_layer_equivalence blocks).",
      [](const Gpt2StagesConfig& c) { return std::make_shared<Gpt2StagesGenerator>(c); });
}

}  // namespace modalities::plugins::pipeline

MODALITIES_PLUGIN(pipeline, MODALITIES_PLUGIN_VERSION, modalities::plugins::pipeline::register_components)
