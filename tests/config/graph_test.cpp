// The component graph (docs/configs.md; the conformance cases of Modalities' config tests): sharing through references,
// private inline instances, build order, profiles, strict node shapes, typed
// fields, aggregated errors with file:line:col and dotted paths.
#include "test_components.h"

#include <modalities/core/graph.h>
#include <modalities/core/interpolation.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace modalities::core {
namespace {

using test::build_log;
using test::Holder;
using test::Widget;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class GraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::register_test_components(registry_);
    build_log().clear();
  }

  BuiltGraph build(std::string_view text, const PipelineProfile* profile = nullptr) {
    root_ = load_toml_string(text, "graph.toml");
    resolve_interpolations(root_, builtin_resolvers({}));
    ComponentGraph g(registry_, root_, profile);
    return g.build({});
  }

  std::string error_of(std::string_view text, const PipelineProfile* profile = nullptr) {
    try {
      build(text, profile);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }

  static std::shared_ptr<Widget> widget(const BuiltGraph& g, std::string_view key) {
    return std::static_pointer_cast<Widget>(g.get(key)->as_object().ptr);
  }

  Registry registry_;
  ConfigNode root_;
};

constexpr const char* kSharing = R"(
[holder_list]
component_key = "widget"
variant_key = "list_holder"
[holder_list.config]
name = "list"
[[holder_list.config.deps]]
component_key = "widget"
variant_key = "plain"
config = { name = "inline_a" }
[[holder_list.config.deps]]
instance_key = "shared"
pass_type = "BY_REFERENCE"
[[holder_list.config.deps]]
component_key = "widget"
variant_key = "plain"
config = { name = "inline_a" }

[shared]
component_key = "widget"
variant_key = "plain"
config = { name = "shared" }

[holder]
component_key = "widget"
variant_key = "holder"
config = { name = "holder", dep = { instance_key = "shared", pass_type = "BY_REFERENCE" } }
)";

TEST_F(GraphTest, ForwardAndBackwardReferencesShareOneInstance) {
  const BuiltGraph g = build(kSharing);
  auto list = std::static_pointer_cast<Holder>(widget(g, "holder_list"));
  auto holder = std::static_pointer_cast<Holder>(widget(g, "holder"));
  ASSERT_EQ(list->deps.size(), 3u);
  EXPECT_EQ(list->deps[1].get(), widget(g, "shared").get());    // forward reference
  EXPECT_EQ(holder->deps[0].get(), widget(g, "shared").get());  // backward reference
  EXPECT_NE(list->deps[0].get(), list->deps[2].get());          // equal inline definitions: distinct
  EXPECT_EQ(std::count(build_log().begin(), build_log().end(), "shared"), 1);
}

TEST_F(GraphTest, BuildsChildrenFirstAndReferencedNodesAtFirstReference) {
  build(kSharing);
  EXPECT_THAT(build_log(), ElementsAre("inline_a", "shared", "inline_a", "list", "holder"));
}

TEST_F(GraphTest, InterpolatedComponentNodeIsANewInstance) {
  const BuiltGraph g = build(R"(
[proto]
component_key = "widget"
variant_key = "plain"
config = { name = "proto" }
[copy]
component_key = "widget"
variant_key = "holder"
config = { name = "copy", dep = "${proto}" }
)");
  auto copy = std::static_pointer_cast<Holder>(widget(g, "copy"));
  EXPECT_NE(copy->deps[0].get(), widget(g, "proto").get());
  EXPECT_EQ(copy->deps[0]->name, "proto");
}

TEST_F(GraphTest, NoImplicitReferencingByKeyName) {
  const BuiltGraph g = build(R"(
[dep]
component_key = "widget"
variant_key = "plain"
config = { name = "top_level_dep" }
[holder]
component_key = "widget"
variant_key = "holder"
[holder.config]
name = "h"
dep = { component_key = "widget", variant_key = "plain", config = { name = "nested_dep" } }
)");
  auto holder = std::static_pointer_cast<Holder>(widget(g, "holder"));
  EXPECT_EQ(holder->deps[0]->name, "nested_dep");
  EXPECT_NE(holder->deps[0].get(), widget(g, "dep").get());
}

TEST_F(GraphTest, ProfileSelectsOnlyItsKeysInItsOrder) {
  PipelineProfile p{"test", "test profile", {{"second", "Widget", true, ""}, {"first", "Widget", true, ""}}};
  const BuiltGraph g = build(R"(
[first]
component_key = "widget"
variant_key = "plain"
config = { name = "first" }
[unused]
component_key = "widget"
variant_key = "plain"
config = { name = "unused" }
[second]
component_key = "widget"
variant_key = "plain"
config = { name = "second" }
)",
                             &p);
  EXPECT_THAT(build_log(), ElementsAre("second", "first"));
  EXPECT_EQ(g.top_level.size(), 2u);
}

