// torch.Generator(device="tpu"): the one thing this extension adds. PyTorch's Python backend hooks
// (torch._C._acc) cannot make a generator for PrivateUse1; torch asks the factory registered here.
// The generator holds a seed and an offset; torch_tpu's random ops read both (initial_seed,
// get_offset) and advance the offset, drawing the numbers on the device (torch_tpu/core/rng.py).
#include <ATen/core/Generator.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <cstring>
#include <random>
#include <typeinfo>

namespace {

constexpr uint64_t kDefaultSeed = 67280421310721ULL;  // CPU's default seed

struct TPUGeneratorImpl : public c10::GeneratorImpl {
  explicit TPUGeneratorImpl(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index < 0 ? 0 : index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    std::random_device rd;
    uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    set_current_seed(s);
    return s;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }

  // The state: seed then offset, 8 bytes each, as a CPU uint8 tensor (like get_rng_state).
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::empty({16}, at::TensorOptions().dtype(at::kByte).device(at::kCPU));
    uint64_t words[2] = {seed_, offset_};
    std::memcpy(state.data_ptr(), words, sizeof(words));
    return state.getIntrusivePtr();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    TORCH_CHECK(new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && new_state.numel() == 16,
                "torch.Generator(device='tpu').set_state: expected a uint8 tensor of 16 bytes (seed, offset), got ",
                new_state.numel(), " elements of ", new_state.dtype().name());
    TORCH_CHECK(new_state.device().is_cpu(), "torch.Generator(device='tpu').set_state: the state is a CPU tensor");
    uint64_t words[2];
    std::memcpy(words, new_state.data(), sizeof(words));
    seed_ = words[0];
    offset_ = words[1];
  }

  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

 private:
  TPUGeneratorImpl* clone_impl() const override {
    auto copy = new TPUGeneratorImpl(device().index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }

  uint64_t seed_ = kDefaultSeed;
  uint64_t offset_ = 0;
};

// torch calls this factory from GetGeneratorForPrivateuse1(), which first warns that it is deprecated
// (at every generator made). Called from Python, the warning sits in the buffer of the handler that
// torch's binding installed for the call (PyWarningHandler), to become a Python DeprecationWarning
// when the call returns: a test suite run with warnings as errors could not make a tpu generator.
// The notice is about the registration route, which is the only one torch's Python hooks leave
// (see below), so it is taken out of that buffer here. The handler is recognised by its type's
// mangled name, so nothing is touched under any other handler (a C++ caller, another ABI).
void drop_torchs_deprecation_notice() {
  c10::WarningHandler* handler = c10::WarningUtils::get_warning_handler();
  // the Itanium ABI's name of torch::PyWarningHandler::InternalHandler (its type_info is not exported)
  constexpr const char* kPyHandler = "N5torch16PyWarningHandler15InternalHandlerE";
  if (handler == nullptr || std::strcmp(typeid(*handler).name(), kPyHandler) != 0) {
    return;
  }
  auto& buffer = static_cast<torch::PyWarningHandler::InternalHandler*>(handler)->warning_buffer_;
  if (!buffer.empty() && buffer.back().msg().rfind("GetGeneratorForPrivateuse1() is deprecated", 0) == 0) {
    buffer.pop_back();
  }
}

at::Generator make_tpu_generator(c10::DeviceIndex index) {
  drop_torchs_deprecation_notice();
  return at::make_generator<TPUGeneratorImpl>(index);
}

// torch calls the registration deprecated in favour of a C++ hooks interface, but the hooks are
// PyTorch's Python ones (torch._C._acc, registered when torch imports), which may be registered
// only once and defer getNewGenerator to this registration. Its warning would only confuse users.
struct Quiet : public c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

bool register_generator() {
  static Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  static at::_GeneratorRegister registration(make_tpu_generator);
  return true;
}

}  // namespace

namespace tpu {
bool register_device_guard();  // csrc/device_guard.cpp
bool register_views();  // csrc/views.cpp
std::vector<std::string> view_op_names();
std::vector<int64_t> take_view_counts();
void set_as_strided_fallback(py::object kernel);
void set_key_types(py::object tensor, py::object parameter, py::object lazy);  // csrc/keys.cpp
py::object key_of_tensors(py::list xs, bool recording);
}  // namespace tpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_tpu's C++ extension: torch.Generator(device='tpu'), nested tensors' kernels, views, keys";
  m.def("register_generator", &register_generator, "Lets torch.Generator(device='tpu') be made (once).");
  m.def("register_device_guard", &tpu::register_device_guard,
        "Answers tpu device guards in C++ instead of asking Python at each one.");
  m.def("register_views", &tpu::register_views, "Serves tpu views (as_strided, view, ...) in C++ (once).");
  m.def("set_as_strided_fallback", &tpu::set_as_strided_fallback,
        "The Python as_strided for views not shown to lie inside their source (bounds checked there).");
  m.def("view_op_names", &tpu::view_op_names, "The overloads register_views serves, in take_view_counts' order.");
  m.def("take_view_counts", &tpu::take_view_counts, "The C++ views' calls since the last take (then zeroed).");
  m.def("set_key_types", &tpu::set_key_types, "torch.Tensor, nn.Parameter and the trace's placeholder type.");
  m.def("key_of_tensors", &tpu::key_of_tensors,
        "(keys, arrays) of a list of tpu tensors over whole storages, or None: op_kernel._key_of's list case.");
}
