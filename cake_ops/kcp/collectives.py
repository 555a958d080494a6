"""The KCP exchanges, on functional collectives (``torch.distributed._functional_collectives``,
the group passed by name), so that torch.compile traces them.

``all_gather`` is differentiable with a backward of its own: the adjoint of an all-gather
is a sum over the ranks of each rank's block, which a reduce-scatter would form in an
order of the backend's choosing; here each rank receives its blocks from every rank by an
all-to-all and adds them in rank order, so the gradients are bitwise reproducible.

A collective of a backward takes an ``after`` gradient: traced (torch.compile), its input
is made to depend on it. AOTAutograd's min-cut partitioner (the default of inductor and
aot_eager) computes in the forward every node that no gradient reaches, collectives
included; a rank with nothing to send (say, no sink fragment) would then run that
backward collective in its forward while the others run it in their backward, and the
ranks would wait on each other for ever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch.distributed.nn.functional takes ``group.WORLD`` as a default argument, bound when it
# is first imported; torch._dynamo imports it, and so does the first eager functional
# collective. Imported while a default group exists, it keeps that group alive past
# destroy_process_group, and the group's gloo threads then die with the interpreter (an
# abort at exit, after a run had passed). Imported here, before the program makes a group,
# it binds None.
if not dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401


# torch 2.13 names it all_gather_single (all_gather_tensor, deprecated there, is 2.11's).
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _after(x: torch.Tensor, after: torch.Tensor | None) -> torch.Tensor:
    """``x``, traced as depending on ``after`` (module docstring): plus -0.0 taken from an
    empty slice of it, which changes no bit of x (-0.0 + -0.0 = -0.0). Eager: x itself."""
    if after is None or not torch.compiler.is_compiling():
        return x
    return x + after.flatten()[:0].sum().neg()


def gather(x: torch.Tensor, ctx, after: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on each), concatenated in rank order along dim 0
    (not differentiable). ``after``: in a backward, its gradient (module docstring)."""
    return _wait(_all_gather_single(_after(x, after).contiguous(), 0, ctx.group_name))


def gather_adjoint(grad: torch.Tensor, ctx, after: torch.Tensor | None = None) -> torch.Tensor:
    """The adjoint of ``gather``: this rank's block of every rank's ``grad``, summed in
    rank order. ``after`` as ``gather``'s."""
    blocks = _wait(funcol.all_to_all_single(_after(grad, after).contiguous(), None, None, ctx.group_name))
    blocks = blocks.view(ctx.world, -1, *grad.shape[1:])
    total = blocks[0]
    for r in range(1, ctx.world):  # rank order, whatever the backend
        total = total + blocks[r]
    return total


def shift(x: torch.Tensor, send_splits, recv_splits, ctx, after: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``x`` to other ranks: the first ``send_splits[0]`` to rank 0, the next
    ``send_splits[1]`` to rank 1, ...; returns the rows received, by source rank
    (``recv_splits[r]`` from rank r). An all-to-all whose splits are the plan's, zero but
    for neighbours in the ring exchange (not differentiable). ``after`` as ``gather``'s."""
    return _wait(funcol.all_to_all_single(_after(x, after).contiguous(), list(recv_splits), list(send_splits),
                                          ctx.group_name))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kcp):
        ctx.kcp = kcp
        return gather(x, kcp)

    @staticmethod
    def backward(ctx, grad):
        return gather_adjoint(grad, ctx.kcp), None  # grad is the gradient: nothing to tie it to


def all_gather(x: torch.Tensor, ctx) -> torch.Tensor:
    """``gather`` with its adjoint as the backward (module docstring). Every rank's
    backward must reach it (a collective)."""
    return _AllGather.apply(x, ctx)
