// subscribers: every variant built through the registry from TOML. The JSONL
// file and the console line are compared byte for byte with what Modalities
// itself writes for the same results (tests/data/results.*), and the Python
// number/string spelling with ~2,700 cases from Python (tests/data/python_format.tsv);
// both produced by scripts/reference/make_subscribers_reference.py. The
// progress bar is checked in its plain-line (non-terminal) form.
#include <modalities/sdk/interfaces/data_loader.h>
#include <modalities/sdk/interfaces/message_subscriber.h>
#include <modalities/sdk/python_format.h>
#include <modalities/testing/harness.h>
#include <modalities/testing/scratch_dir.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

namespace modalities::plugins::subscribers {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

const fs::path kData = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "tests" / "data";
const fs::path kExample = fs::path(MODALITIES_TEST_PLUGIN_SOURCE_DIR) / "configs" / "example.toml";

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

ResultItem item(at::Tensor v, std::optional<int> decimals = std::nullopt) { return {std::move(v), decimals}; }
at::Tensor f32(double x) { return at::scalar_tensor(x, at::kFloat); }

// The samples of make_subscribers_reference.py (keep in sync).
std::vector<EvaluationResultBatch> samples() {
  EvaluationResultBatch train{"train", 42, {}, {}, {}};
  train.losses = {{"train loss avg", item(f32(3.4567891), 2)},
                  {"train loss last", item(at::scalar_tensor(2.675, at::kDouble), 2)}};
  train.metrics = {{"consumed tokens", item(at::scalar_tensor(1048576, at::kLong), 0)},
                   {"grad norm avg", item(f32(0.125), 2)},
                   {"grad norm last", item(f32(1.005), 2)}};
  train.throughput_metrics = {{"train samples/s", item(f32(123.45), 1)},
                              {"train mfu (16-bit)", item(f32(-1.0), 2)},
                              {"lr mean", item(f32(0.0003))},
                              {"peak memory rank 0 (MB)", item(f32(1234.5678), 2)}};
  EvaluationResultBatch evaluation{"val \xc3\xbc \"q\"", 42, {}, {}, {}};
  evaluation.losses = {{"CLMCrossEntropyLoss", item(f32(3.215), 2)}};
  evaluation.throughput_metrics = {{"evaluation_num_samples_per_second", item(f32(45.25), 1)}};
  EvaluationResultBatch shapes{"shapes", 0, {}, {}, {}};
  shapes.losses = {{"small", item(f32(6e-05))}};
  shapes.metrics = {
      {"matrix", item(at::tensor({1, 2, 3, 4}, at::kInt).reshape({2, 2}), 1)},
      {"vector", item(at::tensor({0.5, 1e-7, std::nan("")}, at::kFloat))},
      {"flag", item(at::scalar_tensor(true, at::kBool))},
      {"big", item(at::scalar_tensor(1.5e17, at::kDouble), 0)},
      {"whole", item(f32(7.0))},
      {"zero", item(f32(0.0))},
      {"bf16", item(at::scalar_tensor(0.1, at::kBFloat16), 3)},
  };
  return {train, evaluation, shapes};
}

Message result_message(EvaluationResultBatch r, std::int64_t rank = 0) {
  return Message{MessageType::kEvaluationResult, std::move(r), rank, rank};
}
Message progress(std::int64_t n, ExperimentStatus status, std::string tag) {
  return Message{MessageType::kBatchProgressUpdate, ProgressUpdate{n, status, std::move(tag)}, 0, 0};
}

using TempDir = modalities::testing::ScratchDir;

// ---------------------------------------------------------------------------
// Python spelling of numbers and strings

TEST(PythonFormatTest, MatchesPythonOnEveryReferenceCase) {
  std::ifstream in(kData / "python_format.tsv");
  ASSERT_TRUE(in) << "missing " << (kData / "python_format.tsv");
  int checked = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto t1 = line.find('\t'), t2 = line.find('\t', t1 + 1);
    const std::string kind = line.substr(0, t1), input = line.substr(t1 + 1, t2 - t1 - 1), want = line.substr(t2 + 1);
    std::string got;
    if (kind == "repr") {
      got = py::float_repr(std::strtod(input.c_str(), nullptr));
    } else if (kind == "json") {
      got = py::json_float(std::strtod(input.c_str(), nullptr));
    } else if (kind == "round") {
      const auto comma = input.find(',');
      got = py::float_repr(
          py::round(std::strtod(input.substr(0, comma).c_str(), nullptr), std::stoi(input.substr(comma + 1))));
    } else if (kind == "jsonstr") {
      std::string s;
      for (std::size_t i = 0; i + 1 < input.size(); i += 2)
        s += static_cast<char>(std::stoi(input.substr(i, 2), nullptr, 16));
      got = py::json_string(s);
    } else {
      FAIL() << "unknown kind " << kind;
    }
    EXPECT_EQ(got, want) << kind << " " << input;
    ++checked;
  }
  EXPECT_GT(checked, 2000);
}

