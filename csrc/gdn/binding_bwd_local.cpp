// Torch binding of the GDN backward's chunk-local gradients (gdn/bwd_local.h), on its own
// until it joins gdn/binding.cpp: argument checks, outputs, device and stream. Internal op:
// the tapes come from the backward's walks (or, in tests, from cake_ops/pytorch/gdn.py).

#include <cmath>
#include <cstdint>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/binding.h"
#include "gdn/bwd_local.h"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

constexpr const char* kOp = "gdn_bwd_local";

void check_tensor(const at::Tensor& t, const at::Tensor& like, const char* name, at::IntArrayRef shape,
                  at::ScalarType dtype, const char* shape_text) {
  TORCH_CHECK(t.sizes() == shape, kOp, ": ", name, " must be ", shape_text, " = ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, kOp, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  check_same_device(t, like, kOp, name, "q");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_bwd_local(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& gcum, const at::Tensor& A, const at::Tensor& h,
    const at::Tensor& v_new, const at::Tensor& dS, const at::Tensor& dv_new, const at::Tensor& chunk_offsets,
    const at::Tensor& cu_seqlens, double scale, bool use_qk_l2norm) {
  constexpr int64_t C = kGdnChunk, D = kGdnHeadDim;
  TORCH_CHECK(q.is_cuda(), kOp, ": q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && q.size(1) >= 1, kOp,
              ": q must be [T, H, 128] (K = 128), got ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, kOp, ": q must be bfloat16, got ", q.scalar_type());
  check_tensor(k, q, "k", q.sizes(), at::kBFloat16, "[T, H, 128] like q");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == T && v.size(2) == D, kOp, ": v must be [T, HV, 128] (V = 128), got ",
              v.sizes());
  const int64_t HV = v.size(1);
  TORCH_CHECK(HV >= 1 && HV % H == 0, kOp, ": v: the value heads HV = ", HV,
              " must be a positive multiple of q's heads H = ", H);
  TORCH_CHECK(HV < (1 << 24), kOp, ": v: HV = ", HV, " must be below 2^24");
  check_tensor(v, q, "v", {T, HV, D}, at::kBFloat16, "[T, HV, 128]");
  check_tensor(dout, q, "do", {T, HV, D}, at::kBFloat16, "[T, HV, 128] like v");
  check_tensor(g, q, "g", {T, HV}, at::kFloat, "[T, HV]");
  TORCH_CHECK(beta.sizes() == at::IntArrayRef({T, HV}), kOp, ": beta must be [T, HV] = [", T, ", ", HV, "], got ",
              beta.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat || beta.scalar_type() == at::kBFloat16, kOp,
              ": beta must be float32 or bfloat16, got ", beta.scalar_type());
  check_same_device(beta, q, kOp, "beta", "q");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, kOp, ": cu_seqlens must be [N + 1], got ",
              cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, kOp,
              ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, q, kOp, "cu_seqlens", "q");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, kOp, ": cu_seqlens: ", T, " tokens need at least one document");
  const int64_t NC = gdn_fwd_chunk_slots(T, N);
  TORCH_CHECK(T < (int64_t{1} << 31) - C && NC * HV < (int64_t{1} << 31) && NC * H < (int64_t{1} << 31), kOp,
              ": T = ", T, ", N = ", N, ", HV = ", HV, " exceed the kernel's 32-bit grid");
  check_tensor(chunk_offsets, q, "chunk_offsets", {N + 1}, at::kInt, "[N + 1] int32");
  check_tensor(gcum, q, "gcum", {NC, HV, C}, at::kFloat, "[NC, HV, 64] with NC = ceil(T / 64) + N");
  check_tensor(A, q, "A", {NC, HV, C, C}, at::kBFloat16, "[NC, HV, 64, 64] with NC = ceil(T / 64) + N");
  check_tensor(h, q, "h", {NC, HV, D, D}, at::kBFloat16, "[NC, HV, 128 (V), 128 (K)] (S^T)");
  check_tensor(v_new, q, "v_new", {NC, HV, C, D}, at::kBFloat16, "[NC, HV, 64, 128]");
  check_tensor(dS, q, "dS", {NC, HV, D, D}, at::kBFloat16, "[NC, HV, 128 (V), 128 (K)] (dS^T)");
  check_tensor(dv_new, q, "dv_new", {NC, HV, C, D}, at::kBFloat16, "[NC, HV, 64, 128]");
  TORCH_CHECK(std::isfinite(scale) && scale > 0, kOp, ": scale must be finite and > 0, got ", scale);

  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const at::Tensor q_ = dense16(q), k_ = dense16(k), v_ = dense16(v), do_ = dense16(dout), A_ = dense16(A),
                   h_ = dense16(h), vn_ = dense16(v_new), ds_ = dense16(dS), dvn_ = dense16(dv_new);
  const at::Tensor g_ = g.contiguous(), beta_ = beta.contiguous(), gcum_ = gcum.contiguous(),
                   co_ = chunk_offsets.contiguous(), cu_ = cu_seqlens.contiguous();
  at::Tensor dq = at::empty({T, H, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dk = at::empty({T, H, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dv = at::empty({T, HV, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dg = at::empty({T, HV}, q.options().dtype(at::kFloat));
  at::Tensor dbeta = at::empty({T, HV}, q.options().dtype(beta.scalar_type()));

  GdnBwdLocalArgs a{};
  a.q = q_.data_ptr();
  a.k = k_.data_ptr();
  a.v = v_.data_ptr();
  a.dout = do_.data_ptr();
  a.g = g_.data_ptr<float>();
  a.beta = beta_.data_ptr();
  a.beta_dtype = to_dtype(beta_.scalar_type());
  a.gcum = gcum_.data_ptr<float>();
  a.a = A_.data_ptr();
  a.h = h_.data_ptr();
  a.v_new = vn_.data_ptr();
  a.ds = ds_.data_ptr();
  a.dv_new = dvn_.data_ptr();
  a.chunk_offsets = co_.data_ptr<int32_t>();
  a.cu_seqlens = cu_.data_ptr();
  a.cu_int64 = cu_.scalar_type() == at::kLong;
  a.dq = dq.data_ptr();
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  a.dg = dg.data_ptr<float>();
  a.dbeta = dbeta.data_ptr();
  a.T = T;
  a.N = N;
  a.H = H;
  a.HV = HV;
  a.scale = static_cast<float>(scale);
  a.use_qk_l2norm = use_qk_l2norm;
  const cudaError_t err = gdn_bwd_local_launch(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, kOp, ": kernel launch failed: ", cudaGetErrorString(err));
  return {dq, dk, dv, dg, dbeta};
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY_FRAGMENT(cake_cuda, m) {
  m.def(
      "gdn_bwd_local(Tensor q, Tensor k, Tensor v, Tensor do, Tensor g, Tensor beta, Tensor gcum, Tensor A, "
      "Tensor h, Tensor v_new, Tensor dS, Tensor dv_new, Tensor chunk_offsets, Tensor cu_seqlens, float scale, "
      "bool use_qk_l2norm) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta)");
}

TORCH_LIBRARY_IMPL(cake_cuda, CUDA, m) { m.impl("gdn_bwd_local", &cake::gdn_bwd_local); }
