// src/api/tensor.cpp — TensorView helpers and names of the API's enums.
#include <string>

#include "flashattn/flashattn.h"

namespace flashattn {

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element, no layout to violate
  std::int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               std::initializer_list<std::int64_t> strides, Device device) {
  if (shape.size() != strides.size() || shape.size() == 0 || shape.size() > std::size_t(kMaxDims)) {
    throw Error("TensorView::strided: shape and strides must have the same rank, 1 to " +
                std::to_string(kMaxDims) + "; got " + std::to_string(shape.size()) + " and " +
                std::to_string(strides.size()));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = int(shape.size());
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  i = 0;
  for (std::int64_t s : strides) t.stride[i++] = s;
  return t;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device) {
  if (shape.size() == 0 || shape.size() > std::size_t(kMaxDims)) {
    throw Error("TensorView::contiguous: rank must be 1 to " + std::to_string(kMaxDims) +
                "; got " + std::to_string(shape.size()));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = int(shape.size());
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  std::int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f8e4m3: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::i32: return "i32";
    case DType::f8e4m3: return "f8e4m3";
  }
  return "?";
}

const char* device_name(DeviceType type) {
  return type == DeviceType::cuda ? "cuda" : "cpu";
}

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "auto";
    case Backend::cpu: return "cpu";
    case Backend::cpu_reference: return "cpu_reference";
    case Backend::cuda: return "cuda";
  }
  return "?";
}

std::string shape_string(const TensorView& t) {
  if (!t.defined()) return "(not given)";
  std::string s = "(";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + ")";
}

}  // namespace flashattn
