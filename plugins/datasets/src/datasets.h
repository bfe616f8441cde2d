// Registration entry points of the datasets plugin, one per source file.
#pragma once

#include <modalities/sdk/registrar.h>

namespace modalities::plugins::datasets {

void register_packed(Registrar& r);     // packed_mem_map_dataset_continuous
void register_mem_map(Registrar& r);    // mem_map_dataset
void register_composite(Registrar& r);  // combined, weighted_mixture, dummy_dataset

}  // namespace modalities::plugins::datasets
