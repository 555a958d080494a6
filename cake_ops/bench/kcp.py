"""``python -m cake_ops.bench --cp N --emulate``: KCP's per-rank compute on one device.

The N ranks run as threads of this process on torch's threaded process group
(``cake_ops.testing.run_rank_threads``), sharing the device and its default stream, so
the device time of a KCP forward+backward is the sum of the ranks' work and over N a
rank's mean compute. Per shape it reports the single-device ``cake_ops.gdn``
forward+backward of the same global batch, the KCP step's device time, the per-rank
time over (single / N) (issue 20 bounds it by 1.15) and the bytes each rank puts into
each collective (``kcp_comm_bytes``). Then each rank's step runs alone, its collectives
served from what a threaded step received (``_Collectives``), checked bitwise against the
threaded step's outputs and gradients: the slowest rank's time alone is what a machine of
one GPU a rank would take before communication and waits (issue 21's targets bound the
slowest rank's step, communication included, at 0.6x the single device at CP 2 and 0.2x
at CP 8). Before timing, ``gdn_kcp`` on the accuracy shape
is checked against the FP64 reference (o and every input gradient, rel-RMS <= 1e-2).
Times are ``kernel_ms`` as the benchmark's (profiler; wall-clock on a CPU).

``kcp_scaling`` / ``format_kcp_scaling``: the curve over several degrees (``--cp 1,2,4,8``),
of either mode's reports.
"""

from __future__ import annotations

import contextlib
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


class _EmulatedKcp:
    """One KCP forward+backward of ``inp`` (the global inputs) on ``world`` rank threads
    (``step``); ``out[rank]`` gets (ctx, o, grads, comm bytes) of the last call.

    ``alone(rank)``: that rank's step run by itself, its collectives served from those
    ``record()`` saw it receive (``_Collectives``), so its time is its own work with the
    whole device, as on a machine of one GPU a rank, without the communication."""

    def __init__(self, inp, world: int, layout: str, align: int):
        self.inp, self.world, self.layout, self.align = inp, world, layout, align
        self.cu = inp.cu_seqlens.tolist()  # read once here: a plan is made outside the timed step
        self.ranks: dict = {}
        self.out: dict = {}
        self.collectives = _Collectives()

    def _rank_step(self, r: int):
        from cake_ops.kcp import gdn_kcp

        ctx, local, do = self.ranks[r]
        o, _ = gdn_kcp(*local, ctx, use_qk_l2norm=True)
        return ctx, o, torch.autograd.grad(o, local, do)

    def _rank(self, r: int, w: int):
        from cake_ops.kcp import build_context_kcp, kcp_comm_bytes

        # One plan and one shard of the inputs per rank, made at the first call and kept
        # (every call's threads join a threaded group of the same name), so the timed
        # steps hold neither the planning nor the sharding copies.
        inp = self.inp
        if r not in self.ranks:
            ctx = build_context_kcp(self.cu, layout=self.layout, device=inp.q.device, align=self.align)
            local = [ctx.shard(getattr(inp, n)).detach().requires_grad_(True) for n in NAMES]
            self.ranks[r] = (ctx, local, ctx.shard(inp.do))
        ctx, o, grads = self._rank_step(r)
        self.out[r] = (ctx, o, grads, kcp_comm_bytes(ctx, inp.v.shape[1], inp.q.shape[-1], inp.v.shape[-1]))

    def step(self):
        from cake_ops.testing import run_rank_threads

        run_rank_threads(self._rank, self.world, timeout=600)

    def record(self):
        """One threaded step, every rank's received collectives kept."""
        with self.collectives.recording():
            self.step()

    def alone(self, r: int):
        """A callable running rank ``r``'s step alone; ``check()`` of its last call says
        whether its outputs and gradients are the threaded step's bits."""
        last = {}

        def run():
            with self.collectives.replaying(r):
                last["got"] = self._rank_step(r)

        def check() -> bool:
            _, o, grads, _ = self.out[r]
            _, o2, grads2 = last["got"]
            return all(torch.equal(a, b) for a, b in zip((o, *grads), (o2, *grads2)))

        run.check = check
        return run


