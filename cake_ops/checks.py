"""Input validation shared by the ops, their fake kernels and the user API.

Static checks (dtype, device, rank, shape) run on real and fake tensors alike, so a
bad call fails with a ValueError/TypeError naming the argument before any kernel runs,
also while torch.compile traces. Checks on the *values* of ``cu_seqlens`` run eagerly
on CPU tensors and as a device-side assert on CUDA (no host sync).
"""

from __future__ import annotations

import math

import torch

QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(cls, msg: str):
    raise cls(msg)


def _check_dtype(name: str, x: torch.Tensor, allowed) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        _fail(TypeError, f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")


def _check_shape(name: str, x: torch.Tensor, expected: tuple, what: str) -> None:
    if x.dim() != len(expected) or any(a != b for a, b in zip(x.shape, expected)):
        _fail(ValueError, f"{name} must have shape {what} = {tuple(expected)}, got {tuple(x.shape)}")


def _check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        _fail(ValueError, f"{name} must be on {device} (the device of the first input), got {x.device}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> int:
    """Static checks of cu_seqlens; returns N, the number of documents."""
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(TypeError, f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    _check_dtype("cu_seqlens", cu_seqlens, INDEX_DTYPES)
    _check_device("cu_seqlens", cu_seqlens, device)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        _fail(ValueError, f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens.shape[0] - 1


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int) -> None:
    """cu_seqlens starts at 0, never decreases and ends at T.

    CPU: checked eagerly (ValueError). CUDA: a device-side assert, so there is no
    host sync and CUDA-graph capture still works; a violation surfaces as a CUDA
    error carrying this message. Fake tensors have no values: nothing to check.
    """
    if cu_seqlens.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(cu_seqlens):
        return
    c = cu_seqlens.long()
    ok = (c[0] == 0) & (c[-1] == T) & (c[1:] >= c[:-1]).all()
    msg = f"cu_seqlens must start at 0, be non-decreasing and end at T = {T}"
    if c.device.type == "cpu":
        if not bool(ok):
            _fail(ValueError, f"{msg}, got {cu_seqlens.tolist()}")
    else:
        torch._assert_async(ok, msg)


def check_gdn(q, k, v, g, beta, cu_seqlens, initial_state, v_name: str = "v"):
    """Validates a GDN call in the packed layout; returns (T, H, K, HV, V, N). ``v_name``:
    what the errors call ``v`` (an op that takes do in its place: do has v's shape)."""
    for name, x in (("q", q), ("k", k), (v_name, v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            _fail(TypeError, f"{name} must be a tensor, got {type(x).__name__}")
    device = q.device
    if q.dim() != 3:
        _fail(ValueError, f"q must be [T, H, K] (packed), got shape {tuple(q.shape)}")
    T, H, K = q.shape
    _check_dtype("q", q, QKV_DTYPES)
    for name, x in (("k", k), (v_name, v)):
        _check_device(name, x, device)
        if x.dtype != q.dtype:
            _fail(TypeError, f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    _check_shape("k", k, (T, H, K), "[T, H, K]")
    if v.dim() != 3 or v.shape[0] != T:
        _fail(ValueError, f"{v_name} must be [T, HV, V] with T = {T}, got shape {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    if H == 0 or HV % H != 0:
        _fail(ValueError, f"the value heads HV = {HV} ({v_name}.shape[1]) must be a multiple of the q/k heads H = {H}")
    if K == 0 or V == 0:
        _fail(ValueError, f"the head dims K = q.shape[-1] and V = {v_name}.shape[-1] must be positive, got K = {K}, "
              f"V = {V}")
    _check_device("g", g, device)
    _check_dtype("g", g, (torch.float32,))
    _check_shape("g", g, (T, HV), "[T, HV]")
    _check_device("beta", beta, device)
    _check_dtype("beta", beta, (torch.float32, q.dtype))
    _check_shape("beta", beta, (T, HV), "[T, HV]")
    N = check_cu_seqlens(cu_seqlens, device)
    if initial_state is not None:
        _check_device("initial_state", initial_state, device)
        _check_dtype("initial_state", initial_state, (torch.float32,))
        _check_shape("initial_state", initial_state, (N, HV, K, V), "[N, HV, K, V]")
    return T, H, K, HV, V, N


def default_scale(K):
    """K ** -0.5, the output scale's default: finite for any head dim, so not checked (under
    ``torch.compile(dynamic=True)`` K, and so the scale, is symbolic, which
    ``math.isfinite`` cannot take)."""
    return K ** -0.5


def check_scale(scale) -> None:
    """The output scale: a finite real number (the default K**-0.5 is set by the caller)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail(TypeError, f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        _fail(ValueError, f"scale must be finite, got {scale}")


MAX_SEGMENT_CHUNKS = 1 << 20  # the binding's bound (csrc/gdn/binding.cpp)


def check_segment_chunks(segment_chunks) -> None:
    """The cut grid of a call's CUDA walks: -1 (the plan's choice), 0 (uncut) or a grid in
    64-token chunks (the PyTorch path, which walks uncut, checks it too)."""
    if isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int):
        _fail(TypeError, f"segment_chunks must be an int, got {type(segment_chunks).__name__}")
    if not -1 <= segment_chunks <= MAX_SEGMENT_CHUNKS:
        _fail(ValueError, f"segment_chunks must be -1 (the plan's choice), 0 (uncut) or a cut grid of 1 .. "
                          f"{MAX_SEGMENT_CHUNKS} chunks, got {segment_chunks}")


def check_piece_flags(doc_flags, N: int, device: torch.device) -> None:
    """check_doc_flags for the segment summaries ops, which require the flags (every
    document a piece inside a longer one: its values are the kernels' to assert)."""
    if doc_flags is None:
        _fail(ValueError, "doc_flags must be given: every document flagged to open and close inside (1 | 2, with its "
                          "grid class), at most one segment of its cut grid")
    check_doc_flags(doc_flags, N, device)


def check_doc_flags(doc_flags, N: int, device: torch.device) -> None:
    """Per-document flags of a call's plan (csrc/gdn/gdn.h ``doc_flags``): uint8 [N] on
    the inputs' device, or None."""
    if doc_flags is None:
        return
    _check_dtype("doc_flags", doc_flags, (torch.uint8,))
    _check_shape("doc_flags", doc_flags, (N,), "[N]")
    _check_device("doc_flags", doc_flags, device)


def check_state_chain(values, transfers, state, seg_cu) -> None:
    """A state chain's operands (``cake::gdn_state_chain``, ``gdn_state_grad_chain``): per
    segment values [R, HV, K, V] and transfers [R, HV, K, K], per document the state it
    enters from [N, HV, K, V], fp32, and seg_cu int32 [N + 1] (its segments' rows, from 0
    to R, non-decreasing: not read on the host), all on one device."""
    for name, t in (("values", values), ("transfers", transfers), ("state", state), ("seg_cu", seg_cu)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a tensor, got {type(t).__name__}")
    if state.dim() != 4:
        _fail(ValueError, f"state must be [N, HV, K, V], got shape {tuple(state.shape)}")
    N, HV, K, V = state.shape
    R = values.shape[0] if values.dim() else -1
    _check_shape("values", values, (R, HV, K, V), "[R, HV, K, V]")
    _check_shape("transfers", transfers, (R, HV, K, K), "[R, HV, K, K]")
    _check_shape("seg_cu", seg_cu, (N + 1,), "[N + 1]")
    for name, t in (("values", values), ("transfers", transfers), ("state", state)):
        _check_dtype(name, t, (torch.float32,))
        _check_device(name, t, state.device)
    _check_dtype("seg_cu", seg_cu, (torch.int32,))
    _check_device("seg_cu", seg_cu, state.device)


def check_gdn_grads(do, dht, T, HV, V, N, K):
    _check_shape("grad of o", do, (T, HV, V), "[T, HV, V]")
    if dht is not None:
        _check_shape("grad of final_state", dht, (N, HV, K, V), "[N, HV, K, V]")


def check_short_conv(x, weight, bias, cu_seqlens, initial_state):
    """Validates a short-convolution call in the packed layout; returns (T, D, W, N)."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 2:
        _fail(ValueError, f"x must be [T, D] (packed), got shape {tuple(x.shape)}")
    T, D = x.shape
    device = x.device
    _check_dtype("x", x, QKV_DTYPES)
    _check_device("weight", weight, device)
    _check_dtype("weight", weight, QKV_DTYPES)
    if weight.dim() != 2 or weight.shape[0] != D:
        _fail(ValueError, f"weight must be [D, W] with D = {D}, got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if not 1 <= W <= 4:
        _fail(ValueError, f"the convolution width W = weight.shape[1] must be in 1..4, got {W}")
    if bias is not None:
        _check_device("bias", bias, device)
        _check_dtype("bias", bias, QKV_DTYPES)
        _check_shape("bias", bias, (D,), "[D]")
    N = check_cu_seqlens(cu_seqlens, device)
    if initial_state is not None:
        _check_device("initial_state", initial_state, device)
        _check_dtype("initial_state", initial_state, QKV_DTYPES)
        _check_shape("initial_state", initial_state, (N, D, W - 1), "[N, D, W-1]")
    return T, D, W, N
