// Torch binding of the GDN forward: argument checks, outputs and the one workspace
// allocation, device and stream; the plan (gdn/plan.h) and the math live in the
// torch-free launchers. These ops are internal: the public cake:: ops (with fake kernels
// and autograd) call them.

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/binding.h"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

struct GdnShapes {
  int64_t T, H, HV, N;
};

// The CUDA-eligibility rule: these checks mirror cake_ops/dispatch.py's rule for sending a
// call to the CUDA kernels (q, k, v bf16; K = V = 128; scale finite and > 0 (gdn_fwd);
// g fp32; beta fp32 or bf16; HV a positive multiple of H, HV < 2^24; T < 2^31 - 64 and
// (ceil(T / 64) + N) HV < 2^31), plus the shapes and devices every call needs. Keep the two
// in step: a call dispatch.py sends here must pass, and one it keeps must fail.
GdnShapes check_gdn_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens) {
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 3, op, ": q must be [T, H, K], got ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1), K = q.size(2);
  TORCH_CHECK(K == kGdnHeadDim, op, ": q: the CUDA kernels need head dim K = 128, got K = ", K);
  TORCH_CHECK(H >= 1, op, ": q needs at least one head, got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must be [T, H, K] = ", q.sizes(), " like q, got ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, op, ": q must be bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == at::kBFloat16, op, ": k must be bfloat16, got ", k.scalar_type());
  check_same_device(k, q, op, "k", "q");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == T, op, ": g must be [T, HV] with T = ", T, ", got ", g.sizes());
  const int64_t HV = g.size(1);
  TORCH_CHECK(HV >= 1 && HV % H == 0, op, ": g: the value heads HV = ", HV,
              " must be a positive multiple of q's heads H = ", H);
  TORCH_CHECK(HV < (1 << 24), op, ": g: the kernels take row strides HV * 128 as 32-bit values; HV = ", HV,
              " must be below 2^24");
  if (v != nullptr) {
    TORCH_CHECK(v->dim() == 3 && v->size(0) == T && v->size(1) == HV, op, ": v must be [T, HV, V] = [", T,
                ", ", HV, ", V], got ", v->sizes());
    TORCH_CHECK(v->size(2) == kGdnHeadDim, op, ": v: the CUDA kernels need head dim V = 128, got V = ", v->size(2));
    TORCH_CHECK(v->scalar_type() == at::kBFloat16, op, ": v must be bfloat16, got ", v->scalar_type());
    check_same_device(*v, q, op, "v", "q");
  }
  TORCH_CHECK(g.scalar_type() == at::kFloat, op, ": g must be float32, got ", g.scalar_type());
  check_same_device(g, q, op, "g", "q");
  TORCH_CHECK(beta.sizes() == g.sizes(), op, ": beta must be [T, HV] = ", g.sizes(), ", got ", beta.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat || beta.scalar_type() == at::kBFloat16, op,
              ": beta must be float32 or bfloat16, got ", beta.scalar_type());
  check_same_device(beta, q, op, "beta", "q");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op, ": cu_seqlens must be [N + 1], got ",
              cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, q, op, "cu_seqlens", "q");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, op, ": cu_seqlens: ", T, " tokens need at least one document");
  // The walk's TMA coordinates (token rows, chunk-slot tiles) are 32-bit.
  TORCH_CHECK(T < (int64_t{1} << 31) - kGdnChunk && gdn_fwd_chunk_slots(T, N) * HV < (int64_t{1} << 31), op,
              ": q, cu_seqlens, g: T = ", T, " tokens with N = ", N, " documents and HV = ", HV,
              " value heads exceed the kernels' 32-bit token and tile coordinates");
  return {T, H, HV, N};
}

// Inputs made dense, outputs and the workspace allocated (never initialised: the kernels
// write what is read), and the launch arguments pointing at them. The workspaces share
// one allocation laid out by the plan: one allocator call instead of ten on the host path
// of every call.
struct GdnFwdCall {
  at::Tensor q, k, v, g, beta, cu, h0, o, final_state, workspace;
  GdnPlan plan;
  GdnFwdArgs args{};
};

GdnFwdCall prepare_gdn_fwd(const GdnPlan& plan, const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
                           const std::optional<at::Tensor>& initial_state, double scale) {
  GdnFwdCall c;
  c.plan = plan;
  c.q = dense16(q);
  c.k = dense16(k);
  if (v != nullptr) c.v = dense16(*v);
  c.g = g.contiguous();
  c.beta = beta.contiguous();
  c.cu = cu_seqlens.contiguous();
  c.workspace = at::empty({plan.ws.bytes}, q.options().dtype(at::kByte));
  if (v != nullptr) {
    if (initial_state) c.h0 = dense16(*initial_state);
    c.o = at::empty({plan.T, plan.HV, kGdnHeadDim}, q.options().dtype(at::kBFloat16));
    c.final_state = at::empty({plan.N, plan.HV, kGdnHeadDim, kGdnHeadDim}, q.options().dtype(at::kFloat));
  }
  GdnFwdArgs& a = c.args;
  a.q = c.q.data_ptr();
  a.k = c.k.data_ptr();
  a.v = v != nullptr ? c.v.data_ptr() : nullptr;
  a.g = c.g.data_ptr<float>();
  a.beta = c.beta.data_ptr();
  a.beta_dtype = to_dtype(c.beta.scalar_type());
  a.cu_seqlens = c.cu.data_ptr();
  a.cu_int64 = c.cu.scalar_type() == at::kLong;
  a.initial_state = c.h0.defined() ? c.h0.data_ptr<float>() : nullptr;
  a.o = c.o.defined() ? c.o.data_ptr() : nullptr;
  a.final_state = c.final_state.defined() ? c.final_state.data_ptr<float>() : nullptr;
  a.scale = static_cast<float>(scale);
  gdn_fwd_apply_plan(plan, c.workspace.data_ptr(), a);
  return c;
}

