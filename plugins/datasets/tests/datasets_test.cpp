// The dataset variants built through the registry from configs/example.toml:
// the continuous packed dataset against the expected values of
// README.md (data/sample, and Modalities' files from ../shared), combined and weighted
// mixtures against their index arithmetic, the dummy dataset's shapes and
// ranges, mem_map_dataset with an in-process byte tokenizer, and one test per
// validator asserting that the message names the config path.
#include "../src/mixture_schedule.h"

#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/sdk/interfaces/dataset.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

namespace modalities::plugins::datasets {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";
const fs::path kFixtures = fs::path(MODALITIES_TEST_FIXTURES_DIR);

// The example config names its data relative to the repository root.
class InSourceRoot : public ::testing::Environment {
 public:
  void SetUp() override { fs::current_path(MODALITIES_TEST_SOURCE_ROOT); }
};
const auto* const kEnv = ::testing::AddGlobalTestEnvironment(new InSourceRoot);

std::vector<std::int64_t> values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()};
}

std::vector<std::int64_t> head(const at::Tensor& t, std::int64_t n) { return values(t.slice(0, 0, n)); }

// A tokenizer for tests: one id per byte; "<b>" and "<e>" are 1000 and 1001.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<std::int64_t> tokenize(std::string_view text) const override {
    return {reinterpret_cast<const unsigned char*>(text.data()),
            reinterpret_cast<const unsigned char*>(text.data()) + text.size()};
  }
  std::string decode(std::span<const std::int64_t> ids) const override { return std::string(ids.begin(), ids.end()); }
  std::int64_t vocab_size() const override { return 1002; }
  std::int64_t token_id(std::string_view token) const override {
    if (token == "<b>") return 1000;
    if (token == "<e>") return 1001;
    if (token.size() == 1) return static_cast<unsigned char>(token[0]);
    throw Error(fmt::format("'{}' is not a single token", token));
  }
  bool is_special_token_id(std::int64_t id) const override { return id >= 1000; }
};
struct NoConfig {
  static void describe(Schema<NoConfig>&) {}
};
void register_byte_tokenizer(testing::Harness& h) {
  auto problem = h.registry().register_plugin({"test_tokenizer", "0.0.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Tokenizer, NoConfig>("byte_test", "one id per byte",
                               [](const NoConfig&) { return std::make_shared<ByteTokenizer>(); });
  });
  ASSERT_FALSE(problem.has_value()) << *problem;
}

class DatasetsTest : public ::testing::Test {
 protected:
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
};

// The i-th token of a .pbin with 2-byte tokens (header of 12 bytes).
std::int64_t token_of(const std::string& pbin_bytes, std::size_t i) {
  return static_cast<std::int64_t>(static_cast<unsigned char>(pbin_bytes[12 + 2 * i]) |
                                   (static_cast<unsigned char>(pbin_bytes[13 + 2 * i]) << 8));
}

TEST_F(DatasetsTest, ContinuousDatasetCutsOverlappingBlocksOfTheFile) {
  auto ds = h.get<Dataset>("train_dataset");
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->size(), 911);  // data/sample/train.pbin: (233 300 - 1) div 256
  EXPECT_EQ(ds->token_size_in_bytes(), 2);
  const std::string bytes = testing::read_file(fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data/sample/train.pbin");
  for (std::int64_t i : {0, 1, 642, 910}) {
    const auto v = values(ds->get(i).at("input_ids"));
    ASSERT_EQ(v.size(), 257u);
    for (std::size_t k = 0; k < v.size(); ++k)
      ASSERT_EQ(v[k], token_of(bytes, static_cast<std::size_t>(i) * 256 + k)) << "sample " << i << " token " << k;
  }
  EXPECT_EQ(values(ds->get(641).at("input_ids")).back(), values(ds->get(642).at("input_ids")).front());
}

