"""The GDN ops ``cake::gdn_fwd`` / ``cake::gdn_bwd`` and the user entry point ``gdn``.

The ops work in the packed layout (q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV];
``cu_seqlens`` [N+1] on the device). ``cake::gdn_fwd`` carries the autograd formula, so
a compiled model can call ``torch.ops.cake.gdn_fwd`` directly. Which implementation
runs a call is decided by ``cake_ops.dispatch`` (the CUDA kernels of ``csrc/gdn/`` on
Hopper for K = V = 128 and bf16 q/k/v, forward and backward, else the chunked
PyTorch algorithm of ``cake_ops.pytorch.gdn``). Fake kernels: ``meta/gdn.py``. The math: docs/math.md.
"""

from __future__ import annotations

import warnings

import torch

from .. import dispatch
from ..checks import check_cu_seqlens_values, check_gdn, check_gdn_grads, check_scale
from ..pytorch import gdn as pytorch_gdn
from ..varlen import to_packed

_warned_nondeterministic = False


def effective_deterministic(deterministic: bool) -> bool:
    """``torch.use_deterministic_algorithms(True)`` overrides ``deterministic=False``."""
    global _warned_nondeterministic
    if deterministic or not torch.are_deterministic_algorithms_enabled():
        return deterministic
    if not _warned_nondeterministic:
        _warned_nondeterministic = True
        warnings.warn(
            "cake_ops: deterministic=False was asked for while torch.use_deterministic_algorithms(True) "
            "is set; running the deterministic variant.",
            stacklevel=3,
        )
    return True


@torch.library.custom_op("cake::gdn_fwd", mutates_args=())
def gdn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked GDN forward over packed documents.

    Returns (o [T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32). The final state
    is always produced (it is small); ``cake_ops.gdn`` drops it unless asked.
    """
    return _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)


def _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    T = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)[0]
    check_scale(scale)
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    return pytorch_gdn.gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@gdn_fwd.register_kernel("cuda")
def _gdn_fwd_cuda(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_scale(scale)
    if dispatch.gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_fwd_pytorch(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)
    deterministic = effective_deterministic(deterministic)
    from .. import build

    # The kernels' first stage checks cu_seqlens's values itself (csrc/gdn/plan.cu).
    return build.load().gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)


@torch.library.custom_op("cake::gdn_bwd", mutates_args=())
def gdn_bwd(
    do: torch.Tensor,
    dht: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked GDN backward: recomputes the forward's tapes from the inputs (the light
    save mode: nothing but the inputs is saved), walks dS back, then the chunk-local
    gradients.

    Returns (dq, dk, dv, dg, dbeta, dh0) with the dtypes of (q, k, v, g, beta) and
    dh0 [N, HV, K, V] fp32 (the gradient of the initial state, zero or not).
    """
    args = (do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)
    return _gdn_bwd_pytorch(*args)


def _check_gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale) -> int:
    """The backward's static checks; returns T."""
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_scale(scale)
    return T


def _gdn_bwd_pytorch(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    T = _check_gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale)
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    return pytorch_gdn.gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@gdn_bwd.register_kernel("cuda")
def _gdn_bwd_cuda(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    _check_gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale)
    if dispatch.gdn_bwd_cuda_refusal(do, dht, q, k, v, g, beta, cu_seqlens, scale) is not None:
        return _gdn_bwd_pytorch(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                deterministic)
    deterministic = effective_deterministic(deterministic)
    from .. import build

    # Recomputes the forward's tapes with the forward's own plan (its first kernel checks
    # cu_seqlens's values), then walks dS back and forms the chunk-local gradients.
    return build.load().gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm,
                                deterministic)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic = inputs
    # Light save mode: inputs only; the backward recomputes the chunk tensors and the walk.
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state)
    ctx.args = (scale, use_qk_l2norm, deterministic)


def _backward(ctx, do, dht):
    q, k, v, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.cake.gdn_bwd(
        do, dht, q, k, v, g, beta, cu_seqlens, initial_state, *ctx.args
    )
    return dq, dk, dv, dg, dbeta, None, dh0 if initial_state is not None else None, None, None, None


gdn_fwd.register_autograd(_backward, setup_context=_setup_context)


def gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet (chunked, differentiable) over packed variable-length documents.

    Args:
        q, k: [T, H, K] (packed) or [B, T, H, K]; bf16 (fp16/fp32 also accepted).
        v: [T, HV, V] or [B, T, HV, V], HV a multiple of H (GVA).
        g: [T, HV] / [B, T, HV] fp32 log decay (<= 0; -inf is a full reset).
        beta: same shape, fp32 or q's dtype.
        cu_seqlens: [N+1] int32/int64 tensor of document boundaries on q's device; None
            means one document per batch row. Not allowed with B > 1.
        scale: a finite float; defaults to K ** -0.5.
        initial_state: [N, HV, K, V] fp32 (N = documents, or B).
        output_final_state: return the final state [N, HV, K, V] fp32.
        use_qk_l2norm: L2-normalise q and k inside the op (with its backward).
        deterministic: bitwise reproducible (default). False allows faster plans.
    Returns:
        (o in v's layout and dtype, final_state or None).
    """
    q, packed, cu_seqlens, batch = to_packed(
        "q", q, 3, cu_seqlens, {"k": (k, 3), "v": (v, 3), "g": (g, 2), "beta": (beta, 2)}
    )
    check_gdn(q, packed["k"], packed["v"], packed["g"], packed["beta"], cu_seqlens, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    check_scale(scale)
    o, final_state = torch.ops.cake.gdn_fwd(
        q, packed["k"], packed["v"], packed["g"], packed["beta"], cu_seqlens, initial_state, float(scale),
        use_qk_l2norm, deterministic,
    )
    if batch is not None:
        o = o.unflatten(0, batch)
    return o, (final_state if output_final_state else None)
