// Torch binding of the GDN kernels: the forward (gdn_fwd), the backward (gdn_bwd), and
// their stages alone for tests (gdn_fwd_prep, gdn_bwd_tapes, gdn_bwd_walk, gdn_bwd_local):
// argument checks, outputs and the one workspace allocation, device and stream; the plan
// (gdn/plan.h) and the math live in the torch-free launchers. These ops are internal: the
// public cake:: ops (with fake kernels and autograd) call them.

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/binding.h"
#include "gdn/bwd_local.h"
#include "gdn/bwd_walk.h"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

struct GdnShapes {
  int64_t T, H, HV, N;
};

// cu_seqlens of a call whose first tensor is q ([T, ...]): [N + 1] int32 / int64 on q's
// device; returns N. Its values are checked by the plan kernel (plan.cu), on the device.
int64_t check_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& q, int64_t T) {
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op, ": cu_seqlens must be [N + 1], got ",
              cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  check_same_device(cu_seqlens, q, op, "cu_seqlens", "q");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(T == 0 || N >= 1, op, ": cu_seqlens: ", T, " tokens need at least one document");
  return N;
}

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
  const int64_t N = check_cu_seqlens(op, cu_seqlens, q, T);
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
  at::Tensor q, k, v, g, beta, cu, h0, o, final_state, workspace, doc_flags;
  at::Tensor chunks;  // the per-chunk block, where the plan has it apart (the full save mode)
  GdnPlan plan;
  GdnFwdArgs args{};
};

// outputs = false (the backward's recompute): v and the initial state are read, but no o
// or final state is allocated. A plan with the per-chunk block apart takes `chunks` (the
// forward's kept block, checked by the caller) or allocates it.
GdnFwdCall prepare_gdn_fwd(const GdnPlan& plan, const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
                           const std::optional<at::Tensor>& initial_state, double scale, bool outputs = true,
                           const at::Tensor* chunks = nullptr,
                           const std::optional<at::Tensor>& doc_flags = std::nullopt) {
  GdnFwdCall c;
  c.plan = plan;
  c.q = dense16(q);
  c.k = dense16(k);
  if (v != nullptr) c.v = dense16(*v);
  c.g = g.contiguous();
  c.beta = beta.contiguous();
  c.cu = cu_seqlens.contiguous();
  c.workspace = at::empty({plan.ws.bytes}, q.options().dtype(at::kByte));
  if (plan.chunks_apart) c.chunks = chunks != nullptr ? *chunks : at::empty({plan.ws.chunk.bytes}, c.workspace.options());
  if (v != nullptr) {
    if (initial_state) c.h0 = dense16(*initial_state);
    if (outputs) {
      c.o = at::empty({plan.T, plan.HV, kGdnHeadDim}, q.options().dtype(at::kBFloat16));
      c.final_state = at::empty({plan.N, plan.HV, kGdnHeadDim, kGdnHeadDim}, q.options().dtype(at::kFloat));
    }
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
  if (doc_flags) {
    c.doc_flags = *doc_flags;
    a.doc_flags = c.doc_flags.data_ptr<uint8_t>();
  }
  gdn_fwd_apply_plan(plan, c.workspace.data_ptr(), a, c.chunks.defined() ? c.chunks.data_ptr() : nullptr);
  return c;
}

// The checks of a forward walk's further arguments (gdn_fwd and gdn_bwd_tapes, which
// walks as the forward does) and the call's plan: backward = true adds the backward's
// workspace pieces (gdn_bwd_make_plan). segment_chunks: -1 lets the plan choose the cut
// grid (fixed for deterministic, shape- and SM-count-dependent otherwise); >= 0 forces
// one (0: uncut). value_splits: -1 lets the plan choose the walks' value-column split
// (from the shapes and SM count), 1 or 2 forces it. Forcing is for tests and tuning.
GdnPlan check_and_plan_walk(const char* op, const GdnShapes& s, const at::Tensor& q,
                            const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm,
                            bool deterministic, int64_t segment_chunks, int64_t value_splits, bool backward,
                            int64_t head_slices = -1, bool tapes = false,
                            const std::optional<at::Tensor>& doc_flags = std::nullopt) {
  // Part of the eligibility rule (cake_ops/dispatch.py): the walk takes log2(scale).
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be finite and > 0, got ", scale);
  if (initial_state) {
    TORCH_CHECK(initial_state->sizes() == at::IntArrayRef({s.N, s.HV, kGdnHeadDim, kGdnHeadDim}), op,
                ": initial_state must be [N, HV, K, V] = [", s.N, ", ", s.HV, ", 128, 128], got ",
                initial_state->sizes());
    TORCH_CHECK(initial_state->scalar_type() == at::kFloat, op, ": initial_state must be float32, got ",
                initial_state->scalar_type());
    check_same_device(*initial_state, q, op, "initial_state", "q");
  }
  TORCH_CHECK(segment_chunks >= -1 && segment_chunks <= (1 << 20), op, ": segment_chunks must be -1 (the plan's "
              "choice), 0 (uncut) or a cut grid in chunks, got ", segment_chunks);
  TORCH_CHECK(value_splits == -1 || value_splits == 1 || value_splits == 2, op,
              ": value_splits must be -1 (the plan's choice), 1 or 2, got ", value_splits);
  int sm_count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.device().index());
  TORCH_CHECK(err == cudaSuccess, op, ": cannot read the SM count: ", cudaGetErrorString(err));
  TORCH_CHECK(head_slices == -1 || (head_slices >= 1 && s.H % head_slices == 0), op,
              ": head_slices must be -1 (the plan's choice) or a divisor of q's heads H = ", s.H, ", got ", head_slices);
  if (doc_flags) {
    TORCH_CHECK(doc_flags->dim() == 1 && doc_flags->numel() == s.N && doc_flags->scalar_type() == at::kByte &&
                    doc_flags->is_contiguous(),
                op, ": doc_flags must be a contiguous uint8 [N] = [", s.N, "] tensor, got ", doc_flags->scalar_type(),
                " ", doc_flags->sizes());
    check_same_device(*doc_flags, q, op, "doc_flags", "q");
  }
  const GdnPlan plan =
      !backward ? gdn_fwd_make_plan(s.T, s.N, s.H, s.HV, use_qk_l2norm, deterministic, sm_count,
                                    static_cast<int>(segment_chunks), static_cast<int>(value_splits), tapes,
                                    doc_flags.has_value())
                : gdn_bwd_make_plan(s.T, s.N, s.H, s.HV, use_qk_l2norm, deterministic, sm_count,
                                    static_cast<int>(segment_chunks), static_cast<int>(value_splits),
                                    static_cast<int>(head_slices), tapes, doc_flags.has_value());
  // The empty segments of doc_flags are segments of the cut grid: an uncut plan has no
  // summaries or chain to put them in.
  TORCH_CHECK(!doc_flags || plan.seg_chunks > 0, op, ": doc_flags needs a cut plan (deterministic=True, or "
              "segment_chunks > 0); this call's plan is uncut");
  return plan;
}

// One stage's launches under a profiler range named after the op and the stage
// ("cake::gdn_fwd/prep"), so that a torch.profiler trace shows each kernel under its stage
// (README, "Profiling"). A range costs nothing while no profiler runs.
template <typename Args>
void launch_stage(const char* op, const char* range, cudaError_t (*launch)(const Args&, cudaStream_t),
                  const Args& args, cudaStream_t stream) {
  RECORD_FUNCTION(range, std::vector<c10::IValue>());
  const cudaError_t err = launch(args, stream);
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed (", range, "): ", cudaGetErrorString(err));
}

// The forward's stages in order (gdn.h); each returns at once when the call's plan gives
// it nothing to do.
struct FwdStage {
  const char* range;
  const char* range_full;  // under gdn_fwd_full
  cudaError_t (*launch)(const GdnFwdArgs&, cudaStream_t);
};
constexpr FwdStage kFwdStages[] = {
    {"cake::gdn_fwd/plan", "cake::gdn_fwd_full/plan", gdn_fwd_plan_launch},
    {"cake::gdn_fwd/prep", "cake::gdn_fwd_full/prep", gdn_fwd_prep_launch},
    {"cake::gdn_fwd/summaries", "cake::gdn_fwd_full/summaries", gdn_fwd_summary_launch},
    {"cake::gdn_fwd/chain", "cake::gdn_fwd_full/chain", gdn_fwd_chain_launch},
    {"cake::gdn_fwd/walk", "cake::gdn_fwd_full/walk", gdn_fwd_walk_launch},
};