// The worked sample of the spec (data.md) on Modalities' lorem_ipsum_long.pbin from ../shared.
TEST_F(DatasetsTest, ContinuousDatasetReproducesTheSpecSample) {
  MODALITIES_REQUIRE_SHARED(kFixtures / "data/lorem_ipsum_long.pbin");
  h.set("train_dataset.config.raw_data_path", Value((kFixtures / "data/lorem_ipsum_long.pbin").string()));
  auto ds = h.get<Dataset>("train_dataset");
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->size(), 1300);  // (332 875 - 1) div 256
  EXPECT_EQ(ds->token_size_in_bytes(), 2);
  const Sample s = ds->get(642);
  ASSERT_EQ(s.size(), 1u);
  const at::Tensor& t = s.at("input_ids");
  EXPECT_EQ(t.scalar_type(), at::kLong);  // quirk Q12: int64 whatever the file's token size
  EXPECT_EQ(t.sizes(), (std::vector<std::int64_t>{257}));
  EXPECT_THAT(head(t, 6), ElementsAre(2797, 3384, 2248, 382, 2123, 288));
  // Consecutive samples share exactly one token.
  EXPECT_EQ(values(ds->get(641).at("input_ids")).back(), values(t).front());
  EXPECT_EQ(values(ds->get(1299).at("input_ids")).size(), 257u);
}

TEST_F(DatasetsTest, ContinuousDatasetWithoutReuseCutsDisjointBlocks) {
  h.set("short_dataset.config.reuse_last_target", Value(false));
  auto ds = h.get<Dataset>("short_dataset");
  EXPECT_EQ(ds->size(), 40);  // data/sample/eval.pbin: 10 285 div 256
  const std::string bytes = testing::read_file(fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data/sample/eval.pbin");
  for (std::int64_t i : {0, 1, 39}) {
    const auto v = values(ds->get(i).at("input_ids"));
    ASSERT_EQ(v.size(), 256u);
    for (std::size_t k = 0; k < v.size(); ++k)
      ASSERT_EQ(v[k], token_of(bytes, static_cast<std::size_t>(i) * 256 + k)) << "sample " << i << " token " << k;
  }
  h.set("short_dataset.config.reuse_last_target", Value(true));
  EXPECT_EQ(h.get<Dataset>("short_dataset")->size(), 40);  // (10 285 - 1) div 256
}

TEST_F(DatasetsTest, ContinuousDatasetReadsLegacyFilesWithoutTheirIndex) {
  // tiny.pbin with absolute (pre-2024-06) index offsets and with a damaged index:
  // the continuous dataset never reads the index.
  const fs::path dir = fs::temp_directory_path() / fmt::format("datasets_test_{}", ::getpid());
  fs::create_directories(dir);
  std::string tiny = testing::read_file(testing::tiny_example_dir() / "tiny.pbin");
  const std::string data = tiny.substr(0, 22);
  std::ofstream(dir / "legacy.pbin", std::ios::binary)
      << data << formats::pickle_index(std::vector<formats::IndexEntry>{{12, 4}, {16, 6}});
  std::ofstream(dir / "broken_index.pbin", std::ios::binary) << data << "garbage";
  for (const char* name : {"legacy.pbin", "broken_index.pbin"}) {
    h.set("short_dataset.config.raw_data_path", Value((dir / name).string()));
    h.set("short_dataset.config.sequence_length", Value(2));
    auto ds = h.get<Dataset>("short_dataset");
    ASSERT_NE(ds, nullptr) << name;
    EXPECT_EQ(ds->size(), 2) << name;  // 5 tokens: [0, 3), [2, 5)
    EXPECT_THAT(values(ds->get(1).at("input_ids")), ElementsAre(10603, 0, 50256)) << name;
  }
  fs::remove_all(dir);
}

TEST_F(DatasetsTest, ContinuousDatasetValidatorsNameTheConfigPath) {
  h.set("train_dataset.config.sequence_length", Value(1));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataset.config.sequence_length: must be > 1, got 1"));
  h.set("train_dataset.config.sequence_length", Value(2.5));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataset.config.sequence_length: expected an integer"));
  h.set("train_dataset.config.sequence_length", Value("256"));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataset.config.sequence_length: expected an integer"));
  h.set("train_dataset.config.sequence_length", Value(233300));  // needs 233 301 tokens with reuse
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("train_dataset.config.sequence_length"),
                                     HasSubstr("holds 233300 tokens, fewer than one sample of 233301")));
  h.set("train_dataset.config.reuse_last_target", Value(false));
  EXPECT_EQ(h.build_error(), "");
  EXPECT_EQ(h.get<Dataset>("train_dataset")->size(), 1);
  h.set("train_dataset.config.reuse_last_target", Value(1));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataset.config.reuse_last_target: expected a boolean"));
  h.set("train_dataset.config.reuse_last_target", Value(true));
  h.set("train_dataset.config.sequence_length", Value(256));
  h.erase("train_dataset.config.sample_key");
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataset.config.sample_key: missing required key"));
  h.set("train_dataset.config.sample_key", Value("input_ids"));
  h.set("train_dataset.config.block_size", Value(256));
  EXPECT_THAT(h.build_error(), HasSubstr("train_dataset.config.block_size: unknown key"));
}