// The whole forward: (o, final_state). segment_chunks: -1 lets the plan choose the cut
// grid (fixed for deterministic, shape- and SM-count-dependent otherwise); >= 0 forces
// one (0: uncut). value_splits: -1 lets the plan choose the walks' value-column split
// (from the shapes and SM count), 1 or 2 forces it. Forcing is for tests and tuning.
std::tuple<at::Tensor, at::Tensor> gdn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta,
                                           const at::Tensor& cu_seqlens,
                                           const std::optional<at::Tensor>& initial_state, double scale,
                                           bool use_qk_l2norm, bool deterministic, int64_t segment_chunks,
                                           int64_t value_splits) {
  const GdnShapes s = check_gdn_inputs("gdn_fwd", q, k, &v, g, beta, cu_seqlens);
  // Part of the eligibility rule (cake_ops/dispatch.py): the walk takes log2(scale).
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "gdn_fwd: scale must be finite and > 0, got ", scale);
  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({s.N, s.HV, kGdnHeadDim, kGdnHeadDim}),
                "gdn_fwd: initial_state must be [N, HV, K, V] = [", s.N, ", ", s.HV, ", 128, 128], got ",
                initial_state->sizes());
    TORCH_CHECK(initial_state->scalar_type() == at::kFloat, "gdn_fwd: initial_state must be float32, got ",
                initial_state->scalar_type());
    check_same_device(*initial_state, q, "gdn_fwd", "initial_state", "q");
  }
  TORCH_CHECK(segment_chunks >= -1 && segment_chunks <= (1 << 20), "gdn_fwd: segment_chunks must be -1 (the plan's "
              "choice), 0 (uncut) or a cut grid in chunks, got ", segment_chunks);
  TORCH_CHECK(value_splits == -1 || value_splits == 1 || value_splits == 2,
              "gdn_fwd: value_splits must be -1 (the plan's choice), 1 or 2, got ", value_splits);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  int sm_count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.device().index());
  TORCH_CHECK(err == cudaSuccess, "gdn_fwd: cannot read the SM count: ", cudaGetErrorString(err));
  const GdnPlan plan = gdn_fwd_make_plan(s.T, s.N, s.H, s.HV, use_qk_l2norm, deterministic, sm_count,
                                         static_cast<int>(segment_chunks), static_cast<int>(value_splits));
  GdnFwdCall c = prepare_gdn_fwd(plan, q, k, &v, g, beta, cu_seqlens, initial_state, scale);
  const cudaError_t launch_err = gdn_fwd_launch(c.args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(launch_err == cudaSuccess, "gdn_fwd: kernel launch failed: ", cudaGetErrorString(launch_err));
  return {c.o, c.final_state};
}

// The prep stage alone: (a [NC, HV, 64, 64] bf16 = A diag(beta) per chunk slot,
// gcum [NC, HV, 64] fp32, chunk_decay [NC, HV] fp32), NC = ceil(T / 64) + N; slots past
// the last document's last chunk are left unwritten. For tests of the stage and for a
// backward that reuses A.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_fwd_prep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g,
                                                const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                                bool use_qk_l2norm) {
  const GdnShapes s = check_gdn_inputs("gdn_fwd_prep", q, k, nullptr, g, beta, cu_seqlens);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  // Uncut, unsplit: the prep reads neither; no SM count needed.
  const GdnPlan plan = gdn_fwd_make_plan(s.T, s.N, s.H, s.HV, use_qk_l2norm, /*deterministic=*/false,
                                         /*sm_count=*/0, /*segment_chunks=*/0, /*value_splits=*/1);
  GdnFwdCall c = prepare_gdn_fwd(plan, q, k, nullptr, g, beta, cu_seqlens, std::nullopt, 1.0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = gdn_fwd_plan_launch(c.args, stream);
  if (err == cudaSuccess) err = gdn_fwd_prep_launch(c.args, stream);
  TORCH_CHECK(err == cudaSuccess, "gdn_fwd_prep: kernel launch failed: ", cudaGetErrorString(err));
  const int64_t NC = plan.chunk_slots;
  constexpr int64_t C = kGdnChunk;
  auto piece = [&](int64_t offset, int64_t elems, at::ScalarType dtype, at::IntArrayRef shape) {
    return c.workspace.narrow(0, offset, elems * at::elementSize(dtype)).view(dtype).view(shape);
  };
  return {piece(plan.ws.a, NC * s.HV * C * C, at::kBFloat16, {NC, s.HV, C, C}),
          piece(plan.ws.gcum, NC * s.HV * C, at::kFloat, {NC, s.HV, C}),
          piece(plan.ws.chunk_decay, NC * s.HV, at::kFloat, {NC, s.HV})};
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY_FRAGMENT(cake_cuda, m) {
  m.def(
      "gdn_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? initial_state, float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, "
      "int value_splits=-1) "
      "-> (Tensor, Tensor)");
  m.def(
      "gdn_fwd_prep(Tensor q, Tensor k, Tensor g, Tensor beta, Tensor cu_seqlens, bool use_qk_l2norm) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cake_cuda, CUDA, m) {
  m.impl("gdn_fwd", &cake::gdn_fwd);
  m.impl("gdn_fwd_prep", &cake::gdn_fwd_prep);
}