TEST(PythonFormatTest, RoundsTheExactBinaryValueTiesToEven) {
  EXPECT_EQ(py::float_repr(py::round(2.675, 2)), "2.67");  // stored as 2.67499999...
  EXPECT_EQ(py::float_repr(py::round(0.125, 2)), "0.12");  // exact tie, even digit
  EXPECT_EQ(py::float_repr(py::round(0.375, 2)), "0.38");
  EXPECT_EQ(py::float_repr(py::round(2.5, 0)), "2.0");
  EXPECT_EQ(py::float_repr(py::round(-0.4, 0)), "-0.0");
  EXPECT_EQ(py::float_repr(py::round(1048576.0, 0)), "1048576.0");
  EXPECT_EQ(py::float_repr(py::round(250.0, -2)), "200.0");
  EXPECT_EQ(py::float_repr(py::round(1e16, 2)), "1e+16");
}

// ---------------------------------------------------------------------------
// results_subscriber/to_disc

TEST(ToDiscTest, WritesModalitiesJsonLinesByteForByteOnRankZero) {
  TempDir dir;
  const fs::path file = dir.path() / "nested" / "deeper" / "evaluation_results.jsonl";
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("evaluation_subscriber.config.output_file_path", file.string());
  auto sub = h.get<MessageSubscriber>("evaluation_subscriber");
  ASSERT_NE(sub, nullptr);
  EXPECT_TRUE(fs::is_directory(file.parent_path())) << "parent folders are created when the subscriber is built";
  sub->consume_dict({{"No. parameters", std::int64_t{124}}});  // no-op
  for (const auto& r : samples()) {
    sub->consume_message(result_message(r, 1));  // other ranks write nothing
    sub->consume_message(result_message(r, 0));
    // Flushed after each line: the file is complete between messages.
    EXPECT_EQ(testing::read_file(file).back(), '\n');
  }
  sub->consume_message(progress(3, ExperimentStatus::kTrain, "train"));  // not a result: ignored
  EXPECT_EQ(testing::read_file(file), testing::read_file(kData / "results.jsonl"));
}

TEST(ToDiscTest, AppendsToAnExistingFile) {
  TempDir dir;
  const fs::path file = dir.path() / "results.jsonl";
  fs::create_directories(dir.path());
  std::ofstream(file) << "{\"earlier\": 1}\n";
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("evaluation_subscriber.config.output_file_path", file.string());
  h.get<MessageSubscriber>("evaluation_subscriber")->consume_message(result_message(samples()[1]));
  EXPECT_EQ(lines_of(testing::read_file(file)).size(), 2u);
  EXPECT_THAT(testing::read_file(file), ::testing::StartsWith("{\"earlier\": 1}\n{\"dataloader_tag\": \"val \\u00fc"));
}

TEST(ToDiscTest, RequiresOutputFilePath) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.erase("evaluation_subscriber.config.output_file_path");
  EXPECT_THAT(h.build_error(), HasSubstr("evaluation_subscriber.config.output_file_path"));
}

