// `modalities data pack_encoded_data` end to end through the CLI with the
// bundled tokenizer plugins: byte-identical .pbin files for every fixture
// (whatever the thread count and batch size), the file-existence policies,
// and every bad input of the issue with its message asserted and no output
// left behind.
#include "../cli/run_command.h"
#include "../cli/scratch_dir.h"

#include <modalities/core/data/jsonl.h>
#include <modalities/core/data/packing.h>
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/formats/packed_file.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/shared_fixtures.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace modalities::core::data {
namespace {

using modalities::testing::read_file;
using modalities::testing::run_command;
using modalities::testing::ScratchDir;
using ::testing::HasSubstr;

const std::filesystem::path kFixtures = std::filesystem::path(MODALITIES_TEST_FIXTURES_DIR);
const std::filesystem::path kGpt2 = kFixtures / "data" / "tokenizer" / "hf_gpt2";
const std::filesystem::path kSpModel =
    kFixtures / "data" / "tokenizer" / "sentencepiece_dclm" / "en_32k_tokenizer.model";
// The bundled corpus and tokenizer, with the .idx/.pbin Modalities 0.5.0 wrote from them (data/sample/README.md).
const std::filesystem::path kSample = std::filesystem::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "sample";
const std::filesystem::path kSampleTokenizer =
    std::filesystem::path(MODALITIES_TEST_SOURCE_ROOT) / "data" / "tokenizer" / "gpt2_style_8k";

testing::CommandResult modalities(std::vector<std::string> args, const std::string& shell_prefix = {}) {
  args.insert(args.begin(), MODALITIES_TEST_BINARY);
  if (shell_prefix.empty()) return run_command(args);
  std::string cmd = shell_prefix + " exec";
  for (const auto& a : args) cmd += " " + testing::shell_quote(a);
  return run_command({"/bin/sh", "-c", cmd});
}

// TOML basic string (test paths hold no quotes or backslashes).
std::string q(const std::filesystem::path& p) { return fmt::format("\"{}\"", p.string()); }

struct PackConfig {
  std::filesystem::path src, dst, index;
  std::string tokenizer = "sample";  // data/tokenizer/gpt2_style_8k; "gpt2" and "sp" need ../shared
  std::string eod = "<|endoftext|>";
  int num_cpus = 2;
  int batch = 10;
  bool skip_invalid = false;
  std::string jq = ".text";

  std::string toml() const {
    std::string t = "[settings]\n";
    t += fmt::format("src_path = {}\n", q(src));
    if (!dst.empty()) t += fmt::format("dst_path = {}\n", q(dst));
    if (!index.empty()) t += fmt::format("index_path = {}\n", q(index));
    t += fmt::format("jq_pattern = \"{}\"\nnum_cpus = {}\neod_token = \"{}\"\nprocessing_batch_size = {}\n", jq,
                     num_cpus, eod, batch);
    t += "raw_samples_queue_size = 3\nprocessed_samples_queue_size = 2\n";
    if (skip_invalid) t += "skip_invalid_documents = true\n";
    t += "\n[tokenizer]\ncomponent_key = \"tokenizer\"\n";
    if (tokenizer == "gpt2" || tokenizer == "sample")
      t += fmt::format(
          "variant_key = \"pretrained_hf_tokenizer\"\nconfig = {{ pretrained_model_name_or_path = {}, "
          "padding = false, truncation = false }}\n",
          q(tokenizer == "gpt2" ? kGpt2 : kSampleTokenizer));
    else
      t += fmt::format("variant_key = \"pretrained_sp_tokenizer\"\nconfig = {{ tokenizer_model_file = {} }}\n",
                       q(kSpModel));
    return t;
  }
};

testing::CommandResult pack(const ScratchDir& dir, const PackConfig& c, std::vector<std::string> extra = {},
                            const std::string& shell_prefix = {}) {
  static int n = 0;
  const auto cfg = dir.write(fmt::format("pack{}.toml", n++), c.toml());
  std::vector<std::string> args = {"data", "pack_encoded_data", cfg.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return modalities(args, shell_prefix);
}

std::size_t files_in(const std::filesystem::path& dir) {
  return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(dir), {}));
}

TEST(TokenSize, FollowsTheVocabSizeRule) {
  EXPECT_EQ(token_size_for_vocab(2), 1u);
  EXPECT_EQ(token_size_for_vocab(256), 1u);
  EXPECT_EQ(token_size_for_vocab(257), 2u);
  EXPECT_EQ(token_size_for_vocab(50257), 2u);
  EXPECT_EQ(token_size_for_vocab(65536), 2u);
  EXPECT_EQ(token_size_for_vocab(65537), 4u);
  EXPECT_EQ(token_size_for_vocab(std::int64_t{1} << 32), 4u);
  EXPECT_EQ(token_size_for_vocab(1), 4u);  // Modalities' quirk, kept
  EXPECT_THROW(token_size_for_vocab((std::int64_t{1} << 32) + 1), Error);
  EXPECT_THROW(token_size_for_vocab(0), Error);
}

// The bundled corpus gives the .pbin Modalities 0.5.0 wrote from it, byte for byte, for several
// thread counts and batch sizes (stands alone: no ../shared needed).
TEST(PackEncodedData, SampleCorpusByteIdenticalToModalities) {
  ScratchDir dir;
  int n = 0;
  for (const char* stem : {"eval", "train"}) {
    for (const auto& [cpus, batch] : {std::pair{1, 10}, std::pair{2, 1}, std::pair{3, 7}}) {
      PackConfig c;
      c.src = kSample / fmt::format("{}.jsonl", stem);
      c.index = kSample / fmt::format("{}.idx", stem);
      c.dst = dir.path() / fmt::format("{}.{}.pbin", stem, n++);
      c.num_cpus = cpus;
      c.batch = batch;
      const auto r = pack(dir, c);
      ASSERT_EQ(r.exit_code, 0) << r;
      EXPECT_EQ(read_file(c.dst), read_file(kSample / fmt::format("{}.pbin", stem)))
          << stem << " cpus " << cpus << " batch " << batch;
    }
  }
}

// Modalities' own GPT-2 .pbin files (../shared), for several thread counts and batch sizes.
TEST(PackEncodedData, Gpt2FixturesByteIdentical) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  ScratchDir dir;
  const std::pair<const char*, const char*> cases[] = {{"lorem_ipsum", "data/lorem_ipsum.pbin"},
                                                       {"lorem_ipsum_long", "data/lorem_ipsum_long.pbin"}};
  int n = 0;
  for (const auto& [stem, expected] : cases) {
    for (const auto& [cpus, batch] : {std::pair{1, 10}, std::pair{2, 1}, std::pair{3, 7}}) {
      PackConfig c;
      c.tokenizer = "gpt2";
      c.src = kFixtures / "data" / fmt::format("{}.jsonl", stem);
      c.index = kFixtures / "data" / fmt::format("{}.idx", stem);
      c.dst = dir.path() / fmt::format("{}.{}.pbin", stem, n++);
      c.num_cpus = cpus;
      c.batch = batch;
      const auto r = pack(dir, c);
      ASSERT_EQ(r.exit_code, 0) << r;
      EXPECT_EQ(read_file(c.dst), read_file(kFixtures / expected)) << stem << " cpus " << cpus << " batch " << batch;
    }
  }
}

