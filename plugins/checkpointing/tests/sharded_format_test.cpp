// Format v2 (sharded checkpoints) at the level of format.h, in one process: the collective writer
// with a world of one, and hand-made folders whose tensors are split into chunks over several rank
// files, as several ranks write them. The writer's multi-rank path (plan exchange, deduplication,
// commit by rank 0) runs in tests/distributed (DistributedCheckpointTest), which saves on 4 Gloo
// ranks and continues on 4, 2 and 1.
#include "../src/format.h"
#include "scratch_dir.h"  // tests/cli

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/safetensors.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace modalities::plugins::checkpointing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

using Folder = modalities::testing::ScratchDir;

std::string sha256(const at::Tensor& t) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(t.data_ptr(), t.nbytes(), md, &len, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
  return hex;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
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

constexpr const char* kName = "eid_x-seen_steps_2-seen_tokens_64-target_steps_4-target_tokens_128";

// A checkpoint as 2 ranks of an FSDP run write it: "model.w" [5,3] split 3 + 2 rows,
// "model.b" [4] whole on rank 0, and both ranks' RNG states.
struct TwoRankFolder {
  Folder dir;
  at::Tensor w = torch::arange(15, torch::kFloat).reshape({5, 3});
  at::Tensor b = torch::tensor({1.f, 2.f, 3.f, 4.f});
  at::Tensor rng0 = torch::full({8}, 7, torch::kUInt8), rng1 = torch::full({8}, 9, torch::kUInt8);
  fs::path folder = dir.path() / kName;

  TwoRankFolder() {
    fs::create_directories(folder);
    const at::Tensor w0 = w.narrow(0, 0, 3).contiguous(), w1 = w.narrow(0, 3, 2).contiguous();
    formats::write_safetensors(folder / "rank_00000.safetensors", {{"model.w", w0}, {"model.b", b}, {"rng.cpu", rng0}});
    formats::write_safetensors(folder / "rank_00001.safetensors", {{"model.w", w1}, {"rng.cpu", rng1}});
    write_manifest(fmt::format(
        R"("tensors": {{
      "model.b": {{"dtype": "F32", "shape": [4], "chunks": [{{"file": "rank_00000.safetensors", "offsets": [0], "shape": [4], "sha256": "{}"}}]}},
      "model.w": {{"dtype": "F32", "shape": [5, 3], "chunks": [
        {{"file": "rank_00000.safetensors", "offsets": [0, 0], "shape": [3, 3], "sha256": "{}"}},
        {{"file": "rank_00001.safetensors", "offsets": [3, 0], "shape": [2, 3], "sha256": "{}"}}]}}}})",
        sha256(b), sha256(w0), sha256(w1)));
  }

  void write_manifest(const std::string& tensors) const {
    std::ofstream(folder / "manifest.json") << fmt::format(
        R"({{"format": "modalities_checkpoint", "format_version": 2, "experiment_id": "x",
  "training_progress": {{"num_seen_steps_total": 2, "num_seen_tokens_total": 64, "num_target_steps": 4, "num_target_tokens": 128}},
  "world_size": 2,
  "files": {{"rank_00000.safetensors": {{"bytes": {}}}, "rank_00001.safetensors": {{"bytes": {}}}}},
  "ranks": [{{"file": "rank_00000.safetensors", "rng": {{"rng.cpu": "{}"}}}}, {{"file": "rank_00001.safetensors", "rng": {{"rng.cpu": "{}"}}}}],
  {}}})",
        fs::file_size(folder / "rank_00000.safetensors"), fs::file_size(folder / "rank_00001.safetensors"),
        sha256(rng0), sha256(rng1), tensors);
  }
};

TEST(ShardedFormatTest, ReadsWholeTensorsAndRegionsAcrossChunks) {
  const TwoRankFolder f;
  const CheckpointReader reader(f.folder);
  EXPECT_EQ(reader.format_version(), kShardedFormatVersion);
  EXPECT_EQ(reader.saved_world_size(), 2);
  EXPECT_EQ(reader.shapes().at("model.w"), (std::vector<std::int64_t>{5, 3}));
  const StateDict all = reader.read_all();
  EXPECT_TRUE(torch::equal(all.at("model.w"), f.w));
  EXPECT_TRUE(torch::equal(all.at("model.b"), f.b));
  // Rows 2..3 span both files; a column slice of them; an empty region reads nothing.
  const StateDict part = reader.read_regions({{"model.w", Box{{2, 1}, {2, 2}}}, {"model.b", Box{{4}, {0}}}});
  EXPECT_TRUE(torch::equal(part.at("model.w"), f.w.narrow(0, 2, 2).narrow(1, 1, 2)));
  EXPECT_EQ(part.at("model.b").numel(), 0);
  EXPECT_TRUE(torch::equal(reader.read_rng(1).at("rng.cpu"), f.rng1));
  EXPECT_THAT(error_of([&] { (void)reader.read_rng(2); }), HasSubstr("no generator states of rank 2"));
  EXPECT_THAT(error_of([&] {
                (void)reader.read_regions({{"model.w", Box{{4, 0}, {2, 3}}}});
              }),
              HasSubstr("outside tensor 'model.w' of shape [5,3]"));
  EXPECT_THAT(error_of([&] {
                (void)reader.read_regions({{"model.nope", std::nullopt}});
              }),
              HasSubstr("holds no tensor 'model.nope'"));
}

