"""``python -m cake_ops.bench --cp N`` (without ``--emulate``): KCP with one process a device.

N ranks, each its own process on its own device: ``cuda:rank`` with NCCL, or the CPU
with gloo (``--device cpu``; the CI's test of this path). Under ``torchrun`` the ranks
are torchrun's (``RANK``, ``WORLD_SIZE`` and its rendezvous in the environment); otherwise
the command spawns them itself, with a FileStore rendezvous. Every rank makes the same
global inputs (same seed), its plan and its shard of them before timing.

First ``gdn_kcp`` on ``ACCURACY_SHAPE`` is checked against the FP64 reference (the outputs
and gradients gathered to rank 0). Then per shape and op (``fwd``, ``fwdbwd``, ``ckpt``:
the benchmark's ops, ``cake_ops.bench.arms``) every rank times its KCP step, the ranks
stepping together as training would: ``stream_ms`` (CUDA events over calls issued back
to back; the collectives keep the ranks in step, so it is the step's time on that rank),
``kernel_ms`` (profiler: device busy time, NCCL's kernels included, which wait for the
slowest rank) and ``compute_ms`` (the busy time of the other kernels: the rank's own work),
and its peak memory. Then rank 0 alone times the single-device ``cake_ops.gdn`` of the
whole global batch, the others waiting. The table gives each cell's slowest rank and
its ratio to the single device (issue 21's targets: at most 0.6 at CP 2, 0.2 at CP 8),
and the bytes each rank puts into each collective.

With ``fla`` among ``--arms`` (the default) and CUDA devices, every rank also times FLA's
own context parallel (``fla.ops.cp`` of fla-core 0.6.0, its Triton path) on the same
global batch, in the layout of FLA's that matches ``--layout`` (C: ``contiguous``, Z:
``zigzag``; FLA cuts equal token parts, so T must be a multiple of the parts; D has no FLA
counterpart), first checking its output against the single-device ``cake_ops.gdn``; the
table gives its slowest rank beside cake's. Where it cannot run, the row says why.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from .accuracy import GRAD_NAMES, reference_outputs
from .report import make_meta
from .shapes import ACCURACY_SHAPE, KCP_SHAPES, QUICK_SHAPES, SHAPES, make_inputs
from .timing import Timer, busy_us
from ..testing import NO_NVLINK_MULTICAST, run_spawned

NAMES = ("q", "k", "v", "g", "beta")
NCCL_KERNEL = "nccl"  # NCCL's kernels' names start with ncclDevKernel / ncclKernel


def _op_steps(call, leaves, do, ops) -> dict:
    """Per op of ``ops``, a callable running ``call(*leaves)`` as the benchmark's op does:
    fwd (no grad), fwdbwd, ckpt (non-reentrant checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    def fwd():
        with torch.no_grad():
            call(*leaves)

    def fwdbwd():
        torch.autograd.grad(call(*leaves), leaves, do)

    def ckpt():
        torch.autograd.grad(checkpoint(call, *leaves, use_reentrant=False), leaves, do)

    return {op: {"fwd": fwd, "fwdbwd": fwdbwd, "ckpt": ckpt}[op] for op in ops}


def _steps(inp, ctx, ops) -> dict:
    """Per op, a callable running this rank's KCP step of ``inp`` (the global inputs)."""
    from cake_ops.kcp import gdn_kcp

    leaves = [ctx.shard(getattr(inp, n)).detach().requires_grad_(True) for n in NAMES]
    return _op_steps(lambda *xs: gdn_kcp(*xs, ctx, use_qk_l2norm=True)[0], leaves, ctx.shard(inp.do), ops)


def _single_steps(inp, ops) -> dict:
    """Per op, a callable running the single-device ``cake_ops.gdn`` of the whole batch."""
    import cake_ops

    leaves = [getattr(inp, n).detach().requires_grad_(True) for n in NAMES]
    return _op_steps(lambda *xs: cake_ops.gdn(*xs, inp.cu_seqlens, use_qk_l2norm=True)[0], leaves, inp.do, ops)


# FLA 0.6.0's CP layouts that cut the global batch as ours do (equal token parts).
FLA_LAYOUTS = {"C": "contiguous", "Z": "zigzag"}


def fla_cp_rows(T: int, world: int, rank: int, layout: str) -> torch.Tensor | None:
    """The global token rows rank ``rank`` holds under FLA's own context parallel
    (``fla.ops.cp.build_cp_context``): ``contiguous``, W equal parts, part r; ``zigzag``,
    2W equal parts, parts r and 2W - 1 - r in that order. None where FLA has no such layout
    (D) or cannot cut T (not a multiple of the parts)."""
    if layout not in FLA_LAYOUTS:
        return None
    parts = world if layout == "C" else 2 * world
    if T % parts:
        return None
    n = T // parts
    pieces = (rank,) if layout == "C" else (rank, 2 * world - 1 - rank)
    return torch.cat([torch.arange(p * n, (p + 1) * n) for p in pieces])


def _fla_cp(inp, args, device, world: int, rank: int):
    """FLA's own CP on ``inp`` (the global inputs): ((call, leaves, do), None) for this
    rank's step, or (None, why it does not run), the same on every rank."""
    if "fla" not in args.arms:
        return None, "not among --arms"
    if device.type != "cuda":
        return None, "FLA's kernels need CUDA"
    T = inp.q.shape[0]
    rows = fla_cp_rows(T, world, rank, args.layout)
    if rows is None:
        why = (f"FLA has no layout {args.layout}" if args.layout not in FLA_LAYOUTS else
               f"FLA cuts equal parts: T = {T} is not a multiple of {world if args.layout == 'C' else 2 * world}")
        return None, why
    os.environ["FLA_FLASH_QLA"] = "0"  # FLA's own Triton path, as the fla arm (cake_ops.bench.arms)
    try:
        from fla.ops.cp import build_cp_context
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # missing, or failing at import (its Triton): skipped, as an arm whose package is missing
        return None, f"fla.ops.cp not importable ({type(e).__name__}: {e})"
    cp = build_cp_context(inp.cu_seqlens.long(), group=dist.group.WORLD, layout=FLA_LAYOUTS[args.layout])
    rows = rows.to(device)
    leaves = [getattr(inp, n).index_select(0, rows).unsqueeze(0).detach().requires_grad_(True) for n in NAMES]

    def call(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, cp_context=cp, use_qk_l2norm_in_kernel=True)[0]

    return (call, leaves, inp.do.index_select(0, rows).unsqueeze(0)), None


def _fla_output_check(fla, inp, world: int, layout: str, device) -> float | None:
    """rel-RMS of FLA's CP output (every rank's rows gathered in global order) against the
    single-device ``cake_ops.gdn`` of the whole batch (rank 0's value; None elsewhere)."""
    import cake_ops
    from cake_ops.testing import accuracy

    call, leaves, _ = fla
    with torch.no_grad():
        mine = call(*leaves)[0].contiguous()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if dist.get_rank() != 0:
        return None
    T = inp.q.shape[0]
    o = torch.empty(T, *mine.shape[1:], dtype=mine.dtype, device=device)
    for r, x in enumerate(every):
        o[fla_cp_rows(T, world, r, layout).to(device)] = x
    with torch.no_grad():
        want, _ = cake_ops.gdn(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_seqlens, use_qk_l2norm=True)
    return accuracy(o, want).rel_rms


def _time(step, timer: Timer, args) -> dict:
    """stream_ms, kernel_ms and compute_ms (medians over ``args.calls``) and peak bytes of
    ``step`` on this rank; every rank calls it at the same point (the step's collectives)."""
    for _ in range(args.warmup):
        step()
    timer.sync()
    peak = timer.peak_memory(step)
    stream = statistics.median(timer.stream_ms(step, args.calls))
    kernel, compute = [], []
    for _ in range(args.calls):
        kernel.append(timer.kernel_ms(step, 1)[0])
        own = [(a, b) for name, a, b in timer.last_spans if NCCL_KERNEL not in name.lower()]
        compute.append(busy_us(own) / 1e3 if timer.cuda and timer.last_spans else kernel[-1])
    return {"stream_ms": stream, "kernel_ms": statistics.median(kernel), "compute_ms": statistics.median(compute),
            "peak_mem_bytes": peak}


TIMINGS = ("stream_ms", "kernel_ms", "compute_ms", "peak_mem_bytes")


def _slowest(every: list[dict]) -> dict:
    return {t: max(r[t] for r in every) for t in ("stream_ms", "kernel_ms", "compute_ms")}


def _gather_timings(mine: dict, world: int, device) -> list[dict]:
    """Every rank's ``_time`` dict, on every rank (an all-gather of a float64 tensor: the
    object collectives need NumPy, which a CPU install may lack)."""
    x = torch.tensor([math.nan if mine[t] is None else float(mine[t]) for t in TIMINGS], dtype=torch.float64,
                     device=device)
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x)
    return [{t: (None if math.isnan(v) else (int(v) if t == "peak_mem_bytes" else v))
             for t, v in zip(TIMINGS, y.tolist())} for y in out]


