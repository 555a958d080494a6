"""The short causal convolution in plain PyTorch: the implementation behind
``cake::short_conv_fwd`` / ``cake::short_conv_bwd`` wherever no CUDA kernel takes a call
(``cake_ops.dispatch``). The math: docs/math.md, Short convolution.

Vectorised over tokens and channels (a loop over the W taps only) and deterministic: the
backward is a gather, never a scatter-add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import token_document


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


def short_conv_fwd(x, weight, bias, cu_seqlens, initial_state, silu):
    """y [T, D] in x's dtype, fp32 accumulation (shapes: cake::short_conv_fwd)."""
    doc, pos = token_document(cu_seqlens, x.shape[0])
    init = initial_state.float() if initial_state is not None else None
    pre = _preactivation(x.float(), weight, bias, doc, pos, init)
    y = F.silu(pre) if silu else pre
    return y.to(x.dtype)


def short_conv_bwd(dy, x, weight, bias, cu_seqlens, initial_state, silu):
    """(dx, dweight, dbias, dinitial_state) as ``cake::short_conv_bwd`` returns them."""
    T, D = x.shape
    W, N = weight.shape[1], cu_seqlens.shape[0] - 1
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
