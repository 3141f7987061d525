// The cache key of a list of tpu tensors, in C++: a foreach op's argument (AdamW's parameters,
// gradients and moments: 383 tensors in 15 lists per fused gpt-tiny step). The op path
// (dispatch/op_kernel.py, _key_of) reads each tensor's storage there, its array, dtype and shape,
// checks that the tensor covers the whole storage, and keys it by (shape, dtype): about a
// microsecond per tensor in Python, most of a foreach op's host time.
//
// key_of_tensors answers for lists of plain tpu tensors whose storages hold an array of their dtype
// (a placeholder still pending only while recording): (shape, dtype) for a tensor over its whole
// storage, (shape, dtype, storage shape, strides, offset) for a view, as _key_of keys them; None for
// anything else (a CPU tensor, a capture in progress), where the Python loop keys the list as
// before. The keys are equal to the Python loop's (tuples compare and hash as tuples whatever
// their type).
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace tpu {
namespace {

// Set once by set_key_types (dispatch/op_kernel.py): torch.Tensor, torch.nn.Parameter, the fused
// trace's placeholder type, and the storage attribute names.
PyTypeObject* tensor_type = nullptr;
PyTypeObject* parameter_type = nullptr;
PyTypeObject* lazy_type = nullptr;
PyObject* s_jx = nullptr;
PyObject* s_dtype = nullptr;
PyObject* s_shape = nullptr;
PyObject* s_value = nullptr;

// A new reference to attribute `name` of `o`, or null (no error left set) where it has none.
PyObject* attr(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

bool same_sizes(PyObject* shape, c10::IntArrayRef sizes) {
  if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(sizes.size())) return false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyObject* d = PyTuple_GET_ITEM(shape, i);
    if (!PyLong_Check(d)) return false;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(d, &overflow);
    if (overflow != 0 || v != sizes[i]) return false;
  }
  return true;
}

}  // namespace

void set_key_types(py::object tensor, py::object parameter, py::object lazy) {
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor.release().ptr());
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter.release().ptr());
  lazy_type = reinterpret_cast<PyTypeObject*>(lazy.release().ptr());
  s_jx = PyUnicode_InternFromString("_jx");
  s_dtype = PyUnicode_InternFromString("_dtype");
  s_shape = PyUnicode_InternFromString("_shape");
  s_value = PyUnicode_InternFromString("value");
}

// (keys, arrays) for `xs`, or None where a tensor is not the common case. `recording`: a pending
// placeholder is an input (fused mode, or a trace being recorded); else the Python path runs it.
py::object key_of_tensors(py::list xs, bool recording) {
  if (lazy_type == nullptr) return py::none();
  PyObject* list = xs.ptr();
  Py_ssize_t n = PyList_GET_SIZE(list);
  py::tuple keys(n);
  py::list arrays(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyList_GET_ITEM(list, i);
    PyTypeObject* type = Py_TYPE(x);
    if (type != tensor_type && type != parameter_type) return py::none();
    const at::Tensor& t = THPVariable_Unpack(x);
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || !t.has_storage()) return py::none();
    py::object storage = py::reinterpret_steal<py::object>(torch::createPyObject(t.storage()));
    if (!storage) {
      PyErr_Clear();
      return py::none();
    }
    py::object value = py::reinterpret_steal<py::object>(attr(storage.ptr(), s_jx));
    py::object dtype = py::reinterpret_steal<py::object>(attr(storage.ptr(), s_dtype));
    if (!value || value.is_none() || !dtype ||
        dtype.ptr() != reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()))) {
      return py::none();
    }
    if (Py_TYPE(value.ptr()) == lazy_type) {
      py::object computed = py::reinterpret_steal<py::object>(attr(value.ptr(), s_value));
      if (!computed) return py::none();
      if (!computed.is_none()) {
        // computed by an earlier trace: the storage drops the placeholder, as the Python path does
        if (PyObject_SetAttr(storage.ptr(), s_jx, computed.ptr()) != 0) {
          PyErr_Clear();
          return py::none();
        }
        value = computed;
      } else if (!recording) {
        return py::none();
      }
    }
    py::object shape = py::reinterpret_steal<py::object>(attr(storage.ptr(), s_shape));
    if (!shape || !PyTuple_Check(shape.ptr())) return py::none();
    int64_t offset = t.storage_offset();
    if (offset == 0 && same_sizes(shape.ptr(), t.sizes()) && t.is_contiguous()) {
      keys[i] = py::make_tuple(shape, dtype);  // the whole storage
    } else {  // a view of it: where it lies in the storage is part of the key
      keys[i] = py::make_tuple(py::tuple(py::cast(t.sizes().vec())), dtype, shape, py::tuple(py::cast(t.strides().vec())),
                               offset);
    }
    arrays[i] = value;
  }
  return py::make_tuple(keys, arrays);
}

}  // namespace tpu