TEST(ToDiscTest, UnwritableFolderIsAClearError) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("evaluation_subscriber.config.output_file_path", "/proc/no_such_dir/results.jsonl");
  EXPECT_THAT(h.build_error(), HasSubstr("cannot create the folder '/proc/no_such_dir'"));
}

// ---------------------------------------------------------------------------
// results_subscriber/wandb (recorded for scripts/wandb_replay.py; see the README)

TEST(WandbTest, OfflineRecordsTheConfigEveryLogCallAndTheRunConfigEntries) {
  TempDir dir;
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("wandb_subscriber.config.mode", "OFFLINE");
  h.set("wandb_subscriber.config.directory", (dir.path() / "wandb_storage").string());
  h.set("wandb_subscriber.config.config_file_path", kExample.string());
  auto sub = h.get<MessageSubscriber>("wandb_subscriber");
  ASSERT_NE(sub, nullptr) << h.build_error();
  const fs::path run = dir.path() / "wandb_storage" / "modalities-offline-run-example_run";
  ASSERT_TRUE(fs::is_directory(run));
  EXPECT_EQ(testing::read_file(run / "config.toml"), testing::read_file(kExample));
  const std::string meta = testing::read_file(run / "run.json");
  EXPECT_THAT(meta, HasSubstr("\"project\": \"modalities_example\", \"name\": \"example_run\", \"mode\": \"OFFLINE\", "
                              "\"config_file\": \"config.toml\""));
  sub->consume_dict({{"No. parameters", std::int64_t{124}}, {"precision", std::string("bf16")}});
  const auto s = samples();
  sub->consume_message(result_message(s[0]));
  sub->consume_message(result_message(s[1]));
  sub->consume_message(progress(3, ExperimentStatus::kTrain, "train"));  // not a result: ignored
  const auto history = lines_of(testing::read_file(run / "history.jsonl"));
  ASSERT_EQ(history.size(), 6u);  // three wandb.log calls per result, as Modalities makes them
  EXPECT_EQ(history[0],
            "{\"step\": 42, \"data\": {\"train train loss avg\": 3.456789016723633, "
            "\"train train loss last\": 2.675}}");
  EXPECT_THAT(history[1], HasSubstr("\"train consumed tokens\": 1048576"));
  EXPECT_THAT(history[2], HasSubstr("\"train lr mean\": 0.0003000000142492354"));
  EXPECT_THAT(history[3],
              ::testing::StartsWith("{\"step\": 42, \"data\": {\"val \\u00fc \\\"q\\\" CLMCrossEntropyLoss\": "));
  EXPECT_EQ(history[4], "{\"step\": 42, \"data\": {}}");  // no metrics: an empty log call, as in Modalities
  EXPECT_EQ(testing::read_file(run / "config_updates.jsonl"), "{\"No. parameters\": 124, \"precision\": \"bf16\"}\n");
  // For check.wandb_replay: this recording, replayed through the official wandb client.
  if (const char* out = std::getenv("MODALITIES_WANDB_CHECK_DIR"))
    fs::copy(run, fs::path(out), fs::copy_options::recursive | fs::copy_options::overwrite_existing);

  // A second run with the same experiment id gets its own folder.
  testing::Harness again{MODALITIES_TEST_PLUGIN, kExample};
  again.set("wandb_subscriber.config.mode", "ONLINE");
  again.set("wandb_subscriber.config.directory", (dir.path() / "wandb_storage").string());
  again.set("wandb_subscriber.config.config_file_path", kExample.string());
  ASSERT_NE(again.get<MessageSubscriber>("wandb_subscriber"), nullptr) << again.build_error();
  EXPECT_THAT(testing::read_file(dir.path() / "wandb_storage" / "modalities-offline-run-example_run-2" / "run.json"),
              HasSubstr("\"mode\": \"ONLINE\""));
}