// The whole forward: (o, final_state); segment_chunks and value_splits as check_and_plan_walk says.
// keep_tapes (the full save mode): the per-chunk block with the tapes is a tensor of its
// own (GdnChunkLayout), written by the prep (with A) and the walk (o and the tapes in one
// pass), returned as `tapes` for gdn_bwd.
GdnFwdCall run_gdn_fwd(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
                       const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm,
                       bool deterministic, int64_t segment_chunks, int64_t value_splits, bool keep_tapes,
                       const std::optional<at::Tensor>& doc_flags) {
  const GdnShapes s = check_gdn_inputs(op, q, k, &v, g, beta, cu_seqlens);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const GdnPlan plan = check_and_plan_walk(op, s, q, initial_state, scale, use_qk_l2norm, deterministic,
                                           segment_chunks, value_splits, /*backward=*/false, 1, keep_tapes, doc_flags);
  GdnFwdCall c = prepare_gdn_fwd(plan, q, k, &v, g, beta, cu_seqlens, initial_state, scale, true, nullptr, doc_flags);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (const FwdStage& stage : kFwdStages)
    launch_stage(op, keep_tapes ? stage.range_full : stage.range, stage.launch, c.args, stream);
  return c;
}

std::tuple<at::Tensor, at::Tensor> gdn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                           const std::optional<at::Tensor>& initial_state, double scale,
                                           bool use_qk_l2norm, bool deterministic, int64_t segment_chunks,
                                           int64_t value_splits, const std::optional<at::Tensor>& doc_flags) {
  const GdnFwdCall c = run_gdn_fwd("gdn_fwd", q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                   deterministic, segment_chunks, value_splits, /*keep_tapes=*/false, doc_flags);
  return {c.o, c.final_state};
}

// (o, final_state, tapes): the full save mode's forward; tapes is uint8 [GdnChunkLayout bytes].
std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_fwd_full(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm,
    bool deterministic, int64_t segment_chunks, int64_t value_splits, const std::optional<at::Tensor>& doc_flags) {
  const GdnFwdCall c = run_gdn_fwd("gdn_fwd_full", q, k, v, g, beta, cu_seqlens, initial_state, scale,
                                   use_qk_l2norm, deterministic, segment_chunks, value_splits, /*keep_tapes=*/true,
                                   doc_flags);
  return {c.o, c.final_state, c.chunks};
}

// The final states alone (cake::gdn_fwd_final_state), fp32 [N, HV, K, V]: the forward's
// plan, prep, summaries and chain, then each document's last segment walked without
// output (gdn_fwd_final_state_walk_launch), so the bits are gdn_fwd's final state for the
// same arguments. No o is allocated or written.
at::Tensor gdn_fwd_final_state(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& cu_seqlens,
                               const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm,
                               bool deterministic, int64_t segment_chunks, int64_t value_splits,
                               const std::optional<at::Tensor>& doc_flags) {
  constexpr const char* op = "gdn_fwd_final_state";
  const GdnShapes s = check_gdn_inputs(op, q, k, &v, g, beta, cu_seqlens);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const GdnPlan plan = check_and_plan_walk(op, s, q, initial_state, scale, use_qk_l2norm, deterministic,
                                           segment_chunks, value_splits, /*backward=*/false, 1, false, doc_flags);
  GdnFwdCall c = prepare_gdn_fwd(plan, q, k, &v, g, beta, cu_seqlens, initial_state, scale, /*outputs=*/false,
                                 nullptr, doc_flags);
  c.final_state = at::empty({plan.N, plan.HV, kGdnHeadDim, kGdnHeadDim}, q.options().dtype(at::kFloat));
  c.args.final_state = c.final_state.data_ptr<float>();
  c.args.walk_segments = kGdnWalkLast;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  launch_stage(op, "cake::gdn_fwd_final_state/plan", gdn_fwd_plan_launch, c.args, stream);
  launch_stage(op, "cake::gdn_fwd_final_state/prep", gdn_fwd_prep_launch, c.args, stream);
  launch_stage(op, "cake::gdn_fwd_final_state/summaries", gdn_fwd_summary_launch, c.args, stream);
  launch_stage(op, "cake::gdn_fwd_final_state/chain", gdn_fwd_chain_launch, c.args, stream);
  launch_stage(op, "cake::gdn_fwd_final_state/walk", gdn_fwd_final_state_walk_launch, c.args, stream);
  return c.final_state;
}

// The checks of a state chain's operands (cake::gdn_state_chain, gdn_state_grad_chain):
// per segment the values X [R, HV, 128, 128] and the transfers T [R, HV, 128, 128], fp32;
// per document the state it enters from [N, HV, 128, 128] fp32; its segments' rows seg_cu
// [N + 1] int32 (from 0 to R, non-decreasing: the caller's), all on one device.
void check_state_chain(const char* op, const at::Tensor& values, const at::Tensor& transfers,
                       const at::Tensor& state, const at::Tensor& seg_cu) {
  TORCH_CHECK(state.dim() == 4 && state.size(2) == kGdnHeadDim && state.size(3) == kGdnHeadDim &&
                  state.scalar_type() == at::kFloat, op, ": the state must be float32 [N, HV, 128, 128], got ",
              state.scalar_type(), " ", state.sizes());
  const int64_t HV = state.size(1);
  for (const auto& [t, name] : {std::pair{&values, "the segments' values"}, std::pair{&transfers, "transfers"}}) {
    TORCH_CHECK(t->dim() == 4 && t->size(1) == HV && t->size(2) == kGdnHeadDim && t->size(3) == kGdnHeadDim &&
                    t->scalar_type() == at::kFloat && t->size(0) == values.size(0),
                op, ": ", name, " must be float32 [R, HV, 128, 128] with HV = ", HV, " and R = ", values.size(0),
                ", got ", t->scalar_type(), " ", t->sizes());
    check_same_device(*t, state, op, name, "the state");
  }
  TORCH_CHECK(seg_cu.dim() == 1 && seg_cu.numel() == state.size(0) + 1 && seg_cu.scalar_type() == at::kInt, op,
              ": seg_cu must be int32 [N + 1] = [", state.size(0) + 1, "], got ", seg_cu.scalar_type(), " ",
              seg_cu.sizes());
  check_same_device(seg_cu, state, op, "seg_cu", "the state");
}

