// The safetensors reader/writer: reads a file written by Python's `safetensors`
// (tests/formats/data/tiny.safetensors, from scripts/reference/make_safetensors_fixture.py),
// round-trips every dtype, and rejects truncated and corrupt files with messages
// that name the file and the tensor.
#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>

#include "../cli/scratch_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

namespace modalities::formats {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

const fs::path kTiny = fs::path(MODALITIES_TEST_SOURCE_ROOT) / "tests/formats/data/tiny.safetensors";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file with the given JSON header and data bytes (header padded to 8).
std::string make_file(std::string json, std::string_view data) {
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((json.size() >> (8 * i)) & 0xff));
  return out + json + std::string(data);
}

TEST(SafetensorsTest, ReadsFileWrittenByPython) {
  const StateDict sd = read_safetensors(kTiny);
  ASSERT_EQ(sd.size(), 11u);
  EXPECT_TRUE(torch::equal(sd.at("a.f32"), torch::arange(6, torch::kFloat32).reshape({2, 3}) * 0.5));
  EXPECT_TRUE(torch::equal(sd.at("b.f16"), torch::arange(4, torch::kFloat16) - 1.5));
  EXPECT_TRUE(torch::equal(sd.at("c.bf16"), torch::arange(3, torch::kBFloat16) * 0.25));
  EXPECT_EQ(sd.at("d.f64").dim(), 0);
  EXPECT_EQ(sd.at("d.f64").item<double>(), 3.25);
  EXPECT_TRUE(torch::equal(sd.at("e.i64"), torch::arange(5, torch::kInt64) * -1000000007));
  EXPECT_TRUE(torch::equal(sd.at("f.i32"), torch::tensor({1, -2, 3, -4}, torch::kInt32).reshape({2, 2})));
  EXPECT_TRUE(torch::equal(sd.at("g.i16"), torch::tensor({-300, 300}, torch::kInt16)));
  EXPECT_TRUE(torch::equal(sd.at("h.i8"), torch::tensor({-7, 7, 0}, torch::kInt8)));
  EXPECT_TRUE(torch::equal(sd.at("i.u8"), torch::tensor({0, 255, 17}, torch::kUInt8)));
  EXPECT_TRUE(torch::equal(sd.at("j.bool"), torch::tensor({true, false, true})));
  EXPECT_EQ(sd.at("k.empty").sizes(), (std::vector<std::int64_t>{0, 4}));
  const auto meta = read_safetensors_metadata(kTiny);
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("note"), "tiny \"fixture\"");
}

TEST(SafetensorsTest, RoundTripsEveryDtypeFromStridedTensors) {
  testing::ScratchDir dir;
  StateDict sd;
  const auto base = torch::randn({4, 6}, torch::kFloat64);
  sd["t.f64"] = base.t();  // non-contiguous
  sd["t.f32"] = base.to(torch::kFloat32).index({torch::indexing::Slice(), torch::indexing::Slice(0, 6, 2)});
  sd["t.f16"] = base.to(torch::kFloat16);
  sd["t.bf16"] = base.to(torch::kBFloat16);
  sd["t.i64"] = torch::arange(7, torch::kInt64);
  sd["t.i32"] = torch::arange(7, torch::kInt32);
  sd["t.i16"] = torch::arange(7, torch::kInt16);
  sd["t.i8"] = torch::arange(7, torch::kInt8);
  sd["t.u8"] = torch::arange(7, torch::kUInt8);
  sd["t.bool"] = torch::arange(7) % 2 == 0;
  sd["t.scalar"] = torch::tensor(1.5);
  sd["t.empty"] = torch::empty({3, 0});
  sd["weird \"name\"\n"] = torch::ones({1});
  const fs::path p = dir.path() / "rt.safetensors";
  write_safetensors(p, sd, {{"k", "v"}, {"unicode", "caf\xc3\xa9"}});
  const StateDict back = read_safetensors(p);
  ASSERT_EQ(back.size(), sd.size());
  for (const auto& [k, v] : sd) {
    ASSERT_TRUE(back.count(k)) << k;
    EXPECT_EQ(back.at(k).scalar_type(), v.scalar_type()) << k;
    EXPECT_TRUE(torch::equal(back.at(k), v)) << k;
    EXPECT_TRUE(back.at(k).is_contiguous()) << k;
  }
  EXPECT_EQ(read_safetensors_metadata(p).at("unicode"), "caf\xc3\xa9");
  const StateDict ints = read_safetensors(p, [](const std::string& name) { return name.starts_with("t.i"); });
  EXPECT_EQ(ints.size(), 4u);
  EXPECT_TRUE(torch::equal(ints.at("t.i16"), sd.at("t.i16")));

  // Header length is a multiple of 8 and every tensor is aligned to its element size.
  const SafetensorsHeader h = read_safetensors_header(p);
  EXPECT_EQ(h.data_offset % 8, 0u);
  for (const auto& [k, e] : h.tensors) EXPECT_EQ(e.begin % c10::elementSize(e.scalar_type), 0u) << k;
  EXPECT_EQ(h.tensors.at("t.bf16").dtype, "BF16");
}