TEST(WandbTest, DisabledAndOtherRanksRecordNothing) {
  TempDir dir;
  for (const auto& [mode, rank] : {std::pair{"DISABLED", 0}, std::pair{"OFFLINE", 1}}) {
    testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
    h.set("wandb_subscriber.config.mode", mode);
    h.set("wandb_subscriber.config.global_rank", std::int64_t{rank});
    h.set("wandb_subscriber.config.directory", (dir.path() / "w").string());
    h.set("wandb_subscriber.config.config_file_path", kExample.string());
    auto sub = h.get<MessageSubscriber>("wandb_subscriber");
    ASSERT_NE(sub, nullptr) << h.build_error();
    sub->consume_message(result_message(samples()[0]));
    EXPECT_FALSE(fs::exists(dir.path() / "w")) << mode;
  }
}

TEST(WandbTest, BadModeAndMissingConfigFileAreClearErrors) {
  TempDir dir;
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("wandb_subscriber.config.mode", "offline");
  EXPECT_THAT(h.build_error(), HasSubstr("wandb_subscriber.config.mode"));
  testing::Harness h2{MODALITIES_TEST_PLUGIN, kExample};
  h2.set("wandb_subscriber.config.mode", "OFFLINE");
  h2.set("wandb_subscriber.config.directory", dir.path().string());
  h2.set("wandb_subscriber.config.config_file_path", (dir.path() / "nope.yaml").string());
  EXPECT_THAT(h2.build_error(), HasSubstr("config_file_path"));
  EXPECT_THAT(h2.build_error(), HasSubstr("is not a file"));
}

// ---------------------------------------------------------------------------
// results_subscriber/tensorboard: the event file decoded here (TFRecord framing with CRC-32C,
// Event / Summary protocol buffers); scripts/check_tensorboard.py reads the same kind of file
// with the tensorboard package (the CTest test check.tensorboard).

std::uint32_t test_crc32c(std::string_view data) {  // bitwise, independent of the plugin's table
  std::uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return c ^ 0xFFFFFFFFu;
}

struct Scalar {
  std::string tag;
  std::int64_t step;
  float value;
};

// Minimal protobuf reader for the fields the subscriber writes.
struct PbReader {
  std::string_view d;
  std::size_t i = 0;
  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; i < d.size(); shift += 7) {
      const auto b = static_cast<unsigned char>(d[i++]);
      v |= static_cast<std::uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  }
  std::string_view bytes() {
    const std::size_t n = varint();
    const std::string_view out = d.substr(i, n);
    i += n;
    return out;
  }
  template <class T>
  T fixed() {
    T v;
    std::memcpy(&v, d.data() + i, sizeof(T));
    i += sizeof(T);
    return v;
  }
};

std::vector<Scalar> read_events(const fs::path& file, std::string* version) {
  const std::string data = testing::read_file(file);
  std::vector<Scalar> out;
  for (std::size_t pos = 0; pos < data.size();) {
    std::uint64_t len;
    std::uint32_t len_crc, data_crc;
    std::memcpy(&len, data.data() + pos, 8);
    std::memcpy(&len_crc, data.data() + pos + 8, 4);
    const std::string_view payload(data.data() + pos + 12, len);
    std::memcpy(&data_crc, data.data() + pos + 12 + len, 4);
    auto masked = [](std::uint32_t c) { return ((c >> 15) | (c << 17)) + 0xA282EAD8u; };
    EXPECT_EQ(len_crc, masked(test_crc32c(std::string_view(data.data() + pos, 8))));
    EXPECT_EQ(data_crc, masked(test_crc32c(payload)));
    pos += 16 + len;
    PbReader e{payload};
    std::int64_t step = 0;
    while (e.i < payload.size()) {
      const std::uint64_t key = e.varint();
      if (key == (1 << 3 | 1)) e.fixed<double>();
      else if (key == (2 << 3 | 0)) step = static_cast<std::int64_t>(e.varint());
      else if (key == (3 << 3 | 2)) *version = std::string(e.bytes());
      else if (key == (5 << 3 | 2)) {
        PbReader summary{e.bytes()};
        while (summary.i < summary.d.size()) {
          EXPECT_EQ(summary.varint(), 1u << 3 | 2);
          PbReader value{summary.bytes()};
          Scalar sc{"", step, 0};
          while (value.i < value.d.size()) {
            const std::uint64_t k = value.varint();
            if (k == (1 << 3 | 2)) sc.tag = std::string(value.bytes());
            else if (k == (2 << 3 | 5)) sc.value = value.fixed<float>();
            else ADD_FAILURE() << "unexpected Summary.Value field " << k;
          }
          out.push_back(sc);
        }
      } else {
        ADD_FAILURE() << "unexpected Event field " << key;
        break;
      }
    }
  }
  return out;
}

