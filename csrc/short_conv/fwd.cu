// Forward of the short causal convolution (see short_conv/short_conv.h for the math).
//
// Why it is as it is: the op is memory bound (about 2 * T * D elements moved for W * T * D
// FMAs), so the layout serves the loads: one thread owns VEC consecutive channels
// (one 16-byte load per token) over a run of kTokensPerThread consecutive tokens,
// and slides the W-1 previous inputs through registers. Each input row is read
// once per run, plus W-1 halo rows at the run's start. Every output is computed by
// one thread in a fixed order, so results are deterministic and independent of the
// launch shape.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "short_conv/elements.cuh"
#include "short_conv/short_conv.h"

namespace cake {
namespace {

constexpr int kThreads = 128;
constexpr int kTokensPerThread = 16;
// Rows loaded before they are used: several 16-byte loads in flight per thread
// hide HBM latency at the modest occupancy the register window allows.
constexpr int kRowsInFlight = 4;
static_assert(kTokensPerThread % kRowsInFlight == 0, "runs are whole load groups");

using namespace short_conv_elements;

struct ShortConvFwdParams {
  const void* x;
  const void* weight;
  const void* bias;
  const void* cu_seqlens;
  const void* initial_state;
  void* y;
  int64_t T, D, N;
  DType w_dtype, s_dtype;
  bool cu_int64;
  bool silu;

