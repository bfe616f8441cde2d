// Weight initialization (README.md):
//   model_initialization/composed          normal init by parameter-name regexes, in stages
//                                          plain -> scaled -> scaled_embed (GPT-2 or CoCa names)
//   model_initialization/gpt2_llama3_like  TorchTitan's Llama-3 scheme: truncated normals,
//                                          depth-scaled output projections, no biases allowed
//   model/model_initialized                materializes a meta-device model on the run device,
//                                          resets every parameter, then applies an initializer
// Draws use the global generator of each parameter's device, in parameter order.
#include "model_initialized.h"
#include "truncated_normal.h"

#include <modalities/sdk/interfaces/model_initializer.h>
#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/log.h>
#include <modalities/sdk/plugin.h>
#include <modalities/sdk/run_context.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace modalities::plugins::initialization {
namespace {

// Note [Canonical names]
// Modalities matches the names of torch's model.named_parameters(), which carry
// wrapper infixes. It deletes only torch.compile's `_orig_mod.`, so after
// activation checkpointing (`_checkpoint_wrapped_module.`) the block parameters
// silently keep their default values (docs/differences.md). Here names come
// from Module::named_parameters(), which by contract are canonical (wrappers
// override it), so the wrapping order cannot make an initializer skip
// parameters. As a safety net for a wrapper that leaks its infix anyway, the
// three known infixes are deleted before matching.
std::string canonical_name(std::string name) {
  for (const std::string_view infix : {"_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."}) {
    for (auto pos = name.find(infix); pos != std::string::npos; pos = name.find(infix, pos))
      name.erase(pos, infix.size());
  }
  return name;
}

struct NamedParameter {
  std::string name;  // canonical
  at::Tensor tensor;
};

// The model's parameters in order, each tensor once: a tied matrix is drawn once,
// under its first name ("transformer.wte.weight"), as with PyTorch's
// named_parameters(remove_duplicate=True).
std::vector<NamedParameter> unique_parameters(const Module& model) {
  std::vector<NamedParameter> out;
  std::unordered_set<const void*> seen;
  for (auto& [name, tensor] : model.named_parameters()) {
    if (!seen.insert(tensor.unsafeGetTensorImpl()).second) continue;
    out.push_back({canonical_name(name), tensor});
  }
  return out;
}

struct Pattern {
  std::string text;  // as written in Modalities, for messages
  std::regex re;
  explicit Pattern(std::string t) : text(std::move(t)), re(text, std::regex::ECMAScript | std::regex::optimize) {}
  bool full_match(const std::string& name) const { return std::regex_match(name, re); }
};

std::vector<Pattern> compile(const std::vector<std::string>& texts) {
  std::vector<Pattern> out;
  for (const auto& t : texts) out.emplace_back(t);
  return out;
}

// "'a', 'b', ... (n more)" for messages.
std::string name_list(const std::vector<std::string>& names, std::size_t limit = 8) {
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < limit; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > limit) s += fmt::format(", ... ({} more)", names.size() - limit);
  return s;
}

// --- model_initialization/composed ------------------------------------------------

// Regex groups of Modalities' NAMED_PARAMETER_INIT_GROUPS,
// verbatim, including the unescaped '.' in "W_2.weight".
struct RegexFilter {
  std::vector<std::string> weights, biases;
};

RegexFilter gpt2_group(const std::string& stage) {
  if (stage == "plain")
    return {{R"(transformer\.h\.\d+\.attn\.(q_attn|k_attn|v_attn|c_proj)\.weight)",
             R"(transformer\.h\.\w+\.mlp\.(W|V|W_2)\.weight)", R"(transformer\.h\.\w+\.mlp\.(c_fc|c_proj)\.weight)",
             R"(transformer\.wte\.weight)", R"(transformer\.wpe\.weight)", R"(transformer\.lm_head\.weight)"},
            {R"(transformer\.h\.\d+\.attn\.(q_attn|k_attn|v_attn|c_proj)\.bias)",
             R"(transformer\.h\.\w+\.mlp\.(W|V|W_2)\.bias)", R"(transformer\.h\.\w+\.mlp\.(c_fc|c_proj)\.bias)",
             R"(transformer\.lm_head\.bias)"}};
  if (stage == "scaled")
    return {{R"(transformer\.h\.\d+\.attn\.c_proj\.weight)", R"(transformer\.h\.\w+\.mlp\.W_2.weight)",
             R"(transformer\.h\.\w+\.mlp\.c_proj\.weight)"},
            {}};
  return {{R"(transformer\.wte\.weight)", R"(transformer\.wpe\.weight)", R"(transformer\.lm_head\.weight)"}, {}};
}

