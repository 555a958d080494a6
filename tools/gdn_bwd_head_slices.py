#!/usr/bin/env python
"""The CUDA GDN backward at each head-slice count: time and peak memory per shape, and
what the plan chooses (docs/kernels.md, "Head slices").

    python tools/gdn_bwd_head_slices.py [--shapes s32k_h16,...] [--slices 1,2,4] [--calls 5]

Per benchmark shape (cake_ops/bench/shapes.py, its inputs and mamba gate): the median
over --calls of one torch.ops.cake_cuda.gdn_bwd (deterministic, in-op L2 norm, no initial
state) by CUDA events, and the allocator's peak during one call above what it held
before, for head_slices = each of --slices that divides H and -1 (the plan's choice,
reported as "auto"). Every count's gradients are checked bitwise equal to the first's.
Repo root, Hopper GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cake_ops import build  # noqa: E402
from cake_ops.bench.shapes import SHAPES, make_inputs, shape_names  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--slices", default="1,2,4")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    try:
        names = shape_names(args.shapes)  # before any GPU work
    except ValueError as e:
        ap.error(str(e))
    ops = build.load()
    dev = torch.device("cuda")
    print(f"{'shape':10} {'slices':>6} {'ms':>8} {'peak MiB':>9}")
    for name in names:
        shape = SHAPES[name]
        x = make_inputs(shape, dev, "mamba", seed=0)

        def bwd(slices):
            return ops.gdn_bwd(x.do, None, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, None, shape.K**-0.5, True, True,
                               -1, -1, slices)

        first = None
        for slices in [int(s) for s in args.slices.split(",") if shape.H % int(s) == 0] + [-1]:
            grads = bwd(slices)
            if first is None:
                first = grads
            assert all(torch.equal(a, b) for a, b in zip(first, grads)), f"{name}: {slices} slices: other bits"
            del grads
            times = []
            for _ in range(args.calls):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                bwd(slices)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = bwd(slices)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del grads
            label = "auto" if slices == -1 else str(slices)
            print(f"{name:10} {label:>6} {statistics.median(times):8.3f} {peak / 2**20:9.0f}", flush=True)
        del first, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
