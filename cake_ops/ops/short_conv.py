"""The short causal convolution of GDN layers: ``cake::short_conv_fwd`` / ``_bwd``.

Depthwise, width W <= 4, optional SiLU, over packed documents (a document never sees
its neighbour's tokens), with an optional initial conv state [N, D, W-1] holding the
W-1 inputs before each document. y[t] = act(bias + sum_i weight[:, i] x[t - (W-1) + i]).

Which implementation runs a call is decided by ``cake_ops.dispatch``: on a Hopper GPU
the forward and the backward run the CUDA kernels of ``csrc/short_conv/`` (fwd.cu,
bwd.cu); elsewhere the PyTorch implementation ``cake_ops.pytorch.short_conv``. The
kernels read the weight in fp32 or x's dtype, the bias in the weight's and the initial
state in fp32 or x's dtype: other dtypes (and a bias of another dtype than the weight, with
that weight) are widened to fp32 for them, and the backward's gradients are cast back to
the dtypes the op promises. Fake kernels:
``meta/short_conv.py``. The math: docs/math.md, Short convolution.
"""

from __future__ import annotations

import torch

from .. import dispatch
from . import cuda_kernel
from ..checks import check_cu_seqlens_values, check_short_conv
from ..pytorch import short_conv as pytorch_short_conv
from ..varlen import to_packed


@torch.library.custom_op("cake::short_conv_fwd", mutates_args=())
def short_conv_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """x: [T, D]; weight: [D, W]; bias: [D]; initial_state: [N, D, W-1]. Returns y [T, D]
    in x's dtype (fp32 accumulation)."""
    T = check_short_conv(x, weight, bias, cu_seqlens, initial_state)[0]
    check_cu_seqlens_values(cu_seqlens, T)
    return pytorch_short_conv.short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, silu)


@cuda_kernel("short_conv_fwd")
def _short_conv_fwd_cuda(x, weight, bias, cu_seqlens, initial_state, silu):
    T = check_short_conv(x, weight, bias, cu_seqlens, initial_state)[0]
    check_cu_seqlens_values(cu_seqlens, T)
    if dispatch.short_conv_fwd_cuda_refusal(x) is not None:
        return pytorch_short_conv.short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, silu)
    from .. import build

    weight, bias, initial_state = kernel_dtypes(x, weight, bias, initial_state)
    return build.load().short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, silu)


def kernel_dtypes(x, weight, bias, initial_state):
    """weight, bias and initial_state in the dtypes the CUDA kernels read: the weight in fp32
    unless it has x's dtype (and the bias its dtype), the bias in the weight's dtype, the
    initial state in fp32 unless it has x's dtype. Every cast is exact: only fp16 and bf16
    widen to fp32."""
    if weight.dtype not in (torch.float32, x.dtype) or (bias is not None and bias.dtype != weight.dtype):
        weight = weight.float()
    if bias is not None:
        bias = bias.to(weight.dtype)
    if initial_state is not None and initial_state.dtype not in (torch.float32, x.dtype):
        initial_state = initial_state.float()
    return weight, bias, initial_state


@torch.library.custom_op("cake::short_conv_bwd", mutates_args=())
def short_conv_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [T, D], dweight [D, W], dbias [D], dinitial_state [N, D, W-1]) in the
    dtypes of x, weight, bias (weight's if None) and initial_state (x's if None)."""
    T = check_short_conv(x, weight, bias, cu_seqlens, initial_state)[0]
    check_cu_seqlens_values(cu_seqlens, T)
    return pytorch_short_conv.short_conv_bwd(dy, x, weight, bias, cu_seqlens, initial_state, silu)


@cuda_kernel("short_conv_bwd")
def _short_conv_bwd_cuda(dy, x, weight, bias, cu_seqlens, initial_state, silu):
    T = check_short_conv(x, weight, bias, cu_seqlens, initial_state)[0]
    check_cu_seqlens_values(cu_seqlens, T)
    if dispatch.short_conv_bwd_cuda_refusal(dy, x) is not None:
        return pytorch_short_conv.short_conv_bwd(dy, x, weight, bias, cu_seqlens, initial_state, silu)
    from .. import build

    k_weight, k_bias, k_state = kernel_dtypes(x, weight, bias, initial_state)
    dx, dweight, dbias, dinit = build.load().short_conv_bwd(dy, x, k_weight, k_bias, cu_seqlens, k_state, silu)
    return (
        dx,
        dweight.to(weight.dtype),
        dbias.to(bias.dtype if bias is not None else weight.dtype),
        dinit.to(initial_state.dtype if initial_state is not None else x.dtype),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, cu_seqlens, initial_state, silu = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens, initial_state)
    ctx.silu = silu


def _backward(ctx, dy):
    x, weight, bias, cu_seqlens, initial_state = ctx.saved_tensors
    dx, dweight, dbias, dinit = torch.ops.cake.short_conv_bwd(dy, x, weight, bias, cu_seqlens, initial_state, ctx.silu)
    return dx, dweight, dbias if bias is not None else None, None, dinit if initial_state is not None else None, None


short_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution over packed documents (differentiable).

    Args:
        x: [T, D] packed or [B, T, D]. weight: [D, W], W <= 4 (``weight[:, -1]`` multiplies
            the current token). bias: [D]. cu_seqlens: [N+1] int32/int64 on x's device
            tensor (None: one document per batch row; not allowed with B > 1).
        initial_state: [N, D, W-1], the W-1 inputs before each document.
        activation: None or "silu".
    Returns:
        y with x's shape and dtype.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    x, _, cu_seqlens, batch = to_packed("x", x, 2, cu_seqlens, {})
    y = torch.ops.cake.short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, activation == "silu")
    return y.unflatten(0, batch) if batch is not None else y
