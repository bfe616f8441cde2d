// Rank-aware messages for plugins. Every rank runs the same code, so a plain fprintf(stderr, ...)
// in a component prints the same line once per rank; these print it once.
//
//   modalities::log::warning("the tokenizer has no BOS token; none is added");   // rank 0 only
//   modalities::log::rank_warning("batch 17 holds no mask token");               // every rank that sees it,
//                                                                                // as "rank 3: ..."
#pragma once

#include <modalities/sdk/export.h>

#include <string_view>

namespace modalities::log {

/// This process's global rank: the process group's when it exists, else the RANK environment
/// variable (launchers set it before anything is built), else 0.
MODALITIES_SDK_API int rank();

/// "warning: <message>" on stderr, from rank 0 only: for facts every rank shares (the config, the
/// model, a checkpoint all ranks read).
MODALITIES_SDK_API void warning(std::string_view message);

/// "<message>" on stderr, from rank 0 only.
MODALITIES_SDK_API void info(std::string_view message);

/// "warning: [rank N: ]<message>" on stderr from the calling rank: for what only this rank knows
/// (its own batches, its own files). The prefix appears when there are several ranks.
MODALITIES_SDK_API void rank_warning(std::string_view message);

}  // namespace modalities::log
