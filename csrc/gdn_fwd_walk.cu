// Forward walk of the chunked gated delta rule (see gdn_fwd.h), in two modes:
//   output:  the walk of one segment (a whole document when uncut) with the output fused,
//            from the segment's start state; the last segment writes the final state;
//   summary: the walk of one segment without output, from zero (E_s; segment 0 from the
//            initial state) or from the identity with v = 0 (M_s), written to the
//            segment workspaces for the chain (gdn_fwd_chain.cu); at a truncated cut
//            (gdn_fwd.h) E_s over the truncation window only, from zero, and no M_s.
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
//     the state:
//     P~ = scale tril(Q K^T * e^(gcum_i - gcum_j)) (bf16) and the gate vectors
//     e^gcum_j and e^(gl - gcum_j); with use_qk_l2norm q and k arrive raw, with their
//     rows' log2 inverse norms from the prep, which the aux folds into P~'s exponents
//     and the gate vectors (fp32; no normalised bf16 copy of q or k exists).
// Per chunk, every product is a warpgroup MMA (wgmma, bf16 in, fp32 accumulate), B
// always from shared memory:
//   P    = Q K^T                                   aux    SS  m64n64k128
//   U^T  = S^T K^T                                 state  RS  m64n64k128
//   O^T  = S^T Q^T                                 state  RS  m64n64k128
//   X    = (V^T - e^gcum * U^T) (A diag(beta))^T   state  RS  m64n64k64  (X = v_new^T)
//   S^T  = e^gl S^T + (X * e^(gl - gcum)) K        state  RS  m64n128k64 (K MN-major)
//   O^T  = scale e^gcum_i * O^T + X P~^T           state  RS  m64n64k64
// The chain S -> U -> X -> S never leaves registers: S^T, W' = -e^gcum U^T and X are
// accumulators turned into the next product's A fragment (wgmma_sm90.cuh).
//
// NOTES:
// - Why three warpgroups: with one thread doing loads, gating, exponentials and the
//   chain, the walk was issue-latency bound (about 1300 instructions per warp and chunk
//   at 4-5 cycles each, measured with ncu). The aux warpgroup takes everything that does
//   not need S, so the state warpgroups issue little more than their wgmmas, and
//   setmaxnreg moves registers from the aux warpgroup (few live values) to them.
// - Loads by TMA (tma_sm90.cuh): a chunk is 7-8 box loads and one 256-byte copy from one
//   thread, completing on the stage's mbarrier. With 29 cp.async of 16 bytes a thread,
//   issuing them took ~1400 of the aux's ~4700 cycles a chunk (clock stamps per phase,
//   s64k_h16), on the critical path: the state warpgroups waited for the aux. With TMA
//   the aux waits for them instead (walk about 5 % faster). A box of a ragged chunk reads
//   the next document's rows; the aux zeroes them in shared memory, so no other
//   document's values ever enter (they would meet only zero weights, but 0 * inf = NaN).
// - Stage handoff by named barriers: FULL[wg][s] (aux arrives once chunk c's tiles, P~
//   and gate vectors are in stage s = c % 3; state warpgroup wg waits) and EMPTY[s] (the
//   state warpgroups arrive when done with chunk c; the aux waits before loading chunk
//   c + 3 into it). Arrivals are only made where a wait will consume them.
// - One FULL barrier per state warpgroup, and warpgroup 1 starting once warpgroup 0 has
//   issued its first state update: with one shared FULL the two ran in lock step,
//   issuing their wgmmas and their conversions at the same times, and the tensor cores
//   idled during both conversions; staggered, one's conversions overlap the other's
//   wgmmas (walk 3 % faster, tools/gdn_fwd_gpu_check.py). Where in warpgroup 0's first
//   chunk warpgroup 1 starts (walk ms, s64k_h16 / s256k_h2 / s32k_h16, one call of
//   tools/ab_csrc.py, S_end then still spilled outside the loop): after its U and O
//   0.626 / 0.470 / 0.475; after its X 0.650 / 0.480 / 0.480; after its state update
//   0.617 / 0.463 / 0.469; after its whole chunk 0.623 / 0.466 / 0.471.
// - Value columns never mix (every product contracts over the head dim or over tokens),
//   so a value column's result is the same instruction sequence whichever warpgroup, and
//   whichever CTA, runs it: the split is free to depend on the SM count in either mode.
// - Why the split: a CTA's chunk step is bound by its SM's tensor cores (two state
//   warpgroups plus P~ per chunk); where walks leave SMs idle, one state warpgroup per SM
//   takes a chunk in less time, at the cost of loading q, k, A and forming P~ twice.
// - Exponents are differences of chunk-local cumsums, <= 0 where used (g <= 0; the gate
//   vectors clamp): strong decay underflows to 0; masked elements are selected away,
//   never multiplied by 0.
// - Summary mode runs the same chain instructions as the output mode (so E_s and M_s
//   round as the uncut walk would) minus Q, P~ and O; M_s's walk reads zeros for V.
// - o is staged (stmatrix.trans) into the warp's own, consumed columns of the V tile and
//   stored 16 bytes per lane, real token rows only: a ragged chunk never writes into the
//   next document. The staging and stores take ~1000 of a state warpgroup's ~4800 cycles
//   a chunk, yet every way tried of taking them off its path was slower (walk, s64k_h16):
//   stores after the next chunk's U/O issue +12-15 %, one TMA store per warpgroup with
//   the stage released a chunk later +4 %, the aux storing the staged o +10 %. The SM's
//   tensor, shared-memory and issue resources are shared by all three warpgroups; work
//   moved between them has not shortened the step, work removed has (the TMA loads).
// - Nor is the step the loads' latency: warming L2 with chunk c + 4 when loading c + 2
//   (TMA tensor prefetch, branch try/walk-prefetch) made the walk 5-9 % slower. What
//   the aux adds per chunk does show: forming the q/k norms here cost 27 %, folding the
//   prep's norms in 3 % (ncu at s64k_h16: DRAM 49 % busy at ncu's clocks, issue 41 %).
//   Nor is it the A tile's bytes: A stored as its lower block triangle (5 KB, not 8) and
//   loaded as four TMA boxes of 16 rows with zero fill (try/packed-a) made the walk
//   slower, 0.613 -> 0.637 ms at s64k_h16 and 0.462 -> 0.473 at s256k_h2 (one
//   tools/ab_csrc.py call, --rounds 2).
// - When the aux works matters more than how much (walk ms at s64k_h16, against 0.637
//   for this code with warpgroup 1 then starting at X, in the same call of
//   tools/ab_csrc.py): empty stages as mbarriers with the aux forming P~ of each chunk
//   as soon as it lands, no longer after waiting for the later state warpgroup to free
//   a stage (branch try/lazy-loads), 0.73 (+15 %); on top of that,
//   S^T held up to a scale 2^L so that the state warpgroups skip the e^gl multiply
//   (try/lazy-oax-lambda) +5 % more; P~'s decay as row x column factors, 128
//   exponentials a chunk instead of 4096 but a warpgroup vote (try/p-separable), 0.671.
//   O^T issued behind X (try/o-after-x) was -1.5 % here and +1.7 % at s32k_h16: not
//   taken. A reading, not measured: the aux's P~ product now lands while warpgroup 1
//   stages its o (no tensor work), and anything that moves it onto the chain's products
//   costs more than the work saved. With the stagger at the state update, warpgroup 1
//   starting after warpgroup 0's first O += X P~^T (try/stagger-o) was +1 %, and O^T
//   behind X (try/oax2) +2-3 %, at s64k_h16, s256k_h2 and s32k_h16.
// - Summaries on the persistent grid (kernel ms of the summary launch, det plan, one
//   tools/ab_csrc.py call with --rounds 2): 0.007 -> 0.001 at s64k_h16 and 0.006 -> 0.001
//   at s256k_h2, where no document is cut; 0.102 -> 0.107 at s32k_h16 and 0.040 -> 0.043
//   at s16k_long, where they walk (a CTA's turn between walks: two CTA barriers, the
//   atomic, find_walk's dependent loads, re-initialised barriers). A fixed stride instead
//   of the queue (try/summary-persistent) cost +47 % at s32k_h16. Taking walk k + 1 from
//   the queue during walk k (an aux thread, double-buffered; try/summary-prefetch) made
//   the summaries slower, not faster: 0.107 -> 0.118 ms at s32k_h16 and 0.045 -> 0.052 at
//   s16k_long, in one call.