TEST(TensorboardTest, WritesEveryScalarResultAsAnEventOnRankZero) {
  TempDir dir;
  const fs::path log_dir = dir.path() / "tb";
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("tensorboard_subscriber.config.log_dir", log_dir.string());
  auto sub = h.get<MessageSubscriber>("tensorboard_subscriber");
  ASSERT_NE(sub, nullptr) << h.build_error();
  sub->consume_dict({{"No. parameters", std::int64_t{124}}, {"name", std::string("x")}});
  const auto s = samples();
  for (const auto& r : s) sub->consume_message(result_message(r));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(log_dir)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_THAT(files[0].filename().string(), ::testing::StartsWith("events.out.tfevents."));
  std::string version;
  const auto scalars = read_events(files[0], &version);
  EXPECT_EQ(version, "brain.Event:2");
  std::vector<Scalar> want = {{"run/No. parameters", 0, 124.0f}};
  for (const auto& r : s)
    for (const ResultItems* items : {&r.losses, &r.metrics, &r.throughput_metrics})
      for (const auto& [key, item] : *items)
        if (item.value.numel() == 1)
          want.push_back({r.dataloader_tag + "/" + key, r.num_train_steps_done,
                          static_cast<float>(item.value.to(at::kDouble).item<double>())});
  ASSERT_EQ(scalars.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(scalars[i].tag, want[i].tag);
    EXPECT_EQ(scalars[i].step, want[i].step) << want[i].tag;
    if (std::isnan(want[i].value)) EXPECT_TRUE(std::isnan(scalars[i].value));
    else EXPECT_EQ(scalars[i].value, want[i].value) << want[i].tag;
  }
  // For check.tensorboard: the same events and what they must contain, read by the tensorboard package.
  if (const char* out = std::getenv("MODALITIES_TENSORBOARD_CHECK_DIR")) {
    fs::create_directories(out);
    fs::copy_file(files[0], fs::path(out) / files[0].filename(), fs::copy_options::overwrite_existing);
    std::ofstream expected(fs::path(out) / "expected_scalars.tsv");
    for (const auto& w : want) expected << w.tag << '\t' << w.step << '\t' << fmt::format("{}", w.value) << '\n';
  }
}

TEST(TensorboardTest, OtherRanksWriteNothingAndBadFoldersAreClearErrors) {
  TempDir dir;
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("tensorboard_subscriber.config.log_dir", (dir.path() / "tb").string());
  h.set("tensorboard_subscriber.config.global_rank", std::int64_t{1});
  h.get<MessageSubscriber>("tensorboard_subscriber")->consume_message(result_message(samples()[0]));
  EXPECT_FALSE(fs::exists(dir.path() / "tb"));
  testing::Harness bad{MODALITIES_TEST_PLUGIN, kExample};
  bad.set("tensorboard_subscriber.config.log_dir", "/proc/no_such_dir/tb");
  EXPECT_THAT(bad.build_error(), HasSubstr("tensorboard_subscriber.config.log_dir"));
}

// ---------------------------------------------------------------------------
// results_subscriber/rich

const std::string kTimestamp = "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2} \\| ";

TEST(RichResultsTest, PrintsModalitiesLogLineWithPythonRounding) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  auto sub = h.get<MessageSubscriber>("console_subscriber");
  ASSERT_NE(sub, nullptr);
  ::testing::internal::CaptureStdout();
  for (const auto& r : samples()) sub->consume_message(result_message(r));
  const auto got = lines_of(::testing::internal::GetCapturedStdout());
  const auto want = lines_of(testing::read_file(kData / "results.txt"));
  ASSERT_EQ(got.size(), want.size());
  const std::regex stamp(kTimestamp);
  for (std::size_t i = 0; i < got.size(); ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(got[i], m, stamp) && m.position(0) == 0) << got[i];
    EXPECT_EQ(got[i].substr(static_cast<std::size_t>(m.length(0))), want[i]);
  }
}

