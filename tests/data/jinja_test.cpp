// The chat-template engine (modalities/core/data/jinja.h) against jinja2 3.1.6 in Modalities'
// environment: every case of tests/data/jinja/reference.json (scripts/reference/make_jinja_reference.py)
// renders to exactly jinja2's output, or fails where jinja2 fails. Also: Python's float repr and
// json.dumps, and refusals of unsupported Jinja.
#include <modalities/core/data/jinja.h>
#include <modalities/sdk/error.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <simdjson.h>

#include <filesystem>
#include <string>

namespace modalities::core::data::jinja {
namespace {

using ::testing::HasSubstr;

const std::filesystem::path kReference =
    std::filesystem::path(MODALITIES_TEST_SOURCE_ROOT) / "tests" / "data" / "jinja" / "reference.json";

// The message of the error that parsing or rendering `text` raises, or "no error".
std::string error(const std::string& text) {
  try {
    Template(text).render({});
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return "no error";
}

TEST(JinjaTest, RendersExactlyAsJinja2) {
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  ASSERT_FALSE(parser.load(kReference.string()).get(root)) << kReference;
  int n = 0;
  for (auto c : simdjson::dom::array(root["cases"])) {
    const std::string name{std::string_view(c["name"])};
    SCOPED_TRACE(name);
    const Value ctx = json_loads(simdjson::to_string(c["context"]));
    std::string_view expected;
    const bool ok = !c["output"].get_string().get(expected);
    try {
      const Template t{std::string_view(c["template"])};
      const std::string out = t.render(*ctx.dict);
      EXPECT_TRUE(ok) << "jinja2 fails here (" << std::string_view(c["error"]) << "), we rendered: " << out;
      if (ok) {
        EXPECT_EQ(out, expected);
      }
    } catch (const Error& e) {
      EXPECT_FALSE(ok) << "jinja2 renders this; we failed: " << e.what();
    }
    ++n;
  }
  EXPECT_EQ(n, 17);
}

TEST(JinjaTest, PythonNumbersAndJson) {
  const auto str = [](const std::string& expr) { return Template("{{ " + expr + " }}").render({}); };
  EXPECT_EQ(str("0.1 + 0.2"), "0.30000000000000004");
  EXPECT_EQ(str("1e-4"), "0.0001");
  EXPECT_EQ(str("1e-5"), "1e-05");
  EXPECT_EQ(str("123456789.0 * 1e7"), "1234567890000000.0");
  EXPECT_EQ(str("123456789.0 * 1e8"), "1.23456789e+16");
  EXPECT_EQ(str("-0.0"), "-0.0");
  EXPECT_EQ(str("2.675 | round(2)"), "2.67");  // the binary value is below 2.675
  EXPECT_EQ(json_dumps(json_loads(R"({"a": "\u0001\u00e9\n", "b": [1, 2.50, -3e300], "a": true})")),
            R"({"a": true, "b": [1, 2.5, -3e+300]})");
}

// Python's arithmetic and jinja2's filters and loop variables, as jinja2 3.1.6's sandboxed environment
// renders them (outputs taken from it); where Python has big integers or jinja2's sandbox refuses,
// a clear error with the template line instead of a wrapped value, a signal or unbounded work.
TEST(JinjaTest, ArithmeticFiltersAndLoopsAsJinja2) {
  const auto str = [](const std::string& text) { return Template(text).render({}); };
  EXPECT_EQ(str("{{ 2 ** -1 }}"), "0.5");
  EXPECT_EQ(str("{{ 2 ** 62 }}"), "4611686018427387904");
  EXPECT_EQ(str("{{ 7 // -2 }}|{{ -7 % 3 }}|{{ 7.5 % -2 }}|{{ -7.5 // 2 }}"), "-4|2|-0.5|-4.0");
  EXPECT_EQ(str("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(str("{{ 1e999 }}"), "inf");
  EXPECT_EQ(str("{{ 'x'|replace('', 'yy') }}"), "yyxyy");
  EXPECT_EQ(str("{{ 'ab'|replace('', '-', 2) }}"), "-a-b");
  EXPECT_EQ(str("{{ '0x1A'|int }}"), "0");
  EXPECT_EQ(str("{{ 'a\nb'|indent(-5, true) }}"), "a\nb");
  EXPECT_EQ(
      str("{% for x in [1,2] %}{{ loop.depth }}{{ loop.depth0 }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}"),
      "102;101;");
  EXPECT_EQ(str("  {%+ if true +%}\nx{% endif %}"), "  \nx");
  EXPECT_EQ(str("{{ range(100000)|length }}"), "100000");
  // Tuple addition (jinja2 3.1.6 in ImmutableSandboxedEnvironment renders the same).
  EXPECT_EQ(str("{{ (1,2) + (3,) }}|{{ ((1,) + ()) }}|{{ [1] + [2] }}|{% for x in (1,) + (2, 3) %}{{ x }}{% endfor %}"),
            "(1, 2, 3)|(1,)|[1, 2]|123");
  EXPECT_THAT(error("{{ 9223372036854775807 + 1 }}"), HasSubstr("integer overflow"));
  EXPECT_THAT(error("{{ 3 ** 40 }}"), HasSubstr("integer overflow"));
  EXPECT_THAT(error("{{ (-9223372036854775807 - 1) // -1 }}"), HasSubstr("integer overflow"));
  EXPECT_THAT(error("{{ 99999999999999999999 }}"), HasSubstr("does not fit 64 bits"));
  EXPECT_THAT(error("{{ [1] + (2,) }}"), HasSubstr("can only concatenate list (not \"tuple\") to list"));
  EXPECT_THAT(error("{{ (1,) + [2] }}"), HasSubstr("can only concatenate tuple (not \"list\") to tuple"));
  for (const char* zero : {"{{ 1/0 }}", "{{ 1.0 % 0 }}", "{{ 1 // 0 }}", "{{ 0 ** -1 }}"})
    EXPECT_THAT(error(zero), ::testing::AnyOf(HasSubstr("division by zero"), HasSubstr("negative power"))) << zero;
  EXPECT_THAT(error("{{ range(100001)|length }}"), HasSubstr("more than 100000"));
  EXPECT_THAT(error("{{ range(0, 9223372036854775807, 4611686018427387904)|length }}"), HasSubstr("no error"));
  EXPECT_THAT(error("{{ range(10**9)|length }}"), HasSubstr("more than 100000"));
  EXPECT_THAT(error("{{ 'ab' * 9223372036854775807 }}"), HasSubstr("exceeds"));
  EXPECT_THAT(error("{{ 'abc'|indent(9999999999) }}"), HasSubstr("too large"));
  // Nesting that overflowed the stack: parentheses, lists, `not`, `-`, attribute and filter chains, blocks.
  for (const std::string& deep : {"{{ " + std::string(30000, '(') + "1" + std::string(30000, ')') + " }}",
                                  "{{ " + std::string(30000, '[') + std::string(30000, ']') + " }}",
                                  "{{ " +
                                      [] {
                                        std::string s;
                                        for (int i = 0; i < 100000; ++i) s += "not ";
                                        return s;
                                      }() +
                                      "x }}",
                                  "{{ " + std::string(100000, '-') + "1 }}",
                                  "{{ x" +
                                      [] {
                                        std::string s;
                                        for (int i = 0; i < 100000; ++i) s += ".a";
                                        return s;
                                      }() +
                                      " }}",
                                  "{{ x" +
                                      [] {
                                        std::string s;
                                        for (int i = 0; i < 100000; ++i) s += "|trim";
                                        return s;
                                      }() +
                                      " }}",
                                  "{{ 1" +
                                      [] {
                                        std::string s;
                                        for (int i = 0; i < 100000; ++i) s += "+1";
                                        return s;
                                      }() +
                                      " }}"})
    EXPECT_THAT(error(deep), HasSubstr("expression nested more than 512 levels deep")) << deep.substr(0, 20);
  std::string ifs, fors;
  for (int i = 0; i < 30000; ++i) ifs += "{% if true %}";
  for (int i = 0; i < 30000; ++i) ifs += "{% endif %}";
  for (int i = 0; i < 30000; ++i) fors += "{% for x in [1] %}";
  for (int i = 0; i < 30000; ++i) fors += "{% endfor %}";
  EXPECT_THAT(error(ifs), HasSubstr("blocks nested more than 256 levels deep"));
  EXPECT_THAT(error(fors), HasSubstr("blocks nested more than 256 levels deep"));
}

TEST(JinjaTest, RefusesWhatItDoesNotImplement) {
  EXPECT_THAT([] { Template("{% macro m() %}x{% endmacro %}"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("'{% macro %}' is not supported")));
  EXPECT_THAT([] { Template("{{ x | wordwrap }}"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("filter 'wordwrap' is not supported")));
  EXPECT_THAT([] { Template("line1\n{% if x %}"); }, ::testing::ThrowsMessage<Error>(HasSubstr("endif")));
  EXPECT_THAT([] { Template("{{ x "); }, ::testing::ThrowsMessage<Error>(HasSubstr("template line 1")));
  // Unknown tests, functions and methods are refused before anything renders.
  EXPECT_THAT([] { Template("{% if x is divisibleby(3) %}{% endif %}"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("test 'divisibleby' is not supported")));
  EXPECT_THAT([] { Template("{{ strftime_now('%Y') }}"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("function 'strftime_now' is not supported")));
  EXPECT_THAT([] { Template("{{ x.casefold() }}"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("method 'casefold' is not supported")));
  EXPECT_THAT([] { Template("{{ x | tojson(indent=2) }}").render({}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("tojson with arguments")));
}

// An error shows the start of a long operand, not all of it: the repr of a 20 MB string took
// minutes (found by fuzzing, tests/fuzz/corpus/jinja/long_operand_in_an_error.jinja).
TEST(JinjaTest, AnErrorShowsOnlyTheStartOfALongOperand) {
  const std::string m = error("{{ 'ab' * 10000000 / 3 }}");
  EXPECT_THAT(m, HasSubstr("template line 1"));
  EXPECT_THAT(m, HasSubstr("... (20000000 bytes) and 3"));
  EXPECT_LT(m.size(), 1000u);
  // Escapes as Python reads them (found by fuzzing: '\u\\\\' ended the process in std::stoul).
  EXPECT_THAT(error("{{ '\\u\\\\\\\\' }}"), HasSubstr("template line 1: truncated \\u escape"));
  EXPECT_THAT(error("{{ '\\u12zz' }}"), HasSubstr("truncated \\u escape"));
  EXPECT_THAT(error("{{ '\\U00110000' }}"), HasSubstr("illegal Unicode character"));
  EXPECT_THAT(error("{{ '\\ud800' }}"), HasSubstr("surrogate"));
  EXPECT_EQ(error("{{ '\\u00e9\\x41' }}"), "no error");
  EXPECT_THAT(error("{{ (range(100) | list) - 1 }}"),
              HasSubstr("[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (100 items)] and 1"));
}

}  // namespace
}  // namespace modalities::core::data::jinja
