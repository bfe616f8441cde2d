// inference_component/text built from TOML through the registry, with the
// bundled GPT-2 tokenizer (hf_tokenizer plugin) and a deterministic test model
// defined here: its logits favour token (last + 1) mod V, or the next entry of
// a scripted chain. Checks greedy generation, top-k / top-p / seed behaviour,
// the eod stop, UTF-8-safe streaming, the prompt template and its errors.
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/text_inference_component.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <filesystem>
#include <sstream>

namespace modalities::plugins::text_inference {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

// GPT-2's tokenizer as Modalities ships it, from ../shared (the ids below are GPT-2's; the tests
// that use it skip where ../shared is absent).
const fs::path kGpt2 = fs::path(MODALITIES_TEST_FIXTURES_DIR) / "data" / "tokenizer" / "hf_gpt2";
const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";
constexpr std::int64_t kEod = 50256;  // <|endoftext|>

struct NextTokenConfig {
  std::int64_t vocab_size = 0;
  double strength = 10.0;
  std::vector<std::int64_t> script;

  static void describe(Schema<NextTokenConfig>& s) {
    s.field("vocab_size", &NextTokenConfig::vocab_size, "V").required();
    s.field("strength", &NextTokenConfig::strength, "logit of the favoured token (others 0)");
    s.field("script", &NextTokenConfig::script, "after script[i] comes script[i+1]");
  }
};

// Logits [1, L, V]: at each position t, `strength` for the successor of x[t]
// and 0 elsewhere. Reads "tokens", writes "scores", so a component that
// hard-codes Modalities' "input_ids"/"logits" fails.
class NextTokenModel final : public Module {
 public:
  explicit NextTokenModel(const NextTokenConfig& c) : c_(c), impl_(std::make_shared<torch::nn::Module>("NextToken")) {}

  TensorMap forward(const TensorMap& inputs) override {
    ++calls;
    grad_was_enabled = grad_was_enabled || at::GradMode::is_enabled();
    was_training = was_training || is_training();
    const at::Tensor x = inputs.at("tokens").to(at::kCPU);  // [1, L]
    at::Tensor next = (x + 1).remainder(c_.vocab_size);
    for (std::size_t i = 0; i + 1 < c_.script.size(); ++i) next = at::where(x == c_.script[i], c_.script[i + 1], next);
    return {{"scores", at::one_hot(next, c_.vocab_size).to(at::kFloat) * c_.strength}};
  }
  torch::nn::Module& module() override { return *impl_; }
  const torch::nn::Module& module() const override { return *impl_; }
  std::string sample_key() const override { return "tokens"; }
  std::string prediction_key() const override { return "scores"; }

  int calls = 0;
  bool grad_was_enabled = false;
  bool was_training = false;

