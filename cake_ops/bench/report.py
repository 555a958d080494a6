"""The benchmark's report: the meta, the rows' summaries, the tables and the strict JSON.

The report is a dict of ``meta`` (machine, versions, settings; ``interrupted`` when a
run was cut short), ``skipped_arms``, ``accuracy`` (one entry per arm and op) and
``results`` (one row per shape, op and arm). ``--json`` writes it with
``allow_nan=False``: non-finite numbers become null.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from typing import Any

import torch

from .shapes import FWDBWD_OVER_FWD
from .timing import TIMINGS, UNSTABLE_DRIFT, is_unstable, summarize

MIB = 1 << 20


def sanitize(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, tuples lists, keys strings."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return sanitize(obj.item())
    return str(obj)


def write_json(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(sanitize(report), f, allow_nan=False, indent=1)


def dist_version(name: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def make_meta(args, device: torch.device) -> dict[str, Any]:
    """The run's machine, versions and settings (``matmul_tflops`` is added once measured)."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(args.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None,
        "timing": "cuda" if device.type == "cuda" else "wall-clock",
        "groups": args.groups,
        "calls": args.calls,
        "warmup": args.warmup,
        "gate": args.gate,
        "seed": args.seed,
        "cu_seqlens_dtype": "int32",
        "cu_seqlens": args.cu_seqlens,
        "unstable_drift": UNSTABLE_DRIFT,
        "fwdbwd_over_fwd_flop": FWDBWD_OVER_FWD,
        "versions": {d: dist_version(d) for d in ("cake-ops", "fla-core", "flash-qla", "tilelang", "triton")},
    }


def summarize_rows(rows: dict[tuple[str, str, str], dict], timed: set[tuple[str, str, str]]) -> list[dict]:
    """The result rows: each timing's value (median), drift, group medians and the
    unstable marks from the row's samples (dropped), the timings not finished
    (``untimed``), and cake's kernel_ms and stream_ms over the arm's."""
    for row in rows.values():
        samples = row.pop("samples")
        row["untimed"] = [t for t in TIMINGS if (row["shape"], row["op"], t) not in timed]
        row["drift"], row["group_medians"], row["unstable_timings"] = {}, {}, []
        for t in TIMINGS:
            done = not row["error"] and t not in row["untimed"]
            value, d, medians = summarize(samples[t]) if done else (None, None, None)
            row[t], row["drift"][t], row["group_medians"][t] = value, d, medians
            if d is not None and is_unstable(d):
                row["unstable_timings"].append(t)
        row["unstable"] = bool(row["unstable_timings"])
    results = []
    for (shape_name, op, _), row in rows.items():
        cake = rows.get((shape_name, op, "cake"), {})
        for t, key in (("kernel_ms", "cake_over_arm_kernel"), ("stream_ms", "cake_over_arm_stream")):
            c, x = cake.get(t), row.get(t)
            ok = c is not None and x is not None and math.isfinite(c) and math.isfinite(x) and x > 0
            row[key] = c / x if ok else None
        results.append(row)
    return results


def format_number(x: float | None, width: int = 9, prec: int = 3) -> str:
    """x right-aligned with prec decimals; "-" for None and non-finite values."""
    if x is None or not math.isfinite(x):
        return "-".rjust(width)
    return f"{x:.{prec}f}".rjust(width)


def format_table(report: dict) -> str:
    """One line per result row (``*``: unstable; an error follows the columns), then notes."""
    head = ["shape", "op", "arm", "kernel_ms", "stream_ms", "sync_ms", "floor_ms", "cake/arm", "cake/arm_s", "peak_MiB"]
    lines = []
    for row in report["results"]:
        unstable = set(row.get("unstable_timings") or [])
        cells = [row["shape"], row["op"], row["arm"]]
        for t in TIMINGS:
            cells.append(format_number(row[t]).strip() + ("*" if t in unstable else ""))
        cells.append(format_number(row["floor_ms"]).strip())
        cake = next((r for r in report["results"] if (r["shape"], r["op"], r["arm"]) == (row["shape"], row["op"], "cake")), {})
        for t, key in (("kernel_ms", "cake_over_arm_kernel"), ("stream_ms", "cake_over_arm_stream")):
            ratio = row.get(key)
            if row["arm"] == "cake" or ratio is None:
                cells.append("-")
                continue
            shaky = t in unstable or t in set(cake.get("unstable_timings") or [])
            cells.append(f"{ratio:.2f}" + ("*" if shaky else ""))
        peak = row.get("peak_mem_bytes")
        cells.append(format_number(None if peak is None else peak / MIB, prec=1).strip())
        if row.get("error"):
            cells.append(f"({row['error']})")
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *[c[: len(head)] for c in lines])] if lines else [len(h) for h in head]
    out = ["  ".join(h.rjust(w) if i >= 3 else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    for cells in lines:
        body = [str(c).rjust(w) if i >= 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        out.append("  ".join(body + cells[len(head):]))
    notes = [
        f"* drift (|last group median - first| / median of group medians) > {UNSTABLE_DRIFT:.0%}; "
        "cake/arm = cake kernel_ms / arm kernel_ms, cake/arm_s the same of stream_ms (> 1: the arm is faster)",
        f"floor_ms = FLOP / measured bf16 matmul rate ({report['meta']['matmul_tflops']:.3g} TFLOP/s); "
        f"fwdbwd = {FWDBWD_OVER_FWD} x fwd FLOP, ckpt = fwd + fwdbwd",
        "peak_MiB = allocator peak during one call above the memory allocated before it (CUDA only)",
    ]
    if report["meta"].get("interrupted"):
        notes.append(f"INTERRUPTED ({report['meta']['interrupted']}): a - in a row that has no error was not timed")
    if report["meta"]["timing"] != "cuda":
        notes.append(
            "NO CUDA: kernel_ms, stream_ms and sync_ms are all host wall-clock per call "
            "(no profiler, no L2 flush); only a smoke test"
        )
    return "\n".join(out + notes)


def format_kernels(report: dict, min_share: float = 0.01) -> str:
    """Each timed row's kernels (median ms per call, largest first; those under min_share
    of the row's kernel_ms are summed as "other"): which stage costs what, every arm."""
    out = ["kernels per call (ms; median over the kernel_ms samples):"]
    for row in report["results"]:
        split, total = row.get("kernels"), row.get("kernel_ms")
        if not split or not total:
            continue
        out.append(f"{row['shape']} {row['op']} {row['arm']}  (kernel_ms {total:.3f})")
        other = 0.0
        for name, ms in split.items():
            if ms >= min_share * total:
                out.append(f"  {ms:8.3f}  {name}")
            else:
                other += ms
        if other:
            out.append(f"  {other:8.3f}  other")
    return "\n".join(out)
