#pragma once

// Torch-side helpers shared by the bindings (gdn/binding.cpp, short_conv/binding.cpp): the
// only common header that includes torch. Kernel files never include it: tensors cross
// into the launchers as raw pointers plus DType tags (dtype.h).

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "common/dtype.h"

namespace cake {

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "cake_cuda: unsupported dtype ", t);
  }
}

// t on the device of `like` (the op's first tensor argument, named like_name).
inline void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name,
                              const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), " like ", like_name,
              ", got ", t.device());
}

// Dense and 16-byte aligned (the kernels read 16-byte vectors); copies only if needed.
inline at::Tensor dense16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

}  // namespace cake