TEST(RichResultsTest, ConsumeDictPrintsTheFactsInsteadOfRaising) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  auto sub = h.get<MessageSubscriber>("console_subscriber");
  ::testing::internal::CaptureStdout();
  sub->consume_dict(
      {{"No. parameters", std::int64_t{124439808}}, {"fsdp", true}, {"share", 0.5}, {"name", std::string("gpt2")}});
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_THAT(
      out, MatchesRegex(kTimestamp + "No. parameters: 124439808 \\| fsdp: True \\| name: gpt2 \\| share: 0.5 \\| \n"));
}

TEST(RichResultsTest, ShowsTheDataloaderTagWhenAsked) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("console_subscriber.config.show_dataloader_tag", true);
  ::testing::internal::CaptureStdout();
  h.get<MessageSubscriber>("console_subscriber")->consume_message(result_message(samples()[1]));
  EXPECT_THAT(::testing::internal::GetCapturedStdout(),
              HasSubstr("| Dataloader: val \xc3\xbc \"q\" | step: 42 | evaluation_num_samples_per_second: 45.2 | "
                        "CLMCrossEntropyLoss: 3.21 |  | \n"));
}

TEST(RichResultsTest, OtherRanksPrintNothing) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.set("console_subscriber.config.global_rank", 1);
  auto sub = h.get<MessageSubscriber>("console_subscriber");
  ::testing::internal::CaptureStdout();
  sub->consume_message(result_message(samples()[0]));
  sub->consume_dict({{"No. parameters", std::int64_t{1}}});
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
}

TEST(RichResultsTest, RejectsMissingRank) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  h.erase("console_subscriber.config.global_rank");
  EXPECT_THAT(h.build_error(), HasSubstr("console_subscriber.config.global_rank"));
  h.set("console_subscriber.config.global_rank", 0);
  h.set("console_subscriber.config.num_ranks", 0);
  EXPECT_THAT(h.build_error(), HasSubstr("console_subscriber.config.num_ranks"));
}

// ---------------------------------------------------------------------------
// dummies

TEST(DummyTest, BothDummiesIgnoreEverything) {
  testing::Harness h{MODALITIES_TEST_PLUGIN, kExample};
  for (const char* key : {"dummy_progress_subscriber", "dummy_results_subscriber"}) {
    auto sub = h.get<MessageSubscriber>(key);
    ASSERT_NE(sub, nullptr) << key;
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    sub->consume_message(result_message(samples()[0]));
    sub->consume_message(progress(1, ExperimentStatus::kTrain, "train"));
    sub->consume_dict({{"x", std::int64_t{1}}});
    EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  }
  h.set("dummy_results_subscriber.config.extra", 1);
  EXPECT_THAT(h.build_error(), HasSubstr("dummy_results_subscriber.config.extra"));
}

// ---------------------------------------------------------------------------
// progress_subscriber/rich (plain lines, as in CI logs)

class FixedLoader final : public DataLoader {
 public:
  FixedLoader(std::string tag, std::int64_t n) : tag_(std::move(tag)), n_(n) {}
  std::string tag() const override { return tag_; }
  std::int64_t size() const override { return n_; }
  void begin(std::int64_t) override {}
  std::optional<DatasetBatch> next() override { return std::nullopt; }

 private:
  std::string tag_;
  std::int64_t n_;
};

struct FixedLoaderConfig {
  std::string tag;
  std::int64_t num_batches = 0;
  static void describe(Schema<FixedLoaderConfig>& s) {
    s.field("tag", &FixedLoaderConfig::tag, "tag").required();
    s.field("num_batches", &FixedLoaderConfig::num_batches, "size").required();
  }
};

class RichProgressTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("MODALITIES_PROGRESS", "plain", 1);
    auto problem = h.registry().register_plugin({"progress_test_fakes", "0.0.0", {}, {}, {}}, [](Registrar& r) {
      r.add<DataLoader, FixedLoaderConfig>(
          "fixed_for_test", "a loader of a given size",
          [](const FixedLoaderConfig& c) { return std::make_shared<FixedLoader>(c.tag, c.num_batches); });
    });
    ASSERT_FALSE(problem) << *problem;
    h.set_config_text(R"(
[val_loader]
component_key = "data_loader"
variant_key = "fixed_for_test"
config = { tag = "val", num_batches = 5 }

[progress_subscriber]
component_key = "progress_subscriber"
variant_key = "rich"
[progress_subscriber.config]
global_rank = 0
num_seen_steps = 0
num_target_steps = 20
train_dataloader_tag = "train"
eval_dataloaders = [{ instance_key = "val_loader", pass_type = "BY_REFERENCE" }]
)");
  }
  void TearDown() override { ::unsetenv("MODALITIES_PROGRESS"); }
  testing::Harness h{MODALITIES_TEST_PLUGIN};
};

TEST_F(RichProgressTest, PrintsALineEveryTenPercentWithLossLrAndEta) {
  auto sub = h.get<MessageSubscriber>("progress_subscriber");
  ASSERT_NE(sub, nullptr);
  ::testing::internal::CaptureStderr();
  for (int step = 1; step <= 20; ++step) {
    sub->consume_message(progress(step, ExperimentStatus::kTrain, "train"));
    if (step == 10) {
      EvaluationResultBatch r{"train", 10, {}, {}, {}};
      r.losses = {{"train loss avg", item(f32(3.25), 2)}, {"train loss last", item(f32(9.0), 2)}};
      r.metrics = {{"consumed tokens", item(at::scalar_tensor(40960, at::kLong), 0)}};
      r.throughput_metrics = {{"lr mean", item(f32(0.0003))}};
      sub->consume_message(result_message(r));
      sub->consume_message(result_message(samples()[1]));  // another tag: not the training numbers
      for (int b = 0; b <= 5; ++b) sub->consume_message(progress(b, ExperimentStatus::kEvaluation, "val"));
    }
  }
  const auto lines = lines_of(::testing::internal::GetCapturedStderr());
  // First update, then every 10 % (2, 4, ..., 20), plus one line for the eval pass.
  ASSERT_EQ(lines.size(), 12u) << ::testing::PrintToString(lines);
  EXPECT_THAT(lines[0], ::testing::StartsWith("train [#-----------------------]   5% 1/20 steps"));
  EXPECT_THAT(lines[1], ::testing::StartsWith("train [##----------------------]  10% 2/20 steps"));
  EXPECT_THAT(lines[1], HasSubstr(" steps/s | ETA "));
  EXPECT_THAT(lines[5], ::testing::StartsWith("train [############------------]  50% 10/20 steps"));
  EXPECT_THAT(lines[5], Not(HasSubstr("loss")));  // printed before the result arrived
  EXPECT_THAT(lines[6], ::testing::StartsWith("val [########################] 100% 5/5 batches"));
  EXPECT_THAT(lines[6], HasSubstr(" elapsed"));
  EXPECT_THAT(lines[7],
              ::testing::StartsWith("train [##############----------]  60% 12/20 steps | loss 3.2500 | lr 3.00e-04"));
  EXPECT_THAT(lines[11], ::testing::StartsWith("train [########################] 100% 20/20 steps | loss 3.2500"));
  EXPECT_THAT(lines[11], HasSubstr(" elapsed"));
  for (const auto& line : lines) EXPECT_THAT(line, Not(HasSubstr("\r")));
}

