// Reading and writing `.safetensors` files (the Hugging Face format: an 8-byte
// little-endian header length, a JSON header naming every tensor's dtype, shape
// and byte range, then the raw little-endian data). Checkpoints and model
// exports use it, and files written here open in Python's `safetensors`.
#pragma once

#include <modalities/sdk/export.h>
#include <modalities/sdk/interfaces/batch.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace modalities::formats {

/// One tensor as described by a safetensors header (no data).
struct SafetensorsEntry {
  std::string dtype;                // "F32", "BF16", "I64", ... as written in the file
  c10::ScalarType scalar_type;      // the LibTorch equivalent
  std::vector<std::int64_t> shape;  // [] for a 0-dim tensor
  std::uint64_t begin = 0;          // byte range, relative to the data section
  std::uint64_t end = 0;
};

/// The parsed header of a safetensors file.
struct SafetensorsHeader {
  std::map<std::string, SafetensorsEntry> tensors;  // by name (sorted)
  std::map<std::string, std::string> metadata;      // "__metadata__", string -> string
  std::uint64_t data_offset = 0;                    // file position of the data section
  std::uint64_t data_size = 0;                      // bytes in the data section
};

/// Reads and validates the header of `path`: header length within the file,
/// valid JSON object, known dtypes (F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16
/// U8 BOOL F8_E4M3 F8_E5M2), non-negative shapes, each byte range inside the
/// data section and exactly numel * element size long, the ranges laid end to end
/// over the whole data section (no overlap, no gap, nothing left over: Python's
/// safetensors' "fully covered" rule), string-valued metadata. Throws modalities::Error naming the file (and the
/// tensor) otherwise. Since: SDK 0.1.
MODALITIES_SDK_API SafetensorsHeader read_safetensors_header(const std::filesystem::path& path);

/// Reads every tensor of `path` into CPU tensors with their own storage
/// (contiguous; dtype as stored). Validates like read_safetensors_header().
///
/// \code
///   StateDict sd = formats::read_safetensors("ckpt/app_state.safetensors");
///   at::Tensor w = sd.at("model.transformer.wte.weight");  // [V, C], float32
/// \endcode
/// Since: SDK 0.1.
MODALITIES_SDK_API StateDict read_safetensors(const std::filesystem::path& path);

/// Reads only the tensors whose name `select` accepts (e.g. the "model."
/// entries of a checkpoint); the others are never read from disk.
MODALITIES_SDK_API StateDict read_safetensors(const std::filesystem::path& path,
                                              const std::function<bool(const std::string&)>& select);

/// The "__metadata__" map of `path` (empty when the file has none).
MODALITIES_SDK_API std::map<std::string, std::string> read_safetensors_metadata(const std::filesystem::path& path);

/// Writes `tensors` (and `metadata` as "__metadata__") to `path` atomically
/// (AtomicFile: a failure leaves any previous file intact). Tensors on any
/// device, strided or not, are copied to contiguous CPU memory first; an
/// undefined, sparse, quantized or complex tensor, or a dtype the format lacks,
/// throws modalities::Error naming the tensor. Header keys are sorted; data is
/// laid out by element size (largest first), then name, so every tensor is
/// aligned to its element size; the header is padded with spaces to a multiple
/// of 8 bytes. Since: SDK 0.1.
MODALITIES_SDK_API void write_safetensors(const std::filesystem::path& path, const StateDict& tensors,
                                          const std::map<std::string, std::string>& metadata = {});

/// The safetensors dtype name of `type` ("F32", ...); throws modalities::Error
/// when the format has none.
MODALITIES_SDK_API std::string_view safetensors_dtype_name(c10::ScalarType type);

}  // namespace modalities::formats