TEST_F(DatasetsTest, BadPbinFilesAreReportedAtRawDataPath) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("datasets_test_bad_{}", ::getpid());
  fs::create_directories(dir);
  const std::string good = testing::read_file(fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data/sample/eval.pbin");
  std::ofstream(dir / "truncated.pbin", std::ios::binary) << good.substr(0, 1000);
  std::ofstream(dir / "empty.pbin", std::ios::binary) << "";
  std::string ts3 = good;
  ts3[8] = 3;
  std::ofstream(dir / "ts3.pbin", std::ios::binary) << ts3;
  const std::pair<const char*, const char*> cases[] = {{"truncated.pbin", "truncated"},
                                                       {"empty.pbin", "too short"},
                                                       {"ts3.pbin", "token size 3"},
                                                       {"missing.pbin", "cannot open"}};
  for (const auto& [name, why] : cases) {
    h.set("train_dataset.config.raw_data_path", Value((dir / name).string()));
    EXPECT_THAT(h.build_error(),
                AllOf(HasSubstr("train_dataset.config.raw_data_path"), HasSubstr(name), HasSubstr(why)))
        << name;
  }
  fs::remove_all(dir);
}

TEST_F(DatasetsTest, OutOfRangeIndexThrows) {
  auto ds = h.get<Dataset>("train_dataset");
  EXPECT_THROW(ds->get(911), Error);
  EXPECT_THROW(ds->get(-1), Error);
}

TEST_F(DatasetsTest, CombinedConcatenates) {
  auto combined = h.get<Dataset>("combined_dataset");
  auto a = h.get<Dataset>("short_dataset");
  auto b = h.get<Dataset>("train_dataset");
  ASSERT_EQ(combined->size(), 40 + 911);
  EXPECT_EQ(combined->token_size_in_bytes(), 2);
  for (std::int64_t g : {0, 39, 40, 41, 673, 950}) {
    const at::Tensor expected = g < 40 ? a->get(g).at("input_ids") : b->get(g - 40).at("input_ids");
    EXPECT_TRUE(combined->get(g).at("input_ids").equal(expected)) << g;
  }
  EXPECT_THROW(combined->get(951), Error);
  h.set("combined_dataset.config.datasets", Value(Value::List{Value(3)}));
  EXPECT_THAT(h.build_error(), HasSubstr("combined_dataset.config.datasets[0]: expected a Dataset"));
}

TEST_F(DatasetsTest, WeightedMixtureFollowsItsSchedule) {
  auto mix = h.get<Dataset>("mixture_dataset");
  auto a = h.get<Dataset>("short_dataset");
  auto b = h.get<Dataset>("train_dataset");
  ASSERT_EQ(mix->size(), 400);
  const MixtureSchedule schedule({1.0, 3.0}, {40, 911}, 400, 42, true);
  std::vector<std::int64_t> from_a;
  for (std::int64_t g = 0; g < 400; ++g) {
    const auto [j, local] = schedule.at(g);
    const at::Tensor expected = (j == 0 ? a : b)->get(local).at("input_ids");
    ASSERT_TRUE(mix->get(g).at("input_ids").equal(expected)) << g;
    if (j == 0) from_a.push_back(local);
  }
  // 100 draws from a 40-sample source: two full passes (each a permutation) and 20 more.
  ASSERT_EQ(from_a.size(), 100u);
  for (int pass = 0; pass < 2; ++pass) {
    std::set<std::int64_t> seen(from_a.begin() + 40 * pass, from_a.begin() + 40 * (pass + 1));
    EXPECT_EQ(seen.size(), 40u) << "pass " << pass;
  }
  EXPECT_FALSE(std::equal(from_a.begin(), from_a.begin() + 40, from_a.begin() + 40)) << "passes use the same order";
  // Resumable: a fresh build gives the same sample at any position.
  h.set("mixture_dataset.config.seed", Value(42));
  EXPECT_TRUE(h.get<Dataset>("mixture_dataset")->get(317).at("input_ids").equal(mix->get(317).at("input_ids")));
}

