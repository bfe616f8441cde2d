// Collators built through the registry: the GPT-2 shift,
// the loss-masking wrapper against the README's example and Modalities' error
// cases, the CoCa split; marker ids come from an in-process
// tokenizer. One negative test per validator asserts the config path.
#include <modalities/sdk/interfaces/collate_fn.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

namespace modalities::plugins::collators {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::filesystem::path kExample =
    std::filesystem::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

// "<begin>" = 3, "<end>" = 4, "<eod>" = 4 (to provoke equal ids); anything else is unknown.
class MarkerTokenizer final : public Tokenizer {
 public:
  std::vector<std::int64_t> tokenize(std::string_view) const override { return {}; }
  std::string decode(std::span<const std::int64_t>) const override { return {}; }
  std::int64_t vocab_size() const override { return 10; }
  std::int64_t token_id(std::string_view token) const override {
    if (token == "<begin>") return 3;
    if (token == "<end>" || token == "<eod>") return 4;
    throw Error(fmt::format("token '{}' is not in the vocabulary", token));
  }
  bool is_special_token_id(std::int64_t) const override { return false; }
};
struct NoConfig {
  static void describe(Schema<NoConfig>&) {}
};

std::vector<std::int64_t> row(const at::Tensor& t, std::int64_t i) {
  const at::Tensor r = t[i].contiguous();
  return {r.data_ptr<std::int64_t>(), r.data_ptr<std::int64_t>() + r.numel()};
}

Sample tokens(std::vector<std::int64_t> v, const std::string& key = "input_ids") {
  return {{key, at::tensor(v, at::kLong)}};
}

std::string collate_error(const CollateFn& c, const std::vector<Sample>& samples) {
  try {
    c.collate(samples);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class CollatorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto problem = h.registry().register_plugin({"collator_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
      r.add<Tokenizer, NoConfig>("markers", "marker ids",
                                 [](const NoConfig&) { return std::make_shared<MarkerTokenizer>(); });
    });
    ASSERT_FALSE(problem.has_value()) << *problem;
  }
  void add_mask_loss() {
    h.set_config_text(testing::read_file(kExample) + R"(
[tokenizer]
component_key = "tokenizer"
variant_key = "markers"
config = {}

[masked_collate_fn]
component_key = "collate_fn"
variant_key = "mask_loss_collator_wrapper"

[masked_collate_fn.config]
wrapped_collate_fn = { instance_key = "collate_fn", pass_type = "BY_REFERENCE" }
target_keys_to_mask = ["target_ids"]
loss_ignore_index = -100
mask_tokens = { b_include_to_loss_token = "<begin>", e_include_to_loss_token = "<end>" }
tokenizer = { instance_key = "tokenizer", pass_type = "BY_REFERENCE" }
)");
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
};

TEST_F(CollatorsTest, Gpt2CollatorShiftsByOneToken) {
  auto c = h.get<CollateFn>("collate_fn");
  ASSERT_NE(c, nullptr);
  const std::vector<Sample> samples = {tokens({0, 1, 2, 3, 4}), tokens({10, 11, 12, 13, 14})};
  const DatasetBatch b = c->collate(samples);
  const at::Tensor& x = b.samples.at("input_ids");
  const at::Tensor& y = b.targets.at("target_ids");
  EXPECT_EQ(x.sizes(), (std::vector<std::int64_t>{2, 4}));
  EXPECT_EQ(y.sizes(), (std::vector<std::int64_t>{2, 4}));
  EXPECT_THAT(row(x, 1), ElementsAre(10, 11, 12, 13));
  EXPECT_THAT(row(y, 1), ElementsAre(11, 12, 13, 14));
  EXPECT_EQ(b.size(), 2);
  EXPECT_EQ(b.batch_dim, 0);
  // Narrow dtypes (Modalities' int32 for 2-byte files) come out as int64 (quirk Q12).
  const std::vector<Sample> narrow = {{{"input_ids", at::tensor({5, 6, 7}, at::kInt)}}};
  const DatasetBatch nb = c->collate(narrow);
  EXPECT_EQ(nb.samples.at("input_ids").scalar_type(), at::kLong);
  EXPECT_EQ(nb.targets.at("target_ids").scalar_type(), at::kLong);
  EXPECT_THAT(row(nb.targets.at("target_ids"), 0), ElementsAre(6, 7));
}

TEST_F(CollatorsTest, Gpt2CollatorRejectsBadBatches) {
  auto c = h.get<CollateFn>("collate_fn");
  EXPECT_THAT(collate_error(*c, {}), HasSubstr("cannot collate an empty batch"));
  EXPECT_THAT(collate_error(*c, {tokens({1, 2}), tokens({1, 2}, "text")}),
              HasSubstr("sample 1 of the batch has no key 'input_ids' (it has 'text')"));
  EXPECT_THAT(collate_error(*c, {tokens({1, 2, 3}), tokens({1, 2})}),
              HasSubstr("sample 1 of the batch has 'input_ids' of shape [2], but sample 0 has [3]"));
  EXPECT_THAT(collate_error(*c, {tokens({1})}), HasSubstr("at least 2 tokens"));
}

TEST_F(CollatorsTest, Gpt2CollatorValidatorsNameTheConfigPath) {
  h.erase("collate_fn.config.target_key");
  EXPECT_THAT(h.build_error(), HasSubstr("collate_fn.config.target_key: missing required key"));
  h.set("collate_fn.config.target_key", Value(3));
  EXPECT_THAT(h.build_error(), HasSubstr("collate_fn.config.target_key: expected a string"));
}

TEST_F(CollatorsTest, MaskLossMatchesTheSpecExample) {
  add_mask_loss();
  auto c = h.get<CollateFn>("masked_collate_fn");
  ASSERT_NE(c, nullptr);
  // Targets (after the shift) [7, 3, 9, 9, 4, 8] -> [-100, -100, 9, 9, -100, -100].
  const DatasetBatch b = c->collate(std::vector<Sample>{tokens({0, 7, 3, 9, 9, 4, 8})});
  EXPECT_THAT(row(b.targets.at("target_ids"), 0), ElementsAre(-100, -100, 9, 9, -100, -100));
  EXPECT_THAT(row(b.samples.at("input_ids"), 0), ElementsAre(0, 7, 3, 9, 9, 4));  // inputs untouched
  EXPECT_EQ(b.targets.at("target_ids").scalar_type(), at::kLong);
}

TEST_F(CollatorsTest, MaskLossHandlesSeveralSpansRowsAndOpenEnds) {
  add_mask_loss();
  auto c = h.get<CollateFn>("masked_collate_fn");
  const DatasetBatch b = c->collate(
      std::vector<Sample>{tokens({0, 3, 5, 4, 6, 3, 7, 4, 8}),    // two spans
                          tokens({0, 1, 3, 5, 6, 7, 8, 9, 2}),    // begins, never ends: open until the row ends
                          tokens({0, 5, 6, 7, 8, 9, 1, 2, 5}),    // no markers: fully masked (others have them)
                          tokens({0, 9, 9, 9, 9, 9, 9, 9, 3})});  // ends on a begin marker
  const at::Tensor& y = b.targets.at("target_ids");
  EXPECT_THAT(row(y, 0), ElementsAre(-100, 5, -100, -100, -100, 7, -100, -100));
  EXPECT_THAT(row(y, 1), ElementsAre(-100, -100, 5, 6, 7, 8, 9, 2));
  EXPECT_THAT(row(y, 2), ElementsAre(-100, -100, -100, -100, -100, -100, -100, -100));
  EXPECT_THAT(row(y, 3), ElementsAre(-100, -100, -100, -100, -100, -100, -100, -100));
}

TEST_F(CollatorsTest, MaskLossMasksEverythingWhenAMarkerIsMissingFromTheBatch) {
  add_mask_loss();
  auto c = h.get<CollateFn>("masked_collate_fn");
  const DatasetBatch none = c->collate(std::vector<Sample>{tokens({0, 7, 9, 4, 8})});  // no begin anywhere
  EXPECT_THAT(row(none.targets.at("target_ids"), 0), ElementsAre(-100, -100, -100, -100));
  const DatasetBatch no_end = c->collate(std::vector<Sample>{tokens({0, 7, 3, 9, 8})});  // no end anywhere
  EXPECT_THAT(row(no_end.targets.at("target_ids"), 0), ElementsAre(-100, -100, -100, -100));
}

TEST_F(CollatorsTest, MaskLossRaisesLikeModalitiesOnBadMarkerOrder) {
  add_mask_loss();
  auto c = h.get<CollateFn>("masked_collate_fn");
  // End before begin (a block starting inside a span, quirk Q10).
  EXPECT_THAT(collate_error(*c, {tokens({0, 7, 4, 3, 9})}), HasSubstr("end mask token indicator is before begin"));
  // Two begins without an end.
  EXPECT_THAT(collate_error(*c, {tokens({0, 3, 9, 3, 9, 4})}), HasSubstr("end mask token indicator is before begin"));
  // A listed target key the wrapped collator does not produce.
  h.set("masked_collate_fn.config.target_keys_to_mask", Value(Value::List{Value("labels")}));
  EXPECT_THAT(collate_error(*h.get<CollateFn>("masked_collate_fn"), {tokens({0, 3, 4})}),
              HasSubstr("the wrapped collator produced no target 'labels' (it has 'target_ids')"));
}

TEST_F(CollatorsTest, MaskLossValidatorsNameTheConfigPath) {
  add_mask_loss();
  h.set("masked_collate_fn.config.mask_tokens.b_include_to_loss_token", Value("<eod>"));  // same id as <end>
  EXPECT_THAT(h.build_error(),
              HasSubstr("masked_collate_fn.config.mask_tokens: b_mask_token_id and e_mask_token_id must be different, "
                        "both are 4 ('<eod>' and '<end>')"));
  h.set("masked_collate_fn.config.mask_tokens.b_include_to_loss_token", Value("<end>"));
  EXPECT_THAT(h.build_error(), HasSubstr("masked_collate_fn.config.mask_tokens: b_mask_token_id and e_mask_token_id"));
  h.set("masked_collate_fn.config.mask_tokens.b_include_to_loss_token", Value("<start>"));
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("masked_collate_fn.config.mask_tokens.b_include_to_loss_token"),
                                     HasSubstr("'<start>' is not in the vocabulary")));
  h.set("masked_collate_fn.config.mask_tokens.b_include_to_loss_token", Value("<begin>"));
  h.erase("masked_collate_fn.config.mask_tokens.e_include_to_loss_token");
  EXPECT_THAT(h.build_error(),
              HasSubstr("masked_collate_fn.config.mask_tokens.e_include_to_loss_token: missing required key"));
  h.set("masked_collate_fn.config.mask_tokens.e_include_to_loss_token", Value("<end>"));
  h.set("masked_collate_fn.config.loss_ignore_index", Value(-100.0));
  EXPECT_THAT(h.build_error(), HasSubstr("masked_collate_fn.config.loss_ignore_index: expected an integer"));
  h.set("masked_collate_fn.config.loss_ignore_index", Value(-100));
  h.set("masked_collate_fn.config.target_keys_to_mask", Value("target_ids"));
  EXPECT_THAT(h.build_error(), HasSubstr("masked_collate_fn.config.target_keys_to_mask: expected a list"));
  h.set("masked_collate_fn.config.target_keys_to_mask", Value(Value::List{Value("target_ids")}));
  h.set("masked_collate_fn.config.wrapped_collate_fn",
        Value(Value::Table{{"instance_key", Value("tokenizer")}, {"pass_type", Value("BY_REFERENCE")}}));
  EXPECT_THAT(h.build_error(), HasSubstr("masked_collate_fn.config.wrapped_collate_fn: expected a CollateFn"));
}

