// Counts the bytes of live CPU tensors, for tests and benchmarks that measure activation memory:
// every CPU allocation of ATen goes through the allocator c10::GetCPUAllocator returns, so a
// step's activation memory is its peak minus what was live before it (exact, unlike RSS, which
// the system allocator's free lists blur). Install it with
//   static CountingAllocator counting(c10::GetDefaultCPUAllocator());
//   c10::SetCPUAllocator(&counting, /*priority=*/100);
// and put the default back with a higher priority when done. Tensors allocated before keep their
// own deleters.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace modalities::testing {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* held = new Held{std::move(inner), n, this};
    const std::int64_t now = live_.fetch_add(static_cast<std::int64_t>(n)) + static_cast<std::int64_t>(n);
    std::int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, held, &CountingAllocator::release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  /// Bytes of live allocations now, and at most since the last reset_peak().
  std::int64_t live() const { return live_.load(); }
  std::int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Held {
    c10::DataPtr inner;
    std::size_t n;
    CountingAllocator* owner;
  };
  static void release(void* p) {
    auto* held = static_cast<Held*>(p);
    held->owner->live_.fetch_sub(static_cast<std::int64_t>(held->n));
    delete held;
  }
  c10::Allocator* base_;
  std::atomic<std::int64_t> live_{0}, peak_{0};
};

}  // namespace modalities::testing