#include <algorithm>

#include <cuda_bf16.h>

#include "gdn_chunks.cuh"
#include "gdn_fwd.h"
#include "mma_sm80.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace cake {
namespace {

// kStateWgs state warpgroups (2: both halves of the value columns; 1: the CTA's half),
// then the aux warpgroup.
template <int kStateWgs>
constexpr int kWalkThreads = 128 * (kStateWgs + 1);
// setmaxnreg: 2 * 216 + 72 = 3 * 168, the launch allocation of the unsplit CTA (the aux
// holds P~'s 64 x 64 accumulator, 32 registers; with the loads by TMA the state
// warpgroups fit in 216); the split CTA has room to spare (and its state warpgroup, which
// holds its half's index beside the warpgroup's, spills at 224).
template <int kStateWgs>
constexpr int kStateRegs = kStateWgs == 2 ? 216 : 240;
template <int kStateWgs>
constexpr int kAuxRegs = kStateWgs == 2 ? 72 : 104;
// setmaxnreg only moves registers within what the CTA got at launch (the launch bound's
// cap per thread); asking for more makes the increasing warpgroups wait forever.
template <int kStateWgs>
constexpr int kLaunchRegs = std::min(255, 65536 / kWalkThreads<kStateWgs> / 8 * 8);  // per thread
template <int kStateWgs>
constexpr bool kRegistersFit =
    kStateWgs * kStateRegs<kStateWgs> + kAuxRegs<kStateWgs> <= (kStateWgs + 1) * kLaunchRegs<kStateWgs>;
static_assert(kRegistersFit<1> && kRegistersFit<2>, "register pool overcommitted");
constexpr int kStages = 3;
constexpr int kBV = 64;  // value columns per state warpgroup: its wgmma M
constexpr int kQOff = 0;
constexpr int kKOff = kQOff + 64 * kGdnHeadDim * 2;
constexpr int kVOff = kKOff + 64 * kGdnHeadDim * 2;
constexpr int kAOff = kVOff + 64 * kGdnHeadDim * 2;
constexpr int kPOff = kAOff + 64 * 64 * 2;
// The stage's vectors (floats from kGOff): gcum, then the gate vectors in the form the
// state warpgroups multiply with (each with the tokens' inverse norms folded in), the
// log2 inverse norms of q and k rows (loaded with gcum; 0 without use_qk_l2norm), and e^gl.
constexpr int kGOff = kPOff + 64 * 64 * 2;
constexpr int kGDecayK = 64;   // -e^gcum_j / |k_j|
constexpr int kGTailK = 128;   // e^(gl - gcum_j) / |k_j|
constexpr int kGOutQ = 192;    // scale e^gcum_i / |q_i|
constexpr int kGLogRq = 256;   // log2(1 / |q_i|) (0 without use_qk_l2norm)
constexpr int kGLogRk = 320;   // log2(1 / |k_j|)
constexpr int kGGamma = 384;   // e^gl
constexpr int kStageBytes = kGOff + 2048;  // padded: every tile stays 1024-aligned
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the base to 1024

// Named barriers (0 is __syncthreads).
constexpr int kBarFull = 1;      // + 7 wg + stage: one per state warpgroup (1..3, 8..10)
constexpr int kBarEmpty = 4;     // + stage
constexpr int kBarAux = 7;       // the aux warpgroup alone
constexpr int kBarStagger = 11;  // warpgroup 1 starts once warpgroup 0 has issued its first state update
constexpr int kBarItem = 12;     // summary mode: the whole CTA between two walks

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
constexpr float kLog2e = 1.4426950408889634f;

// The tensor maps of the walk's TMA loads (tma_sm90.cuh): q, k, v as [T][heads][128] in
// boxes of 64 tokens x 64 columns, and the A diag(beta) workspace as [slot x HV][64][64]
// in whole tiles.
struct WalkMaps {
  CUtensorMap q, k, v, a;
};

// acc (a 64 x 64 accumulator, this thread's columns j = 8 jt + 2 t4 (+1)) times the
// per-column factors f[j] (read where used: registers are the scarce resource here).
__device__ __forceinline__ void scale_columns(float (&acc)[32], const float* f, int t4) {
#pragma unroll
  for (int jt = 0; jt < 8; ++jt) {
    const float2 e = *reinterpret_cast<const float2*>(f + 8 * jt + 2 * t4);
    acc[4 * jt + 0] *= e.x;
    acc[4 * jt + 1] *= e.y;
    acc[4 * jt + 2] *= e.x;
    acc[4 * jt + 3] *= e.y;
  }
}

// The aux warpgroup: loads two chunks ahead; P~ and gate vectors one chunk ahead.
// Tokens seg_start .. seg_end - 1 (nch chunks from chunk slot first_slot); with_v = false
// leaves the V tiles zero instead. A split CTA (kStateWgs = 1) loads only the value
// columns of its half vh. load_bar: the stages' load barriers (8 bytes each).
template <bool kOutput, int kStateWgs>
__device__ __forceinline__ void aux_warpgroup(const GdnFwdArgs& p, const WalkMaps& maps, unsigned char* smem,
                                              uint32_t load_bar, int hv, int h, int64_t seg_start, int64_t seg_end,
                                              int nch, int64_t first_slot, bool with_v, int vh, bool reinit) {
  constexpr int kThreads = kWalkThreads<kStateWgs>;
  const int tid = threadIdx.x - 128 * kStateWgs, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // stmatrix: this lane's matrix and row
  const float scale = p.scale;
  const float log2_scale = log2f(scale);  // scale > 0 (cake_ops/gdn.py sends others to PyTorch)
  const int seg_len = static_cast<int>(seg_end - seg_start);
  // The V columns loaded: both halves, or the split CTA's (column block vh of the tile).
  constexpr int kVBytes = kStateWgs == 2 ? 2 * 64 * 64 * 2 : 64 * 64 * 2;
  const uint32_t load_bytes = (kOutput ? 64 * kGdnHeadDim * 2 : 0) + 64 * kGdnHeadDim * 2 + (with_v ? kVBytes : 0) +
                              64 * 64 * 2 + 64 * 4 + (p.use_qk_l2norm ? 128 * 4 : 0);

  // One thread issues a chunk's loads (TMA, see tma_sm90.cuh): q, k and v rows from the
  // segment's token row (rows past the tensor's end arrive as zeros; past the document's
  // end, the next document's rows, zeroed below), this (slot, value head)'s A diag(beta)
  // tile, gcum and the rows' log2 inverse norms.
  auto issue_loads = [&](int c) {
    const int stage = c % kStages;
    if (c >= kStages) bar_sync(kBarEmpty + stage, kThreads);  // the state warpgroups are done with c - 3
    if (tid != 0) return;
    const uint32_t st = mma::smem_addr(smem + stage * kStageBytes), bar = load_bar + 8 * stage;
    const int row = static_cast<int>(seg_start) + c * kGdnChunk;  // T < 2^31 (binding.cpp)
    const int slot_head = static_cast<int>((first_slot + c) * p.HV + hv);  // NC * HV < 2^31 (binding.cpp)
    tma::mbar_arrive_expect_tx(bar, load_bytes);
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      if constexpr (kOutput) tma::load_box_3d(st + kQOff + 8192 * blk, &maps.q, 64 * blk, h, row, bar);
      tma::load_box_3d(st + kKOff + 8192 * blk, &maps.k, 64 * blk, h, row, bar);
      if (with_v && (kStateWgs == 2 || blk == vh)) tma::load_box_3d(st + kVOff + 8192 * blk, &maps.v, 64 * blk, hv, row, bar);
    }
    tma::load_box_3d(st + kAOff, &maps.a, 0, 0, slot_head, bar);
    tma::load_bytes(st + kGOff, p.gcum + static_cast<int64_t>(slot_head) * 64, 64 * 4, bar);
    if (p.use_qk_l2norm)  // the log2 inverse norms of the q and k rows, contiguous as the stage keeps them
      tma::load_bytes(st + kGOff + kGLogRq * 4, p.qk_lrn + ((first_slot + c) * p.H + h) * 128, 128 * 4, bar);
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
  bar_sync(kBarAux, 128);  // the barriers are initialised (and the zeros written)
  if (nch > 0) issue_loads(0);
  if (nch > 1) issue_loads(1);

  for (int c = 0; c < nch; ++c) {
    tma::mbar_wait(load_bar + 8 * (c % kStages), (c / kStages) & 1);  // chunk c has landed
    unsigned char* st = smem + (c % kStages) * kStageBytes;

    // A ragged chunk (the document's last): the rows past its end came from the next
    // document (or are zeros past the tensor's end); zero them, so that a document's
    // results never see another's values (they would only ever meet zero weights, but
    // 0 * inf is NaN). Tiles of 64 rows, block (64 columns) after block.
    const int len = seg_len - c * kGdnChunk;
    if (len < kGdnChunk) {
      for (int i = tid; i < (kGdnChunk - len) * 16; i += 128) {
        const int r = len + (i >> 4), ch = i & 15;
        const int off = wgmma::sw128_offset(64, r, ch);
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (kOutput) *reinterpret_cast<uint4*>(st + kQOff + off) = zero;
        *reinterpret_cast<uint4*>(st + kKOff + off) = zero;
        if (with_v && (kStateWgs == 2 || ch >> 3 == vh)) *reinterpret_cast<uint4*>(st + kVOff + off) = zero;
      }
      wgmma::fence_proxy_async();  // read by wgmma
      bar_sync(kBarAux, 128);
    }
    const uint32_t sq = mma::smem_addr(st + kQOff), sk = mma::smem_addr(st + kKOff);
    float* gs = reinterpret_cast<float*>(st + kGOff);

    // Gate vectors for the state warpgroups, in the form they multiply with.
    if (tid < 64) {
      const float gj = gs[tid], gl = gs[kGdnChunk - 1], lrk = gs[kGLogRk + tid];
      gs[kGDecayK + tid] = -mma::exp2_ftz(fmaf(gj, kLog2e, lrk));
      gs[kGTailK + tid] = mma::exp2_ftz(fmaf(fminf(gl - gj, 0.f), kLog2e, lrk));
      gs[kGOutQ + tid] = mma::exp2_ftz(fmaf(gj, kLog2e, log2_scale + gs[kGLogRq + tid]));
      if (tid == 0) gs[kGGamma] = mma::exp2_ftz(gl * kLog2e);
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
        wgmma::mma_ss_m64n64k16(pq, wgmma::desc_k_major(sq, 64, ks), wgmma::desc_k_major(sk, 64, ks), ks > 0);
      wgmma::commit();
      float row_term[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = 16 * warp + gid + 8 * hh;
        row_term[hh] = fmaf(gs[i], kLog2e, log2_scale + gs[kGLogRq + i]);
      }
      wgmma::wait<0>();
      wgmma::fence_operands(pq);
#pragma unroll
      for (int jt = 0; jt < 8; ++jt) {
        const int j = 8 * jt + 2 * t4;
        const float2 gj = *reinterpret_cast<const float2*>(gs + j);
        const float2 lk = *reinterpret_cast<const float2*>(gs + kGLogRk + j);
        const float c0 = fmaf(gj.x, kLog2e, -lk.x), c1 = fmaf(gj.y, kLog2e, -lk.y);
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
        mma::stmatrix_x4(mma::smem_addr(st + kPOff) + wgmma::sw128_offset(64, 16 * warp + (mi & 1) * 8 + r8, 2 * kb + (mi >> 1)),
                         r);
      }
    }
    if constexpr (kOutput) wgmma::fence_proxy_async();  // P~ is read by wgmma
    bar_arrive(kBarFull + c % kStages, 256);  // stage c % 3 is ready, for each state warpgroup
    if constexpr (kStateWgs == 2) bar_arrive(kBarFull + 7 + c % kStages, 256);

    // Then chunk c + 2, into the stage the state warpgroups free after chunk c - 1:
    // P~ of chunk c is ready before they ask for it.
    if (c + 2 < nch) issue_loads(c + 2);
  }
}

// A state warpgroup (wg of the CTA's): the walk of the 64 value columns of half vh
// (v0 = 64 vh ..) of one (segment, value head), from S0 (K x V fp32, rows of 128;
// nullptr: zeros; identity: the K x K identity), to S_end (same layout, or transposed
// when identity: M_s^T, the layout the chain reads).
template <bool kOutput, int kStateWgs>
__device__ __forceinline__ void state_warpgroup(const GdnFwdArgs& p, unsigned char* smem, uint32_t load_bar,
                                                int wg, int vh, int64_t hv, int64_t seg_start, int64_t doc_end, int nch,
                                                const float* S0, bool identity, float* S_end) {
  const int tid = threadIdx.x & 127, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix/stmatrix: this lane's matrix and row
  const int v0 = vh * kBV;
  __nv_bfloat16* og = static_cast<__nv_bfloat16*>(p.o);
  // S_end waits in shared memory for the end of the walk: held in registers across the
  // loop it is spilled (the loop needs them all). Every thread of the warpgroup writes
  // the same value and reads back its own write.
  __shared__ float* parked_end[kStateWgs];
  parked_end[wg] = S_end;

  // S^T accumulator: s[4 nt + e] is value column `col` (+8 for e >= 2), head dim 8 nt + 2 t4 + (e & 1).
  const int col = v0 + 16 * warp + gid;
  float s[64];
  if (S0 != nullptr) {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int kd = 8 * nt + 2 * t4;
      s[4 * nt + 0] = S0[kd * kGdnHeadDim + col];
      s[4 * nt + 1] = S0[(kd + 1) * kGdnHeadDim + col];
      s[4 * nt + 2] = S0[kd * kGdnHeadDim + col + 8];
      s[4 * nt + 3] = S0[(kd + 1) * kGdnHeadDim + col + 8];
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int kd = 8 * nt + 2 * t4;
      s[4 * nt + 0] = identity && kd == col ? 1.f : 0.f;
      s[4 * nt + 1] = identity && kd + 1 == col ? 1.f : 0.f;
      s[4 * nt + 2] = identity && kd == col + 8 ? 1.f : 0.f;
      s[4 * nt + 3] = identity && kd + 1 == col + 8 ? 1.f : 0.f;
    }
  }