class _Collectives:
    """``cake_ops.kcp.collectives``' exchanges (gather, gather_adjoint, shift: every KCP
    collective goes through them) recorded per rank in call order while the ranks run as
    threads, then served back in that order to one rank running alone. Each served call
    is checked against the recorded one (the same exchange on the same input shape)."""

    NAMES = ("gather", "gather_adjoint", "shift")

    def __init__(self):
        self.calls: dict[int, list] = {}

    @contextlib.contextmanager
    def _patched(self, make):
        from cake_ops.kcp import collectives

        real = {n: getattr(collectives, n) for n in self.NAMES}
        for n in self.NAMES:
            setattr(collectives, n, make(n, real[n]))
        try:
            yield
        finally:
            for n in self.NAMES:
                setattr(collectives, n, real[n])

    def recording(self):
        self.calls = {}

        def make(name, fn):
            def recorded(x, *args, **kwargs):
                y = fn(x, *args, **kwargs)
                self.calls.setdefault(args[-1].rank, []).append((name, tuple(x.shape), y))
                return y
            return recorded

        return self._patched(make)

    @contextlib.contextmanager
    def replaying(self, rank: int):
        calls, at = self.calls.get(rank, []), 0

        def make(name, fn):
            def served(x, *args, **kwargs):
                nonlocal at
                if at >= len(calls) or calls[at][:2] != (name, tuple(x.shape)):
                    want = calls[at][:2] if at < len(calls) else "none"
                    raise RuntimeError(f"rank {rank} alone: collective {at} is {name} of {tuple(x.shape)}, "
                                       f"the threaded step's was {want}")
                at += 1
                return calls[at - 1][2]
            return served

        with self._patched(make):
            yield
        if at != len(calls):
            raise RuntimeError(f"rank {rank} alone: {at} collectives, the threaded step's {len(calls)}")


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
    kcp = _EmulatedKcp(inp, args.cp, args.layout, args.align)
    kcp.step()
    out = kcp.out
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
        kcp = _EmulatedKcp(inp, args.cp, args.layout, args.align)
        steps = {"single": _single_step(inp), "kcp": kcp.step}
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
               "comm_bytes_per_rank": kcp.out[0][3], "kernels": kernels}
        try:  # a failure here leaves the row's threaded timings, and says why
            row.update(_time_alone(kcp, timer, args, ms["single"]))
        except Exception as e:  # noqa: BLE001 - reported in the row and the table
            row.update(rank_alone_ms=None, slowest_rank=None, slowest_alone_ms=None, slowest_alone_over_single=None,
                       alone_bitwise=None, rank_alone_peak_bytes=None, alone_error=f"{type(e).__name__}: {e}")
        report["results"].append(row)
        del inp, kcp, steps
    return report


def _time_alone(kcp: _EmulatedKcp, timer: Timer, args, single_ms: float) -> dict:
    """Every rank's step alone (``_EmulatedKcp.alone``), each checked bitwise against the
    threaded step, timed (median kernel_ms over ``args.calls``) and its peak bytes
    measured (the allocator's peak above what the rank held before: its activations and
    workspaces; None without CUDA)."""
    kcp.record()
    alone, peaks, bitwise = [], [], True
    for r in range(kcp.world):
        step = kcp.alone(r)
        for _ in range(max(args.warmup, 1)):
            step()
        bitwise = bitwise and step.check()
        alone.append(statistics.median(timer.kernel_ms(step, 1)[0] for _ in range(args.calls)))
        peaks.append(timer.peak_memory(step))
    slowest = max(range(kcp.world), key=lambda r: alone[r])
    return {"rank_alone_ms": alone, "slowest_rank": slowest, "slowest_alone_ms": alone[slowest],
            "slowest_alone_over_single": alone[slowest] / single_ms, "alone_bitwise": bitwise,
            "rank_alone_peak_bytes": peaks}


