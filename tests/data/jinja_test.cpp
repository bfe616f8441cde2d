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

}  // namespace
}  // namespace modalities::core::data::jinja