  __device__ __forceinline__ int64_t cu(int64_t n) const {
    return cu_int64 ? static_cast<const int64_t*>(cu_seqlens)[n]
                    : static_cast<const int32_t*>(cu_seqlens)[n];
  }
};

template <typename XT, int W, int VEC>
__global__ void __launch_bounds__(kThreads) short_conv_fwd_kernel(const ShortConvFwdParams p) {
  static_assert(W >= 1 && W <= 4, "short conv widths 1..4");
  constexpr int kHalo = W - 1;
  using XPack = Pack<XT, VEC>;

  const int64_t d0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
  const int64_t t_begin = (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * kTokensPerThread;
  if (d0 >= p.D || t_begin >= p.T) return;
  const int64_t t_end = min(t_begin + kTokensPerThread, p.T);

  // This thread's column of x and y.
  const XT* __restrict__ x = static_cast<const XT*>(p.x) + d0;
  XT* __restrict__ y = static_cast<XT*>(p.y) + d0;
  auto load_row = [&](int64_t t) { return *reinterpret_cast<const XPack*>(x + t * p.D); };

  float weight[W][VEC];
  float bias[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
#pragma unroll
    for (int i = 0; i < W; ++i) weight[i][v] = load_float(p.weight, (d0 + v) * W + i, p.w_dtype);
    bias[v] = p.bias ? load_float(p.bias, d0 + v, p.w_dtype) : 0.f;
  }

  // Document n of t_begin: the last n with cu[n] <= t_begin, so empty documents
  // ending at t_begin are skipped. Invariant: cu[lo] <= t_begin < cu[hi]. (The search of
  // common/varlen.cuh's find_document, written out: through CuSeqlens this kernel's
  // code and registers change, unmeasured, so it keeps its own.)
  int64_t lo = 0, hi = p.N;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (p.cu(mid) <= t_begin) lo = mid;
    else hi = mid;
  }
  int64_t n = lo;
  int64_t doc_start = p.cu(n);
  int64_t doc_end = p.cu(n + 1);

  // halo[j] holds the input at position t - (W-1) + j for the next token t.
  float halo[kHalo > 0 ? kHalo : 1][VEC];
  // Inputs before a document come from initial_state[n, d, s] (position
  // doc_start - (W-1) + s), or are zero without one.
  auto load_state = [&](int j, int64_t s) {
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      halo[j][v] = p.initial_state
                       ? load_float(p.initial_state, (n * p.D + d0 + v) * kHalo + s, p.s_dtype)
                       : 0.f;
  };
#pragma unroll
  for (int j = 0; j < kHalo; ++j) {
    const int64_t pos = t_begin - kHalo + j;
    if (pos >= doc_start) {
      const XPack row = load_row(pos);
#pragma unroll
      for (int v = 0; v < VEC; ++v) halo[j][v] = to_float(row.v[v]);
    } else {
      load_state(j, j + (t_begin - doc_start));
    }
  }

  for (int64_t t0 = t_begin; t0 < t_end; t0 += kRowsInFlight) {
    XPack rows[kRowsInFlight];
#pragma unroll
    // Unpredicated: a run's last group re-reads its last row instead, so the
    // loads issue back to back (the predicated form also made ptxas spill).
    for (int r = 0; r < kRowsInFlight; ++r) rows[r] = load_row(min(t0 + r, t_end - 1));

#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t t = t0 + r;
      if (t >= t_end) continue;
      // Document boundaries matter only through the halo (W = 1 has none).
      if (kHalo > 0 && t == doc_end) {
        // t opens a later document; skip any empty ones in between (bounded so
        // a malformed cu_seqlens cannot read past its end).
        while (t == doc_end && n + 1 < p.N) {
          ++n;
          doc_start = doc_end;
          doc_end = p.cu(n + 1);
        }
#pragma unroll
        for (int j = 0; j < kHalo; ++j) load_state(j, j);
      }

      XPack out;
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const float cur = to_float(rows[r].v[v]);
        float pre = bias[v];
#pragma unroll
        for (int j = 0; j < kHalo; ++j) pre = fmaf(weight[j][v], halo[j][v], pre);
        pre = fmaf(weight[kHalo][v], cur, pre);
        out.v[v] = from_float<XT>(p.silu ? pre / (1.f + expf(-pre)) : pre);
#pragma unroll
        for (int j = 0; j + 1 < kHalo; ++j) halo[j][v] = halo[j + 1][v];
        if constexpr (kHalo > 0) halo[kHalo - 1][v] = cur;
      }
      *reinterpret_cast<XPack*>(y + t * p.D) = out;
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename XT, int W, int VEC>
cudaError_t launch(const ShortConvFwdParams& p, cudaStream_t stream) {
  const int64_t vectors = p.D / VEC;
  // A warp spans up to 32 vectors of one token (512 contiguous bytes at 16-byte
  // vectors); narrow D gives the spare lanes to more token runs instead.
  int threads_x = 1;
  while (threads_x < 32 && threads_x < vectors) threads_x *= 2;
  const dim3 block(threads_x, kThreads / threads_x);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.T, int64_t(block.y) * kTokensPerThread)),
                  static_cast<unsigned>(ceil_div(vectors, threads_x)));
  short_conv_fwd_kernel<XT, W, VEC><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename XT, int W>
cudaError_t launch_vectorised_or_scalar(const ShortConvFwdParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(XT);
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.y) % 16 == 0;
  if (p.D % kVec == 0 && aligned) return launch<XT, W, kVec>(p, stream);
  return launch<XT, W, 1>(p, stream);
}

}  // namespace

cudaError_t short_conv_fwd_launch(const void* x, const void* weight, const void* bias,
                                  const void* cu_seqlens, bool cu_int64,
                                  const void* initial_state, void* y, int64_t T, int64_t D,
                                  int W, int64_t N, DType x_dtype, DType w_dtype,
                                  DType s_dtype, bool silu, cudaStream_t stream) {
  if (T == 0 || D == 0) return cudaSuccess;
  const ShortConvFwdParams p{x, weight, bias, cu_seqlens, initial_state, y, T, D, N,
                             w_dtype, s_dtype, cu_int64, silu};
  return dispatch_dtype_width(x_dtype, W, [&](auto x, auto w) {
    return launch_vectorised_or_scalar<decltype(x), decltype(w)::value>(p, stream);
  });
}

}  // namespace cake
