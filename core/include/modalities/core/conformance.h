// Interface conformance checks run by `modalities plugins smoke` on every
// object an example config builds: properties every implementation of an
// interface must have, whatever the variant.
#pragma once

#include <modalities/sdk/value.h>

#include <string>
#include <vector>

namespace modalities::core {

/// Problems found with `built` (empty when it conforms). Interfaces without
/// checks yet pass; plain values must be of the kind their variant declares.
std::vector<std::string> check_conformance(const Value& built);

}  // namespace modalities::core