// cake::gdn_state_chain on the forward's chain kernel (fwd_chain.cu): per document n, from
// S_start[n] through its segments' summaries (rows seg_cu[n] .. seg_cu[n + 1] of E and M),
// S <- M_s S + E_s, or S <- E_s where M_s is all zeros (a truncated cut's, as the
// final-state op walked from the identity with v = 0 gives it): the end state. The
// kernel's pieces per document are a slot of its start state, then one per segment, so
// that a document of R_n segments takes the chain's path of one with R_n + 2 (the empty
// first and last of doc_flags, gdn.h): the same FMAs in the same order.
at::Tensor gdn_state_chain(const at::Tensor& E, const at::Tensor& M, const at::Tensor& S_start,
                           const at::Tensor& seg_cu) {
  constexpr const char* op = "gdn_state_chain";
  check_state_chain(op, E, M, S_start, seg_cu);
  const c10::cuda::OptionalCUDAGuard device_guard(S_start.device());
  const int64_t N = S_start.size(0), R = E.size(0), HV = S_start.size(1);
  if (N == 0 || R == 0) return S_start.clone();
  const auto idx = S_start.options().dtype(at::kLong);
  const at::Tensor cu = seg_cu.to(at::kLong);
  const at::Tensor docs = at::arange(N, idx);
  const at::Tensor rows = at::arange(R, idx);
  // Row j of E belongs to document searchsorted(seg_cu[1:], j, right) and sits one slot
  // after its start state's.
  const at::Tensor row_slots = rows.add(at::searchsorted(cu.narrow(0, 1, N), rows, false, true)).add(1);
  at::Tensor state = at::empty({R + N, HV, kGdnHeadDim, kGdnHeadDim}, S_start.options());
  state.index_copy_(0, cu.narrow(0, 0, N).add(docs), S_start.contiguous());
  state.index_copy_(0, row_slots, E.contiguous());
  at::Tensor transfer = at::zeros(state.sizes(), state.options());
  transfer.index_copy_(0, row_slots, M.transpose(-1, -2).contiguous());  // the kernel reads M_s^T
  at::Tensor exact = at::zeros({R + N, HV}, S_start.options().dtype(at::kInt));
  exact.index_copy_(0, row_slots, M.ne(0).flatten(2).any(-1).to(at::kInt));
  const at::Tensor seg_offsets = cu.add(at::arange(N + 1, idx), 2).to(at::kInt);
  const at::Tensor chain_docs = docs.to(at::kInt);
  GdnFwdArgs a{};
  a.N = N;
  a.HV = HV;
  a.seg_offsets = const_cast<int32_t*>(seg_offsets.data_ptr<int32_t>());
  a.seg_state = state.data_ptr<float>();
  a.seg_transfer = transfer.data_ptr<float>();
  a.seg_exact = exact.data_ptr<int32_t>();
  a.chain_docs = const_cast<int32_t*>(chain_docs.data_ptr<int32_t>());
  RECORD_FUNCTION("cake::gdn_state_chain/chain", std::vector<c10::IValue>());
  const cudaError_t err = gdn_state_chain_launch(a, N, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return state.index_select(0, cu.narrow(0, 1, N).add(docs));  // slot R_n of document n: its end
}

// cake::gdn_state_grad_chain on the backward's chain kernel (bwd_chain.cu): per document
// n, from dS_end[n] back through its segments (rows seg_cu[n] .. seg_cu[n + 1] of F and B,
// the last first), dS <- B_s dS + F_s, or dS <- F_s where B_s is all zeros (a truncated
// cut's): the gradient at its start. The kernel's pieces per document are one cut slot a
// segment (the cut before it), so that a document of R_n segments takes the chain's path
// of one with an empty first segment and R_n real ones after it.
at::Tensor gdn_state_grad_chain(const at::Tensor& F, const at::Tensor& B, const at::Tensor& dS_end,
                                const at::Tensor& seg_cu) {
  constexpr const char* op = "gdn_state_grad_chain";
  check_state_chain(op, F, B, dS_end, seg_cu);
  const c10::cuda::OptionalCUDAGuard device_guard(dS_end.device());
  const int64_t N = dS_end.size(0), R = F.size(0), HV = dS_end.size(1);
  if (N == 0 || R == 0) return dS_end.clone();
  const auto idx = dS_end.options().dtype(at::kLong);
  const at::Tensor cu = seg_cu.to(at::kLong);
  at::Tensor grad = F.clone(at::MemoryFormat::Contiguous);
  const at::Tensor transfer = B.transpose(-1, -2).contiguous();  // the kernel reads columns of B's rows
  at::Tensor exact = B.ne(0).flatten(2).any(-1).to(at::kInt);
  const at::Tensor seg_offsets = cu.add(at::arange(N + 1, idx)).to(at::kInt);
  const at::Tensor dht = dS_end.contiguous();
  GdnBwdWalkArgs a{};
  a.N = N;
  a.HV = HV;
  a.HV_stride = HV;
  a.dht = dht.data_ptr<float>();
  a.seg_offsets = seg_offsets.data_ptr<int32_t>();
  a.seg_grad = grad.data_ptr<float>();
  a.seg_transfer = const_cast<float*>(transfer.data_ptr<float>());
  a.seg_exact = exact.data_ptr<int32_t>();
  a.inner_slots = R;
  RECORD_FUNCTION("cake::gdn_state_grad_chain/chain", std::vector<c10::IValue>());
  const cudaError_t err = gdn_bwd_chain_launch(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  // A document with segments ends its chain at its first cut slot; one without is dS_end.
  const at::Tensor first = cu.narrow(0, 0, N);
  const at::Tensor has = cu.narrow(0, 1, N).gt(first).view({N, 1, 1, 1});
  return at::where(has, grad.index_select(0, first.clamp_max(R - 1)), dht);
}

// A piece of a call's workspace as a tensor view.
at::Tensor workspace_piece(const at::Tensor& workspace, int64_t offset, at::ScalarType dtype, at::IntArrayRef shape) {
  int64_t elems = 1;
  for (const int64_t n : shape) elems *= n;
  return workspace.narrow(0, offset, elems * static_cast<int64_t>(at::elementSize(dtype))).view(dtype).view(shape);
}

// A segment-summaries call's doc_flags must be given: every document flagged to open and
// close inside (their values the gather kernel asserts on the device).
void require_doc_flags(const char* op, const std::optional<at::Tensor>& doc_flags) {
  TORCH_CHECK(doc_flags.has_value(), op, ": doc_flags must be given, every document flagged to open and close "
              "inside (1 | 2, with its grid class): the op takes each as one segment between two empty ones");
}

// A segment-summaries call's plan must cut (the summaries are the cut walks'): a
// non-deterministic plan of short documents does not, unless segment_chunks asks.
void require_cut_plan(const char* op, const GdnShapes& s, const GdnPlan& plan) {
  TORCH_CHECK(s.N == 0 || plan.seg_chunks > 0, op, ": the plan does not cut these documents "
              "(deterministic=False without segment_chunks): pass deterministic=True or segment_chunks > 0");
}

// The gather (gdn_piece_summaries_launch, gdn.h) of the real segments' summaries from the
// call's workspace into `values` and `transfers` at value head hv0.
void take_piece_summaries(const char* op, const char* range, const GdnPlan& plan, const GdnFwdArgs& f, int shift,
                          int64_t hv0, at::Tensor& values, at::Tensor& transfers) {
  GdnPieceSummariesArgs a{};
  a.seg_offsets = f.seg_offsets;
  a.seg_state = f.seg_state;
  a.seg_transfer = f.seg_transfer;
  a.seg_exact = f.seg_exact;
  a.values = values.data_ptr<float>();
  a.transfers = transfers.data_ptr<float>();
  a.N = plan.N;
  a.HV = plan.HV;
  a.out_HV = values.size(1);
  a.hv0 = hv0;
  a.shift = shift;
  launch_stage(op, range, gdn_piece_summaries_launch, a, c10::cuda::getCurrentCUDAStream());
}

// (E, M) per document, each document one segment of its grid (cake::gdn_segment_summaries):
// the forward's plan, prep and summaries of the documents as pieces inside longer ones,
// the summaries read out (take_piece_summaries). The values of two gdn_fwd_final_state
// calls on the same pieces (from zero; from the identity with v = 0) from one prep and one
// pass of summary walks: KCP's relays (docs/kcp.md, "Relays").
std::tuple<at::Tensor, at::Tensor> gdn_segment_summaries(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& g,
                                                        const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                                        double scale, bool use_qk_l2norm, bool deterministic,
                                                        int64_t segment_chunks, int64_t value_splits,
                                                        const std::optional<at::Tensor>& doc_flags) {
  constexpr const char* op = "gdn_segment_summaries";
  constexpr int64_t D = kGdnHeadDim;
  const GdnShapes s = check_gdn_inputs(op, q, k, &v, g, beta, cu_seqlens);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  require_doc_flags(op, doc_flags);
  const GdnPlan plan = check_and_plan_walk(op, s, q, std::nullopt, scale, use_qk_l2norm, deterministic,
                                           segment_chunks, value_splits, /*backward=*/false, 1, false, doc_flags);
  require_cut_plan(op, s, plan);
  GdnFwdCall c = prepare_gdn_fwd(plan, q, k, &v, g, beta, cu_seqlens, std::nullopt, scale, /*outputs=*/false,
                                 nullptr, doc_flags);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  launch_stage(op, "cake::gdn_segment_summaries/plan", gdn_fwd_plan_launch, c.args, stream);
  launch_stage(op, "cake::gdn_segment_summaries/prep", gdn_fwd_prep_launch, c.args, stream);
  launch_stage(op, "cake::gdn_segment_summaries/summaries", gdn_fwd_summary_launch, c.args, stream);
  at::Tensor E = at::empty({s.N, s.HV, D, D}, q.options().dtype(at::kFloat));
  at::Tensor M = at::empty_like(E);
  take_piece_summaries(op, "cake::gdn_segment_summaries/gather", plan, c.args, /*shift=*/1, 0, E, M);
  return {E, M};
}

// The backward's forward-direction recompute (gdn.h gdn_bwd_tapes_launch; docs/kernels.md,
// "Backward tapes"): the forward's plan, prep, summaries and chain, then the walk in tape
// mode, for the same arguments as gdn_fwd (the same checks, the same plan). Returns views
// of the one backward workspace (which also holds the reverse walk's dS and dv_new
// tapes, not returned here): h [NC, HV, 128 (v), 128 (k)] bf16 (S^T at each chunk's
// start), a = A [NC, HV, 64, 64] bf16, chunk_beta [NC, HV, 64] fp32, gcum [NC, HV, 64]
// fp32, qk_lrn [NC, H, 2, 64] fp32 (empty [0] without use_qk_l2norm), chunk_offsets
// [N + 1] int32; NC = ceil(T / 64) + N. Slots from chunk_offsets[N] on are left unwritten.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_bwd_tapes(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm,
    bool deterministic, int64_t segment_chunks, int64_t value_splits) {
  const GdnShapes s = check_gdn_inputs("gdn_bwd_tapes", q, k, &v, g, beta, cu_seqlens);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const GdnPlan plan = check_and_plan_walk("gdn_bwd_tapes", s, q, initial_state, scale, use_qk_l2norm,
                                           deterministic, segment_chunks, value_splits, /*backward=*/true,
                                           /*head_slices=*/1);
  GdnFwdCall c = prepare_gdn_fwd(plan, q, k, &v, g, beta, cu_seqlens, initial_state, scale, /*outputs=*/false);
  const cudaError_t err = gdn_bwd_tapes_launch(c.args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "gdn_bwd_tapes: kernel launch failed: ", cudaGetErrorString(err));
  const int64_t NC = plan.chunk_slots, HV = s.HV, D = kGdnHeadDim, C = kGdnChunk;
  const GdnWorkspaceLayout& w = plan.ws;
  at::Tensor chunk_offsets = workspace_piece(c.workspace, w.chunk_offsets, at::kInt, {s.N + 1});
  if (s.N == 0) chunk_offsets.zero_();  // no document: the plan stage does not run
  at::Tensor qk_lrn = use_qk_l2norm ? workspace_piece(c.workspace, w.chunks + w.chunk.qk_lrn, at::kFloat, {NC, s.H, 2, C})
                                    : at::empty({0}, q.options().dtype(at::kFloat));
  return {workspace_piece(c.workspace, w.chunks + w.chunk.h_tape, at::kBFloat16, {NC, HV, D, D}),
          workspace_piece(c.workspace, w.chunks + w.chunk.a, at::kBFloat16, {NC, HV, C, C}),
          workspace_piece(c.workspace, w.chunks + w.chunk.chunk_beta, at::kFloat, {NC, HV, C}),
          workspace_piece(c.workspace, w.chunks + w.chunk.gcum, at::kFloat, {NC, HV, C}),
          qk_lrn,
          chunk_offsets};
}

// The prep stage alone: (a [NC, HV, 64, 64] bf16 = A per chunk slot, gcum [NC, HV, 64]
// fp32, chunk_beta [NC, HV, 64] fp32, chunk_decay [NC, HV] fp32), NC = ceil(T / 64) + N; slots past
// the last document's last chunk are left unwritten. For tests of the stage and for a
// backward that reuses A.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_fwd_prep(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g,
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
  const GdnWorkspaceLayout& w = plan.ws;
  return {workspace_piece(c.workspace, w.chunks + w.chunk.a, at::kBFloat16, {NC, s.HV, C, C}),
          workspace_piece(c.workspace, w.chunks + w.chunk.gcum, at::kFloat, {NC, s.HV, C}),
          workspace_piece(c.workspace, w.chunks + w.chunk.chunk_beta, at::kFloat, {NC, s.HV, C}),
          workspace_piece(c.workspace, w.chunks + w.chunk.chunk_decay, at::kFloat, {NC, s.HV})};
}