TEST_F(GraphTest, ProfileReportsMissingKeysAndWrongInterfaces) {
  PipelineProfile p{"test", "", {{"model", "Widget", true, "the model"}, {"gadget", "Widget", true, "a widget"}}};
  const std::string e = error_of("[gadget]\ncomponent_key = \"gadget\"\nvariant_key = \"plain\"\nconfig = {}\n", &p);
  EXPECT_THAT(e, HasSubstr("missing top-level key 'model' required by pipeline 'test'"));
  EXPECT_THAT(e, HasSubstr("pipeline 'test' needs Widget here, got Gadget (gadget/plain)"));
}

TEST_F(GraphTest, MissingReferenceTargetNamesTheReferrerAndSuggests) {
  const std::string e = error_of(R"(
[shared_widget]
component_key = "widget"
variant_key = "plain"
config = { name = "w" }
[holder]
component_key = "widget"
variant_key = "holder"
config = { name = "h", dep = { instance_key = "shared_widgte", pass_type = "BY_REFERENCE" } }
)");
  EXPECT_THAT(e, HasSubstr("graph.toml:9:"));
  EXPECT_THAT(e, HasSubstr("holder.config.dep.instance_key"));
  EXPECT_THAT(e, HasSubstr("reference to missing top-level key 'shared_widgte'"));
  EXPECT_THAT(e, HasSubstr("did you mean 'shared_widget'?"));
}

TEST_F(GraphTest, ReferenceCyclesAreReportedWithThePath) {
  const std::string e = error_of(R"(
[a]
component_key = "widget"
variant_key = "holder"
config = { name = "a", dep = { instance_key = "b", pass_type = "BY_REFERENCE" } }
[b]
component_key = "widget"
variant_key = "holder"
config = { name = "b", dep = { instance_key = "a", pass_type = "BY_REFERENCE" } }
)");
  EXPECT_THAT(e, HasSubstr("reference cycle: a -> b -> a"));
}

TEST_F(GraphTest, NodeShapesAreStrict) {
  EXPECT_THAT(
      error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"plain\"\nconfig = { name = \"n\" }\nextra = 1\n"),
      HasSubstr("unexpected key 'extra' in a component node"));
  EXPECT_THAT(error_of("[x]\ncomponent_key = \"widget\"\nconfig = {}\n"),
              HasSubstr("component node has no variant_key"));
  EXPECT_THAT(error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"plain\"\n"),
              HasSubstr("component node has no config table"));
  EXPECT_THAT(error_of("[t]\ny = 1\n[x]\nr = { instance_key = \"t\", pass_type = \"BY_VALUE\" }\n"),
              HasSubstr("BY_VALUE is not supported"));
  EXPECT_THAT(error_of("[t]\ny = 1\n[x]\nr = { instance_key = \"t\", pass_type = \"BY_REFERENCE\", z = 1 }\n"),
              HasSubstr("unexpected key 'z' in a reference"));
  EXPECT_THAT(error_of("[x]\nr = { instance_key = \"t\" }\n"), HasSubstr("reference has no pass_type"));
}

TEST_F(GraphTest, UnknownComponentAndVariantSuggestTheNearest) {
  const std::string e1 = error_of("[x]\ncomponent_key = \"widgit\"\nvariant_key = \"plain\"\nconfig = {}\n");
  EXPECT_THAT(e1, HasSubstr("graph.toml:2:"));
  EXPECT_THAT(e1, HasSubstr("x.component_key: unknown component_key 'widgit'"));
  EXPECT_THAT(e1, HasSubstr("did you mean 'widget'?"));
  const std::string e2 = error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"plane\"\nconfig = {}\n");
  EXPECT_THAT(e2, HasSubstr("x.variant_key: unknown variant 'plane' of component 'widget'"));
  EXPECT_THAT(e2, HasSubstr("did you mean 'plain'?"));
}

TEST_F(GraphTest, ConfigKeysAreCheckedWithHintsAndProvenance) {
  const std::string e =
      error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"plain\"\nconfig = { nmae = \"n\" }\n");
  EXPECT_THAT(e, HasSubstr("x.config.nmae: unknown key"));
  EXPECT_THAT(e, HasSubstr("did you mean 'name'?"));
  EXPECT_THAT(e, HasSubstr("x.config.name: missing required key"));
  EXPECT_THAT(e, HasSubstr("(widget/plain from test_components"));
}