 private:
  NextTokenConfig c_;
  std::shared_ptr<torch::nn::Module> impl_;
};

Value toml_ids(const std::vector<std::int64_t>& ids) {
  Value::List list;
  for (auto id : ids) list.emplace_back(id);
  return Value(std::move(list));
}

// The generated text of every prompt in a session's output.
std::vector<std::string> outputs(const std::string& session) {
  const std::string head = "--------------------OUTPUT--------------------\n\n";
  std::vector<std::string> out;
  for (auto begin = session.find(head); begin != std::string::npos; begin = session.find(head, begin + 1)) {
    const auto end = session.find("\n<reached", begin);
    if (end == std::string::npos) break;
    out.push_back(session.substr(begin + head.size(), end - begin - head.size()));
  }
  return out;
}

class TextInferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MODALITIES_REQUIRE_SHARED(kGpt2);
    h.load_plugin(MODALITIES_TEST_HF_TOKENIZER_PLUGIN);
    auto problem = h.registry().register_plugin({"text_inference_test_model", "0.0.0", {}, {}, {}}, [](Registrar& r) {
      r.add<Module, NextTokenConfig>("next_token_for_test", "deterministic successor logits",
                                     [](const NextTokenConfig& c) { return std::make_shared<NextTokenModel>(c); });
    });
    ASSERT_FALSE(problem) << *problem;
    reset_config();
  }

  void reset_config() {
    h.set_config_text(fmt::format(R"(
[tokenizer]
component_key = "tokenizer"
variant_key = "pretrained_hf_tokenizer"
config = {{ pretrained_model_name_or_path = "{}" }}

[model]
component_key = "model"
variant_key = "next_token_for_test"
config = {{ vocab_size = 50257 }}

[text_inference_component]
component_key = "inference_component"
variant_key = "text"
[text_inference_component.config]
model = {{ instance_key = "model", pass_type = "BY_REFERENCE" }}
tokenizer = {{ instance_key = "tokenizer", pass_type = "BY_REFERENCE" }}
prompt_template = "{{prompt}}"
sequence_length = 12
temperature = 0.0
eod_token = "<|endoftext|>"
device = "cpu"
)",
                                  kGpt2.string()));
  }

  std::shared_ptr<TextInferenceComponent> component() {
    auto c = h.get<TextInferenceComponent>("text_inference_component");
    EXPECT_NE(c, nullptr) << h.build_error();
    return c;
  }
  std::shared_ptr<Tokenizer> tokenizer() { return h.get<Tokenizer>("tokenizer"); }
  std::shared_ptr<NextTokenModel> model() { return std::static_pointer_cast<NextTokenModel>(h.get<Module>("model")); }

  // The whole session's output for `input`.
  std::string session(const std::string& input) {
    std::istringstream in(input);
    std::ostringstream out;
    component()->run(in, out);
    return out.str();
  }

  // The generated text of the first prompt of a session.
  std::string generated(const std::string& input) {
    const std::string out = session(input);
    const auto all = outputs(out);
    EXPECT_FALSE(all.empty()) << out;
    return all.empty() ? std::string() : all.front();
  }

  std::string decode(std::vector<std::int64_t> ids) { return tokenizer()->decode(ids); }

  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

TEST_F(TextInferenceTest, GreedyFollowsTheModelDeterministicallyWithoutGradInEvalMode) {
  const std::vector<std::int64_t> prompt = tokenizer()->tokenize("Hello world");
  std::vector<std::int64_t> want;
  for (auto id = prompt.back() + 1; static_cast<std::int64_t>(prompt.size() + want.size()) < 12; ++id)
    want.push_back(id);
  const std::string out = session("Hello world\n");
  EXPECT_EQ(out,
            "prompt: --------------------PROMPT--------------------\nPrompt:  Hello world\n\n"
            "--------------------OUTPUT--------------------\n\n" +
                decode(want) + "\n<reached max tokens>\nprompt: \n");
  EXPECT_EQ(session("Hello world\n"), out);
  EXPECT_EQ(model()->calls, 2 * static_cast<int>(want.size()));
  EXPECT_FALSE(model()->grad_was_enabled);
  EXPECT_FALSE(model()->was_training);
}

TEST_F(TextInferenceTest, TopKOneEqualsGreedy) {
  const std::string greedy = generated("The answer is\n");
  h.set("text_inference_component.config.temperature", 1.0);
  h.set("text_inference_component.config.top_k", 1);
  EXPECT_EQ(generated("The answer is\n"), greedy);
}

TEST_F(TextInferenceTest, SmallTopPKeepsOnlyTheMostLikelyToken) {
  const std::string greedy = generated("The answer is\n");
  // p(favoured) = e^10 / (e^10 + 50256) ~ 0.30 >= 0.25: the nucleus is that one token.
  h.set("text_inference_component.config.temperature", 1.0);
  h.set("text_inference_component.config.top_p", 0.25);
  EXPECT_EQ(generated("The answer is\n"), greedy);
  h.set("text_inference_component.config.top_p", 0.99);
  h.set("text_inference_component.config.seed", 3);
  EXPECT_NE(generated("The answer is\n"), greedy);
}

TEST_F(TextInferenceTest, SameSeedGivesTheSameTextOtherSeedsDiffer) {
  h.set("model.config.strength", 1.0);  // nearly uniform: every draw matters
  h.set("text_inference_component.config.temperature", 1.0);
  h.set("text_inference_component.config.top_k", 1000);
  h.set("text_inference_component.config.seed", 1234);
  const std::string a = generated("Once upon a time\n");
  EXPECT_EQ(generated("Once upon a time\n"), a);  // a fresh component, same seed
  // Every prompt starts from the seed, so a session's second prompt repeats the first.
  EXPECT_EQ(outputs(session("Once upon a time\nOnce upon a time\n")), (std::vector<std::string>{a, a}));
  h.set("text_inference_component.config.seed", 1235);
  EXPECT_NE(generated("Once upon a time\n"), a);
}