  for (int c = 0; c < nch; ++c) {
    const int stage = c % kStages;
    bar_sync(kBarFull + 7 * wg + stage, 256);  // chunk c, its P~ and gate vectors are in
    tma::mbar_wait(load_bar + 8 * stage, (c / kStages) & 1);  // (done: orders the TMA writes for this thread)
    if (kStateWgs == 2 && c == 0 && wg == 1) bar_sync(kBarStagger, 256);
    unsigned char* st = smem + stage * kStageBytes;
    const uint32_t sq = mma::smem_addr(st + kQOff), sk = mma::smem_addr(st + kKOff);
    const uint32_t sv = mma::smem_addr(st + kVOff), sa = mma::smem_addr(st + kAOff);
    const uint32_t sp = mma::smem_addr(st + kPOff);
    const float* gs = reinterpret_cast<const float*>(st + kGOff);

    // (1) Group 1: U^T = S^T K^T. Group 2: O^T = S^T Q^T.
    uint32_t sfrag[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma::to_a_frag(sfrag[ks], s, ks);
    float u[32], o[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) u[i] = o[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma::mma_rs_m64n64k16<0>(u, sfrag[ks], wgmma::desc_k_major(sk, 64, ks), ks > 0);
    wgmma::commit();
    if constexpr (kOutput) {
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) wgmma::mma_rs_m64n64k16<0>(o, sfrag[ks], wgmma::desc_k_major(sq, 64, ks), ks > 0);
    }
    wgmma::commit();  // (an empty group in summary mode keeps the wait counts below)

    // (2) Group 3: X = (V^T + W') (A diag(beta))^T with W' = -e^gcum_j U^T, the sum formed
    // in fp32 (one fma per element, in place of U^T) and rounded to bf16 once: one k64
    // product on the serial chain rather than one for V^T and one for W'. V^T comes as
    // A fragments (tokens = k), read k-step by k-step (no registers to hold all four).
    wgmma::wait<1>();
    wgmma::fence_operands(u);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t vfrag[4];
      mma::ldmatrix_x4_trans(vfrag, sv + wgmma::sw128_offset(64, 16 * ks + (mi >> 1) * 8 + r8, 8 * vh + 2 * warp + (mi & 1)));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        // vfrag[r] holds the bf16 pair of accumulator elements i, i + 1 (to_a_frag):
        // tokens 8 (i / 4) + 2 t4 (+1), as in scale_columns.
        const int i = 8 * ks + 2 * r;
        const float2 e = *reinterpret_cast<const float2*>(gs + kGDecayK + 8 * (i >> 2) + 2 * t4);
        u[i] = fmaf(u[i], e.x, __uint_as_float(vfrag[r] << 16));
        u[i + 1] = fmaf(u[i + 1], e.y, __uint_as_float(vfrag[r] & 0xffff0000u));
      }
    }
    uint32_t wfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::to_a_frag(wfrag[ks], u, ks);
    float x[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) x[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<0>(x, wfrag[ks], wgmma::desc_k_major(sa, 64, ks), ks > 0);
    wgmma::commit();

    // (3) O^T columns (tokens i) scaled by scale e^gcum_i, once group 2 is done.
    if constexpr (kOutput) {
      wgmma::wait<1>();
      wgmma::fence_operands(o);
      scale_columns(o, gs + kGOutQ, t4);
    }
    wgmma::wait<0>();
    wgmma::fence_operands(x);

    // (4) Group 4: S^T = e^gl S^T + (X * e^(gl - gcum_j)) K, the serial chain first.
    // Group 5: O^T += X P~^T.
    uint32_t xfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::to_a_frag(xfrag[ks], x, ks);
    scale_columns(x, gs + kGTailK, t4);
    uint32_t xtfrag[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::to_a_frag(xtfrag[ks], x, ks);
    const float gamma = gs[kGGamma];  // e^gl
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] *= gamma;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma::mma_rs_m64n128k16<1>(s, xtfrag[ks], wgmma::desc_mn_major(sk, 64, ks), 1);
    wgmma::commit();
    if (kStateWgs == 2 && c == 0 && wg == 0) bar_arrive(kBarStagger, 256);
    if constexpr (kOutput) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) wgmma::mma_rs_m64n64k16<0>(o, xfrag[ks], wgmma::desc_k_major(sp, 64, ks), 1);
      wgmma::commit();
    }
    wgmma::wait<0>();
    if constexpr (kOutput) wgmma::fence_operands(o);
    wgmma::fence_operands(s);

    // (5) o: stage O^T transposed into this warp's (consumed) columns of the V tile,
    // then 16-byte stores of the real rows; then the stage goes back to the aux.
    if constexpr (kOutput) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t r[4];
      wgmma::to_a_frag(r, o, jj);
      mma::stmatrix_x4_trans(sv + wgmma::sw128_offset(64, 16 * jj + (mi >> 1) * 8 + r8, 8 * vh + 2 * warp + (mi & 1)), r);
    }
    __syncwarp();
    const int64_t t0 = seg_start + static_cast<int64_t>(c) * kGdnChunk;
    const int len = static_cast<int>(min(doc_end - t0, static_cast<int64_t>(kGdnChunk)));
    // All four rows read before any store: one shared-memory round trip, not four.
    uint4 val[4];
