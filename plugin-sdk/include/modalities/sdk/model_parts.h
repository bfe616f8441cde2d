// ModelParts: a config field that takes one Module or a list of model parts
// (the pipeline stages of this rank), as Modalities' "maybe list" fields do
// (optimizers, gradient clippers, app_state/raw). Header-only: a plain struct
// with its Codec, so a config struct simply declares `ModelParts wrapped_model;`.
//
//   wrapped_model = { instance_key = "model", pass_type = "BY_REFERENCE" }
//   wrapped_model = [{ instance_key = "stage0", ... }, { instance_key = "stage1", ... }]
#pragma once

#include <modalities/sdk/interfaces/module.h>
#include <modalities/sdk/schema.h>

#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

namespace modalities {

/// One Module, or a non-empty list of model parts, in config order.
/// After a successful (non-dry-run) parse `parts` holds at least one part.
struct ModelParts {
  std::vector<Ref<Module>> parts;

  /// The parts as shared pointers, in order.
  std::vector<std::shared_ptr<Module>> shared() const {
    std::vector<std::shared_ptr<Module>> out;
    out.reserve(parts.size());
    for (const auto& p : parts) out.push_back(p.shared());
    return out;
  }
};

template <>
struct Codec<ModelParts> {
  static std::string type_name() { return "Ref<Module> | list[Ref<Module>]"; }
  static Parsed parse(const Value& v, ModelParts& out, const std::string& path, ParseContext& ctx) {
    if (v.is_list()) {
      if (v.as_list().empty()) {
        ctx.fail(path, "expected a Module or a non-empty list of Modules, got an empty list");
        return Parsed::kError;
      }
      return Codec<std::vector<Ref<Module>>>::parse(v, out.parts, path, ctx);
    }
    out.parts.assign(1, {});
    return Codec<Ref<Module>>::parse(v, out.parts[0], path, ctx);
  }
  static std::string repr(const ModelParts& m) {
    return m.parts.empty() ? "null" : fmt::format("<{} part(s)>", m.parts.size());
  }
  static void annotate(FieldInfo& info) { info.interface = std::string(Module::kInterface); }
};

}  // namespace modalities
