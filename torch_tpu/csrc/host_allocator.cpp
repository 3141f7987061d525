// The tpu device's host allocator: ordinary CPU memory. torch asks the current accelerator's host
// ("pinned") allocator for torch.accelerator.empty_host_cache() and its host memory statistics, and
// with none registered for PrivateUse1 torch 2.13 dereferences a null pointer (a segfault once a
// tpu tensor exists). XLA copies host buffers when they move, so page-locked memory buys nothing
// here: this allocator hands out CPU memory, caches none (empty_host_cache frees nothing) and keeps
// no statistics. pin_memory() itself is served in Python (_torch_tpu_autoload._register_pinning).
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <cstring>

namespace {

struct TPUHostAllocator final : public at::HostAllocator {
  at::DataPtr allocate(size_t size) override { return c10::GetCPUAllocator()->allocate(size); }
  at::DeleterFnPtr raw_deleter() const override { return c10::GetCPUAllocator()->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override { return false; }  // nothing is reused
  void empty_cache() override {}
  at::HostStats get_stats() override { return at::HostStats(); }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

TPUHostAllocator host_allocator;

struct Register {
  Register() { at::setHostAllocator(c10::DeviceType::PrivateUse1, &host_allocator); }
} register_host_allocator;

}  // namespace