#pragma unroll
    for (int it = 0; it < 4; ++it)
      val[it] = *reinterpret_cast<const uint4*>(
          st + kVOff + wgmma::sw128_offset(64, 16 * it + (lane >> 1), 8 * vh + 2 * warp + (lane & 1)));
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int row = 16 * it + (lane >> 1);
      if (row < len) mma::st_global_16(og + ((t0 + row) * p.HV + hv) * kGdnHeadDim + v0 + 16 * warp + 8 * (lane & 1), val[it]);
    }
    }
    if (c + kStages < nch) {
      wgmma::fence_proxy_async();  // this stage's reads and writes precede the TMA loads into it
      bar_arrive(kBarEmpty + stage, kWalkThreads<kStateWgs>);
    }
  }

  // The end state (for an empty document: the initial state or zeros).
  S_end = parked_end[wg];
  if (S_end == nullptr) return;
  if (identity) {  // M_s^T: row col, pairs of adjacent head dims
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      const int kd = 8 * nt + 2 * t4;
      *reinterpret_cast<float2*>(S_end + col * kGdnHeadDim + kd) = make_float2(s[4 * nt + 0], s[4 * nt + 1]);
      *reinterpret_cast<float2*>(S_end + (col + 8) * kGdnHeadDim + kd) = make_float2(s[4 * nt + 2], s[4 * nt + 3]);
    }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const int kd = 8 * nt + 2 * t4;
    S_end[kd * kGdnHeadDim + col] = s[4 * nt + 0];
    S_end[(kd + 1) * kGdnHeadDim + col] = s[4 * nt + 1];
    S_end[kd * kGdnHeadDim + col + 8] = s[4 * nt + 2];
    S_end[(kd + 1) * kGdnHeadDim + col + 8] = s[4 * nt + 3];
  }
}