TEST(PackEncodedData, DerivedFixturesByteIdentical) {
  MODALITIES_REQUIRE_SHARED(MODALITIES_TEST_FIXTURES_DIR);
  ScratchDir dir;
  const auto ds = kFixtures / "tests" / "data" / "datasets";
  const auto derived = kFixtures / "derived" / "tests" / "data" / "datasets";
  struct Case {
    std::string stem, tokenizer, eod, expected;
    std::filesystem::path index;
  };
  const Case cases[] = {
      {"danish_test_dataset", "gpt2", "<|endoftext|>", "danish_test_dataset.gpt2_eod50256.pbin",
       derived / "danish_test_dataset.idx"},
      {"lorem_ipsum_without_last_newline", "gpt2", "<|endoftext|>",
       "lorem_ipsum_without_last_newline.gpt2_eod50256.pbin", derived / "lorem_ipsum_without_last_newline.idx"},
      {"danish_test_dataset", "sp", "</s>", "danish_test_dataset.sp_en32k_eod2.pbin",
       derived / "danish_test_dataset.idx"},
      {"lorem_ipsum_without_last_newline", "sp", "</s>", "lorem_ipsum_without_last_newline.sp_en32k_eod2.pbin",
       derived / "lorem_ipsum_without_last_newline.idx"},
      {"lorem_ipsum_long", "sp", "</s>", "lorem_ipsum_long.sp_en32k_eod2.pbin", ds / "lorem_ipsum_long.idx"},
  };
  for (const auto& k : cases) {
    PackConfig c;
    c.src = ds / (k.stem + ".jsonl");
    c.index = k.index;
    c.dst = dir.path() / (k.expected);
    c.tokenizer = k.tokenizer;
    c.eod = k.eod;
    const auto r = pack(dir, c);
    ASSERT_EQ(r.exit_code, 0) << r;
    EXPECT_EQ(read_file(c.dst), read_file(derived / k.expected)) << k.expected;
  }
}