def _check_accuracy(args, device, ctx_of) -> dict | None:
    """gdn_kcp on ACCURACY_SHAPE against the FP64 reference (rank 0's dict; None elsewhere)."""
    from cake_ops.kcp import gdn_kcp
    from cake_ops.testing import REL_RMS_TOL, accuracy

    inp = make_inputs(ACCURACY_SHAPE, device, args.gate, args.seed + 1)
    ctx = ctx_of(inp)
    leaves = [ctx.shard(getattr(inp, n)).detach().requires_grad_(True) for n in NAMES]
    o, _ = gdn_kcp(*leaves, ctx, use_qk_l2norm=True)
    grads = torch.autograd.grad(o, leaves, ctx.shard(inp.do))
    got = [ctx.gather(o.detach())] + [ctx.gather(g) for g in grads]  # collectives: every rank
    if dist.get_rank() != 0:
        return None
    ref_o, ref_grads = reference_outputs(inp)
    rel = {n: accuracy(x, ref).rel_rms for n, x, ref in zip(("o", *GRAD_NAMES), got, (ref_o, *ref_grads))}
    return {"ok": all(math.isfinite(v) and v <= REL_RMS_TOL for v in rel.values()), "rel_rms": rel}


def _rank_main(args, out_path: str | None) -> dict | None:
    """One rank's whole run, its process group already up; rank 0 returns the report."""
    from cake_ops.kcp import build_context_kcp, kcp_comm_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if args.device.startswith("cuda") else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report: dict[str, Any] = {"meta": make_meta(args, device), "accuracy": None, "results": []}
    report["meta"].update(cp=world, layout=args.layout, align=args.align, emulate=False, backend=dist.get_backend())

    def ctx_of(inp):
        return build_context_kcp(inp.cu_seqlens.tolist(), layout=args.layout, device=device, align=args.align)

    acc = _check_accuracy(args, device, ctx_of)
    ok = torch.tensor([float(acc["ok"]) if acc is not None else 0.0], device=device)
    dist.broadcast(ok, src=0)
    report["accuracy"] = acc
    if rank == 0:
        worst = max(acc["rel_rms"].values())
        print(f"accuracy gdn_kcp CP{world} layout {args.layout} worst rel-RMS {worst:.2e}: "
              f"{'ok' if acc['ok'] else 'FAIL, not timed'}", flush=True)
    if ok.item():
        timer = Timer(device)
        for name in args.shapes:
            shape = {**SHAPES, **QUICK_SHAPES, **KCP_SHAPES}[name]
            inp = make_inputs(shape, device, args.gate, args.seed)  # the same on every rank
            ctx = ctx_of(inp)
            comm = kcp_comm_bytes(ctx, inp.v.shape[1], inp.q.shape[-1], inp.v.shape[-1])
            fla, fla_skipped = _fla_cp(inp, args, device, world, rank)
            fla_rel_rms = _fla_output_check(fla, inp, world, args.layout, device) if fla is not None else None
            fla_steps = _op_steps(*fla, args.ops) if fla is not None else {}
            for op, step in _steps(inp, ctx, args.ops).items():
                every = _gather_timings(_time(step, timer, args), world, device)
                fla_every = _gather_timings(_time(fla_steps[op], timer, args), world, device) if fla else None
                single = _time(_single_steps(inp, [op])[op], timer, args) if rank == 0 else None
                dist.barrier()
                if rank == 0:
                    slowest = _slowest(every)
                    row = {"shape": name, "op": op, "single": single, "ranks": every, "slowest": slowest,
                           "slowest_over_single": {t: slowest[t] / single[t] if single[t] else math.nan
                                                   for t in ("stream_ms", "kernel_ms")},
                           "comm_bytes_per_rank": comm, "fla": None, "fla_skipped": fla_skipped}
                    if fla_every is not None:
                        fla_slowest = _slowest(fla_every)
                        row["fla"] = {"ranks": fla_every, "slowest": fla_slowest, "o_rel_rms_vs_cake": fla_rel_rms,
                                      "cake_over_fla": {t: slowest[t] / fla_slowest[t] if fla_slowest[t] else math.nan
                                                        for t in ("stream_ms", "kernel_ms")}}
                    report["results"].append(row)
                    print(f"timed {name} {op}", flush=True)
            del inp, ctx, fla, fla_steps
    if rank == 0 and out_path is not None:
        with open(out_path, "w") as f:
            json.dump(report, f)
    return report if rank == 0 else None


