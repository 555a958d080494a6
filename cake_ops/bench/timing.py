"""The benchmark's timing protocol (docs/benchmark.md, Timings and Protocol).

- Timings per cell: ``kernel_ms`` (profiler/CUPTI: the time the device runs at least
  one kernel, memcpy or memset of the call, per call: kernels on two streams that
  overlap count once), ``stream_ms`` (median CUDA-event time of calls issued
  back to back, no host sync between them), ``sync_ms`` (median CUDA-event time with
  a 256 MiB L2 flush and a synchronize before every call). Without CUDA the three
  timings are host wall-clock per call (no profiler, no flush).
- Peak memory per cell: ``peak_mem_bytes``, the allocator's peak during one call
  (after the warm-up) above what it held before the call (the inputs); null without CUDA.
- Protocol: warm-up, ``--groups`` (>= 3) groups, in each the arms in palindromic
  order (A B ... B A), ``--calls`` calls per arm appearance and timing; a value is
  the median over calls (``kernel_ms``: over the per-appearance means, since the
  profiler gives a total); drift = |last group median - first| / median of the group
  medians, > 2 % marks the value unstable (``*``). All cells get their CUDA-event
  timings first and their profiler timings in a second pass: once a profiler session
  has run, CUPTI stays attached and slows launches for the rest of the process.
- Per kernel: each ``kernel_ms`` sample is also split by kernel (ms per call; repeated
  names told apart by their rank in the call, ``main_kernel#2``); the JSON row's
  ``kernels`` holds the medians, ``--kernels`` prints them: which stage costs what.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from .arms import SLOW_ARM_CALLS, Arm, arm_args, error_text, make_step
from .shapes import Inputs, Shape, gdn_flop, make_inputs

UNSTABLE_DRIFT = 0.02
L2_FLUSH_BYTES = 256 << 20
TIMINGS = ("kernel_ms", "stream_ms", "sync_ms")
# The two passes over all cells: CUDA events first, the profiler last. Peak memory is
# taken in the first.
PASSES = (("stream_ms", "sync_ms"), ("kernel_ms",))


# ------------------------------------------------------------------ the statistics


def palindrome(items: Sequence[Any]) -> list[Any]:
    """A B C -> A B C C B A: each item's mean position is the same, so slow drifts cancel."""
    items = list(items)
    return items + items[::-1]


def drift(group_medians: Sequence[float]) -> float:
    """|last - first| / median of the group medians (nan when undefined)."""
    vals = [float(x) for x in group_medians]
    if len(vals) < 2 or not all(math.isfinite(x) for x in vals):
        return math.nan
    mid = statistics.median(vals)
    if mid <= 0:
        return math.nan
    return abs(vals[-1] - vals[0]) / mid


def is_unstable(d: float) -> bool:
    return math.isfinite(d) and d > UNSTABLE_DRIFT


def summarize(samples: list[list[float]]) -> tuple[float, float, list[float]]:
    """(median over all samples, drift of the group medians, group medians)."""
    flat = [x for grp in samples for x in grp]
    medians = [statistics.median(grp) if grp else math.nan for grp in samples]
    value = statistics.median(flat) if flat and all(math.isfinite(x) for x in flat) else math.nan
    return value, drift(medians), medians


# ----------------------------------------------------------------- per-kernel split


def short_kernel_name(name: str) -> str:
    """A profiler kernel name without return type, namespaces' noise and parameter list."""
    name = name.strip().replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first "(" outside template brackets
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    name = name[:cut]
    return name if len(name) <= 90 else name[:87] + "..."


def kernel_split(launches: Sequence[tuple[str, float]], n: int) -> dict[str, float]:
    """ms per call of each kernel of n identical calls, from (name, us) in launch order.

    Kernels of one name launched k times a call (TileLang names most of its kernels
    ``main_kernel``) are told apart by their rank within the call, ``name#j``: the
    launch's occurrence index modulo k. A name whose count is not a multiple of n keeps
    one entry.
    """
    counts: dict[str, int] = {}
    for name, _ in launches:
        counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    out: dict[str, float] = {}
    for name, us in launches:
        per_call = counts[name] // n if counts[name] % n == 0 else 1
        j = seen.get(name, 0)
        seen[name] = j + 1
        label = short_kernel_name(name) + (f"#{j % per_call}" if per_call > 1 else "")
        out[label] = out.get(label, 0.0) + us / 1e3 / n
    return out


