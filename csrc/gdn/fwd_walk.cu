// Forward walk of the chunked gated delta rule (gdn.h; docs/kernels.md, "Forward
// stages"), in three modes (WalkMode, fwd_walk_layout.cuh):
//   output:  the walk of one segment (a whole document when uncut) with the output fused,
//            from the segment's start state; the last segment writes the final state;
//   tape:    the backward's recompute: the output mode's walks (same start states, same
//            chain instructions), writing per chunk the h tape instead of o (no q, P~
//            or O; no final state; fwd_walk_tapes.cuh); without a tape, the documents'
//            last segments only, for their final states (gdn_fwd_final_state);
//   output and tape: both at once, the forward of the full save mode (its tape is
//            bitwise tape mode's: the same chain instructions, the same fragments);
//   reverse: the backward's reverse walk of the state gradient (gdn/bwd_walk.h) on this
//            CTA, from each segment's last chunk to its first: the dS tape and dv_new
//            (fwd_walk_reverse.cuh), launched by gdn_bwd_reverse_walk_launch; and its cut
//            summaries F and M^T (gdn_bwd_reverse_summary_launch);
//   summary: the walk of one segment without output, from zero (E_s; segment 0 from the
//            initial state) or from the identity with v = 0 (M_s), written to the
//            segment workspaces for the chain (fwd_chain.cu); at a truncated cut
//            (docs/kernels.md, "Truncated cuts") E_s over the truncation window only,
//            from zero, and no M_s.
// This file: the kernel, the tensor-map encoding and the launch. Its parts:
//   fwd_walk_layout.cuh     warpgroups, registers, the stage ring, the named barriers
//   fwd_walk_scheduler.cuh  which walk a CTA runs: find_walk, truncation_start, the queue
//   fwd_walk_loads.cuh      the aux warpgroup: TMA loads, ragged-row zeroing, P~, gate vectors
//   fwd_walk_state.cuh      the state warpgroups: the chain S -> U -> X -> S, O^T
//   fwd_walk_reverse.cuh    the reverse walk's state warpgroups: dS -> dv_new -> X -> dS
//   fwd_walk_output.cuh     the o epilogue
//   fwd_walk_tapes.cuh      the h epilogue of tape mode
//
// One CTA per (segment, value head[, E or M]) (summaries: a persistent grid, the CTAs
// taking these walks from a queue), three warpgroups with separate jobs:
//   state warpgroups 0 and 1: each holds 64 rows (value columns) of the transposed state
//     S^T (64 x 128 fp32, 64 registers per thread) across all chunks of the document
//     and runs the serial chain plus the output of its columns;
// or, split by value columns (value_splits = 2, for shapes with fewer walks than half
// the SMs), two CTAs per (segment, value head[, E or M]), each with one state warpgroup
// for its half of the columns and the aux warpgroup (then warpgroup 1);
//   aux warpgroup 2: loads chunks ahead (TMA, one thread; rows past the document's end
//     zeroed) into a ring of three stages, and per chunk forms what does not depend on
//     the state: P~ and the gate vectors e^gcum_j and e^(gl - gcum_j); with
//     use_qk_l2norm q and k arrive raw, with their rows' log2 inverse norms from the
//     prep, which the aux folds into P~'s exponents and the gate vectors.
// Per chunk, every product is a warpgroup MMA (wgmma, bf16 in, fp32 accumulate), B
// always from shared memory:
//   P    = Q K^T                                   aux    SS  m64n64k128
//   U^T  = S^T K^T                                 state  RS  m64n64k128
//   O^T  = S^T Q^T                                 state  RS  m64n64k128
//   X    = (V^T - e^gcum * U^T) diag(beta) A^T     state  RS  m64n64k64  (X = v_new^T)
//   S^T  = e^gl S^T + (X * e^(gl - gcum)) K        state  RS  m64n128k64 (K MN-major)
//   O^T  = scale e^gcum_i * O^T + X P~^T           state  RS  m64n64k64
// The chain S -> U -> X -> S never leaves registers: S^T, W' = -e^gcum U^T and X are
// accumulators turned into the next product's A fragment (common/wgmma_sm90.cuh).
//
// Why it is as it is:
// - Three warpgroups: with one thread doing loads, gating, exponentials and the chain,
//   the walk was issue-latency bound. The aux warpgroup takes everything that does not
//   need S, so the state warpgroups issue little more than their wgmmas, and setmaxnreg
//   moves registers from the aux warpgroup (few live values) to them.
// - Value columns never mix (every product contracts over the head dim or over tokens),
//   so a value column's result is the same instruction sequence whichever warpgroup, and
//   whichever CTA, runs it: the split is free to depend on the SM count in either mode.
// - The split (docs/kernels.md, "Value split"): a CTA's chunk step is bound by its SM's
//   tensor cores (two state warpgroups plus P~ per chunk); where walks leave SMs idle,
//   one state warpgroup per SM takes a chunk in less time, at the cost of loading q, k, A
//   and forming P~ twice.
// - The step is not the loads' latency nor the A tile's bytes (prefetching and a packed
//   A tile were slower: docs/experiments.md).

