// inference_component/text: Modalities' TextInferenceComponent (see
// README.md), the loop behind `modalities generate_text`. Fills the
// prompt template's {placeholders} from the input stream, then samples one
// token at a time (re-running the whole sequence; no KV cache, as Modalities)
// until the end-of-document token or the length limit, streaming the text.
// Fixed against Modalities: no autograd, the model's own input/output keys,
// top-k / top-p, a seedable private generator, UTF-8-safe streaming, and no
// ids beyond the tokenizer's vocabulary.
#include <modalities/sdk/device_setting.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/interfaces/text_inference_component.h>
#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <istream>
#include <limits>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace modalities {
namespace plugins::text_inference {
namespace {

struct TextInferenceConfig {
  Ref<Module> model;
  Ref<Tokenizer> tokenizer;
  std::string prompt_template;
  std::int64_t sequence_length = 0;
  double temperature = 1.0;
  std::string eod_token = "<eod>";
  DeviceSetting device;
  std::int64_t top_k = 0;
  double top_p = 1.0;
  std::optional<std::int64_t> seed;
  std::optional<std::int64_t> max_new_tokens;

  static void describe(Schema<TextInferenceConfig>& s) {
    using C = TextInferenceConfig;
    s.field("model", &C::model, "Language model; moved to `device` and put in eval mode.").required();
    s.field("tokenizer", &C::tokenizer, "Tokenizer of the model's vocabulary.").required();
    s.field("prompt_template", &C::prompt_template,
            "Prompt text; each {name} is asked for on the input stream ({{ and }} are literal braces). "
            "Without placeholders the template itself is the one prompt.")
        .required();
    s.field("sequence_length", &C::sequence_length, "Maximum prompt + generated tokens.").required().at_least(1);
    s.field("temperature", &C::temperature, "Logits are divided by it before sampling; 0 = greedy (argmax).")
        .non_negative();
    s.field("eod_token", &C::eod_token, "Generation stops when this token is produced (not printed).");
    s.field("device", &C::device, "Where the model runs: an integer N for cuda:N, or \"cpu\".").required();
    s.field("top_k", &C::top_k, "Sample only among the k most likely tokens; 0 = off. Our addition.").non_negative();
    s.field("top_p", &C::top_p,
            "Sample only among the most likely tokens whose probabilities sum to top_p (nucleus); 1.0 = off. "
            "Our addition.")
        .greater_than(0.0)
        .at_most(1.0);
    s.field("seed", &C::seed,
            "Seeds a private generator at the start of every prompt, so a prompt's text is reproducible; "
            "unset = the global generator. Our addition.");
    s.field("max_new_tokens", &C::max_new_tokens,
            "At most this many new tokens per prompt (also bounded by sequence_length). Our addition.")
        .at_least(1);
  }
};

// A prompt template split into literal text and {name} fields, the subset of
// Python's str.format that Modalities' templates use.
struct Template {
  struct Part {
    bool field = false;
    std::string text;  // literal text, or the field name
  };
  std::vector<Part> parts;
  std::vector<std::string> names;  // distinct field names, in order of first use

  static Template parse(const std::string& t) {
    Template out;
    std::string literal;
    for (std::size_t i = 0; i < t.size(); ++i) {
      const char c = t[i];
      if ((c == '{' || c == '}') && i + 1 < t.size() && t[i + 1] == c) {
        literal += c;
        ++i;
      } else if (c == '{') {
        const auto end = t.find_first_of("{}", i + 1);
        if (end == std::string::npos || t[end] != '}')
          throw ConfigError("prompt_template", fmt::format("the '{{' at position {} is not closed by '}}'", i),
                            "write {{ for a literal brace");
        const std::string name = t.substr(i + 1, end - i - 1);
        if (name.empty())
          throw ConfigError("prompt_template", fmt::format("empty placeholder '{{}}' at position {}", i),
                            "name it, e.g. {prompt}, or write {{}} for literal braces");
        if (!literal.empty()) out.parts.push_back({false, std::move(literal)});
        literal.clear();
        out.parts.push_back({true, name});
        if (std::find(out.names.begin(), out.names.end(), name) == out.names.end()) out.names.push_back(name);
        i = end;
      } else if (c == '}') {
        throw ConfigError("prompt_template", fmt::format("single '}}' at position {}", i),
                          "write }} for a literal brace");
      } else {
        literal += c;
      }
    }
    if (!literal.empty()) out.parts.push_back({false, std::move(literal)});
    return out;
  }

