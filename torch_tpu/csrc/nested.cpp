// Nested tensors on tpu: the kernels that only read a NestedTensorImpl's metadata or hand its buffer
// to dense ops. torch registers its nested-tensor kernels for NestedTensorCPU and NestedTensorCUDA
// (and HPU), so a nested tpu tensor (a NestedTensorImpl over a dense tpu buffer, which
// torch.nested.nested_tensor(..., device="tpu") makes) could not even be asked its sizes or copied
// to CPU. The at::native functions below are device-generic: their arithmetic is dense ops on the
// buffer, which reach torch_tpu's own PrivateUse1 kernels, so they serve tpu as they are. Python
// cannot reach a NestedTensorImpl's buffer, hence C++. Every other op on a nested tpu tensor goes
// through the CPU fallback (torch_tpu/dispatch/nested.py).
#include <ATen/NestedTensorImpl.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/ops/_nested_tensor_size_native.h>
#include <ATen/ops/_nested_tensor_storage_offsets_native.h>
#include <ATen/ops/_nested_tensor_strides_native.h>
#include <ATen/ops/_nested_view_from_buffer_native.h>
#include <ATen/ops/_to_copy.h>
#include <ATen/ops/_to_copy_native.h>
#include <ATen/ops/alias_native.h>
#include <ATen/ops/chunk_native.h>
#include <ATen/ops/clone_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/detach_native.h>
#include <ATen/ops/empty_like_native.h>
#include <ATen/ops/is_same_size_native.h>
#include <ATen/ops/narrow_native.h>
#include <ATen/ops/select_native.h>
#include <ATen/ops/split_with_sizes_native.h>
#include <ATen/ops/squeeze_native.h>
#include <ATen/ops/transpose_native.h>
#include <ATen/ops/unbind_native.h>
#include <ATen/ops/unsqueeze_native.h>
#include <ATen/ops/values_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <algorithm>

namespace {

// A tpu storage is not told its size when an op makes it (torch_tpu/tensor/storage_api.py: that would cost
// every op a call), but NestedTensorImpl takes its buffer's length from the storage's byte count. So
// before torch's kernels read the buffer, the count is brought up to what the components span
// (their offsets, sizes and strides), as _storage_api.sync_nbytes does for the storage API. The
// bytes themselves are the tpu array's; nothing is allocated.
void fit_storage(const at::Tensor& t) {
  if (!t.is_nested() || t.device().type() != c10::DeviceType::PrivateUse1) return;
  auto* impl = at::native::get_nested_tensor_impl(t);
  const at::Tensor sizes = impl->get_nested_sizes().contiguous();
  const at::Tensor strides = impl->get_nested_strides().contiguous();
  const at::Tensor offsets = impl->get_storage_offsets().contiguous();
  const int64_t n = offsets.numel();
  const int64_t dim = sizes.dim() == 2 ? sizes.size(1) : 0;
  const int64_t* sz = sizes.const_data_ptr<int64_t>();
  const int64_t* st = strides.const_data_ptr<int64_t>();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  int64_t need = 0;  // elements
  for (int64_t i = 0; i < n; ++i) {
    int64_t end = off[i] + 1;
    bool empty = false;
    for (int64_t d = 0; d < dim; ++d) {
      if (sz[i * dim + d] == 0) empty = true;
      end += (sz[i * dim + d] - 1) * st[i * dim + d];
    }
    if (!empty) need = std::max(need, end);
  }
  const auto bytes = static_cast<size_t>(need) * t.dtype().itemsize();
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() < bytes) storage->set_nbytes(bytes);
}

// A dense tpu tensor's storage told the bytes it spans (its offset, sizes and strides).
void fit_dense(const at::Tensor& t) {
  if (t.device().type() != c10::DeviceType::PrivateUse1 || t.is_nested()) return;
  int64_t end = t.storage_offset();
  bool empty = false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) empty = true;
    end += (t.size(d) - 1) * t.stride(d);
  }
  const auto bytes = empty ? 0 : static_cast<size_t>(end + 1) * t.dtype().itemsize();
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() < bytes) storage->set_nbytes(bytes);
}

// A copy to another dtype or device: the buffer is copied by the dense ops (torch_tpu's kernels for
// a tpu buffer, CPU's for a CPU one) and keeps the components' sizes, strides and offsets. torch's
// _to_copy_nested makes the new buffer with a dense empty_like and reads its length back from the
// storage's byte count, which a new tpu storage does not carry (see fit_storage).
at::Tensor fitted_to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                          std::optional<at::Device> device, std::optional<bool> pin_memory, bool non_blocking,
                          std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == self.layout(),
              "to(options) doesn't support converting to a different layout, but got self.layout being ",
              self.layout(), " and options.layout set as ", *layout);
  TORCH_CHECK(!memory_format.has_value() || *memory_format == at::MemoryFormat::Preserve,
              "memory format option is only supported by strided tensors");
  fit_storage(self);
  auto* impl = at::native::get_nested_tensor_impl(self);
  at::Tensor buffer = at::_to_copy(impl->get_unsafe_storage_as_tensor(), dtype, std::nullopt, device, pin_memory,
                                   non_blocking, std::nullopt);
  fit_dense(buffer);
  at::Tensor result = at::detail::make_tensor<at::native::NestedTensorImpl>(
      buffer, impl->get_nested_sizes().clone(), impl->get_nested_strides().clone(), impl->get_storage_offsets().clone());
  fit_storage(result);
  return result;
}

std::vector<at::Tensor> fitted_unbind(const at::Tensor& self, int64_t dim) {
  fit_storage(self);
  return at::native::NestedTensor_unbind(self, dim);
}

at::Tensor fitted_clone(const at::Tensor& self, std::optional<at::MemoryFormat> memory_format) {
  fit_storage(self);
  return at::native::clone_nested(self, memory_format);
}

