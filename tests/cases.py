"""Named test cases shared by the test groups: each field says what varies."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from cake_ops.testing import make_gdn_inputs


@dataclasses.dataclass(frozen=True)
class GdnCase:
    """A packed GDN call: documents of ``lengths`` tokens, H q/k heads, G value heads per
    q/k head (GVA), head dims K and V, the gate and beta regimes of ``make_gdn_inputs``."""

    id: str
    lengths: tuple[int, ...]
    H: int = 1
    G: int = 1
    K: int = 128
    V: int = 128
    gate: str = "normal"  # "normal" (-1..0), "strong" (down to -20), "slow" (about -1e-3)
    beta: str = "uniform"  # "uniform" in (0, 1) or "extreme" (near 0 and near 1)
    beta_dtype: torch.dtype = torch.float32
    l2norm: bool = False  # use_qk_l2norm (else the keys arrive unit-norm)
    initial_state: bool = False
    cu_dtype: torch.dtype = torch.int32

    @property
    def HV(self) -> int:
        return self.H * self.G

    @property
    def seed(self) -> int:
        """Stable per case, so a failure reproduces."""
        return zlib.crc32(self.id.encode())

    def inputs(self, device: str = "cpu", seed: int | None = None) -> dict:
        inp = make_gdn_inputs(
            list(self.lengths), self.H, self.HV, self.K, self.V, gate=self.gate, beta=self.beta,
            beta_dtype=self.beta_dtype, normalized_qk=not self.l2norm, initial_state=self.initial_state,
            device=device, seed=self.seed if seed is None else seed,
        )
        inp["cu_seqlens"] = inp["cu_seqlens"].to(self.cu_dtype)
        return inp


@dataclasses.dataclass(frozen=True)
class ShortConvCase:
    """A packed short-convolution call: D channels, width W."""

    id: str
    lengths: tuple[int, ...]
    D: int
    W: int
    bias: bool
    initial_state: bool
    activation: str | None
    dtype: torch.dtype


def params(cases) -> list:
    """pytest parameters named by each case's id."""
    return [pytest.param(c, id=c.id) for c in cases]
