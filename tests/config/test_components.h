// In-process test components for the config-engine tests (Modalities' tests/config cases):
// a Widget interface with a plain variant, holders referencing one or a list
// of Widgets, a Gadget interface to provoke interface mismatches, and a
// variant whose factory throws. Every construction is recorded in build_log()
// so tests can assert build order and sharing.
#pragma once

#include <modalities/core/registry.h>
#include <modalities/sdk/registrar.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace modalities::test {

struct Widget {
  static constexpr std::string_view kInterface = "Widget";
  static constexpr std::string_view kComponentKey = "widget";
  virtual ~Widget() = default;
  std::string name;
  std::int64_t size = 0;
};

struct Gadget {
  static constexpr std::string_view kInterface = "Gadget";
  static constexpr std::string_view kComponentKey = "gadget";
  virtual ~Gadget() = default;
};

struct Holder : Widget {
  std::vector<std::shared_ptr<Widget>> deps;
};

/// Names of built components, in construction order.
std::vector<std::string>& build_log();

/// Registers widget/plain, widget/holder, widget/list_holder, widget/tuned,
/// gadget/plain, widget/exploding into `r`.
void register_test_components(core::Registry& r);

}  // namespace modalities::test
