// stages_generator/gpt2_stages_generator: Modalities' documented example, uneven weights that
// Modalities 0.5's packing could not place, the errors, and over many shapes the property that
// matters: exactly num_stages contiguous stages holding every module once, in model order.
#include "../src/pipeline.h"

#include <modalities/sdk/error.h>
#include <modalities/sdk/interfaces/stages_generator.h>
#include <modalities/testing/harness.h>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace modalities::plugins::pipeline {
namespace {

using modalities::testing::Harness;
using ::testing::HasSubstr;
using Stages = std::vector<std::vector<std::string>>;

std::shared_ptr<StagesGenerator> generator(Harness& h, int layers, int in_eq = 1, int out_eq = 1) {
  h.set_config_text(fmt::format(R"([stages_generator]
component_key = "stages_generator"
variant_key = "gpt2_stages_generator"
config = {{ num_model_layers = {}, input_layer_equivalence = {}, output_layer_equivalence = {} }}
)",
                                layers, in_eq, out_eq));
  auto g = h.get<StagesGenerator>("stages_generator");
  EXPECT_NE(g, nullptr) << h.build_error();
  return g;
}

std::string error_of(const StagesGenerator& g, int per_stage, int pp) {
  try {
    g.stages(per_stage, pp);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Gpt2StagesGeneratorTest, ModalitiesExampleAndEvenSplits) {
  Harness h(MODALITIES_TEST_PLUGIN);
  EXPECT_EQ(generator(h, 2)->stages(2, 2),
            (Stages{{"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"},
                    {"transformer.h.1", "transformer.lm_head_norm", "transformer.lm_head"}}));
  EXPECT_EQ(generator(h, 6)->stages(2, 2),
            (Stages{{"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"},
                    {"transformer.h.1", "transformer.h.2"},
                    {"transformer.h.3", "transformer.h.4"},
                    {"transformer.h.5", "transformer.lm_head_norm", "transformer.lm_head"}}));
  EXPECT_EQ(generator(h, 4, 3)->stages(3, 1),
            (Stages{{"transformer.wte", "transformer.wpe", "transformer.drop"},
                    {"transformer.h.0", "transformer.h.1", "transformer.h.2"},
                    {"transformer.h.3", "transformer.lm_head_norm", "transformer.lm_head"}}));
}

// A head weighing 3 blocks with 2 blocks per stage: 4 stages of capacity 2 in Modalities 0.5,
// whose packing refuses a split point heavier than that; here the lightest contiguous packing.
TEST(Gpt2StagesGeneratorTest, AHeavyHeadGetsAStageOfItsOwn) {
  Harness h(MODALITIES_TEST_PLUGIN);
  EXPECT_EQ(generator(h, 3, 1, 3)->stages(2, 2), (Stages{{"transformer.wte", "transformer.wpe", "transformer.drop"},
                                                         {"transformer.h.0", "transformer.h.1"},
                                                         {"transformer.h.2"},
                                                         {"transformer.lm_head_norm", "transformer.lm_head"}}));
}

TEST(Gpt2StagesGeneratorTest, StageCountsThatCannotWorkAreErrors) {
  Harness h(MODALITIES_TEST_PLUGIN);
  EXPECT_THAT(error_of(*generator(h, 2), 1, 3),
              HasSubstr("4 stages (ceil((2 blocks + 1 + 1) / 1 per stage)) cannot be spread evenly over a pipeline "
                        "degree of 3"));
  EXPECT_THAT(error_of(*generator(h, 1, 2), 1, 1),
              HasSubstr("4 stages need at least as many split points, the model has 3"));
  EXPECT_THAT(error_of(*generator(h, 2), 0, 1), HasSubstr("num_layers_per_stage must be >= 1, got 0"));
  h.set_config_text(R"([stages_generator]
component_key = "stages_generator"
variant_key = "gpt2_stages_generator"
config = { num_model_layers = 0 }
)");
  EXPECT_THAT(h.build_error(), HasSubstr("stages_generator.config.num_model_layers: must be >= 1, got 0"));
}

TEST(Gpt2StagesGeneratorTest, EveryModuleLandsInExactlyOneStageInOrder) {
  Harness h(MODALITIES_TEST_PLUGIN);
  int checked = 0;
  for (int layers = 1; layers <= 12; ++layers)
    for (int in_eq = 1; in_eq <= 3; ++in_eq)
      for (int out_eq = 1; out_eq <= 3; ++out_eq) {
        const auto g = generator(h, layers, in_eq, out_eq);
        std::vector<std::string> all = {"transformer.wte", "transformer.wpe", "transformer.drop"};
        for (int i = 0; i < layers; ++i) all.push_back(fmt::format("transformer.h.{}", i));
        all.insert(all.end(), {"transformer.lm_head_norm", "transformer.lm_head"});
        for (int per_stage = 1; per_stage <= 5; ++per_stage) {
          const int num_stages = (layers + in_eq + out_eq + per_stage - 1) / per_stage;
          if (num_stages > layers + 2) continue;  // an error, tested above
          const Stages stages = g->stages(per_stage, 1);
          ASSERT_EQ(static_cast<int>(stages.size()), num_stages) << layers << " " << in_eq << " " << out_eq;
          std::vector<std::string> flat;
          for (const auto& s : stages) {
            EXPECT_FALSE(s.empty());
            flat.insert(flat.end(), s.begin(), s.end());
          }
          EXPECT_EQ(flat, all) << layers << " blocks, " << per_stage << " per stage";
          ++checked;
        }
      }
  EXPECT_GT(checked, 300);
}

// --- schedules -----------------------------------------------------------------------------

struct Shape {
  ScheduleKind kind;
  std::int64_t pp, v, m;
};

std::vector<Shape> shapes() {
  std::vector<Shape> out;
  for (std::int64_t pp : {2, 3, 4})
    for (std::int64_t m : {1, 2, 4, 8}) {
      out.push_back({ScheduleKind::kGPipe, pp, 1, m});
      out.push_back({ScheduleKind::k1F1B, pp, 1, m});
      for (std::int64_t v : {1, 2, 3}) {
        out.push_back({ScheduleKind::kLoopedBFS, pp, v, m});
        if (m % pp == 0) out.push_back({ScheduleKind::kInterleaved1F1B, pp, v, m});
      }
    }
  return out;
}

std::string name(const Shape& s) {
  static const char* names[] = {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"};
  return fmt::format("{} pp {} v {} m {}", names[static_cast<int>(s.kind)], s.pp, s.v, s.m);
}

// Every rank runs the forward and the backward of every micro-batch on each of its stages exactly
// once, each backward after its forward.
TEST(ScheduleTest, EveryRankRunsEachForwardAndBackwardOnceBackwardAfterForward) {
  for (const Shape& s : shapes())
    for (std::int64_t r = 0; r < s.pp; ++r) {
      const auto actions = schedule_actions(s.kind, r, s.pp, s.v, s.m);
      ASSERT_EQ(actions.size(), static_cast<std::size_t>(2 * s.v * s.m)) << name(s);
      std::set<std::tuple<bool, std::int64_t, std::int64_t>> seen;
      for (const Action& a : actions) {
        ASSERT_TRUE(a.local_stage >= 0 && a.local_stage < s.v && a.micro_batch >= 0 && a.micro_batch < s.m) << name(s);
        ASSERT_TRUE(seen.insert({a.forward, a.local_stage, a.micro_batch}).second) << name(s);
        if (!a.forward) {
          EXPECT_TRUE(seen.contains({true, a.local_stage, a.micro_batch})) << name(s);
        }
      }
    }
}

// Run together, no schedule deadlocks, and with equal stage times each has the textbook bubble:
// (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) for interleaved 1F1B.
TEST(ScheduleTest, NoScheduleDeadlocksAndTheBubbleIsTheTheoreticalOne) {
  for (const Shape& s : shapes()) {
    const auto t = simulate(s.kind, s.pp, s.v, s.m);
    ASSERT_TRUE(t.has_value()) << name(s) << " deadlocks";
    if (s.kind == ScheduleKind::kLoopedBFS) continue;  // its bubble has no closed form here
    EXPECT_NEAR(t->bubble, theoretical_bubble(s.kind, s.pp, s.v, s.m), 1e-12) << name(s);
  }
  // Interleaving shrinks the bubble: 4 ranks, 8 micro-batches: 3/11 with one stage per rank,
  // 3/19 with two.
  EXPECT_NEAR(simulate(ScheduleKind::k1F1B, 4, 1, 8)->bubble, 3.0 / 11.0, 1e-12);
  EXPECT_NEAR(simulate(ScheduleKind::kInterleaved1F1B, 4, 2, 8)->bubble, 3.0 / 19.0, 1e-12);
}

// 1F1B keeps at most p - r micro-batches in flight on rank r (GPipe: all m), the point of it.
TEST(ScheduleTest, OneFOneBBoundsTheActivationsInFlight) {
  for (std::int64_t r = 0; r < 4; ++r) {
    std::int64_t in_flight = 0, most = 0;
    for (const Action& a : schedule_actions(ScheduleKind::k1F1B, r, 4, 1, 8)) {
      in_flight += a.forward ? 1 : -1;
      most = std::max(most, in_flight);
    }
    EXPECT_EQ(most, 4 - r) << "rank " << r;
  }
}

TEST(ScheduleTest, NamesAreCaseInsensitive) {
  EXPECT_EQ(schedule_kind("gpipe"), ScheduleKind::kGPipe);
  EXPECT_EQ(schedule_kind("GPipe"), ScheduleKind::kGPipe);
  EXPECT_EQ(schedule_kind("1f1b"), ScheduleKind::k1F1B);
  EXPECT_EQ(schedule_kind("Interleaved1F1B"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(schedule_kind("loopedbfs"), ScheduleKind::kLoopedBFS);
  EXPECT_FALSE(schedule_kind("ZBVZeroBubble").has_value());
}

}  // namespace
}  // namespace modalities::plugins::pipeline