TEST_F(DatasetsTest, WeightedMixtureDefaultsToTheLongestMixtureWithoutRepetition) {
  h.erase("mixture_dataset.config.num_samples");
  auto mix = h.get<Dataset>("mixture_dataset");
  // short_dataset (40 samples, weight 1/4) runs out first: its 41st draw would be position 161.
  EXPECT_EQ(mix->size(), 161);
}

TEST_F(DatasetsTest, WeightedMixtureValidatorsNameTheConfigPath) {
  h.set("mixture_dataset.config.weights", Value(Value::List{Value(1.0)}));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.weights: expected one weight per dataset (2), got 1"));
  h.set("mixture_dataset.config.weights", Value(Value::List{Value(1.0), Value(-2.0)}));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.weights[1]: must be >= 0"));
  h.set("mixture_dataset.config.weights", Value(Value::List{Value(0.0), Value(0)}));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.weights: at least one weight must be positive"));
  h.set("mixture_dataset.config.weights", Value(Value::List{Value(1.0), Value("x")}));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.weights[1]: expected a number"));
  h.set("mixture_dataset.config.weights", Value(Value::List{Value(1.0), Value(3.0)}));
  h.set("mixture_dataset.config.num_samples", Value(-1));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.num_samples: must be >= 0"));
  h.set("mixture_dataset.config.num_samples", Value(std::int64_t{1} << 41));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.num_samples: must be in [0, 2^40]"));
  h.set("mixture_dataset.config.num_samples", Value(10));
  h.set("mixture_dataset.config.datasets", Value(Value::List{}));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.datasets: must not be empty"));
}

TEST_F(DatasetsTest, WeightedMixtureRejectsAnEmptySourceWithPositiveWeight) {
  h.set("random_dataset.config.num_samples", Value(0));
  h.set("mixture_dataset.config.datasets[0]",
        Value(Value::Table{{"instance_key", Value("random_dataset")}, {"pass_type", Value("BY_REFERENCE")}}));
  EXPECT_THAT(h.build_error(), HasSubstr("mixture_dataset.config.datasets[0]: is empty but has a positive weight"));
}

TEST_F(DatasetsTest, DummyDatasetHasTheDefinedShapesTypesAndRanges) {
  auto ds = h.get<Dataset>("random_dataset");
  EXPECT_EQ(ds->size(), 16);
  const Sample s = ds->get(3);
  EXPECT_EQ(s.at("input_ids").scalar_type(), at::kLong);
  EXPECT_EQ(s.at("input_ids").sizes(), (std::vector<std::int64_t>{33}));
  EXPECT_GE(s.at("input_ids").min().item<std::int64_t>(), 0);
  EXPECT_LT(s.at("input_ids").max().item<std::int64_t>(), 512);
  EXPECT_EQ(s.at("noise").scalar_type(), at::kDouble);
  EXPECT_EQ(s.at("noise").sizes(), (std::vector<std::int64_t>{2, 4}));
  // Seeded: a pure function of (seed, index); different indices differ.
  EXPECT_TRUE(ds->get(3).at("noise").equal(s.at("noise")));
  EXPECT_FALSE(ds->get(4).at("input_ids").equal(s.at("input_ids")));
  h.set("random_dataset.config.seed", Value());
  auto unseeded = h.get<Dataset>("random_dataset");
  EXPECT_FALSE(unseeded->get(3).at("noise").equal(unseeded->get(3).at("noise")));
}