  std::string fill(const std::map<std::string, std::string>& answers) const {
    std::string s;
    for (const auto& p : parts) s += p.field ? answers.at(p.text) : p.text;
    return s;
  }
};

// Length of `s` without a trailing run of U+FFFD: what a byte-level
// tokenizer's decode shows for the first bytes of a character whose
// remaining bytes come with the next tokens.
std::size_t stable_length(const std::string& s) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  std::size_t n = s.size();
  while (n >= kReplacement.size() &&
         std::string_view(s).substr(n - kReplacement.size(), kReplacement.size()) == kReplacement)
    n -= kReplacement.size();
  return n;
}

class TextInference final : public TextInferenceComponent {
 public:
  TextInference(const TextInferenceConfig& c, BuildContext& ctx)
      : model_(c.model.shared()),
        tokenizer_(c.tokenizer.shared()),
        template_(Template::parse(c.prompt_template)),
        sequence_length_(c.sequence_length),
        temperature_(c.temperature),
        eod_token_(c.eod_token),
        top_k_(c.top_k),
        top_p_(c.top_p),
        seed_(c.seed),
        max_new_tokens_(c.max_new_tokens),
        device_(parse_run_device(c.device.text, "device")) {
    model_->to(device_, std::nullopt);
    model_->eval();
    sample_key_ = model_->sample_key();
    prediction_key_ = model_->prediction_key();
    if (sample_key_.empty() || prediction_key_.empty()) {
      ctx.warn(fmt::format("model {} declares no sample/prediction key; using Modalities' 'input_ids' -> 'logits'",
                           c.model.origin()));
      if (sample_key_.empty()) sample_key_ = "input_ids";
      if (prediction_key_.empty()) prediction_key_ = "logits";
    }
    try {
      eod_id_ = tokenizer_->token_id(eod_token_);
    } catch (const Error& e) {
      ctx.warn(
          fmt::format("eod_token '{}' is not a single token of the tokenizer ({}); generation stops only when a "
                      "token decodes to exactly that text, or at the length limit",
                      eod_token_, e.what()));
    }
    vocab_size_ = tokenizer_->vocab_size();
  }

  void run(std::istream& in, std::ostream& out) override {
    if (template_.names.empty()) {  // non-interactive: the template is the prompt
      generate(template_.fill({}), out);
      return;
    }
    while (true) {
      std::map<std::string, std::string> answers;
      for (const auto& name : template_.names) {
        out << name << ": " << std::flush;
        std::string line;
        if (!std::getline(in, line)) {
          out << "\n" << std::flush;
          return;  // end of input
        }
        if (!line.empty() && line.back() == '\r') line.pop_back();
        answers[name] = std::move(line);
      }
      generate(template_.fill(answers), out);
    }
  }

 private:
  void generate(const std::string& prompt, std::ostream& out) {
    if (prompt.empty())
      throw Error("the prompt is empty (prompt_template filled with the answers gives no text); type some text");
    std::vector<std::int64_t> ids = tokenizer_->tokenize(prompt);
    if (ids.empty()) throw Error(fmt::format("the prompt '{}' gives no tokens", prompt));
    const auto prompt_length = static_cast<std::int64_t>(ids.size());
    if (prompt_length >= sequence_length_)
      throw Error(fmt::format("the prompt has {} tokens, which leaves no room to generate within sequence_length {}",
                              prompt_length, sequence_length_));
    std::int64_t budget = sequence_length_ - prompt_length;
    if (max_new_tokens_) budget = std::min(budget, *max_new_tokens_);

    out << "--------------------PROMPT--------------------\n"
        << "Prompt:  " << tokenizer_->decode(ids) << "\n\n--------------------OUTPUT--------------------\n\n"
        << std::flush;

    at::NoGradGuard no_grad;
    std::optional<at::Generator> generator;
    if (seed_) generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(*seed_));
    std::vector<std::int64_t> generated;
    std::string printed;  // the decoded text written so far
    bool reached_eod = false;
    for (std::int64_t i = 0; i < budget; ++i) {
      const std::int64_t id = next_token(ids, generator);
      if (is_eod(id)) {
        reached_eod = true;
        break;
      }
      generated.push_back(id);
      ids.push_back(id);
      // Decode everything generated and print the new suffix, holding back a
      // trailing incomplete UTF-8 character until its last byte arrives.
      const std::string text = tokenizer_->decode(generated);
      const std::size_t stable = stable_length(text);
      if (stable > printed.size()) {
        out << text.substr(printed.size(), stable - printed.size()) << std::flush;
        printed = text.substr(0, stable);
      }
    }
    if (!generated.empty()) {
      const std::string text = tokenizer_->decode(generated);
      if (text.size() > printed.size()) out << text.substr(printed.size());
    }
    out << (reached_eod ? "\n<reached end of document token>\n" : "\n<reached max tokens>\n") << std::flush;
  }

