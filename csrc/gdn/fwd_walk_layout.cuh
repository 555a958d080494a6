#pragma once

// The walk CTA's shape (fwd_walk.cu): its warpgroups and their register budgets, the
// shared-memory ring of chunk stages, the named barriers of the stage handoff, and the
// tensor maps of its loads. Shared by the aux warpgroup (fwd_walk_loads.cuh), the state
// warpgroups (fwd_walk_state.cuh) and the kernel.
//
// Stage handoff (named barriers): FULL[wg][s] (the aux arrives once chunk c's tiles, P~
// and gate vectors are in stage s = c % 3; state warpgroup wg waits) and EMPTY[s] (the
// state warpgroups arrive when done with chunk c; the aux waits before loading chunk
// c + 3 into it). Arrivals are only made where a wait will consume them. One FULL barrier
// per state warpgroup, and warpgroup 1 starting once warpgroup 0 has issued its first
// state update (kBarStagger): in lock step the two would issue their wgmmas and their
// conversions at the same times, idling the tensor cores during both conversions;
// staggered, one's conversions overlap the other's wgmmas.

#include <algorithm>
#include <cstdint>

#include <cuda.h>

#include "gdn/gdn.h"

namespace cake::gdn_walk {

// What a walk computes besides the state S (docs/kernels.md, "Forward stages",
// "Backward tapes"):
//   kOutput   o, from the segment's start state; the last segment writes the final state;
//   kSummary  E_s (from zero, or the initial state) or M_s (from the identity, v = 0);
//   kTape     the backward's tape, from the segment's start state as kOutput: h (S^T at
//             each chunk's start, bf16); no q, P~, o or final state;
//   kOutputTape  kOutput and the tape of kTape in one walk (the full save mode's forward);
//   kReverse  the backward's reverse walk of the state gradient dS (gdn/bwd_walk.h), from
//             the segment's last chunk to its first (fwd_walk_reverse.cuh): do loaded in
//             place of v; per chunk the dS tape (staged as kOutputTape stages h) and dv_new
//             (in o's place and layout); the walk's start state is dS at the segment's end,
//             its end state dh0 at a document's first segment;
//   kReverseSummary  the reverse walk's cut summaries (gdn/bwd_walk.h): per cut, the
//             segment after it walked back from zero over its truncation window or whole
//             (F), and at an exact cut from the identity with do = 0 (M^T); no tapes.
enum class WalkMode { kOutput, kSummary, kTape, kOutputTape, kReverse, kReverseSummary };
__host__ __device__ constexpr bool walks_output(WalkMode m) { return m == WalkMode::kOutput || m == WalkMode::kOutputTape; }
__host__ __device__ constexpr bool walks_tapes(WalkMode m) { return m == WalkMode::kTape || m == WalkMode::kOutputTape; }
// The reverse walk's modes: the state gradient, from a segment's last chunk to its first.
__host__ __device__ constexpr bool walks_reverse(WalkMode m) {
  return m == WalkMode::kReverse || m == WalkMode::kReverseSummary;
}
// The modes that load q and form P~ (the aux warpgroup's work beyond the gates).
__host__ __device__ constexpr bool walks_p(WalkMode m) { return walks_output(m) || walks_reverse(m); }

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
constexpr int kBV = 64;  // value columns per state warpgroup: its wgmma M (half the head dim)
constexpr int kQOff = 0;
constexpr int kKOff = kQOff + kGdnChunk * kGdnHeadDim * 2;
constexpr int kVOff = kKOff + kGdnChunk * kGdnHeadDim * 2;
constexpr int kAOff = kVOff + kGdnChunk * kGdnHeadDim * 2;
constexpr int kPOff = kAOff + kGdnChunk * kGdnChunk * 2;
// The stage's vectors (floats from kGOff): gcum, then the gate vectors in the form the
// state warpgroups multiply with (each with the tokens' inverse norms folded in), the
// log2 inverse norms of q and k rows (loaded with gcum; 0 without use_qk_l2norm), and e^gl.
constexpr int kGOff = kPOff + kGdnChunk * kGdnChunk * 2;
constexpr int kGDecayK = 64;   // -beta_j e^gcum_j / |k_j|
constexpr int kGTailK = 128;   // e^(gl - gcum_j) / |k_j|
constexpr int kGOutQ = 192;    // scale e^gcum_i / |q_i|
constexpr int kGLogRq = 256;   // log2(1 / |q_i|) (0 without use_qk_l2norm)
constexpr int kGLogRk = 320;   // log2(1 / |k_j|)
constexpr int kGGamma = 384;   // e^gl
constexpr int kGBeta = 448;    // beta_j (the prep's chunk_beta, loaded with gcum)
constexpr int kStageBytes = kGOff + 2048;  // padded: every tile stays 1024-aligned
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the base to 1024
// kOutputTape stages h, and kReverse the dS tape, in 16 KB after the ring (8 warps x 2 KB):
// the Q tiles, where kTape stages h, are loaded in those modes.
constexpr int kHStageOff = kStages * kStageBytes;
template <WalkMode kMode>
constexpr int kWalkSmemBytes =
    kSmemBytes + (kMode == WalkMode::kOutputTape || kMode == WalkMode::kReverse ? 8 * 2048 : 0);
static_assert(kWalkSmemBytes<WalkMode::kOutputTape> <= 227 * 1024, "shared memory of one CTA an SM");

// Named barriers (mma::bar_sync / bar_arrive; 0 is __syncthreads).
constexpr int kBarFull = 1;      // + 7 wg + stage: one per state warpgroup (1..3, 8..10)
constexpr int kBarEmpty = 4;     // + stage
constexpr int kBarAux = 7;       // the aux warpgroup alone
constexpr int kBarStagger = 11;  // warpgroup 1 starts once warpgroup 0 has issued its first state update
constexpr int kBarItem = 12;     // summary mode: the whole CTA between two walks


// The tensor maps of the walk's TMA loads (common/tma_sm90.cuh; encoded in fwd_walk.cu): q, k, v as [T][heads][128] in
// boxes of 64 tokens x 64 columns, and the A workspace as [slot x HV][64][64]
// in whole tiles.
struct WalkMaps {
  CUtensorMap q, k, v, a;
};

// Tape mode's output (GdnFwdArgs::h_tape; the dS tape in the reverse walk; nullptr in the
// other modes): a kernel parameter of its own after the maps, so that the maps' parameter
// offset, and with it the other modes' code, is that of a walk without tapes.
struct WalkTapes {
  void* h;
};

}  // namespace cake::gdn_walk
