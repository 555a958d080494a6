"""FP64 ground truth: the gated delta rule token by token, and the short causal convolution.

Slow on purpose: one token at a time, exactly the recurrence of docs/math.md (The
recurrence), so that every chunked or fused implementation is checked against the
definition and not against another chunked algorithm. Differentiable with plain autograd (FP64 gradients
are the reference gradients). Reads ``cu_seqlens`` on the host: it is not an op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gdn_reference", "short_conv_reference", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule in FP64.

    q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV]; cu_seqlens: [N+1];
    initial_state: [N, HV, K, V]. Returns (o [T, HV, V], final_state [N, HV, K, V]),
    both float64. Per value head hv (q/k head hv // (HV // H)), per document:
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // H
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(G, dim=1)  # [T, HV, K]
    k = k.repeat_interleave(G, dim=1)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    bounds = cu_seqlens.tolist()
    N = len(bounds) - 1
    outs, finals = [], []
    for n in range(N):
        if initial_state is not None:
            S = initial_state[n].double()
        else:
            S = q.new_zeros(HV, K, V)
        for t in range(bounds[n], bounds[n + 1]):
            S = S * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]) * scale)
        finals.append(S)
    o = torch.stack(outs) if outs else q.new_zeros(0, HV, V)
    return o, torch.stack(finals)


def short_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution per document in FP64.

    x: [T, D]; weight: [D, W]; bias: [D]; initial_state: [N, D, W-1] holding the W-1
    inputs before each document (last column = the token just before). Returns
    y [T, D] float64, y[t] = act(bias + sum_i weight[:, i] * x[t - (W-1) + i]).
    """
    T, D = x.shape
    W = weight.shape[1]
    x, weight = x.double(), weight.double()
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    bounds = cu_seqlens.tolist()
    ys = []
    for n in range(len(bounds) - 1):
        doc = x[bounds[n] : bounds[n + 1]]  # [L, D]
        if initial_state is not None:
            before = initial_state[n].double().transpose(0, 1)  # [W-1, D]
        else:
            before = x.new_zeros(W - 1, D)
        padded = torch.cat([before, doc], 0)
        for t in range(doc.shape[0]):
            window = padded[t : t + W]  # [W, D], oldest first
            ys.append((window.transpose(0, 1) * weight).sum(-1))
    y = torch.stack(ys) if ys else x.new_zeros(0, D)
    if bias is not None:
        y = y + bias.double()
    if activation == "silu":
        y = F.silu(y)
    return y
