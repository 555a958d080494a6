"""``python -m cake_ops.bench --cp N --emulate``: KCP's per-rank compute on one device.

The N ranks run as threads of this process on torch's threaded process group
(``cake_ops.testing.run_rank_threads``), sharing the device and its default stream, so
the device time of a KCP forward+backward is the sum of the ranks' work and over N a
rank's mean compute. Per shape it reports the single-device ``cake_ops.gdn``
forward+backward of the same global batch, the KCP step's device time, the per-rank
time over (single / N) (issue 20 bounds it by 1.15) and the bytes each rank puts into
each collective (``kcp_comm_bytes``). Before timing, ``gdn_kcp`` on the accuracy shape
is checked against the FP64 reference (o and every input gradient, rel-RMS <= 1e-2).
Times are ``kernel_ms`` as the benchmark's (profiler; wall-clock on a CPU).
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

import torch

from .accuracy import GRAD_NAMES, reference_outputs
from .report import make_meta
from .shapes import ACCURACY_SHAPE, KCP_SHAPES, QUICK_SHAPES, SHAPES, make_inputs
from .timing import Timer, median_split

NAMES = ("q", "k", "v", "g", "beta")


def _by_kernel(split: dict[str, float]) -> dict[str, float]:
    """ms per kernel name: the ranks' threads interleave their launches, so the split's
    ``name#j`` ranks within a call mean nothing here and are summed."""
    out: dict[str, float] = {}
    for label, ms in split.items():
        name = re.sub(r"#\d+$", "", label)
        out[name] = out.get(name, 0.0) + ms
    return out


def _kcp_step(inp, world: int, layout: str, align: int, out: dict):
    """A callable running one KCP forward+backward of ``inp`` on ``world`` rank threads;
    ``out[rank]`` gets (o, grads, comm bytes) of the last call."""
    from cake_ops.kcp import build_context_kcp, gdn_kcp, kcp_comm_bytes
    from cake_ops.testing import run_rank_threads

    cu = inp.cu_seqlens.tolist()  # read once here: a plan is made outside the timed step
    ranks: dict = {}

    def rank(r, w):
        # One plan and one shard of the inputs per rank, made at the first call and kept
        # (every call's threads join a threaded group of the same name), so the timed
        # steps hold neither the planning nor the sharding copies.
        if r not in ranks:
            ctx = build_context_kcp(cu, layout=layout, device=inp.q.device, align=align)
            local = [ctx.shard(getattr(inp, n)).detach().requires_grad_(True) for n in NAMES]
            ranks[r] = (ctx, local, ctx.shard(inp.do))
        ctx, local, do = ranks[r]
        o, _ = gdn_kcp(*local, ctx, use_qk_l2norm=True)
        grads = torch.autograd.grad(o, local, do)
        out[r] = (ctx, o, grads, kcp_comm_bytes(ctx, inp.v.shape[1], inp.q.shape[-1], inp.v.shape[-1]))

    return lambda: run_rank_threads(rank, world, timeout=600)


def _single_step(inp):
    import cake_ops

    leaves = [getattr(inp, n).detach().requires_grad_(True) for n in NAMES]

    def step():
        o, _ = cake_ops.gdn(*leaves, inp.cu_seqlens, use_qk_l2norm=True)
        torch.autograd.grad(o, leaves, inp.do)

    return step


def _gathered(out: dict, world: int, rows: int, pick) -> torch.Tensor:
    """A global [T, ...] tensor from every rank's local rows (``pick`` of out[rank])."""
    full = None
    for r in range(world):
        ctx, *_ = out[r]
        local = pick(out[r])
        full = local.new_zeros(rows, *local.shape[1:]) if full is None else full
        full[ctx.local_rows.to(local.device)] = local
    return full