RegexFilter coca_group(const std::string& stage) {
  // Every weight/bias outside norms; the scaled stages are empty for CoCa.
  if (stage == "plain") return {{R"(^(?!.*norm)(?!.*ln_).*\.weight$)"}, {R"(^(?!.*norm)(?!.*ln_).*\.bias$)"}};
  return {};
}

// `std`: a number >= 0 or the string "auto".
struct StdSetting {
  bool is_auto = false;
  double value = 0.0;
};

}  // namespace
}  // namespace modalities::plugins::initialization

namespace modalities {
template <>
struct Codec<plugins::initialization::StdSetting> {
  static std::string type_name() { return "float or \"auto\""; }
  static Parsed parse(const Value& v, plugins::initialization::StdSetting& out, const std::string& path,
                      ParseContext& ctx) {
    if (ctx.dry_run() && detail::pending_fits(v, {"int", "float", "string"})) return Parsed::kPending;
    if (v.is_string()) {
      if (v.as_string() != "auto") {
        ctx.fail(path, fmt::format("expected a number >= 0 or \"auto\", got \"{}\"", v.as_string()));
        return Parsed::kError;
      }
      out = {true, 0.0};
      return Parsed::kOk;
    }
    double x = 0.0;
    if (v.is_float()) x = v.as_float();
    else if (v.is_int()) x = static_cast<double>(v.as_int());
    else return detail::type_error(v, "a number >= 0 or \"auto\"", path, ctx);
    if (!(x >= 0.0)) {
      ctx.fail(path, fmt::format("must be >= 0 or \"auto\", got {}", format_float(x)));
      return Parsed::kError;
    }
    out = {false, x};
    return Parsed::kOk;
  }
  static std::string repr(const plugins::initialization::StdSetting& s) {
    return s.is_auto ? "\"auto\"" : format_float(s.value);
  }
};
}  // namespace modalities

namespace modalities::plugins::initialization {
namespace {

struct ComposedConfig {
  std::string model_type;
  std::string weight_init_type;
  double mean = 0.0;
  StdSetting std;
  std::optional<std::int64_t> hidden_dim;
  std::optional<std::int64_t> num_layers;

  static void describe(Schema<ComposedConfig>& s) {
    s.field("model_type", &ComposedConfig::model_type, "Which parameter-name regex groups to use.")
        .required()
        .one_of({"gpt2", "coca"});
    s.field("weight_init_type", &ComposedConfig::weight_init_type,
            "plain: N(mean, std) on matching weights, biases 0; scaled: then output projections re-drawn with "
            "std/sqrt(2*num_layers); scaled_embed: then embeddings re-drawn with sqrt(0.4).")
        .required()
        .one_of({"plain", "scaled", "scaled_embed"});
    s.field("mean", &ComposedConfig::mean, "Mean of every normal draw.").required();
    s.field("std", &ComposedConfig::std, "Plain std (>= 0), or \"auto\" = sqrt(2 / (5 * hidden_dim)).").required();
    s.field("hidden_dim", &ComposedConfig::hidden_dim, "Model width; required iff std = \"auto\".").positive();
    s.field("num_layers", &ComposedConfig::num_layers,
            "Number of transformer layers; required for scaled/scaled_embed, not allowed for plain.")
        .positive();
    s.rule([](const ComposedConfig& c, ParseContext& ctx) {
      if (c.std.is_auto && !c.hidden_dim)
        ctx.fail("hidden_dim", "required when std = \"auto\" (std = sqrt(2 / (5 * hidden_dim)))");
      if (!c.std.is_auto && c.hidden_dim)
        ctx.fail("hidden_dim", fmt::format("must not be given when std is a number (std = {}); remove it or set "
                                           "std = \"auto\"",
                                           format_float(c.std.value)));
      if (c.weight_init_type == "plain" && c.num_layers)
        ctx.fail("num_layers", "must not be given when weight_init_type = \"plain\"");
      if (c.weight_init_type != "plain" && !c.num_layers)
        ctx.fail("num_layers", fmt::format("required when weight_init_type = \"{}\"", c.weight_init_type));
    });
  }
};

class ComposedInitializer final : public ModelInitializer {
 public:
  explicit ComposedInitializer(const ComposedConfig& c) : mean_(c.mean) {
    auto group = [&](const std::string& stage) {
      return c.model_type == "coca" ? coca_group(stage) : gpt2_group(stage);
    };
    const double plain_std = c.std.is_auto ? std::sqrt(2.0 / (5.0 * static_cast<double>(*c.hidden_dim))) : c.std.value;
    add_stage("plain", plain_std, group("plain"));
    if (c.weight_init_type != "plain")
      add_stage("scaled", plain_std / std::sqrt(2.0 * static_cast<double>(*c.num_layers)), group("scaled"));
    if (c.weight_init_type == "scaled_embed") add_stage("scaled_embed", std::sqrt(0.4), group("scaled_embed"));
  }

