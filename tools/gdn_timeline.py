#!/usr/bin/env python
"""The kernels of one GDN forward+backward on a timeline: what runs when, on which stream,
with what grid, and how much of the step the device is busy.

    python tools/gdn_timeline.py [--shapes s32k_h16,s16k_h8] [--save-mode light|full] [--op fwdbwd|ckpt]

For each shape (the benchmark's shapes and inputs, deterministic, in-op L2 norm): a few
warm-up steps, then one profiled step (torch.profiler, its chrome trace read back), and a
table of its kernels in order of start: start and end in µs from the first kernel's
start, duration, stream, grid and block, registers a thread and dynamic shared memory.
Below it, the step's busy time (the union of the kernels' intervals) and its gaps (where
no kernel runs: the host or a dependency holding the device), and per stream the sum of
its kernels' durations. docs/kernels.md, Backward ("The step on a timeline"), reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import cake_ops  # noqa: E402
from cake_ops.bench.shapes import SHAPES, make_inputs, shape_names  # noqa: E402
from cake_ops.bench.timing import busy_us, short_kernel_name  # noqa: E402


def step_fn(inp, op: str, save_mode: str):
    leaves = [t.detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]

    def fn(q, k, v, g, beta):
        o, _ = cake_ops.gdn(q, k, v, g, beta, inp.cu_seqlens, use_qk_l2norm=True, save_mode=save_mode)
        return o

    def step():
        if op == "ckpt":
            o = checkpoint(fn, *leaves, use_reentrant=False)
        else:
            o = fn(*leaves)
        return torch.autograd.grad(o, leaves, inp.do)

    return step


def kernels_of(step) -> list[dict]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    out = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("ph") == "X"]
    return sorted(out, key=lambda e: e["ts"])


def summary(ks: list[dict]) -> dict:
    """Of trace events (each with ts, dur in µs and args.stream): the step's length from the
    first start, the busy time (the union of the intervals, as the bench's kernel_ms), the
    gaps between them (start offset, length) and each stream's sum of durations."""
    t0 = ks[0]["ts"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks)
    gaps, end = [], t0
    for s, f in spans:
        if s > end:
            gaps.append((end - t0, s - end))
        end = max(end, f)
    per_stream: dict = {}
    for e in ks:
        stream = e.get("args", {}).get("stream", "-")
        per_stream[stream] = per_stream.get(stream, 0.0) + e["dur"]
    return {"step": end - t0, "busy": busy_us(spans), "gaps": gaps, "per_stream": per_stream}


def report(name: str, ks: list[dict]) -> None:
    t0 = ks[0]["ts"]
    print(f"== {name}: {len(ks)} kernels")
    print(f"{'start':>8} {'end':>8} {'dur':>7}  {'stream':>6}  {'grid':>14} {'block':>11} {'regs':>4} {'smem':>6}  kernel")
    for e in ks:
        a = e.get("args", {})
        grid = "x".join(str(x) for x in a.get("grid", [])) or "-"
        block = "x".join(str(x) for x in a.get("block", [])) or "-"
        print(f"{e['ts'] - t0:8.1f} {e['ts'] + e['dur'] - t0:8.1f} {e['dur']:7.1f}  {a.get('stream', '-'):>6}  "
              f"{grid:>14} {block:>11} {a.get('registers per thread', '-'):>4} "
              f"{a.get('shared memory', '-'):>6}  {short_kernel_name(e['name'])[:60]}")
    s = summary(ks)
    print(f"step {s['step']:.1f} µs, busy {s['busy']:.1f} µs; gaps over 2 µs: "
          + ", ".join(f"{g:.1f} at {at:.1f}" for at, g in s["gaps"] if g > 2))
    print("per stream (sum of durations, µs): " + ", ".join(f"{k}: {v:.1f}" for k, v in s["per_stream"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="s32k_h16")
    ap.add_argument("--op", default="fwdbwd", choices=("fwdbwd", "ckpt"))
    ap.add_argument("--save-mode", default="light", choices=("light", "full"))
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    try:
        names = shape_names(args.shapes)  # before any GPU work
    except ValueError as e:
        ap.error(str(e))
    device = torch.device("cuda")
    for name in names:
        inp = make_inputs(SHAPES[name], device, "mamba", seed=0)
        step = step_fn(inp, args.op, args.save_mode)
        for _ in range(args.warmup):
            step()
        report(f"{name} {args.op} save_mode={args.save_mode}", kernels_of(step))
        del inp, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