  bool is_eod(std::int64_t id) const {
    if (eod_id_) return id == *eod_id_;
    return tokenizer_->decode(std::vector<std::int64_t>{id}) == eod_token_;  // Modalities' rule
  }

  // Shapes: input [1, L] -> logits [1, L, V] -> last position [V'] with V' = min(V, vocab size).
  std::int64_t next_token(const std::vector<std::int64_t>& ids, std::optional<at::Generator>& generator) {
    const at::Tensor input = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).to(device_).unsqueeze(0);  // [1, L]
    const TensorMap result = model_->forward({{sample_key_, input}});
    const auto it = result.find(prediction_key_);
    if (it == result.end()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : result) keys.push_back(k);
      throw Error(fmt::format("the model returned no '{}' (its prediction_key); it returned {}", prediction_key_,
                              quoted_list(keys)));
    }
    const at::Tensor& logits_all = it->second;
    MODALITIES_CHECK(
        logits_all.dim() == 3 && logits_all.size(0) == 1 && logits_all.size(1) == static_cast<std::int64_t>(ids.size()),
        "expected logits of shape [1, {}, vocab] from the model, got {}", ids.size(),
        fmt::format("[{}]", fmt::join(logits_all.sizes().begin(), logits_all.sizes().end(), ", ")));
    // Ids past the tokenizer's vocabulary (embedding padding, e.g. 50304 vs 50257) cannot be decoded.
    const std::int64_t v = std::min(logits_all.size(2), vocab_size_);
    at::Tensor logits = logits_all[0][-1].slice(0, 0, v).to(at::kCPU, at::kFloat);  // [V']
    if (temperature_ == 0.0) return logits.argmax().item<std::int64_t>();
    logits = logits / temperature_;
    const double neg_inf = -std::numeric_limits<double>::infinity();
    if (top_k_ > 0 && top_k_ < v) {
      const at::Tensor kth = std::get<0>(logits.topk(top_k_)).select(0, top_k_ - 1);
      logits = logits.masked_fill(logits < kth, neg_inf);
    }
    if (top_p_ < 1.0) {
      // Keep the most likely tokens until their probabilities reach top_p
      // (always at least the first): drop a token when the mass before it already does.
      auto [sorted, order] = logits.sort(/*dim=*/0, /*descending=*/true);
      const at::Tensor probs = sorted.softmax(0);
      const at::Tensor mass_before = probs.cumsum(0) - probs;
      const at::Tensor drop_sorted = mass_before >= top_p_;
      const at::Tensor drop = at::zeros_like(drop_sorted).scatter(0, order, drop_sorted);
      logits = logits.masked_fill(drop, neg_inf);
    }
    const at::Tensor probs = logits.softmax(0);
    const at::Tensor pick = generator ? at::multinomial(probs, 1, false, *generator) : at::multinomial(probs, 1);
    return pick.item<std::int64_t>();
  }

  std::shared_ptr<Module> model_;
  std::shared_ptr<Tokenizer> tokenizer_;
  Template template_;
  std::int64_t sequence_length_;
  double temperature_;
  std::string eod_token_;
  std::int64_t top_k_;
  double top_p_;
  std::optional<std::int64_t> seed_, max_new_tokens_;
  c10::Device device_;
  std::string sample_key_, prediction_key_;
  std::optional<std::int64_t> eod_id_;
  std::int64_t vocab_size_ = 0;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<TextInferenceComponent, TextInferenceConfig>(
      "text",
      "Text generation (generate_text): fills the prompt template from the input, samples tokens until the eod token "
      "or the length limit (temperature, top-k, top-p, seed), streams the text.",
      [](const TextInferenceConfig& c, BuildContext& ctx) { return std::make_shared<TextInference>(c, ctx); });
}

}  // namespace plugins::text_inference
}  // namespace modalities

MODALITIES_PLUGIN(text_inference, MODALITIES_PLUGIN_VERSION, modalities::plugins::text_inference::register_components)