#include <algorithm>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gdn/chunks.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/bwd_walk.h"
#include "gdn/fwd_walk_loads.cuh"
#include "gdn/fwd_walk_reverse.cuh"
#include "gdn/fwd_walk_scheduler.cuh"
#include "gdn/fwd_walk_state.cuh"
#include "gdn/gdn.h"
#include "gdn/plan.h"

namespace cake {
namespace {

using namespace gdn_walk;

// Output, tape and reverse modes: one CTA per walk (find_walk). Summary mode: the
// persistent grid and its queue (fwd_walk_scheduler.cuh).
// Each role's loop sits beside its setmaxnreg, so that the compiler sees one register
// budget per code path.
template <WalkMode kMode, int kStateWgs>
__global__ void __launch_bounds__(kWalkThreads<kStateWgs>, 1)
    gdn_fwd_walk_kernel(const GdnFwdCoreArgs p, const __grid_constant__ WalkMaps maps, const WalkTapes tapes) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t load_bar[kStages];
  unsigned char* smem = smem_raw + ((1024 - (mma::smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t bars = mma::smem_addr(load_bar);
  const int wg = threadIdx.x >> 7;
  if constexpr (kMode != WalkMode::kSummary) {
    const Walk w = find_walk<kMode, kStateWgs>(p, blockIdx.x);
    if (!w.run) return;
    if (wg == kStateWgs) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kAuxRegs<kStateWgs>));
      // (A transfer's reverse walk reads do as zeros.)
      const bool with_v = !(kMode == WalkMode::kReverseSummary && w.transfer);
      aux_warpgroup<kMode, kStateWgs>(p, maps, smem, bars, w.hv, w.hv / static_cast<int>(p.HV / p.H), w.seg_start,
                                      w.seg_end, w.nch, w.first_slot, with_v, w.half, false);
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kStateRegs<kStateWgs>));
      if constexpr (walks_reverse(kMode))
        reverse_state_warpgroup<kMode == WalkMode::kReverse, kStateWgs>(
            p, smem, bars, kStateWgs == 2 ? wg : 0, kStateWgs == 2 ? wg : w.half, w.hv, w.seg_start, w.doc_end, w.nch,
            w.S0, w.transfer, w.S_end, w.first_slot, tapes);
      else
        state_warpgroup<kMode, kStateWgs>(p, smem, bars, kStateWgs == 2 ? wg : 0, kStateWgs == 2 ? wg : w.half,
                                          w.hv, w.seg_start, w.doc_end, w.nch, w.S0, false, w.S_end, w.first_slot,
                                          tapes);
    }
  } else {
    __shared__ int32_t taken;  // the walk thread 0 took from the queue
    const int64_t walks = (p.seg_offsets[p.N] - p.N) * p.HV * 2 * (3 - kStateWgs);
    if (walks == 0) return;
    if (wg == kStateWgs) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kAuxRegs<kStateWgs>));
      bool walked = false;  // the load barriers hold an earlier walk's (spent) state
      for (;;) {
        mma::bar_sync(kBarItem, kWalkThreads<kStateWgs>);  // `taken` is written
        const int64_t i = taken;
        if (i >= walks) break;
        const Walk w = find_walk<kMode, kStateWgs>(p, i);
        if (w.run) {
          aux_warpgroup<kMode, kStateWgs>(p, maps, smem, bars, w.hv, w.hv / static_cast<int>(p.HV / p.H),
                                          w.seg_start, w.seg_end, w.nch, w.first_slot, !w.transfer, w.half, walked);
          walked = true;
        }
        mma::bar_sync(kBarItem, kWalkThreads<kStateWgs>);  // the walk is done: its barriers and stages are free
      }
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kStateRegs<kStateWgs>));
      for (;;) {
        take_walk(p.walk_queue, taken);
        mma::bar_sync(kBarItem, kWalkThreads<kStateWgs>);
        const int64_t i = taken;
        if (i >= walks) break;
        const Walk w = find_walk<kMode, kStateWgs>(p, i);
        if (w.run)
          state_warpgroup<kMode, kStateWgs>(p, smem, bars, kStateWgs == 2 ? wg : 0, kStateWgs == 2 ? wg : w.half,
                                            w.hv, w.seg_start, w.doc_end, w.nch, w.S0, w.transfer, w.S_end,
                                            w.first_slot, tapes);
        mma::bar_sync(kBarItem, kWalkThreads<kStateWgs>);  // (every thread has read `taken` before it is rewritten)
      }
    }
  }
}

