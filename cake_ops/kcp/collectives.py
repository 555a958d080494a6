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


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name: str, world: int):
        ctx.group_name, ctx.world = group_name, world
        return _wait(_all_gather_single(x.contiguous(), 0, group_name))

    @staticmethod
    def backward(ctx, grad):
        blocks = _wait(funcol.all_to_all_single(grad.contiguous(), None, None, ctx.group_name))
        blocks = blocks.view(ctx.world, -1, *grad.shape[1:])
        total = blocks[0]
        for r in range(1, ctx.world):  # rank order, whatever the backend
            total = total + blocks[r]
        return total, None, None


def all_gather(x: torch.Tensor, ctx) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on each), concatenated in rank order along dim
    0; its gradient is summed over the ranks in rank order (module docstring)."""
    return _AllGather.apply(x, ctx.group_name, ctx.world)