TEST_F(GraphTest, TypesAreStrict) {
  auto tuned = [&](const std::string& cfg) {
    return error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"tuned\"\nconfig = { " + cfg + " }\n");
  };
  EXPECT_THAT(tuned("small = 1.5"), HasSubstr("x.config.small: expected an integer, got float 1.5"));
  EXPECT_THAT(tuned("small = true"), HasSubstr("expected an integer, got boolean"));
  EXPECT_THAT(tuned("small = 3000000000"), HasSubstr("x.config.small: integer 3000000000 is out of range"));
  EXPECT_THAT(tuned("flag = 1"), HasSubstr("x.config.flag: expected a boolean"));
  EXPECT_THAT(tuned("lr = \"0.1\""), HasSubstr("x.config.lr: expected a number, got string"));
  EXPECT_EQ(tuned("lr = 1"), "");  // an integer is a valid float
  const std::string null_error = tuned("small = \"${null:}\"");
  EXPECT_THAT(null_error, HasSubstr("x.config.small: expected an integer, got null"));
  EXPECT_THAT(null_error, HasSubstr("an unset environment variable (${cuda_env:NAME}) or ${null:} gives null"));
  EXPECT_THAT(null_error, ::testing::Not(HasSubstr("null null")));
}

TEST_F(GraphTest, ConstraintsNameTheElement) {
  auto tuned = [&](const std::string& cfg) {
    return error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"tuned\"\nconfig = { " + cfg + " }\n");
  };
  EXPECT_THAT(tuned("betas = [0.9, 1.2]"), HasSubstr("x.config.betas[1]: must be in (0, 1), got 1.2"));
  EXPECT_THAT(tuned("betas = [0.9]"), HasSubstr("expected exactly 2 elements, got 1"));
  EXPECT_THAT(tuned("mode = \"fsat\""), HasSubstr("must be one of 'fast', 'slow', got 'fsat'"));
  EXPECT_THAT(tuned("mode = \"fsat\""), HasSubstr("did you mean 'fast'?"));
  EXPECT_THAT(tuned("warmup = 20, total = 10"), HasSubstr("x.config.warmup: must be < total (10), got 20"));
}

TEST_F(GraphTest, DeprecatedAliasWarnsAndBothSpellingsIsAnError) {
  EXPECT_EQ(
      error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"plain\"\nconfig = { name = \"n\", old_size = 2 }\n"),
      "");
  EXPECT_THAT(error_of("[x]\ncomponent_key = \"widget\"\nvariant_key = \"plain\"\nconfig = { name = \"n\", size = 1, "
                       "old_size = 2 }\n"),
              HasSubstr("are both given"));
}

TEST_F(GraphTest, WrongInterfaceInATypedFieldNamesBoth) {
  const std::string e = error_of(R"(
[g]
component_key = "gadget"
variant_key = "plain"
config = {}
[h]
component_key = "widget"
variant_key = "holder"
config = { name = "h", dep = { instance_key = "g", pass_type = "BY_REFERENCE" } }
)");
  EXPECT_THAT(e, HasSubstr("h.config.dep: expected a Widget, but gadget/plain produces Gadget"));
}

TEST_F(GraphTest, AllErrorsOfAFileAreReportedTogether) {
  const std::string e = error_of(R"(
[a]
component_key = "widget"
variant_key = "plain"
config = { name = 1 }
[b]
component_key = "widget"
variant_key = "nope"
config = {}
[c]
component_key = "widget"
variant_key = "tuned"
config = { lr = -1.0 }
)");
  EXPECT_THAT(e, HasSubstr("a.config.name"));
  EXPECT_THAT(e, HasSubstr("b.variant_key"));
  EXPECT_THAT(e, HasSubstr("c.config.lr: must be > 0"));
}

TEST_F(GraphTest, ValueProducingComponentsFeedTypedFieldsAndAreCheckedAfterBuilding) {
  // The nested number is only known after it is built: its constraint (> 0) is checked then.
  const std::string ok = error_of(R"(
[x]
component_key = "widget"
variant_key = "plain"
config = { name = "n", size = { component_key = "number", variant_key = "size_of", config = { name = "s", size = 4 } } }
)");
  EXPECT_EQ(ok, "");
  const std::string e = error_of(R"(
[x]
component_key = "widget"
variant_key = "tuned"
[x.config]
total = { component_key = "number", variant_key = "size_of", config = { name = "s", size = 4 } }
warmup = { component_key = "number", variant_key = "size_of", config = { name = "s", size = 9 } }
)");
  EXPECT_THAT(e, HasSubstr("x.config.warmup: must be < total (4), got 9"));
}

