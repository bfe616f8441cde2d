#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, then run the pipelines that
# exist today on the bundled data:
#   1. data preparation: index and tokenize data/lorem_ipsum/lorem_ipsum_long.jsonl
#      with GPT-2 into out/data/ (byte-identical to Modalities' own .pbin), inspect it;
#   2. config validation and graph building: a GPT-2 run's token budget computed
#      from the packed data.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"${root}/scripts/build.sh" cpu
cd "${root}"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "modalities --version"
build/bin/modalities --version
step "modalities plugins list"
build/bin/modalities plugins list

step "modalities data create_raw_index (bundled lorem-ipsum JSONL -> out/data/lorem_ipsum_long.idx)"
build/bin/modalities data create_raw_index data/lorem_ipsum/lorem_ipsum_long.jsonl \
  --index_path out/data/lorem_ipsum_long.idx --file_existence_policy override
step "modalities data pack_encoded_data configs/data_preparation/pack_lorem_ipsum_long.toml"
build/bin/modalities data pack_encoded_data configs/data_preparation/pack_lorem_ipsum_long.toml \
  --file_existence_policy override
if cmp -s out/data/lorem_ipsum_long.pbin data/lorem_ipsum/lorem_ipsum_long.pbin; then
  echo "out/data/lorem_ipsum_long.pbin is byte-identical to Modalities' data/lorem_ipsum/lorem_ipsum_long.pbin"
else
  echo "out/data/lorem_ipsum_long.pbin differs from data/lorem_ipsum/lorem_ipsum_long.pbin" >&2
  exit 1
fi
step "modalities data inspect_packed_data out/data/lorem_ipsum_long.pbin --document 3"
build/bin/modalities data inspect_packed_data out/data/lorem_ipsum_long.pbin --document 3 --max_tokens 12 \
  --tokenizer_config configs/data_preparation/pack_lorem_ipsum_long.toml | cut -c1-160 | head -n 12

step "modalities config validate configs/token_budget.toml"
build/bin/modalities config validate configs/token_budget.toml
step "modalities config build configs/token_budget.toml"
build/bin/modalities config build configs/token_budget.toml
