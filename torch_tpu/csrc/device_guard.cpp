// The tpu device guard, answered in C++. torch's Python backend registration installs a guard whose
// every operation (current device, exchange, stream queries) first asks a Python method for the
// device type; the autograd engine and tensor factories run such operations over a thousand times
// per small training step, each a call from C++ into Python. This guard gives the same answers
// without Python: one device as far as guards go (index 0, which is where the Python guard put
// every tensor), its one default stream, and events and stream queries with nothing to wait for
// (XLA orders a device's work itself; torch.tpu.synchronize() waits for it).
//
// With no Python call inside a guard, an exception raised in a backward node also unwinds through
// the engine as itself, where the Python guard could only find it pending (see _Guard.type_).
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

namespace tpu {
namespace {

constexpr c10::DeviceType kTPU = c10::DeviceType::PrivateUse1;

c10::Device the_device() { return c10::Device(kTPU, 0); }
c10::Stream the_stream() { return c10::Stream(c10::Stream::DEFAULT, the_device()); }

struct Guard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTPU; }
  c10::Device exchangeDevice(c10::Device) const override { return the_device(); }
  c10::Device getDevice() const override { return the_device(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return the_stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return the_stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return the_stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

}  // namespace

// Replaces the Python guard torch registered for PrivateUse1 (the registry keeps one per device
// type; the Python one stays alive, as torch holds a reference to it). Returns true once done.
bool register_device_guard() {
  static Guard guard;
  c10::impl::registerDeviceGuard(kTPU, &guard);
  return true;
}

}  // namespace tpu
