// losses: loss/clm_cross_entropy_loss built from the example config and
// compared with PyTorch (Modalities' CLMCrossEntropyLoss) on stored cases from
// scripts/reference/loss_reference.py (tests/data/loss_reference.txt); loss/moe_aux_loss and
// loss/weighted_sum against the formula.
// Tolerance: 1e-6 relative for fp32 (same kernels, different build), exact for
// bf16 (the loss is a bf16 scalar; one bf16 step near 8 is 1/16).
#include <modalities/sdk/interfaces/batch.h>
#include <modalities/sdk/interfaces/loss.h>
#include <modalities/testing/harness.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace modalities::plugins::losses {
namespace {

using ::testing::HasSubstr;

const std::filesystem::path kDir = MODALITIES_TEST_PLUGIN_SOURCE_DIR;

struct ReferenceCase {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::int64_t B = 0, T = 0, V = 0;
  std::vector<float> logits;
  std::vector<std::int64_t> labels;
  double loss = 0.0;
};

std::vector<ReferenceCase> read_reference() {
  std::ifstream in(kDir / "tests" / "data" / "loss_reference.txt");
  EXPECT_TRUE(in.good()) << "cannot open loss_reference.txt";
  std::vector<ReferenceCase> cases;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string tag;
    s >> tag;
    if (tag == "case") {
      ReferenceCase c;
      std::string dtype;
      s >> c.name >> dtype >> c.B >> c.T >> c.V;
      c.dtype = dtype == "bf16" ? at::kBFloat16 : at::kFloat;
      cases.push_back(c);
    } else if (tag == "logits") {
      for (float x; s >> x;) cases.back().logits.push_back(x);
    } else if (tag == "labels") {
      for (std::int64_t x; s >> x;) cases.back().labels.push_back(x);
    } else if (tag == "loss") {
      s >> cases.back().loss;
    }
  }
  return cases;
}

class ClmLossTest : public ::testing::Test {
 protected:
  std::shared_ptr<Loss> loss() {
    auto l = h.get<Loss>("loss_fn");
    EXPECT_NE(l, nullptr) << h.build_error();
    return l;
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN, kDir / "configs" / "example.toml"};
};

TEST_F(ClmLossTest, BuildsFromExampleWithModalitiesKeysAndTag) {
  auto l = loss();
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->tag(), "CLMCrossEntropyLoss");
  EXPECT_EQ(l->target_key(), "target_ids");
  EXPECT_EQ(l->prediction_key(), "logits");
  h.set("loss_fn.config.tag", Value("val_loss"));
  EXPECT_EQ(loss()->tag(), "val_loss");
}

TEST_F(ClmLossTest, MatchesPyTorchReference) {
  auto l = loss();
  ASSERT_NE(l, nullptr);
  const auto cases = read_reference();
  ASSERT_EQ(cases.size(), 5u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_EQ(static_cast<std::int64_t>(c.logits.size()), c.B * c.T * c.V);
    const at::Tensor logits = at::tensor(c.logits).reshape({c.B, c.T, c.V}).to(c.dtype);
    // int32 labels on purpose: the loss casts them to int64 like Modalities' .long().
    const at::Tensor labels = at::tensor(c.labels).reshape({c.B, c.T}).to(at::kInt);
    InferenceResultBatch batch;
    batch.targets = {{"target_ids", labels}};
    batch.predictions = {{"logits", logits}};
    const at::Tensor from_batch = l->compute(batch);
    const at::Tensor from_tensors = l->compute(logits, labels);
    EXPECT_EQ(from_batch.dim(), 0);
    EXPECT_EQ(from_batch.scalar_type(), c.dtype) << "the loss keeps the logits' dtype";
    const double got = from_batch.item<double>();
    if (c.dtype == at::kBFloat16) {
      EXPECT_EQ(got, c.loss);
    } else {
      EXPECT_NEAR(got, c.loss, 1e-6 * std::abs(c.loss)) << "difference " << got - c.loss;
    }
    EXPECT_TRUE(from_batch.equal(from_tensors)) << "both compute() overloads agree";
  }
}

TEST_F(ClmLossTest, MatchesTheFormulaAndIgnoresMinus100) {
  at::manual_seed(0);
  const at::Tensor logits = at::randn({2, 3, 5}, at::kDouble);
  const at::Tensor labels = at::tensor({1, -100, 4, 0, 2, -100}, at::kLong).reshape({2, 3});
  // mean over the 4 kept tokens of logsumexp(z) - z[y]
  double sum = 0;
  int kept = 0;
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 3; ++t) {
      const auto y = labels[b][t].item<std::int64_t>();
      if (y == -100) continue;
      sum += (at::logsumexp(logits[b][t], 0) - logits[b][t][y]).item<double>();
      ++kept;
    }
  EXPECT_NEAR(loss()->compute(logits, labels).item<double>(), sum / kept, 1e-12);
}

TEST_F(ClmLossTest, AllLabelsIgnoredGivesNaN) {
  const at::Tensor loss_value = loss()->compute(at::randn({1, 4, 8}), at::full({1, 4}, -100, at::kLong));
  EXPECT_TRUE(std::isnan(loss_value.item<double>()));
}