// The backward's reverse walk alone (gdn/bwd_walk.h), uncut (one walk a document), for
// tests of the stage: (dS tape [NC, HV, 128, 128] bf16 ([slot, hv, v, k] = dS_end[k, v]),
// dv_new [T, HV, 128] bf16, dh0 [N, HV, 128, 128] fp32), NC = a.size(0). value_splits: -1
// the plan's choice for these shapes, else 1 or 2 (the bits do not depend on it).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_bwd_walk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& dout, const at::Tensor& a, const at::Tensor& gcum,
    const at::Tensor& chunk_beta, const std::optional<at::Tensor>& qk_lrn, const std::optional<at::Tensor>& dht,
    const at::Tensor& chunk_offsets, const at::Tensor& cu_seqlens, int64_t HV, double scale, int64_t value_splits) {
  constexpr const char* op = "gdn_bwd_walk";
  TORCH_CHECK(value_splits == -1 || value_splits == 1 || value_splits == 2, op,
              ": value_splits must be -1 (the plan's choice), 1 or 2, got ", value_splits);
  constexpr int64_t D = kGdnHeadDim, C = kGdnChunk;
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  TORCH_CHECK(q.dim() == 3, op, ": q must be [T, H, K], got ", q.sizes());
  const int64_t T = q.size(0), H = q.size(1);
  TORCH_CHECK(q.size(2) == D, op, ": q: the CUDA kernels need head dim K = 128, got K = ", q.size(2));
  TORCH_CHECK(H >= 1, op, ": q needs at least one head, got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, op, ": q must be bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must be [T, H, K] = ", q.sizes(), " like q, got ", k.sizes());
  TORCH_CHECK(k.scalar_type() == at::kBFloat16, op, ": k must be bfloat16, got ", k.scalar_type());
  check_same_device(k, q, op, "k", "q");
  TORCH_CHECK(HV >= 1 && HV % H == 0, op, ": HV = ", HV, " must be a positive multiple of q's heads H = ", H);
  TORCH_CHECK(HV < (1 << 24), op, ": HV = ", HV, " must be below 2^24");
  TORCH_CHECK(dout.dim() == 3 && dout.size(0) == T && dout.size(1) == HV && dout.size(2) == D, op,
              ": do must be [T, HV, V] = [", T, ", ", HV, ", 128], got ", dout.sizes());
  TORCH_CHECK(dout.scalar_type() == at::kBFloat16, op, ": do must be bfloat16, got ", dout.scalar_type());
  check_same_device(dout, q, op, "do", "q");
  const int64_t N = check_cu_seqlens(op, cu_seqlens, q, T);
  TORCH_CHECK(chunk_offsets.dim() == 1 && chunk_offsets.numel() == N + 1, op,
              ": chunk_offsets must be [N + 1] = [", N + 1, "], got ", chunk_offsets.sizes());
  TORCH_CHECK(chunk_offsets.scalar_type() == at::kInt, op, ": chunk_offsets must be int32, got ",
              chunk_offsets.scalar_type());
  check_same_device(chunk_offsets, q, op, "chunk_offsets", "q");
  TORCH_CHECK(a.dim() == 4 && a.size(1) == HV && a.size(2) == C && a.size(3) == C, op,
              ": a must be [NC, HV, 64, 64] with HV = ", HV, ", got ", a.sizes());
  const int64_t NC = a.size(0);
  // Every document's chunks fit ceil(T / 64) + N slots (plan.h): the plan's grid, or more.
  TORCH_CHECK(NC >= gdn_fwd_chunk_slots(T, N), op, ": a: NC = ", NC, " chunk slots, fewer than ceil(T / 64) + N = ",
              gdn_fwd_chunk_slots(T, N));
  TORCH_CHECK(NC * HV < (int64_t{1} << 31), op, ": a: NC * HV = ", NC * HV, " must be below 2^31");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16, op, ": a must be bfloat16, got ", a.scalar_type());
  check_same_device(a, q, op, "a", "q");
  TORCH_CHECK(gcum.dim() == 3 && gcum.size(0) == NC && gcum.size(1) == HV && gcum.size(2) == C, op,
              ": gcum must be [NC, HV, 64] = [", NC, ", ", HV, ", 64], got ", gcum.sizes());
  TORCH_CHECK(gcum.scalar_type() == at::kFloat, op, ": gcum must be float32, got ", gcum.scalar_type());
  check_same_device(gcum, q, op, "gcum", "q");
  TORCH_CHECK(chunk_beta.sizes() == gcum.sizes(), op, ": chunk_beta must be [NC, HV, 64] = [", NC, ", ", HV,
              ", 64] like gcum, got ", chunk_beta.sizes());
  TORCH_CHECK(chunk_beta.scalar_type() == at::kFloat, op, ": chunk_beta must be float32, got ",
              chunk_beta.scalar_type());
  check_same_device(chunk_beta, q, op, "chunk_beta", "q");
  if (qk_lrn) {
    TORCH_CHECK(qk_lrn->dim() == 4 && qk_lrn->size(0) == NC && qk_lrn->size(1) == H && qk_lrn->size(2) == 2 &&
                    qk_lrn->size(3) == C,
                op, ": qk_lrn must be [NC, H, 2, 64] = [", NC, ", ", H, ", 2, 64], got ", qk_lrn->sizes());
    TORCH_CHECK(qk_lrn->scalar_type() == at::kFloat, op, ": qk_lrn must be float32, got ", qk_lrn->scalar_type());
    check_same_device(*qk_lrn, q, op, "qk_lrn", "q");
  }
  if (dht) {
    TORCH_CHECK(dht->sizes() == at::IntArrayRef({N, HV, D, D}), op, ": dht must be [N, HV, K, V] = [", N, ", ", HV,
                ", 128, 128], got ", dht->sizes());
    TORCH_CHECK(dht->scalar_type() == at::kFloat, op, ": dht must be float32, got ", dht->scalar_type());
    check_same_device(*dht, q, op, "dht", "q");
  }
  TORCH_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be finite and > 0, got ", scale);
  TORCH_CHECK(T < (int64_t{1} << 31) - C, op, ": q: T = ", T, " tokens must be below 2^31 - 64");

  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const at::Tensor qc = dense16(q), kc = dense16(k), doc = dense16(dout), ac = dense16(a), gc = dense16(gcum),
                   bc = dense16(chunk_beta);
  const at::Tensor lrn = qk_lrn ? dense16(*qk_lrn) : at::Tensor();
  const at::Tensor dhtc = dht ? dht->contiguous() : at::Tensor();
  const at::Tensor offs = chunk_offsets.contiguous(), cu = cu_seqlens.contiguous();
  at::Tensor dS = at::empty({NC, HV, D, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dv_new = at::empty({T, HV, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dh0 = at::empty({N, HV, D, D}, q.options().dtype(at::kFloat));

  GdnBwdWalkArgs p{};
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.dout = doc.data_ptr();
  p.a = ac.data_ptr();
  p.gcum = gc.data_ptr<float>();
  p.chunk_beta = bc.data_ptr<float>();
  p.qk_lrn = lrn.defined() ? lrn.data_ptr<float>() : nullptr;
  p.dht = dhtc.defined() ? dhtc.data_ptr<float>() : nullptr;
  p.chunk_offsets = offs.data_ptr<int32_t>();
  p.cu_seqlens = cu.data_ptr();
  p.cu_int64 = cu.scalar_type() == at::kLong;
  p.dS = dS.data_ptr();
  p.dv_new = dv_new.data_ptr();
  p.dh0 = dh0.data_ptr<float>();
  p.T = T;
  p.N = N;
  p.H = p.H_stride = H;
  p.HV = p.HV_stride = HV;
  p.scale = static_cast<float>(scale);
  // Uncut: segment n is document n (seg_chunks = 0), no summaries, no cut workspaces.
  const at::Tensor seg_offsets = at::arange(N + 1, q.options().dtype(at::kInt));
  p.seg_offsets = seg_offsets.data_ptr<int32_t>();
  int sm_count = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.device().index());
  TORCH_CHECK(err == cudaSuccess, op, ": cannot read the SM count: ", cudaGetErrorString(err));
  const GdnPlan plan = gdn_fwd_make_plan(T, N, H, HV, qk_lrn.has_value(), /*deterministic=*/true, sm_count,
                                         /*segment_chunks=*/0, static_cast<int>(value_splits));
  p.value_splits = p.summary_splits = plan.walk_splits;
  err = gdn_bwd_walk_launch(p, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {dS, dv_new, dh0};
}

// The backward's chunk-local gradients alone (gdn/bwd_local.h), for tests of the stage,
// fed tapes from anywhere (the backward's walks, or cake_ops/pytorch/gdn.py).
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
    const at::Tensor& dS, const at::Tensor& dv_new,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& dht,
    const at::Tensor& chunk_offsets, const at::Tensor& cu_seqlens, double scale, bool use_qk_l2norm) {
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
  const int64_t N = check_cu_seqlens(kOp, cu_seqlens, q, T);
  const int64_t NC = gdn_fwd_chunk_slots(T, N);
  TORCH_CHECK(T < (int64_t{1} << 31) - C && NC * HV < (int64_t{1} << 31) && NC * H < (int64_t{1} << 31), kOp,
              ": T = ", T, ", N = ", N, ", HV = ", HV, " exceed the kernel's 32-bit grid");
  check_tensor(chunk_offsets, q, "chunk_offsets", {N + 1}, at::kInt, "[N + 1] int32");
  check_tensor(gcum, q, "gcum", {NC, HV, C}, at::kFloat, "[NC, HV, 64] with NC = ceil(T / 64) + N");
  check_tensor(A, q, "A", {NC, HV, C, C}, at::kBFloat16, "[NC, HV, 64, 64] with NC = ceil(T / 64) + N");
  check_tensor(h, q, "h", {NC, HV, D, D}, at::kBFloat16, "[NC, HV, 128 (V), 128 (K)] (S^T)");
  check_tensor(dS, q, "dS", {NC, HV, D, D}, at::kBFloat16, "[NC, HV, 128 (V), 128 (K)] (dS^T)");
  check_tensor(dv_new, q, "dv_new", {T, HV, D}, at::kBFloat16, "[T, HV, 128] like v");
  if (initial_state) check_tensor(*initial_state, q, "initial_state", {N, HV, D, D}, at::kFloat, "[N, HV, K, V]");
  if (dht) check_tensor(*dht, q, "dht", {N, HV, D, D}, at::kFloat, "[N, HV, K, V]");
  TORCH_CHECK(std::isfinite(scale) && scale > 0, kOp, ": scale must be finite and > 0, got ", scale);

  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const at::Tensor q_ = dense16(q), k_ = dense16(k), v_ = dense16(v), do_ = dense16(dout), A_ = dense16(A),
                   h_ = dense16(h), ds_ = dense16(dS), dvn_ = dense16(dv_new);
  const at::Tensor g_ = g.contiguous(), beta_ = beta.contiguous(), gcum_ = gcum.contiguous(),
                   co_ = chunk_offsets.contiguous(), cu_ = cu_seqlens.contiguous();
  const at::Tensor h0_ = initial_state ? initial_state->contiguous() : at::Tensor();
  const at::Tensor dht_ = dht ? dht->contiguous() : at::Tensor();
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
  a.ds = ds_.data_ptr();
  a.dv_new = dvn_.data_ptr();
  a.initial_state = h0_.defined() ? h0_.data_ptr<float>() : nullptr;
  a.dht = dht_.defined() ? dht_.data_ptr<float>() : nullptr;
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
  a.H = a.H_stride = H;
  a.HV = a.HV_stride = HV;
  a.scale = static_cast<float>(scale);
  a.use_qk_l2norm = use_qk_l2norm;
  const cudaError_t err = gdn_bwd_local_launch(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, kOp, ": kernel launch failed: ", cudaGetErrorString(err));
  return {dq, dk, dv, dg, dbeta};
}


// A pointer `heads` heads on in a tensor whose heads are `head_elems` elements of
// `elem_bytes` each (a head slice's first head).
template <class T>
T* heads_on(T* p, int64_t heads, int64_t head_elems, int64_t elem_bytes) {
  using Byte = std::conditional_t<std::is_const_v<T>, const unsigned char, unsigned char>;
  return p == nullptr ? nullptr
                      : reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + heads * head_elems * elem_bytes);
}

// The shapes and head strides a backward stage takes from its slice's forward args (the
// same fields in GdnBwdWalkArgs and GdnBwdLocalArgs).
template <class StageArgs>
void set_stage_shapes(StageArgs& a, const GdnFwdArgs& f, double scale) {
  a.T = f.T;
  a.N = f.N;
  a.H = f.H;
  a.HV = f.HV;
  a.H_stride = f.H_stride;
  a.HV_stride = f.HV_stride;
  a.scale = static_cast<float>(scale);
}

// A stream beside the call's for work independent of what the call's stream runs
// meanwhile, ordered by events (which CUDA graph capture records as the graph's edges):
// fork() makes the side stream wait for what the call's stream has launched so far,
// join() the call's stream for what the side stream has. Work launched between fork and
// join may read and write only what the call's stream does not touch meanwhile.
class SideStream {
 public:
  SideStream(c10::DeviceIndex device, cudaStream_t main)
      : main_(main), side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device).stream()) {
    TORCH_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming) == cudaSuccess &&
                    cudaEventCreateWithFlags(&join_, cudaEventDisableTiming) == cudaSuccess,
                "gdn_bwd: cannot create the side stream's events");
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    cudaEventDestroy(fork_);
    cudaEventDestroy(join_);
  }
  cudaStream_t stream() const { return side_; }
  void fork() { order(main_, side_, fork_); }
  void join() { order(side_, main_, join_); }

 private:
  static void order(cudaStream_t from, cudaStream_t to, cudaEvent_t event) {
    cudaError_t err = cudaEventRecord(event, from);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(to, event, 0);
    TORCH_CHECK(err == cudaSuccess, "gdn_bwd: cannot order the side stream: ", cudaGetErrorString(err));
  }
  cudaStream_t main_, side_;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

