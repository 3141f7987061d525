// torch.accelerator.Graph on tpu. From torch 2.13 the device-generic graph class asks a registry for
// the current accelerator's implementation of at::GraphImplInterface, which PyTorch's Python
// backend hooks cannot provide. The capture and replay themselves are Python's
// (torch_tpu.device.graphs.TPUGraph, torch.tpu.graph's class): the implementation registered here
// holds one TPUGraph and forwards each call to it, so device-generic code and torch.tpu code share
// one capture. Where torch has no such interface (2.11, 2.12) this file registers nothing.
#if __has_include(<ATen/core/GraphImplInterface.h>)
#include <ATen/core/GraphImplInterface.h>
#include <torch/extension.h>

#include <atomic>
#include <string>

namespace {

std::atomic<uint64_t> next_pool{1};

const char* mode_name(at::GraphCaptureMode mode) {
  switch (mode) {
    case at::GraphCaptureMode::ThreadLocal:
      return "thread_local";
    case at::GraphCaptureMode::Relaxed:
      return "relaxed";
    default:
      return "global";
  }
}

struct TPUGraphImpl : public at::GraphImplInterface {
  explicit TPUGraphImpl(const at::GraphImplArgs& args) : pool_{0, next_pool++} {
    py::gil_scoped_acquire gil;
    py::object cls = py::module_::import("torch_tpu.device.graphs").attr("TPUGraph");
    graph_ = new py::object(cls(args.keep_graph));
  }

  ~TPUGraphImpl() override {
    if (Py_IsInitialized() && graph_ != nullptr) {
      py::gil_scoped_acquire gil;
      delete graph_;
    }  // else the interpreter is gone, and the object with it
  }

  void capture_begin(at::MempoolId_t pool, at::GraphCaptureMode capture_mode) override {
    py::gil_scoped_acquire gil;
    if (pool.first != 0 || pool.second != 0) {
      pool_ = pool;  // another graph's token: shared, as CUDA's pools are
    }
    call("capture_begin")(py::make_tuple(pool_.first, pool_.second), mode_name(capture_mode));
  }
  void capture_end() override {
    py::gil_scoped_acquire gil;
    call("capture_end")();
  }
  void instantiate() override {}  // capture_end compiles the graph: nothing is left to instantiate
  void replay() override {
    py::gil_scoped_acquire gil;
    call("replay")();
  }
  void reset() override {
    py::gil_scoped_acquire gil;
    call("reset")();
  }
  at::MempoolId_t pool() const override { return pool_; }
  void enable_debug_mode() override {
    py::gil_scoped_acquire gil;
    call("enable_debug_mode")();
  }
  void debug_dump(const std::string& path) override {
    py::gil_scoped_acquire gil;
    call("debug_dump")(path);
  }

 private:
  py::object call(const char* name) const { return graph_->attr(name); }

  py::object* graph_ = nullptr;  // a pointer, so that the destructor decides when (and whether) it is freed
  at::MempoolId_t pool_;
};

}  // namespace

namespace at {
// the registry's key is c10::DeviceTypeName(PrivateUse1, false): the backend's name, upper case
REGISTER_GRAPH_IMPL(TPU, TPUGraphImpl);
}  // namespace at
#endif