TEST(ShardedFormatTest, AMissingOrTruncatedRankFileIsFoundBeforeReading) {
  const TwoRankFolder f;
  const std::string bytes = slurp(f.folder / "rank_00001.safetensors");
  std::ofstream(f.folder / "rank_00001.safetensors", std::ios::binary | std::ios::trunc) << bytes.substr(0, 100);
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              AllOf(HasSubstr(kName), HasSubstr("rank_00001.safetensors has 100 bytes"), HasSubstr("truncated")));
  fs::remove(f.folder / "rank_00001.safetensors");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              AllOf(HasSubstr("is incomplete"), HasSubstr("rank_00001.safetensors is missing")));
}

TEST(ShardedFormatTest, ADamagedChunkFailsItsChecksumOnlyWhenRead) {
  const TwoRankFolder f;
  std::string bytes = slurp(f.folder / "rank_00001.safetensors");
  const auto header = formats::read_safetensors_header(f.folder / "rank_00001.safetensors");
  bytes[header.data_offset + header.tensors.at("model.w").begin + 1] ^= 0x10;
  std::ofstream(f.folder / "rank_00001.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  const CheckpointReader reader(f.folder);
  EXPECT_EQ(error_of([&] { (void)reader.read_regions({{"model.w", Box{{0, 0}, {3, 3}}}}); }), "");  // rank 0's rows
  EXPECT_THAT(error_of([&] { (void)reader.read_all(); }),
              AllOf(HasSubstr("'model.w' in rank_00001.safetensors does not match its SHA-256")));
}

TEST(ShardedFormatTest, ChunksThatDoNotTileTheTensorAreRefused) {
  const TwoRankFolder f;
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "F32", "shape": [5, 3], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [0, 0], "shape": [3, 3], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              HasSubstr("the chunks of tensor 'model.w' hold 9 elements, the tensor 15"));
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "F32", "shape": [5, 3], "chunks": [
        {"file": "rank_00007.safetensors", "offsets": [0, 0], "shape": [5, 3], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              HasSubstr("names file 'rank_00007.safetensors', which 'files' does not list"));
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "F32", "shape": [5, 3], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [4, 0], "shape": [3, 3], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }), HasSubstr("reaches outside its shape [5,3]"));
}

// Chunks with the right element count that overlap (and so leave a gap) would load one row twice
// and another never: refused, naming both.
TEST(ShardedFormatTest, OverlappingChunksAreRefusedEvenWhenTheCountAddsUp) {
  const TwoRankFolder f;
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "F32", "shape": [5, 3], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [0, 0], "shape": [3, 3], "sha256": "00"},
        {"file": "rank_00001.safetensors", "offsets": [2, 0], "shape": [2, 3], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              AllOf(HasSubstr("two chunks of tensor 'model.w' overlap"), HasSubstr("[3,3] at [0,0] in rank_00000"),
                    HasSubstr("[2,3] at [2,0] in rank_00001")));
}

// Found by fuzzing (tests/fuzz/corpus/manifest/tensor_listed_twice.json, unsupported_dtype.json): a
// tensor listed twice added the chunks of one shape to the record of another (a heap overflow in
// the overlap check), an unknown dtype failed only when read and without the folder, and shapes
// whose element count overflows 64 bits were counted wrapped.
TEST(ShardedFormatTest, ATensorListedTwiceAnUnknownDtypeAndAnUncountableShapeAreRefused) {
  const TwoRankFolder f;
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "F32", "shape": [3], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [0], "shape": [3], "sha256": "00"}]},
      "model.w": {"dtype": "F32", "shape": [5, 3], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [0, 0], "shape": [5, 3], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              AllOf(HasSubstr(kName), HasSubstr("tensor 'model.w' is listed twice")));
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "I16F32", "shape": [5, 3], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [0, 0], "shape": [5, 3], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }),
              AllOf(HasSubstr(kName), HasSubstr("tensor 'model.w': unsupported dtype 'I16F32'")));
  f.write_manifest(R"("tensors": {"model.w": {"dtype": "F32", "shape": [4294967296, 4294967296], "chunks": [
        {"file": "rank_00000.safetensors", "offsets": [0, 0], "shape": [4294967296, 4294967296], "sha256": "00"}]}})");
  EXPECT_THAT(error_of([&] { CheckpointReader r(f.folder); }), HasSubstr("more elements than 64 bits count"));
}