TEST_F(TextInferenceTest, StopsAtTheEodTokenWithoutPrintingIt) {
  const std::string prompt = decode({50250});
  ASSERT_EQ(tokenizer()->tokenize(prompt), std::vector<std::int64_t>{50250});
  h.set("text_inference_component.config.sequence_length", 100);
  const std::string out = session(prompt + "\n");
  EXPECT_THAT(out, HasSubstr(decode({50251, 50252, 50253, 50254, 50255}) + "\n<reached end of document token>\n"));
  EXPECT_THAT(out, Not(HasSubstr("<|endoftext|>")));
  EXPECT_EQ(model()->calls, 6);
}

TEST_F(TextInferenceTest, EodTokenThatIsNotOneTokenFallsBackToModalitiesTextRule) {
  // "<eod>" (Modalities' default) is no GPT-2 token: build warns, and the
  // decoded-text comparison still stops at a token spelled exactly so.
  h.set("text_inference_component.config.eod_token", decode({50253}));
  h.set("text_inference_component.config.sequence_length", 100);
  EXPECT_EQ(generated(decode({50250}) + "\n"), decode({50251, 50252}));
  // Not a token and never decoded: only the length limit stops, and <|endoftext|> is ordinary text.
  h.set("text_inference_component.config.eod_token", "<eod>");
  h.set("text_inference_component.config.max_new_tokens", 8);
  const std::string out = session(decode({50250}) + "\n");
  EXPECT_EQ(outputs(out), std::vector<std::string>{decode({50251, 50252, 50253, 50254, 50255, kEod, 0, 1})});
  EXPECT_THAT(out, HasSubstr("\n<reached max tokens>\n"));
}

TEST_F(TextInferenceTest, StreamsMultiByteCharactersWhole) {
  // "€" is E2 82 AC: three byte tokens; after the first two, decode shows U+FFFD.
  auto tok = tokenizer();
  const std::int64_t colon = tok->tokenize("Price:").back();
  const std::vector<std::int64_t> euro = {tok->token_id("\xC3\xA2"), tok->token_id("\xC4\xA4"),
                                          tok->token_id("\xC2\xAC")};
  ASSERT_EQ(decode(euro), "\xE2\x82\xAC");
  ASSERT_EQ(decode({euro[0], euro[1]}), "\xEF\xBF\xBD");  // what a naive suffix diff would print and never fix
  h.set("model.config.script", toml_ids({colon, euro[0], euro[1], euro[2], kEod}));
  h.set("text_inference_component.config.sequence_length", 100);
  EXPECT_EQ(generated("Price:\n"), "\xE2\x82\xAC");
}

TEST_F(TextInferenceTest, NeverSamplesIdsBeyondTheTokenizerVocabulary) {
  h.set("model.config.vocab_size", 50304);  // padded embedding, as GPT-2 configs use
  h.set("model.config.script", toml_ids({kEod, 50300}));
  h.set("text_inference_component.config.sequence_length", 4);
  // After <|endoftext|> the model favours 50300; greedy over the 50257 decodable ids picks id 0 ("!").
  EXPECT_EQ(generated(decode({kEod}) + "\n").substr(0, 1), "!");
  h.set("text_inference_component.config.temperature", 1.0);
  h.set("text_inference_component.config.seed", 0);
  EXPECT_NO_THROW(generated(decode({kEod}) + "\n"));
}

TEST_F(TextInferenceTest, MaxNewTokensCapsTheLength) {
  h.set("text_inference_component.config.sequence_length", 100);
  h.set("text_inference_component.config.max_new_tokens", 3);
  const std::int64_t last = tokenizer()->tokenize("Hi").back();
  EXPECT_EQ(generated("Hi\n"), decode({last + 1, last + 2, last + 3}));
  EXPECT_EQ(model()->calls, 3);
}

