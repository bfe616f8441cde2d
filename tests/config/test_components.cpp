// Test components (see test_components.h).
#include "test_components.h"

#include <gtest/gtest.h>

namespace modalities::test {
namespace {

struct PlainConfig {
  std::string name;
  std::int64_t size = 1;
  static void describe(Schema<PlainConfig>& s) {
    s.field("name", &PlainConfig::name, "Name recorded in the build log.").required();
    s.field("size", &PlainConfig::size, "A positive size.").positive().alias("old_size");
  }
};

struct HolderConfig {
  std::string name;
  Ref<Widget> dep;
  static void describe(Schema<HolderConfig>& s) {
    s.field("name", &HolderConfig::name, "Name.").required();
    s.field("dep", &HolderConfig::dep, "The widget it holds.").required();
  }
};

struct ListHolderConfig {
  std::string name;
  std::vector<Ref<Widget>> deps;
  static void describe(Schema<ListHolderConfig>& s) {
    s.field("name", &ListHolderConfig::name, "Name.").required();
    s.field("deps", &ListHolderConfig::deps, "Widgets it holds.").required();
  }
};

struct TunedConfig {
  std::array<double, 2> betas = {0.9, 0.95};
  std::int32_t small = 0;
  double lr = 1e-3;
  bool flag = false;
  std::string mode = "fast";
  std::int64_t warmup = 0;
  std::int64_t total = 10;
  static void describe(Schema<TunedConfig>& s) {
    s.field("betas", &TunedConfig::betas, "Two coefficients.").in_open(0.0, 1.0);
    s.field("small", &TunedConfig::small, "A 32-bit integer.");
    s.field("lr", &TunedConfig::lr, "Learning rate.").positive();
    s.field("flag", &TunedConfig::flag, "A switch.");
    s.field("mode", &TunedConfig::mode, "Speed.").one_of({"fast", "slow"});
    s.field("warmup", &TunedConfig::warmup, "Warmup steps.").non_negative();
    s.field("total", &TunedConfig::total, "Total steps.").positive();
    s.rule([](const TunedConfig& c, ParseContext& ctx) {
      if (c.warmup >= c.total) ctx.fail("warmup", fmt::format("must be < total ({}), got {}", c.total, c.warmup));
    });
  }
};

struct EmptyConfig {
  static void describe(Schema<EmptyConfig>&) {}
};

}  // namespace

std::vector<std::string>& build_log() {
  static std::vector<std::string> log;
  return log;
}

void register_test_components(core::Registry& registry) {
  auto failure = registry.register_plugin(core::PluginInfo{"test_components", "1.0", {}, {}, {}}, [](Registrar& r) {
    r.add<Widget, PlainConfig>("plain", "A named widget.", [](const PlainConfig& c) {
      build_log().push_back(c.name);
      auto w = std::make_shared<Widget>();
      w->name = c.name;
      w->size = c.size;
      return w;
    });
    r.add<Widget, HolderConfig>("holder", "Holds one widget.", [](const HolderConfig& c) {
      build_log().push_back(c.name);
      auto h = std::make_shared<Holder>();
      h->name = c.name;
      h->deps.push_back(c.dep.shared());
      return std::shared_ptr<Widget>(h);
    });
    r.add<Widget, ListHolderConfig>("list_holder", "Holds widgets.", [](const ListHolderConfig& c) {
      build_log().push_back(c.name);
      auto h = std::make_shared<Holder>();
      h->name = c.name;
      for (const auto& d : c.deps) h->deps.push_back(d.shared());
      return std::shared_ptr<Widget>(h);
    });
    r.add<Widget, TunedConfig>("tuned", "Exercises constraints.",
                               [](const TunedConfig&) { return std::make_shared<Widget>(); });
    r.add<Gadget, EmptyConfig>("plain", "A gadget.", [](const EmptyConfig&) { return std::make_shared<Gadget>(); });
    r.add<Widget, EmptyConfig>(
        "exploding", "Factory always throws.",
        [](const EmptyConfig&) -> std::shared_ptr<Widget> { throw Error("kaboom: the factory failed"); });
    // Hands a config to another variant (BuildContext::build): widget/plain (with size 0, which it
    // refuses, for the name "zero"; its own config as given for the name "as given"), or for the
    // name "gadget" the unregistered widget/missing.
    r.add<Widget, PlainConfig>("delegating", "Built by widget/plain.", [](const PlainConfig& c, BuildContext& ctx) {
      if (c.name == "as given")
        return std::static_pointer_cast<Widget>(ctx.build("widget", "plain", ctx.config()).as_object().ptr);
      Value::Table t{{"name", Value(c.name + " (delegated)")}, {"size", Value(c.name == "zero" ? 0 : c.size)}};
      const Value v = ctx.build("widget", c.name == "gadget" ? "missing" : "plain", Value(std::move(t)));
      return std::static_pointer_cast<Widget>(v.as_object().ptr);
    });
    r.add_value<std::int64_t, PlainConfig>("number", "size_of", "Returns its size.",
                                           [](const PlainConfig& c) { return c.size; });
  });
  if (failure) ADD_FAILURE() << *failure;
}

}  // namespace modalities::test