// Summary mode: the truncation window of an inner segment (see gdn_fwd.h), as the
// offset of its first chunk from the segment's first, or -1 if the cut is exact: the
// latest chunk cw with sum over c = cw .. nch - 1 of decay[c] <= kGdnTruncLogDecay
// (the smallest window). decay: chunk_decay at the segment's first chunk, stride HV.
// Every warp computes it alike (same loads and the same summation order), so no barrier.
__device__ __forceinline__ int truncation_start(const float* decay, int64_t HV, int nch) {
  const int lane = threadIdx.x & 31;
  float carry = 0.f;  // the log decay of the chunks after this round's
  for (int end = nch; end > 0; end -= 32) {
    const int c = end - 1 - lane;  // lane 0 takes the latest chunk
    float x = c >= 0 ? decay[c * HV] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    x += carry;  // the log decay of chunks c .. nch - 1
    const unsigned hit = __ballot_sync(0xffffffffu, c >= 0 && x <= kGdnTruncLogDecay);
    if (hit != 0u) return end - __ffs(hit);  // the lowest lane: the latest chunk
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
  return -1;
}

// One walk: output mode, (segment slot, hv[, half]); summary mode, (inner segment, hv,
// E or M[, half]), inner segments being those that are not their document's last (the
// half only when split: kStateWgs = 1; the halves are neighbours, so they run together
// and share their loads of q, k and A in L2). run = false for walks past the real
// segments, M of segment 0 (whose start state is known) and M of a truncated cut.
struct Walk {
  bool run, transfer;
  int hv, half, nch;
  int64_t seg_start, seg_end, doc_end, first_slot;
  const float* S0;
  float* S_end;
};

template <bool kOutput, int kStateWgs>
__device__ __forceinline__ Walk find_walk(const GdnFwdArgs& p, int64_t index) {
  constexpr int kKinds = kOutput ? 1 : 2, kHalves = 3 - kStateWgs;
  Walk w{};
  w.half = kHalves == 2 ? static_cast<int>(index % 2) : 0;
  const int64_t block = index / kHalves;
  w.transfer = !kOutput && block % kKinds == 1;  // M_s rather than E_s
  const int64_t hv = block / kKinds % p.HV;
  w.hv = static_cast<int>(hv);
  const int64_t item = block / kKinds / p.HV;
  if (item >= p.seg_offsets[p.N] - (kOutput ? 0 : p.N)) return w;
  const int64_t slot = kOutput ? item : inner_segment_slot(p.seg_offsets, p.N, item);
  const SegmentPos sp =
      find_segment(p.seg_offsets, CuSeqlens{p.cu_seqlens, p.cu_int64}, p.N, p.seg_chunks, p.seg_long_max, slot);
  if (w.transfer && sp.seg == 0) return w;

  // The seg_ workspaces hold inner segments only, by inner index slot - doc (document n's
  // first inner segment is seg_offsets[n] - n).
  const int64_t inner = slot - sp.doc;
  int skip = 0;  // chunks of the segment before the walk starts (summary of a truncated cut)
  if constexpr (!kOutput) {
    const int cw = truncation_start(p.chunk_decay + (p.chunk_offsets[sp.doc] + sp.c0) * p.HV + hv, p.HV, sp.nch);
    if (w.transfer && cw >= 0) return w;  // truncated: the chain needs no M_s
    if (!w.transfer && w.half == 0 && threadIdx.x == 0) p.seg_exact[inner * p.HV + hv] = cw < 0;
    skip = cw > 0 ? cw : 0;
  }
  constexpr int64_t kMat = kGdnHeadDim * kGdnHeadDim;
  w.S0 = nullptr;
  if (sp.seg == 0 && !w.transfer && skip == 0) {
    if (p.initial_state != nullptr) w.S0 = p.initial_state + (sp.doc * p.HV + hv) * kMat;
  } else if (kOutput) {
    w.S0 = p.seg_state + ((inner - 1) * p.HV + hv) * kMat;  // the chained start state: the previous segment's
  }
  if constexpr (kOutput) w.S_end = sp.seg == sp.nseg - 1 ? p.final_state + (sp.doc * p.HV + hv) * kMat : nullptr;
  else w.S_end = (w.transfer ? p.seg_transfer : p.seg_state) + (inner * p.HV + hv) * kMat;

  const int c0 = sp.c0 + skip;
  w.nch = sp.nch - skip;
  w.seg_start = sp.doc_start + static_cast<int64_t>(c0) * kGdnChunk;
  w.seg_end = min(sp.doc_end, w.seg_start + static_cast<int64_t>(w.nch) * kGdnChunk);
  w.doc_end = sp.doc_end;
  w.first_slot = p.chunk_offsets[sp.doc] + c0;
  w.run = true;
  return w;
}

// Output mode: one CTA per walk (find_walk). Summary mode: a persistent grid of at most
// one CTA per SM, each CTA taking the next walk from p.walk_queue (an integer atomic; the
// plan zeroed it) until none is left. Where no document is cut every summary walk is
// empty, and a CTA per walk slot (1,920 at s64k_h16, one at a time per SM for their
// shared memory) cost 6-7 us a call just to start and return. The queue, not a fixed
// walk i, i + gridDim.x, ... per CTA: walks differ in length (a truncated cut's E_s is a
// few chunks, its M_s none, an exact one's both whole segments), and with an even grid a
// CTA would only ever take E_s or only M_s (kind = index % 2); the queue balances as the
// block scheduler did. Which CTA runs a walk does not change its bits.
// Each role's loop sits beside its setmaxnreg, so that the compiler sees one register
// budget per code path.
template <bool kOutput, int kStateWgs>
__global__ void __launch_bounds__(kWalkThreads<kStateWgs>, 1)
    gdn_fwd_walk_kernel(const GdnFwdArgs p, const __grid_constant__ WalkMaps maps) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t load_bar[kStages];
  unsigned char* smem = smem_raw + ((1024 - (mma::smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t bars = mma::smem_addr(load_bar);
  const int wg = threadIdx.x >> 7;
  if constexpr (kOutput) {
    const Walk w = find_walk<kOutput, kStateWgs>(p, blockIdx.x);
    if (!w.run) return;
    if (wg == kStateWgs) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kAuxRegs<kStateWgs>));
      aux_warpgroup<kOutput, kStateWgs>(p, maps, smem, bars, w.hv, w.hv / static_cast<int>(p.HV / p.H), w.seg_start,
                                        w.seg_end, w.nch, w.first_slot, true, w.half, false);
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kStateRegs<kStateWgs>));
      state_warpgroup<kOutput, kStateWgs>(p, smem, bars, kStateWgs == 2 ? wg : 0, kStateWgs == 2 ? wg : w.half, w.hv,
                                          w.seg_start, w.doc_end, w.nch, w.S0, false, w.S_end);
    }
  } else {
    __shared__ int32_t taken;  // the walk thread 0 took from the queue
    const int64_t walks = (p.seg_offsets[p.N] - p.N) * p.HV * 2 * (3 - kStateWgs);
    if (walks == 0) return;
    if (wg == kStateWgs) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kAuxRegs<kStateWgs>));
      bool walked = false;  // the load barriers hold an earlier walk's (spent) state
      for (;;) {
        bar_sync(kBarItem, kWalkThreads<kStateWgs>);  // `taken` is written
        const int64_t i = taken;
        if (i >= walks) break;
        const Walk w = find_walk<kOutput, kStateWgs>(p, i);
        if (w.run) {
          aux_warpgroup<kOutput, kStateWgs>(p, maps, smem, bars, w.hv, w.hv / static_cast<int>(p.HV / p.H),
                                            w.seg_start, w.seg_end, w.nch, w.first_slot, !w.transfer, w.half, walked);
          walked = true;
        }
        bar_sync(kBarItem, kWalkThreads<kStateWgs>);  // the walk is done: its barriers and stages are free
      }
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kStateRegs<kStateWgs>));
      for (;;) {
        if (threadIdx.x == 0) taken = atomicAdd(p.walk_queue, 1);
        bar_sync(kBarItem, kWalkThreads<kStateWgs>);
        const int64_t i = taken;
        if (i >= walks) break;
        const Walk w = find_walk<kOutput, kStateWgs>(p, i);
        if (w.run)
          state_warpgroup<kOutput, kStateWgs>(p, smem, bars, kStateWgs == 2 ? wg : 0, kStateWgs == 2 ? wg : w.half,
                                              w.hv, w.seg_start, w.doc_end, w.nch, w.S0, w.transfer, w.S_end);
        bar_sync(kBarItem, kWalkThreads<kStateWgs>);  // (every thread has read `taken` before it is rewritten)
      }
    }
  }
}

