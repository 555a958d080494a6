// Torch binding of the short convolution: argument checks, output allocation, device and
// stream; the math lives in the torch-free launcher (short_conv/short_conv.h). The op is
// internal: the public cake:: op (with its fake kernel and autograd) calls it.

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/binding.h"
#include "short_conv/short_conv.h"

namespace cake {
namespace {

void check_float32_or_dtype_of_x(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == x.scalar_type(),
              "short_conv_fwd: ", name, " must be float32 or x's dtype ", x.scalar_type(),
              ", got ", t.scalar_type());
}

at::Tensor short_conv_fwd(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const at::Tensor& cu_seqlens,
                          const std::optional<at::Tensor>& initial_state, bool silu) {
  TORCH_CHECK(x.is_cuda(), "short_conv_fwd: x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "short_conv_fwd: x must be [T, D], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kFloat,
              "short_conv_fwd: x must be bfloat16, float16 or float32, got ", x.scalar_type());
  const int64_t T = x.size(0);
  const int64_t D = x.size(1);

  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) >= 1 &&
                  weight.size(1) <= 4,
              "short_conv_fwd: weight must be [D, W] with D = ", D, " and 1 <= W <= 4, got ",
              weight.sizes());
  check_same_device(weight, x, "short_conv_fwd", "weight", "x");
  check_float32_or_dtype_of_x(weight, x, "weight");
  const int W = static_cast<int>(weight.size(1));

  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == D, "short_conv_fwd: bias must be [D] with D = ",
                D, ", got ", bias->sizes());
    check_same_device(*bias, x, "short_conv_fwd", "bias", "x");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(),
                "short_conv_fwd: bias must have weight's dtype ", weight.scalar_type(), ", got ",
                bias->scalar_type());
  }

  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "short_conv_fwd: cu_seqlens must be [N + 1], got ", cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
              "short_conv_fwd: cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, x, "short_conv_fwd", "cu_seqlens", "x");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, "short_conv_fwd: ", T, " tokens need at least one document");

  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({N, D, W - 1}),
                "short_conv_fwd: initial_state must be [N, D, W - 1] = [", N, ", ", D, ", ", W - 1,
                "], got ", initial_state->sizes());
    check_same_device(*initial_state, x, "short_conv_fwd", "initial_state", "x");
    check_float32_or_dtype_of_x(*initial_state, x, "initial_state");
  }

  const c10::cuda::OptionalCUDAGuard device_guard(x.device());
  // Gradients arrive as expanded stride-0 tensors; the kernel reads dense rows.
  const at::Tensor x_c = x.contiguous();
  const at::Tensor weight_c = weight.contiguous();
  const at::Tensor cu_c = cu_seqlens.contiguous();
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  const at::Tensor state_c = initial_state ? initial_state->contiguous() : at::Tensor();
  at::Tensor y = at::empty({T, D}, x.options());

  const cudaError_t err = short_conv_fwd_launch(
      x_c.data_ptr(), weight_c.data_ptr(), bias_c.defined() ? bias_c.data_ptr() : nullptr,
      cu_c.data_ptr(), cu_c.scalar_type() == at::kLong,
      state_c.defined() ? state_c.data_ptr() : nullptr, y.data_ptr(), T, D, W, N,
      to_dtype(x.scalar_type()), to_dtype(weight.scalar_type()),
      state_c.defined() ? to_dtype(state_c.scalar_type()) : DType::kFloat32, silu,
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "short_conv_fwd: kernel launch failed: ",
              cudaGetErrorString(err));
  return y;
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY_FRAGMENT(cake_cuda, m) {
  m.def(
      "short_conv_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, "
      "Tensor? initial_state, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(cake_cuda, CUDA, m) { m.impl("short_conv_fwd", &cake::short_conv_fwd); }
