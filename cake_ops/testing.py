"""The accuracy contract (docs/contract.md, Accuracy) as code, shared by the tests and the benchmark.

Every output and gradient must be finite and meet, against the FP64 reference,
    rel-RMS = ||x - ref|| / ||ref|| <= 1e-2   and   max|x - ref| <= 2e-2 * max|ref|.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

REL_RMS_TOL = 1e-2
MAX_ABS_TOL = 2e-2


@dataclass
class Accuracy:
    rel_rms: float
    max_abs_ratio: float  # max|x - ref| / max|ref|
    finite: bool

    @property
    def ok(self) -> bool:
        return self.finite and self.rel_rms <= REL_RMS_TOL and self.max_abs_ratio <= MAX_ABS_TOL


def accuracy(x: torch.Tensor, ref: torch.Tensor) -> Accuracy:
    if x.shape != ref.shape:
        raise ValueError(f"shape {tuple(x.shape)} != reference shape {tuple(ref.shape)}")
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    finite = bool(torch.isfinite(x).all())
    err = x - ref
    ref_norm = ref.norm().item()
    ref_max = ref.abs().max().item() if ref.numel() else 0.0
    # An all-zero reference (e.g. no tokens) must be matched exactly.
    rel = err.norm().item() / ref_norm if ref_norm > 0 else err.norm().item()
    mx = (err.abs().max().item() if err.numel() else 0.0) / (ref_max if ref_max > 0 else 1.0)
    return Accuracy(rel, mx, finite)


@contextlib.contextmanager
def poisoned_allocations():
    """Fill every fresh allocation (outputs, workspaces) with NaN for the duration.

    Uses torch.use_deterministic_algorithms with fill_uninitialized_memory, which makes
    torch.empty (and at::empty in extensions) write NaN into float memory, so a kernel
    that leaves an element unwritten returns NaN there instead of stale values.
    """
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def make_gdn_inputs(
    lengths,
    H: int,
    HV: int,
    K: int,
    V: int,
    *,
    gate: str = "normal",
    beta: str = "uniform",
    beta_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype = torch.bfloat16,
    normalized_qk: bool = False,
    initial_state: bool = False,
    device="cpu",
    seed: int = 0,
) -> dict:
    """Fresh random inputs (never zeros) for a packed GDN call.

    gate: "normal" (g in [-1, 0)), "strong" (down to -20 per token), "slow" (about -1e-3).
    beta: "uniform" in (0, 1) or "extreme" (a mix of values near 0 and near 1).
    normalized_qk: unit-norm q/k rows, for calls without the in-op L2 norm (the chunked
    algorithm, like the peers', assumes normalised keys).
    """
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(T, H, K), randn(T, H, K)
    if normalized_qk:
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    v = randn(T, HV, V)
    u = torch.rand(T, HV, generator=gen)
    g = {"normal": -(u + 1e-3), "strong": -20 * u - 1e-3, "slow": -1e-3 * (u + 0.5)}[gate]
    if beta == "uniform":
        b = torch.rand(T, HV, generator=gen) * 0.98 + 0.01
    else:
        near_one = torch.rand(T, HV, generator=gen) < 0.5
        b = torch.where(near_one, 1 - 1e-3 * u, 1e-3 * u + 1e-6)
    out = dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=b.to(beta_dtype),
        cu_seqlens=torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32),
        initial_state=randn(len(lengths), HV, K, V) * 0.5 if initial_state else None,
    )
    return {n: (t.to(device) if t is not None else None) for n, t in out.items()}
