// Torch binding of the cake_cuda kernels: argument checks, output allocation,
// device and stream; the math lives in the torch-free launchers. These ops are
// internal: the public cake:: ops (with fake kernels and autograd) call them.

#include <cstdint>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "gdn_fwd.h"
#include "short_conv.h"

namespace cake {
namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "cake_cuda: unsupported dtype ", t);
  }
}

void check_on_device_of(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "short_conv_fwd: ", name, " must be on ", x.device(),
              " like x, got ", t.device());
}

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
  check_on_device_of(weight, x, "weight");
  check_float32_or_dtype_of_x(weight, x, "weight");
  const int W = static_cast<int>(weight.size(1));

  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == D, "short_conv_fwd: bias must be [D] with D = ",
                D, ", got ", bias->sizes());
    check_on_device_of(*bias, x, "bias");
    TORCH_CHECK(bias->scalar_type() == weight.scalar_type(),
                "short_conv_fwd: bias must have weight's dtype ", weight.scalar_type(), ", got ",
                bias->scalar_type());
  }

  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "short_conv_fwd: cu_seqlens must be [N + 1], got ", cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
              "short_conv_fwd: cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_on_device_of(cu_seqlens, x, "cu_seqlens");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, "short_conv_fwd: ", T, " tokens need at least one document");

  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({N, D, W - 1}),
                "short_conv_fwd: initial_state must be [N, D, W - 1] = [", N, ", ", D, ", ", W - 1,
                "], got ", initial_state->sizes());
    check_on_device_of(*initial_state, x, "initial_state");
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


// ---------------------------------------------------------------------------------
// GDN forward (gdn_fwd.h): K = V = 128 only; the Python side falls back to PyTorch
// for other head dims.

void check_same_device(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on ", q.device(), " like q, got ",
              t.device());
}

// Dense and 16-byte aligned (the kernels read 16-byte vectors); copies only if needed.
at::Tensor dense16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

struct GdnShapes {
  int64_t T, H, HV, N;
};

GdnShapes check_gdn_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens) {
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 3, op, ": q must be [T, H, K], got ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1), K = q.size(2);
  TORCH_CHECK(K == kGdnHeadDim, op, ": the CUDA kernels need head dim K = 128, got K = ", K);
  TORCH_CHECK(H >= 1, op, ": q needs at least one head, got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must be [T, H, K] = ", q.sizes(), " like q, got ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16, op,
              ": q and k must be bfloat16, got ", q.scalar_type(), " and ", k.scalar_type());
  check_same_device(k, q, op, "k");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == T, op, ": g must be [T, HV] with T = ", T, ", got ", g.sizes());
  const int64_t HV = g.size(1);
  TORCH_CHECK(HV >= 1 && HV % H == 0, op, ": the value heads HV = ", HV, " must be a positive multiple of H = ", H);
  TORCH_CHECK(HV < (1 << 24), op, ": the kernels take row strides HV * 128 as 32-bit values; HV = ", HV,
              " must be below 2^24");
  if (v != nullptr) {
    TORCH_CHECK(v->dim() == 3 && v->size(0) == T && v->size(1) == HV, op, ": v must be [T, HV, V] = [", T,
                ", ", HV, ", V], got ", v->sizes());
    TORCH_CHECK(v->size(2) == kGdnHeadDim, op, ": the CUDA kernels need head dim V = 128, got V = ", v->size(2));
    TORCH_CHECK(v->scalar_type() == at::kBFloat16, op, ": v must be bfloat16, got ", v->scalar_type());
    check_same_device(*v, q, op, "v");
  }
  TORCH_CHECK(g.scalar_type() == at::kFloat, op, ": g must be float32, got ", g.scalar_type());
  check_same_device(g, q, op, "g");
  TORCH_CHECK(beta.sizes() == g.sizes(), op, ": beta must be [T, HV] = ", g.sizes(), ", got ", beta.sizes());
  TORCH_CHECK(beta.scalar_type() == at::kFloat || beta.scalar_type() == at::kBFloat16, op,
              ": beta must be float32 or bfloat16, got ", beta.scalar_type());
  check_same_device(beta, q, op, "beta");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op, ": cu_seqlens must be [N + 1], got ",
              cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, q, op, "cu_seqlens");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, op, ": ", T, " tokens need at least one document");
  // The walk's TMA coordinates (token rows, chunk-slot tiles) are 32-bit.
  TORCH_CHECK(T < (int64_t{1} << 31) - 64 && gdn_fwd_chunk_slots(T, N) * HV < (int64_t{1} << 31), op,
              ": T = ", T, " tokens with N = ", N, " documents and HV = ", HV,
              " value heads exceed the kernels' 32-bit token and tile coordinates");
  return {T, H, HV, N};
}

