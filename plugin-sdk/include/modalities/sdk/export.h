// Symbol visibility for the Modalities SDK. Everything is built with hidden
// visibility by default; the SDK library exports its API with
// MODALITIES_SDK_API and each plugin exports exactly its two entry symbols
// (see plugin.h), so plugins never clash with each other.
#pragma once

#define MODALITIES_SDK_API __attribute__((visibility("default")))
#define MODALITIES_PLUGIN_EXPORT extern "C" __attribute__((visibility("default")))