  void initialize_in_place(Module& model) const override {
    at::NoGradGuard no_grad;
    const std::vector<NamedParameter> params = unique_parameters(model);
    for (const Stage& stage : stages_) {
      for (const NamedParameter& p : params) {
        std::vector<std::string> hits;
        bool weight = false;
        for (const Pattern& w : stage.weights)
          if (w.full_match(p.name)) hits.push_back(w.text), weight = true;
        for (const Pattern& b : stage.biases)
          if (b.full_match(p.name)) hits.push_back(b.text);
        if (hits.empty()) continue;
        MODALITIES_CHECK(hits.size() == 1,
                         "model_initialization/composed: parameter '{}' matches {} patterns of the {} stage ({}); "
                         "each parameter may match one",
                         p.name, hits.size(), stage.name, name_list(hits));
        if (weight) p.tensor.normal_(mean_, stage.std);
        else p.tensor.zero_();
      }
    }
  }

 private:
  struct Stage {
    std::string name;
    double std;
    std::vector<Pattern> weights, biases;
  };
  void add_stage(std::string name, double std, const RegexFilter& f) {
    stages_.push_back({std::move(name), std, compile(f.weights), compile(f.biases)});
  }

  double mean_;
  std::vector<Stage> stages_;
};

// --- model_initialization/gpt2_llama3_like ----------------------------------------

struct Llama3Config {
  std::int64_t num_layers = 0;
  std::int64_t n_embd = 0;
  bool depth_init = true;

  static void describe(Schema<Llama3Config>& s) {
    s.field("num_layers", &Llama3Config::num_layers,
            "Number of transformer layers (std of output projections "
            "when depth_init = false).")
        .required()
        .positive();
    s.field("n_embd", &Llama3Config::n_embd, "Model width: lm_head std 1/sqrt(n_embd), bounds +-3/sqrt(n_embd).")
        .required()
        .positive();
    s.field("depth_init", &Llama3Config::depth_init,
            "Output projections (attn.c_proj, mlp.V, mlp.W_2) get std 0.02/sqrt(2*(layer+1)); false: "
            "0.02/sqrt(2*num_layers).");
  }
};

class Llama3Initializer final : public ModelInitializer {
 public:
  explicit Llama3Initializer(const Llama3Config& c) : config_(c) {
    const double d = static_cast<double>(c.n_embd);
    rules_.push_back({Pattern(R"(transformer\.h\.\d+\.attn\.(q_attn|k_attn|v_attn)\.weight)"), 0.02, false, 2.0});
    rules_.push_back({Pattern(R"(transformer\.h\.\d+\.attn\.c_proj\.weight)"), 0.0, true, 2.0});
    rules_.push_back({Pattern(R"(transformer\.h\.\d+\.mlp\.(W)\.weight)"), 0.02, false, 2.0});
    rules_.push_back({Pattern(R"(transformer\.h\.\d+\.mlp\.(V|W_2)\.weight)"), 0.0, true, 2.0});
    rules_.push_back({Pattern(R"(transformer\.wte\.weight)"), 1.0, false, 0.0});  // plain normal, no bounds
    rules_.push_back({Pattern(R"(transformer\.lm_head\.weight)"), 1.0 / std::sqrt(d), false, 3.0 / std::sqrt(d)});
  }

