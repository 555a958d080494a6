#pragma once

// The walk's aux warpgroup (fwd_walk.cu): the TMA loads of a segment's chunks into the
// stage ring, the zeroing of rows past a ragged chunk's document end, and per chunk what
// does not depend on the state: P~ = scale tril(Q K^T * e^(gcum_i - gcum_j)) (bf16) and
// the gate vectors, with use_qk_l2norm the prep's log2 inverse row norms folded into
// their exponents (fp32; no normalised bf16 copy of q or k exists).
//
// Why it is as it is:
// - Loads by TMA (common/tma_sm90.cuh): a chunk is 7-8 box loads and one 256-byte copy
//   from one thread, completing on the stage's mbarrier. Issued as per-thread cp.async
//   they sat on the critical path (the state warpgroups waited for the aux); with TMA the
//   aux waits for them instead.
// - A box of a ragged chunk reads the next document's rows; the aux zeroes them in shared
//   memory, so no other document's values ever enter (they would meet only zero weights,
//   but 0 * inf = NaN).
// - The aux works in step with the state warpgroups (chunk c's P~, then the loads of
//   c + 2 into the stage they freed after c - 1), not as early as it could: forming P~ as
//   soon as a chunk lands was slower (docs/experiments.md). A reading: its P~ product now
//   lands while a state warpgroup stages its o (no tensor work), and anything that moves
//   it onto the chain's products costs more than the work saved.
// - Exponents are differences of chunk-local cumsums, <= 0 where used (g <= 0; the gate
//   vectors clamp): strong decay underflows to 0; masked elements are selected away,
//   never multiplied by 0.

#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "common/tma_sm90.cuh"
#include "common/wgmma_sm90.cuh"
#include "gdn/fwd_walk_layout.cuh"
#include "gdn/gdn.h"

namespace cake::gdn_walk {


// The aux warpgroup: loads two chunks ahead; P~ and gate vectors one chunk ahead.
// Tokens seg_start .. seg_end - 1 (nch chunks from chunk slot first_slot); with_v = false
// leaves the V tiles zero instead. A split CTA (kStateWgs = 1) loads only the value
// columns of its half vh. load_bar: the stages' load barriers (8 bytes each).
// kTape loads as kSummary does (no q, no P~); kOutputTape as kOutput; the reverse modes as
// kOutput with do in v's place (maps.v), the chunks from the segment's last to its first.
template <WalkMode kMode, int kStateWgs>
__device__ __forceinline__ void aux_warpgroup(const GdnFwdCoreArgs& p, const WalkMaps& maps, unsigned char* smem,
                                              uint32_t load_bar, int hv, int h, int64_t seg_start, int64_t seg_end,
                                              int nch, int64_t first_slot, bool with_v, int vh, bool reinit) {
  constexpr bool kOutput = walks_p(kMode);  // q and P~ are loaded and formed (o, or the reverse walk's dv_new)
  // Step c of the walk is chunk chunk_of(c) of the segment.
  const auto chunk_of = [nch](int c) { return walks_reverse(kMode) ? nch - 1 - c : c; };
  constexpr int kThreads = kWalkThreads<kStateWgs>;
  const int tid = threadIdx.x - 128 * kStateWgs, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // stmatrix: this lane's matrix and row
  const float scale = p.scale;
  const float log2_scale = log2f(scale);  // scale finite and > 0: checked by the binding (gdn/binding.cpp)
  const int seg_len = static_cast<int>(seg_end - seg_start);
  // The V columns loaded: both halves, or the split CTA's (column block vh of the tile).
  constexpr int kVBytes = kStateWgs == 2 ? 2 * 64 * 64 * 2 : 64 * 64 * 2;
  const uint32_t load_bytes = (kOutput ? 64 * kGdnHeadDim * 2 : 0) + 64 * kGdnHeadDim * 2 + (with_v ? kVBytes : 0) +
                              64 * 64 * 2 + 2 * 64 * 4 + (p.use_qk_l2norm ? 128 * 4 : 0);

  // One thread issues a chunk's loads (TMA, see common/tma_sm90.cuh): q, k and v rows from the
  // segment's token row (rows past the tensor's end arrive as zeros; past the document's
  // end, the next document's rows, zeroed below), this (slot, value head)'s A tile, gcum,
  // beta and the rows' log2 inverse norms.
  auto issue_loads = [&](int c) {
    const int stage = c % kStages;
    if (c >= kStages) mma::bar_sync(kBarEmpty + stage, kThreads);  // the state warpgroups are done with c - 3
    if (tid != 0) return;
    const uint32_t st = mma::smem_addr(smem + stage * kStageBytes), bar = load_bar + 8 * stage;
    const int ch = chunk_of(c);
    const int row = static_cast<int>(seg_start) + ch * kGdnChunk;  // T < 2^31 (gdn/binding.cpp)
    const int slot_head = static_cast<int>((first_slot + ch) * p.HV + hv);  // NC * HV < 2^31 (gdn/binding.cpp)
    tma::mbar_arrive_expect_tx(bar, load_bytes);
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      if constexpr (kOutput) tma::load_box_3d(st + kQOff + 8192 * blk, &maps.q, 64 * blk, h, row, bar);
      tma::load_box_3d(st + kKOff + 8192 * blk, &maps.k, 64 * blk, h, row, bar);
      if (with_v && (kStateWgs == 2 || blk == vh)) tma::load_box_3d(st + kVOff + 8192 * blk, &maps.v, 64 * blk, hv, row, bar);
    }
    tma::load_box_3d(st + kAOff, &maps.a, 0, 0, slot_head, bar);
    tma::load_bytes(st + kGOff, p.gcum + static_cast<int64_t>(slot_head) * 64, 64 * 4, bar);
    tma::load_bytes(st + kGOff + kGBeta * 4, p.chunk_beta + static_cast<int64_t>(slot_head) * 64, 64 * 4, bar);
    if (p.use_qk_l2norm)  // the log2 inverse norms of the q and k rows, contiguous as the stage keeps them
      tma::load_bytes(st + kGOff + kGLogRq * 4, p.qk_lrn + ((first_slot + ch) * p.H + h) * 128, 128 * 4, bar);
  };