// The checks of a backward's do (o's gradient: bf16 [T, HV, V]) and dht (the final
// state's: fp32 [N, HV, K, V], or none).
void check_gdn_grads(const char* op, const GdnShapes& s, const at::Tensor& dout, const std::optional<at::Tensor>& dht,
                     const at::Tensor& q) {
  constexpr int64_t D = kGdnHeadDim;
  TORCH_CHECK(dout.sizes() == at::IntArrayRef({s.T, s.HV, D}), op, ": do must be [T, HV, V] = [", s.T, ", ", s.HV,
              ", 128], got ", dout.sizes());
  TORCH_CHECK(dout.scalar_type() == at::kBFloat16, op, ": do must be bfloat16, got ", dout.scalar_type());
  check_same_device(dout, q, op, "do", "q");
  if (dht) {
    TORCH_CHECK(dht->sizes() == at::IntArrayRef({s.N, s.HV, D, D}), op, ": dht must be [N, HV, K, V] = [", s.N, ", ",
                s.HV, ", 128, 128], got ", dht->sizes());
    TORCH_CHECK(dht->scalar_type() == at::kFloat, op, ": dht must be float32, got ", dht->scalar_type());
    check_same_device(*dht, q, op, "dht", "q");
  }
}

// The reverse walk's arguments for one head slice (first value head hv0) of a backward
// whose recompute args are `f`: dv_new to `dv_new` (the slice's first head), dh0 to
// `dh0`'s rows of the slice. The forward's cut grid; the cuts' workspaces are the
// backward's own where the walk runs beside the recompute's (`beside_recompute`), else
// the forward's seg_ pieces (bwd_walk.h).
GdnBwdWalkArgs reverse_walk_args(const GdnPlan& plan, const GdnFwdArgs& f, unsigned char* ws, bool beside_recompute,
                                 const at::Tensor& dout, const at::Tensor& dht, int64_t hv0, void* dv_new,
                                 const at::Tensor& dh0, double scale) {
  constexpr int64_t D = kGdnHeadDim;
  const bool inner = plan.inner_slots > 0;
  GdnBwdWalkArgs r{};
  r.q = f.q;
  r.k = f.k;
  r.dout = heads_on<const void>(dout.data_ptr(), hv0, D, 2);
  r.a = f.a;
  r.gcum = f.gcum;
  r.chunk_beta = f.chunk_beta;
  r.qk_lrn = f.qk_lrn;
  r.dht = dht.defined() ? heads_on<const float>(dht.data_ptr<float>(), hv0, D * D, 4) : nullptr;
  r.chunk_offsets = f.chunk_offsets;
  r.cu_seqlens = f.cu_seqlens;
  r.cu_int64 = f.cu_int64;
  r.dS = ws + plan.ws.dS_tape;
  r.dv_new = dv_new;
  r.dh0 = heads_on(dh0.data_ptr<float>(), hv0, D * D, 4);
  r.seg_offsets = f.seg_offsets;
  r.chunk_decay = f.chunk_decay;
  r.seg_grad = !inner ? nullptr : beside_recompute ? reinterpret_cast<float*>(ws + plan.ws.bwd_seg_grad) : f.seg_state;
  r.seg_transfer = !inner ? nullptr
                   : beside_recompute ? reinterpret_cast<float*>(ws + plan.ws.bwd_seg_transfer)
                                      : f.seg_transfer;
  r.seg_exact = !inner ? nullptr
                : beside_recompute ? reinterpret_cast<int32_t*>(ws + plan.ws.bwd_seg_exact)
                                   : f.seg_exact;
  r.seg_chunks = f.seg_chunks;
  r.seg_long_max = f.seg_long_max;
  r.inner_slots = plan.inner_slots;
  r.doc_flags = f.doc_flags;
  set_stage_shapes(r, f, scale);
  r.value_splits = f.walk_splits;
  r.summary_splits = f.summary_splits;
  return r;
}