// The tensor maps for p's tensors (see WalkMaps): encoded on the host per call, passed
// by value (so a captured CUDA graph replays them with the launch).
cudaError_t encode_walk_maps(const GdnFwdArgs& p, WalkMaps& m) {
  if (p.T == 0) {  // only empty documents: no chunk is loaded
    m = WalkMaps{};
    return cudaSuccess;
  }
  const uint64_t T = static_cast<uint64_t>(p.T), H = static_cast<uint64_t>(p.H), HV = static_cast<uint64_t>(p.HV);
  const uint64_t row = kGdnHeadDim * 2;  // bytes of one head's row
  cudaError_t err = tma::encode_bf16_3d(&m.q, p.q, kGdnHeadDim, H, T, row, H * row, 64, 1, kGdnChunk);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.k, p.k, kGdnHeadDim, H, T, row, H * row, 64, 1, kGdnChunk);
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.v, p.v, kGdnHeadDim, HV, T, row, HV * row, 64, 1, kGdnChunk);
  const uint64_t tiles = static_cast<uint64_t>(gdn_fwd_chunk_slots(p.T, p.N)) * HV;
  if (err == cudaSuccess) err = tma::encode_bf16_3d(&m.a, p.a, 64, 64, tiles, 128, 64 * 128, 64, 64, 1);
  return err;
}

