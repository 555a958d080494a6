"""The CUDA short convolution forward (``torch.ops.cake_cuda.short_conv_fwd``,
csrc/short_conv/fwd.cu) on the GPU, called directly: against the FP64 reference under
NaN-poisoned allocation (widths 1-4, vectorised and scalar channel counts, mixed dtypes,
bias, initial state, SiLU), odd layouts (int64 cu_seqlens, misaligned and expanded x),
bitwise repeatability and CUDA-graph replay on new documents. Every test is marked
``gpu`` and skipped without a Hopper GPU. (The binding's argument checks, for both
kernel families, are in test_build.py.)
"""

import pytest
import torch

from cake_ops import build
from cake_ops.reference import short_conv_reference
from cake_ops.testing import accuracy, poisoned_allocations

from cases import replay_and_eager, short_conv_documents
from conftest import record_accuracy

pytestmark = pytest.mark.gpu


def _documents(lengths, D, W, x_dtype, param_dtype, **kw):
    return short_conv_documents(lengths, D, W, x_dtype, param_dtype, with_dy=False, **kw)


def _lengths(seed):
    """Empty and 1-3 token documents, boundaries on and off the kernel's 16-token runs,
    plus random lengths."""
    gen = torch.Generator().manual_seed(seed)
    fixed = [0, 1, 2, 3, 10, 0, 0, 16, 16, 5, 40, 0]
    return fixed + torch.randint(0, 50, (6,), generator=gen).tolist() + [0]


def _fwd(inputs, silu):
    return build.load().short_conv_fwd(
        inputs["x"], inputs["weight"], inputs["bias"], inputs["cu_seqlens"], inputs["initial_state"], silu
    )


def _check_against_reference(y, inputs, silu, tol, name):
    cpu = {n: t.cpu() if t is not None else None for n, t in inputs.items()}
    ref = short_conv_reference(cpu["x"], cpu["weight"], cpu["bias"], cpu["cu_seqlens"], cpu["initial_state"],
                               "silu" if silu else None)
    assert y.dtype == inputs["x"].dtype and y.shape == inputs["x"].shape and y.is_contiguous()
    acc = accuracy(y, ref)
    record_accuracy(f"cake_cuda.short_conv_fwd {name}", acc)
    assert acc.finite and acc.rel_rms <= tol and acc.max_abs_ratio <= tol, acc


# The error is fp32 accumulation plus one rounding of y to x's dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float32), (torch.float32, torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_dtype,param_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("D", [64, 37], ids=["vectorised", "scalar"])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_short_conv_fwd_matches_reference(W, D, x_dtype, param_dtype, bias, state, silu):
    inputs = _documents(_lengths(W * 7 + D), D, W, x_dtype, param_dtype, bias=bias, state=state, seed=W + D)
    with poisoned_allocations():
        y = _fwd(inputs, silu)
    _check_against_reference(y, inputs, silu, TOLERANCE[x_dtype], str(x_dtype).removeprefix("torch."))


@pytest.mark.gpu
def test_short_conv_fwd_odd_layouts():
    """int64 cu_seqlens, x 2 bytes off 16-byte alignment (the scalar path), and an
    expanded stride-0 x as gradients arrive."""
    inputs = _documents(_lengths(1), 64, 4, torch.bfloat16, torch.float32, bias=True, state=True,
                        cu_dtype=torch.int64, seed=1)
    T = inputs["x"].shape[0]
    shifted = torch.empty(T * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(T, 64)
    shifted.copy_(inputs["x"])
    expanded = inputs["x"][:1].expand(T, 64)
    for name, x in {"int64": inputs["x"], "misaligned": shifted, "expanded": expanded}.items():
        case = {**inputs, "x": x}
        with poisoned_allocations():
            y = _fwd(case, True)
        _check_against_reference(y, case, True, TOLERANCE[torch.bfloat16], name)


@pytest.mark.gpu
def test_short_conv_fwd_is_bitwise_repeatable():
    inputs = _documents(_lengths(2) * 40, 512, 4, torch.bfloat16, torch.bfloat16, bias=True, state=True,
                        seed=2)
    first = _fwd(inputs, True)
    for _ in range(3):
        assert torch.equal(_fwd(inputs, True).view(torch.int16), first.view(torch.int16))


@pytest.mark.gpu
def test_short_conv_fwd_cuda_graph_replays_new_documents():
    """Captured once, replayed on new values and new document lengths (same N and T):
    equals eager, so nothing in the op depends on host-side values of cu_seqlens."""
    lengths = _lengths(3)
    static = _documents(lengths, 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=3)
    fresh = _documents(lengths[::-1], 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=4)
    replayed, eager = replay_and_eager(lambda inputs: _fwd(inputs, True), static, fresh)
    assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16))
