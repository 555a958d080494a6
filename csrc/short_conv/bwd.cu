// Backward of the short causal convolution (see short_conv/short_conv.h for the math).
//
// Two launches:
//
// 1. The token kernel: one thread owns VEC consecutive channels over a run of
//    kTokensPerThread consecutive tokens, as in the forward. It walks the run plus the
//    W-1 tokens after it, recomputing the pre-activation (SiLU's derivative needs it)
//    from a register window of the W-1 previous inputs, and sends each dpre[u] to the
//    W outputs dx[u - s] it reaches (kept in W register accumulators; dx[u - (W-1)] is
//    complete, and stored, once dpre[u] is in). Over its own run it also sums
//    dpre * tap for dweight and dpre for dbias; the CTA adds its runs' sums per token
//    tile of kRunsPerTile runs (kShortConvBwdTileTokens tokens) in run order, into the
//    fp32 workspace [tiles, D, W + 1].
// 2. The epilogue: blocks [0, reduce_blocks) sum the workspace's tiles per (channel,
//    tap) in a fixed order (kReduceLanes strided lanes, then the lanes in order) and
//    write dweight and dbias; the remaining blocks write dinitial_state, one thread per
//    (document, channel), from the document's first W-1 tokens (recomputing their dpre).
//
// Why it is as it is: like the forward the op is memory bound (dy and x read, dx
// written). The register window of the backward is about twice the forward's (W dx
// accumulators and W + 1 dweight sums per channel beside the weights and the inputs),
// so a thread owns 4 channels (16-byte loads in fp32, 8-byte in fp16 / bf16: a warp
// still reads 256 or 512 contiguous bytes per row), and runs of 32 tokens keep the
// W-1 recomputed tokens past a run under 10 % of the work. No float atomics and every
// sum in a fixed order: dx and dinitial_state depend on their document only, dweight
// and dbias on T (the tile boundaries) only, never on the vector width or launch shape.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/varlen.cuh"
#include "short_conv/elements.cuh"
#include "short_conv/short_conv.h"