def busy_us(spans: Sequence[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) intervals (us, sorted by start): the
    time the device runs at least one of them. Kernels of one stream never overlap, so
    there it is their sum; kernels an arm runs on two streams at once count once."""
    total, end = 0.0, -math.inf
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def median_split(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per kernel, the median over samples of its ms per call (0 where a sample lacks it);
    the largest first."""
    names = {k for sample in samples for k in sample}
    med = {k: statistics.median(sample.get(k, 0.0) for sample in samples) for k in names}
    return dict(sorted(med.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------- timer


class Timer:
    """The three timings and peak memory; CUDA events and the profiler on a GPU,
    wall-clock otherwise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush_buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if self.cuda else None
        self.sessions = 0  # profiler sessions so far in this process
        self.last_kernels: dict[str, float] = {}  # kernel_ms's last sample, per kernel: ms per call
        self.last_spans: list[tuple[str, float, float]] = []  # and its launches: (name, start us, end us)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _wall(self, step, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def kernel_ms(self, step, n: int) -> list[float]:
        """One sample: device time of all kernels, memcpys and memsets of n calls, over n.

        One profiler session per sample. Kineto can drop the first kernel records of a
        session as out of range, one more with every session of the process (pytorch
        issue #192021), so each session starts with pad kernels (``torch.cuda._sleep``,
        "spin_kernel") that are left out of the sum; a session in which no pad survived
        may have lost real kernels and gives nan.
        """
        if not self.cuda:
            return self._wall(step, n)
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        self.sessions += 1
        pads = 64 + 2 * self.sessions
        self.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(pads):
                torch.cuda._sleep(100)
            self.sync()
            for _ in range(n):
                step()
            self.sync()
        pads_seen, launches, spans = 0, [], []
        self.last_kernels, self.last_spans = {}, []
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            if "spin_kernel" in e.name:
                pads_seen += 1
                continue
            dur = e.time_range.elapsed_us()
            if not 0 <= dur < 600e6:  # a corrupted timestamp
                return [math.nan]
            launches.append((e.name, dur))
            spans.append((e.time_range.start, e.time_range.end))
            self.last_spans.append((e.name, e.time_range.start, e.time_range.end))
        if pads_seen == 0 or not launches:
            print(f"  warning: profiler session kept {pads_seen}/{pads} pads and {len(launches)} kernels; sample dropped", flush=True)
            return [math.nan]
        self.last_kernels = kernel_split(launches, n)
        return [busy_us(spans) / 1e3 / n]

    def stream_ms(self, step, n: int) -> list[float]:
        """Per call: CUDA-event time of calls issued back to back, one sync at the end."""
        if not self.cuda:
            return self._wall(step, n)
        self.sync()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            step()
            events[i + 1].record()
        self.sync()
        return [events[i].elapsed_time(events[i + 1]) for i in range(n)]

    def sync_ms(self, step, n: int) -> list[float]:
        """Per call: 256 MiB write (L2 flush), synchronize, then CUDA-event time of one call."""
        if not self.cuda:
            return self._wall(step, n)
        pairs = []
        for _ in range(n):
            self.flush_buf.zero_()
            self.sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            pairs.append((start, end))
        self.sync()
        return [s.elapsed_time(e) for s, e in pairs]

    def peak_memory(self, step) -> int | None:
        """Bytes: the allocator's peak during one call above what it held before the
        call (the inputs, the leaves, the flush buffer); None without CUDA."""
        if not self.cuda:
            return None
        self.sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        self.sync()
        return torch.cuda.max_memory_allocated(self.device) - before


# ------------------------------------------------------------------------ the cells


def time_cell(
    shape: Shape, op: str, arms: list[Arm], inp: Inputs, timer: Timer, timings: Sequence[str], args
) -> dict[str, dict]:
    """All arms on one (shape, op): warm-up, then groups in palindromic order.

    Returns per arm {"error": str | None, "samples": {timing: [samples of group 0, ...]},
    "kernels": [per-kernel split of each kernel_ms sample]}, and in the first pass
    (``PASSES[0]``) "peak_mem_bytes" (one call after the warm-up).
    """
    cells: dict[str, dict] = {}
    steps = {}
    with_memory = tuple(timings) == PASSES[0]
    for arm in arms:
        cells[arm.name] = {
            "error": None, "samples": {t: [[] for _ in range(args.groups)] for t in timings}, "kernels": [],
        }
        try:
            leaves, cu, do = arm_args(arm, inp)
            steps[arm.name] = make_step(arm, op, leaves, cu, do, fresh_cu=args.cu_seqlens == "fresh")
            for _ in range(args.warmup):
                steps[arm.name]()
            timer.sync()
            if with_memory:
                cells[arm.name]["peak_mem_bytes"] = timer.peak_memory(steps[arm.name])
        except Exception as e:
            cells[arm.name]["error"] = error_text(e)
            steps.pop(arm.name, None)
            print(f"  {shape.name} {op} {arm.name}: warm-up failed: {error_text(e)}", flush=True)
    live = [arm for arm in arms if arm.name in steps]
    for grp in range(args.groups):
        for arm in palindrome(live):
            cell = cells[arm.name]
            if cell["error"]:
                continue
            n = min(args.calls, SLOW_ARM_CALLS) if arm.slow else args.calls
            try:
                for t in timings:
                    cell["samples"][t][grp] += getattr(timer, t)(steps[arm.name], n)
                    if t == "kernel_ms" and timer.last_kernels:
                        cell["kernels"].append(timer.last_kernels)
            except Exception as e:
                cell["error"] = error_text(e)
                print(f"  {shape.name} {op} {arm.name}: failed while timing: {error_text(e)}", flush=True)
    steps.clear()
    return cells


def time_cells(args, shapes, arms, passed, rate, timer, rows, timed, meta) -> None:
    """Every (shape, op) cell: rows[(shape, op, arm)] gets its samples, timed the
    (shape, op, timing) of each finished cell; meta["timing_now"] names the cell in hand.

    Two phases over all cells (``PASSES``): CUDA-event timings first, then the profiler.
    A profiler session leaves CUPTI attached (no teardown by default), which slows
    launches for the rest of the process; stream_ms and sync_ms must not see that.
    """
    meta["timing_now"] = "(no cell yet)"
    for timings in PASSES:
        for shape in shapes:
            inp = make_inputs(shape, timer.device, args.gate, args.seed)
            for op in args.ops:
                flop = gdn_flop(shape, op)
                runnable = []
                for arm in arms:
                    key = (shape.name, op, arm.name)
                    if key not in rows:
                        rows[key] = {
                            "shape": shape.name, "op": op, "arm": arm.name, "flop": flop,
                            "floor_ms": flop / (rate * 1e12) * 1e3, "peak_mem_bytes": None, "error": None,
                            "samples": {t: [[] for _ in range(args.groups)] for t in TIMINGS},
                        }
                        rows[key]["error"] = arm.supports(shape) or (
                            None if passed[(arm.name, op)] else "failed the accuracy check"
                        )
                    if not rows[key]["error"]:
                        runnable.append(arm)
                meta["timing_now"] = f"{shape.name} {op} [{', '.join(timings)}]"
                print(f"timing {meta['timing_now']}: {', '.join(a.name for a in runnable) or 'no arm'}", flush=True)
                for name, cell in time_cell(shape, op, runnable, inp, timer, timings, args).items():
                    row = rows[(shape.name, op, name)]
                    row["error"] = cell["error"]
                    row["samples"].update(cell["samples"])
                    if "peak_mem_bytes" in cell:
                        row["peak_mem_bytes"] = cell["peak_mem_bytes"]
                    if cell["kernels"]:
                        row["kernels"] = median_split(cell["kernels"])
                timed.update((shape.name, op, t) for t in timings)
                if timer.device.type == "cuda":
                    torch.cuda.empty_cache()
            del inp