TEST(PackEncodedData, DefaultPathsPoliciesAndSummary) {
  ScratchDir dir;
  std::filesystem::copy_file(kSample / "eval.jsonl", dir.path() / "tiny.jsonl");
  std::filesystem::copy_file(kSample / "eval.idx", dir.path() / "tiny.idx");
  PackConfig c;
  c.src = dir.path() / "tiny.jsonl";  // index and dst default to tiny.idx / tiny.pbin next to it
  auto r = pack(dir, c);
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.out, HasSubstr("24 documents, 10285 tokens of 2 byte(s)"));
  EXPECT_EQ(read_file(dir.path() / "tiny.pbin"), read_file(kSample / "eval.pbin"));

  r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("tiny.pbin' already exists"));
  r = pack(dir, c, {"--file_existence_policy", "skip"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("skipped"));
  r = pack(dir, c, {"--file_existence_policy", "override"});
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_EQ(read_file(dir.path() / "tiny.pbin"), read_file(kSample / "eval.pbin"));
}

// One bad line in the middle of many good ones: a clear error naming the file
// and line, exit status 1, and nothing under the destination name.
struct BadCase {
  std::string name, line, message;
  friend void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }
};

class PackBadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(PackBadInput, FailsNamingTheLineAndLeavesNoOutput) {
  const BadCase& bad = GetParam();
  ScratchDir dir;
  std::string text;
  for (int i = 0; i < 30; ++i)
    text += (i == 16 ? bad.line : fmt::format("{{\"text\": \"document number {}\"}}", i)) + "\n";
  const auto src = dir.write("in.jsonl", text);
  // The raw index is written directly, so that lines create_raw_index would refuse reach the packer.
  const auto lines = split_lines(text);
  dir.write("in.idx", formats::pickle_index(lines));
  const auto out_dir = dir.path() / "out";
  PackConfig c;
  c.src = src;
  c.dst = out_dir / "in.pbin";
  c.batch = 4;
  auto r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("in.jsonl:17: " + bad.message));
  EXPECT_THAT(r.err, HasSubstr("nothing was written"));
  EXPECT_FALSE(std::filesystem::exists(c.dst));
  if (std::filesystem::exists(out_dir)) {
    EXPECT_EQ(files_in(out_dir), 0u) << "temporary file left behind";
  }

  // Opt-in: the bad document is skipped and reported, everything else packed.
  c.skip_invalid = true;
  r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 0) << r;
  EXPECT_THAT(r.err, HasSubstr("in.jsonl:17: skipped: " + bad.message));
  EXPECT_THAT(r.out, HasSubstr("29 documents"));
  EXPECT_THAT(r.out, HasSubstr("1 documents skipped"));
  EXPECT_EQ(formats::PackedFile(c.dst).num_documents(), 29u);
}