namespace cake {
namespace {

constexpr int kThreads = 128;
constexpr int kTokensPerThread = 32;
constexpr int kRowsInFlight = 4;
constexpr int kVec = 4;  // channels per thread on the vectorised path
// A tile is kRunsPerTile runs of one CTA (blockDim.y is a multiple of it: blockDim.x <= 32).
constexpr int kRunsPerTile = static_cast<int>(kShortConvBwdTileTokens / kTokensPerThread);
static_assert(kRunsPerTile * kTokensPerThread == kShortConvBwdTileTokens, "a tile is whole runs");
static_assert(kThreads / 32 % kRunsPerTile == 0, "every CTA holds whole tiles");

constexpr int kEpilogueThreads = 256;
constexpr int kReduceLanes = kEpilogueThreads / 32;  // warps of a reduce block, one tile lane each

using namespace short_conv_elements;

// The forward's pre-activation of one channel: bias, then the taps oldest first, by fmaf
// (the order of fwd.cu, so the recomputed value is the forward's). halo[j]: the input at
// t - (W-1) + j; cur: x[t].
template <int W>
__device__ __forceinline__ float preactivation(float bias, const float (&weight)[W],
                                               const float (&halo)[W > 1 ? W - 1 : 1], float cur) {
  float pre = bias;
#pragma unroll
  for (int j = 0; j + 1 < W; ++j) pre = fmaf(weight[j], halo[j], pre);
  return fmaf(weight[W - 1], cur, pre);
}

// dy * silu'(pre) = dy * sigmoid(pre) * (1 + pre * (1 - sigmoid(pre))) (finite for every
// finite pre: sigmoid underflows to 0, never 0 * inf).
__device__ __forceinline__ float silu_grad(float dy, float pre) {
  const float sig = 1.f / (1.f + expf(-pre));
  return dy * sig * (1.f + pre * (1.f - sig));
}

struct ShortConvBwdParams {
  const void* dy;
  const void* x;
  const void* weight;
  const void* bias;
  CuSeqlens cu;
  const void* initial_state;
  void* dx;
  void* dweight;
  void* dbias;
  void* dinitial_state;
  float* workspace;  // [tiles, D, W + 1]
  int64_t T, D, N, tiles;
  DType w_dtype, s_dtype, ds_dtype;
  bool silu;
};

template <typename XT, int W, int VEC>
__global__ void __launch_bounds__(kThreads) short_conv_bwd_tokens_kernel(const ShortConvBwdParams p) {
  static_assert(W >= 1 && W <= 4, "short conv widths 1..4");
  constexpr int kHalo = W - 1;
  constexpr int kHaloSlots = kHalo > 0 ? kHalo : 1;
  using XPack = Pack<XT, VEC>;
  // This thread's sums over its run (the W taps of dweight, then dbias), per channel,
  // for the CTA's tile sums: [thread * VEC + v][W + 1], so the summing threads read
  // consecutive words.
  __shared__ float run_sums[kThreads * VEC][W + 1];

  const int64_t d0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  const int64_t run = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t t_begin = run * kTokensPerThread;

  float sums[W + 1][VEC];
#pragma unroll
  for (int i = 0; i <= W; ++i)
#pragma unroll
    for (int v = 0; v < VEC; ++v) sums[i][v] = 0.f;

  if (d0 < p.D && t_begin < p.T) {
    const int64_t t_end = min(t_begin + kTokensPerThread, p.T);
    // dx[t] takes dpre[t .. t + W-1]: the walk runs W-1 tokens past the run (those at or
    // past T contribute nothing).
    const int64_t u_end = t_end + kHalo;

    const XT* __restrict__ x = static_cast<const XT*>(p.x) + d0;
    const XT* __restrict__ dy = static_cast<const XT*>(p.dy) + d0;
    XT* __restrict__ dx = static_cast<XT*>(p.dx) + d0;
    auto load_row = [&](const XT* base, int64_t t) {
      return *reinterpret_cast<const XPack*>(base + t * p.D);
    };

    float weight[VEC][W];
    float bias[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
#pragma unroll
      for (int i = 0; i < W; ++i) weight[v][i] = load_float(p.weight, (d0 + v) * W + i, p.w_dtype);
      bias[v] = p.bias ? load_float(p.bias, d0 + v, p.w_dtype) : 0.f;
    }

    // The document of the walk's token, as in the forward (empty documents skipped).
    int64_t n = 0, doc_start = 0, doc_end = p.T;
    if constexpr (kHalo > 0) {
      n = find_document(p.cu, p.N, t_begin);
      doc_start = p.cu[n];
      doc_end = p.cu[n + 1];
    }

    // halo[v][j]: the input at u - (W-1) + j for the next token u; before a document,
    // initial_state[n, d, s] (position doc_start - (W-1) + s), or zero without one.
    float halo[VEC][kHaloSlots];
    auto load_state = [&](int j, int64_t s) {
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        halo[v][j] = p.initial_state
                         ? load_float(p.initial_state, (n * p.D + d0 + v) * kHalo + s, p.s_dtype)
                         : 0.f;
    };
#pragma unroll
    for (int j = 0; j < kHalo; ++j) {
      const int64_t pos = t_begin - kHalo + j;
      if (pos >= doc_start) {
        const XPack row = load_row(x, pos);
#pragma unroll
        for (int v = 0; v < VEC; ++v) halo[v][j] = to_float(row.v[v]);
      } else {
        load_state(j, j + (t_begin - doc_start));
      }
    }

    // acc[v][k]: dx[u - k] so far, once token u is in.
    float acc[VEC][W];
#pragma unroll
    for (int v = 0; v < VEC; ++v)
#pragma unroll
      for (int k = 0; k < W; ++k) acc[v][k] = 0.f;

    for (int64_t u0 = t_begin; u0 < u_end; u0 += kRowsInFlight) {
      XPack x_rows[kRowsInFlight], dy_rows[kRowsInFlight];
      // Unpredicated (rows past the walk re-read the last row), so the loads issue back
      // to back, as in the forward.
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        const int64_t row = min(min(u0 + r, u_end - 1), p.T - 1);
        x_rows[r] = load_row(x, row);
        dy_rows[r] = load_row(dy, row);
      }

#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r) {
        const int64_t u = u0 + r;
        if (u >= u_end) continue;
        const bool live = u < p.T;
        if (kHalo > 0 && live && u == doc_end) {
          // u opens a later document; skip any empty ones in between (bounded so a
          // malformed cu_seqlens cannot read past its end).
          while (u == doc_end && n + 1 < p.N) {
            ++n;
            doc_start = doc_end;
            doc_end = p.cu[n + 1];
          }
#pragma unroll
          for (int j = 0; j < kHalo; ++j) load_state(j, j);
        }
        // dpre[u] reaches dx[u - s] for the s <= pos whose token is in u's document.
        const int64_t pos = u - doc_start;
        const bool in_run = u < t_end;

#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const float cur = to_float(x_rows[r].v[v]);
          float dpre = to_float(dy_rows[r].v[v]);
          if (p.silu) dpre = silu_grad(dpre, preactivation<W>(bias[v], weight[v], halo[v], cur));
          if (in_run) {
#pragma unroll
            for (int i = 0; i < kHalo; ++i) sums[i][v] = fmaf(dpre, halo[v][i], sums[i][v]);
            sums[W - 1][v] = fmaf(dpre, cur, sums[W - 1][v]);
            sums[W][v] += dpre;
          }
#pragma unroll
          for (int k = W - 1; k > 0; --k) acc[v][k] = acc[v][k - 1];
          acc[v][0] = 0.f;
          if (live) {
#pragma unroll
            for (int s = 0; s < W; ++s)
              if (s == 0 || s <= pos) acc[v][s] = fmaf(dpre, weight[v][W - 1 - s], acc[v][s]);
          }
#pragma unroll
          for (int j = 0; j + 1 < kHalo; ++j) halo[v][j] = halo[v][j + 1];
          if constexpr (kHalo > 0) halo[v][kHalo - 1] = cur;
        }

        // dx[u - (W-1)] has all its taps; store it if it is this run's.
        const int64_t t = u - kHalo;
        if (t >= t_begin) {
          XPack out;
#pragma unroll
          for (int v = 0; v < VEC; ++v) out.v[v] = from_float<XT>(acc[v][W - 1]);
          *reinterpret_cast<XPack*>(dx + t * p.D) = out;
        }
      }
    }
  }

  // Tile sums: tile k of this CTA is its runs (threadIdx.y) k * kRunsPerTile onwards; each
  // (tile, channel, tap) is summed by one thread over the tile's runs in order. Threads past
  // T or D hold zeros, so a tile's sum does not depend on which of them exist.
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int v = 0; v < VEC; ++v)
#pragma unroll
    for (int i = 0; i <= W; ++i) run_sums[thread * VEC + v][i] = sums[i][v];
  __syncthreads();

  const int channels = blockDim.x * VEC;  // the CTA's channels; a run's row of run_sums
  const int tiles_here = blockDim.y / kRunsPerTile;
  const int per_tile = channels * (W + 1);
  const int64_t tile0 = int64_t(blockIdx.x) * tiles_here;
  const int64_t c0 = int64_t(blockIdx.y) * channels;
  for (int e = thread; e < tiles_here * per_tile; e += kThreads) {
    const int k = e / per_tile;
    const int ci = e - k * per_tile;  // channel * (W + 1) + tap
    const int c = ci / (W + 1);
    const int64_t tile = tile0 + k;
    if (tile >= p.tiles || c0 + c >= p.D) continue;
    const float* first = &run_sums[0][0] + int64_t(k) * kRunsPerTile * channels * (W + 1) + ci;
    float s = first[0];
#pragma unroll
    for (int r = 1; r < kRunsPerTile; ++r) s += first[r * channels * (W + 1)];
    p.workspace[(tile * p.D + c0) * (W + 1) + ci] = s;
  }
}