TEST_F(DatasetsTest, DummyDatasetValidatorsNameTheConfigPath) {
  h.set("random_dataset.config.sample_definition[0].sample_type", Value("long"));
  EXPECT_THAT(h.build_error(),
              HasSubstr("random_dataset.config.sample_definition[0].sample_type: must be one of 'float', 'int'"));
  h.set("random_dataset.config.sample_definition[0].sample_type", Value("int"));
  h.set("random_dataset.config.sample_definition[1].sample_shape", Value(Value::List{Value(2), Value(-4)}));
  EXPECT_THAT(h.build_error(), HasSubstr("random_dataset.config.sample_definition[1].sample_shape[1]: must be >= 0"));
  h.set("random_dataset.config.sample_definition[1].sample_shape", Value(Value::List{Value(2)}));
  h.set("random_dataset.config.num_samples", Value(-3));
  EXPECT_THAT(h.build_error(), HasSubstr("random_dataset.config.num_samples: must be >= 0"));
}

// --- mem_map_dataset ----------------------------------------------------------

class MemMapDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    register_byte_tokenizer(h);
    h.set_config_text(fmt::format(R"(
[tokenizer]
component_key = "tokenizer"
variant_key = "byte_test"
config = {{}}

[jsonl_dataset]
component_key = "dataset"
variant_key = "mem_map_dataset"
config = {{ raw_data_path = "{}", tokenizer = {{ instance_key = "tokenizer", pass_type = "BY_REFERENCE" }}, jq_pattern = ".text", sample_key = "input_ids" }}
)",
                                  (testing::tiny_example_dir() / "tiny.jsonl").string()));
  }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

std::vector<std::int64_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const unsigned char*>(s.data()),
          reinterpret_cast<const unsigned char*>(s.data()) + s.size()};
}

TEST_F(MemMapDatasetTest, TokenizesTheSelectedTextOfEachLine) {
  auto ds = h.get<Dataset>("jsonl_dataset");
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->size(), 2);
  EXPECT_EQ(values(ds->get(0).at("input_ids")), bytes_of("Hello"));  // no EOD appended, as in Modalities
  EXPECT_EQ(values(ds->get(1).at("input_ids")), bytes_of("World!"));
  EXPECT_EQ(ds->get(1).at("input_ids").scalar_type(), at::kLong);
}

TEST_F(MemMapDatasetTest, FollowsNestedAndBracketedPaths) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("memmap_test_{}", ::getpid());
  fs::create_directories(dir);
  const std::string jsonl = "{\"a\": {\"b c\": \"xy\"}}\n{\"a\": {\"b c\": 5}}\n{\"a\": [1]}\n{\"z\": 1}\nnot json";
  std::ofstream(dir / "nested.jsonl", std::ios::binary) << jsonl;
  std::vector<formats::IndexEntry> index;  // the line splitting of docs/data.md
  for (std::size_t p = 0; p < jsonl.size();) {
    const std::size_t q = std::min(jsonl.find('\n', p), jsonl.size());
    index.emplace_back(p, q - p);
    p = q + 1;
  }
  std::ofstream(dir / "nested.idx", std::ios::binary) << formats::pickle_index(index);
  h.set("jsonl_dataset.config.raw_data_path", Value((dir / "nested.jsonl").string()));
  h.set("jsonl_dataset.config.jq_pattern", Value(".a[\"b c\"]"));
  auto ds = h.get<Dataset>("jsonl_dataset");
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(values(ds->get(0).at("input_ids")), bytes_of("xy"));
  auto error_of = [&](std::int64_t i) {
    try {
      ds->get(i);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_THAT(error_of(1), AllOf(HasSubstr("nested.jsonl:2: "), HasSubstr("selects a number, not a string")));
  EXPECT_THAT(error_of(2), AllOf(HasSubstr("nested.jsonl:3: "), HasSubstr("cannot index an array")));
  EXPECT_THAT(error_of(3), AllOf(HasSubstr("nested.jsonl:4: "), HasSubstr("selects null (the key \"a\" is missing)")));
  EXPECT_THAT(error_of(4), AllOf(HasSubstr("nested.jsonl:5: "), HasSubstr("invalid JSON")));
  fs::remove_all(dir);
}

TEST_F(MemMapDatasetTest, ValidatorsNameTheConfigPath) {
  h.set("jsonl_dataset.config.jq_pattern", Value(".text | length"));
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("jsonl_dataset.config.jq_pattern: unsupported jq_pattern"),
                                     HasSubstr("Supported: a path of keys and array indices")));
  h.set("jsonl_dataset.config.jq_pattern", Value("text"));
  EXPECT_THAT(h.build_error(), HasSubstr("jsonl_dataset.config.jq_pattern: unsupported jq_pattern 'text'"));
  h.set("jsonl_dataset.config.jq_pattern", Value(".text"));
  h.set("jsonl_dataset.config.raw_data_path", Value("does/not/exist.jsonl"));
  EXPECT_THAT(h.build_error(),
              HasSubstr("jsonl_dataset.config.raw_data_path: file 'does/not/exist.jsonl' does not exist"));
  h.set("jsonl_dataset.config.raw_data_path",
        Value((fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data/sample/eval.jsonl").string()));
  h.set("jsonl_dataset.config.index_path",
        Value((testing::tiny_example_dir() / "tiny.jsonl").string()));  // not a pickle
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("jsonl_dataset.config.index_path"), HasSubstr("index pickle")));
  h.set("jsonl_dataset.config.raw_data_path", Value((testing::tiny_example_dir() / "tiny.jsonl").string()));
  h.set("jsonl_dataset.config.index_path",
        Value((fs::path(MODALITIES_TEST_SOURCE_ROOT) / "data/sample/eval.idx").string()));  // longer file's index
  EXPECT_THAT(h.build_error(), AllOf(HasSubstr("jsonl_dataset.config.index_path"), HasSubstr("does not belong to")));
  h.erase("jsonl_dataset.config.index_path");
  h.set("jsonl_dataset.config.tokenizer", Value(7));
  EXPECT_THAT(h.build_error(), HasSubstr("jsonl_dataset.config.tokenizer: expected a Tokenizer"));
}

