"""The GDN ops ``cake::gdn_fwd`` / ``cake::gdn_bwd`` and the user entry point ``gdn``.

The ops work in the packed layout (q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV];
``cu_seqlens`` [N+1] on the device). ``cake::gdn_fwd`` carries the autograd formula, so
a compiled model can call ``torch.ops.cake.gdn_fwd`` directly. Implementation: the
chunked PyTorch algorithm of ``cake_ops.chunked`` on every device until a CUDA kernel is
registered for a stage: on Hopper the forward runs the CUDA kernels of ``csrc/gdn_fwd*``
(K = V = 128, bf16 q/k/v; other cases fall back to PyTorch); the backward is PyTorch
for now. Fake kernels: ``meta/gdn.py``.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from . import chunked
from .checks import check_cu_seqlens_values, check_gdn, check_gdn_grads

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
    T = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)[0]
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)  # the PyTorch path is deterministic either way
    return chunked.gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


@gdn_fwd.register_kernel("cuda")
def _gdn_fwd_cuda(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic):
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    deterministic = effective_deterministic(deterministic)
    from . import build  # imported here so that `python -m cake_ops.build` runs cleanly

    # The kernels fold log2(scale) into the gate exponents, so they take scale > 0.
    if _use_pytorch or not build.available() or (K, V) != (128, 128) or q.dtype != torch.bfloat16 or scale <= 0:
        check_cu_seqlens_values(cu_seqlens, T)
        return chunked.gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)
    # The kernels' first stage checks cu_seqlens's values itself (gdn_fwd_plan.cu).
    return build.load().gdn_fwd(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, deterministic)


_use_pytorch = False


@contextlib.contextmanager
def pytorch_implementation():
    """Run the cake:: GDN ops on their PyTorch implementation on every device, e.g. to
    compare against the kernels. Not thread-safe; cover forward and backward with it."""
    global _use_pytorch
    previous, _use_pytorch = _use_pytorch, True
    try:
        yield
    finally:
        _use_pytorch = previous


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
    """Chunked GDN backward: recomputes the forward from the inputs, then walks dS back.

    Returns (dq, dk, dv, dg, dbeta, dh0) with the dtypes of (q, k, v, g, beta) and
    dh0 [N, HV, K, V] fp32 (the gradient of the initial state, zero or not).
    """
    T, H, K, HV, V, N = check_gdn(q, k, v, g, beta, cu_seqlens, initial_state)
    check_gdn_grads(do, dht, T, HV, V, N, K)
    check_cu_seqlens_values(cu_seqlens, T)
    effective_deterministic(deterministic)
    return chunked.gdn_bwd(do, dht, q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm)


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
        g: [T, HV] / [B, T, HV] fp32 log decay (<= 0). beta: same shape, fp32 or q's dtype.
        cu_seqlens: [N+1] int32/int64 document boundaries on q's device; None means
            one document per batch row. Not allowed with B > 1.
        scale: defaults to K ** -0.5.
        initial_state: [N, HV, K, V] fp32 (N = documents, or B).
        output_final_state: return the final state [N, HV, K, V] fp32.
        use_qk_l2norm: L2-normalise q and k inside the op (with its backward).
        deterministic: bitwise reproducible (default). False allows faster plans.
    Returns:
        (o in v's layout and dtype, final_state or None).
    """
    batched = q.dim() == 4
    if batched:
        B, T = q.shape[0], q.shape[1]
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens needs a batch of 1 (packed documents), got batch size {B}")
        for name, x, rank in (("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
            if x.dim() != rank or x.shape[0] != B:
                raise ValueError(f"{name} must be [B, T, ...] with B = {B} like q, got shape {tuple(x.shape)}")
        if cu_seqlens is None:
            cu_seqlens = torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
        q, k, v, g, beta = (x.flatten(0, 1) for x in (q, k, v, g, beta))
    elif cu_seqlens is None:
        cu_seqlens = torch.arange(2, device=q.device, dtype=torch.int32) * q.shape[0]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state = torch.ops.cake.gdn_fwd(
        q, k, v, g, beta, cu_seqlens, initial_state, float(scale), use_qk_l2norm, deterministic
    )
    if batched:
        o = o.unflatten(0, (B, T))
    return o, (final_state if output_final_state else None)