template <typename XT, int W>
__global__ void __launch_bounds__(kEpilogueThreads)
    short_conv_bwd_epilogue_kernel(const ShortConvBwdParams p, unsigned reduce_blocks) {
  if (blockIdx.x < reduce_blocks) {
    // dweight and dbias: element e = channel * (W + 1) + tap of the workspace; lane l (a
    // warp) sums the tiles l, l + kReduceLanes, ... in order, then lane 0 adds the lanes
    // in order. The order depends on the number of tiles only.
    __shared__ float lane_sums[kReduceLanes][32];
    const int64_t elements = p.D * (W + 1);
    const int lane = threadIdx.x / 32;
    const int64_t e = int64_t(blockIdx.x) * 32 + threadIdx.x % 32;
    float s = 0.f;
    if (e < elements) {
      const float* __restrict__ partial = p.workspace + e;
#pragma unroll 4
      for (int64_t k = lane; k < p.tiles; k += kReduceLanes) s += partial[k * elements];
    }
    lane_sums[lane][threadIdx.x % 32] = s;
    __syncthreads();
    if (lane == 0 && e < elements) {
#pragma unroll
      for (int l = 1; l < kReduceLanes; ++l) s += lane_sums[l][threadIdx.x];
      const int64_t d = e / (W + 1);
      const int i = static_cast<int>(e - d * (W + 1));
      if (i < W) store_float(p.dweight, d * W + i, p.w_dtype, s);
      else store_float(p.dbias, d, p.w_dtype, s);
    }
    return;
  }

  if constexpr (W > 1) {
    // dinitial_state[n, d, j] = sum_{p <= j, p < len} dpre[c_n + p, d] * weight[d, j - p]:
    // the taps by which document n's first W-1 tokens read its initial state.
    constexpr int kHalo = W - 1;
    const int64_t idx = int64_t(blockIdx.x - reduce_blocks) * kEpilogueThreads + threadIdx.x;
    if (idx >= p.N * p.D) return;
    const int64_t n = idx / p.D;
    const int64_t d = idx - n * p.D;
    const int64_t start = p.cu[n];
    const int64_t len = p.cu[n + 1] - start;

    float weight[W];
#pragma unroll
    for (int i = 0; i < W; ++i) weight[i] = load_float(p.weight, d * W + i, p.w_dtype);
    const float bias = p.bias ? load_float(p.bias, d, p.w_dtype) : 0.f;
    float halo[kHalo];
#pragma unroll
    for (int j = 0; j < kHalo; ++j)
      halo[j] = p.initial_state ? load_float(p.initial_state, idx * kHalo + j, p.s_dtype) : 0.f;

    const XT* __restrict__ x = static_cast<const XT*>(p.x);
    const XT* __restrict__ dy = static_cast<const XT*>(p.dy);
    float dpre[kHalo];
#pragma unroll
    for (int q = 0; q < kHalo; ++q) {
      dpre[q] = 0.f;
      if (q < len) {
        const int64_t at = (start + q) * p.D + d;
        const float cur = to_float(x[at]);
        dpre[q] = to_float(dy[at]);
        if (p.silu) dpre[q] = silu_grad(dpre[q], preactivation<W>(bias, weight, halo, cur));
#pragma unroll
        for (int j = 0; j + 1 < kHalo; ++j) halo[j] = halo[j + 1];
        halo[kHalo - 1] = cur;
      }
    }
#pragma unroll
    for (int j = 0; j < kHalo; ++j) {
      float s = 0.f;
#pragma unroll
      for (int q = 0; q <= j; ++q)
        if (q < len) s = fmaf(dpre[q], weight[j - q], s);
      store_float(p.dinitial_state, idx * kHalo + j, p.ds_dtype, s);
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename XT, int W, int VEC>
cudaError_t launch_tokens(const ShortConvBwdParams& p, cudaStream_t stream) {
  const int64_t vectors = p.D / VEC;
  // As the forward: a warp spans up to 32 vectors of one token, narrow D gives the spare
  // lanes to more runs. blockDim.y >= kThreads / 32 holds whole tiles.
  int threads_x = 1;
  while (threads_x < 32 && threads_x < vectors) threads_x *= 2;
  const dim3 block(threads_x, kThreads / threads_x);
  const int64_t runs = ceil_div(p.T, kTokensPerThread);
  const dim3 grid(static_cast<unsigned>(ceil_div(runs, block.y)),
                  static_cast<unsigned>(ceil_div(vectors, threads_x)));
  short_conv_bwd_tokens_kernel<XT, W, VEC><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename XT, int W>
cudaError_t launch_width(const ShortConvBwdParams& p, cudaStream_t stream) {
  if (p.T > 0) {
    constexpr int kBytes = kVec * sizeof(XT);
    const bool aligned = reinterpret_cast<uintptr_t>(p.x) % kBytes == 0 &&
                         reinterpret_cast<uintptr_t>(p.dy) % kBytes == 0 &&
                         reinterpret_cast<uintptr_t>(p.dx) % kBytes == 0;
    const cudaError_t err = p.D % kVec == 0 && aligned ? launch_tokens<XT, W, kVec>(p, stream)
                                                       : launch_tokens<XT, W, 1>(p, stream);
    if (err != cudaSuccess) return err;
  }
  // The epilogue runs at T = 0 too: dweight and dbias are then 0, and so is every
  // document's dinitial_state.
  const int64_t reduce_blocks = ceil_div(p.D * (W + 1), 32);
  const int64_t state_blocks = W > 1 ? ceil_div(p.N * p.D, kEpilogueThreads) : 0;
  short_conv_bwd_epilogue_kernel<XT, W>
      <<<static_cast<unsigned>(reduce_blocks + state_blocks), kEpilogueThreads, 0, stream>>>(
          p, static_cast<unsigned>(reduce_blocks));
  return cudaGetLastError();
}

}  // namespace

cudaError_t short_conv_bwd_launch(const void* dy, const void* x, const void* weight,
                                  const void* bias, const void* cu_seqlens, bool cu_int64,
                                  const void* initial_state, void* dx, void* dweight,
                                  void* dbias, void* dinitial_state, float* workspace,
                                  int64_t T, int64_t D, int W, int64_t N, DType x_dtype,
                                  DType w_dtype, DType s_dtype, DType ds_dtype, bool silu,
                                  cudaStream_t stream) {
  if (D == 0) return cudaSuccess;
  const ShortConvBwdParams p{dy,
                             x,
                             weight,
                             bias,
                             CuSeqlens{cu_seqlens, cu_int64},
                             initial_state,
                             dx,
                             dweight,
                             dbias,
                             dinitial_state,
                             workspace,
                             T,
                             D,
                             N,
                             short_conv_bwd_tiles(T),
                             w_dtype,
                             s_dtype,
                             ds_dtype,
                             silu};
  return dispatch_dtype_width(x_dtype, W, [&](auto x, auto w) {
    return launch_width<decltype(x), decltype(w)::value>(p, stream);
  });
}

}  // namespace cake
