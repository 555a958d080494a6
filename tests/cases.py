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


def short_conv_documents(lengths, D, W, x_dtype, param_dtype, *, bias, state, cu_dtype=torch.int32, seed=0,
                         with_dy=False, device="cuda") -> dict:
    """Fresh random short-convolution inputs for documents of ``lengths`` tokens (and the
    output gradient dy first, with_dy); the initial state takes the dtype the weight does
    not, so mixed dtypes are covered."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    state_dtype = torch.float32 if param_dtype == x_dtype else x_dtype
    out = dict(dy=torch.randn(T, D, generator=gen).to(device, x_dtype)) if with_dy else {}
    out.update(
        x=torch.randn(T, D, generator=gen).to(device, x_dtype),
        weight=(torch.randn(D, W, generator=gen) / W**0.5).to(device, param_dtype),
        bias=torch.randn(D, generator=gen).to(device, param_dtype) if bias else None,
        cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=cu_dtype, device=device),
        initial_state=torch.randn(N, D, W - 1, generator=gen).to(device, state_dtype) if state else None,
    )
    return out


def replay_and_eager(step, static: dict, fresh: dict):
    """step(static) captured in a CUDA graph (after a warm-up outside it), the static
    tensors then overwritten with fresh's values and the graph replayed: (the replayed
    outputs, step(fresh) run eagerly)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)  # builds and loads outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    for name, tensor in static.items():
        if tensor is not None:
            tensor.copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    return captured, step(fresh)


def params(cases) -> list:
    """pytest parameters named by each case's id."""
    return [pytest.param(c, id=c.id) for c in cases]