TEST_F(RichProgressTest, WarmStartCountsFromTheSeenStepsAndRepeatedStepsPrintOnce) {
  h.set("progress_subscriber.config.num_seen_steps", 15);
  auto sub = h.get<MessageSubscriber>("progress_subscriber");
  ::testing::internal::CaptureStderr();
  for (int step = 16; step <= 20; ++step)
    for (int micro = 0; micro < 3; ++micro) sub->consume_message(progress(step, ExperimentStatus::kTrain, "train"));
  const auto lines = lines_of(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 3u) << ::testing::PrintToString(lines);  // 16 (first), 18 (90 %), 20 (100 %)
  EXPECT_THAT(lines[0], HasSubstr(" 16/20 steps"));
  EXPECT_THAT(lines[1], HasSubstr(" 18/20 steps"));
  EXPECT_THAT(lines[2], HasSubstr(" 20/20 steps"));
}

TEST_F(RichProgressTest, EvalLoaderOfUnknownSizeGetsOneLineWhenTrainingResumes) {
  auto sub = h.get<MessageSubscriber>("progress_subscriber");
  ::testing::internal::CaptureStderr();
  for (int b = 0; b <= 3; ++b) sub->consume_message(progress(b, ExperimentStatus::kEvaluation, "other"));
  sub->consume_message(progress(1, ExperimentStatus::kTrain, "train"));
  const auto lines = lines_of(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u) << ::testing::PrintToString(lines);
  EXPECT_THAT(lines[0], ::testing::StartsWith("other 3 batches"));
  EXPECT_THAT(lines[1], HasSubstr(" 1/20 steps"));
}

TEST_F(RichProgressTest, SilentWithProgressOffAndOnOtherRanks) {
  ::setenv("MODALITIES_PROGRESS", "0", 1);
  auto sub = h.get<MessageSubscriber>("progress_subscriber");
  ::testing::internal::CaptureStderr();
  sub->consume_message(progress(1, ExperimentStatus::kTrain, "train"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ::setenv("MODALITIES_PROGRESS", "plain", 1);
  h.set("progress_subscriber.config.global_rank", 3);
  sub = h.get<MessageSubscriber>("progress_subscriber");
  ::testing::internal::CaptureStderr();
  sub->consume_message(progress(1, ExperimentStatus::kTrain, "train"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(RichProgressTest, TerminalModeRedrawsOneLineInPlace) {
  ::setenv("MODALITIES_PROGRESS", "tty", 1);
  auto sub = h.get<MessageSubscriber>("progress_subscriber");
  ::testing::internal::CaptureStderr();
  for (int step = 1; step <= 20; ++step) sub->consume_message(progress(step, ExperimentStatus::kTrain, "train"));
  sub.reset();
  h.set("progress_subscriber.config.num_seen_steps", 0);  // drops the built graph: the subscriber ends its line
  const std::string out = ::testing::internal::GetCapturedStderr();
  // Throttled to 10 redraws a second: the first and the last step at least, far fewer than 20.
  EXPECT_THAT(out, ::testing::StartsWith("\r\033[Ktrain [#-----------------------]   5% 1/20 steps"));
  EXPECT_THAT(out, HasSubstr("\r\033[Ktrain [########################] 100% 20/20 steps"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_EQ(out.back(), '\n');
}

TEST_F(RichProgressTest, RejectsBadFields) {
  h.set("progress_subscriber.config.num_target_steps", 0);
  EXPECT_THAT(h.build_error(), HasSubstr("progress_subscriber.config.num_target_steps"));
  h.set("progress_subscriber.config.num_target_steps", 20);
  h.set("progress_subscriber.config.num_seen_steps", -1);
  EXPECT_THAT(h.build_error(), HasSubstr("progress_subscriber.config.num_seen_steps"));
  h.set("progress_subscriber.config.num_seen_steps", 0);
  h.set("progress_subscriber.config.log_interval_s", 0.0);
  EXPECT_THAT(h.build_error(), HasSubstr("progress_subscriber.config.log_interval_s"));
  h.erase("progress_subscriber.config.log_interval_s");
  h.erase("progress_subscriber.config.train_dataloader_tag");
  EXPECT_THAT(h.build_error(), HasSubstr("progress_subscriber.config.train_dataloader_tag"));
}

}  // namespace
}  // namespace modalities::plugins::subscribers
