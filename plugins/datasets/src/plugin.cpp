// The datasets plugin: every `dataset/*` variant of Modalities except the
// broken `packed_mem_map_dataset_megatron` (quirk Q6, docs/differences.md),
// plus the new `weighted_mixture`. See README.md for the config keys.
#include "datasets.h"

#include <modalities/sdk/plugin.h>

namespace modalities::plugins::datasets {

void register_components(Registrar& r) {
  register_packed(r);
  register_mem_map(r);
  register_composite(r);
}

}  // namespace modalities::plugins::datasets

MODALITIES_PLUGIN(datasets, MODALITIES_PLUGIN_VERSION, modalities::plugins::datasets::register_components)
