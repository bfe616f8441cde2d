// The 14 `number_conversion` variants (README.md): integer arithmetic over
// token budgets, step counts, checkpoint folder names and dataset files, used
// through interpolation to keep a run's numbers consistent. All integer
// fields are strict; `//` is floor division of non-negative integers.
// Deviations from Modalities (fixes of registrations that cannot work there):
//   * num_steps_from_num_samples takes `dp_degree` (alias `num_ranks`);
//     Modalities' registration can never be instantiated.
//   * num_target_steps_from_checkpoint_path checks that the tokens per step
//     divide the target tokens; Modalities' check can never fire.
#include <modalities/sdk/formats/packed_data.h>
#include <modalities/sdk/interfaces/device_mesh.h>
#include <modalities/sdk/parallel.h>
#include <modalities/sdk/plugin.h>

#include <cstdint>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

namespace modalities::plugins::number_conversion {
namespace {

using i64 = std::int64_t;

// --- parallel_degree ------------------------------------------------------------

struct ParallelDegreeConfig {
  Ref<DeviceMesh> device_mesh;
  std::vector<std::string> parallelism_methods;
  static void describe(Schema<ParallelDegreeConfig>& s) {
    s.field("device_mesh", &ParallelDegreeConfig::device_mesh, "Device mesh whose dimensions are multiplied.")
        .required();
    s.field("parallelism_methods", &ParallelDegreeConfig::parallelism_methods,
            "Mesh dimensions to multiply, e.g. [\"dp_shard\", \"dp_replicate\"] for the data-parallel degree.")
        .required()
        .non_empty()
        .one_of(mesh_dim_names());
  }
};

i64 parallel_degree(const ParallelDegreeConfig& c) {
  const ParallelDims dims(c.device_mesh.shared());
  i64 degree = 1;
  for (const auto& name : c.parallelism_methods) degree *= dims.degree(*parse_mesh_dim(name));  // absent: 1
  return degree;
}

// --- pure arithmetic ----------------------------------------------------------------

// Our extension (Modalities has no such variant): the micro-batch size that keeps the global batch
// fixed whatever the world size, so one config gives the same loss curve on 1, 2, 4 ... ranks.
struct LocalMicroBatchSizeFromGlobalBatchSizeConfig {
  i64 global_batch_size = 0, dp_degree = 0, gradient_accumulation_steps = 1;
  static void describe(Schema<LocalMicroBatchSizeFromGlobalBatchSizeConfig>& s) {
    using C = LocalMicroBatchSizeFromGlobalBatchSizeConfig;
    s.field("global_batch_size", &C::global_batch_size, "Samples per optimizer step over all data-parallel ranks.")
        .required()
        .positive();
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").required().positive();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .positive();
  }
};

i64 local_micro_batch_size_from_global_batch_size(const LocalMicroBatchSizeFromGlobalBatchSizeConfig& c) {
  const i64 per_micro_step = c.dp_degree * c.gradient_accumulation_steps;
  if (c.global_batch_size % per_micro_step != 0)
    throw Error(
        fmt::format("global_batch_size {} is not divisible by dp_degree {} x gradient_accumulation_steps {} = "
                    "{}: choose a global batch that is a multiple of it, or another world size",
                    c.global_batch_size, c.dp_degree, c.gradient_accumulation_steps, per_micro_step));
  return c.global_batch_size / per_micro_step;
}

struct LocalNumBatchesFromNumSamplesConfig {
  i64 num_ranks = 0, global_num_samples = 0, local_micro_batch_size = 0;
  static void describe(Schema<LocalNumBatchesFromNumSamplesConfig>& s) {
    using C = LocalNumBatchesFromNumSamplesConfig;
    s.field("num_ranks", &C::num_ranks, "Number of data-parallel ranks.").required().positive();
    s.field("global_num_samples", &C::global_num_samples, "Samples over all ranks.").required().non_negative();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
  }
};

struct LocalNumBatchesFromNumTokensConfig {
  i64 num_ranks = 0, global_num_tokens = 0, sequence_length = 0, local_micro_batch_size = 0;
  static void describe(Schema<LocalNumBatchesFromNumTokensConfig>& s) {
    using C = LocalNumBatchesFromNumTokensConfig;
    s.field("num_ranks", &C::num_ranks, "Number of data-parallel ranks.").required().positive();
    s.field("global_num_tokens", &C::global_num_tokens, "Tokens over all ranks.").required().non_negative();
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().positive();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
  }
};

struct NumSamplesFromNumTokensConfig {
  i64 num_tokens = 0, sequence_length = 0;
  static void describe(Schema<NumSamplesFromNumTokensConfig>& s) {
    using C = NumSamplesFromNumTokensConfig;
    s.field("num_tokens", &C::num_tokens, "Number of tokens.").required().non_negative();
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().positive();
  }
};

struct NumStepsFromNumSamplesConfig {
  i64 dp_degree = 0, local_micro_batch_size = 0, global_num_samples = 0, gradient_accumulation_steps = 0;
  static void describe(Schema<NumStepsFromNumSamplesConfig>& s) {
    using C = NumStepsFromNumSamplesConfig;
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").required().positive().alias("num_ranks");
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
    s.field("global_num_samples", &C::global_num_samples, "Samples over all ranks.").required().non_negative();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .required()
        .positive();
  }
};

struct NumStepsFromNumTokensConfig {
  i64 dp_degree = 0, local_micro_batch_size = 0, global_num_tokens = 0, sequence_length = 0,
      gradient_accumulation_steps = 0;
  static void describe(Schema<NumStepsFromNumTokensConfig>& s) {
    using C = NumStepsFromNumTokensConfig;
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").required().positive();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
    s.field("global_num_tokens", &C::global_num_tokens, "Tokens over all ranks.").required().non_negative();
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().positive();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .required()
        .positive();
  }
};

i64 num_steps_from_num_tokens(i64 tokens, i64 seq, i64 dp, i64 mbs, i64 gas) { return (tokens / seq) / dp / mbs / gas; }

struct NumTokensFromNumStepsConfig {
  i64 num_steps = 0, dp_degree = 0, local_micro_batch_size = 0, sequence_length = 0, gradient_accumulation_steps = 0;
  static void describe(Schema<NumTokensFromNumStepsConfig>& s) {
    using C = NumTokensFromNumStepsConfig;
    s.field("num_steps", &C::num_steps, "Optimizer steps.").required().non_negative();
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").required().positive();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().positive();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .required()
        .positive();
  }
};

i64 checked_product(std::initializer_list<i64> factors) {
  i64 p = 1;
  for (i64 f : factors) MODALITIES_CHECK(!__builtin_mul_overflow(p, f, &p), "product overflows a 64-bit integer");
  return p;
}

// --- checkpoint paths ---------------------------------------------------------------

struct CheckpointPathConfig {
  std::filesystem::path checkpoint_path;
  static void describe(Schema<CheckpointPathConfig>& s) {
    s.field("checkpoint_path", &CheckpointPathConfig::checkpoint_path,
            "Checkpoint file or folder whose name contains seen_steps_<n>, seen_tokens_<n>, target_tokens_<n>.")
        .required();
  }
};

// The integer after `<key>_` in the path; the pattern must occur exactly once.
i64 number_in_path(const std::filesystem::path& path, const std::string& key) {
  const std::string s = path.string();
  const std::regex re(key + "_(\\d+)");
  std::vector<std::string> found;
  for (auto it = std::sregex_iterator(s.begin(), s.end(), re); it != std::sregex_iterator(); ++it)
    found.push_back((*it)[1].str());
  MODALITIES_CHECK(found.size() == 1,
                   "checkpoint path '{}' must contain '{}_<number>' exactly once, found it {} time(s)", s, key,
                   found.size());
  try {
    return std::stoll(found[0]);
  } catch (const std::out_of_range&) {
    throw Error(fmt::format("'{}_{}' in checkpoint path '{}' does not fit a 64-bit integer", key, found[0], s));
  }
}

i64 num_target_steps_from_checkpoint_path(const CheckpointPathConfig& c) {
  const i64 seen_steps = number_in_path(c.checkpoint_path, "seen_steps");
  const i64 seen_tokens = number_in_path(c.checkpoint_path, "seen_tokens");
  const i64 target_tokens = number_in_path(c.checkpoint_path, "target_tokens");
  MODALITIES_CHECK(seen_steps > 0, "checkpoint path '{}' has seen_steps_0: tokens per step are unknown",
                   c.checkpoint_path.string());
  MODALITIES_CHECK(seen_tokens % seen_steps == 0, "seen_tokens ({}) is not a multiple of seen_steps ({}) in '{}'",
                   seen_tokens, seen_steps, c.checkpoint_path.string());
  const i64 tokens_per_step = seen_tokens / seen_steps;
  MODALITIES_CHECK(tokens_per_step > 0, "checkpoint path '{}' implies 0 tokens per step", c.checkpoint_path.string());
  MODALITIES_CHECK(target_tokens % tokens_per_step == 0,
                   "target_tokens ({}) is not a multiple of the tokens per step ({}) in '{}'", target_tokens,
                   tokens_per_step, c.checkpoint_path.string());
  return target_tokens / tokens_per_step;
}

// --- datasets --------------------------------------------------------------------------

struct NumTokensFromPackedDatasetConfig {
  std::filesystem::path dataset_path;
  i64 sequence_length = 0, dp_degree = 0, local_micro_batch_size = 0, gradient_accumulation_steps = 0;
  std::string sample_key = "text";
  bool reuse_last_target = true;
  static void describe(Schema<NumTokensFromPackedDatasetConfig>& s) {
    using C = NumTokensFromPackedDatasetConfig;
    s.field("dataset_path", &C::dataset_path, "Packed dataset (.pbin) that training reads continuously.")
        .required()
        .existing_file();
    s.field("sequence_length", &C::sequence_length, "Tokens per sample.").required().positive();
    s.field("dp_degree", &C::dp_degree, "Data-parallel degree.").required().positive();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .required()
        .positive();
    s.field("sample_key", &C::sample_key, "Sample key of the dataset (does not change the result).");
    s.field("reuse_last_target", &C::reuse_last_target,
            "Whether consecutive samples share one token, as in dataset/packed_mem_map_dataset_continuous.");
  }
};

// Samples of packed_mem_map_dataset_continuous (plugins/datasets/README.md).
i64 continuous_num_samples(const NumTokensFromPackedDatasetConfig& c) {
  const auto header = formats::read_packed_header(c.dataset_path);
  const i64 tokens = static_cast<i64>(header.num_tokens());
  const i64 block = c.reuse_last_target ? c.sequence_length + 1 : c.sequence_length;
  MODALITIES_CHECK(
      block >= 2, "a block of {} token(s) is too small: sequence_length must be >= 2 without reuse_last_target", block);
  MODALITIES_CHECK(tokens >= block, "{} has {} tokens, fewer than one block of {}", c.dataset_path.string(), tokens,
                   block);
  return c.reuse_last_target ? (tokens - 1) / c.sequence_length : tokens / c.sequence_length;
}

struct NumStepsFromRawIndexConfig {
  std::filesystem::path raw_index_path;
  i64 num_ranks = 0, local_micro_batch_size = 0, gradient_accumulation_steps = 0;
  static void describe(Schema<NumStepsFromRawIndexConfig>& s) {
    using C = NumStepsFromRawIndexConfig;
    s.field("raw_index_path", &C::raw_index_path, "Raw JSONL index (.idx) from `modalities data create_raw_index`.")
        .required()
        .existing_file();
    s.field("num_ranks", &C::num_ranks, "Number of data-parallel ranks.").required().positive();
    s.field("local_micro_batch_size", &C::local_micro_batch_size, "Samples per micro batch on one rank.")
        .required()
        .positive();
    s.field("gradient_accumulation_steps", &C::gradient_accumulation_steps, "Micro batches per optimizer step.")
        .required()
        .positive();
  }
};

}  // namespace

void register_components(Registrar& r) {
  constexpr std::string_view kKey = "number_conversion";
  r.add_value<i64, ParallelDegreeConfig>(
      kKey, "parallel_degree", "Product of the sizes of the listed device-mesh dimensions (absent ones count 1).",
      parallel_degree);
  r.add_value<i64, LocalMicroBatchSizeFromGlobalBatchSizeConfig>(
      kKey, "local_micro_batch_size_from_global_batch_size",
      "global_batch_size / (dp_degree * gradient_accumulation_steps), which must divide exactly (our extension).",
      local_micro_batch_size_from_global_batch_size);
  r.add_value<i64, LocalNumBatchesFromNumSamplesConfig>(
      kKey, "local_num_batches_from_num_samples", "global_num_samples // num_ranks // local_micro_batch_size.",
      [](const LocalNumBatchesFromNumSamplesConfig& c) {
        return c.global_num_samples / c.num_ranks / c.local_micro_batch_size;
      });
  r.add_value<i64, LocalNumBatchesFromNumTokensConfig>(
      kKey, "local_num_batches_from_num_tokens",
      "(global_num_tokens // sequence_length) // num_ranks // local_micro_batch_size.",
      [](const LocalNumBatchesFromNumTokensConfig& c) {
        return c.global_num_tokens / c.sequence_length / c.num_ranks / c.local_micro_batch_size;
      });
  r.add_value<i64, NumSamplesFromNumTokensConfig>(
      kKey, "num_samples_from_num_tokens", "num_tokens // sequence_length.",
      [](const NumSamplesFromNumTokensConfig& c) { return c.num_tokens / c.sequence_length; });
  r.add_value<i64, NumStepsFromNumSamplesConfig>(
      kKey, "num_steps_from_num_samples",
      "global_num_samples // dp_degree // local_micro_batch_size // gradient_accumulation_steps.",
      [](const NumStepsFromNumSamplesConfig& c) {
        return c.global_num_samples / c.dp_degree / c.local_micro_batch_size / c.gradient_accumulation_steps;
      });
  r.add_value<i64, NumStepsFromNumTokensConfig>(
      kKey, "num_steps_from_num_tokens",
      "(global_num_tokens // sequence_length) // dp_degree // local_micro_batch_size // gradient_accumulation_steps.",
      [](const NumStepsFromNumTokensConfig& c) {
        return num_steps_from_num_tokens(c.global_num_tokens, c.sequence_length, c.dp_degree, c.local_micro_batch_size,
                                         c.gradient_accumulation_steps);
      });
  r.add_value<i64, NumTokensFromNumStepsConfig>(
      kKey, "num_tokens_from_num_steps",
      "num_steps * dp_degree * local_micro_batch_size * sequence_length * gradient_accumulation_steps.",
      [](const NumTokensFromNumStepsConfig& c) {
        return checked_product({c.num_steps, tokens_per_step(c.local_micro_batch_size, c.sequence_length,
                                                             c.gradient_accumulation_steps, c.dp_degree)});
      });
  r.add_value<i64, CheckpointPathConfig>(
      kKey, "last_step_from_checkpoint_path", "seen_steps_<n> of the checkpoint path, minus 1.",
      [](const CheckpointPathConfig& c) { return number_in_path(c.checkpoint_path, "seen_steps") - 1; });
  r.add_value<i64, CheckpointPathConfig>(
      kKey, "num_seen_steps_from_checkpoint_path", "seen_steps_<n> of the checkpoint path.",
      [](const CheckpointPathConfig& c) { return number_in_path(c.checkpoint_path, "seen_steps"); });
  r.add_value<i64, CheckpointPathConfig>(
      kKey, "global_num_seen_tokens_from_checkpoint_path", "seen_tokens_<n> of the checkpoint path.",
      [](const CheckpointPathConfig& c) { return number_in_path(c.checkpoint_path, "seen_tokens"); });
  r.add_value<i64, CheckpointPathConfig>(
      kKey, "num_target_steps_from_checkpoint_path",
      "target_tokens // (seen_tokens / seen_steps) of the checkpoint path; the division must be exact.",
      num_target_steps_from_checkpoint_path);
  r.add_value<i64, CheckpointPathConfig>(
      kKey, "global_num_target_tokens_from_checkpoint_path", "target_tokens_<n> of the checkpoint path.",
      [](const CheckpointPathConfig& c) { return number_in_path(c.checkpoint_path, "target_tokens"); });
  r.add_value<i64, NumTokensFromPackedDatasetConfig>(
      kKey, "num_tokens_from_packed_mem_map_dataset_continuous",
      "Tokens a run consumes from a continuously packed .pbin: whole steps only "
      "(steps * dp_degree * local_micro_batch_size * sequence_length * gradient_accumulation_steps).",
      [](const NumTokensFromPackedDatasetConfig& c) {
        const i64 samples = continuous_num_samples(c);
        const i64 steps =
            num_steps_from_num_tokens(checked_product({samples, c.sequence_length}), c.sequence_length, c.dp_degree,
                                      c.local_micro_batch_size, c.gradient_accumulation_steps);
        return checked_product({steps, tokens_per_step(c.local_micro_batch_size, c.sequence_length,
                                                       c.gradient_accumulation_steps, c.dp_degree)});
      });
  r.add_value<i64, NumStepsFromRawIndexConfig>(
      kKey, "num_steps_from_raw_dataset_index",
      "Documents in a raw JSONL index // num_ranks // local_micro_batch_size // gradient_accumulation_steps.",
      [](const NumStepsFromRawIndexConfig& c) {
        const auto index = formats::read_raw_index(c.raw_index_path);
        return static_cast<i64>(index.size()) / c.num_ranks / c.local_micro_batch_size / c.gradient_accumulation_steps;
      });
}

}  // namespace modalities::plugins::number_conversion

MODALITIES_PLUGIN(number_conversion, MODALITIES_PLUGIN_VERSION,
                  modalities::plugins::number_conversion::register_components)