template <bool kOutput, int kStateWgs>
cudaError_t launch_walk_ctas(const GdnFwdArgs& p, int64_t items, cudaStream_t stream) {
  auto kernel = gdn_fwd_walk_kernel<kOutput, kStateWgs>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  int64_t blocks = items * p.HV * (kOutput ? 1 : 2) * (3 - kStateWgs);
  if (blocks == 0) return cudaSuccess;
  if constexpr (!kOutput) {  // persistent: at most one CTA per SM (the kernel's occupancy)
    if (p.sm_count <= 0) return cudaErrorInvalidValue;
    blocks = std::min<int64_t>(blocks, p.sm_count);
  }
  WalkMaps maps;
  err = encode_walk_maps(p, maps);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), kWalkThreads<kStateWgs>, kSmemBytes, stream>>>(p, maps);
  return cudaGetLastError();
}

template <bool kOutput>
cudaError_t launch_walk(const GdnFwdArgs& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const int finest = gdn_fwd_finest_cut_chunks(p.seg_chunks, p.seg_long_max);
  const int64_t items = kOutput ? gdn_fwd_segment_slots(p.T, p.N, finest) : gdn_fwd_inner_segment_slots(p.T, finest);
  const int splits = kOutput ? p.walk_splits : p.summary_splits;
  return splits == 2 ? launch_walk_ctas<kOutput, 1>(p, items, stream) : launch_walk_ctas<kOutput, 2>(p, items, stream);
}

}  // namespace

cudaError_t gdn_fwd_walk_launch(const GdnFwdArgs& p, cudaStream_t stream) { return launch_walk<true>(p, stream); }

cudaError_t gdn_fwd_summary_launch(const GdnFwdArgs& p, cudaStream_t stream) {
  return p.seg_chunks > 0 ? launch_walk<false>(p, stream) : cudaSuccess;
}

}  // namespace cake