TEST(SafetensorsTest, RejectsUnstorableTensorsAndKeepsThePreviousFile) {
  testing::ScratchDir dir;
  const fs::path p = dir.path() / "x.safetensors";
  write_safetensors(p, {{"a", torch::ones({2})}});
  const std::string before = slurp(p);
  EXPECT_THAT(error_of([&] {
                write_safetensors(p, {{"a", torch::ones({2})}, {"b", at::Tensor()}});
              }),
              AllOf(HasSubstr("x.safetensors"), HasSubstr("'b' is undefined")));
  EXPECT_THAT(error_of([&] {
                write_safetensors(p, {{"c", torch::ones({2}, torch::kComplexFloat)}});
              }),
              HasSubstr("'c' has dtype ComplexFloat"));
  EXPECT_EQ(slurp(p), before);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 1);  // no temp files left
}

TEST(SafetensorsTest, RejectsTruncatedAndCorruptFiles) {
  testing::ScratchDir dir;
  const std::string good = slurp(kTiny);
  const auto check = [&](const std::string& name, const std::string& bytes, const std::string& expected) {
    const fs::path p = dir.write(name, bytes);
    EXPECT_THAT(error_of([&] { read_safetensors(p); }), AllOf(HasSubstr(name), HasSubstr(expected))) << name;
  };
  check("empty.safetensors", "", "truncated");
  check("short_header.safetensors", good.substr(0, 40), "truncated");
  check("short_data.safetensors", good.substr(0, good.size() - 10), "beyond the");
  check("huge_len.safetensors", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "exceeds");
  check("not_json.safetensors", make_file("{\"a\": [", ""), "corrupt JSON header");
  check("not_object.safetensors", make_file("[1,2]", ""), "expected a JSON object");
  check("bad_dtype.safetensors", make_file(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x"),
        "tensor 'w': unknown dtype 'Q4'");
  check("bad_size.safetensors", make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "xxxx"),
        "needs 8");
  check("out_of_range.safetensors", make_file(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", "xxxx"),
        "beyond the 4 bytes");
  check(
      "overlap.safetensors",
      make_file(
          R"({"v":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"w":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
          "xxx"),
      "overlap");
  check("bad_meta.safetensors", make_file(R"({"__metadata__":{"a":1}})", ""), "not a string");
  check(
      "gap.safetensors",
      make_file(
          R"({"v":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
          "xxxx"),
      "data bytes [1, 2) before tensor 'w' belong to no tensor");
  check("starts_late.safetensors", make_file(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", "xxx"),
        "data bytes [0, 1) before tensor 'w'");
  check("trailing.safetensors", make_file(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xxx"),
        "the tensors cover 2 of its 3 data bytes");
  // The header length lowered by one, into the header's padding: the JSON still parses, and every
  // tensor would be read one byte early (Python's safetensors: "not fully covered").
  std::string lowered = make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "abcdefgh");
  ASSERT_EQ(lowered[8 + (static_cast<unsigned char>(lowered[0]) - 1)], ' ');
  lowered[0] = static_cast<char>(lowered[0] - 1);
  check("lowered_header_length.safetensors", lowered, "not fully covered");
  EXPECT_THAT(error_of([&] { read_safetensors(dir.path() / "missing.safetensors"); }),
              AllOf(HasSubstr("missing.safetensors"), HasSubstr("cannot open")));
}

}  // namespace
}  // namespace modalities::formats