at::Tensor& fitted_copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  fit_storage(self);
  fit_storage(src);
  return at::native::copy_nested_(self, src, non_blocking);
}

at::Tensor fitted_values(const at::Tensor& self) {
  fit_storage(self);
  return at::native::values_nested(self);
}

// A nested tpu tensor over a dense tpu buffer (how the CPU fallback brings nested results back).
at::Tensor fitted_view_from_buffer(const at::Tensor& buffer, const at::Tensor& sizes, const at::Tensor& strides,
                                   const at::Tensor& offsets) {
  fit_dense(buffer);
  at::Tensor result = at::native::_nested_view_from_buffer(buffer, sizes, strides, offsets);
  fit_storage(result);
  return result;
}

// Views: a new NestedTensorImpl over the same storage, its components' metadata changed.
at::Tensor fitted_unsqueeze(const at::Tensor& self, int64_t dim) {
  fit_storage(self);
  return at::native::unsqueeze_nested(self, dim);
}

at::Tensor fitted_transpose(const at::Tensor& self, int64_t dim0, int64_t dim1) {
  fit_storage(self);
  return at::native::transpose_nested(self, dim0, dim1);
}

at::Tensor fitted_select(const at::Tensor& self, int64_t dim, int64_t index) {
  fit_storage(self);
  return at::native::select_nested(self, dim, index);
}

at::Tensor fitted_view(const at::Tensor& self, at::IntArrayRef size) {
  fit_storage(self);
  return at::native::view_nested(self, size);
}

at::Tensor fitted_squeeze(const at::Tensor& self) {
  fit_storage(self);
  return at::native::squeeze_nested(self);
}

at::Tensor fitted_squeeze_dim(const at::Tensor& self, int64_t dim) {
  fit_storage(self);
  return at::native::squeeze_dim_nested(self, dim);
}

at::Tensor fitted_squeeze_dims(const at::Tensor& self, at::IntArrayRef dims) {
  fit_storage(self);
  return at::native::squeeze_dim_nested(self, dims);
}

at::Tensor fitted_narrow(const at::Tensor& self, int64_t dim, c10::SymInt start, c10::SymInt length) {
  fit_storage(self);
  return at::native::narrow_nested_symint(self, dim, std::move(start), std::move(length));
}

std::vector<at::Tensor> fitted_chunk(const at::Tensor& self, int64_t chunks, int64_t dim) {
  fit_storage(self);
  return at::native::chunk_nested_tensor(self, chunks, dim);
}

std::vector<at::Tensor> fitted_split_with_sizes(const at::Tensor& self, at::IntArrayRef split_sizes, int64_t dim) {
  fit_storage(self);
  return at::native::split_with_sizes_nested(self, split_sizes, dim);
}

// split by a size, as chunk and split_with_sizes split (the dimension regular across components);
// torch's newer chunk reaches it through its composite kernel.
std::vector<at::Tensor> fitted_split(const at::Tensor& self, int64_t split_size, int64_t dim) {
  fit_storage(self);
  dim = at::maybe_wrap_dim(dim, self.dim());
  const auto size = at::native::get_nested_tensor_impl(self)->opt_size(dim);
  TORCH_CHECK(dim > 0 && size.has_value(), "split(): a nested tensor splits only along a regular dimension "
              "other than 0, but got dim ", dim);
  TORCH_CHECK(split_size > 0 || *size == 0, "split(): split_size must be positive, but got ", split_size);
  std::vector<int64_t> sizes;
  for (int64_t at = 0; at < *size; at += split_size) sizes.push_back(std::min(split_size, *size - at));
  return at::native::split_with_sizes_nested(self, sizes, dim);
}

at::Tensor fitted_detach(const at::Tensor& self) { return at::native::detach(self); }

}  // namespace

TORCH_LIBRARY_IMPL(aten, NestedTensorPrivateUse1, m) {
  m.impl("_to_copy", TORCH_FN(fitted_to_copy));
  m.impl("unbind.int", TORCH_FN(fitted_unbind));
  m.impl("clone", TORCH_FN(fitted_clone));
  m.impl("copy_", TORCH_FN(fitted_copy_));
  m.impl("empty_like", TORCH_FN(at::native::empty_like_nested));
  m.impl("alias", TORCH_FN(at::native::alias_nested));
  m.impl("detach", TORCH_FN(fitted_detach));
  m.impl("values", TORCH_FN(fitted_values));
  m.impl("unsqueeze", TORCH_FN(fitted_unsqueeze));
  m.impl("transpose.int", TORCH_FN(fitted_transpose));
  m.impl("select.int", TORCH_FN(fitted_select));
  m.impl("view", TORCH_FN(fitted_view));
  m.impl("squeeze", TORCH_FN(fitted_squeeze));
  m.impl("squeeze.dim", TORCH_FN(fitted_squeeze_dim));
  m.impl("squeeze.dims", TORCH_FN(fitted_squeeze_dims));
  m.impl("narrow", TORCH_FN(fitted_narrow));
  m.impl("chunk", TORCH_FN(fitted_chunk));
  m.impl("split_with_sizes", TORCH_FN(fitted_split_with_sizes));
  m.impl("split.Tensor", TORCH_FN(fitted_split));
  m.impl("is_same_size", TORCH_FN(at::native::nested_is_same_size));
  m.impl("_nested_tensor_size", TORCH_FN(at::native::_nested_tensor_size));
  m.impl("_nested_tensor_strides", TORCH_FN(at::native::_nested_tensor_strides));
  m.impl("_nested_tensor_storage_offsets", TORCH_FN(at::native::_nested_tensor_storage_offsets));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_nested_view_from_buffer", TORCH_FN(fitted_view_from_buffer));
}
