// tokenizer/pretrained_hf_tokenizer: Modalities' PreTrainedHFTokenizer (see
// README.md). Loads a local Hugging Face tokenizer folder the way
// transformers' AutoTokenizer does for the supported fast-tokenizer classes
// (tokenizer.json + tokenizer_config.json + special_tokens_map.json), then
// tokenizes like `tokenizer(text, max_length, padding, truncation)["input_ids"]`.
// The tokenizer.json pipeline itself lives in tokenizer_json.cpp.
#include "tokenizer_json.h"

#include <modalities/sdk/interfaces/tokenizer.h>
#include <modalities/sdk/plugin.h>

#include <absl/container/flat_hash_set.h>
#include <fmt/format.h>
#include <simdjson.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

namespace modalities {
namespace plugins::hf_tokenizer {

/// `padding` accepts what transformers accepts: false, true, "longest",
/// "max_length" or "do_not_pad".
struct Padding {
  enum class Mode { kNone, kLongest, kMaxLength } mode = Mode::kNone;
  bool from_bool = true;  // spelled as a boolean (only for repr)
};

}  // namespace plugins::hf_tokenizer

template <>
struct Codec<plugins::hf_tokenizer::Padding> {
  using P = plugins::hf_tokenizer::Padding;
  static std::string type_name() { return "bool | \"longest\" | \"max_length\" | \"do_not_pad\""; }
  static Parsed parse(const Value& v, P& out, const std::string& path, ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"bool", "string"})) return Parsed::kPending;
    if (v.is_bool()) {
      out.mode = v.as_bool() ? P::Mode::kLongest : P::Mode::kNone;
      out.from_bool = true;
      return Parsed::kOk;
    }
    if (v.is_string()) {
      const std::string& s = v.as_string();
      out.from_bool = false;
      if (s == "longest") out.mode = P::Mode::kLongest;
      else if (s == "max_length") out.mode = P::Mode::kMaxLength;
      else if (s == "do_not_pad") out.mode = P::Mode::kNone;
      else {
        ctx.fail(path, fmt::format("must be true, false, \"longest\", \"max_length\" or \"do_not_pad\", got '{}'", s));
        return Parsed::kError;
      }
      return Parsed::kOk;
    }
    return detail::type_error(v, "a boolean or one of \"longest\", \"max_length\", \"do_not_pad\"", path, ctx);
  }
  static std::string repr(const P& p) {
    switch (p.mode) {
      case P::Mode::kNone: return p.from_bool ? "false" : "\"do_not_pad\"";
      case P::Mode::kLongest: return p.from_bool ? "true" : "\"longest\"";
      case P::Mode::kMaxLength: return "\"max_length\"";
    }
    return "false";
  }
};

namespace plugins::hf_tokenizer {
namespace {

namespace fs = std::filesystem;
namespace dom = simdjson::dom;

struct SpecialTokensConfig {
  std::optional<std::string> bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token;
  std::optional<std::vector<std::string>> additional_special_tokens;

  static void describe(Schema<SpecialTokensConfig>& s) {
    s.field("bos_token", &SpecialTokensConfig::bos_token, "Beginning-of-sequence token.");
    s.field("eos_token", &SpecialTokensConfig::eos_token, "End-of-sequence token.");
    s.field("unk_token", &SpecialTokensConfig::unk_token, "Unknown token.");
    s.field("sep_token", &SpecialTokensConfig::sep_token, "Separator token.");
    s.field("pad_token", &SpecialTokensConfig::pad_token, "Padding token (needed by padding).");
    s.field("cls_token", &SpecialTokensConfig::cls_token, "Classifier token.");
    s.field("mask_token", &SpecialTokensConfig::mask_token, "Mask token.");
    s.field("additional_special_tokens", &SpecialTokensConfig::additional_special_tokens,
            "More special tokens, appended to the tokenizer's own list.");
  }
};

struct HfTokenizerConfig {
  std::string pretrained_model_name_or_path;
  bool truncation = false;
  Padding padding;
  std::optional<std::int64_t> max_length;
  std::optional<SpecialTokensConfig> special_tokens;

