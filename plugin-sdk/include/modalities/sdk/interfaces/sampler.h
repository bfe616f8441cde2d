// The sampler interfaces: which dataset indices this rank visits, in which
// order (Sampler), and how they are grouped into micro-batches (BatchSampler).
// Random access by position instead of iteration keeps them resumable and
// lets a loader start mid-epoch. Maps torch.utils.data.Sampler / BatchSampler
// as Modalities uses them (`sampler/*`, `batch_sampler/default`).
#pragma once

#include <modalities/sdk/export.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace modalities {

/// The ordered sequence of dataset indices this rank reads, of length size().
///
/// Built once per run. Instead of materializing the index list (too large for
/// trillion-token runs) or an iterator (hard to resume), it offers random
/// access: index_at(p) is the dataset index at position p. Implementations may
/// precompute what they need at construction (e.g. the shuffled permutation),
/// but index_at must then be O(1) or O(log n), const, and safe to call
/// concurrently (loader workers).
///
/// \code
///   for (std::int64_t p = 0; p < sampler->size(); ++p) {
///     Sample s = dataset->get(sampler->index_at(p));
///   }
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it may hold a
/// shared_ptr to the dataset it samples.
/// Errors: p outside [0, size()) throws modalities::Error; never exit().
/// Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API Sampler {
 public:
  static constexpr std::string_view kInterface = "Sampler";
  static constexpr std::string_view kComponentKey = "sampler";

  Sampler() = default;
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;
  virtual ~Sampler();  // defined in the SDK library: one vtable, one typeinfo

  /// Number of positions (indices this rank visits).
  virtual std::int64_t size() const = 0;

  /// Dataset index at `position`.
  virtual std::int64_t index_at(std::int64_t position) const = 0;
};

/// Groups a Sampler's positions into micro-batches of dataset indices.
///
/// Modalities types `batch_sampler/default` as a Sampler over index lists;
/// here it is its own interface, since its elements are lists. Built once per
/// run; batch_at is const and safe to call concurrently, with the same cost
/// expectations as Sampler::index_at.
///
/// \code
///   std::vector<std::int64_t> ids = batch_sampler->batch_at(b);  // batch_size indices
///   std::vector<Sample> samples;
///   for (auto i : ids) samples.push_back(dataset->get(i));
/// \endcode
///
/// Ownership: the host owns the instance (std::shared_ptr); it holds a
/// shared_ptr to its Sampler.
/// Errors: b outside [0, size()) throws modalities::Error; never exit().
/// Since: SDK 0.1.
/// ABI: adding, removing or reordering virtuals bumps MODALITIES_PLUGIN_ABI_VERSION.
class MODALITIES_SDK_API BatchSampler {
 public:
  static constexpr std::string_view kInterface = "BatchSampler";
  static constexpr std::string_view kComponentKey = "batch_sampler";

  BatchSampler() = default;
  BatchSampler(const BatchSampler&) = delete;
  BatchSampler& operator=(const BatchSampler&) = delete;
  virtual ~BatchSampler();  // defined in the SDK library: one vtable, one typeinfo

  /// Number of batches (with drop_last: sampler size / batch size, rounded down).
  virtual std::int64_t size() const = 0;

  /// Dataset indices of batch `batch`, in sampler order.
  virtual std::vector<std::int64_t> batch_at(std::int64_t batch) const = 0;
};

}  // namespace modalities