INSTANTIATE_TEST_SUITE_P(Lines, PackBadInput,
                         ::testing::Values(BadCase{"InvalidJson", "{\"text\": \"unterminated}", "invalid JSON"},
                                           BadCase{"MissingField", "{\"content\": \"no text key\"}",
                                                   ".text selects null (the key \"text\" is missing)"},
                                           BadCase{"NullField", "{\"text\": null}", ".text selects null"},
                                           BadCase{"NotAString", "{\"text\": 42}",
                                                   ".text selects a number, not a string"},
                                           BadCase{"InvalidUtf8", "{\"text\": \"caf\xC3\"}", "invalid UTF-8"},
                                           BadCase{"EmptyDocument", "{\"text\": \"\"}", "empty document"},
                                           BadCase{"EmptyLine", "", "invalid JSON"}),
                         [](const auto& info) { return info.param.name; });

// An index whose entries lie inside the file but are not its lines is refused whatever
// skip_invalid_documents says, naming its first wrong entry even when a later work item (checked
// by another thread) has one too, and nothing is written.
TEST(PackEncodedData, IndexEntriesThatAreNotLinesAreFatal) {
  ScratchDir dir;
  std::string text;
  for (int i = 0; i < 40; ++i) text += fmt::format("{{\"text\": \"document number {}\"}}\n", i);
  const auto src = dir.write("in.jsonl", text);
  const auto out_dir = dir.path() / "out";
  for (const std::size_t first_bad : {std::size_t{33}, std::size_t{7}}) {
    auto lines = split_lines(text);
    lines[33].first += 1;  // starts inside line 33 (and still ends at its end)
    lines[33].second -= 1;
    lines[first_bad].second -= 1;  // ends inside its line
    dir.write("in.idx", formats::pickle_index(lines));
    PackConfig c;
    c.src = src;
    c.dst = out_dir / "in.pbin";
    c.batch = 3;
    c.skip_invalid = true;
    const auto r = pack(dir, c);
    EXPECT_EQ(r.exit_code, 1) << r;
    EXPECT_THAT(r.err, HasSubstr(fmt::format("does not belong to '{}': entry {} ({}, {}) is not a line of the file",
                                             src.string(), first_bad, lines[first_bad].first, lines[first_bad].second)))
        << r;
    EXPECT_FALSE(std::filesystem::exists(c.dst));
    if (std::filesystem::exists(out_dir)) {
      EXPECT_EQ(files_in(out_dir), 0u) << "temporary file left behind";
    }
  }
}

TEST(PackEncodedData, UnknownEodTokenMissingIndexAndForeignIndex) {
  ScratchDir dir;
  std::filesystem::copy_file(modalities::testing::tiny_example_dir() / "tiny.jsonl", dir.path() / "tiny.jsonl");
  PackConfig c;
  c.src = dir.path() / "tiny.jsonl";
  c.dst = dir.path() / "tiny.pbin";
  auto r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("tiny.idx' of '"));
  EXPECT_THAT(r.err, HasSubstr("create it with `modalities data create_raw_index"));

  // An index of another, longer file.
  std::filesystem::copy_file(kSample / "eval.idx", dir.path() / "tiny.idx");
  r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("does not belong to"));

  // A corrupt index.
  dir.write("tiny.idx", "\x80\x04garbage");
  r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("tiny.idx"));

  std::filesystem::copy_file(modalities::testing::tiny_example_dir() / "tiny.idx", dir.path() / "tiny.idx",
                             std::filesystem::copy_options::overwrite_existing);
  c.eod = "<|endoftext|";
  r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("<|endoftext|"));
  EXPECT_FALSE(std::filesystem::exists(c.dst));
}

TEST(PackEncodedData, ConfigErrorsNameTheSettingsPath) {
  ScratchDir dir;
  PackConfig c;
  c.src = dir.path() / "missing.jsonl";
  c.dst = dir.path() / "x.pbin";
  auto r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("settings.src_path"));

  c.src = modalities::testing::tiny_example_dir() / "tiny.jsonl";
  c.index = modalities::testing::tiny_example_dir() / "tiny.idx";
  c.jq = ".text | length";
  r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("settings.jq_pattern"));
  EXPECT_THAT(r.err, HasSubstr("unsupported jq_pattern"));
}

