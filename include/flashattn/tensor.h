// flashattn/tensor.h — non-owning tensor views and the small vocabulary types of the API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace flashattn {

// f8e4m3: float8 e4m3 ("e4m3fn": 4 exponent bits of bias 7, 3 mantissa bits, no infinity, NaN
// 0x7f / 0xff, largest finite 448): FP8 inputs of the forward and the KV-cache call
// (ForwardInputs::q_descale, docs/fp8.md).
enum class DType : std::uint8_t { f16, bf16, f32, i32, f8e4m3 };

enum class DeviceType : std::uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  friend bool operator==(Device a, Device b) { return a.type == b.type && a.index == b.index; }
  friend bool operator!=(Device a, Device b) { return !(a == b); }
};

// A CUDA stream (cudaStream_t) or nullptr for the default stream; ignored by the CPU backend.
struct Stream {
  void* handle = nullptr;
};

// Scratch memory that the caller owns and the library may use for the duration of one call.
// Ask the *_workspace_size functions how many bytes a call needs, or set `grow`: a call whose
// need exceeds `bytes` (or that has no `data`) then asks grow(grow_context, need) once, after its
// arguments are validated and before anything is written (a call refused after it — a workspace
// grow gave too little, an index error of an earlier CUDA call — writes nothing either), and uses
// the workspace it returns
// (at least `need` bytes, 256-byte aligned, valid until the call's work on its stream is done;
// its own grow is ignored). The need is the call's own, for the kernels it chose, counted once;
// a call that needs nothing, or no more than `bytes`, never asks, and an exception that grow
// throws leaves the call with nothing written.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
  Workspace (*grow)(void* grow_context, std::size_t need) = nullptr;
  void* grow_context = nullptr;
};

inline constexpr int kMaxDims = 5;

// A view of memory the caller owns: pointer, element type, shape and strides (in elements).
// A default-constructed view (ndim == 0) means "not given" for optional arguments.
// A view with a zero-sized dimension may have data == nullptr.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t stride[kMaxDims] = {};
  Device device = {};

  bool defined() const { return ndim > 0; }
  std::int64_t numel() const;
  bool is_contiguous() const;

  // A view with the given shape and strides.
  static TensorView strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> strides, Device device = {});
  // A row-major (C-contiguous) view of the given shape.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = {});
};

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* device_name(DeviceType type);
// "(2, 128, 16, 64)"
std::string shape_string(const TensorView& t);

}  // namespace flashattn