TEST_F(TextInferenceTest, FillsEveryPlaceholderOnceAndLoopsUntilEndOfInput) {
  h.set("text_inference_component.config.prompt_template", "Q: {question} ({question}) {{{lang}}}\nA:");
  h.set("text_inference_component.config.sequence_length", 20);
  const std::string out = session("Why?\nen\nHow?\nde\nWhen?\n");
  EXPECT_THAT(
      out,
      HasSubstr("question: lang: --------------------PROMPT--------------------\nPrompt:  Q: Why? (Why?) {en}\nA:\n"));
  EXPECT_THAT(out, HasSubstr("Prompt:  Q: How? (How?) {de}\nA:\n"));
  EXPECT_THAT(out, ::testing::EndsWith("<reached max tokens>\nquestion: lang: \n"));  // EOF after "When?"
}

TEST_F(TextInferenceTest, TemplateWithoutPlaceholdersGeneratesOnceWithoutReading) {
  h.set("text_inference_component.config.prompt_template", "Hello world");
  std::istringstream in("ignored\n");
  std::ostringstream out;
  component()->run(in, out);
  EXPECT_THAT(out.str(),
              ::testing::StartsWith("--------------------PROMPT--------------------\nPrompt:  Hello world\n"));
  EXPECT_THAT(out.str(), ::testing::EndsWith("<reached max tokens>\n"));
  std::string rest;
  std::getline(in, rest);
  EXPECT_EQ(rest, "ignored");
}

TEST_F(TextInferenceTest, EmptyInputReturnsAndEmptyPromptIsAnError) {
  EXPECT_EQ(session(""), "prompt: \n");
  try {
    session("\n");
    FAIL() << "an empty prompt must be an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("the prompt is empty"));
  }
}

TEST_F(TextInferenceTest, PromptLongerThanTheSequenceIsAnError) {
  h.set("text_inference_component.config.sequence_length", 2);
  try {
    session("one two three\n");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr("the prompt has 3 tokens, which leaves no room to generate within sequence_length 2"));
  }
}

TEST_F(TextInferenceTest, RejectsBadConfigValues) {
  auto expect_error = [&](const std::string& key, Value v) {
    h.set("text_inference_component.config." + key, std::move(v));
    EXPECT_THAT(h.build_error(), HasSubstr("text_inference_component.config." + key)) << key;
    reset_config();
  };
  expect_error("prompt_template", Value(std::string("{unclosed")));
  expect_error("prompt_template", Value(std::string("empty {} field")));
  expect_error("prompt_template", Value(std::string("stray } brace")));
  expect_error("temperature", Value(-0.5));
  expect_error("top_k", Value(std::int64_t{-1}));
  expect_error("top_p", Value(0.0));
  expect_error("top_p", Value(1.5));
  expect_error("max_new_tokens", Value(std::int64_t{0}));
  expect_error("sequence_length", Value(std::int64_t{0}));
  expect_error("device", Value(std::string("gpu")));
  expect_error("device", Value(std::int64_t{-1}));
  h.erase("text_inference_component.config.device");
  EXPECT_THAT(h.build_error(), HasSubstr("text_inference_component.config.device"));
}

TEST_F(TextInferenceTest, DeviceIntegerMeansCuda) {
  h.set("text_inference_component.config.device", 0);
  if (at::hasCUDA()) {
    EXPECT_EQ(h.build_error(), "");
    EXPECT_EQ(generated("Hello world\n"),
              decode({995 + 1, 995 + 2, 995 + 3, 995 + 4, 995 + 5, 995 + 6, 995 + 7, 995 + 8, 995 + 9, 995 + 10}));
  } else {
    EXPECT_THAT(h.build_error(), HasSubstr("cuda"));
  }
}

TEST(TextInferenceExampleTest, ExampleConfigBuildsWithTheBundledTokenizer) {
  fs::current_path(MODALITIES_TEST_SOURCE_ROOT);  // the example's tokenizer path is relative to the repository root
  testing::Harness h{MODALITIES_TEST_PLUGIN};
  h.load_plugin(MODALITIES_TEST_HF_TOKENIZER_PLUGIN);
  h.load_plugin(fs::path(MODALITIES_TEST_HF_TOKENIZER_PLUGIN).parent_path() / "libmodalities_layer_norm.so");
  h.set_config_text(testing::read_file(kExample), kExample.string());
  EXPECT_NE(h.get<TextInferenceComponent>("text_inference_component"), nullptr) << h.build_error();
}

}  // namespace
}  // namespace modalities::plugins::text_inference
