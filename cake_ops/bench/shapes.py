"""The benchmark's shapes and inputs, and its FLOP model and floor.

docs/benchmark.md: the shapes in Shapes, the inputs in Protocol, the floor in Timings.

Inputs: q, k, v ~ randn (bf16), l2-normalised inside every arm (``use_qk_l2norm``
/ ``use_qk_l2norm_in_kernel``); beta = sigmoid(randn) (fp32); g (fp32) from
``--gate``: ``mamba`` (default, what a GDN layer produces at init: per value head
A ~ U(0, 16) and dt_bias = softplus^-1(dt0), dt0 log-uniform in [1e-3, 1e-1]; per
token g = -A * softplus(x + dt_bias) with x ~ N(0, 1), so fast and slow heads mix:
median g about -0.06, 0.1 % below -7, the extremes near -35) or ``logsigmoid``
(logsigmoid(U(0, 1)), in (-0.69, -0.31): the FLA/FlashQLA docstring gate, uniformly
strong decay). FlashQLA's intra-card split truncates its warm-up by the decay it sees,
so the gate changes its times.

``floor_ms`` of a cell is the op's FLOP (``gdn_flop``) over the bf16 matmul rate
measured at start (``matmul_tflops``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..pytorch.gdn import CHUNK  # the chunk of every GDN implementation here
# Whole fwd+bwd step (forward, backward, backward's state recompute) over the forward
# alone: ≈ 43-45 MFLOP per head-chunk, ≈ 3.9x the forward (docs/benchmark.md, Timings).
FWDBWD_OVER_FWD = 3.9


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


def shape_names(text: str) -> list[str]:
    """A tool's ``--shapes``: comma-separated names of the benchmark's shapes (``SHAPES``),
    checked before any GPU work; ValueError naming the unknown ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"--shapes: unknown {unknown or 'empty list'}; the benchmark's are {', '.join(SHAPES)}")
    return names


# Context parallel's shapes, for --cp only (issue 21): packs of 262144 tokens, one to six
# documents, at (H, HV) = (16, 48) and (2, 6). One document spans every rank (relays from
# CP 3 on); two are issue 20's target; from three on the lengths are uneven and not
# multiples of 64, so documents cross rank boundaries at arbitrary offsets with partial
# last chunks. 262144 = 2^18 tokens splits into the equal parts FLA's CP needs at any CP.
_KCP_DOCS = {
    1: (262144,),
    2: (131072, 131072),
    3: (120000, 90000, 52144),
    4: (100000, 80000, 50000, 32144),
    5: (90000, 70000, 50000, 30000, 22144),
    6: (80000, 60000, 50000, 35000, 25000, 12144),
}
KCP_SHAPES = {
    s.name: s
    for heads, H, HV in (("h16", 16, 48), ("h2", 2, 6))
    for s in (Shape(f"s256k_{n}doc{'s' if n > 1 else ''}_{heads}", docs, H, HV) for n, docs in _KCP_DOCS.items())
}
ACCURACY_SHAPE = Shape("accuracy", (100, 64, 37), 2, 6)


# ----------------------------------------------------------------------- FLOP model


def chunks_per_head(docs: Sequence[int], chunk: int = CHUNK) -> int:
    """Chunks one head walks over: each document is cut into ceil(len / chunk)."""
    return sum(-(-n // chunk) for n in docs)


def fwd_flop_per_head_chunk(K: int, V: int, G: int, chunk: int = CHUNK) -> float:
    """Forward FLOP per (chunk, value head), written in K, V, G = HV/H (docs/benchmark.md, Timings).

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


# --------------------------------------------------------------------------- inputs


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