TEST(PackEncodedData, UnwritableDestinationAndFullDisk) {
  ScratchDir dir;
  PackConfig c;
  c.src = kSample / "train.jsonl";
  c.index = kSample / "train.idx";
  const auto blocker = dir.write("file", "x");
  c.dst = blocker / "sub" / "out.pbin";
  auto r = pack(dir, c);
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("cannot create the directory"));

  // A file-size limit of 64 KiB stands in for a full disk: write() fails with EFBIG.
  c.dst = dir.path() / "out" / "big.pbin";
  r = pack(dir, c, {}, "ulimit -f 128; trap '' XFSZ;");
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("big.pbin': write failed: File too large"));
  EXPECT_FALSE(std::filesystem::exists(c.dst));
  if (std::filesystem::exists(dir.path() / "out")) {
    EXPECT_EQ(files_in(dir.path() / "out"), 0u) << "temporary file left behind";
  }
}

}  // namespace
}  // namespace modalities::core::data

namespace modalities::core::data {
namespace {

// GPT-2's byte-to-character table (the byte-level BPE alphabet).
std::vector<std::string> byte_level_alphabet() {
  std::vector<int> bs, cs;
  for (int b = 0; b < 256; ++b)
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) bs.push_back(b);
  cs = bs;
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + n++);
    }
  std::vector<std::string> out(256);
  for (std::size_t i = 0; i < bs.size(); ++i) {
    const int c = cs[i];
    std::string u;
    if (c < 0x80) u.push_back(static_cast<char>(c));
    else {
      u.push_back(static_cast<char>(0xC0 | (c >> 6)));
      u.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
    out[static_cast<std::size_t>(bs[i])] = u;
  }
  return out;
}

// A byte-level tokenizer.json with the 256 byte tokens (id = byte value), `extra` more vocabulary
// entries without merges, and the added token "<|big|>" (which `tokenizers` numbers after the
// vocabulary, whatever the file says).
std::string byte_level_tokenizer_json(int extra) {
  const auto alphabet = byte_level_alphabet();
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    std::string key;
    for (char ch : alphabet[static_cast<std::size_t>(b)])
      key += (ch == '"' || ch == '\\') ? std::string{'\\', ch} : std::string{ch};
    vocab += fmt::format("{}\"{}\": {}", b ? ", " : "", key, b);
  }
  for (int k = 0; k < extra; ++k) vocab += fmt::format(", \"extra{}\": {}", k, 256 + k);
  return fmt::format(R"({{"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{{"id": 300, "content": "<|big|>", "single_word": false, "lstrip": false, "rstrip": false,
                     "normalized": false, "special": true}}],
  "normalizer": null,
  "pre_tokenizer": {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}},
  "post_processor": null,
  "decoder": {{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}},
  "model": {{"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {{{}}}, "merges": []}}}})",
                     vocab);
}

// A pack_encoded_data config for the byte-level tokenizer folder `tok`, EOD "!", and `extra`
// settings lines.
std::string byte_level_pack_toml(const std::filesystem::path& src, const std::filesystem::path& dst,
                                 const std::filesystem::path& tok, const std::string& extra = {}) {
  return fmt::format(
      "[settings]\nsrc_path = {}\ndst_path = {}\njq_pattern = \".text\"\neod_token = \"!\"\n{}\n"
      "[tokenizer]\ncomponent_key = \"tokenizer\"\nvariant_key = \"pretrained_hf_tokenizer\"\n"
      "config = {{ pretrained_model_name_or_path = {} }}\n",
      q(src), q(dst), extra, q(tok));
}

