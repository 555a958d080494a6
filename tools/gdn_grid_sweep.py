#!/usr/bin/env python
"""The forward and the light backward of the CUDA GDN kernels timed at forced cut grids, per
benchmark shape: whether a shape would run faster cut finer or coarser than the plan cuts it
(docs/kernels.md, "Plan and cut grid"; a Hopper GPU, repo root).

    python tools/gdn_grid_sweep.py [--shapes s32k_h16,s32k_h2] [--grids -1,0,16,24,32,48,64]
                                   [--nondeterministic] [--calls 5]

A grid is what the ops' ``segment_chunks`` takes: -1 the plan's own (for the deterministic
plan the 64-chunk grid, halved for long documents of few walks), 0 uncut, else every
that many chunks of every document alike (a forced grid has no finer long-document grid).
Each cell times ``torch.ops.cake_cuda.gdn_fwd`` and ``gdn_bwd`` (no final state gradient,
no initial state) on the benchmark's inputs (mamba gate, in-op L2 norm): the median of
--calls calls issued back to back (the benchmark's ``stream_ms``, ``cake_ops.bench.timing``),
after two warm-up calls, and prints fwd, bwd
and their sum in ms, with the sum's ratio to the plan's (-1; the first grid if -1 is not
among them). The raw ops carry no autograd and no host-side Python of ``cake_ops.gdn``:
the times are the kernels' and their launches'. The bits differ between grids (a cut
changes which fp32 chain a state comes from), so nothing is compared but time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cake_ops.bench.shapes import SHAPES, make_inputs, shape_names  # noqa: E402
from cake_ops.checks import MAX_SEGMENT_CHUNKS  # noqa: E402


def parse_grids(text: str) -> list[int]:
    """``--grids``: comma-separated cut grids, each -1, 0 or 1 .. MAX_SEGMENT_CHUNKS, no repeats."""
    try:
        grids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--grids takes comma-separated integers, got {text!r}") from None
    bad = [x for x in grids if not -1 <= x <= MAX_SEGMENT_CHUNKS]
    if bad:
        raise ValueError(f"--grids: each must be -1 (the plan's), 0 (uncut) or 1 .. {MAX_SEGMENT_CHUNKS}, got {bad}")
    if len(set(grids)) != len(grids):
        raise ValueError(f"--grids repeats a grid: {text!r}")
    return grids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="s32k_h16,s32k_h2,s16k_long,s16k_h8")
    ap.add_argument("--grids", default="-1,0,16,24,32,48,64")
    ap.add_argument("--nondeterministic", action="store_true", help="the non-deterministic plan (its -1 is the "
                    "cost model's grid)")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        shapes, grids = shape_names(args.shapes), parse_grids(args.grids)
    except ValueError as e:
        ap.error(str(e))
    if args.calls < 1:
        ap.error("--calls must be at least 1")

    from cake_ops import build
    from cake_ops.bench.timing import Timer

    ops = build.load()
    dev = torch.device("cuda")
    timer = Timer(dev)

    def median_ms(fn) -> float:
        for _ in range(2):
            fn()
        return statistics.median(timer.stream_ms(fn, args.calls))

    deterministic = not args.nondeterministic
    print(f"{torch.cuda.get_device_name(dev)}, {torch.cuda.get_device_properties(dev).multi_processor_count} SMs; "
          f"{'deterministic' if deterministic else 'non-deterministic'} plan, mamba gate, in-op L2 norm")
    print(f"{'shape':10s} {'grid':>5s} {'fwd ms':>8s} {'bwd ms':>8s} {'sum ms':>8s} {'/ base':>7s}")
    for name in shapes:
        x = make_inputs(SHAPES[name], dev, "mamba", 0)
        scale = x.q.shape[-1] ** -0.5
        base = None
        for grid in sorted(grids, key=lambda g: g != -1):  # the plan's first: the ratios' base

            def fwd():
                return ops.gdn_fwd(x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, None, scale, True, deterministic, grid)

            def bwd():
                return ops.gdn_bwd(x.do, None, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, None, scale, True,
                                   deterministic, grid)

            f, b = median_ms(fwd), median_ms(bwd)
            base = base or f + b
            print(f"{name:10s} {grid:5d} {f:8.3f} {b:8.3f} {f + b:8.3f} {(f + b) / base:7.3f}", flush=True)


if __name__ == "__main__":
    main()
