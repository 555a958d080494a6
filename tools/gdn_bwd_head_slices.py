#!/usr/bin/env python
"""The CUDA GDN backward's variants side by side: each head-slice count (docs/kernels.md,
"Head slices") and each form of the reverse walk's summaries and tape walk
(reverse_walk 0: mma.sync, the default; 1: wgmma on the forward walk's CTA, not yet the
default; docs/kernels.md, "Backward"): time and peak memory per shape.

    python tools/gdn_bwd_head_slices.py [--shapes s32k_h16,...] [--slices 1,2,4] [--reverse-walk 0,1] [--calls 5]

Per benchmark shape (cake_ops/bench/shapes.py, its inputs and mamba gate): the median
over --calls of one torch.ops.cake_cuda.gdn_bwd (deterministic, in-op L2 norm, no initial
state) by CUDA events, and the allocator's peak during one call above what it held
before, for each form of --reverse-walk and head_slices = each of --slices that divides H
and -1 (the plan's choice, reported as "auto"). Within a form every count's gradients are
checked bitwise equal to the first's; across forms (other summation orders) the last
column is each gradient's rel-RMS difference from the first form's. Repo root, Hopper GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cake_ops import build  # noqa: E402
from cake_ops.bench.shapes import SHAPES, make_inputs  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--slices", default="1,2,4")
    ap.add_argument("--reverse-walk", default="0", help="comma list of the reverse walk's forms (0, 1)")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    ops = build.load()
    dev = torch.device("cuda")
    print(f"{'shape':10} {'form':>4} {'slices':>6} {'ms':>8} {'peak MiB':>9}  rel-RMS vs the first form")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        x = make_inputs(shape, dev, "mamba", seed=0)

        def bwd(form, slices):
            return ops.gdn_bwd(x.do, None, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, None, shape.K**-0.5, True, True,
                               -1, -1, slices, None, form)

        reference = None  # the first form's gradients
        for form in [int(f) for f in args.reverse_walk.split(",")]:
            first = None
            for slices in [int(s) for s in args.slices.split(",") if shape.H % int(s) == 0] + [-1]:
                grads = bwd(form, slices)
                if first is None:
                    first = grads
                    reference = reference if reference is not None else grads
                assert all(torch.equal(a, b) for a, b in zip(first, grads)), f"{name}: {slices} slices: other bits"
                del grads
                times = []
                for _ in range(args.calls):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    bwd(form, slices)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end))
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                grads = bwd(form, slices)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                del grads
                label = "auto" if slices == -1 else str(slices)
                diff = "  ".join(f"{n} {rel_rms(a, b):.1e}" for n, a, b in zip(NAMES, first, reference))
                print(f"{name:10} {form:>4} {label:>6} {statistics.median(times):8.3f} {peak / 2**20:9.0f}  {diff}",
                      flush=True)
            del first
        del reference, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