// Note [Manifest checksum]: a manifest the writer made records its own SHA-256, so an edited or
// damaged placement (one digit of an offset, a shape, a swapped file name) is refused when the
// checkpoint is opened, before a chunk could land in the wrong place with exit 0.
TEST(ShardedFormatTest, AnEditedManifestFailsItsOwnChecksum) {
  const Folder dir;
  const fs::path folder = dir.path() / kName;
  TrainingProgress progress{2, 64, 4, 128, 0, 0};
  write_sharded_checkpoint_folder(
      folder, {{"model.w", torch::randn({4, 2}), {4, 2}, {0, 0}}, {"model.v", torch::randn({3}), {3}, {0}}}, {},
      {"x", progress, "test"}, {});
  const std::string good = slurp(folder / "manifest.json");
  ASSERT_THAT(good, HasSubstr("\"manifest_sha256\": \""));
  EXPECT_EQ(error_of([&] { CheckpointReader r(folder); }), "");
  for (const auto& [from, to] :
       std::vector<std::pair<std::string, std::string>>{{"\"offsets\": [0, 0]", "\"offsets\": [1, 0]"},
                                                        {"\"shape\": [4, 2]", "\"shape\": [4, 3]"},
                                                        {"rank_00000.safetensors", "rank_00001.safetensors"},
                                                        {"\"manifest_sha256\": \"", "\"manifest_sha256\": \"f"}}) {
    std::string edited = good;
    const auto at = edited.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    edited.replace(at, from.size(), to);
    std::ofstream(folder / "manifest.json", std::ios::trunc) << edited;
    EXPECT_THAT(error_of([&] { CheckpointReader r(folder); }),
                AllOf(HasSubstr(kName), HasSubstr("does not match its manifest_sha256")))
        << from;
  }
}

// With one process the collective writer needs no process group: it writes rank_00000 and the
// manifest, commits, and runs after_commit before returning.
TEST(ShardedFormatTest, TheWriterRoundTripsInOneProcess) {
  const Folder dir;
  const fs::path folder = dir.path() / kName;
  const at::Tensor w = torch::randn({4, 2}), step = torch::tensor(3.0);
  bool committed = false;
  TrainingProgress progress{2, 64, 4, 128, 0, 0};
  write_sharded_checkpoint_folder(folder, {{"model.w", w, {4, 2}, {0, 0}}, {"optimizer.state.w.step", step, {}, {}}},
                                  {{"rng.cpu", torch::full({3}, 5, torch::kUInt8)}}, {"x", progress, "test"},
                                  [&] { committed = fs::exists(folder / "manifest.json"); });
  EXPECT_TRUE(committed);
  const CheckpointReader reader(folder);
  EXPECT_EQ(reader.format_version(), kShardedFormatVersion);
  const StateDict all = reader.read_all();
  EXPECT_TRUE(torch::equal(all.at("model.w"), w));
  EXPECT_TRUE(torch::equal(all.at("optimizer.state.w.step"), step));
  EXPECT_EQ(all.count("rng.cpu"), 0u);  // generator states are per rank, not tensors of the state
  EXPECT_EQ(reader.read_rng(0).at("rng.cpu")[0].item<int>(), 5);
  EXPECT_EQ(reader.progress().num_seen_steps, 2);
  // Chunks that do not tile the tensor are refused before anything is written.
  EXPECT_THAT(error_of([&] {
                write_sharded_checkpoint_folder(dir.path() / "other", {{"model.w", w, {8, 2}, {0, 0}}}, {},
                                                {"x", progress, "test"}, {});
              }),
              HasSubstr("the chunks of 'model.w' held by the ranks have 8 elements, the tensor [8,2] 16"));
  EXPECT_FALSE(fs::exists(dir.path() / "other"));
}

}  // namespace
}  // namespace modalities::plugins::checkpointing