TEST_F(GraphTest, FactoryFailureNamesTheNodeAndThePlugin) {
  const std::string e = error_of("[boom]\ncomponent_key = \"widget\"\nvariant_key = \"exploding\"\nconfig = {}\n");
  EXPECT_THAT(e, HasSubstr("graph.toml:1:"));
  EXPECT_THAT(e, HasSubstr("boom: building widget/exploding failed: kaboom: the factory failed"));
}

TEST_F(GraphTest, AFactoryBuildsAnotherRegisteredVariant) {
  const BuiltGraph g =
      build("[w]\ncomponent_key = \"widget\"\nvariant_key = \"delegating\"\nconfig = { name = \"a\", size = 3 }\n");
  EXPECT_EQ(widget(g, "w")->name, "a (delegated)");
  EXPECT_EQ(widget(g, "w")->size, 3);
  EXPECT_THAT(build_log(), ElementsAre("a (delegated)"));
  // Its own config as it came (BuildContext::config).
  const BuiltGraph same = build(
      "[w]\ncomponent_key = \"widget\"\nvariant_key = \"delegating\"\nconfig = { name = \"as given\", size = 5 }\n");
  EXPECT_EQ(widget(same, "w")->name, "as given");
  EXPECT_EQ(widget(same, "w")->size, 5);
  // The nested variant's errors are reported at this node; an unregistered one is named.
  EXPECT_THAT(error_of("[w]\ncomponent_key = \"widget\"\nvariant_key = \"delegating\"\nconfig = { name = \"zero\" }\n"),
              HasSubstr("w.config.size"));
  const std::string e =
      error_of("[w]\ncomponent_key = \"widget\"\nvariant_key = \"delegating\"\nconfig = { name = \"gadget\" }\n");
  EXPECT_THAT(e, HasSubstr("building widget/delegating failed: widget/missing is not registered"));
}

TEST_F(GraphTest, DotGraphShowsNestingAndReferences) {
  root_ = load_toml_string(kSharing, "graph.toml");
  ComponentGraph g(registry_, root_, nullptr);
  const std::string dot = g.to_dot();
  EXPECT_THAT(dot, HasSubstr("digraph modalities"));
  EXPECT_THAT(dot, HasSubstr("\"holder\" -> \"shared\" [style=dashed"));
  EXPECT_THAT(dot, HasSubstr("\"holder_list\" -> \"holder_list.config.deps[0]\""));
}

TEST_F(GraphTest, RegistryOverrideIsScoped) {
  VariantSpec spec = registry_.find("widget", "plain")->spec;
  spec.summary = "overridden";
  {
    Registry::Override o(registry_, spec);
    EXPECT_EQ(registry_.find("widget", "plain")->spec.summary, "overridden");
  }
  EXPECT_EQ(registry_.find("widget", "plain")->spec.summary, "A named widget.");
}

}  // namespace
}  // namespace modalities::core

namespace modalities::core {
namespace {

TEST(RegistryTest, PluginResolversCannotShadowBuiltInsOrEachOther) {
  Registry r;
  auto resolver = [](std::string name) {
    return [name](Registrar& reg) { reg.resolver(name, "test", [](std::string_view) { return Value(1); }); };
  };
  EXPECT_THAT(r.register_plugin(PluginInfo{"shadow", "1", {}, {}, {}}, resolver("cuda_env")).value_or(""),
              HasSubstr("resolver 'cuda_env' is built into the host"));
  EXPECT_FALSE(r.register_plugin(PluginInfo{"first", "1", {}, {}, {}}, resolver("my_env")));
  EXPECT_THAT(r.register_plugin(PluginInfo{"second", "2", {}, {}, {}}, resolver("my_env")).value_or(""),
              HasSubstr("resolver 'my_env' registered twice: first and second"));
  EXPECT_THAT(r.register_plugin(PluginInfo{"twice", "1", {}, {}, {}},
                                [](Registrar& reg) {
                                  reg.resolver("x_env", "a", [](std::string_view) { return Value(1); });
                                  reg.resolver("x_env", "b", [](std::string_view) { return Value(2); });
                                })
                  .value_or(""),
              HasSubstr("resolver 'x_env' is registered twice by twice"));
  EXPECT_EQ(r.plugin_resolvers().size(), 1u);
}

}  // namespace
}  // namespace modalities::core
