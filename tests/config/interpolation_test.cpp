// Interpolation semantics of docs/configs.md ("Interpolation", "Resolvers"): typed whole-string
// substitution, string concatenation, subtree copies, chained paths, escapes,
// the built-in resolvers, and errors (unknown paths and resolvers, cycles).
#include <modalities/core/interpolation.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace modalities::core {
namespace {

using ::testing::HasSubstr;

ConfigNode resolved(std::string_view text, const ModalitiesEnv& env = {}) {
  ConfigNode root = load_toml_string(text, "interp.toml");
  resolve_interpolations(root, builtin_resolvers(env));
  return root;
}

std::string error_of(std::string_view text, const ModalitiesEnv& env = {}) {
  try {
    resolved(text, env);
  } catch (const ConfigFileError& e) {
    return e.what();
  }
  return "";
}

Value at(const ConfigNode& root, std::initializer_list<std::string> path) {
  const ConfigNode* n = &root;
  for (const auto& k : path) n = n->find(k);
  return n == nullptr ? Value("<missing>") : n->to_value();
}

TEST(InterpolationTest, WholeStringKeepsTheTargetType) {
  const ConfigNode r = resolved(R"(
[settings]
n = 256
lr = 0.5
on = true
[model]
seq = "${settings.n}"
lr = "${settings.lr}"
on = "${settings.on}"
)");
  EXPECT_EQ(at(r, {"model", "seq"}).as_int(), 256);
  EXPECT_DOUBLE_EQ(at(r, {"model", "lr"}).as_float(), 0.5);
  EXPECT_TRUE(at(r, {"model", "on"}).as_bool());
}

TEST(InterpolationTest, EmbeddedInterpolationsConcatenateAsText) {
  const ConfigNode r = resolved(R"(
[paths]
root = "/exp"
id = 7
lr = 1e-4
[out]
dir = "${paths.root}/run_${paths.id}/lr${paths.lr}"
)");
  EXPECT_EQ(at(r, {"out", "dir"}).as_string(), "/exp/run_7/lr0.0001");
}

TEST(InterpolationTest, TablesAreCopiedAndCopiesAreIndependent) {
  const ConfigNode r = resolved(R"(
[proto]
component_key = "widget"
variant_key = "plain"
config = { name = "${names.a}" }
[names]
a = "alpha"
[copy]
node = "${proto}"
)");
  const Value copy = at(r, {"copy", "node"});
  ASSERT_TRUE(copy.is_table());
  EXPECT_EQ(copy.find("config")->find("name")->as_string(), "alpha");
}

TEST(InterpolationTest, PathsMayTraverseInterpolatedValuesAndIndexLists) {
  const ConfigNode r = resolved(R"(
[a]
list = [10, 20, { deep = 30 }]
[b]
alias = "${a}"
[c]
x = "${b.alias.list[1]}"
y = "${b.alias.list.2.deep}"
)");
  EXPECT_EQ(at(r, {"c", "x"}).as_int(), 20);
  EXPECT_EQ(at(r, {"c", "y"}).as_int(), 30);
}

TEST(InterpolationTest, EscapedDollarBraceStaysLiteral) {
  const ConfigNode r = resolved(R"(a = "cost: \\${not.a.path} and ${b}"
b = 2
)");
  EXPECT_EQ(at(r, {"a"}).as_string(), "cost: ${not.a.path} and 2");
}

TEST(InterpolationTest, NullResolverGivesNullAndCannotBeEmbedded) {
  EXPECT_TRUE(at(resolved("a = \"${null:}\"\n"), {"a"}).is_null());
  EXPECT_THAT(error_of("a = \"x${null:}\"\n"), HasSubstr("cannot be embedded"));
  EXPECT_THAT(error_of("a = \"${null:arg}\"\n"), HasSubstr("takes no argument"));
}

TEST(InterpolationTest, UnknownPathNamesItAndSuggestsTheNearestKey) {
  const std::string e = error_of("[settings]\nseq_len = 1\n[m]\nx = \"${settings.seqlen}\"\n");
  EXPECT_THAT(e, HasSubstr("interp.toml:4:"));
  EXPECT_THAT(e, HasSubstr("m.x"));
  EXPECT_THAT(e, HasSubstr("no value at 'settings.seqlen'"));
  EXPECT_THAT(e, HasSubstr("did you mean 'settings.seq_len'?"));
}

TEST(InterpolationTest, UnknownResolverSuggestsKnownOnes) {
  const std::string e = error_of("a = \"${cuda_envv:RANK}\"\n");
  EXPECT_THAT(e, HasSubstr("unknown resolver 'cuda_envv'"));
  EXPECT_THAT(e, HasSubstr("did you mean 'cuda_env'?"));
}

TEST(InterpolationTest, CyclesAreReportedWithTheChain) {
  const std::string e = error_of("a = \"${b}\"\nb = \"${c}\"\nc = \"${a}\"\n");
  EXPECT_THAT(e, HasSubstr("interpolation cycle: a -> b -> c -> a"));
  EXPECT_THAT(error_of("a = \"${a}\"\n"), HasSubstr("interpolation cycle: a -> a"));
}

TEST(InterpolationTest, AllErrorsOfAFileAreReportedAtOnce) {
  const std::string e = error_of("a = \"${missing.one}\"\nb = \"${nope:x}\"\n");
  EXPECT_THAT(e, HasSubstr("missing.one"));
  EXPECT_THAT(e, HasSubstr("unknown resolver 'nope'"));
}

TEST(InterpolationTest, EmbeddingATableIsAnError) {
  EXPECT_THAT(error_of("[t]\nx = 1\n[u]\ny = \"pre ${t}\"\n"), HasSubstr("cannot be embedded in a string"));
}

TEST(InterpolationTest, CudaEnvParsesLauncherVariablesAsIntegers) {
  ::setenv("RANK", "3", 1);
  ::setenv("MODALITIES_TEST_STRING_VAR", "hello", 1);
  ::unsetenv("MODALITIES_TEST_UNSET_VAR");
  const ConfigNode r = resolved(
      "r = \"${cuda_env:RANK}\"\ns = \"${cuda_env:MODALITIES_TEST_STRING_VAR}\"\nu = "
      "\"${cuda_env:MODALITIES_TEST_UNSET_VAR}\"\n");
  EXPECT_EQ(at(r, {"r"}).as_int(), 3);
  EXPECT_EQ(at(r, {"s"}).as_string(), "hello");
  EXPECT_TRUE(at(r, {"u"}).is_null());
  ::setenv("RANK", "three", 1);
  EXPECT_THAT(error_of("r = \"${cuda_env:RANK}\"\n"), HasSubstr("not a non-negative integer"));
  ::unsetenv("RANK");
  EXPECT_THAT(error_of("r = \"${cuda_env:RANK}\"\n"), HasSubstr("RANK is not set"));
}

TEST(InterpolationTest, ModalitiesEnvKnowsOnlyWhatTheCommandSupplies) {
  ModalitiesEnv env;
  env.values["config_file_path"] = "/cfg/run.toml";
  EXPECT_EQ(at(resolved("p = \"${modalities_env:config_file_path}\"\n", env), {"p"}).as_string(), "/cfg/run.toml");
  const std::string e = error_of("p = \"${modalities_env:experiment_id}\"\n", env);
  EXPECT_THAT(e, HasSubstr("unknown modalities_env variable 'experiment_id'"));
  EXPECT_THAT(e, HasSubstr("config_file_path"));
}

TEST(InterpolationTest, NodeEnvCountsCpusAndYieldsNullOtherwise) {
  const ConfigNode r = resolved("n = \"${node_env:num_cpus}\"\nx = \"${node_env:other}\"\n");
  EXPECT_GE(at(r, {"n"}).as_int(), 1);
  EXPECT_TRUE(at(r, {"x"}).is_null());
}

TEST(InterpolationTest, RegisteredResolversMayReturnTablesThatPathsTraverse) {
  ResolverTable t = builtin_resolvers({});
  t.add({"warmstart_env", "test", [](std::string_view arg) -> Value {
           if (arg != "checkpoint_paths") throw Error("unknown argument");
           return Value(Value::Table{{"checkpoint_folder_path", Value("/ckpt/seen_steps_5")}});
         }});
  ConfigNode root = load_toml_string(
      "[settings]\nwarm = \"${warmstart_env:checkpoint_paths}\"\n[x]\np = "
      "\"${settings.warm.checkpoint_folder_path}\"\n",
      "w.toml");
  resolve_interpolations(root, t);
  EXPECT_EQ(root.find("x")->find("p")->as_string(), "/ckpt/seen_steps_5");
}

}  // namespace
}  // namespace modalities::core