  static void describe(Schema<HfTokenizerConfig>& s) {
    s.field("pretrained_model_name_or_path", &HfTokenizerConfig::pretrained_model_name_or_path,
            "Local folder with tokenizer.json (and usually tokenizer_config.json). Hub names are not downloaded.")
        .required()
        .non_empty();
    s.field("truncation", &HfTokenizerConfig::truncation,
            "Cut token sequences to max_length (or the model_max_length of tokenizer_config.json).");
    s.field("padding", &HfTokenizerConfig::padding,
            "false / true (= \"longest\", a no-op for single texts) / \"max_length\" (pad to max_length or "
            "model_max_length; needs a pad token).");
    s.field("max_length", &HfTokenizerConfig::max_length, "Length for truncation and max_length padding.")
        .non_negative();
    s.field("special_tokens", &HfTokenizerConfig::special_tokens,
            "Tokens to mark special (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token, "
            "additional_special_tokens). Each must already be in the vocabulary.");
  }
};

// ---------------------------------------------------------------------------
// tokenizer_config.json / special_tokens_map.json

// A special token as transformers holds it: a plain string or an AddedToken.
struct SpecialValue {
  AddedToken token;
  bool is_added_token = false;  // false: a plain string
};

const std::vector<std::string> kAttributes = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

std::string read_text(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot be read", file.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// simdjson refuses integers beyond 64 bits; transformers writes
// model_max_length = int(1e30) as such a literal. Such literals become floats.
std::string widen_big_integers(const std::string& text) {
  std::string out;
  out.reserve(text.size() + 8);
  bool in_string = false;
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];
      else if (c == '"') in_string = false;
      ++i;
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      ++i;
      continue;
    }
    if (c >= '0' && c <= '9') {
      std::size_t j = i;
      while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
      out.append(text, i, j - i);
      const bool fraction = j < text.size() && (text[j] == '.' || text[j] == 'e' || text[j] == 'E');
      if (j - i > 18 && !fraction) out += ".0";
      i = j;
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

struct JsonFile {
  dom::parser parser;
  dom::element root;
  fs::path file;
  explicit JsonFile(const fs::path& f) : file(f) {
    const std::string text = widen_big_integers(read_text(f));
    if (auto err = parser.parse(simdjson::padded_string(text)).get(root); err != simdjson::SUCCESS)
      throw Error(fmt::format("{}: malformed JSON ({})", f.string(), simdjson::error_message(err)));
    if (root.type() != dom::element_type::OBJECT)
      throw Error(fmt::format("{}: expected a JSON object at the top level", f.string()));
  }
  std::optional<dom::element> get(std::string_view key) const {
    dom::element v;
    if (root.at_key(key).get(v) != simdjson::SUCCESS || v.is_null()) return std::nullopt;
    return v;
  }
  [[noreturn]] void bad(std::string_view key, std::string_view expected) const {
    throw Error(fmt::format("{}: {}: expected {}", file.string(), key, expected));
  }
  std::optional<std::string> string(std::string_view key) const {
    auto v = get(key);
    if (!v) return std::nullopt;
    std::string_view s;
    if (v->get_string().get(s) != simdjson::SUCCESS) bad(key, "a string");
    return std::string(s);
  }
  std::optional<bool> boolean(std::string_view key) const {
    auto v = get(key);
    if (!v) return std::nullopt;
    bool b;
    if (v->get_bool().get(b) != simdjson::SUCCESS) bad(key, "true or false");
    return b;
  }
  std::optional<double> number(std::string_view key) const {
    auto v = get(key);
    if (!v) return std::nullopt;
    double d;
    if (v->get_double().get(d) != simdjson::SUCCESS) bad(key, "a number");
    return d;
  }
};

// A special-token value: "text" or {"content": "text", "lstrip": ..., ...}.
std::optional<SpecialValue> special_value(const JsonFile& f, dom::element v, const std::string& where) {
  if (v.is_null()) return std::nullopt;
  SpecialValue out;
  std::string_view s;
  if (v.get_string().get(s) == simdjson::SUCCESS) {
    out.token = AddedToken{std::string(s), false, false, false, false, true};
    return out;
  }
  dom::object o;
  if (v.get_object().get(o) != simdjson::SUCCESS) f.bad(where, "a string or an AddedToken object");
  auto flag = [&](std::string_view key, bool fallback) {
    dom::element e;
    bool b;
    if (o.at_key(key).get(e) != simdjson::SUCCESS || e.is_null()) return fallback;
    if (e.get_bool().get(b) != simdjson::SUCCESS) f.bad(fmt::format("{}.{}", where, key), "true or false");
    return b;
  };
  dom::element content;
  if (o.at_key("content").get(content) != simdjson::SUCCESS || content.get_string().get(s) != simdjson::SUCCESS)
    f.bad(where + ".content", "a string");
  out.is_added_token = true;
  out.token.content = std::string(s);
  out.token.special = flag("special", true);
  out.token.single_word = flag("single_word", false);
  out.token.lstrip = flag("lstrip", false);
  out.token.rstrip = flag("rstrip", false);
  out.token.normalized = flag("normalized", !out.token.special);
  return out;
}

// ---------------------------------------------------------------------------

std::string clean_up_tokenization(std::string s) {
  static const std::pair<std::string_view, std::string_view> kRules[] = {
      {" .", "."},     {" ?", "?"},   {" !", "!"},   {" ,", ","},     {" ' ", "'"},
      {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    std::string out;
    out.reserve(s.size());
    std::size_t pos = 0;
    for (std::size_t hit = s.find(from); hit != std::string::npos; hit = s.find(from, pos)) {
      out.append(s, pos, hit - pos);
      out += to;
      pos = hit + from.size();
    }
    out.append(s, pos);
    s = std::move(out);
  }
  return s;
}

constexpr double kUnboundedLength = 1e20;  // transformers' LARGE_INTEGER

class PretrainedHfTokenizer final : public Tokenizer {
 public:
  PretrainedHfTokenizer(const HfTokenizerConfig& c, BuildContext& ctx) {
    const fs::path dir = c.pretrained_model_name_or_path;
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      if (fs::exists(dir, ec))
        throw ConfigError("pretrained_model_name_or_path",
                          fmt::format("'{}' is a file; give the folder that contains tokenizer.json", dir.string()));
      throw ConfigError(
          "pretrained_model_name_or_path",
          fmt::format("'{}' is not a local folder; downloads are not supported, give a local folder with "
                      "tokenizer.json (for a hub model, download it first, e.g. `huggingface-cli download {} "
                      "--local-dir <folder>`)",
                      dir.string(), dir.string()));
    }
    folder_ = dir;
    const fs::path json = dir / "tokenizer.json";
    if (!fs::is_regular_file(json, ec))
      throw ConfigError("pretrained_model_name_or_path",
                        fmt::format("'{}' has no tokenizer.json (only the fast-tokenizer format is supported; "
                                    "vocab.json/merges.txt or a SentencePiece model alone are not)",
                                    dir.string()));
    tok_ = std::make_unique<TokenizerJson>(json);
    for (const auto& w : tok_->warnings()) ctx.warn(w);

    load_transformers_config(dir, ctx);
    if (c.special_tokens) add_configured_special_tokens(*c.special_tokens);
    resolve_special_ids();
    resolve_padding_and_truncation(c, ctx);
  }

  std::vector<std::int64_t> tokenize(std::string_view text) const override {
    if (!content_limit_ && !pad_to_) return tok_->encode(text);  // the packing path: no copies
    std::vector<std::int64_t> content;
    content.reserve(text.size() / 3 + 8);
    tok_->encode_sequence(text, content);
    if (content_limit_ && content.size() > *content_limit_) {
      if (truncate_left_) content.erase(content.begin(), content.end() - static_cast<std::ptrdiff_t>(*content_limit_));
      else content.resize(*content_limit_);
    }
    const auto& pre = tok_->template_prefix();
    const auto& suf = tok_->template_suffix();
    std::vector<std::int64_t> ids;
    const std::size_t n = pre.size() + content.size() + suf.size();
    const std::size_t pad = pad_to_ && n < *pad_to_ ? *pad_to_ - n : 0;
    ids.reserve(n + pad);
    if (pad_left_) ids.insert(ids.end(), pad, pad_id_);
    ids.insert(ids.end(), pre.begin(), pre.end());
    ids.insert(ids.end(), content.begin(), content.end());
    ids.insert(ids.end(), suf.begin(), suf.end());
    if (!pad_left_) ids.insert(ids.end(), pad, pad_id_);
    return ids;
  }

  std::string decode(std::span<const std::int64_t> ids) const override {
    std::string text = tok_->decode(ids);
    return clean_up_ ? clean_up_tokenization(std::move(text)) : text;
  }

  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(tok_->model_vocab_size()); }

  // Quirk Q9 (docs/differences.md): transformers maps an unknown string to the unk id (GPT-2:
  // 50256 = <|endoftext|>) with only a warning; we refuse strings that are not
  // literally in the vocabulary.
  std::int64_t token_id(std::string_view token) const override {
    if (auto id = tok_->token_to_id(token)) return *id;
    throw Error(
        fmt::format("token '{}' is not in the vocabulary of {} (it is not represented by a single token id; "
                    "transformers would silently map it to the unknown token)",
                    token, tok_->file().string()));
  }

  bool is_special_token_id(std::int64_t id) const override { return special_ids_.contains(id); }
  // The folder it was loaded from (special tokens that the config adds are not in its files).
  std::optional<fs::path> huggingface_folder() const override { return folder_; }

 private:
  void load_transformers_config(const fs::path& dir, BuildContext& ctx) {
    std::map<std::string, SpecialValue> attrs;
    std::vector<SpecialValue> additional;
    std::vector<std::pair<std::int64_t, AddedToken>> decoder;  // added_tokens_decoder
    bool has_decoder = false;
    std::string cls = "PreTrainedTokenizerFast";
    bool add_prefix_space = false, add_prefix_space_given = false, additional_given = false;
    std::optional<bool> add_bos_token, add_eos_token, do_lower_case, strip_accents, tokenize_chinese_chars;
    std::optional<std::int64_t> extra_ids;

    const fs::path config_file = dir / "tokenizer_config.json";
    std::error_code ec;
    std::set<std::string> given;  // attribute keys present (even as null) in the config
    if (fs::exists(config_file, ec)) {
      JsonFile f(config_file);
      if (auto v = f.string("tokenizer_class")) cls = *v;
      if (auto v = f.number("model_max_length")) model_max_length_ = *v;
      if (auto v = f.boolean("clean_up_tokenization_spaces")) clean_up_ = *v;
      if (auto v = f.boolean("add_prefix_space")) {
        add_prefix_space = *v;
        add_prefix_space_given = true;
      }
      add_bos_token = f.boolean("add_bos_token");
      add_eos_token = f.boolean("add_eos_token");
      do_lower_case = f.boolean("do_lower_case");
      strip_accents = f.boolean("strip_accents");
      tokenize_chinese_chars = f.boolean("tokenize_chinese_chars");
      if (auto v = f.number("extra_ids")) {
        if (*v < 0 || *v != static_cast<double>(static_cast<std::int64_t>(*v)))
          f.bad("extra_ids", "a non-negative integer");
        extra_ids = static_cast<std::int64_t>(*v);
      }
      additional_given = f.get("additional_special_tokens").has_value();
      if (auto v = f.string("padding_side")) {
        if (*v != "left" && *v != "right") f.bad("padding_side", "\"left\" or \"right\"");
        pad_left_ = *v == "left";
      }
      if (auto v = f.string("truncation_side")) {
        if (*v != "left" && *v != "right") f.bad("truncation_side", "\"left\" or \"right\"");
        truncate_left_ = *v == "left";
      }
      if (f.boolean("split_special_tokens").value_or(false))
        throw Error(fmt::format("{}: split_special_tokens = true is not supported", config_file.string()));
      for (const auto& key : kAttributes) {
        dom::element e;
        if (f.root.at_key(key).get(e) != simdjson::SUCCESS) continue;
        given.insert(key);
        if (auto sv = special_value(f, e, key)) attrs[key] = *sv;
      }
      if (auto a = f.get("additional_special_tokens")) {
        dom::array list;
        if (a->get_array().get(list) != simdjson::SUCCESS) f.bad("additional_special_tokens", "a list");
        std::size_t k = 0;
        for (dom::element e : list)
          if (auto sv = special_value(f, e, fmt::format("additional_special_tokens[{}]", k++)))
            additional.push_back(*sv);
      }
      if (auto d = f.get("added_tokens_decoder")) {
        has_decoder = true;
        dom::object o;
        if (d->get_object().get(o) != simdjson::SUCCESS) f.bad("added_tokens_decoder", "an object");
        for (auto field : o) {
          const std::string where = fmt::format("added_tokens_decoder.{}", field.key);
          std::int64_t id = 0;
          try {
            id = std::stoll(std::string(field.key));
          } catch (const std::exception&) {
            f.bad(where, "an integer key");
          }
          auto sv = special_value(f, field.value, where);
          if (!sv || !sv->is_added_token) f.bad(where, "an AddedToken object");
          decoder.emplace_back(id, sv->token);
        }
        std::sort(decoder.begin(), decoder.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      }
    } else {
      ctx.warn(
          fmt::format("{} has no tokenizer_config.json: using PreTrainedTokenizerFast defaults (no special "
                      "tokens, no model_max_length); transformers' AutoTokenizer would refuse this folder",
                      dir.string()));
    }

    // Legacy: special_tokens_map.json fills attributes only without added_tokens_decoder.
    const fs::path map_file = dir / "special_tokens_map.json";
    if (!has_decoder && fs::exists(map_file, ec)) {
      JsonFile m(map_file);
      for (const auto& key : kAttributes) {
        if (attrs.contains(key)) continue;
        if (auto e = m.get(key))
          if (auto sv = special_value(m, *e, key)) attrs[key] = *sv;
      }
      if (auto a = m.get("additional_special_tokens")) {
        dom::array list;
        if (a->get_array().get(list) != simdjson::SUCCESS) m.bad("additional_special_tokens", "a list");
        std::size_t k = 0;
        for (dom::element e : list)
          if (auto sv = special_value(m, e, fmt::format("additional_special_tokens[{}]", k++))) {
            const bool dup = std::any_of(additional.begin(), additional.end(),
                                         [&](const SpecialValue& x) { return x.token.content == sv->token.content; });
            if (!dup) additional.push_back(*sv);
          }
      }
    }

    // Class rules of the fast tokenizer classes whose loading we reproduce (transformers 4.57:
    // a slow class name means its Fast class). See the README's table.
    std::string base = cls;
    if (base.ends_with("Fast")) base.resize(base.size() - 4);
    auto default_attr = [&](const std::string& key, const std::string& value, bool added_token) {
      if (given.contains(key) || attrs.contains(key)) return;
      SpecialValue sv;
      sv.token = AddedToken{value, false, false, false, false, true};
      sv.is_added_token = added_token;
      attrs[key] = sv;
    };
    bool template_from_flags = false, default_add_bos = false, force_prefix_space = true, roberta_mask = false;
    bool mask_normalized = false;  // XLMRobertaTokenizerFast's AddedToken(mask, lstrip=True) keeps normalized
    if (base == "GPT2Tokenizer" || base == "CodeGenTokenizer") {
      for (const char* key : {"unk_token", "bos_token", "eos_token"}) default_attr(key, "<|endoftext|>", false);
      if (base == "CodeGenTokenizer" && add_bos_token.value_or(false))
        throw Error(
            fmt::format("{}: CodeGenTokenizer does not support add_bos_token = true (transformers raises "
                        "a ValueError)",
                        config_file.string()));
    } else if (base == "Qwen2Tokenizer") {
      for (const char* key : {"unk_token", "eos_token", "pad_token"}) default_attr(key, "<|endoftext|>", true);
    } else if (base == "LlamaTokenizer" || base == "T5Tokenizer") {
      if (add_prefix_space_given)
        throw Error(fmt::format(
            "{}: add_prefix_space is set, so transformers' {}Fast rebuilds the tokenizer from its SentencePiece "
            "model instead of reading tokenizer.json; that conversion is not reproduced (remove the key to use "
            "tokenizer.json as it is)",
            config_file.string(), base));
      force_prefix_space = false;  // these classes pass add_prefix_space=None: the pre-tokenizer stays as it is
      if (base == "LlamaTokenizer") {
        default_attr("unk_token", "<unk>", false);
        default_attr("bos_token", "<s>", false);
        default_attr("eos_token", "</s>", false);
        template_from_flags = true;
        default_add_bos = true;
      } else {
        default_attr("eos_token", "</s>", false);
        default_attr("unk_token", "<unk>", false);
        default_attr("pad_token", "<pad>", false);
        const std::int64_t extra = extra_ids.value_or(100);
        std::vector<SpecialValue> extras;
        for (std::int64_t k = 0; k < extra; ++k)
          extras.push_back(
              SpecialValue{AddedToken{fmt::format("<extra_id_{}>", k), false, false, false, false, true}, false});
        if (!additional_given && additional.empty()) {
          additional = extras;
        } else {
          const auto have = std::count_if(additional.begin(), additional.end(), [](const SpecialValue& v) {
            return v.token.content.find("<extra_id_") != std::string::npos;
          });
          if (have == 0) additional.insert(additional.end(), extras.begin(), extras.end());
          else if (extra > 0 && have != extra)
            throw Error(
                fmt::format("{}: extra_ids = {} but additional_special_tokens has {} <extra_id_*> tokens "
                            "(transformers raises a ValueError)",
                            config_file.string(), extra, have));
        }
      }
    } else if (base == "GemmaTokenizer") {
      default_attr("unk_token", "<unk>", false);
      default_attr("bos_token", "<bos>", false);
      default_attr("eos_token", "<eos>", false);
      default_attr("pad_token", "<pad>", false);
      template_from_flags = true;
      default_add_bos = true;
    } else if (base == "GPTNeoXTokenizer") {
      for (const char* key : {"unk_token", "bos_token", "eos_token"}) default_attr(key, "<|endoftext|>", false);
      template_from_flags = true;
    } else if (base == "CohereTokenizer") {
      default_attr("unk_token", "<UNK>", false);
      default_attr("bos_token", "<BOS_TOKEN>", false);
      default_attr("eos_token", "<|END_OF_TURN_TOKEN|>", false);
      template_from_flags = true;
      default_add_bos = true;
    } else if (base == "RobertaTokenizer" || base == "XLMRobertaTokenizer") {
      // XLMRobertaTokenizerFast has RobertaTokenizerFast's special tokens and string-mask rule (with
      // normalized left true) and no post-processor or prefix-space rules of its own.
      mask_normalized = base == "XLMRobertaTokenizer";
      default_attr("bos_token", "<s>", false);
      default_attr("cls_token", "<s>", false);
      default_attr("eos_token", "</s>", false);
      default_attr("sep_token", "</s>", false);
      default_attr("unk_token", "<unk>", false);
      default_attr("pad_token", "<pad>", false);
      default_attr("mask_token", "<mask>", false);
      roberta_mask = true;  // applied after the added_tokens_decoder lookup below
    } else if (base == "BloomTokenizer") {
      default_attr("unk_token", "<unk>", false);
      default_attr("bos_token", "<s>", false);
      default_attr("eos_token", "</s>", false);
      default_attr("pad_token", "<pad>", false);
    } else if (base == "BertTokenizer") {
      default_attr("unk_token", "[UNK]", false);
      default_attr("sep_token", "[SEP]", false);
      default_attr("pad_token", "[PAD]", false);
      default_attr("cls_token", "[CLS]", false);
      default_attr("mask_token", "[MASK]", false);
      // BertTokenizerFast rebuilds a top-level BertNormalizer with the config's flags.
      tok_->configure_bert_normalizer(do_lower_case.value_or(true), strip_accents,
                                      tokenize_chinese_chars.value_or(true));
    } else if (base != "PreTrainedTokenizer") {
      throw Error(fmt::format(
          "{}: tokenizer_class '{}' is not supported: its class-specific loading rules are not reproduced "
          "(supported: PreTrainedTokenizerFast, GPT2, CodeGen, Qwen2, Llama, Gemma, GPTNeoX, Cohere, Roberta, "
          "XLMRoberta, Bloom, Bert and T5 tokenizers, slow or Fast){}. If the tokenizer.json alone defines the "
          "tokenizer, set "
          "\"tokenizer_class\": \"PreTrainedTokenizerFast\".",
          config_file.string(), cls,
          base == "CodeLlamaTokenizer" ? "; CodeLlama's infilling (<FILL_ME>) is Python code in transformers" : ""));
    }

    // String attributes take the AddedToken of the same content from added_tokens_decoder.
    auto resolve = [&](SpecialValue& sv) {
      if (sv.is_added_token) return;
      for (const auto& [id, t] : decoder)
        if (t.content == sv.token.content) {
          sv.token = t;
          sv.is_added_token = true;
        }
    };
    for (auto& [key, sv] : attrs) resolve(sv);
    // RobertaTokenizerFast turns a mask token that is still a string (not an added_tokens_decoder entry)
    // into AddedToken(lstrip=True, normalized=False); transformers adds it only when tokenizer.json does
    // not have that content as an added token already, so there tokenizer.json's flags stay (a literal
    // "<mask> <mask>" keeps its space when tokenizer.json says lstrip false).
    if (roberta_mask)
      if (auto it = attrs.find("mask_token"); it != attrs.end() && !it->second.is_added_token) {
        const auto& existing = tok_->added_tokens();
        const bool in_tokenizer_json = std::any_of(existing.begin(), existing.end(), [&](const auto& e) {
          return e.second.content == it->second.token.content;
        });
        if (!in_tokenizer_json) {
          it->second.token = AddedToken{it->second.token.content, false, true, false, mask_normalized, true};
          it->second.is_added_token = true;
        }
      }

    // PreTrainedTokenizerFast.__init__: transformers overrides add_prefix_space of a top-level ByteLevel
    // (Bloom and Cohere set it on every ByteLevel when it is true).
    if (force_prefix_space) tok_->set_top_level_add_prefix_space(add_prefix_space);
    if ((base == "BloomTokenizer" || base == "CohereTokenizer") && add_prefix_space)
      tok_->set_byte_level_add_prefix_space_everywhere(true);

    // Re-add added_tokens_decoder entries that differ from tokenizer.json, then
    // the special attributes (an AddedToken is always re-added; a string only
    // when its content is not an added token yet).
    std::vector<AddedToken> to_add;
    for (const auto& [id, t] : decoder) {
      const bool same = std::any_of(tok_->added_tokens().begin(), tok_->added_tokens().end(),
                                    [&](const auto& e) { return e.second == t; });
      if (!same) to_add.push_back(t);
    }
    std::vector<std::string> special_strings;
    for (const auto& key : kAttributes)
      if (auto it = attrs.find(key); it != attrs.end()) special_strings.push_back(it->second.token.content);
    for (const auto& sv : additional) special_strings.push_back(sv.token.content);
    auto is_special_string = [&](const std::string& s) {
      return std::find(special_strings.begin(), special_strings.end(), s) != special_strings.end();
    };
    for (auto& t : to_add) t.special = t.special || is_special_string(t.content);
    auto consider = [&](const SpecialValue& sv) {
      if (sv.is_added_token) {
        AddedToken t = sv.token;
        t.special = t.special || is_special_string(t.content);
        to_add.push_back(t);
        return;
      }
      const bool known =
          std::any_of(tok_->added_tokens().begin(), tok_->added_tokens().end(),
                      [&](const auto& e) { return e.second.content == sv.token.content; }) ||
          std::any_of(to_add.begin(), to_add.end(), [&](const AddedToken& t) { return t.content == sv.token.content; });
      if (!known) to_add.push_back(AddedToken{sv.token.content, false, false, false, false, true});
    };
    for (const auto& key : kAttributes)
      if (auto it = attrs.find(key); it != attrs.end()) consider(it->second);
    for (const auto& sv : additional) consider(sv);
    tok_->add_tokens(to_add);

    for (const auto& key : kAttributes)
      if (auto it = attrs.find(key); it != attrs.end()) attributes_[key] = it->second.token.content;
    for (const auto& sv : additional) additional_.push_back(sv.token.content);

    // update_post_processor() of the Llama, Gemma, GPTNeoX and Cohere classes: the template
    // becomes [bos if add_bos_token] $A [eos if add_eos_token], whatever tokenizer.json says.
    if (template_from_flags) {
      auto id_of = [&](const char* key, const char* flag) {
        auto it = attributes_.find(key);
        std::optional<std::int64_t> id;
        if (it != attributes_.end()) id = tok_->token_to_id(it->second);
        if (!id)
          throw Error(fmt::format("{}: {} is true but the tokenizer has no {} (transformers raises a ValueError)",
                                  config_file.string(), flag, key));
        return *id;
      };
      std::vector<std::int64_t> prefix, suffix;
      if (add_bos_token.value_or(default_add_bos)) prefix.push_back(id_of("bos_token", "add_bos_token"));
      if (add_eos_token.value_or(false)) suffix.push_back(id_of("eos_token", "add_eos_token"));
      tok_->set_template(std::move(prefix), std::move(suffix));
    }
  }

  // Modalities: tokenizer.add_special_tokens(special_tokens, replace_additional_special_tokens=False),
  // and NotImplementedError when that grows the vocabulary.
  void add_configured_special_tokens(const SpecialTokensConfig& s) {
    const std::size_t before = tok_->full_vocab_size();
    std::vector<AddedToken> tokens;
    std::vector<std::string> new_tokens;
    auto attr = [&](const char* key, const std::optional<std::string>& value) {
      if (!value) return;
      attributes_[key] = *value;
      tokens.push_back(AddedToken{*value, false, false, false, false, true});
      if (!tok_->token_to_id(*value)) new_tokens.push_back(fmt::format("{} = '{}'", key, *value));
    };
    attr("bos_token", s.bos_token);
    attr("eos_token", s.eos_token);
    attr("unk_token", s.unk_token);
    attr("sep_token", s.sep_token);
    attr("pad_token", s.pad_token);
    attr("cls_token", s.cls_token);
    attr("mask_token", s.mask_token);
    if (s.additional_special_tokens) {
      for (const auto& t : *s.additional_special_tokens) {
        if (std::find(additional_.begin(), additional_.end(), t) != additional_.end()) continue;
        additional_.push_back(t);
        tokens.push_back(AddedToken{t, false, false, false, false, true});
        if (!tok_->token_to_id(t)) new_tokens.push_back(fmt::format("additional_special_tokens '{}'", t));
      }
    }
    if (!new_tokens.empty()) {
      std::string list;
      for (const auto& t : new_tokens) list += (list.empty() ? "" : ", ") + t;
      throw ConfigError("special_tokens",
                        fmt::format("{} not in the vocabulary of {}; only tokens already in the vocabulary can be "
                                    "marked special (the embedding matrix cannot be resized)",
                                    list, tok_->file().string()));
    }
    tok_->add_tokens(tokens);
    if (tok_->full_vocab_size() != before)
      throw ConfigError("special_tokens", "registering the special tokens grew the vocabulary");
  }

  std::optional<std::int64_t> convert_token(const std::string& token) const {
    if (auto id = tok_->token_to_id(token)) return id;
    if (auto it = attributes_.find("unk_token"); it != attributes_.end()) return tok_->token_to_id(it->second);
    return std::nullopt;
  }

  void resolve_special_ids() {
    for (const auto& key : kAttributes)
      if (auto it = attributes_.find(key); it != attributes_.end())
        if (auto id = convert_token(it->second)) special_ids_.insert(*id);
    for (const auto& t : additional_)
      if (auto id = convert_token(t)) special_ids_.insert(*id);
  }

  // transformers' _get_padding_truncation_strategies + the backend's rules.
  void resolve_padding_and_truncation(const HfTokenizerConfig& c, BuildContext& ctx) {
    Padding::Mode padding = c.padding.mode;
    bool truncation = c.truncation;
    std::optional<std::int64_t> max_length = c.max_length;
    const bool unbounded = model_max_length_ > kUnboundedLength;
    if (!max_length) {
      if (padding == Padding::Mode::kMaxLength) {
        if (unbounded) {
          ctx.warn(
              "padding = \"max_length\" without max_length and without model_max_length in "
              "tokenizer_config.json: no padding is applied (as in transformers)");
          padding = Padding::Mode::kNone;
        } else {
          max_length = static_cast<std::int64_t>(model_max_length_);
        }
      }
      if (truncation) {
        if (unbounded) {
          ctx.warn(
              "truncation = true without max_length and without model_max_length in tokenizer_config.json: "
              "no truncation is applied (as in transformers)");
          truncation = false;
        } else {
          max_length = static_cast<std::int64_t>(model_max_length_);
        }
      }
    }
    if (padding != Padding::Mode::kNone) {
      auto it = attributes_.find("pad_token");
      std::optional<std::int64_t> pad_id;
      if (it != attributes_.end()) pad_id = convert_token(it->second);
      if (!pad_id)
        throw ConfigError("padding", "padding needs a pad token, and the tokenizer has none",
                          "mark an existing token as padding token, e.g. special_tokens = { pad_token = \"...\" }");
      pad_id_ = *pad_id;
      if (padding == Padding::Mode::kMaxLength) pad_to_ = static_cast<std::size_t>(*max_length);
    }
    if (truncation) {
      const std::size_t added = tok_->template_prefix().size() + tok_->template_suffix().size();
      if (static_cast<std::size_t>(*max_length) < added)
        throw ConfigError("max_length", fmt::format("truncation to {} tokens leaves no room for the {} template "
                                                    "tokens the tokenizer adds",
                                                    *max_length, added));
      content_limit_ = static_cast<std::size_t>(*max_length) - added;
    }
  }

  fs::path folder_;
  std::unique_ptr<TokenizerJson> tok_;
  double model_max_length_ = 1e30;  // transformers' VERY_LARGE_INTEGER when unset
  bool clean_up_ = false;
  bool pad_left_ = false, truncate_left_ = false;
  std::optional<std::size_t> content_limit_, pad_to_;
  std::int64_t pad_id_ = -1;
  std::map<std::string, std::string> attributes_;  // bos_token, ... -> content
  std::vector<std::string> additional_;
  absl::flat_hash_set<std::int64_t> special_ids_;
};

}  // namespace

void register_components(Registrar& r) {
  r.add<Tokenizer, HfTokenizerConfig>(
      "pretrained_hf_tokenizer",
      "Hugging Face fast tokenizer (tokenizer.json: byte-level BPE, SentencePiece-style BPE, Unigram, WordPiece) from "
      "a "
      "local folder, as AutoTokenizer loads it.",
      [](const HfTokenizerConfig& c, BuildContext& ctx) { return std::make_shared<PretrainedHfTokenizer>(c, ctx); });
}

}  // namespace plugins::hf_tokenizer
}  // namespace modalities

MODALITIES_PLUGIN(hf_tokenizer, MODALITIES_PLUGIN_VERSION, modalities::plugins::hf_tokenizer::register_components)
