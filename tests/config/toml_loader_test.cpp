// TOML loading: document order (TOML++ iterates alphabetically), strict value
// kinds (no dates), bounded nesting, syntax errors with positions, and the
// TOML writer used by `config resolve` round-tripping.
#include <modalities/core/config_tree.h>
#include <modalities/core/interpolation.h>
#include <modalities/sdk/schema.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace modalities::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> keys(const ConfigNode& n) {
  std::vector<std::string> out;
  for (const auto& [k, v] : n.as_table()) out.push_back(k);
  return out;
}

std::string error_of(std::string_view text) {
  try {
    load_toml_string(text, "bad.toml");
  } catch (const ConfigFileError& e) {
    return e.what();
  }
  return "";
}

TEST(TomlLoaderTest, KeepsDocumentOrderNotAlphabeticalOrder) {
  const ConfigNode root = load_toml_string(R"(
zeta = 1
alpha = 2
[mid]
b = 1
a = 2
[mid.inner]
x = 1
[first]
y = 2
)",
                                           "order.toml");
  EXPECT_THAT(keys(root), ElementsAre("zeta", "alpha", "mid", "first"));
  EXPECT_THAT(keys(*root.find("mid")), ElementsAre("b", "a", "inner"));
}

TEST(TomlLoaderTest, ArrayOfTablesKeepsElementOrderAndPositions) {
  const ConfigNode root = load_toml_string("[[list]]\nname = \"a\"\n[[list]]\nname = \"b\"\n", "aot.toml");
  const auto& list = root.find("list")->as_array();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[1].find("name")->as_string(), "b");
  EXPECT_EQ(list[1].find("name")->where().line, 4u);
}

TEST(TomlLoaderTest, SyntaxErrorNamesFileLineAndColumn) {
  EXPECT_THAT(error_of("a = 1\nb = = 2\n"), HasSubstr("bad.toml:2:"));
  EXPECT_THAT(error_of("a = 1\nb = = 2\n"), HasSubstr("TOML syntax error"));
}

// Every control character a key or string may hold is written escaped, so what to_toml writes
// loads back (U+007F was written raw; found by fuzzing the YAML import, tests/fuzz/corpus/yaml/
// del_in_a_key.yaml).
TEST(TomlLoaderTest, ControlCharactersInKeysAndStringsRoundTrip) {
  std::string text;
  for (int c = 1; c < 0x20; ++c) text += static_cast<char>(c);
  text += '\x7F';
  const ConfigNode root =
      load_toml_string(std::string("[t]\n") + toml_quote("k" + text) + " = " + toml_quote(text) + "\n", "control.toml");
  const ConfigNode again = load_toml_string(to_toml(root), "again.toml");
  const ConfigNode* t = again.find("t");
  ASSERT_NE(t, nullptr);
  const ConfigNode* v = t->find("k" + text);
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->as_string(), text);
}

TEST(TomlLoaderTest, DuplicateKeyIsAnError) { EXPECT_THAT(error_of("a = 1\na = 2\n"), HasSubstr("bad.toml:2:")); }

TEST(TomlLoaderTest, RejectsDatesAndTimesWithTheirPath) {
  const std::string e = error_of("[settings]\nwhen = 2024-01-01\n");
  EXPECT_THAT(e, HasSubstr("bad.toml:2:"));
  EXPECT_THAT(e, HasSubstr("settings.when"));
  EXPECT_THAT(e, HasSubstr("dates and times are not allowed"));
}

TEST(TomlLoaderTest, RejectsAbsurdNesting) {
  std::string deep = "a = " + std::string(200, '[') + std::string(200, ']') + "\n";
  EXPECT_THAT(error_of(deep), HasSubstr("nesting deeper than"));
  const std::string absurd = "a = " + std::string(100000, '[') + std::string(100000, ']') + "\n";
  EXPECT_THAT(error_of(absurd), HasSubstr("maximum nested value depth"));
  std::string header = "[";
  for (int i = 0; i < 100; ++i) header += (i ? ".k" : "k") + std::to_string(i);
  EXPECT_THAT(error_of(header + "]\nx = 1\n"), HasSubstr("nesting deeper than"));
}

// Regression: ~40,000 dotted parts overflowed the stack inside toml::parse (SIGSEGV).
TEST(TomlLoaderTest, RefusesKeysOfTensOfThousandsOfPartsBeforeParsing) {
  std::string dotted = "a";
  for (int i = 0; i < 100000; ++i) dotted += ".b";
  for (const std::string& text :
       {"x = 1\n" + dotted + " = 1\n", "x = 1\n[" + dotted + "]\ny = 1\n", "x = 1\n[[" + dotted + "]]\n",
        "x = 1\nt = { y = 2, " + dotted + " = 3 }\n", "x = [1, { " + dotted + " = 3 }]\n"}) {
    const std::string e = error_of(text);
    EXPECT_THAT(e, HasSubstr("nesting deeper than 64 levels: this key has 100001 dotted parts"));
    EXPECT_THAT(e, HasSubstr("bad.toml:"));
  }
  EXPECT_THAT(error_of("x = 1\n" + dotted + " = 1\n"), HasSubstr("bad.toml:2:1"));
  // Quoted parts count once; dots inside strings and comments do not count.
  const std::string quoted = "\"" + std::string(1000, '.') + "\"";
  EXPECT_EQ(error_of(quoted + " = 1\ns = \"" + dotted + "\" # " + dotted + "\nm = \"\"\"\n" + dotted +
                     "\n\"\"\"\nl = '''\n" + dotted + "'''\n"),
            "");
}

TEST(TomlLoaderTest, RejectsInvalidUtf8) {
  const std::string bad = std::string("name = \"caf") + "\xC3\x28" + "\"\n";
  EXPECT_THAT(error_of(bad), HasSubstr("bad.toml:1:"));
}

TEST(TomlLoaderTest, MissingFileIsAClearError) {
  try {
    load_toml_file("/nonexistent/dir/config.toml");
    FAIL() << "expected an error";
  } catch (const ConfigFileError& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/dir/config.toml"));
    EXPECT_THAT(e.what(), HasSubstr("does not exist"));
  }
}

TEST(TomlLoaderTest, WriterRoundTripsEveryValueKind) {
  const std::string text = R"(
top = [1, 2.5, "x", true]
literal = "\\${not.an.interpolation}"
[a]
s = "quo\"te"
f = 1e-5
i = -3
[a.b]
c = { d = 1, e = [ { f = 2 } ] }
[[a.list]]
name = "one"
[[a.list]]
name = "two"
[a.list.config]
x = 1
)";
  // `config resolve` writes resolved trees: a literal "${" must survive a reload + resolve.
  const ResolverTable resolvers = builtin_resolvers({});
  ConfigNode first = load_toml_string(text, "rt.toml");
  resolve_interpolations(first, resolvers);
  const std::string written = to_toml(first);
  ConfigNode second = load_toml_string(written, "rt2.toml");
  resolve_interpolations(second, resolvers);
  EXPECT_EQ(to_toml(second), written);
  EXPECT_EQ(second.find("a")->find("list")->as_array()[1].find("config")->find("x")->to_value().as_int(), 1);
  EXPECT_EQ(second.find("literal")->as_string(), "${not.an.interpolation}");
  EXPECT_THAT(keys(second), ElementsAre("top", "literal", "a"));
}

}  // namespace
}  // namespace modalities::core
