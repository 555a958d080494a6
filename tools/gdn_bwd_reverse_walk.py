#!/usr/bin/env python
"""The CUDA GDN backward with each form of the reverse walk's summaries and tape walk side
by side: reverse_walk = 0 (mma.sync, bwd_walk.cu, the default) and 1 (the forward walk's
CTA in its reverse modes, wgmma, fwd_walk_reverse.cuh); docs/kernels.md, "Backward".

    python tools/gdn_bwd_reverse_walk.py [--shapes s32k_h16,...] [--calls 5] [--rounds 2]

Per benchmark shape (cake_ops/bench/shapes.py, its inputs and mamba gate): one
torch.ops.cake_cuda.gdn_bwd (deterministic, in-op L2 norm, no initial state) per form,
timed by CUDA events (the median over --calls, the forms in palindromic order over
--rounds), the allocator's peak during one call above what it held before, the time of
the tape walk's own kernel (one profiler session per form, after the timing; the walks
run beside the recompute's, so their kernels stretch), and the
gradients' rel-RMS difference between the forms (not bitwise: the forms' products sum in
other orders). Repo root, Hopper GPU.
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

FORMS = (0, 1)
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# The tape walk's kernel in each form (what the profiler names them).
WALK_KERNEL = {0: "gdn_bwd_walk_kernel", 1: "WalkMode)4"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    ops = build.load()
    dev = torch.device("cuda")
    print(f"{'shape':10} {'form':>4} {'ms':>8} {'walk ms':>8} {'peak MiB':>9}  rel-RMS vs form 0")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        x = make_inputs(shape, dev, "mamba", seed=0)

        def bwd(form):
            return ops.gdn_bwd(x.do, None, x.q, x.k, x.v, x.g, x.beta, x.cu_seqlens, None, shape.K**-0.5, True, True,
                               -1, -1, -1, None, form)

        grads = {form: bwd(form) for form in FORMS}
        times = {form: [] for form in FORMS}
        for r in range(args.rounds):
            for form in FORMS if r % 2 == 0 else FORMS[::-1]:
                for _ in range(args.calls):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    bwd(form)
                    end.record()
                    torch.cuda.synchronize()
                    times[form].append(start.elapsed_time(end))
        for form in FORMS:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            bwd(form)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                bwd(form)
                torch.cuda.synchronize()
            walk_us = sum(e.device_time_total for e in prof.key_averages() if WALK_KERNEL[form] in e.key)
            diff = "  ".join(
                f"{n} {((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item():.1e}"
                for n, a, b in zip(NAMES, grads[form], grads[0]))
            print(f"{name:10} {form:>4} {statistics.median(times[form]):8.3f} {walk_us / 1e3:8.3f} "
                  f"{peak / 2**20:9.0f}  {diff}", flush=True)
        del grads, x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
