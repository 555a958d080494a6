"""The JIT build (cake_ops.build) and the cake_cuda kernels it builds, called directly.

CPU: the cache key and the errors without a GPU. GPU (Hopper): torch.ops.cake_cuda
against the FP64 reference, determinism, CUDA-graph replay.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cake_ops import build
from cake_ops.reference import short_conv_reference
from cake_ops.testing import accuracy, poisoned_allocations

from conftest import HAS_CUDA, record_accuracy

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- build (CPU)


def _print_key() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cake_ops.build", "--print-key"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_print_key_is_stable_and_lists_sources():
    first, second = _print_key(), _print_key()
    assert first == second
    lines = first.splitlines()
    assert lines[0] == f"key {build.build_key()}"
    sources = {Path(line.split(" ", 1)[1]).name for line in lines if line.startswith("source ")}
    assert {"binding.cpp", "short_conv.h", "short_conv_fwd.cu"} <= sources


def test_key_changes_with_flags():
    key = build.build_key()
    assert len(key) == 16 and int(key, 16) >= 0
    assert build.build_key(cuda_cflags=build.CUDA_CFLAGS + ("-DCAKE_X",)) != key
    assert build.build_key(cflags=build.CFLAGS[:-1]) != key


def test_key_changes_with_a_header_not_with_the_location(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), copy)
    assert build.build_key(copy) == build.build_key()
    header = copy / "short_conv.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert build.build_key(copy) != build.build_key()


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without a GPU")
def test_available_is_false_without_gpu():
    assert build.available() is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without a GPU")
def test_load_without_gpu_says_why():
    with pytest.raises(RuntimeError, match=r"unavailable: .*(without CUDA|no CUDA device)"):
        build.load()


# ---------------------------------------------------------------- kernels (GPU)


def _documents(lengths, D, W, x_dtype, param_dtype, *, bias, state, cu_dtype=torch.int32, seed=0):
    """Fresh random inputs on the GPU; the initial state takes the dtype the weight does not,
    so mixed dtypes are covered."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    state_dtype = torch.float32 if param_dtype == x_dtype else x_dtype
    return dict(
        x=torch.randn(T, D, generator=gen).to("cuda", x_dtype),
        weight=(torch.randn(D, W, generator=gen) / W**0.5).to("cuda", param_dtype),
        bias=torch.randn(D, generator=gen).to("cuda", param_dtype) if bias else None,
        cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=cu_dtype,
                                device="cuda"),
        initial_state=torch.randn(N, D, W - 1, generator=gen).to("cuda", state_dtype) if state else None,
    )


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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fwd(static, True)  # builds and loads outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = _fwd(static, True)

    fresh = _documents(lengths[::-1], 64, 4, torch.bfloat16, torch.float32, bias=True, state=True, seed=4)
    for name, tensor in static.items():
        tensor.copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_static.view(torch.int16), _fwd(fresh, True).view(torch.int16))


# Bad arguments that reach the binding must raise RuntimeError. Each call runs in a child
# process: on the H200 (torch 2.11, g++ 13) a TORCH_CHECK message that formatted an
# integer once killed the process with a segfault (a static libstdc++ copy in the
# extension; build.LDFLAGS fixes it), and a crash must fail one case, not the session.
# The public cake:: ops validate in Python first and never reach these checks with bad input.
_GDN_ARGS = (
    "q = torch.randn(10, 1, 128, device='cuda', dtype=torch.bfloat16)\n"
    "g = -torch.rand(10, 1, device='cuda')\n"
    "cu = torch.tensor([0, 10], device='cuda', dtype=torch.int32)\n"
)
_BAD_CALLS = {
    "short_conv_fwd width 5": (
        "x = torch.randn(7, 16, device='cuda', dtype=torch.bfloat16)\n"
        "w = torch.randn(16, 5, device='cuda', dtype=torch.bfloat16)\n"
        "cu = torch.tensor([0, 7], device='cuda', dtype=torch.int32)\n"
        "ops.short_conv_fwd(x, w, None, cu, None, False)",
        "1 <= W <= 4",
    ),
    "gdn_fwd head dim 64": (
        "q = torch.randn(10, 1, 64, device='cuda', dtype=torch.bfloat16)\n"
        "g = -torch.rand(10, 1, device='cuda')\n"
        "cu = torch.tensor([0, 10], device='cuda', dtype=torch.int32)\n"
        "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, None, 0.125, True, True)",
        "K = 128",
    ),
    # Messages that format integers and sizes: with a static libstdc++ in the extension
    # they crashed the process (build.LDFLAGS).
    "gdn_fwd value_splits 3": (
        _GDN_ARGS + "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, None, 0.125, True, True, -1, 3)",
        "value_splits must be -1 (the plan's choice), 1 or 2, got 3",
    ),
    "gdn_fwd segment_chunks -5": (
        _GDN_ARGS + "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, None, 0.125, True, True, -5)",
        "or a cut grid in chunks, got -5",
    ),
    "gdn_fwd initial_state shape": (
        _GDN_ARGS + "ops.gdn_fwd(q, q, q, g, torch.rand_like(g), cu, torch.zeros(2, 3, device='cuda'), 0.125, True, True)",
        "initial_state must be [N, HV, K, V] = [1, 1, 128, 128], got [2, 3]",
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("call", list(_BAD_CALLS))
def test_binding_rejects_bad_arguments_with_runtime_error(call):
    code, message = _BAD_CALLS[call]
    program = (
        "import torch\nfrom cake_ops import build\nops = build.load()\ntry:\n"
        + "".join("    " + line + "\n" for line in code.splitlines())
        + "except RuntimeError as e:\n    print('RAISED', e)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", program], cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "RAISED" in done.stdout and message in done.stdout, (
        f"exit {done.returncode}: {done.stdout[-500:]} {done.stderr[-500:]}"
    )
