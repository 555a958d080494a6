"""The CUDA short convolution backward (``torch.ops.cake_cuda.short_conv_bwd``,
csrc/short_conv/bwd.cu) on the GPU: every gradient (dx, dweight, dbias, dinitial_state)
against FP64 autograd of the reference under NaN-poisoned allocation (widths 1-4,
vectorised and scalar channel counts, mixed dtypes, bias, initial state, SiLU), through
the cake:: op with every parameter dtype (the casts of the CUDA registration), against the
PyTorch implementation, odd layouts (int64 cu_seqlens, misaligned x, expanded stride-0
dy), and determinism: bitwise repeatable, a document's dx and dinitial_state independent
of its neighbours and its place in the pack, dweight / dbias independent of the vector
width and of empty documents added (same T), CUDA-graph replay on new documents. Every
test is marked ``gpu`` and skipped without a Hopper GPU.
"""

import pytest
import torch

import cake_ops
from cake_ops import build, dispatch
from cake_ops.ops.short_conv import kernel_dtypes
from cake_ops.pytorch import short_conv as pytorch_short_conv
from cake_ops.reference import short_conv_reference
from cake_ops.testing import accuracy, poisoned_allocations

from cases import replay_and_eager, short_conv_documents
from conftest import record_accuracy

pytestmark = pytest.mark.gpu

GRADS = ("dx", "dweight", "dbias", "dinitial_state")


def _documents(lengths, D, W, x_dtype, param_dtype, **kw):
    return short_conv_documents(lengths, D, W, x_dtype, param_dtype, with_dy=True, **kw)


def _lengths(seed):
    """Empty and 1-3 token documents, boundaries on and off the kernel's 32-token runs and
    128-token tiles, plus random lengths."""
    gen = torch.Generator().manual_seed(seed)
    fixed = [0, 1, 2, 3, 10, 0, 0, 32, 31, 33, 5, 130, 0]
    return fixed + torch.randint(0, 50, (6,), generator=gen).tolist() + [0]


def _bwd(inputs, silu):
    return build.load().short_conv_bwd(
        inputs["dy"], inputs["x"], inputs["weight"], inputs["bias"], inputs["cu_seqlens"],
        inputs["initial_state"], silu,
    )


def _reference_grads(inputs, silu):
    """FP64 autograd of the reference; a zero bias and initial state stand in for absent
    ones (the reference reads zeros there), so their gradients are defined too."""
    cpu = {n: t.cpu() if t is not None else None for n, t in inputs.items()}
    T, D = cpu["x"].shape
    W, N = cpu["weight"].shape[1], cpu["cu_seqlens"].shape[0] - 1
    leaves = {
        "x": cpu["x"].double(),
        "weight": cpu["weight"].double(),
        "bias": cpu["bias"].double() if cpu["bias"] is not None else torch.zeros(D, dtype=torch.float64),
        "initial_state": (cpu["initial_state"].double() if cpu["initial_state"] is not None
                          else torch.zeros(N, D, W - 1, dtype=torch.float64)),
    }
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    y = short_conv_reference(leaves["x"], leaves["weight"], leaves["bias"], cpu["cu_seqlens"],
                             leaves["initial_state"], "silu" if silu else None)
    y.backward(cpu["dy"].double())
    return tuple(leaves[n].grad for n in ("x", "weight", "bias", "initial_state"))


def _expected_dtypes(inputs):
    weight, bias, state = inputs["weight"], inputs["bias"], inputs["initial_state"]
    return (inputs["x"].dtype, weight.dtype, bias.dtype if bias is not None else weight.dtype,
            state.dtype if state is not None else inputs["x"].dtype)


def _check_against_reference(grads, inputs, silu, name):
    """Every gradient finite and within the contract, and within the forward's kernel-test
    tolerance of its dtype (fp32 accumulation, one rounding)."""
    refs = _reference_grads(inputs, silu)
    failures = []
    for gname, g, ref, dtype in zip(GRADS, grads, refs, _expected_dtypes(inputs)):
        assert g.dtype == dtype and g.shape == ref.shape and g.is_contiguous(), (gname, g.dtype, g.shape)
        acc = accuracy(g, ref)
        record_accuracy(f"cake_cuda.short_conv_bwd {gname}", acc)
        if not (acc.ok and acc.rel_rms <= TOLERANCE[dtype] and acc.max_abs_ratio <= TOLERANCE[dtype]):
            failures.append(f"{gname} ({dtype}): {acc}")
    assert not failures, f"{name}: " + "; ".join(failures)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_bitwise(a, b, what=""):
    for gname, x, y in zip(GRADS, a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, gname)
        assert torch.equal(_bits(x), _bits(y)), f"{what}: {gname} differs"


