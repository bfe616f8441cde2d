#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, then on the bundled data:
#   1. data preparation: index and tokenize data/sample/train.jsonl (our generated corpus)
#      with the bundled GPT-2-style tokenizer into out/data/, check both files are byte-identical
#      to what Modalities 0.5.0 wrote from the same input (data/sample/train.idx/.pbin), inspect it;
#   2. training: a small GPT-2 (RoPE, GQA, SwiGLU) on CPU for 80 steps with
#      checkpoints every 20 steps (out/experiments/quickstart/);
#   3. warm start from the step-60 checkpoint and check that steps 61-80 come out
#      bit for bit the same;
#   4. text generation from the final checkpoint.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"${root}/scripts/build.sh" cpu --target modalities_runtime  # the host and plugins; no test binaries
cd "${root}"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "modalities --version"
build/bin/modalities --version
step "modalities plugins list"
build/bin/modalities plugins list

step "modalities data create_raw_index (bundled sample JSONL -> out/data/train.idx)"
build/bin/modalities data create_raw_index data/sample/train.jsonl \
  --index_path out/data/train.idx --file_existence_policy override
step "modalities data pack_encoded_data configs/data_preparation/pack_sample.toml"
build/bin/modalities data pack_encoded_data configs/data_preparation/pack_sample.toml \
  --file_existence_policy override
for ext in idx pbin; do
  if cmp -s "out/data/train.${ext}" "data/sample/train.${ext}"; then
    echo "out/data/train.${ext} is byte-identical to data/sample/train.${ext}, which Modalities 0.5.0 wrote from the same input"
  else
    echo "out/data/train.${ext} differs from Modalities 0.5.0's data/sample/train.${ext}" >&2
    exit 1
  fi
done
step "modalities data inspect_packed_data out/data/train.pbin --document 3"
build/bin/modalities data inspect_packed_data out/data/train.pbin --document 3 --max_tokens 12 \
  --tokenizer_config configs/data_preparation/pack_sample.toml | cut -c1-160 | head -n 12

step "modalities run configs/quickstart/train.toml (80 steps on CPU)"
rm -rf out/experiments/quickstart out/experiments/quickstart_resumed
build/bin/modalities run --config_file_path configs/quickstart/train.toml \
  --experiments_root_path out/experiments --experiment_id quickstart
ls out/experiments/quickstart/checkpoints

step "modalities warmstart configs/quickstart/warmstart.toml (from the step-60 checkpoint)"
checkpoint="$(ls -d "${root}"/out/experiments/quickstart/checkpoints/eid_quickstart-seen_steps_60-*)"
printf '{"checkpoint_folder_path": "%s"}\n' "${checkpoint}" > out/experiments/resume_from_step_60.json
build/bin/modalities warmstart --config_file_path configs/quickstart/warmstart.toml \
  --experiments_root_path out/experiments --experiment_id quickstart_resumed \
  --last_checkpoint_info_file_path out/experiments/resume_from_step_60.json
# The logged results of steps 65..80 must be identical (losses, grad norms, lr) up to the throughput fields.
strip() { grep '"dataloader_tag": "train"' "$1" | sed -E 's/"throughput_metrics".*"lr mean"/"lr mean"/; s/, "peak memory[^}]*//' | tail -n 4; }
if diff <(strip out/experiments/quickstart/evaluation_results.jsonl) \
        <(strip out/experiments/quickstart_resumed/evaluation_results.jsonl); then
  echo "warm start reproduces steps 61-80 exactly (train loss, grad norm, lr of every logged step)"
else
  echo "warm start differs from the uninterrupted run" >&2
  exit 1
fi

step "modalities generate_text configs/quickstart/generate.toml"
echo "Lorem ipsum dolor sit amet" | build/bin/modalities generate_text --config_file_path configs/quickstart/generate.toml