// Tokens are written as 1, 2 or 4 little-endian bytes, as the vocabulary size calls for: the ids of
// "fine <|big|>" and the EOD token, with the added token's id past 255 and 65535 in the wider files.
TEST(PackEncodedData, EveryTokenWidthIsWrittenLittleEndian) {
  ScratchDir dir;
  for (const auto& [extra, width] : {std::pair{0, 1u}, std::pair{44, 2u}, std::pair{70000 - 256, 4u}}) {
    const std::string name = fmt::format("w{}", width);
    std::filesystem::create_directories(dir.path() / name);
    dir.write(name + "/tokenizer.json", byte_level_tokenizer_json(extra));
    const std::string text = width == 1 ? "fine" : "fine <|big|>";
    const std::string line = fmt::format("{{\"text\": \"{}\"}}\n", text);
    const auto src = dir.write(name + ".jsonl", line);
    dir.write(name + ".idx", formats::pickle_index(split_lines(line)));
    const auto dst = dir.path() / (name + ".pbin");
    const std::string cfg = byte_level_pack_toml(src, dst, dir.path() / name);
    const auto r = modalities({"data", "pack_encoded_data", dir.write(name + ".toml", cfg).string()});
    ASSERT_EQ(r.exit_code, 0) << r;
    std::vector<std::uint32_t> ids = {'f', 'i', 'n', 'e'};
    if (width > 1) ids.insert(ids.end(), {' ', static_cast<std::uint32_t>(256 + extra)});
    ids.push_back('!');
    std::string data;
    for (const std::uint32_t id : ids)
      for (std::uint32_t b = 0; b < width; ++b) data += static_cast<char>((id >> (8 * b)) & 0xFF);
    const std::string pbin = read_file(dst);
    ASSERT_GE(pbin.size(), 12 + data.size()) << name;
    EXPECT_EQ(pbin.substr(8, 4), std::string({static_cast<char>(width), 0, 0, 0})) << name;  // token size
    EXPECT_EQ(pbin.substr(12, data.size()), data) << name;
  }
}

// The byte-level tokenizer with only its 256 byte tokens (1 byte per token): its added token gets
// the id 256, which does not fit in one byte.
TEST(PackEncodedData, TokenIdWiderThanTokenSizeIsAnError) {
  ScratchDir dir;
  std::filesystem::create_directories(dir.path() / "tok");
  dir.write("tok/tokenizer.json", byte_level_tokenizer_json(0));
  const auto src = dir.write("in.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"a <|big|> token\"}\n");
  dir.write("in.idx", formats::pickle_index(split_lines("{\"text\": \"fine\"}\n{\"text\": \"a <|big|> token\"}\n")));
  const std::string cfg = byte_level_pack_toml(src, dir.path() / "in.pbin", dir.path() / "tok");
  const auto r = modalities({"data", "pack_encoded_data", dir.write("pack.toml", cfg).string()});
  EXPECT_EQ(r.exit_code, 1) << r;
  EXPECT_THAT(r.err, HasSubstr("in.jsonl:2: token id 256 does not fit in 1 byte(s) per token (vocab_size 256)"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "in.pbin"));

  // Skipped instead: the documents before and after it are packed whole, and nothing of it.
  const std::string three = "{\"text\": \"fine\"}\n{\"text\": \"a <|big|> token\"}\n{\"text\": \"ok\"}\n";
  const auto src3 = dir.write("in3.jsonl", three);
  dir.write("in3.idx", formats::pickle_index(split_lines(three)));
  const std::string skip_cfg =
      byte_level_pack_toml(src3, dir.path() / "in3.pbin", dir.path() / "tok", "skip_invalid_documents = true\n");
  const auto k = modalities({"data", "pack_encoded_data", dir.write("pack_skip.toml", skip_cfg).string()});
  ASSERT_EQ(k.exit_code, 0) << k;
  EXPECT_THAT(k.err, HasSubstr("in3.jsonl:2: skipped: token id 256 does not fit in 1 byte(s) per token")) << k;
  const std::string pbin = read_file(dir.path() / "in3.pbin");
  ASSERT_GE(pbin.size(), 12u + 8u);
  EXPECT_EQ(pbin.substr(0, 8), std::string({8, 0, 0, 0, 0, 0, 0, 0}));  // "fine!" and "ok!"
  EXPECT_EQ(pbin.substr(12, 8), "fine!ok!");

  // The same id as the EOD token: the message names the config file, its key and the tokenizer.
  std::string eod_cfg = cfg;
  eod_cfg.replace(eod_cfg.find("eod_token = \"!\""), 15, "eod_token = \"<|big|>\"");
  const auto e = modalities({"data", "pack_encoded_data", dir.write("pack_eod.toml", eod_cfg).string()});
  EXPECT_EQ(e.exit_code, 1) << e;
  EXPECT_THAT(e.err, HasSubstr("pack_eod.toml: settings.eod_token = '<|big|>': the tokenizer (config key "
                               "'tokenizer') gives it the id 256, which does not fit in the 1 byte(s) per token"))
      << e;
}

}  // namespace
}  // namespace modalities::core::data
