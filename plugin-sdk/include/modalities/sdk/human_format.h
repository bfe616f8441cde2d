// Numbers and durations for people: progress lines of the host and of subscriber plugins.
#pragma once

#include <modalities/sdk/export.h>

#include <string>

namespace modalities {

/// "1.23G", "1.23M", "456.7k", "12": counts and rates in progress lines.
MODALITIES_SDK_API std::string human_count(double v);

/// "1:02:03" or "4:05" for a duration in seconds; "?" when it is negative or not finite.
MODALITIES_SDK_API std::string human_duration(double seconds);

}  // namespace modalities