  if (tid == 0) {  // (reinit: a later walk of a persistent CTA, every phase of the last one waited for)
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      if (reinit) tma::mbar_inval(load_bar + 8 * s);
      tma::mbar_init(load_bar + 8 * s, 1);
    }
    tma::fence_mbar_init();
  }
  if (!with_v) {  // M_s: v = 0 in every stage, never loaded
    for (int i = tid; i < kStages * 64 * 16; i += 128)  // 64 rows of 16 chunks a stage
      *reinterpret_cast<uint4*>(smem + (i >> 10) * kStageBytes + kVOff + (i & 1023) * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
  if (!p.use_qk_l2norm) {  // unit norms: log2 1 = 0 in every stage, never loaded
    for (int i = tid; i < kStages * 128; i += 128)
      reinterpret_cast<float*>(smem + (i >> 7) * kStageBytes + kGOff)[kGLogRq + (i & 127)] = 0.f;
  }
  wgmma::fence_proxy_async();  // the zeros precede later TMA loads into the same stages
  mma::bar_sync(kBarAux, 128);  // the barriers are initialised (and the zeros written)
  if (nch > 0) issue_loads(0);
  if (nch > 1) issue_loads(1);

  for (int c = 0; c < nch; ++c) {
    tma::mbar_wait(load_bar + 8 * (c % kStages), (c / kStages) & 1);  // chunk c has landed
    unsigned char* st = smem + (c % kStages) * kStageBytes;

    // A ragged chunk (the document's last): the rows past its end came from the next
    // document (or are zeros past the tensor's end); zero them, so that a document's
    // results never see another's values (they would only ever meet zero weights, but
    // 0 * inf is NaN). Tiles of 64 rows, block (64 columns) after block.
    const int len = seg_len - chunk_of(c) * kGdnChunk;
    if (len < kGdnChunk) {
      for (int i = tid; i < (kGdnChunk - len) * 16; i += 128) {
        const int r = len + (i >> 4), ch = i & 15;
        const int off = sw128_offset(64, r, ch);
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (kOutput) *reinterpret_cast<uint4*>(st + kQOff + off) = zero;
        *reinterpret_cast<uint4*>(st + kKOff + off) = zero;
        if (with_v && (kStateWgs == 2 || ch >> 3 == vh)) *reinterpret_cast<uint4*>(st + kVOff + off) = zero;
      }
      wgmma::fence_proxy_async();  // read by wgmma
      mma::bar_sync(kBarAux, 128);
    }
    const uint32_t sq = mma::smem_addr(st + kQOff), sk = mma::smem_addr(st + kKOff);
    float* gs = reinterpret_cast<float*>(st + kGOff);

    // Gate vectors for the state warpgroups, in the form they multiply with. beta goes
    // into the decay vector: it scales the rows that A multiplies (the prep's A has no
    // beta), X = (V^T + W') diag(beta) A^T forward and X = dv_new^T A diag(beta) back.
    if (tid < 64) {
      const float gj = gs[tid], gl = gs[kGdnChunk - 1], lrk = gs[kGLogRk + tid];
      gs[kGDecayK + tid] = -gs[kGBeta + tid] * mma::exp2_ftz(fmaf(gj, mma::kLog2e, lrk));
      gs[kGTailK + tid] = mma::exp2_ftz(fmaf(fminf(gl - gj, 0.f), mma::kLog2e, lrk));
      gs[kGOutQ + tid] = mma::exp2_ftz(fmaf(gj, mma::kLog2e, log2_scale + gs[kGLogRq + tid]));
      if (tid == 0) gs[kGGamma] = mma::exp2_ftz(gl * mma::kLog2e);
    }

    // P~ as one product (q read once, one wait; this thread: rows i = 16 warp + gid (+8),
    // columns j = 8 jt + 2 t4 (+1)), as pq * 2^(r_i - c_j) with the row term
    // r_i = gcum_i log2(e) + log2(scale / |q_i|) and the column term
    // c_j = gcum_j log2(e) - log2(1 / |k_j|), for every element, then masked by a select
    // (2^(positive) may be inf above the diagonal).
    // Skipping the groups above the diagonal does not pay (warp 3 has none to skip, and
    // the aux warps meet every chunk) and costs registers.
    if constexpr (kOutput) {
      float pq[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) pq[i] = 0.f;
      wgmma::fence();
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
        wgmma::mma_ss_m64n64k16<0, 0>(pq, wgmma::desc_k_major(sq, 64, ks), wgmma::desc_k_major(sk, 64, ks), ks > 0);
      wgmma::commit();
      float row_term[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * warp + gid + 8 * hh;
        row_term[hh] = fmaf(gs[i], mma::kLog2e, log2_scale + gs[kGLogRq + i]);
      }
      wgmma::wait<0>();
      wgmma::fence_operands(pq);
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {
        const int j = 8 * jt + 2 * t4;
        const float2 gj = *reinterpret_cast<const float2*>(gs + j);
        const float2 lk = *reinterpret_cast<const float2*>(gs + kGLogRk + j);
        const float c0 = fmaf(gj.x, mma::kLog2e, -lk.x), c1 = fmaf(gj.y, mma::kLog2e, -lk.y);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = 16 * warp + gid + 8 * hh;
          const float p0 = pq[4 * jt + 2 * hh] * mma::exp2_ftz(row_term[hh] - c0);
          const float p1 = pq[4 * jt + 2 * hh + 1] * mma::exp2_ftz(row_term[hh] - c1);
          pq[4 * jt + 2 * hh] = j <= i ? p0 : 0.f;
          pq[4 * jt + 2 * hh + 1] = j + 1 <= i ? p1 : 0.f;
        }
      }
      // The accumulator layout is the ldmatrix layout of 16x16 blocks: one stmatrix per block.
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        uint32_t r[4];
        wgmma::to_a_frag(r, pq, kb);
        mma::stmatrix_x4(mma::smem_addr(st + kPOff) + sw128_offset(64, 16 * warp + (mi & 1) * 8 + r8, 2 * kb + (mi >> 1)),
                         r);
      }
    }
    if constexpr (kOutput) wgmma::fence_proxy_async();  // P~ is read by wgmma
    mma::bar_arrive(kBarFull + c % kStages, 256);  // stage c % 3 is ready, for each state warpgroup
    if constexpr (kStateWgs == 2) mma::bar_arrive(kBarFull + 7 + c % kStages, 256);

    // Then chunk c + 2, into the stage the state warpgroups free after chunk c - 1:
    // P~ of chunk c is ready before they ask for it.
    if (c + 2 < nch) issue_loads(c + 2);
  }
}

}  // namespace cake::gdn_walk
