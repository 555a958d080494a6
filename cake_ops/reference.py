"""FP64 ground truth: the gated delta rule token by token, and the short causal convolution.

Slow on purpose: one token at a time, exactly the recurrence of docs/math.md (The
recurrence), so that every chunked or fused implementation is checked against the
definition and not against another chunked algorithm. Differentiable: the gradients are
the recurrence's exact adjoint, walked back token by token (``_Recurrence``; checked
against autograd through the same loop by tests/pytorch/test_reference.py), so they are
the FP64 reference gradients. Reads ``cu_seqlens`` on the host: it is not an op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gdn_reference", "short_conv_reference", "l2norm"]

# Tokens between the states the forward keeps for its adjoint (the backward walks each
# block's states again from its first): memory T / _BLOCK states, not T.
_BLOCK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _step(S, k, v, a, beta):
    """One token's update of the states S [HV, K, V], a = e^g [HV]: (S1 = a S, u, r = v - S1^T k, S2).
    Batched products over the value heads (bmm, baddbmm: one launch each on a GPU, where the
    loop's small ops are launch-bound)."""
    S1 = S * a[:, None, None]
    r = v - torch.bmm(k[:, None, :], S1)[:, 0]
    u = beta[:, None] * r
    return S1, u, r, torch.baddbmm(S1, k[:, :, None], u[:, None, :])


class _Recurrence(torch.autograd.Function):
    """The recurrence over a pack's documents (bounds: the host's cu_seqlens), FP64, on q
    and k already normalised and repeated per value head ([T, HV, K]). Its backward is
    the exact adjoint of the loop, token by token from each document's end:

        dS2 += scale q do^T;  dq = scale S2 do;  du = dS2^T k;  dk = dS2 u
        dbeta = <du, r>;  dv = beta du;  dS1 = dS2 - k dv^T;  dk -= S1 dv
        dg = <S1, dS1>;  dS = e^g dS1

    where autograd through the loop would fill a [T, HV, K] gradient for each token's
    row of q, k and v (its select's backward): quadratic in T, seconds a long document."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, bounds, scale):
        T, HV, K = q.shape
        V = v.shape[-1]
        a, qs = g.exp(), q * scale
        o = q.new_zeros(T, HV, V)
        finals, kept = [], []
        for n in range(len(bounds) - 1):
            S = initial_state[n] if initial_state is not None else q.new_zeros(HV, K, V)
            for t in range(bounds[n], bounds[n + 1]):
                if (t - bounds[n]) % _BLOCK == 0:
                    kept.append(S)
                S = _step(S, k[t], v[t], a[t], beta[t])[3]
                torch.bmm(qs[t][:, None, :], S, out=o[t][:, None, :])  # o_t = S^T (scale q_t)
            finals.append(S)
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.kept, ctx.bounds, ctx.scale, ctx.with_initial_state = kept, bounds, scale, initial_state is not None
        final = torch.stack(finals) if finals else q.new_zeros(0, HV, K, V)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta = ctx.saved_tensors
        bounds, kept = ctx.bounds, ctx.kept
        HV = q.shape[1]
        a, qs = g.exp(), q * ctx.scale
        # Row-major whatever the inputs' strides: their rows are the products' out= targets.
        dq, dk, dv, dg, dbeta = (x.new_zeros(x.shape) for x in (q, k, v, g, beta))
        dh0 = []
        i = len(kept)
        for n in reversed(range(len(bounds) - 1)):
            dS = dfinal[n]  # (autograd passes zeros for an output without a gradient)
            for s in reversed(range(bounds[n], bounds[n + 1], _BLOCK)):
                i -= 1
                S, states = kept[i], []
                for t in range(s, min(s + _BLOCK, bounds[n + 1])):
                    states.append(_step(S, k[t], v[t], a[t], beta[t]))
                    S = states[-1][3]
                for t in reversed(range(s, min(s + _BLOCK, bounds[n + 1]))):
                    S1, u, r, S2 = states[t - s]
                    dS = torch.baddbmm(dS, qs[t][:, :, None], do[t][:, None, :])
                    torch.bmm(S2, do[t][:, :, None], out=dq[t][:, :, None])  # scaled after the loop
                    du = torch.bmm(k[t][:, None, :], dS)[:, 0]
                    torch.bmm(du[:, None, :], r[:, :, None], out=dbeta[t].view(HV, 1, 1))
                    torch.mul(beta[t][:, None], du, out=dv[t])
                    torch.baddbmm(torch.bmm(dS, u[:, :, None]), S1, dv[t][:, :, None], alpha=-1,
                                  out=dk[t][:, :, None])
                    dS = torch.baddbmm(dS, k[t][:, :, None], dv[t][:, None, :], alpha=-1)
                    torch.bmm(S1.reshape(HV, 1, -1), dS.reshape(HV, -1, 1), out=dg[t].view(HV, 1, 1))
                    dS = dS * a[t][:, None, None]
            dh0.append(dS)
        dq *= ctx.scale
        dinitial = None
        if ctx.with_initial_state:
            dinitial = torch.stack(dh0[::-1]) if dh0 else q.new_zeros(0, q.shape[1], q.shape[2], v.shape[2])
        return dq, dk, dv, dg, dbeta, dinitial, None, None


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

    q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV]; cu_seqlens: [N+1], from 0 to T;
    initial_state: [N, HV, K, V]. Returns (o [T, HV, V], final_state [N, HV, K, V]),
    both float64. Per value head hv (q/k head hv // (HV // H)), per document:
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).
    """
    T, H, K = q.shape
    G = v.shape[1] // H
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    bounds = [0, T] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to T = {T}, non-decreasing, got {bounds}")
    return _Recurrence.apply(q.repeat_interleave(G, dim=1), k.repeat_interleave(G, dim=1), v, g, beta,
                             None if initial_state is None else initial_state.double(), bounds, scale)


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
        # y[t] = sum_i weight[:, i] * padded[t + i]: the W taps over all of the document's
        # tokens at once (a per-token window's backward filled the whole padded rows each).
        L = doc.shape[0]
        y_doc = x.new_zeros(L, D)
        for i in range(W):
            y_doc = y_doc + padded[i : i + L] * weight[:, i]
        ys.append(y_doc)
    y = torch.cat(ys) if ys else x.new_zeros(0, D)
    if bias is not None:
        y = y + bias.double()
    if activation == "silu":
        y = F.silu(y)
    return y