TEST_F(ClmLossTest, GradientFlowsToTheLogits) {
  const at::Tensor logits = at::randn({2, 3, 5}).requires_grad_(true);
  loss()->compute(logits, at::tensor({1, 2, 3, 4, 0, -100}, at::kLong).reshape({2, 3})).backward();
  ASSERT_TRUE(logits.grad().defined());
  // The rows of ignored tokens get no gradient; every other row's gradient sums to 0 (softmax - one-hot).
  EXPECT_EQ(logits.grad()[1][2].abs().sum().item<double>(), 0.0);
  EXPECT_NEAR(logits.grad()[0][0].sum().item<double>(), 0.0, 1e-7);
}

TEST_F(ClmLossTest, ReportsMissingKeysAndShapeMismatches) {
  auto l = loss();
  ASSERT_NE(l, nullptr);
  InferenceResultBatch wrong_key;
  wrong_key.targets = {{"labels", at::zeros({1, 2}, at::kLong)}};
  wrong_key.predictions = {{"logits", at::zeros({1, 2, 3})}};
  EXPECT_THROW(l->compute(wrong_key), Error);
  try {
    l->compute(at::zeros({2, 3, 5}), at::zeros({2, 4}, at::kLong));
    FAIL() << "expected a shape error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("targets 'target_ids' [2, 4] do not fit the logits 'logits' [2, 3, 5]"));
  }
}

TEST_F(ClmLossTest, ValidatorsNameTheConfigPath) {
  h.erase("loss_fn.config.target_key");
  EXPECT_THAT(h.build_error(), HasSubstr("loss_fn.config.target_key: missing required key"));
  h.set("loss_fn.config.target_key", Value(""));
  EXPECT_THAT(h.build_error(), HasSubstr("loss_fn.config.target_key: must not be empty"));
}

// Cross-entropy plus a MoE model's auxiliary-loss output, as a MoE training config combines them.
constexpr const char* kWeightedSum = R"(
[ce]
component_key = "loss"
variant_key = "clm_cross_entropy_loss"
config = { target_key = "target_ids", prediction_key = "logits" }

[aux]
component_key = "loss"
variant_key = "moe_aux_loss"
config = { prediction_key = "balance" }

[loss_fn]
component_key = "loss"
variant_key = "weighted_sum"
config = { losses = [{ instance_key = "ce", pass_type = "BY_REFERENCE" }, { instance_key = "aux", pass_type = "BY_REFERENCE" }], weights = [1.0, 0.5] }
)";

TEST(WeightedSumLossTest, AddsTheWeightedTermsAndTheirGradients) {
  testing::Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(kWeightedSum);
  auto l = h.get<Loss>("loss_fn");
  ASSERT_NE(l, nullptr) << h.build_error();
  EXPECT_EQ(l->tag(), "WeightedSumLoss");
  EXPECT_EQ(l->prediction_key(), "logits");
  EXPECT_EQ(l->target_key(), "target_ids");
  EXPECT_TRUE(l->accepts_vocab_shards());
  at::manual_seed(3);
  const at::Tensor logits = at::randn({2, 5, 7}).set_requires_grad(true);
  const at::Tensor aux = at::full({}, 0.25).set_requires_grad(true);
  InferenceResultBatch b;
  b.targets = {{"target_ids", at::randint(0, 7, {2, 5}, at::kLong)}};
  b.predictions = {{"logits", logits}, {"balance", aux}};
  const at::Tensor total = l->compute(b);
  const at::Tensor ce =
      at::cross_entropy_loss(logits.detach().reshape({-1, 7}), b.targets.at("target_ids").reshape({-1}));
  EXPECT_NEAR(total.item<double>(), ce.item<double>() + 0.5 * 0.25, 1e-6);
  total.backward();
  EXPECT_NEAR(aux.grad().item<double>(), 0.5, 1e-7);
  EXPECT_TRUE(logits.grad().defined());
  auto alone = h.get<Loss>("aux");
  ASSERT_NE(alone, nullptr);
  EXPECT_EQ(alone->tag(), "MoEAuxLoss");
  EXPECT_TRUE(at::equal(alone->compute(b), aux));
}

TEST(WeightedSumLossTest, ErrorsNameTheKeyAndThePath) {
  testing::Harness h(MODALITIES_TEST_PLUGIN);
  h.set_config_text(kWeightedSum);
  auto l = h.get<Loss>("loss_fn");
  ASSERT_NE(l, nullptr) << h.build_error();
  InferenceResultBatch b;  // a model without auxiliary losses
  b.targets = {{"target_ids", at::zeros({1, 2}, at::kLong)}};
  b.predictions = {{"logits", at::zeros({1, 2, 3})}};
  try {
    l->compute(b);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("MoEAuxLoss: the model gave no output 'balance' (prediction_key); it gave logits"));
  }
  b.predictions["balance"] = at::zeros({2});
  EXPECT_THROW(l->compute(b), Error);  // not a scalar
  try {
    l->compute(at::zeros({1, 2, 3}), at::zeros({1, 2}, at::kLong));  // the pipeline path
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("without pipeline parallelism"));
  }
  h.set("loss_fn.config.weights", Value(Value::List{Value(1.0)}));
  EXPECT_THAT(h.build_error(), HasSubstr("loss_fn.config.weights: expected one weight per loss (2), got 1"));
  h.set("loss_fn.config.weights", Value(Value::List{}));  // all 1
  ASSERT_NE(h.get<Loss>("loss_fn"), nullptr) << h.build_error();
  h.set("loss_fn.config.losses", Value(Value::List{}));
  EXPECT_THAT(h.build_error(), HasSubstr("loss_fn.config.losses"));
}

}  // namespace
}  // namespace modalities::plugins::losses
