"""The short causal convolution of GDN layers: ``cake::short_conv_fwd`` / ``_bwd``.

Depthwise, width W <= 4, optional SiLU, over packed documents (a document never sees
its neighbour's tokens), with an optional initial conv state [N, D, W-1] holding the
W-1 inputs before each document. y[t] = act(bias + sum_i weight[:, i] x[t - (W-1) + i]).

The PyTorch implementation below is vectorised over tokens and channels (a loop over
the W taps only) and deterministic: the backward is a gather, never a scatter-add.
On a Hopper GPU the forward runs the CUDA kernel ``csrc/short_conv_fwd.cu`` (the
backward is PyTorch for now). Fake kernels: ``meta/short_conv.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_cu_seqlens_values, check_short_conv
from .varlen import token_document


def _tap(x, init, doc, pos, s):
    """x[t - s] inside t's document, else the initial conv state, else 0: [T, D] fp32."""
    W1 = init.shape[-1] if init is not None else 0
    shifted = x.roll(s, 0) if s else x  # rows that wrapped around have pos < s: replaced below
    inside = (pos >= s)[:, None]
    if init is None or s == 0:
        return torch.where(inside, shifted, 0.0)
    j = (W1 - (s - pos)).clamp(min=0, max=W1 - 1)
    return torch.where(inside, shifted, init[doc, :, j])


def _preactivation(x, weight, bias, doc, pos, init):
    W = weight.shape[1]
    pre = torch.zeros_like(x) if bias is None else bias.float().expand_as(x).clone()
    for i in range(W):
        pre = pre + weight[:, i].float() * _tap(x, init, doc, pos, W - 1 - i)
    return pre


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
    return _short_conv_fwd_pytorch(x, weight, bias, cu_seqlens, initial_state, silu)


def _short_conv_fwd_pytorch(x, weight, bias, cu_seqlens, initial_state, silu):
    doc, pos = token_document(cu_seqlens, x.shape[0])
    init = initial_state.float() if initial_state is not None else None
    pre = _preactivation(x.float(), weight, bias, doc, pos, init)
    y = F.silu(pre) if silu else pre
    return y.to(x.dtype)


@short_conv_fwd.register_kernel("cuda")
def _short_conv_fwd_cuda(x, weight, bias, cu_seqlens, initial_state, silu):
    T = check_short_conv(x, weight, bias, cu_seqlens, initial_state)[0]
    check_cu_seqlens_values(cu_seqlens, T)
    from . import build  # imported here so that `python -m cake_ops.build` runs cleanly

    if not build.available():
        return _short_conv_fwd_pytorch(x, weight, bias, cu_seqlens, initial_state, silu)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)  # the kernel reads bias in the weight's dtype
    if weight.dtype not in (torch.float32, x.dtype):
        weight = weight.float()
    if initial_state is not None and initial_state.dtype not in (torch.float32, x.dtype):
        initial_state = initial_state.float()
    return build.load().short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, silu)


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
    T, D, W, N = check_short_conv(x, weight, bias, cu_seqlens, initial_state)
    check_cu_seqlens_values(cu_seqlens, T)
    doc, pos = token_document(cu_seqlens, T)
    xf = x.float()
    init = initial_state.float() if initial_state is not None else None
    dpre = dy.float()
    if silu:
        pre = _preactivation(xf, weight, bias, doc, pos, init)
        sig = torch.sigmoid(pre)
        dpre = dpre * sig * (1 + pre * (1 - sig))
    dweight = torch.stack([(dpre * _tap(xf, init, doc, pos, W - 1 - i)).sum(0) for i in range(W)], 1)
    dbias = dpre.sum(0)
    # Tap s sends dpre[t] * weight[:, W-1-s] to x[t - s] when t - s is in the same document.
    dx = torch.zeros_like(xf)
    for s in range(W):
        contrib = torch.where((pos >= s)[:, None], dpre * weight[:, W - 1 - s].float(), 0.0)
        dx = dx + (contrib.roll(-s, 0) if s else contrib)
    # The first W-1 tokens of document n read initial_state[n, :, j] at tap s = W-1-j+p.
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    dpre_padded = torch.cat([dpre, dpre.new_zeros(1, D)])
    dinit_cols = [dpre.new_zeros(N, D) for _ in range(W - 1)]
    for p in range(W - 1):
        at_p = torch.where((p < lens)[:, None], dpre_padded[(cu[:-1] + p).clamp(max=T)], 0.0)
        for s in range(p + 1, W):
            j = W - 1 - s + p
            dinit_cols[j] = dinit_cols[j] + at_p * weight[:, W - 1 - s].float()
    dinit = torch.stack(dinit_cols, -1) if W > 1 else dpre.new_zeros(N, D, 0)
    return (
        dx.to(x.dtype),
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
            (None: one document per batch row; not allowed with B > 1).
        initial_state: [N, D, W-1], the W-1 inputs before each document.
        activation: None or "silu".
    Returns:
        y with x's shape and dtype.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    batched = x.dim() == 3
    if batched:
        B, T = x.shape[0], x.shape[1]
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens needs a batch of 1 (packed documents), got batch size {B}")
        if cu_seqlens is None:
            cu_seqlens = torch.arange(B + 1, device=x.device, dtype=torch.int32) * T
        x = x.flatten(0, 1)
    elif cu_seqlens is None:
        cu_seqlens = torch.arange(2, device=x.device, dtype=torch.int32) * x.shape[0]
    y = torch.ops.cake.short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, activation == "silu")
    return y.unflatten(0, (B, T)) if batched else y
