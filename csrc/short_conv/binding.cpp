// Torch binding of the short convolution: argument checks, output allocation, device and
// stream; the math lives in the torch-free launchers (short_conv/short_conv.h). The ops are
// internal: the public cake:: ops (with their fake kernels and autograd) call them.

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/binding.h"
#include "short_conv/short_conv.h"

namespace cake {
namespace {

void check_float32_or_dtype_of_x(const at::Tensor& t, const at::Tensor& x, const char* op,
                                 const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == x.scalar_type(), op, ": ", name,
              " must be float32 or x's dtype ", x.scalar_type(), ", got ", t.scalar_type());
}

struct ShortConvShape {
  int64_t T, D, N;
  int W;
};

// The checks of the forward's and the backward's arguments (op names the op in messages).
ShortConvShape check_short_conv_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const at::Tensor& cu_seqlens,
                                     const std::optional<at::Tensor>& initial_state) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, D], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kFloat,
              op, ": x must be bfloat16, float16 or float32, got ", x.scalar_type());
  const int64_t T = x.size(0);
  const int64_t D = x.size(1);

  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.size(1) >= 1 &&
                  weight.size(1) <= 4,
              op, ": weight must be [D, W] with D = ", D, " and 1 <= W <= 4, got ",
              weight.sizes());
  check_same_device(weight, x, op, "weight", "x");
  check_float32_or_dtype_of_x(weight, x, op, "weight");
  const int W = static_cast<int>(weight.size(1));

  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == D, op, ": bias must be [D] with D = ", D,
                ", got ", bias->sizes());
    check_same_device(*bias, x, op, "bias", "x");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(), op,
                ": bias must have weight's dtype ", weight.scalar_type(), ", got ",
                bias->scalar_type());
  }

  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              op, ": cu_seqlens must be [N + 1], got ", cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
              op, ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, x, op, "cu_seqlens", "x");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, op, ": ", T, " tokens need at least one document");

  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({N, D, W - 1}),
                op, ": initial_state must be [N, D, W - 1] = [", N, ", ", D, ", ", W - 1,
                "], got ", initial_state->sizes());
    check_same_device(*initial_state, x, op, "initial_state", "x");
    check_float32_or_dtype_of_x(*initial_state, x, op, "initial_state");
  }
  return {T, D, N, W};
}

at::Tensor short_conv_fwd(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, const at::Tensor& cu_seqlens,
                          const std::optional<at::Tensor>& initial_state, bool silu) {
  const auto [T, D, N, W] =
      check_short_conv_args("short_conv_fwd", x, weight, bias, cu_seqlens, initial_state);

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

// (dx, dweight, dbias, dinitial_state) in the dtypes of x, weight, weight (bias has it) and
// initial_state (x's without one), as cake::short_conv_bwd returns them for these dtypes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> short_conv_bwd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& cu_seqlens,
    const std::optional<at::Tensor>& initial_state, bool silu) {
  const auto [T, D, N, W] =
      check_short_conv_args("short_conv_bwd", x, weight, bias, cu_seqlens, initial_state);
  TORCH_CHECK(dy.sizes() == x.sizes(), "short_conv_bwd: dy must be [T, D] = [", T, ", ", D,
              "], got ", dy.sizes());
  check_same_device(dy, x, "short_conv_bwd", "dy", "x");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "short_conv_bwd: dy must have x's dtype ",
              x.scalar_type(), ", got ", dy.scalar_type());

  const c10::cuda::OptionalCUDAGuard device_guard(x.device());
  // dy arrives as an expanded stride-0 tensor from y.sum(); the kernels read dense rows.
  const at::Tensor dy_c = dy.contiguous();
  const at::Tensor x_c = x.contiguous();
  const at::Tensor weight_c = weight.contiguous();
  const at::Tensor cu_c = cu_seqlens.contiguous();
  const at::Tensor bias_c = bias ? bias->contiguous() : at::Tensor();
  const at::Tensor state_c = initial_state ? initial_state->contiguous() : at::Tensor();
  at::Tensor dx = at::empty({T, D}, x.options());
  at::Tensor dweight = at::empty({D, W}, weight.options());
  at::Tensor dbias = at::empty({D}, weight.options());
  at::Tensor dstate = at::empty({N, D, W - 1}, state_c.defined() ? state_c.options() : x.options());
  // Per-tile fp32 sums of dweight and dbias; every element is written before it is read.
  at::Tensor workspace = at::empty({short_conv_bwd_tiles(T), D, W + 1},
                                   x.options().dtype(at::kFloat));

  const cudaError_t err = short_conv_bwd_launch(
      dy_c.data_ptr(), x_c.data_ptr(), weight_c.data_ptr(),
      bias_c.defined() ? bias_c.data_ptr() : nullptr, cu_c.data_ptr(),
      cu_c.scalar_type() == at::kLong, state_c.defined() ? state_c.data_ptr() : nullptr,
      dx.data_ptr(), dweight.data_ptr(), dbias.data_ptr(), dstate.data_ptr(),
      workspace.data_ptr<float>(), T, D, W, N, to_dtype(x.scalar_type()),
      to_dtype(weight.scalar_type()),
      state_c.defined() ? to_dtype(state_c.scalar_type()) : DType::kFloat32,
      to_dtype(dstate.scalar_type()), silu, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "short_conv_bwd: kernel launch failed: ",
              cudaGetErrorString(err));
  return {dx, dweight, dbias, dstate};
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY_FRAGMENT(cake_cuda, m) {
  m.def(
      "short_conv_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, "
      "Tensor? initial_state, bool silu) -> Tensor");
  m.def(
      "short_conv_bwd(Tensor dy, Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, "
      "Tensor? initial_state, bool silu) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cake_cuda, CUDA, m) {
  m.impl("short_conv_fwd", &cake::short_conv_fwd);
  m.impl("short_conv_bwd", &cake::short_conv_bwd);
}