// Inputs made dense, outputs and workspaces allocated (never initialised: the kernels
// write what is read), and the launch arguments pointing at them. The workspaces (see
// gdn_fwd.h) share one allocation, carved at 256-byte boundaries: one allocator call
// instead of ten on the host path of every call.
struct GdnFwdCall {
  at::Tensor q, k, v, g, beta, cu, h0, o, final_state, workspace;
  int64_t a_offset = 0, gcum_offset = 0, chunk_decay_offset = 0;  // bytes into workspace (for gdn_fwd_prep)
  GdnFwdArgs args;
};

// Byte offsets of consecutive pieces of one buffer.
struct Carve {
  int64_t bytes = 0;
  int64_t take(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + 255) / 256 * 256;
    return at;
  }
};

GdnFwdCall prepare_gdn_fwd(const GdnShapes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
                           const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm,
                           int seg_chunks, int seg_long_max) {
  GdnFwdCall c;
  c.q = dense16(q);
  c.k = dense16(k);
  if (v != nullptr) c.v = dense16(*v);
  c.g = g.contiguous();
  c.beta = beta.contiguous();
  c.cu = cu_seqlens.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  const auto bf16 = q.options().dtype(at::kBFloat16);
  const int64_t NC = gdn_fwd_chunk_slots(s.T, s.N);
  // Inner segment slots (the segments that are not their document's last): the seg_ workspaces.
  const int64_t NI =
      seg_chunks > 0 ? gdn_fwd_inner_segment_slots(s.T, gdn_fwd_finest_cut_chunks(seg_chunks, seg_long_max)) : 0;
  constexpr int64_t kMatBytes = kGdnHeadDim * kGdnHeadDim * 4;
  Carve ws;
  const int64_t chunk_offsets = ws.take((s.N + 1) * 4), seg_offsets = ws.take((s.N + 1) * 4);
  const int64_t seg_state = ws.take(NI * s.HV * kMatBytes), seg_transfer = ws.take(NI * s.HV * kMatBytes);
  const int64_t seg_exact = ws.take(NI * s.HV * 4);
  const int64_t chain_docs = ws.take(gdn_fwd_chain_doc_slots(s.T, s.N, seg_chunks) * 4);
  const int64_t walk_queue = ws.take(4);
  c.a_offset = ws.take(NC * s.HV * 64 * 64 * 2);
  c.gcum_offset = ws.take(NC * s.HV * 64 * 4);
  c.chunk_decay_offset = ws.take(NC * s.HV * 4);
  const int64_t qk_lrn = ws.take(use_qk_l2norm ? NC * s.H * 2 * 64 * 4 : 0);
  c.workspace = at::empty({ws.bytes}, q.options().dtype(at::kByte));
  unsigned char* base = static_cast<unsigned char*>(c.workspace.data_ptr());
  if (v != nullptr) {
    if (initial_state) c.h0 = dense16(*initial_state);
    c.o = at::empty({s.T, s.HV, kGdnHeadDim}, bf16);
    c.final_state = at::empty({s.N, s.HV, kGdnHeadDim, kGdnHeadDim}, f32);
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
  a.chunk_offsets = reinterpret_cast<int32_t*>(base + chunk_offsets);
  a.a = base + c.a_offset;
  a.gcum = reinterpret_cast<float*>(base + c.gcum_offset);
  a.chunk_decay = reinterpret_cast<float*>(base + c.chunk_decay_offset);
  a.qk_lrn = use_qk_l2norm ? reinterpret_cast<float*>(base + qk_lrn) : nullptr;
  a.seg_offsets = reinterpret_cast<int32_t*>(base + seg_offsets);
  a.seg_state = NI > 0 ? reinterpret_cast<float*>(base + seg_state) : nullptr;
  a.seg_transfer = NI > 0 ? reinterpret_cast<float*>(base + seg_transfer) : nullptr;
  a.seg_exact = NI > 0 ? reinterpret_cast<int32_t*>(base + seg_exact) : nullptr;
  a.chain_docs = seg_chunks > 0 ? reinterpret_cast<int32_t*>(base + chain_docs) : nullptr;
  a.walk_queue = seg_chunks > 0 ? reinterpret_cast<int32_t*>(base + walk_queue) : nullptr;
  a.seg_chunks = seg_chunks;
  a.seg_long_max = seg_long_max;
  a.walk_splits = a.summary_splits = 1;
  a.T = s.T;
  a.N = s.N;
  a.H = s.H;
  a.HV = s.HV;
  a.scale = static_cast<float>(scale);
  a.use_qk_l2norm = use_qk_l2norm;
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
  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({s.N, s.HV, kGdnHeadDim, kGdnHeadDim}),
                "gdn_fwd: initial_state must be [N, HV, K, V] = [", s.N, ", ", s.HV, ", 128, 128], got ",
                initial_state->sizes());
    TORCH_CHECK(initial_state->scalar_type() == at::kFloat, "gdn_fwd: initial_state must be float32, got ",
                initial_state->scalar_type());
    check_same_device(*initial_state, q, "gdn_fwd", "initial_state");
  }
  TORCH_CHECK(segment_chunks >= -1 && segment_chunks <= (1 << 20), "gdn_fwd: segment_chunks must be -1 (the plan's "
              "choice), 0 (uncut) or a cut grid in chunks, got ", segment_chunks);
  TORCH_CHECK(value_splits == -1 || value_splits == 1 || value_splits == 2,
              "gdn_fwd: value_splits must be -1 (the plan's choice), 1 or 2, got ", value_splits);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  int sm_count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.device().index());
  TORCH_CHECK(err == cudaSuccess, "gdn_fwd: cannot read the SM count: ", cudaGetErrorString(err));
  const int seg_chunks = segment_chunks >= 0
                             ? static_cast<int>(segment_chunks)
                             : gdn_fwd_choose_segment_chunks(s.T, s.N, s.HV, deterministic, sm_count);
  // An explicit grid (tests, sweeps) cuts every document alike.
  const int seg_long_max = segment_chunks >= 0 ? 0 : gdn_fwd_choose_segment_long_max(s.HV, deterministic);
  GdnFwdCall c = prepare_gdn_fwd(s, q, k, &v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, seg_chunks,
                                 seg_long_max);
  c.args.sm_count = sm_count;
  if (value_splits > 0) c.args.walk_splits = c.args.summary_splits = static_cast<int>(value_splits);
  else gdn_fwd_choose_value_splits(c.args, sm_count);
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
  GdnFwdCall c = prepare_gdn_fwd(s, q, k, nullptr, g, beta, cu_seqlens, std::nullopt, 1.0, use_qk_l2norm, 0, 0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = gdn_fwd_plan_launch(c.args, stream);
  if (err == cudaSuccess) err = gdn_fwd_prep_launch(c.args, stream);
  TORCH_CHECK(err == cudaSuccess, "gdn_fwd_prep: kernel launch failed: ", cudaGetErrorString(err));
  const int64_t NC = gdn_fwd_chunk_slots(s.T, s.N);
  auto piece = [&](int64_t offset, int64_t elems, at::ScalarType dtype, at::IntArrayRef shape) {
    return c.workspace.narrow(0, offset, elems * at::elementSize(dtype)).view(dtype).view(shape);
  };
  return {piece(c.a_offset, NC * s.HV * 64 * 64, at::kBFloat16, {NC, s.HV, 64, 64}),
          piece(c.gcum_offset, NC * s.HV * 64, at::kFloat, {NC, s.HV, 64}),
          piece(c.chunk_decay_offset, NC * s.HV, at::kFloat, {NC, s.HV})};
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY(cake_cuda, m) {
  m.def(
      "short_conv_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, "
      "Tensor? initial_state, bool silu) -> Tensor");
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
  m.impl("short_conv_fwd", &cake::short_conv_fwd);
  m.impl("gdn_fwd", &cake::gdn_fwd);
  m.impl("gdn_fwd_prep", &cake::gdn_fwd_prep);
}