// The tensor maps for p's tensors (see WalkMaps, fwd_walk_layout.cuh): encoded on the host per call, passed
// by value (so a captured CUDA graph replays them with the launch).
cudaError_t encode_walk_maps(const GdnFwdArgs& p, WalkMaps& m) {
  if (p.T == 0) {  // only empty documents: no chunk is loaded
    m = WalkMaps{};
    return cudaSuccess;
  }
  const uint64_t T = static_cast<uint64_t>(p.T), H = static_cast<uint64_t>(p.H), HV = static_cast<uint64_t>(p.HV);
  // A head slice's tensors (GdnFwdCoreArgs::H_stride) keep the full token rows' stride.
  const uint64_t H_row = static_cast<uint64_t>(p.H_stride), HV_row = static_cast<uint64_t>(p.HV_stride);
  const uint64_t row = kGdnHeadDim * 2;  // bytes of one head's row
  constexpr uint32_t kBoxCols = 64;      // one 128-byte SW128 row of bf16
  constexpr uint64_t kARow = kGdnChunk * 2;  // bytes of one row of an A tile
  cudaError_t err = tma::encode_bf16_3d(&m.q, p.q, kGdnHeadDim, H, T, row, H_row * row, kBoxCols, 1, kGdnChunk);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.k, p.k, kGdnHeadDim, H, T, row, H_row * row, kBoxCols, 1, kGdnChunk);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.v, p.v, kGdnHeadDim, HV, T, row, HV_row * row, kBoxCols, 1, kGdnChunk);
  const uint64_t tiles = static_cast<uint64_t>(gdn_fwd_chunk_slots(p.T, p.N)) * HV;
  if (err == cudaSuccess)
    err = tma::encode_bf16_3d(&m.a, p.a, kGdnChunk, kGdnChunk, tiles, kARow, kGdnChunk * kARow, kGdnChunk, kGdnChunk, 1);
  return err;
}

// The walks of cuts (two kinds a cut) rather than of segments: the summaries.
constexpr bool walks_cuts(WalkMode m) { return m == WalkMode::kSummary || m == WalkMode::kReverseSummary; }

template <WalkMode kMode, int kStateWgs>
cudaError_t launch_walk_ctas(const GdnFwdArgs& p, int64_t items, cudaStream_t stream) {
  auto kernel = gdn_fwd_walk_kernel<kMode, kStateWgs>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWalkSmemBytes<kMode>);
  if (err != cudaSuccess) return err;
  int64_t blocks = items * p.HV * (walks_cuts(kMode) ? 2 : 1) * (3 - kStateWgs);
  if (blocks == 0) return cudaSuccess;
  if constexpr (kMode == WalkMode::kSummary) {  // persistent: at most one CTA per SM (the kernel's occupancy)
    if (p.sm_count <= 0) return cudaErrorInvalidValue;
    blocks = std::min<int64_t>(blocks, p.sm_count);
  }
  WalkMaps maps;
  err = encode_walk_maps(p, maps);
  if (err != cudaSuccess) return err;
  const GdnFwdCoreArgs& core = p;
  const WalkTapes tapes = walks_tapes(kMode) || kMode == WalkMode::kReverse ? WalkTapes{p.h_tape} : WalkTapes{};
  kernel<<<static_cast<unsigned>(blocks), kWalkThreads<kStateWgs>, kWalkSmemBytes<kMode>, stream>>>(core, maps, tapes);
  return cudaGetLastError();
}