  void initialize_in_place(Module& model) const override {
    static const std::regex kLayerId(R"(transformer\.h\.(\d+)\.)");
    const std::vector<NamedParameter> params = unique_parameters(model);
    // Check everything before the first draw, so a rejected model is left untouched.
    std::vector<int> rule_of(params.size(), -1);
    std::vector<std::size_t> hits(rules_.size(), 0);
    std::vector<std::string> unmatched;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::string& name = params[i].name;
      MODALITIES_CHECK(!name.ends_with("bias"),
                       "model_initialization/gpt2_llama3_like: the model has a bias parameter '{}', and this "
                       "initializer allows none: configure the model with bias = false and bias-free norms "
                       "(pytorch_rms_norm, or rms_norm/layer_norm with bias = false)",
                       name);
      std::vector<std::string> matched;
      for (std::size_t r = 0; r < rules_.size(); ++r) {
        if (!rules_[r].pattern.full_match(name)) continue;
        matched.push_back(rules_[r].pattern.text);
        rule_of[i] = static_cast<int>(r);
        ++hits[r];
      }
      MODALITIES_CHECK(matched.size() <= 1,
                       "model_initialization/gpt2_llama3_like: parameter '{}' matches {} rules ({}); each parameter "
                       "may match one",
                       name, matched.size(), name_list(matched));
      if (matched.empty()) unmatched.push_back(name);
    }
    for (std::size_t r = 0; r < rules_.size(); ++r)
      MODALITIES_CHECK(hits[r] > 0,
                       "model_initialization/gpt2_llama3_like: rule '{}' matches no parameter of the model; the model "
                       "does not have the Llama-3 layout this initializer expects (SwiGLU MLP, untied lm_head, "
                       "every model part holding wte and lm_head)",
                       rules_[r].pattern.text);
    if (!unmatched.empty())  // Modalities logs one warning per parameter; one line here
      log::warning(
          fmt::format("model_initialization/gpt2_llama3_like: {} parameter(s) match no rule and keep their "
                      "values: {}",
                      unmatched.size(), name_list(unmatched)));

    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (rule_of[i] < 0) continue;
      const Rule& rule = rules_[static_cast<std::size_t>(rule_of[i])];
      const at::Tensor& p = params[i].tensor;
      if (rule.bound == 0.0) {  // wte: N(0, 1)
        p.normal_(0.0, rule.std);
        continue;
      }
      double std = rule.std;
      if (rule.depth_scaled) {
        if (config_.depth_init) {
          std::smatch m;
          MODALITIES_CHECK(std::regex_search(params[i].name, m, kLayerId),
                           "model_initialization/gpt2_llama3_like: cannot read the layer number of '{}'",
                           params[i].name);
          const double layer_id = std::stod(m[1].str());
          std = 0.02 / std::sqrt(2.0 * (layer_id + 1.0));
        } else {
          std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.num_layers));
        }
      }
      trunc_normal_(p, 0.0, std, -rule.bound, rule.bound);
    }
  }

 private:
  struct Rule {
    Pattern pattern;
    double std;         // unused when depth_scaled
    bool depth_scaled;  // std from the layer number (depth_init) or num_layers
    double bound;       // truncation at +-bound (absolute); 0: plain normal
  };
  Llama3Config config_;
  std::vector<Rule> rules_;
};

// --- model/model_initialized --------------------------------------------------------

struct ModelInitializedConfig {
  Ref<Module> model;
  Ref<ModelInitializer> model_initializer;

  static void describe(Schema<ModelInitializedConfig>& s) {
    s.field("model", &ModelInitializedConfig::model,
            "Model to initialize in place; if built on the meta device it is first materialized (uninitialized) "
            "on the run device.")
        .required();
    s.field("model_initializer", &ModelInitializedConfig::model_initializer,
            "Applied after the model's own reset_parameters().")
        .required();
  }
};

std::shared_ptr<Module> initialize_model(const ModelInitializedConfig& c, BuildContext& ctx) {
  materialize_and_initialize(*c.model, *c.model_initializer, c.model.origin(), ctx);
  return c.model.shared();
}

}  // namespace

void register_components(Registrar& r) {
  r.add<ModelInitializer, ComposedConfig>(
      "composed", "Normal initialization by parameter-name regexes: plain, then scaled, then scaled_embed.",
      [](const ComposedConfig& c) { return std::make_shared<ComposedInitializer>(c); });
  r.add<ModelInitializer, Llama3Config>(
      "gpt2_llama3_like", "Llama-3-style init (TorchTitan): truncated normals, depth-scaled output projections.",
      [](const Llama3Config& c) { return std::make_shared<Llama3Initializer>(c); });
  r.add<Module, ModelInitializedConfig>(
      "model_initialized",
      "Materializes a meta-device model on the run device, resets its parameters and applies an initializer; "
      "returns the same model.",
      [](const ModelInitializedConfig& c, BuildContext& ctx) { return initialize_model(c, ctx); });
}

}  // namespace modalities::plugins::initialization

MODALITIES_PLUGIN(initialization, MODALITIES_PLUGIN_VERSION, modalities::plugins::initialization::register_components)