def _spawned(rank: int, world: int, args, store_path: str, out_path: str) -> None:
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            device_id=device)
    try:
        _rank_main(args, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_kcp_devices(args, timeout: float = 3600.0) -> dict | None:
    """The whole run; the report on the process holding rank 0 (None on torchrun's others)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        os.environ.update(NO_NVLINK_MULTICAST)  # before NCCL starts (the spawned ranks get it from run_spawned)
        world = int(os.environ["WORLD_SIZE"])
        if world != args.cp:
            raise SystemExit(f"--cp {args.cp} under torchrun with WORLD_SIZE={world}: they must agree")
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend)
        try:
            return _rank_main(args, None)
        finally:
            dist.destroy_process_group()
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.cp:
        raise SystemExit(f"--cp {args.cp} needs {args.cp} CUDA devices, this machine has "
                         f"{torch.cuda.device_count()}; --emulate runs the ranks as threads on one")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "report.json")
        run_spawned(_spawned, args.cp, (args.cp, args, os.path.join(tmp, "store"), out_path), timeout)
        with open(out_path) as f:
            return json.load(f)


def format_kcp_devices_table(report: dict) -> str:
    meta = report["meta"]
    lines = [f"KCP CP{meta['cp']} layout {meta['layout']}, one process a device ({meta['backend']}; "
             f"{meta['timing']} timing): slowest rank against the single device of the whole batch",
             f"{'shape':16s} {'op':7s} {'single_ms':>10s} {'slowest_ms':>11s} {'x single':>9s} "
             f"{'kernel':>8s} {'compute':>8s} {'peak_MiB':>9s} {'fla_ms':>8s} {'x fla':>8s} {'fla_MiB':>9s}"
             f"  bytes per rank per collective"]
    fla_notes = []
    for r in report["results"]:
        comm = ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in r["comm_bytes_per_rank"].items()) or "none"
        peak = _peak_mib(r["ranks"])
        fla = r.get("fla")
        fla_cells = (f"{fla['slowest']['stream_ms']:8.3f} {fla['cake_over_fla']['stream_ms']:8.2f} {_peak_mib(fla['ranks'])}"
                     if fla else f"{'-':>8s} {'-':>8s} {'-':>9s}")
        lines.append(f"{r['shape']:16s} {r['op']:7s} {r['single']['stream_ms']:10.3f} {r['slowest']['stream_ms']:11.3f} "
                     f"{r['slowest_over_single']['stream_ms']:9.2f} {r['slowest']['kernel_ms']:8.3f} "
                     f"{r['slowest']['compute_ms']:8.3f} {peak} {fla_cells}  {comm}")
        if fla:
            note = f"{r['shape']}: FLA's CP output against the single-device cake op, rel-RMS {fla['o_rel_rms_vs_cake']:.2e}"
        else:
            note = f"{r['shape']}: FLA's CP not timed: {r.get('fla_skipped')}"
        if note not in fla_notes:
            fla_notes.append(note)
    lines.append("single_ms, slowest_ms: stream_ms (CUDA events, calls back to back); kernel: the slowest rank's "
                 "kernel_ms (NCCL's kernels included), compute: without them; peak_MiB: the largest rank's; "
                 "fla_ms: FLA's own CP (fla.ops.cp), its slowest rank's stream_ms, x fla = slowest_ms / fla_ms")
    return "\n".join(lines + fla_notes)


def _peak_mib(ranks: list[dict]) -> str:
    peaks = [x["peak_mem_bytes"] for x in ranks if x["peak_mem_bytes"] is not None]
    return f"{max(peaks) / 2**20:9.1f}" if peaks else f"{'-':>9s}"
