// The pipeline profiles of the commands (docs/configs.md): which top-level keys each
// command builds, in which order, and what each must produce.
#include <modalities/core/data/packing.h>
#include <modalities/core/graph.h>
#include <modalities/core/training_settings.h>

namespace modalities::core {

const std::vector<PipelineProfile>& builtin_pipelines() {
  static const std::vector<PipelineProfile> profiles = {
      {"training",
       "`modalities run` / `warmstart`",
       {
           {"settings", "table", true, "run settings: paths, intervals, step profile, training target and progress",
            check_training_settings},
           {"app_state", "AppState", true, "model parts, optimizer and optional LR scheduler"},
           {"loss_fn", "Loss", true, "training loss"},
           {"train_dataset", "Dataset", true, "used for the token-budget check"},
           {"train_dataloader", "DataLoader", true, "training batches"},
           {"eval_dataloaders", "list<DataLoader>", true, "evaluation loaders (may be [])"},
           {"progress_subscriber", "MessageSubscriber", true, "receives batch-progress messages"},
           {"evaluation_subscriber", "MessageSubscriber", true, "receives evaluation results"},
           {"checkpoint_saving", "CheckpointSaving", true, "when and how checkpoints are written"},
           {"gradient_clipper", "GradientClipper", true, "gradient clipping (or logging only)"},
           {"model_raw", "Module", true, "the unwrapped model"},
           {"profiler", "SteppableProfiler", false, "wraps the training loop"},
           {"mfu_calculator", "MFUCalculator", false, "model FLOPs utilisation"},
           {"scheduled_pipeline", "Pipeline", false,
            "enables the pipeline-parallel path (or the model brings it: Module::pipeline)"},
           {"device_mesh", "DeviceMesh", false, "parallelism layout; without it DP degree = world size"},
       },
       check_training_set},
      {"packing",
       "`modalities data pack_encoded_data`",
       {
           {"tokenizer", "Tokenizer", true, "tokenizer used to encode the documents"},
           {"settings", "table", true, "src_path, dst_path, index_path, jq_pattern, num_cpus, eod_token, ...",
            data::check_packing_settings},
       }},
      {"text_generation",
       "`modalities generate_text`",
       {
           {"text_inference_component", "TextInferenceComponent", true, "the generation loop"},
           {"settings", "table", true, "model_path, sequence_length, device, referencing_keys"},
       }},
      {"profiling",
       "`modalities profile`",
       {
           {"steppable_component", "SteppableComponent", true, "the work to profile"},
           {"profiler", "SteppableProfiler", true, "the profiler; its size() is the number of steps"},
       }},
  };
  return profiles;
}

const PipelineProfile* find_pipeline(std::string_view name) {
  for (const auto& p : builtin_pipelines())
    if (p.name == name) return &p;
  return nullptr;
}

}  // namespace modalities::core