TEST_F(CollatorsTest, CocaCollatorStacksAndSplitsTheText) {
  auto c = h.get<CollateFn>("coca_collate_fn");
  ASSERT_NE(c, nullptr);
  std::vector<Sample> samples;
  for (int i = 0; i < 3; ++i)
    samples.push_back({{"images", at::full({3, 2, 2}, static_cast<double>(i), at::kFloat)},
                       {"input_ids", at::tensor({i, i + 1, i + 2}, at::kLong)}});
  const DatasetBatch b = c->collate(samples);
  EXPECT_EQ(b.samples.at("images").sizes(), (std::vector<std::int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(b.samples.at("images").scalar_type(), at::kFloat);
  EXPECT_THAT(row(b.samples.at("input_ids"), 2), ElementsAre(2, 3));
  EXPECT_THAT(row(b.targets.at("target_ids"), 2), ElementsAre(3, 4));
}

TEST_F(CollatorsTest, CocaCollatorValidatorsNameTheConfigPath) {
  h.set("coca_collate_fn.config.text_sample_key", Value("text"));
  EXPECT_THAT(h.build_error(), HasSubstr("coca_collate_fn.config.text_sample_key: 'text' must be one of sample_keys"));
  h.set("coca_collate_fn.config.text_sample_key", Value("input_ids"));
  h.set("coca_collate_fn.config.target_keys", Value(Value::List{Value("target_ids")}));
  EXPECT_THAT(h.build_error(),
              HasSubstr("coca_collate_fn.config.text_target_key: 'target_ids' must not be one of target_keys"));
}

// Note [Document ids] in collators.cpp: an EOD (0 here) belongs to the document it ends.
TEST_F(CollatorsTest, DocumentMaskingCountsTheDocumentsOfEachSampleAndMasksTheBoundaryTargets) {
  auto c = h.get<CollateFn>("document_collate_fn");
  ASSERT_NE(c, nullptr);
  const std::vector<Sample> samples = {tokens({5, 6, 0, 7, 0, 0, 8, 9}), tokens({1, 2, 3, 4, 5, 6, 7, 0})};
  const DatasetBatch b = c->collate(samples);
  const at::Tensor& ids = b.samples.at("document_ids");
  EXPECT_EQ(ids.scalar_type(), at::kLong);
  // Inputs 5 6 0 7 0 0 8 (targets 6 0 7 0 0 8 9) and 1 .. 7 (targets 2 .. 7 0).
  EXPECT_THAT(row(ids, 0), ElementsAre(0, 0, 0, 1, 1, 2, 3));
  EXPECT_THAT(row(ids, 1), ElementsAre(0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(row(b.targets.at("target_ids"), 0), ElementsAre(6, 0, -100, 0, -100, -100, 9));
  EXPECT_THAT(row(b.targets.at("target_ids"), 1), ElementsAre(2, 3, 4, 5, 6, 7, 0));
  EXPECT_THAT(row(b.samples.at("input_ids"), 0), ElementsAre(5, 6, 0, 7, 0, 0, 8));
  // Without mask_boundary_targets the targets are the wrapped collator's.
  h.set("document_collate_fn.config.mask_boundary_targets", Value(false));
  const DatasetBatch kept = h.get<CollateFn>("document_collate_fn")->collate(samples);
  EXPECT_THAT(row(kept.targets.at("target_ids"), 0), ElementsAre(6, 0, 7, 0, 0, 8, 9));
  EXPECT_THAT(row(kept.samples.at("document_ids"), 0), ElementsAre(0, 0, 0, 1, 1, 2, 3));
}

TEST_F(CollatorsTest, DocumentMaskingValidatorsNameTheConfigPath) {
  h.erase("document_collate_fn.config.eod_token_id");
  EXPECT_THAT(h.build_error(), HasSubstr("document_collate_fn.config.eod_token_id: missing required key"));
  h.set("document_collate_fn.config.eod_token_id", Value(-1));
  EXPECT_THAT(h.build_error(), HasSubstr("document_collate_fn.config.eod_token_id"));
  h.set("document_collate_fn.config.eod_token_id", Value(0));
  h.erase("document_collate_fn.config.target_key");
  EXPECT_THAT(h.build_error(), HasSubstr("document_collate_fn.config.target_key: is missing; mask_boundary_targets"));
  h.set("document_collate_fn.config.target_key", Value("target_ids"));
  h.set("document_collate_fn.config.document_ids_key", Value("input_ids"));
  EXPECT_THAT(h.build_error(), HasSubstr("document_collate_fn.config.document_ids_key: is 'input_ids'"));
  h.set("document_collate_fn.config.document_ids_key", Value("document_ids"));
  h.set("document_collate_fn.config.sample_key", Value("text"));
  auto c = h.get<CollateFn>("document_collate_fn");
  EXPECT_THAT(collate_error(*c, {tokens({1, 2, 3})}), HasSubstr("has no input 'text' (sample_key)"));
}

TEST(MaskLossGpt2Test, ResolvesMarkersWithTheGpt2Tokenizer) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  const std::filesystem::path gpt2 = std::filesystem::path(MODALITIES_TEST_FIXTURES_DIR) / "data/tokenizer/hf_gpt2";
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_HF_TOKENIZER_PLUGIN);
  h.set_config_text(fmt::format(R"(
[tokenizer]
component_key = "tokenizer"
variant_key = "pretrained_hf_tokenizer"
config = {{ pretrained_model_name_or_path = "{}" }}

[collate_fn]
component_key = "collate_fn"
variant_key = "mask_loss_collator_wrapper"

[collate_fn.config]
wrapped_collate_fn = {{ component_key = "collate_fn", variant_key = "gpt_2_llm_collator", config = {{ sample_key = "input_ids", target_key = "target_ids" }} }}
target_keys_to_mask = ["target_ids"]
loss_ignore_index = -100
mask_tokens = {{ b_include_to_loss_token = "^", e_include_to_loss_token = "<|endoftext|>" }}
tokenizer = {{ instance_key = "tokenizer", pass_type = "BY_REFERENCE" }}
)",
                                gpt2.string()));
  auto c = h.get<CollateFn>("collate_fn");
  ASSERT_NE(c, nullptr);
  // "^" = 61, "<|endoftext|>" = 50256 in the GPT-2 vocabulary.
  const DatasetBatch b = c->collate(std::vector<Sample>{tokens({0, 7, 61, 9, 9, 50256, 8})});
  EXPECT_THAT(row(b.targets.at("target_ids"), 0), ElementsAre(-100, -100, 9, 9, -100, -100));
  h.set("collate_fn.config.mask_tokens.b_include_to_loss_token", Value("<|endoftext|>"));
  EXPECT_THAT(h.build_error(), HasSubstr("collate_fn.config.mask_tokens: b_mask_token_id and e_mask_token_id must be "
                                         "different, both are 50256"));
}

}  // namespace
}  // namespace modalities::plugins::collators
