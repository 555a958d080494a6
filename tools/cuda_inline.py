"""Builds a tool's inline CUDA source against csrc/ for the H200 (sm_90a), the one way the
GPU probes and checks in tools/ compile (torch.utils.cpp_extension.load_inline); and the
device code the probes share (PROBE_PRELUDE: their includes and helpers)."""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The start of every probe's kernel source (namespace probe): the includes (no torch
# header, so that `nvcc -cubin` checks it on a machine without a GPU), the global timer,
# and a warpgroup's bf16 fragments to and from 64-row SW128 tiles.
PROBE_PRELUDE = r"""
#include <cstdint>

#include <cuda_bf16.h>

#include "common/mma_sm80.cuh"
#include "common/swizzle.cuh"
#include "common/wgmma_sm90.cuh"

namespace probe {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The A fragments (4 k16 steps over the tile's 64 rows) of the transpose of column block
// `block` of a 64-row SW128 tile: its columns as M (16 warp ..), its rows as K; ldmatrix.trans,
// as the reverse walk loads do^T.
__device__ __forceinline__ void load_trans_frags(uint32_t (&f)[4][4], uint32_t tile, int block, int warp, int lane) {
  const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    cake::mma::ldmatrix_x4_trans(f[ks], tile + cake::sw128_offset(64, 16 * ks + (mi >> 1) * 8 + r8, 8 * block + 2 * warp + (mi & 1)));
}

// A warpgroup's 64-row bf16 A fragments (kSteps k16 steps) into rows 16 warp .. of a
// K-major SW128 tile of 64 rows.
template <int kSteps>
__device__ __forceinline__ void store_frags(const uint32_t (&f)[kSteps][4], uint32_t tile, int warp, int lane) {
  const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks)
    cake::mma::stmatrix_x4(tile + cake::sw128_offset(64, 16 * warp + (mi & 1) * 8 + r8, 2 * ks + (mi >> 1)), f[ks]);
}

}  // namespace probe
"""


def load(name: str, cpp_sources: str, cuda_sources: str, functions=("run",), ptxas_verbose: bool = False):
    """The extension module `name` built from the sources in a fresh temporary directory;
    ptxas_verbose prints each kernel's registers and spills while it builds."""
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"]
    if ptxas_verbose:
        flags += ["-Xptxas", "-v"]
    return load_inline(
        name,
        cpp_sources=cpp_sources,
        cuda_sources=cuda_sources,
        functions=list(functions),
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cuda_cflags=flags,
        build_directory=tempfile.mkdtemp(prefix=f"{name}_"),
        verbose=False,
    )


def time_chunks(mod, modes, chunks: int) -> None:
    """Times a probe's kernel (``mod.run(mode, chunks, ctas)``: ns a chunk per (CTA,
    warpgroup), one CTA on every SM) in each of ``modes`` (mode, name, the warpgroups whose
    slowest sets a chunk's time, as a column slice) after a short warm-up, and prints that
    time's mean and max over the CTAs and each warpgroup's mean."""
    import torch

    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    for mode, name, cols in modes:
        mod.run(mode, 16, ctas)  # warm-up
        ns = mod.run(mode, chunks, ctas)
        torch.cuda.synchronize()
        t = ns[:, cols].max(dim=1).values
        print(f"{name:7s} {t.mean().item():8.1f} ns a chunk (max over {ctas} CTAs {t.max().item():.1f}); "
              f"per warpgroup {', '.join(f'{x:.1f}' for x in ns.mean(dim=0).tolist())}")


def chunk_probe_main(description: str, name: str, signature: str, source: str, modes) -> int:
    """A chunk probe's command line (``--chunks``): builds its module (``run(mode, chunks,
    ctas)``, registers and spills printed) and times ``modes`` as time_chunks does."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--chunks", type=int, default=1024)
    args = ap.parse_args()
    mod = load(name, signature, source, ptxas_verbose=True)
    time_chunks(mod, modes, args.chunks)
    return 0
