"""Which implementation runs a ``cake::`` op: the one rule per op and direction.

Each ``*_cuda_refusal`` function answers for one op and direction whether its CUDA
kernel takes a call: ``None`` when it does, else the reason (a sentence), and the op
then runs its PyTorch implementation on the same device. The CUDA bindings
(``csrc/<family>/binding.cpp``) check the same conditions with ``TORCH_CHECK``, so a
call that reaches a kernel is one this rule accepted. ``tests/op`` holds each rule
condition by condition; ``tests/cuda`` holds the forward's conditions against the
binding (``test_gdn_fwd_cuda.py::test_dispatch_rule_and_binding_agree``) and runs the
backward's refused calls.

``pytorch_implementation()`` forces the PyTorch implementation of every ``cake::`` op
on every device (for comparisons against the kernels).
"""

from __future__ import annotations

import contextlib
import math

import torch

from .pytorch.gdn import CHUNK

# The GDN kernels' head dim (K = V), and their 32-bit coordinate limits: token rows
# (T < 2^31 - 64) and (chunk slot, value head) tiles ((ceil(T / 64) + N) * HV < 2^31),
# row strides HV * 128 as 32-bit values (HV < 2^24). Mirrors csrc/gdn/binding.cpp.
GDN_CUDA_HEAD_DIM = 128
_INT31 = 1 << 31

_use_pytorch = False


@contextlib.contextmanager
def pytorch_implementation():
    """Run every ``cake::`` op on its PyTorch implementation, on every device.

    Not thread-safe; cover forward and backward with it (the backward of a forward
    that ran inside it runs on whatever the rule picks when it runs)."""
    global _use_pytorch
    previous, _use_pytorch = _use_pytorch, True
    try:
        yield
    finally:
        _use_pytorch = previous


def _kernels_unavailable() -> str | None:
    if _use_pytorch:
        return "cake_ops.pytorch_implementation() is active"
    from . import build  # imported here so that `python -m cake_ops.build` runs cleanly

    return None if build.available() else build.unavailable_reason()


def gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale: float) -> str | None:
    """None when the CUDA GDN forward (csrc/gdn) takes this call (inputs already
    validated by ``checks.check_gdn``), else why not."""
    why = _kernels_unavailable()
    if why is not None:
        return why
    if q.dtype != torch.bfloat16:  # k and v have q's dtype (checks.check_gdn)
        return f"the CUDA kernels take bf16 q, k, v, got {q.dtype}"
    K, V = q.shape[-1], v.shape[-1]
    if (K, V) != (GDN_CUDA_HEAD_DIM, GDN_CUDA_HEAD_DIM):
        return f"the CUDA kernels take head dims K = V = {GDN_CUDA_HEAD_DIM}, got K = {K}, V = {V}"
    # The kernels fold log2(scale) into their exponents.
    if not (math.isfinite(scale) and scale > 0):
        return f"the CUDA kernels take a finite scale > 0, got {scale}"
    T, HV, N = q.shape[0], v.shape[1], cu_seqlens.shape[0] - 1
    slots = -(-T // CHUNK) + N  # chunk slots: ceil(T / 64) + N
    if HV >= 1 << 24 or T >= _INT31 - CHUNK or slots * HV >= _INT31:
        return f"T = {T}, N = {N}, HV = {HV} exceed the CUDA kernels' 32-bit coordinates"
    return None


def gdn_bwd_cuda_refusal(do, dht, q, k, v, g, beta, cu_seqlens, scale: float) -> str | None:
    """None when the CUDA GDN backward (csrc/gdn) takes this call (inputs validated by
    ``checks.check_gdn`` and ``check_gdn_grads``), else why not: the forward's rule and
    the gradients in the dtypes autograd passes them (do as o: bf16; dht fp32)."""
    why = gdn_fwd_cuda_refusal(q, k, v, g, beta, cu_seqlens, scale)
    if why is not None:
        return why
    if do.dtype != torch.bfloat16:
        return f"the CUDA backward takes the gradient of o in bf16 (o's dtype), got {do.dtype}"
    if dht is not None and dht.dtype != torch.float32:
        return f"the CUDA backward takes the gradient of the final state in fp32, got {dht.dtype}"
    return None


def gdn_state_chain_cuda_refusal(state) -> str | None:
    """None when the CUDA chain kernels take a ``cake::gdn_state_chain`` or
    ``gdn_state_grad_chain`` call (operands validated by ``checks.check_state_chain``:
    fp32, one device), else why not: the GDN kernels' head dim, K = V = 128."""
    why = _kernels_unavailable()
    if why is not None:
        return why
    K, V = state.shape[-2], state.shape[-1]
    if (K, V) != (GDN_CUDA_HEAD_DIM, GDN_CUDA_HEAD_DIM):
        return f"the CUDA chain kernels take states of K = V = {GDN_CUDA_HEAD_DIM}, got K = {K}, V = {V}"
    return None


def short_conv_fwd_cuda_refusal(x) -> str | None:
    """None when the CUDA short-convolution forward (csrc/short_conv) takes this call
    (inputs validated by ``checks.check_short_conv``; it takes every dtype and width the
    op does), else why not."""
    return _kernels_unavailable()


def short_conv_bwd_cuda_refusal(dy, x) -> str | None:
    """None when the CUDA short-convolution backward (csrc/short_conv) takes this call
    (inputs validated by ``checks.check_short_conv``; it takes every dtype and width the
    op does, as the forward), else why not. ``dy`` is the gradient of y: the kernel takes
    it in y's shape and dtype, on x's device, as autograd passes it."""
    why = _kernels_unavailable()
    if why is not None:
        return why
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        return (f"the CUDA backward takes dy as x: {tuple(x.shape)} {x.dtype} on {x.device}, got "
                f"{tuple(dy.shape)} {dy.dtype} on {dy.device}")
    return None
