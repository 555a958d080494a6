"""Drop-in for flash-linear-attention's ``chunk_gated_delta_rule`` (same argument names,
[B, T, H, K] layout, same returns), running on ``cake::gdn_fwd``.

    from cake_ops import chunk_gated_delta_rule   # instead of fla.ops.gated_delta_rule

Differences: ``deterministic`` (default True), ``save_mode`` (default ``"light"``),
``recompute_output`` (default ``"auto"``), ``reuse_recompute_tapes`` (default None) and
``graph`` (default ``"off"``; see ``cake_ops.gdn``) are extra keywords; ``cu_seqlens_cpu``
is accepted and ignored (cake never reads ``cu_seqlens`` on the host); the deprecated
``head_first=True`` layout is refused.
"""

from __future__ import annotations

import torch

from .ops.gdn import gdn


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    head_first: bool = False,
    deterministic: bool = True,
    save_mode: str = "light",
    recompute_output: str = "auto",
    reuse_recompute_tapes: str | bool | None = None,
    graph: str = "off",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; with ``cu_seqlens``
    B must be 1. Returns (o [B, T, HV, V], final_state [N, HV, K, V] fp32 or None)."""
    if head_first:
        raise ValueError("head_first=True is not supported: pass q, k, v as [B, T, H, D]")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    return gdn(
        q, k, v, g, beta, cu_seqlens,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        deterministic=deterministic,
        save_mode=save_mode,
        recompute_output=recompute_output,
        reuse_recompute_tapes=reuse_recompute_tapes,
        graph=graph,
    )
