"""A Gated DeltaNet layer (Qwen3-Next style) built on the ``cake::`` ops, for examples
and tests: q/k/v projections, the short causal convolution (SiLU) over the packed q/k/v
channels, the gate ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``,
GDN with in-op q/k L2 norm, a gated RMSNorm ``rmsnorm(o) * silu(z)`` and the output
projection. With a ``KcpContext`` it runs context parallel: the convolution and GDN by
``short_conv_kcp`` and ``gdn_kcp``, everything else per token on this rank's rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .kcp import KcpContext, gdn_kcp, short_conv_kcp
from .ops.gdn import gdn
from .ops.short_conv import short_conv


class GatedDeltaNet(nn.Module):
    """x: [B, T, hidden] (or [1, T, hidden] with ``cu_seqlens`` for packed documents; or
    with ``kcp``, this rank's rows of a global packed row)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_v_heads: int | None = None,
        head_k_dim: int = 128,
        head_v_dim: int = 128,
        conv_size: int = 4,
        norm_eps: float = 1e-6,
        deterministic: bool = True,
        save_mode: str = "light",
    ):
        super().__init__()
        H, HV = num_heads, num_v_heads or num_heads
        if HV % H:
            raise ValueError(f"num_v_heads = {HV} must be a multiple of num_heads = {H}")
        self.H, self.HV, self.K, self.V = H, HV, head_k_dim, head_v_dim
        self.norm_eps = norm_eps
        self.deterministic = deterministic
        self.save_mode = save_mode  # cake_ops.gdn's
        self.q_proj = nn.Linear(hidden_size, H * head_k_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, H * head_k_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, HV * head_v_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, HV, bias=False)
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        self.z_proj = nn.Linear(hidden_size, HV * head_v_dim, bias=False)
        conv_dim = 2 * H * head_k_dim + HV * head_v_dim
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, conv_size))
        # Decay rates exp(A_log) in [1, 16] and time steps softplus(dt_bias) in [1e-3, 0.1]
        # (Mamba-2 / Qwen3-Next initialisation).
        self.A_log = nn.Parameter(torch.empty(HV))
        self.dt_bias = nn.Parameter(torch.empty(HV))
        self.o_norm_weight = nn.Parameter(torch.ones(head_v_dim))
        self.o_proj = nn.Linear(HV * head_v_dim, hidden_size, bias=False)
        self.reset_gdn_parameters()

    @torch.no_grad()
    def reset_gdn_parameters(self) -> None:
        nn.init.uniform_(self.conv_weight, -1 / math.sqrt(self.conv_weight.shape[1]), 1 / math.sqrt(self.conv_weight.shape[1]))
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                kcp: KcpContext | None = None) -> torch.Tensor:
        """``kcp``: context parallel over its group (a collective: every rank calls it). x is
        then [1, T_r, hidden], this rank's rows of the global packed row (``kcp.shard``),
        whose documents the context holds (``cu_seqlens`` None). The parameters are
        replicated and their gradients are this rank's part: sum them over the group (an
        all-reduce) before the optimizer step, as data parallel does."""
        if kcp is not None and (cu_seqlens is not None or x.dim() != 3 or x.shape[0] != 1):
            raise ValueError(f"with kcp, x must be [1, T_r, hidden] (this rank's rows) and cu_seqlens None (the "
                             f"context holds the documents), got x of shape {tuple(x.shape)} and cu_seqlens "
                             f"{'None' if cu_seqlens is None else 'given'}")
        H, HV, K, V = self.H, self.HV, self.K, self.V
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        weight = self.conv_weight.to(qkv.dtype)
        if kcp is None:
            qkv = short_conv(qkv, weight, None, cu_seqlens, activation="silu")
        else:
            qkv = short_conv_kcp(qkv[0], weight, None, kcp, activation="silu")[None]
        q, k, v = qkv.split([H * K, H * K, HV * V], -1)
        q, k, v = q.unflatten(-1, (H, K)), k.unflatten(-1, (H, K)), v.unflatten(-1, (HV, V))
        beta = self.b_proj(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        opts = dict(use_qk_l2norm=True, deterministic=self.deterministic, save_mode=self.save_mode)
        if kcp is None:
            o, _ = gdn(q.contiguous(), k.contiguous(), v.contiguous(), g, beta.to(q.dtype), cu_seqlens, **opts)
        else:
            o, _ = gdn_kcp(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), g[0], beta[0].to(q.dtype), kcp,
                           **opts)
            o = o[None]
        z = self.z_proj(x).unflatten(-1, (HV, V))
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight.float()
        o = (of * F.silu(z.float())).to(x.dtype)
        return self.o_proj(o.flatten(-2))
