// The tpu views, served in C++. A view is metadata only: new sizes, strides and offset over the same
// storage, which on tpu holds the jax array, so the result shares it. The Python kernel
// (dispatch/hand_kernels.py, _view_kernel) computed that with torch's own Meta kernels, at the cost of
// a call into Python and back for every transpose, slice, expand or reshape: a third of the ops of a
// small training step in fused mode (89 of 242 per gpt-tiny step) and about 20 per decoded token.
// These are CPU's own kernels (the ones RegisterCPU registers), so a view on tpu behaves as on CPU;
// as_strided checks its bounds here where it can, and in Python where it cannot (see inside()).
//
// Each call is counted here (an atomic add); metrics() folds the counts into its op counts.
#include <ATen/ATen.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_unsafe_view_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <atomic>

namespace tpu {
namespace {

// In the order of view_op_names(), which Python reads the counts by.
enum Op { kAsStrided, kView, kReshapeAlias, kUnsafeView, kUnfold, kOps };
std::array<std::atomic<int64_t>, kOps> counts{};

inline void count(Op op) { counts[op].fetch_add(1, std::memory_order_relaxed); }

// The Python kernel (dispatch/hand_kernels.py): torch's Meta kernel and CPU's bounds check against the
// storage's logical size, which only Python knows (a tpu storage's C++ byte count stays 0 until
// someone asks for it, see storage.give_address). Never freed, as the library below.
py::object* python_as_strided = nullptr;

// Whether a view of these sizes, strides and offset (in self's elements) reaches only elements that
// self's own extent spans: then it lies inside the storage, as self does, and CPU's bounds check
// passes. Every view op (transpose, slice, select, expand, diagonal, unfold, ...) makes such views.
bool inside(const at::Tensor& self, at::IntArrayRef size, at::IntArrayRef stride, int64_t offset) {
  if (size.size() != stride.size() || offset < 0) return false;
  int64_t last = offset;
  bool empty = false;
  for (size_t i = 0; i < size.size(); ++i) {
    if (size[i] < 0 || stride[i] < 0) return false;
    if (size[i] == 0) empty = true;
    last += (size[i] - 1) * stride[i];
  }
  if (empty) return true;  // no elements: CPU accepts any offset
  if (self.numel() == 0) return false;
  const int64_t first_self = self.storage_offset();
  int64_t last_self = first_self;
  for (int64_t d = 0; d < self.dim(); ++d) last_self += (self.size(d) - 1) * self.stride(d);
  return offset >= first_self && last <= last_self;
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  count(kAsStrided);
  const auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  const auto strides = C10_AS_INTARRAYREF_SLOW(stride);
  const int64_t offset =
      storage_offset.has_value() ? storage_offset->guard_int(__FILE__, __LINE__) : self.storage_offset();
  if (inside(self, sizes, strides, offset) || python_as_strided == nullptr) {
    // as_strided_tensorimpl, CPU's kernel, less its check against the storage's byte count (the
    // geometry is checked above)
    auto result = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(self.storage()),
                                                           self.key_set(), self.dtype());
    result.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, std::make_optional(offset));
    return result;
  }
  py::gil_scoped_acquire gil;
  py::object offset_arg = storage_offset.has_value() ? py::object(py::int_(offset)) : py::object(py::none());
  return (*python_as_strided)(self, std::vector<int64_t>(sizes.begin(), sizes.end()),
                              std::vector<int64_t>(strides.begin(), strides.end()), offset_arg)
      .cast<at::Tensor>();
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  count(kView);
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  count(kReshapeAlias);
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unsafe_view(const at::Tensor& self, c10::SymIntArrayRef size) {
  count(kUnsafeView);
  return at::native::_unsafe_view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  count(kUnfold);
  return at::native::unfold(self, dimension, size, step);
}

}  // namespace

// Registers the kernels above for PrivateUse1, once; Python then leaves these ops to them. A library
// made here, not a static TORCH_LIBRARY_IMPL block, so that loading the extension alone changes
// nothing (TORCH_TPU_PYTHON_VIEWS=1 keeps the Python kernels). Never freed: the registrations last
// as long as the process, with no deregistration racing the dispatcher's own teardown at exit.
bool register_views() {
  static torch::Library* lib = nullptr;
  if (lib != nullptr) return false;
  lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  lib->impl("as_strided", TORCH_FN(as_strided));
  lib->impl("view", TORCH_FN(view));
  lib->impl("_reshape_alias", TORCH_FN(reshape_alias));
  lib->impl("_unsafe_view", TORCH_FN(unsafe_view));
  lib->impl("unfold", TORCH_FN(unfold));
  return true;
}

// The Python kernel that as_strided calls for a view it cannot show to lie inside its source.
void set_as_strided_fallback(py::object kernel) {
  if (python_as_strided == nullptr) {
    python_as_strided = new py::object(std::move(kernel));
  } else {
    *python_as_strided = std::move(kernel);
  }
}

std::vector<std::string> view_op_names() {
  return {"aten.as_strided.default", "aten.view.default", "aten._reshape_alias.default",
          "aten._unsafe_view.default", "aten.unfold.default"};
}

// The calls counted since the last take, each counter set back to zero.
std::vector<int64_t> take_view_counts() {
  std::vector<int64_t> out(kOps);
  for (int i = 0; i < kOps; ++i) out[i] = counts[i].exchange(0, std::memory_order_relaxed);
  return out;
}

}  // namespace tpu
