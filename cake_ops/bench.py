"""Benchmark of GDN training ops against the public peers: ``python -m cake_ops.bench``.

Implements the protocol of BENCH.md in one process on one device:

- Arms: ``cake`` (deterministic), ``cake-nd`` (``deterministic=False``), ``fla``
  (fla-core, Triton path: ``FLA_FLASH_QLA=0``), ``flashqla`` (flash-qla, K = V = 128),
  ``torch`` (this project's PyTorch chunked path, under ``cake_ops.gdn.pytorch_implementation()``) and
  ``cake-aa`` (a second copy of ``cake``: the A/A noise floor). An arm whose package
  is missing is skipped with a message.
- Ops: ``fwd`` (grad-enabled forward), ``fwdbwd`` (forward, then backward with a
  random output gradient made once outside timing), ``ckpt`` (non-reentrant
  ``torch.utils.checkpoint`` around the forward, then backward: forward, recompute,
  backward).
- Timings per cell: ``kernel_ms`` (profiler/CUPTI: device time of every kernel,
  memcpy and memset per call), ``stream_ms`` (median CUDA-event time of calls issued
  back to back, no host sync between them), ``sync_ms`` (median CUDA-event time with
  a 256 MiB L2 flush and a synchronize before every call) and ``floor_ms`` (FLOPs of
  the op over the bf16 matmul rate measured at start). Without CUDA the three
  timings are host wall-clock per call (no profiler, no flush) and the table says so.
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
- Interrupted (SIGTERM, e.g. from ``timeout``, or Ctrl-C) while timing: the cells
  timed so far are still summarised, printed and written; a timing not finished for a
  cell is null and listed in the row's ``untimed``, and the meta says where it
  stopped. A cold machine spends minutes in the peers' compiles and autotuning, so a
  run cut short by a time limit still reports what it measured.
- Accuracy: every arm, for every requested op, against the FP64 token-by-token
  reference on a small packed shape (documents of 100 + 64 + 37 tokens, (H, HV) =
  (2, 6), K = V = 128) with the benchmark's own input distribution: o and, with a
  backward, dq/dk/dv/dg/dbeta must be finite with rel-RMS <= 1e-2. A failing
  (arm, op) is reported and not timed.

Inputs: q, k, v ~ randn (bf16), l2-normalised inside every arm (``use_qk_l2norm``
/ ``use_qk_l2norm_in_kernel``); beta = sigmoid(randn) (fp32); g (fp32) from
``--gate``: ``mamba`` (default, what a GDN layer produces at init: per value head
A ~ U(0, 16) and dt_bias = softplus^-1(dt0), dt0 log-uniform in [1e-3, 1e-1]; per
token g = -A * softplus(x + dt_bias) with x ~ N(0, 1), so fast and slow heads mix:
median g about -0.06, 0.1 % below -7, the extremes near -35) or ``logsigmoid`` (logsigmoid(U(0, 1)), in (-0.69, -0.31):
the FLA/FlashQLA docstring gate, uniformly strong decay). FlashQLA's intra-card
split truncates its warm-up by the decay it sees, so the gate changes its times.

Every arm gets the inputs in its own layout (cake: packed ``[T, ...]``; FLA and
FlashQLA: ``[1, T, ...]`` views of the same storage), made before timing, and its
output is never indexed or copied inside a timed region (KERNELS.md §1.9). By default
the same ``cu_seqlens`` tensor (int32) is passed on every call, so the peers' host-side
caches keyed on it hit, as they do in every layer of a training step but the first;
``--cu-seqlens fresh`` cycles through distinct copies (made before timing, more than
the peers' caches hold), so every call is a step's first layer: the peers read
``cu_seqlens`` on the host, a sync, and rebuild what they cache.

Usage (BENCH.md): ``python -m cake_ops.bench --shapes s32k_h16 --json out/s32k_h16.json``;
``--quick`` is a smoke test (tiny shapes, two calls) that also runs on a CPU. TileLang
compiles each kernel shape on first use (20-40 s each): keep the shape list of one
invocation short. The peers come as wheels: ``pip install --no-index --no-deps
--target /tmp/peers`` and ``PYTHONPATH=/tmp/peers``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK = 64
UNSTABLE_DRIFT = 0.02
L2_FLUSH_BYTES = 256 << 20
FRESH_CU_SEQLENS = 8  # copies cycled with --cu-seqlens fresh: FLA's and FlashQLA's tensor caches hold 4
SLOW_ARM_CALLS = 2  # calls per appearance for arms marked slow (the torch arm)
# Whole fwd+bwd step (forward, backward, backward's state recompute) over the forward
# alone, KERNELS.md §3.1 ("≈ 43-45 MFLOP per head-chunk, ≈ 3.9x the forward").
FWDBWD_OVER_FWD = 3.9

OPS = ("fwd", "fwdbwd", "ckpt")
ARMS = ("cake", "cake-nd", "fla", "flashqla", "torch", "cake-aa")
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


class BenchInterrupted(BaseException):
    """SIGTERM during a run (a BaseException, so an arm's ``except Exception`` does not
    take it for that arm's failure)."""


def _raise_interrupted(signum, frame):
    raise BenchInterrupted(signal.Signals(signum).name)


# ----------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    docs: tuple[int, ...]  # document lengths in tokens, packed in this order
    H: int
    HV: int
    K: int = 128
    V: int = 128

    @property
    def T(self) -> int:
        return sum(self.docs)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.docs:
            out.append(out[-1] + n)
        return out


SHAPES = {
    s.name: s
    for s in (
        Shape("s32k_h16", (11000, 12000, 9768), 16, 48),
        Shape("s64k_h16", (4096,) * 16, 16, 32),
        Shape("s16k_long", (16384,), 8, 16),
        Shape("s256k_h2", (4096,) * 64, 2, 6),
        Shape("s16k_h8", (4096,) * 4, 8, 16),
        Shape("s32k_h2", (11000, 12000, 9768), 2, 6),
    )
}
QUICK_SHAPES = {
    s.name: s
    for s in (
        Shape("q_packed", (150, 90, 20), 2, 6),
        Shape("q_single", (128,), 1, 2),
    )
}
ACCURACY_SHAPE = Shape("accuracy", (100, 64, 37), 2, 6)


# ------------------------------------------------------------------- pure arithmetic


def chunks_per_head(docs: Sequence[int], chunk: int = CHUNK) -> int:
    """Chunks one head walks over: each document is cut into ceil(len / chunk)."""
    return sum(-(-n // chunk) for n in docs)


def fwd_flop_per_head_chunk(K: int, V: int, G: int, chunk: int = CHUNK) -> float:
    """Forward FLOP per (chunk, value head), KERNELS.md §3.1, written in K, V, G = HV/H.

    KK^T and QK^T (2C²K each) are shared by the G value heads of a q/k head; the WY
    products w = A(βΓK) (2C²K) and u = A(βV) (2C²V); the walk v_new = u - wS and
    S += K̃ᵀv_new (2CKV each); the output Q̃S (2CKV) and P·v_new (2C²V); the 64x64
    inverse (2C³/3). K = V = 128: 11.7 MFLOP at G = 1, 10.3 at G = 3.
    """
    C = chunk
    return (
        2 * C * C * K * (1 + 2 / G)  # w, and KK^T + QK^T shared over the group
        + 4 * C * C * V  # u, P·v_new
        + 6 * C * K * V  # walk (two products) + Q̃S
        + 2 * C**3 / 3  # triangular inverse
    )


def gdn_flop(shape: Shape, op: str) -> float:
    """FLOP of one call of ``op`` on ``shape``: fwd; fwdbwd = 3.9 x fwd; ckpt = fwd + fwdbwd."""
    fwd = chunks_per_head(shape.docs) * shape.HV * fwd_flop_per_head_chunk(shape.K, shape.V, shape.HV // shape.H)
    factor = {"fwd": 1.0, "fwdbwd": FWDBWD_OVER_FWD, "ckpt": 1.0 + FWDBWD_OVER_FWD}[op]
    return fwd * factor


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


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _fmt(x: float | None, width: int = 9, prec: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "-".rjust(width)
    return f"{x:.{prec}f}".rjust(width)


# ---------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor  # [T, H, K] bf16
    k: torch.Tensor  # [T, H, K] bf16
    v: torch.Tensor  # [T, HV, V] bf16
    g: torch.Tensor  # [T, HV] fp32
    beta: torch.Tensor  # [T, HV] fp32
    cu_seqlens: torch.Tensor  # [N + 1] int32
    do: torch.Tensor  # [T, HV, V] bf16, the upstream gradient


def make_gate(T: int, HV: int, kind: str, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """g [T, HV] fp32 <= 0 of the ``--gate`` kind (see the module doc)."""
    if kind == "logsigmoid":
        return F.logsigmoid(torch.rand(T, HV, generator=gen, device=device))
    if kind == "mamba":
        A = torch.rand(HV, generator=gen, device=device) * 16.0
        u = torch.rand(HV, generator=gen, device=device)
        dt0 = torch.exp(math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3)))
        dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # softplus^-1(dt0)
        x = torch.randn(T, HV, generator=gen, device=device)
        return -A * F.softplus(x + dt_bias)
    raise ValueError(f"--gate must be 'mamba' or 'logsigmoid', got {kind!r}")


def make_inputs(shape: Shape, device: torch.device, gate: str, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    T, H, HV, K, V = shape.T, shape.H, shape.HV, shape.K, shape.V
    bf16 = torch.bfloat16

    def randn(*size, dtype=torch.float32):
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    return Inputs(
        q=randn(T, H, K, dtype=bf16),
        k=randn(T, H, K, dtype=bf16),
        v=randn(T, HV, V, dtype=bf16),
        g=make_gate(T, HV, gate, gen, device).float().contiguous(),
        beta=torch.sigmoid(randn(T, HV)),
        cu_seqlens=torch.tensor(shape.cu_seqlens, dtype=torch.int32, device=device),
        do=randn(T, HV, V, dtype=bf16),
    )


# ------------------------------------------------------------------------------ arms

ArmFn = Callable[..., torch.Tensor]  # (q, k, v, g, beta, cu_seqlens) -> o in the arm's layout


@dataclasses.dataclass
class Arm:
    name: str
    batched: bool  # takes and returns [1, T, ...] (FLA layout) instead of packed [T, ...]
    slow: bool = False
    fn: ArmFn | None = None
    skip: str | None = None  # why the arm cannot run at all

    def supports(self, shape: Shape) -> str | None:
        if self.name == "flashqla" and (shape.K, shape.V) != (128, 128):
            return "FlashQLA supports K = V = 128 only"
        return None


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _load_cake(deterministic: bool) -> ArmFn:
    import cake_ops

    gdn = cake_ops.gdn

    def fn(q, k, v, g, beta, cu):
        o, _ = gdn(q, k, v, g, beta, cu, use_qk_l2norm=True, deterministic=deterministic)
        return o

    return fn


def _load_torch() -> ArmFn:
    import cake_ops
    from cake_ops.gdn import pytorch_implementation

    # The backward has no CUDA kernel yet, so covering the forward call is enough.
    def fn(q, k, v, g, beta, cu):
        with pytorch_implementation():
            o, _ = cake_ops.gdn(q, k, v, g, beta, cu, use_qk_l2norm=True)
        return o

    return fn


def _load_fla() -> ArmFn:
    os.environ["FLA_FLASH_QLA"] = "0"  # FLA's own Triton path, not its FlashQLA backend
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def fn(q, k, v, g, beta, cu):
        o, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        )
        return o

    return fn


def _load_flashqla() -> ArmFn:
    from flash_qla import chunk_gated_delta_rule

    def fn(q, k, v, g, beta, cu):
        o, _ = chunk_gated_delta_rule(
            q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        )
        return o

    return fn


def load_arms(names: Sequence[str], device: torch.device) -> list[Arm]:
    """Import every requested arm; a missing package gives a skip reason, never an error."""
    specs = {
        "cake": (False, False, lambda: _load_cake(True)),
        "cake-nd": (False, False, lambda: _load_cake(False)),
        "cake-aa": (False, False, lambda: _load_cake(True)),
        "torch": (False, True, _load_torch),
        "fla": (True, False, _load_fla),
        "flashqla": (True, False, _load_flashqla),
    }
    arms = []
    for name in names:
        batched, slow, loader = specs[name]
        arm = Arm(name, batched=batched, slow=slow)
        if batched and device.type != "cuda":
            arm.skip = f"needs a CUDA device (running on {device.type})"
        else:
            try:
                arm.fn = loader()
            except Exception as e:  # ImportError, or a peer refusing this GPU at import
                arm.skip = f"not available: {_err(e)}"
        arms.append(arm)
    return arms


def arm_args(arm: Arm, inp: Inputs) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Leaves (q, k, v, g, beta) requiring grad, cu_seqlens and do, in the arm's layout.

    Views of the shared inputs (no copies), made once, outside every timed region.
    """
    views = [inp.q, inp.k, inp.v, inp.g, inp.beta]
    do = inp.do
    if arm.batched:
        views = [t.unsqueeze(0) for t in views]
        do = do.unsqueeze(0)
    leaves = [t.detach().requires_grad_(True) for t in views]
    return leaves, inp.cu_seqlens, do


def make_step(
    arm: Arm, op: str, leaves: list[torch.Tensor], cu: torch.Tensor, do: torch.Tensor, fresh_cu: bool = False
):
    """One call of ``op``; returns (o, grads-or-None). Nothing but the op runs inside.

    Gradients come from ``torch.autograd.grad``, so no ``.grad`` accumulation kernels.
    fresh_cu: each call takes the next of FRESH_CU_SEQLENS copies of ``cu`` in turn.
    """
    fn = arm.fn
    cus = [cu.clone() for _ in range(FRESH_CU_SEQLENS)] if fresh_cu else [cu]
    turn = itertools.count()

    def step():
        cu_call = cus[next(turn) % len(cus)]
        with torch.enable_grad():
            if op == "ckpt":
                o = checkpoint(fn, *leaves, cu_call, use_reentrant=False)
            else:
                o = fn(*leaves, cu_call)
            grads = torch.autograd.grad(o, leaves, do) if op != "fwd" else None
        return o, grads

    return step


# -------------------------------------------------------------------------- accuracy


def reference_outputs(inp: Inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """FP64 reference o and (dq, dk, dv, dg, dbeta) for do, on the inputs' device, returned on the CPU."""
    from cake_ops.reference import gdn_reference

    leaves = [t.detach().double().requires_grad_(True) for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
    with torch.enable_grad():
        o, _ = gdn_reference(*leaves, inp.cu_seqlens, use_qk_l2norm=True)
        grads = torch.autograd.grad(o, leaves, inp.do.double())
    return o.detach().cpu(), [x.detach().cpu() for x in grads]


def check_accuracy(arm: Arm, op: str, inp: Inputs, ref_o: torch.Tensor, ref_grads: list[torch.Tensor]) -> dict:
    """One arm and op on the accuracy shape: finite and rel-RMS <= 1e-2 on every tensor.

    DESIGN.md's second measure (max|x - ref| <= 2e-2 max|ref|) is reported as
    ``contract_ok`` but does not keep an arm from being timed.
    """
    from cake_ops.testing import REL_RMS_TOL, accuracy

    entry: dict[str, Any] = {
        "arm": arm.name, "op": op, "ok": False, "contract_ok": False, "error": None,
        "rel_rms": {}, "max_abs_ratio": {},
    }
    try:
        leaves, cu, do = arm_args(arm, inp)
        o, grads = make_step(arm, op, leaves, cu, do)()
        pairs = [("o", o, ref_o)]
        if grads is not None:
            pairs += list(zip(GRAD_NAMES, grads, ref_grads))
        accs = {}
        for name, x, ref in pairs:
            accs[name] = acc = accuracy(x.detach().reshape(ref.shape), ref)
            entry["rel_rms"][name] = acc.rel_rms if acc.finite else math.inf
            entry["max_abs_ratio"][name] = acc.max_abs_ratio if acc.finite else math.inf
        entry["ok"] = all(a.finite and a.rel_rms <= REL_RMS_TOL for a in accs.values())
        entry["contract_ok"] = all(a.ok for a in accs.values())
        if not entry["ok"]:
            worst = max(entry["rel_rms"], key=lambda n: entry["rel_rms"][n])
            entry["error"] = f"rel-RMS of {worst} = {entry['rel_rms'][worst]:.3g} > {REL_RMS_TOL:g}"
    except Exception as e:
        entry["error"] = _err(e)
        entry["traceback"] = traceback.format_exc(limit=6)
    return entry


# ---------------------------------------------------------------------------- timers


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


class Timer:
    """The three timings; CUDA events and the profiler on a GPU, wall-clock otherwise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush_buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if self.cuda else None
        self.sessions = 0  # profiler sessions so far in this process
        self.last_kernels: dict[str, float] = {}  # kernel_ms's last sample, per kernel: ms per call

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
        total_us, pads_seen, launches = 0.0, 0, []
        self.last_kernels = {}
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            if "spin_kernel" in e.name:
                pads_seen += 1
                continue
            dur = e.time_range.elapsed_us()
            if not 0 <= dur < 600e6:  # a corrupted timestamp
                return [math.nan]
            total_us += dur
            launches.append((e.name, dur))
        if pads_seen == 0 or not launches:
            print(f"  warning: profiler session kept {pads_seen}/{pads} pads and {len(launches)} kernels; sample dropped", flush=True)
            return [math.nan]
        self.last_kernels = kernel_split(launches, n)
        return [total_us / 1e3 / n]

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


TIMINGS = ("kernel_ms", "stream_ms", "sync_ms")


def matmul_tflops(device: torch.device) -> float:
    """bf16 matmul rate on random data (8192^3 on a GPU, 512^3 on a CPU), TFLOP/s."""
    n, reps = (8192, 10) if device.type == "cuda" else (512, 3)
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=device).to(torch.bfloat16)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        torch.cuda.synchronize(device)
        secs = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        secs = time.perf_counter() - t0
    return 2 * n**3 * reps / secs / 1e12


# ------------------------------------------------------------------------------- run


def time_cell(
    shape: Shape, op: str, arms: list[Arm], inp: Inputs, timer: Timer, timings: Sequence[str], args
) -> dict[str, dict]:
    """All arms on one (shape, op): warm-up, then groups in palindromic order.

    Returns per arm {"error": str | None, "samples": {timing: [samples of group 0, ...]}}.
    """
    cells: dict[str, dict] = {}
    steps = {}
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
        except Exception as e:
            cells[arm.name]["error"] = _err(e)
            steps.pop(arm.name, None)
            print(f"  {shape.name} {op} {arm.name}: warm-up failed: {_err(e)}", flush=True)
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
                cell["error"] = _err(e)
                print(f"  {shape.name} {op} {arm.name}: failed while timing: {_err(e)}", flush=True)
    steps.clear()
    return cells


def median_split(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per kernel, the median over samples of its ms per call (0 where a sample lacks it);
    the largest first."""
    names = {k for sample in samples for k in sample}
    med = {k: statistics.median(sample.get(k, 0.0) for sample in samples) for k in names}
    return dict(sorted(med.items(), key=lambda kv: -kv[1]))


def summarize(samples: list[list[float]]) -> tuple[float, float, list[float]]:
    """(median over all samples, drift of the group medians, group medians)."""
    flat = [x for grp in samples for x in grp]
    medians = [statistics.median(grp) if grp else math.nan for grp in samples]
    value = statistics.median(flat) if flat and all(math.isfinite(x) for x in flat) else math.nan
    return value, drift(medians), medians


def time_cells(args, shapes, arms, passed, rate, timer, rows, timed, meta) -> None:
    """Every (shape, op) cell: rows[(shape, op, arm)] gets its samples, timed the
    (shape, op, timing) of each finished cell; meta["timing_now"] names the cell in hand.

    Two phases over all cells: CUDA-event timings first, then the profiler. A profiler
    session leaves CUPTI attached (no teardown by default), which slows launches for
    the rest of the process; stream_ms and sync_ms must not see that.
    """
    meta["timing_now"] = "(no cell yet)"
    for timings in (("stream_ms", "sync_ms"), ("kernel_ms",)):
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
                            "floor_ms": flop / (rate * 1e12) * 1e3, "error": None,
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
                    if cell["kernels"]:
                        row["kernels"] = median_split(cell["kernels"])
                timed.update((shape.name, op, t) for t in timings)
                if timer.device.type == "cuda":
                    torch.cuda.empty_cache()
            del inp


def run(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    shapes = [{**SHAPES, **QUICK_SHAPES}[s] for s in args.shapes]
    report: dict[str, Any] = {
        "meta": {
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
            "versions": {d: _dist_version(d) for d in ("cake-ops", "fla-core", "flash-qla", "tilelang", "triton")},
        },
        "skipped_arms": {},
        "accuracy": [],
        "results": [],
    }
    meta = report["meta"]

    rate = matmul_tflops(device)
    meta["matmul_tflops"] = rate
    print(f"device {meta['device']} | torch {torch.__version__} | bf16 matmul {rate:.3g} TFLOP/s | gate {args.gate} | cu_seqlens {args.cu_seqlens}", flush=True)

    arms = load_arms(args.arms, device)
    for arm in arms:
        if arm.skip:
            report["skipped_arms"][arm.name] = arm.skip
            print(f"skip {arm.name}: {arm.skip}", flush=True)
    arms = [a for a in arms if not a.skip]

    # Accuracy on the small packed shape, every arm and op, before any timing.
    acc_inp = make_inputs(ACCURACY_SHAPE, device, args.gate, args.seed + 1)
    ref_o, ref_grads = reference_outputs(acc_inp)
    passed: dict[tuple[str, str], bool] = {}
    for arm in arms:
        for op in args.ops:
            entry = check_accuracy(arm, op, acc_inp, ref_o, ref_grads)
            report["accuracy"].append(entry)
            passed[(arm.name, op)] = entry["ok"]
            worst = max(entry["rel_rms"].values(), default=math.nan)
            status = "ok" if entry["ok"] else f"FAIL, not timed ({entry['error']})"
            if entry["ok"] and not entry["contract_ok"]:
                status += " (max-abs over DESIGN.md's 2e-2)"
            print(f"accuracy {arm.name:9s} {op:7s} worst rel-RMS {worst:.2e}: {status}", flush=True)
    del acc_inp

    timer = Timer(device)
    rows: dict[tuple[str, str, str], dict] = {}
    timed: set[tuple[str, str, str]] = set()  # (shape, op, timing) of the cells finished
    try:
        time_cells(args, shapes, arms, passed, rate, timer, rows, timed, meta)
    except (BenchInterrupted, KeyboardInterrupt) as e:
        meta["interrupted"] = f"{str(e) or type(e).__name__} while timing {meta['timing_now']}"
        print(f"interrupted: {meta['interrupted']}; reporting the cells timed so far", flush=True)
    meta.pop("timing_now", None)

    for key, row in rows.items():
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
    for (shape_name, op, _), row in rows.items():
        cake = rows.get((shape_name, op, "cake"), {})
        for t, key in (("kernel_ms", "cake_over_arm_kernel"), ("stream_ms", "cake_over_arm_stream")):
            c, x = cake.get(t), row.get(t)
            ok = c is not None and x is not None and math.isfinite(c) and math.isfinite(x) and x > 0
            row[key] = c / x if ok else None
        report["results"].append(row)
    return report


def format_table(report: dict) -> str:
    head = ["shape", "op", "arm", "kernel_ms", "stream_ms", "sync_ms", "floor_ms", "cake/arm"]
    lines = []
    for row in report["results"]:
        unstable = set(row.get("unstable_timings") or [])
        cells = [row["shape"], row["op"], row["arm"]]
        for t in TIMINGS:
            cells.append(_fmt(row[t]).strip() + ("*" if t in unstable else ""))
        cells.append(_fmt(row["floor_ms"]).strip())
        ratio = row.get("cake_over_arm_kernel")
        if row["arm"] == "cake" or ratio is None:
            cells.append("-")
        else:
            cake = next((r for r in report["results"] if (r["shape"], r["op"], r["arm"]) == (row["shape"], row["op"], "cake")), {})
            shaky = "kernel_ms" in unstable or "kernel_ms" in set(cake.get("unstable_timings") or [])
            cells.append(f"{ratio:.2f}" + ("*" if shaky else ""))
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
        "cake/arm = cake kernel_ms / arm kernel_ms (> 1: the arm is faster)",
        f"floor_ms = FLOP / measured bf16 matmul rate ({report['meta']['matmul_tflops']:.3g} TFLOP/s); "
        f"fwdbwd = {FWDBWD_OVER_FWD} x fwd FLOP, ckpt = fwd + fwdbwd",
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cake_ops.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help=f"comma list; default all of {','.join(SHAPES)} (--quick: {','.join(QUICK_SHAPES)})")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(OPS)}")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--groups", type=int, default=3, help="timing groups, >= 3 (default 3)")
    p.add_argument("--calls", type=int, help="calls per arm appearance and timing (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, help="warm-up calls per arm and cell (default 3; --quick 1)")
    p.add_argument("--gate", default="mamba", choices=("mamba", "logsigmoid"), help="distribution of g (see the module doc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cu-seqlens", default="same", choices=("same", "fresh"),
        help="same tensor every call (default: a training step's later layers) or fresh copies (its first layer)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", help="write the report here (allow_nan=False; non-finite -> null)")
    p.add_argument("--kernels", action="store_true", help="also print each row's per-kernel times (always in the JSON)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few calls: a smoke test that also runs on a CPU")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv

    def split(s: str, allowed: Sequence[str], what: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            p.error(f"--{what}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
        return list(dict.fromkeys(items))

    default_shapes = QUICK_SHAPES if args.quick else SHAPES
    args.shapes = split(args.shapes or ",".join(default_shapes), list(SHAPES) + list(QUICK_SHAPES), "shapes")
    args.ops = split(args.ops, OPS, "ops")
    args.arms = [a for a in ARMS if a in split(args.arms, ARMS, "arms")]  # canonical (palindrome) order
    args.calls = args.calls if args.calls is not None else (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.groups < 3:
        p.error("--groups must be >= 3 (BENCH.md protocol)")
    if args.calls < 1 or args.warmup < 0:
        p.error("--calls must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        report = run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_table(report), flush=True)
    if args.kernels:
        print(format_kernels(report), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(sanitize(report), f, allow_nan=False, indent=1)
        print(f"wrote {args.json}", flush=True)
    return report


if __name__ == "__main__":
    main()
