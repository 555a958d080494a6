"""Index bookkeeping for packed variable-length documents, computed on the device.

Everything here is a function of ``cu_seqlens`` and static sizes only: no host sync and
no data-dependent shapes, so the ops that use it stay CUDA-graph capturable. The
number of chunk slots is the static bound ``ceil(T / C) + N``; slots past the last
document's last chunk are padding (zero inputs, never gathered back).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def token_document(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document of every token and its position inside it: ([T], [T]) int64."""
    cu = cu_seqlens.long()
    t = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu[1:], t, right=True)  # first n with cu[n+1] > t: skips empty documents
    return doc, t - cu[doc]


class ChunkLayout(NamedTuple):
    """Where each C-token chunk of each document sits in a [NC, C] slot grid."""

    token: torch.Tensor  # [NC, C] token index per slot position; T (a zero pad row) where unused
    doc: torch.Tensor  # [NC] document of each slot (clamped to N-1 on unused slots)
    first: torch.Tensor  # [NC] bool: the slot is its document's first chunk
    last: torch.Tensor  # [NC] bool: the slot is its document's last chunk
    doc_first_slot: torch.Tensor  # [N] slot of each document's first chunk (clamped)
    doc_last_slot: torch.Tensor  # [N] slot of each document's last chunk (clamped)
    doc_nonempty: torch.Tensor  # [N] bool
    token_slot: torch.Tensor  # [T] flat position slot * C + i of each token


def chunk_layout(cu_seqlens: torch.Tensor, T: int, C: int) -> ChunkLayout:
    cu = cu_seqlens.long()
    N = cu.shape[0] - 1
    NC = (T + C - 1) // C + N
    device = cu.device
    nchunks = (cu[1:] - cu[:-1] + C - 1) // C
    end = torch.cumsum(nchunks, 0)
    start = end - nchunks
    slot = torch.arange(NC, device=device)
    doc = torch.searchsorted(end, slot, right=True)
    used = doc < N
    doc = doc.clamp(max=N - 1)
    local = slot - start[doc]
    token = cu[doc][:, None] + local[:, None] * C + torch.arange(C, device=device)
    valid = used[:, None] & (token < cu[doc + 1][:, None])
    token = torch.where(valid, token, T)
    tdoc, pos = token_document(cu_seqlens, T)
    return ChunkLayout(
        token=token,
        doc=doc,
        first=used & (local == 0),
        last=used & (local == nchunks[doc] - 1),
        doc_first_slot=start.clamp(max=NC - 1),
        doc_last_slot=(end - 1).clamp(min=0),
        doc_nonempty=nchunks > 0,
        token_slot=(start[tdoc] + pos // C) * C + pos % C,
    )


def to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, heads, ...] -> [NC, heads, C, ...]; padding positions read a zero row."""
    padded = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])
    return padded[layout.token].transpose(1, 2)


def from_chunks(xc: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[NC, heads, C, ...] -> [T, heads, ...] (a gather: deterministic, no scatter)."""
    flat = xc.transpose(1, 2).flatten(0, 1)
    return flat[layout.token_slot]


def to_packed(
    name: str, x: torch.Tensor, packed_rank: int, cu_seqlens, others: dict[str, tuple[torch.Tensor, int]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, tuple[int, int] | None]:
    """The user entries' batch handling: x (named ``name``) is packed ([T, ...], rank
    ``packed_rank``) or batched ([B, T, ...], one rank more); ``others`` name -> (tensor,
    packed rank) follow x. A batch is the packed case with ``cu_seqlens = arange(B+1)*T``;
    ``cu_seqlens`` with a batch needs B = 1; None on a packed x is one document.

    Returns (x, others, cu_seqlens, (B, T) or None) in the packed layout (views)."""
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a torch.Tensor (int32 or int64, on {name}'s device), got "
            f"{type(cu_seqlens).__name__}; e.g. torch.tensor(cu_seqlens, dtype=torch.int32, device={name}.device)"
        )
    if x.dim() != packed_rank + 1:
        if cu_seqlens is None:
            cu_seqlens = torch.arange(2, device=x.device, dtype=torch.int32) * x.shape[0]
        return x, {n: t for n, (t, _) in others.items()}, cu_seqlens, None
    B, T = x.shape[0], x.shape[1]
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 (packed documents), got batch size {B}")
    for n, (t, rank) in others.items():
        if not isinstance(t, torch.Tensor) or t.dim() != rank + 1 or t.shape[0] != B:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{n} must be [B, T, ...] with B = {B} like {name}, got shape {shape}")
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, device=x.device, dtype=torch.int32) * T
    return x.flatten(0, 1), {n: t.flatten(0, 1) for n, (t, _) in others.items()}, cu_seqlens, (B, T)