// mem_map_dataset over `jsonl` with the tokenizer folder `tokenizer` gives the documents of
// `pbin` (packed from the same file with that tokenizer) without their EOD `eod`.
void expect_mem_map_equals_packed(const fs::path& tokenizer, const fs::path& jsonl, const fs::path& pbin,
                                  std::int64_t eod) {
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_HF_TOKENIZER_PLUGIN);
  h.set_config_text(fmt::format(R"(
[tokenizer]
component_key = "tokenizer"
variant_key = "pretrained_hf_tokenizer"
config = {{ pretrained_model_name_or_path = "{}", padding = false, truncation = false }}

[jsonl_dataset]
component_key = "dataset"
variant_key = "mem_map_dataset"
config = {{ raw_data_path = "{}", tokenizer = {{ instance_key = "tokenizer", pass_type = "BY_REFERENCE" }}, jq_pattern = ".text", sample_key = "input_ids" }}
)",
                                tokenizer.string(), jsonl.string()));
  auto ds = h.get<Dataset>("jsonl_dataset");
  ASSERT_NE(ds, nullptr) << h.build_error();
  const formats::PackedFile packed(pbin);
  ASSERT_EQ(ds->size(), static_cast<std::int64_t>(packed.num_documents()));
  for (std::int64_t k = 0; k < ds->size(); ++k) {
    std::vector<std::int64_t> doc = packed.document(static_cast<std::uint64_t>(k));
    ASSERT_EQ(doc.back(), eod);
    doc.pop_back();
    EXPECT_EQ(values(ds->get(k).at("input_ids")), doc) << "document " << k;
  }
}

// data/sample/eval.pbin = Modalities 0.5.0's packing of eval.jsonl with gpt2_style_8k, EOD 0.
TEST(MemMapDatasetSampleTest, TokensEqualThePackedDocumentsWithoutTheirEod) {
  const fs::path root(MODALITIES_TEST_SOURCE_ROOT);
  expect_mem_map_equals_packed(root / "data/tokenizer/gpt2_style_8k", root / "data/sample/eval.jsonl",
                               root / "data/sample/eval.pbin", 0);
}

// Modalities' lorem_ipsum.pbin = GPT-2 tokens of each lorem_ipsum.jsonl line + EOD 50256 (../shared).
TEST(MemMapDatasetGpt2Test, TokensEqualThePackedDocumentsWithoutTheirEod) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  expect_mem_map_equals_packed(kFixtures / "data/tokenizer/hf_gpt2", kFixtures / "data/lorem_ipsum.jsonl",
                               kFixtures / "data/lorem_ipsum.pbin", 50256);
}

}  // namespace
}  // namespace modalities::plugins::datasets