// A head slice's forward args: its first q/k head h0 and value head hv0, the tensors'
// pointers there, with the rows' strides of all heads (GdnFwdCoreArgs::H_stride).
GdnFwdArgs head_slice_args(const GdnFwdArgs& all, int64_t h0, int64_t hv0, int64_t beta_bytes) {
  constexpr int64_t D = kGdnHeadDim;
  GdnFwdArgs f = all;
  f.q = heads_on(f.q, h0, D, 2);
  f.k = heads_on(f.k, h0, D, 2);
  f.v = heads_on(f.v, hv0, D, 2);
  f.g = heads_on(f.g, hv0, 1, 4);
  f.beta = heads_on(f.beta, hv0, 1, beta_bytes);
  f.initial_state = heads_on(f.initial_state, hv0, D * D, 4);
  return f;
}

// The whole backward (docs/kernels.md, "Backward"): per head slice (the plan's; docs/kernels.md,
// "Head slices"), the recompute of the forward's tapes with the forward's own plan
// (gdn_bwd_tapes_launch), the reverse walk of the state gradient (the dS tape, dv_new,
// dh0), then the chunk-local gradients; one workspace of one slice's size, which every
// slice reuses in stream order. dv_new goes to dv's memory, which the chunk-local
// gradients overwrite with dv. The reverse walk reads only the recompute's plan offsets, A
// and gates, so it runs on a side stream beside the recompute's summaries, chain and tape
// walk (its own cuts' pieces: plan.h, bwd_seg_*): the walks each leave SMs idle in their
// last round and the summaries on their few slow heads, which the other fills.
// Returns (dq, dk, dv, dg, dbeta, dh0) in the dtypes of (q, k, v, g, beta) and fp32 dh0
// [N, HV, K, V]. do arrives as o's gradient (bf16 [T, HV, V]), dht as the final state's
// (fp32 [N, HV, K, V]) or none. head_slices: -1 lets the plan choose, else a divisor of H
// (the bits do not depend on it). tapes: the full save mode's per-chunk block from
// gdn_fwd_full for the same arguments, or none: with it the backward recomputes nothing
// but the plan's offsets (one slice), and its gradients are bitwise those without it.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_bwd(
    const at::Tensor& dout, const std::optional<at::Tensor>& dht, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& cu_seqlens,
    const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm, bool deterministic,
    int64_t segment_chunks, int64_t value_splits, int64_t head_slices, const std::optional<at::Tensor>& tapes,
    const std::optional<at::Tensor>& doc_flags) {
  constexpr const char* op = "gdn_bwd";
  constexpr int64_t D = kGdnHeadDim;
  const GdnShapes s = check_gdn_inputs(op, q, k, &v, g, beta, cu_seqlens);
  check_gdn_grads(op, s, dout, dht, q);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  if (tapes) {
    const int64_t bytes = gdn_chunk_layout(s.T, s.N, s.H, s.HV, use_qk_l2norm, /*with_tapes=*/true).bytes;
    TORCH_CHECK(tapes->dim() == 1 && tapes->numel() == bytes && tapes->scalar_type() == at::kByte &&
                    tapes->is_contiguous(),
                op, ": tapes must be the uint8 [", bytes, "] tensor gdn_fwd_full returned for these shapes and "
                "use_qk_l2norm, got ", tapes->scalar_type(), " ", tapes->sizes());
    check_same_device(*tapes, q, op, "tapes", "q");
  }
  const GdnPlan plan = check_and_plan_walk(op, s, q, initial_state, scale, use_qk_l2norm, deterministic,
                                           segment_chunks, value_splits, /*backward=*/true, head_slices,
                                           tapes.has_value(), doc_flags);
  const GdnFwdCall c = prepare_gdn_fwd(plan, q, k, &v, g, beta, cu_seqlens, initial_state, scale, /*outputs=*/false,
                                       tapes ? &*tapes : nullptr, doc_flags);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dout_c = dense16(dout);
  const at::Tensor dht_c = dht ? dht->contiguous() : at::Tensor();
  unsigned char* ws = static_cast<unsigned char*>(c.workspace.data_ptr());
  at::Tensor dq = at::empty({s.T, s.H, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dk = at::empty({s.T, s.H, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dv = at::empty({s.T, s.HV, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dg = at::empty({s.T, s.HV}, q.options().dtype(at::kFloat));
  at::Tensor dbeta = at::empty({s.T, s.HV}, q.options().dtype(beta.scalar_type()));
  at::Tensor dh0 = at::empty({s.N, s.HV, D, D}, q.options().dtype(at::kFloat));
  const int64_t beta_bytes = c.beta.element_size();
  // Kept tapes: nothing to run beside the reverse walk.
  std::optional<SideStream> side;
  if (!tapes) side.emplace(q.device().index(), stream);

  for (int slice = 0; slice < plan.head_slices; ++slice) {
    const int64_t h0 = slice * plan.H, hv0 = slice * plan.HV;
    const GdnFwdArgs f = head_slice_args(c.args, h0, hv0, beta_bytes);
    // Kept tapes: only the plan kernel's offsets (the backward's own plan: its cut grid
    // may differ from the forward's where the SM count does).
    if (tapes)
      launch_stage(op, "cake::gdn_bwd/plan", gdn_fwd_plan_launch, f, stream);
    else
      launch_stage(op, "cake::gdn_bwd/tapes_prep", gdn_bwd_tapes_prep_launch, f, stream);

    const GdnBwdWalkArgs r = reverse_walk_args(plan, f, ws, side.has_value(), dout_c, dht_c, hv0,
                                               heads_on(dv.data_ptr(), hv0, D, 2), dh0, scale);
    if (side) {
      side->fork();
      launch_stage(op, "cake::gdn_bwd/reverse_walk", gdn_bwd_walk_launch, r, side->stream());
      launch_stage(op, "cake::gdn_bwd/tapes_walk", gdn_bwd_tapes_walk_launch, f, stream);
      side->join();
    } else {
      launch_stage(op, "cake::gdn_bwd/reverse_walk", gdn_bwd_walk_launch, r, stream);
    }

    GdnBwdLocalArgs l{};
    l.q = f.q;
    l.k = f.k;
    l.v = f.v;
    l.dout = r.dout;
    l.g = f.g;
    l.beta = f.beta;
    l.beta_dtype = f.beta_dtype;
    l.gcum = f.gcum;
    l.a = f.a;
    l.h = f.h_tape;
    l.ds = r.dS;
    l.dv_new = r.dv_new;
    l.initial_state = f.initial_state;
    l.dht = r.dht;
    l.chunk_offsets = f.chunk_offsets;
    l.cu_seqlens = f.cu_seqlens;
    l.cu_int64 = f.cu_int64;
    l.dq = heads_on(dq.data_ptr(), h0, D, 2);
    l.dk = heads_on(dk.data_ptr(), h0, D, 2);
    l.dv = r.dv_new;
    l.dg = heads_on(dg.data_ptr<float>(), hv0, 1, 4);
    l.dbeta = heads_on(dbeta.data_ptr(), hv0, 1, beta_bytes);
    set_stage_shapes(l, f, scale);
    l.use_qk_l2norm = use_qk_l2norm;
    l.doc_flags = f.doc_flags;
    launch_stage(op, "cake::gdn_bwd/local", gdn_bwd_local_launch, l, stream);
  }
  return {dq, dk, dv, dg, dbeta, dh0};
}

// The initial states' gradient alone (cake::gdn_bwd_initial_state): per head slice the
// backward's prep and reverse walk, on the backward's plan, so dh0 is bitwise gdn_bwd's;
// no tape walk, no chunk-local gradients, and of the reverse walk only each document's
// first segment (its cuts' summaries and chain give that segment's end gradient as in
// gdn_bwd). The walk reads q, k, the gates and do only (dS's recursion holds no state), so
// there is no v and no initial state. dv_new, which the walk writes on its way, goes to a
// scratch tensor.
at::Tensor gdn_bwd_initial_state(const at::Tensor& dout, const std::optional<at::Tensor>& dht, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& g, const at::Tensor& beta,
                                 const at::Tensor& cu_seqlens, double scale, bool use_qk_l2norm, bool deterministic,
                                 int64_t segment_chunks, int64_t value_splits,
                                 const std::optional<at::Tensor>& doc_flags) {
  constexpr const char* op = "gdn_bwd_initial_state";
  constexpr int64_t D = kGdnHeadDim;
  const GdnShapes s = check_gdn_inputs(op, q, k, nullptr, g, beta, cu_seqlens);
  check_gdn_grads(op, s, dout, dht, q);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  const GdnPlan plan = check_and_plan_walk(op, s, q, std::nullopt, scale, use_qk_l2norm, deterministic,
                                           segment_chunks, value_splits, /*backward=*/true, -1, false, doc_flags);
  const GdnFwdCall c = prepare_gdn_fwd(plan, q, k, nullptr, g, beta, cu_seqlens, std::nullopt, scale,
                                       /*outputs=*/false, nullptr, doc_flags);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dout_c = dense16(dout);
  const at::Tensor dht_c = dht ? dht->contiguous() : at::Tensor();
  unsigned char* ws = static_cast<unsigned char*>(c.workspace.data_ptr());
  at::Tensor dv_new = at::empty({s.T, s.HV, D}, q.options().dtype(at::kBFloat16));
  at::Tensor dh0 = at::empty({s.N, s.HV, D, D}, q.options().dtype(at::kFloat));
  for (int slice = 0; slice < plan.head_slices; ++slice) {
    const int64_t h0 = slice * plan.H, hv0 = slice * plan.HV;
    const GdnFwdArgs f = head_slice_args(c.args, h0, hv0, c.beta.element_size());
    launch_stage(op, "cake::gdn_bwd_initial_state/prep", gdn_bwd_tapes_prep_launch, f, stream);
    GdnBwdWalkArgs r = reverse_walk_args(plan, f, ws, /*beside_recompute=*/false, dout_c, dht_c, hv0,
                                         heads_on(dv_new.data_ptr(), hv0, D, 2), dh0, scale);
    r.first_segments_only = true;
    launch_stage(op, "cake::gdn_bwd_initial_state/reverse_walk", gdn_bwd_walk_launch, r, stream);
  }
  return dh0;
}

// (F, B) per document, each document one segment of its grid
// (cake::gdn_segment_grad_summaries): per head slice the backward's plan and prep and the
// reverse walk's cut summaries of the documents as pieces inside longer ones, read out
// (take_piece_summaries). The values of two gdn_bwd_initial_state calls on the same pieces
// (do without dht; dht = I with do = 0) from one prep and one pass of summary walks: KCP's
// relays (docs/kcp.md, "Relays").
std::tuple<at::Tensor, at::Tensor> gdn_segment_grad_summaries(const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& g,
                                                             const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                                             double scale, bool use_qk_l2norm, bool deterministic,
                                                             int64_t segment_chunks, int64_t value_splits,
                                                             const std::optional<at::Tensor>& doc_flags) {
  constexpr const char* op = "gdn_segment_grad_summaries";
  constexpr int64_t D = kGdnHeadDim;
  const GdnShapes s = check_gdn_inputs(op, q, k, nullptr, g, beta, cu_seqlens);
  check_gdn_grads(op, s, dout, std::nullopt, q);
  const c10::cuda::OptionalCUDAGuard device_guard(q.device());
  require_doc_flags(op, doc_flags);
  const GdnPlan plan = check_and_plan_walk(op, s, q, std::nullopt, scale, use_qk_l2norm, deterministic,
                                           segment_chunks, value_splits, /*backward=*/true, -1, false, doc_flags);
  require_cut_plan(op, s, plan);
  const GdnFwdCall c = prepare_gdn_fwd(plan, q, k, nullptr, g, beta, cu_seqlens, std::nullopt, scale,
                                       /*outputs=*/false, nullptr, doc_flags);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor dout_c = dense16(dout);
  unsigned char* ws = static_cast<unsigned char*>(c.workspace.data_ptr());
  at::Tensor F = at::empty({s.N, s.HV, D, D}, q.options().dtype(at::kFloat));
  at::Tensor B = at::empty_like(F);
  for (int slice = 0; slice < plan.head_slices; ++slice) {
    const int64_t h0 = slice * plan.H, hv0 = slice * plan.HV;
    const GdnFwdArgs f = head_slice_args(c.args, h0, hv0, c.beta.element_size());
    launch_stage(op, "cake::gdn_segment_grad_summaries/prep", gdn_bwd_tapes_prep_launch, f, stream);
    GdnBwdWalkArgs r = reverse_walk_args(plan, f, ws, /*beside_recompute=*/false, dout_c, at::Tensor(), hv0,
                                         nullptr, F, scale);
    r.dh0 = nullptr;  // the summaries write only the cuts' pieces: no dh0, dS tape or dv_new
    r.dS = nullptr;
    launch_stage(op, "cake::gdn_segment_grad_summaries/reverse_summaries", gdn_bwd_reverse_summary_launch, r,
                 stream);
    take_piece_summaries(op, "cake::gdn_segment_grad_summaries/gather", plan, f, /*shift=*/0, hv0, F, B);
  }
  return {F, B};
}

// The bytes of the one workspace a call allocates beside its inputs and outputs (the
// plan's GdnPlan::ws; docs/kernels.md, "Workspaces"), for a gdn_fwd (tapes: gdn_fwd_full)
// or gdn_bwd (tapes: given the full save mode's tapes) call of these shapes on the current
// device, whose SM count the plan reads, with the cut grid segment_chunks (as gdn_fwd takes
// it). The caller's allocator holds it rounded up to 512.
int64_t gdn_workspace_bytes(int64_t T, int64_t N, int64_t H, int64_t HV, bool use_qk_l2norm, bool deterministic,
                            bool backward, bool tapes, int64_t segment_chunks, bool doc_flags) {
  constexpr const char* op = "gdn_workspace_bytes";
  TORCH_CHECK(T >= 0 && N >= 1 && H >= 1 && HV >= H && HV % H == 0, op,
              ": needs T >= 0, N >= 1 documents and HV a multiple of H >= 1, got T = ", T, ", N = ", N, ", H = ", H,
              ", HV = ", HV);
  TORCH_CHECK(segment_chunks >= -1 && segment_chunks <= (1 << 20), op, ": segment_chunks must be -1 (the plan's "
              "choice), 0 (uncut) or a cut grid in chunks, got ", segment_chunks);
  int sm_count = 0;
  const cudaError_t err =
      cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, c10::cuda::current_device());
  TORCH_CHECK(err == cudaSuccess, op, ": cannot read the SM count: ", cudaGetErrorString(err));
  const int grid = static_cast<int>(segment_chunks);
  const GdnPlan plan =
      backward ? gdn_bwd_make_plan(T, N, H, HV, use_qk_l2norm, deterministic, sm_count, grid, -1, -1, tapes, doc_flags)
               : gdn_fwd_make_plan(T, N, H, HV, use_qk_l2norm, deterministic, sm_count, grid, -1, tapes, doc_flags);
  return plan.ws.bytes;
}

}  // namespace
}  // namespace cake

TORCH_LIBRARY_FRAGMENT(cake_cuda, m) {
  m.def(
      "gdn_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? initial_state, float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, "
      "int value_splits=-1, Tensor? doc_flags=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "gdn_fwd_prep(Tensor q, Tensor k, Tensor g, Tensor beta, Tensor cu_seqlens, bool use_qk_l2norm) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gdn_bwd_tapes(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? initial_state, float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, "
      "int value_splits=-1) "
      "-> (Tensor h, Tensor a, Tensor chunk_beta, Tensor gcum, Tensor qk_lrn, Tensor chunk_offsets)");
  m.def(
      "gdn_bwd_walk(Tensor q, Tensor k, Tensor do, Tensor a, Tensor gcum, Tensor chunk_beta, Tensor? qk_lrn, Tensor? dht, "
      "Tensor chunk_offsets, Tensor cu_seqlens, int HV, float scale, int value_splits=-1) "
      "-> (Tensor dS, Tensor dv_new, Tensor dh0)");
  m.def(
      "gdn_bwd_local(Tensor q, Tensor k, Tensor v, Tensor do, Tensor g, Tensor beta, Tensor gcum, Tensor A, "
      "Tensor h, Tensor dS, Tensor dv_new, Tensor? initial_state, Tensor? dht, Tensor chunk_offsets, "
      "Tensor cu_seqlens, float scale, bool use_qk_l2norm) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta)");
  m.def(
      "gdn_bwd(Tensor do, Tensor? dht, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? initial_state, float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, "
      "int value_splits=-1, int head_slices=-1, Tensor? tapes=None, Tensor? doc_flags=None) -> (Tensor dq, "
      "Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dh0)");
  m.def(
      "gdn_bwd_initial_state(Tensor do, Tensor? dht, Tensor q, Tensor k, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, int value_splits=-1, "
      "Tensor? doc_flags=None) -> Tensor");
  m.def(
      "gdn_fwd_final_state(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? initial_state, float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, "
      "int value_splits=-1, Tensor? doc_flags=None) -> Tensor");
  m.def(
      "gdn_segment_summaries(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, float scale, "
      "bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, int value_splits=-1, Tensor? doc_flags=None) "
      "-> (Tensor E, Tensor M)");
  m.def(
      "gdn_segment_grad_summaries(Tensor do, Tensor q, Tensor k, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, int value_splits=-1, "
      "Tensor? doc_flags=None) -> (Tensor F, Tensor B)");
  m.def("gdn_state_chain(Tensor E, Tensor M, Tensor S_start, Tensor seg_cu) -> Tensor");
  m.def("gdn_state_grad_chain(Tensor F, Tensor B, Tensor dS_end, Tensor seg_cu) -> Tensor");
  m.def(
      "gdn_fwd_full(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
      "Tensor? initial_state, float scale, bool use_qk_l2norm, bool deterministic, int segment_chunks=-1, "
      "int value_splits=-1, Tensor? doc_flags=None) -> (Tensor, Tensor, Tensor tapes)");
  m.def(
      "gdn_workspace_bytes(int T, int N, int H, int HV, bool use_qk_l2norm, bool deterministic, bool backward, "
      "bool tapes, int segment_chunks=-1, bool doc_flags=False) -> int",
      &cake::gdn_workspace_bytes);
}

TORCH_LIBRARY_IMPL(cake_cuda, CUDA, m) {
  m.impl("gdn_fwd", &cake::gdn_fwd);
  m.impl("gdn_fwd_prep", &cake::gdn_fwd_prep);
  m.impl("gdn_bwd_tapes", &cake::gdn_bwd_tapes);
  m.impl("gdn_bwd_walk", &cake::gdn_bwd_walk);
  m.impl("gdn_bwd_local", &cake::gdn_bwd_local);
  m.impl("gdn_bwd", &cake::gdn_bwd);
  m.impl("gdn_fwd_full", &cake::gdn_fwd_full);
  m.impl("gdn_bwd_initial_state", &cake::gdn_bwd_initial_state);
  m.impl("gdn_fwd_final_state", &cake::gdn_fwd_final_state);
  m.impl("gdn_segment_summaries", &cake::gdn_segment_summaries);
  m.impl("gdn_segment_grad_summaries", &cake::gdn_segment_grad_summaries);
  m.impl("gdn_state_chain", &cake::gdn_state_chain);
  m.impl("gdn_state_grad_chain", &cake::gdn_state_grad_chain);
}
