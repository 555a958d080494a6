"""The KCP exchanges, on functional collectives (``torch.distributed._functional_collectives``,
the group passed by name), so that torch.compile traces them.

``all_gather`` is differentiable with a backward of its own: the adjoint of an all-gather
is a sum over the ranks of each rank's block, which a reduce-scatter would form in an
order of the backend's choosing; here each rank receives its blocks from every rank by an
all-to-all and adds them in rank order, so the gradients are bitwise reproducible.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol


# torch 2.13 names it all_gather_single (all_gather_tensor, deprecated there, is 2.11's).
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def gather(x: torch.Tensor, ctx) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on each), concatenated in rank order along dim 0
    (not differentiable)."""
    return _wait(_all_gather_single(x.contiguous(), 0, ctx.group_name))


def gather_adjoint(grad: torch.Tensor, ctx) -> torch.Tensor:
    """The adjoint of ``gather``: this rank's block of every rank's ``grad``, summed in
    rank order."""
    blocks = _wait(funcol.all_to_all_single(grad.contiguous(), None, None, ctx.group_name))
    blocks = blocks.view(ctx.world, -1, *grad.shape[1:])
    total = blocks[0]
    for r in range(1, ctx.world):  # rank order, whatever the backend
        total = total + blocks[r]
    return total


def shift(x: torch.Tensor, send_splits, recv_splits, ctx) -> torch.Tensor:
    """Rows of ``x`` to other ranks: the first ``send_splits[0]`` to rank 0, the next
    ``send_splits[1]`` to rank 1, ...; returns the rows received, by source rank
    (``recv_splits[r]`` from rank r). An all-to-all whose splits are the plan's, zero but
    for neighbours in the ring exchange (not differentiable)."""
    return _wait(funcol.all_to_all_single(x.contiguous(), list(recv_splits), list(send_splits), ctx.group_name))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kcp):
        ctx.kcp = kcp
        return gather(x, kcp)

    @staticmethod
    def backward(ctx, grad):
        return gather_adjoint(grad, ctx.kcp), None


def all_gather(x: torch.Tensor, ctx) -> torch.Tensor:
    """``gather`` with its adjoint as the backward (module docstring). Every rank's
    backward must reach it (a collective)."""
    return _AllGather.apply(x, ctx)