def check_kcp_accuracy(args, device: torch.device) -> dict:
    """gdn_kcp on ``ACCURACY_SHAPE`` over the emulated ranks against the FP64 reference."""
    from cake_ops.testing import REL_RMS_TOL, accuracy

    inp = make_inputs(ACCURACY_SHAPE, device, args.gate, args.seed + 1)
    ref_o, ref_grads = reference_outputs(inp)
    out: dict = {}
    _kcp_step(inp, args.cp, args.layout, args.align, out)()
    T = inp.q.shape[0]
    got = [("o", _gathered(out, args.cp, T, lambda x: x[1].detach()), ref_o)]
    got += [(n, _gathered(out, args.cp, T, lambda x, i=i: x[2][i]), ref) for i, (n, ref) in
            enumerate(zip(GRAD_NAMES, ref_grads))]
    rel = {n: accuracy(x, ref).rel_rms for n, x, ref in got}
    ok = all(math.isfinite(v) and v <= REL_RMS_TOL for v in rel.values())
    return {"ok": ok, "rel_rms": rel}


def run_kcp(args) -> dict:
    device = torch.device(args.device)
    report: dict[str, Any] = {"meta": make_meta(args, device), "accuracy": None, "results": []}
    report["meta"].update(cp=args.cp, layout=args.layout, align=args.align, emulate=True)
    acc = check_kcp_accuracy(args, device)
    report["accuracy"] = acc
    worst = max(acc["rel_rms"].values())
    print(f"accuracy gdn_kcp CP{args.cp} layout {args.layout} worst rel-RMS {worst:.2e}: "
          f"{'ok' if acc['ok'] else 'FAIL, not timed'}", flush=True)
    if not acc["ok"]:
        return report
    timer = Timer(device)
    for name in args.shapes:
        shape = {**SHAPES, **QUICK_SHAPES, **KCP_SHAPES}[name]
        inp = make_inputs(shape, device, args.gate, args.seed)
        out: dict = {}
        steps = {"single": _single_step(inp), "kcp": _kcp_step(inp, args.cp, args.layout, args.align, out)}
        for step in steps.values():
            for _ in range(args.warmup):
                step()
        timer.sync()
        ms, kernels = {}, {}
        for k, step in steps.items():
            samples, splits = [], []
            for _ in range(args.calls):
                samples.append(timer.kernel_ms(step, 1)[0])
                splits.append(_by_kernel(timer.last_kernels))
            ms[k], kernels[k] = statistics.median(samples), median_split(splits)
        per_rank = ms["kcp"] / args.cp
        row = {"shape": name, "single_ms": ms["single"], "kcp_all_ranks_ms": ms["kcp"], "per_rank_ms": per_rank,
               "per_rank_over_single_per_rank": per_rank / (ms["single"] / args.cp),
               "comm_bytes_per_rank": out[0][3], "kernels": kernels}
        report["results"].append(row)
        del inp, out, steps
    return report


def format_kcp_table(report: dict) -> str:
    meta = report["meta"]
    lines = [f"KCP CP{meta['cp']} layout {meta['layout']}, ranks emulated as threads on one {meta['device']} "
             f"({meta['timing']} timing; per rank = all ranks / {meta['cp']})",
             f"{'shape':10s} {'single_ms':>10s} {'kcp_ms':>10s} {'per_rank':>10s} {'x single/N':>10s}  bytes per rank per collective"]
    for r in report["results"]:
        comm = ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in r["comm_bytes_per_rank"].items()) or "none"
        lines.append(f"{r['shape']:10s} {r['single_ms']:10.3f} {r['kcp_all_ranks_ms']:10.3f} {r['per_rank_ms']:10.3f} "
                     f"{r['per_rank_over_single_per_rank']:10.2f}  {comm}")
    return "\n".join(lines)


def format_kcp_kernels(report: dict, min_ms: float = 0.01) -> str:
    """Per shape, each kernel's ms per step, single device against all KCP ranks, largest
    difference first: what KCP adds."""
    out = ["kernels per step (ms; median over the kernel_ms samples), single device | KCP all ranks | difference:"]
    for r in report["results"]:
        single, kcp = r["kernels"]["single"], r["kernels"]["kcp"]
        out.append(f"{r['shape']}")
        rows = sorted(set(single) | set(kcp), key=lambda n: -(kcp.get(n, 0.0) - single.get(n, 0.0)))
        for n in rows:
            a, b = single.get(n, 0.0), kcp.get(n, 0.0)
            if max(a, b) >= min_ms:
                out.append(f"  {a:8.3f} {b:8.3f} {b - a:+8.3f}  {n}")
    return "\n".join(out)