# The error is fp32 accumulation plus one rounding to the gradient's dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float32), (torch.float32, torch.float32)]


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_dtype,param_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("D", [64, 37], ids=["vectorised", "scalar"])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_short_conv_bwd_matches_reference(W, D, x_dtype, param_dtype, bias, state, silu):
    inputs = _documents(_lengths(W * 7 + D), D, W, x_dtype, param_dtype, bias=bias, state=state, seed=W + D)
    with poisoned_allocations():
        grads = _bwd(inputs, silu)
    _check_against_reference(grads, inputs, silu, str(x_dtype).removeprefix("torch."))


@pytest.mark.parametrize("W", [1, 4])
def test_short_conv_bwd_no_tokens(W):
    """T = 0 (all documents empty): dweight, dbias and every dinitial_state are zeros."""
    inputs = _documents([0, 0, 0], 64, W, torch.bfloat16, torch.float32, bias=True, state=True, seed=5)
    with poisoned_allocations():
        dx, dweight, dbias, dinit = _bwd(inputs, True)
    assert dx.shape == (0, 64) and dinit.shape == (3, 64, W - 1)
    for g in (dweight, dbias, dinit):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_short_conv_bwd_op_every_parameter_dtype(weight_dtype, state_dtype):
    """Through cake::short_conv_bwd on CUDA (the registration's casts: weight and bias to
    fp32 unless both have x's dtype, here never, as the bias has another; state to fp32
    unless x's dtype; gradients back to the dtypes the op promises): the forward's kernel
    tolerances against the reference, the PyTorch path's dtypes, and the kernel's bits on
    the cast inputs."""
    other = torch.float16 if weight_dtype == torch.bfloat16 else torch.bfloat16
    inputs = _documents(_lengths(6), 64, 4, torch.bfloat16, weight_dtype, bias=True, state=True, seed=6)
    inputs["bias"] = inputs["bias"].to(other)
    inputs["initial_state"] = inputs["initial_state"].to(state_dtype)
    args = [inputs[n] for n in ("dy", "x", "weight", "bias", "cu_seqlens", "initial_state")] + [True]
    with poisoned_allocations():
        grads = torch.ops.cake.short_conv_bwd(*args)
    with dispatch.pytorch_implementation():
        torch_grads = torch.ops.cake.short_conv_bwd(*args)
    assert [g.dtype for g in grads] == [g.dtype for g in torch_grads]
    _check_against_reference(grads, inputs, True, f"weight {weight_dtype}, state {state_dtype}")

    weight, bias, state = kernel_dtypes(inputs["x"], inputs["weight"], inputs["bias"], inputs["initial_state"])
    assert weight.dtype == bias.dtype == torch.float32  # the bias never has the weight's dtype here
    assert state.dtype == (torch.float32 if state_dtype == torch.float16 else state_dtype)
    cast = {**inputs, "weight": weight, "bias": bias, "initial_state": state}
    kernel = _bwd(cast, True)
    for gname, g, k in zip(GRADS, grads, kernel):
        assert torch.equal(g, k.to(g.dtype)), gname


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_short_conv_fwd_op_bias_of_another_dtype(weight_dtype):
    """The forward's registration shares the casts: a bias of another dtype than the weight
    (a weight of x's dtype or not) widens both to fp32 (it used to cast the bias to the
    weight's dtype first and then the weight alone to fp32, which the binding refused)."""
    other = torch.float16 if weight_dtype == torch.bfloat16 else torch.bfloat16
    inputs = _documents(_lengths(14), 64, 4, torch.bfloat16, weight_dtype, bias=True, state=True, seed=14)
    inputs["bias"] = inputs["bias"].to(other)
    args = [inputs[n] for n in ("x", "weight", "bias", "cu_seqlens", "initial_state")] + [True]
    with poisoned_allocations():
        y = torch.ops.cake.short_conv_fwd(*args)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    ref = short_conv_reference(*cpu[:5], "silu")
    acc = accuracy(y, ref)
    assert y.dtype == torch.bfloat16 and acc.rel_rms <= TOLERANCE[torch.bfloat16] and acc.max_abs_ratio <= TOLERANCE[torch.bfloat16], acc


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("x_dtype,param_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_short_conv_bwd_matches_pytorch_path(W, x_dtype, param_dtype):
    """The CUDA kernel against the PyTorch implementation on the same GPU inputs: the same
    math in other roundings, so within the dtype's tolerance (not bitwise)."""
    inputs = _documents(_lengths(7), 96, W, x_dtype, param_dtype, bias=True, state=True, seed=7)
    grads = _bwd(inputs, True)
    torch_grads = pytorch_short_conv.short_conv_bwd(
        inputs["dy"], inputs["x"], inputs["weight"], inputs["bias"], inputs["cu_seqlens"],
        inputs["initial_state"], True,
    )
    for gname, g, ref in zip(GRADS, grads, torch_grads):
        assert g.dtype == ref.dtype and g.shape == ref.shape, gname
        acc = accuracy(g, ref)
        # Both sides round once to the gradient's dtype: twice the tolerance.
        assert acc.finite and acc.rel_rms <= 2 * TOLERANCE[g.dtype] and acc.max_abs_ratio <= 2 * TOLERANCE[g.dtype], (gname, acc)


def test_short_conv_bwd_odd_layouts():
    """int64 cu_seqlens, x 2 bytes off alignment (the scalar path: same bits as the vector
    path, dweight and dbias too) and dy as an expanded stride-0 tensor, as y.sum() passes
    it (same bits as its dense copy)."""
    inputs = _documents(_lengths(1), 64, 4, torch.bfloat16, torch.float32, bias=True, state=True,
                        cu_dtype=torch.int64, seed=1)
    T = inputs["x"].shape[0]
    with poisoned_allocations():
        aligned = _bwd(inputs, True)
    _check_against_reference(aligned, inputs, True, "int64")

    shifted = torch.empty(T * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(T, 64)
    shifted.copy_(inputs["x"])
    with poisoned_allocations():
        scalar = _bwd({**inputs, "x": shifted}, True)
    _assert_bitwise(scalar, aligned, "misaligned x")

    expanded = inputs["dy"][:1].expand(T, 64)
    case = {**inputs, "dy": expanded}
    with poisoned_allocations():
        from_expanded = _bwd(case, True)
    _check_against_reference(from_expanded, case, True, "expanded dy")
    _assert_bitwise(from_expanded, _bwd({**case, "dy": expanded.contiguous()}, True), "expanded dy")


def test_short_conv_bwd_autograd_of_a_sum():
    """cake_ops.short_conv(...).sum().backward() on CUDA: dy arrives expanded (stride 0),
    every gradient within the contract."""
    inputs = _documents(_lengths(8), 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=8)
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("x", "weight", "bias", "initial_state")}
    with poisoned_allocations():
        y = cake_ops.short_conv(leaves["x"], leaves["weight"], leaves["bias"], inputs["cu_seqlens"],
                                initial_state=leaves["initial_state"], activation="silu")
        y.sum().backward()
    case = {**inputs, "dy": torch.ones_like(inputs["x"])}
    refs = _reference_grads(case, True)
    for gname, (n, leaf), ref in zip(GRADS, leaves.items(), refs):
        acc = accuracy(leaf.grad, ref)
        assert acc.ok, (gname, acc)


def test_short_conv_bwd_is_bitwise_repeatable():
    inputs = _documents(_lengths(2) * 40, 512, 4, torch.bfloat16, torch.bfloat16, bias=True, state=True,
                        seed=2)
    first = _bwd(inputs, True)
    for _ in range(3):
        _assert_bitwise(_bwd(inputs, True), first, "repeat")


@pytest.mark.parametrize("W", [2, 4])
def test_short_conv_bwd_document_independent_of_neighbours(W):
    """A document's dx rows and dinitial_state are bitwise the same alone and packed between
    other documents at an offset off the kernel's runs, whatever its neighbours hold."""
    D = 64
    doc = _documents([45], D, W, torch.bfloat16, torch.float32, bias=True, state=True, seed=9)
    packed = _documents([7, 0, 45, 30], D, W, torch.bfloat16, torch.float32, bias=True, state=True, seed=10)
    for name in ("dy", "x"):
        packed[name][7:52] = doc[name]
    packed["weight"], packed["bias"] = doc["weight"], doc["bias"]
    packed["initial_state"][2] = doc["initial_state"][0]
    alone = _bwd(doc, True)
    together = _bwd(packed, True)
    assert torch.equal(_bits(together[0][7:52]), _bits(alone[0]))
    assert torch.equal(_bits(together[3][2]), _bits(alone[3][0]))

    other = _documents([7, 0, 45, 30], D, W, torch.bfloat16, torch.float32, bias=True, state=True, seed=11)
    for name in ("dy", "x"):
        other[name][7:52] = doc[name]
    other["weight"], other["bias"] = doc["weight"], doc["bias"]
    other["initial_state"][2] = doc["initial_state"][0]
    changed = _bwd(other, True)
    assert torch.equal(_bits(changed[0][7:52]), _bits(alone[0]))
    assert torch.equal(_bits(changed[3][2]), _bits(alone[3][0]))


def test_short_conv_bwd_sums_independent_of_empty_documents():
    """dweight and dbias are summed over fixed 128-token tiles, so their bits depend on T
    only: adding empty documents (same tokens, same T, other N) changes no bit of any
    gradient, and the empty documents' dinitial_state is zero."""
    lengths = [300, 17, 129, 64, 200]
    inputs = _documents(lengths, 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=12)
    base = _bwd(inputs, True)

    split = [0, 300, 0, 0, 17, 129, 0, 64, 200, 0]
    real = [i for i, n in enumerate(split) if n]
    state = torch.randn(len(split), 64, 3, device="cuda").to(inputs["initial_state"].dtype)
    state[real] = inputs["initial_state"]
    case = {**inputs, "initial_state": state,
            "cu_seqlens": torch.tensor([0] + torch.tensor(split).cumsum(0).tolist(), dtype=torch.int32, device="cuda")}
    with poisoned_allocations():
        more = _bwd(case, True)
    for gname, a, b in zip(GRADS[:3], more[:3], base[:3]):
        assert torch.equal(_bits(a), _bits(b)), gname
    assert torch.equal(_bits(more[3][real]), _bits(base[3]))
    empty = [i for i, n in enumerate(split) if not n]
    assert torch.equal(more[3][empty], torch.zeros_like(more[3][empty]))


def test_short_conv_bwd_cuda_graph_replays_new_documents():
    """Captured once, replayed on new values and new document lengths (same N and T):
    equals eager, so nothing in the op depends on host-side values of cu_seqlens."""
    lengths = _lengths(3)
    static = _documents(lengths, 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=3)
    fresh = _documents(lengths[::-1], 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=4)
    replayed, eager = replay_and_eager(lambda inputs: _bwd(inputs, True), static, fresh)
    _assert_bitwise(replayed, eager, "graph replay")


def test_short_conv_bwd_dy_of_another_dtype_runs_pytorch():
    """dy in another dtype than x (a direct call; autograd passes y's dtype) is refused by
    the dispatch rule and runs the PyTorch implementation; the binding would reject it."""
    inputs = _documents(_lengths(13), 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=13)
    assert dispatch.short_conv_bwd_cuda_refusal(inputs["dy"].float(), inputs["x"]) is not None
    assert dispatch.short_conv_bwd_cuda_refusal(inputs["dy"], inputs["x"]) is None
    args = [inputs[n] for n in ("x", "weight", "bias", "cu_seqlens", "initial_state")] + [True]
    grads = torch.ops.cake.short_conv_bwd(inputs["dy"].float(), *args)
    expected = pytorch_short_conv.short_conv_bwd(inputs["dy"].float(), *args)
    for gname, g, e in zip(GRADS, grads, expected):
        assert torch.equal(g, e), gname


_BAD_DY = {
    "dtype": ("dy = torch.randn(7, 16, device='cuda')", "dy must have x's dtype"),
    "shape": ("dy = torch.randn(6, 16, device='cuda', dtype=torch.bfloat16)", "dy must be [T, D] = [7, 16], got [6, 16]"),
}


@pytest.mark.parametrize("case", list(_BAD_DY))
def test_short_conv_bwd_binding_rejects_bad_dy(case):
    """In a child process, as test_build.py's binding checks (a crash fails one case)."""
    import subprocess
    import sys
    from pathlib import Path

    make_dy, message = _BAD_DY[case]
    program = (
        "import torch\nfrom cake_ops import build\nops = build.load()\n"
        "x = torch.randn(7, 16, device='cuda', dtype=torch.bfloat16)\n"
        "w = torch.randn(16, 4, device='cuda', dtype=torch.bfloat16)\n"
        "cu = torch.tensor([0, 7], device='cuda', dtype=torch.int32)\n"
        f"{make_dy}\n"
        "try:\n    ops.short_conv_bwd(dy, x, w, None, cu, None, True)\n"
        "except RuntimeError as e:\n    print('RAISED', e)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", program], cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "RAISED" in done.stdout and message in done.stdout, (
        f"exit {done.returncode}: {done.stdout[-500:]} {done.stderr[-500:]}"
    )