def format_kcp_table(report: dict) -> str:
    meta = report["meta"]
    lines = [f"KCP CP{meta['cp']} layout {meta['layout']}, ranks emulated as threads on one {meta['device']} "
             f"({meta['timing']} timing; per rank = all ranks / {meta['cp']}; alone: each rank's step by itself, "
             f"its collectives served from a threaded step, so without communication)",
             f"{'shape':16s} {'single_ms':>10s} {'kcp_ms':>10s} {'per_rank':>10s} {'x single/N':>10s} "
             f"{'slowest':>10s} {'x single':>9s}  bytes per rank per collective"]
    for r in report["results"]:
        comm = ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in r["comm_bytes_per_rank"].items()) or "none"
        if r.get("alone_error"):
            slowest = f"{'-':>10s} {'-':>9s} (alone failed: {r['alone_error']})"
        else:
            slowest = f"{r['slowest_alone_ms']:10.3f} {r['slowest_alone_over_single']:9.3f}"
            peaks = [b for b in r["rank_alone_peak_bytes"] if b is not None]
            if peaks:
                slowest += f" (largest rank peak {max(peaks) / 2**20:.1f} MiB)"
            if not r["alone_bitwise"]:
                slowest += " (alone NOT the threaded bits)"
        lines.append(f"{r['shape']:16s} {r['single_ms']:10.3f} {r['kcp_all_ranks_ms']:10.3f} {r['per_rank_ms']:10.3f} "
                     f"{r['per_rank_over_single_per_rank']:10.2f} {slowest}  {comm}")
    lines.append("slowest: the slowest rank alone (ms; rank_alone_ms in the JSON), x single: over the single device")
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


def kcp_scaling(reports: list[dict]) -> list[dict]:
    """Per (shape, op), each degree's rank time and its ratio to the single device of the
    same global batch (timed in that degree's run): emulated, the slowest rank's alone
    (``slowest_alone_ms``, fwdbwd only: compute without communication); on devices, the
    slowest rank's ``stream_ms``."""
    rows: dict[tuple[str, str], dict] = {}
    for report in reports:
        cp = report["meta"]["cp"]
        for r in report["results"]:
            if report["meta"]["emulate"]:
                op, single, ms = "fwdbwd", r["single_ms"], r["slowest_alone_ms"]
                if ms is None:  # the ranks alone failed (the row says why)
                    continue
            else:
                op, single, ms = r["op"], r["single"]["stream_ms"], r["slowest"]["stream_ms"]
            row = rows.setdefault((r["shape"], op), {"shape": r["shape"], "op": op, "by_cp": {}})
            row["by_cp"][cp] = {"single_ms": single, "ms": ms, "over_single": ms / single if single else math.nan}
    return list(rows.values())


def format_kcp_scaling(rows: list[dict], meta: dict) -> str:
    degrees = sorted({cp for row in rows for cp in row["by_cp"]})
    what = ("the slowest rank's kernel_ms alone (ranks emulated: compute, no communication)" if meta["emulate"]
            else "the slowest rank's stream_ms")
    lines = [f"KCP scaling, layout {meta['layout']}: per CP, {what} and (in brackets) its ratio to the single "
             f"device of the same global batch; 1/CP is linear",
             f"{'shape':16s} {'op':7s} " + " ".join(f"{'CP' + str(cp):>17s}" for cp in degrees)]
    for row in rows:
        cells = []
        for cp in degrees:
            c = row["by_cp"].get(cp)
            cells.append(f"{c['ms']:9.3f} ({c['over_single']:5.3f})" if c else f"{'-':>17s}")
        lines.append(f"{row['shape']:16s} {row['op']:7s} " + " ".join(cells))
    return "\n".join(lines)