template <WalkMode kMode>
cudaError_t launch_walk(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const int finest = gdn_fwd_finest_cut_chunks(p.seg_chunks, p.seg_long_max);
  const bool flags = p.doc_flags != nullptr;
  const int64_t items = walks_cuts(kMode) ? gdn_fwd_inner_segment_slots(p.T, finest, p.N, flags)
                                          : gdn_fwd_segment_slots(p.T, p.N, finest, flags);
  const int splits = walks_cuts(kMode) ? p.summary_splits : p.walk_splits;
  return splits == 2 ? launch_walk_ctas<kMode, 1>(p, items, stream) : launch_walk_ctas<kMode, 2>(p, items, stream);
}

// The reverse walk (bwd_walk.h) as walks of this kernel: its fields carry the reverse
// walk's tensors, v = do, o = dv_new, h_tape = the dS tape, initial_state = dht (the last
// segment's start), seg_state = the cuts' F and then their chained end gradients,
// seg_transfer = their M^T, final_state = dh0 (the first segment's end).
GdnFwdArgs reverse_walk_args(const GdnBwdWalkArgs& r) {
  GdnFwdArgs p{};
  p.q = r.q;
  p.k = r.k;
  p.v = r.dout;
  p.a = const_cast<void*>(r.a);
  p.gcum = const_cast<float*>(r.gcum);
  p.chunk_beta = const_cast<float*>(r.chunk_beta);
  p.qk_lrn = const_cast<float*>(r.qk_lrn);
  p.chunk_offsets = const_cast<int32_t*>(r.chunk_offsets);
  p.seg_offsets = const_cast<int32_t*>(r.seg_offsets);
  p.chunk_decay = const_cast<float*>(r.chunk_decay);
  p.cu_seqlens = r.cu_seqlens;
  p.cu_int64 = r.cu_int64;
  p.initial_state = r.dht;
  p.final_state = r.dh0;
  p.seg_state = r.seg_grad;
  p.seg_transfer = r.seg_transfer;
  p.seg_exact = r.seg_exact;
  p.o = r.dv_new;
  p.h_tape = r.dS;
  p.T = r.T;
  p.N = r.N;
  p.H = r.H;
  p.HV = r.HV;
  p.H_stride = r.H_stride;
  p.HV_stride = r.HV_stride;
  p.seg_chunks = r.seg_chunks;
  p.seg_long_max = r.seg_long_max;
  p.walk_splits = r.value_splits;
  p.summary_splits = r.summary_splits;
  p.scale = r.scale;
  p.use_qk_l2norm = r.qk_lrn != nullptr;
  p.walk_segments = r.first_segments_only ? kGdnWalkFirst : kGdnWalkAll;
  p.doc_flags = r.doc_flags;
  return p;
}

bool reverse_walk_args_ok(const GdnBwdWalkArgs& r) {
  const auto split_ok = [](int s) { return s == 1 || s == 2; };
  return r.seg_offsets != nullptr && split_ok(r.value_splits) && split_ok(r.summary_splits);
}

}  // namespace

cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.h_tape != nullptr) return launch_walk<WalkMode::kOutputTape>(p, stream);
  return launch_walk<WalkMode::kOutput>(p, stream);
}

cudaError_t gdn_fwd_summary_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  return p.seg_chunks > 0 ? launch_walk<WalkMode::kSummary>(p, stream) : cudaSuccess;
}

cudaError_t gdn_fwd_tape_walk_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  if (p.h_tape == nullptr) return cudaErrorInvalidValue;
  return launch_walk<WalkMode::kTape>(p, stream);
}

cudaError_t gdn_fwd_final_state_walk_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  if (p.h_tape != nullptr || p.final_state == nullptr || p.walk_segments != kGdnWalkLast) return cudaErrorInvalidValue;
  return launch_walk<WalkMode::kTape>(p, stream);
}

cudaError_t gdn_bwd_reverse_walk_launch(const GdnBwdWalkArgs& r, cudaStream_t stream) {
  if (r.N <= 0 || r.HV <= 0) return cudaSuccess;
  if (!reverse_walk_args_ok(r)) return cudaErrorInvalidValue;
  return launch_walk<WalkMode::kReverse>(reverse_walk_args(r), stream);
}

cudaError_t gdn_bwd_reverse_summary_launch(const GdnBwdWalkArgs& r, cudaStream_t stream) {
  if (r.N <= 0 || r.HV <= 0 || r.inner_slots <= 0) return cudaSuccess;
  if (!reverse_walk_args_ok(r) || r.seg_grad == nullptr || r.seg_transfer == nullptr || r.seg_exact == nullptr)
    return cudaErrorInvalidValue;
  return launch_walk<WalkMode::kReverseSummary>(reverse_walk_args(r), stream);
}

}  // namespace cake
