"""Drop-in for flash-linear-attention's ``chunk_gated_delta_rule`` (FLA 0.6.0's argument
names, [B, T, H, K] layout, same returns), and for FlashQLA's of the same name, running on
``cake::gdn_fwd``.

    from cake_ops import chunk_gated_delta_rule   # instead of fla.ops.gated_delta_rule

Positional are the nine parameters FLA 0.6.0 and FlashQLA 0.1.3 both take in that order
(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel); the
two order the rest differently (FLA's tenth is use_beta_sigmoid_in_kernel, FlashQLA's
cu_seqlens), so the rest are keyword-only here: a tenth positional argument is an error,
not a guess.

FLA's options that act on the inputs and the state run here as PyTorch ops around the op,
with their autograd, so they trace into a compiled graph as the op does:

- ``use_gate_in_kernel=True`` with ``A_log`` [HV] (and ``dt_bias`` [HV]): ``g`` is the raw
  gate input, and the log decay is ``-exp(A_log) * softplus(g + dt_bias)`` in fp32, with
  the gradients of ``g``, ``A_log`` and ``dt_bias``;
- ``use_beta_sigmoid_in_kernel=True``: ``beta`` holds logits, the op takes
  ``sigmoid(beta)`` in fp32, twice that with ``allow_neg_eigval=True``;
- ``state_v_first=True`` (or the deprecated ``transpose_state_layout``): the initial and
  final states are [N, HV, V, K];
- ``g`` in bf16 or fp16 (FLA cumsums it in fp32): taken as fp32.

``chunk_size`` (16, 32 or 64) is accepted and does not change the result: the op's
chunking is its own, and the math is the same for any. ``cu_seqlens_cpu`` and
``chunk_indices`` are accepted and ignored (cake never reads ``cu_seqlens`` on the host and
plans its own chunks), as are FlashQLA's ``auto_cp``, ``enable_fwd_cp_cache`` and
``force_intra_cp`` (cake cuts long documents by its own plan). ``cp_context``: context
parallel as FLA's call takes it (q, k, v, g, beta this rank's rows, [1, T_r, ...], no
``cu_seqlens``), with cake's context (``cake_ops.kcp.build_context_kcp`` in place of
``fla.ops.cp.build_cp_context``): the call runs ``gdn_kcp``, the input options as above;
FLA's or FlashQLA's own context objects are refused, as is ``head_first=True``. Cake's own keywords: ``deterministic`` (default True), ``save_mode`` (default
``"light"``), ``recompute_output`` (default ``"auto"``), ``reuse_recompute_tapes`` (default
None) and ``graph`` (default ``"off"``); see ``cake_ops.gdn``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .kcp import KcpContext, gdn_kcp
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
    *,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = 64,
    head_first: bool = False,
    transpose_state_layout: bool | None = None,
    auto_cp: bool = True,
    enable_fwd_cp_cache: bool = True,
    force_intra_cp: bool = False,
    deterministic: bool = True,
    save_mode: str = "light",
    recompute_output: str = "auto",
    reuse_recompute_tapes: str | bool | None = None,
    graph: str = "off",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; with ``cu_seqlens``
    B must be 1. Returns (o [B, T, HV, V], final_state [N, HV, K, V] fp32 ([N, HV, V, K]
    with ``state_v_first``) or None)."""
    if transpose_state_layout is not None:  # FLA's deprecated name of state_v_first
        if state_v_first:
            raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: pass state_v_first", DeprecationWarning, stacklevel=2)
        state_v_first = bool(transpose_state_layout)
    if head_first:
        raise ValueError("head_first=True is not supported: pass q, k, v as [B, T, H, D]")
    if cp_context is not None:
        if not isinstance(cp_context, KcpContext):
            raise ValueError(f"cp_context must be cake's context parallel context (cake_ops.kcp.build_context_kcp), "
                             f"got {type(cp_context).__name__}: FLA's and FlashQLA's are not supported")
        if cu_seqlens is not None or q.dim() != 4 or q.shape[0] != 1:
            raise ValueError("with cp_context, q, k, v, g, beta are this rank's rows, [1, T_r, ...], and cu_seqlens "
                             "is None (the context holds the documents)")
        if (recompute_output, reuse_recompute_tapes, graph) != ("auto", None, "off"):
            raise ValueError("with cp_context, recompute_output, reuse_recompute_tapes and graph keep their defaults "
                             "(gdn_kcp's walks take save_mode; graph replay is build_context_kcp's graph_replay)")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, HV, V], got shape {tuple(v.shape)}")
    HV = v.shape[2]
    if use_gate_in_kernel:
        # Checked here, not only by the op: a g of the wrong shape would broadcast against dt_bias.
        if g.shape != v.shape[:3]:
            raise ValueError(f"g must be [B, T, HV] = {tuple(v.shape[:3])}, got shape {tuple(g.shape)}")
        if A_log is None:
            raise ValueError("A_log must be given with use_gate_in_kernel=True")
        if A_log.numel() != HV:
            raise ValueError(f"A_log must have HV = {HV} elements, got shape {tuple(A_log.shape)}")
        if dt_bias is not None and dt_bias.numel() != HV:
            raise ValueError(f"dt_bias must have HV = {HV} elements, got shape {tuple(dt_bias.shape)}")
        x = g.float() if dt_bias is None else g.float() + dt_bias.float().reshape(HV)
        g = -A_log.float().reshape(HV).exp() * F.softplus(x)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are used only with use_gate_in_kernel=True")
    else:
        g = g.float()  # FLA takes g in any float dtype and cumsums it in fp32; the op takes fp32
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    elif allow_neg_eigval:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True")
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).contiguous()
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm=use_qk_l2norm_in_kernel, deterministic=deterministic, save_mode=save_mode)
    if cp_context is not None:
        o, final_state = gdn_kcp(q[0], k[0], v[0], g[0], beta[0], cp_context, **common)
        o = o[None]
    else:
        o, final_state = gdn(q, k, v, g, beta, cu_seqlens, recompute_output=recompute_output,
                             reuse_recompute_tapes=reuse_recompute_tapes, graph=graph, **common)
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state
