// Tagged unions in configs: a table `{ <tag_key> = "<tag>", config = { ... } }` whose `config`
// follows the schema of the alternative the tag names, as Modalities' `norm_type` and
// `type_hint` unions are written:
//
//   attention_norm_config = { norm_type = "pytorch_rms_norm", config = { normalized_shape = 768 } }
//
// A Codec<T> for such a field holds one TaggedUnion<T> and forwards to it; each alternative is a
// DescribedStruct parsed with its own schema and then folded into T:
//
//   static const TaggedUnion<NormConfig>& norm_union() {
//     static const TaggedUnion<NormConfig> u{"norm_type", "Norm module.", "Settings of the chosen norm.",
//         {TaggedUnion<NormConfig>::alternative<LayerNormFields>("layer_norm", "LayerNorm keys",
//              [](const LayerNormFields& f, const Value& config, NormConfig& out, const std::string& path,
//                 ParseContext& ctx) { out.eps = f.eps; ... })}};
//     return u;
//   }
//
// Unknown keys, a missing or unknown tag (with a "did you mean"), a missing config and every error
// of the chosen alternative's schema are reported with their paths; `modalities plugins describe`
// shows the tag's choices and each alternative's fields. Header-only.
#pragma once

#include <modalities/sdk/schema.h>

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace modalities {

template <class T>
class TaggedUnion {
 public:
  /// One alternative: its tag, help, the fields of its config (for describe) and how its config
  /// is parsed into T.
  struct Alternative {
    std::string tag;
    std::string help;
    std::vector<FieldInfo> fields;
    /// `path`: the union's path (its config is at path.config).
    std::function<Parsed(const Value& config, T& out, const std::string& path, ParseContext& ctx)> parse;
  };

  /// The alternative `tag` whose config is the DescribedStruct F, folded into T by `fold(f, config,
  /// out, path, ctx)` after F's schema accepted it (`config` is the raw table, for keys whose mere
  /// presence matters; `path` is the union's own path, for warnings about the tag).
  template <class F, class Fold>
  static Alternative alternative(std::string tag, std::string help, Fold fold) {
    Alternative a;
    a.tag = std::move(tag);
    a.help = std::move(help);
    a.fields = Schema<F>::instance().fields();
    a.parse = [fold = std::move(fold)](const Value& config, T& out, const std::string& path, ParseContext& ctx) {
      F f{};
      const Parsed r = Schema<F>::instance().parse(config, f, join_path(path, "config"), ctx);
      if (r == Parsed::kOk) fold(f, config, out, path, ctx);
      return r;
    };
    return a;
  }

  TaggedUnion(std::string tag_key, std::string tag_help, std::string config_help, std::vector<Alternative> alternatives)
      : tag_key_(std::move(tag_key)),
        tag_help_(std::move(tag_help)),
        config_help_(std::move(config_help)),
        alternatives_(std::move(alternatives)) {
    for (const Alternative& a : alternatives_) tags_.push_back(a.tag);
  }

  const std::vector<std::string>& tags() const { return tags_; }
  const std::string& tag_key() const { return tag_key_; }

  std::string type_name() const { return fmt::format("table {{{}, config}}", tag_key_); }

  /// Describes the tag and, under `config`, each alternative's fields.
  void annotate(FieldInfo& info) const {
    FieldInfo tag;
    tag.name = tag_key_;
    tag.type = "string";
    tag.help = tag_help_;
    tag.required = true;
    tag.constraints.push_back("one of " + quoted_list(tags_));
    FieldInfo config;
    config.name = "config";
    config.type = "table";
    config.required = true;
    config.help = config_help_;
    for (const Alternative& a : alternatives_) {
      if (a.fields.empty()) continue;  // e.g. IdentityTransform: {}
      FieldInfo f;
      f.name = fmt::format("[{} = {}] config", tag_key_, a.tag);
      f.type = "table";
      f.help = a.help;
      f.required = true;
      f.children = a.fields;
      config.children.push_back(std::move(f));
    }
    info.children = {std::move(tag), std::move(config)};
  }

  Parsed parse(const Value& v, T& out, const std::string& path, ParseContext& ctx) const {
    if (!v.is_table())
      return detail::type_error(v, fmt::format("a table {{ {} = \"...\", config = {{ ... }} }}", tag_key_), path, ctx);
    const std::size_t before = ctx.error_count();
    const std::vector<std::string> known = {tag_key_, "config"};
    for (const auto& [key, item] : v.as_table()) {
      if (key == tag_key_ || key == "config") continue;
      const std::string near = closest_match(key, known);
      ctx.fail(join_path(path, key), "unknown key",
               near.empty() ? "valid keys: " + quoted_list(known) : fmt::format("did you mean '{}'?", near));
    }
    const Value* t = v.find(tag_key_);
    const Value* config = v.find("config");
    const std::string tpath = join_path(path, tag_key_);
    const Alternative* chosen = nullptr;
    if (t == nullptr) {
      ctx.fail(tpath, fmt::format("missing required key (one of {})", quoted_list(tags_)));
    } else if (!t->is_string()) {
      detail::type_error(*t, "a string", tpath, ctx);
    } else {
      const auto it = std::find_if(alternatives_.begin(), alternatives_.end(),
                                   [&](const Alternative& a) { return a.tag == t->as_string(); });
      if (it == alternatives_.end()) {
        const std::string near = closest_match(t->as_string(), tags_);
        ctx.fail(tpath, fmt::format("must be one of {}, got '{}'", quoted_list(tags_), t->as_string()),
                 near.empty() ? std::string{} : fmt::format("did you mean '{}'?", near));
      } else {
        chosen = &*it;
      }
    }
    if (config == nullptr)
      ctx.fail(join_path(path, "config"),
               fmt::format("missing required key (table: settings of the chosen {})", tag_key_));
    if (ctx.error_count() != before || chosen == nullptr || config == nullptr) return Parsed::kError;
    return chosen->parse(*config, out, path, ctx);
  }

 private:
  std::string tag_key_, tag_help_, config_help_;
  std::vector<Alternative> alternatives_;
  std::vector<std::string> tags_;
};

}  // namespace modalities
