"""The main job (examples/train_lm.py) trains in each of its modes: a few steps as a
subprocess, the loss down and the script's own checks passed (exit 0). Its compiled,
checkpointed step once failed under torch.compile (a write Dynamo refuses inside a
checkpoint region) with no test that ran the example; these run it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_lm.py"
# Few steps and a short generation: enough to compile, step, checkpoint and replay.
QUICK = ["--steps", "6", "--smooth", "2", "--gen-chars", "8", "--seed", "0"]


def run_example(*flags: str, device: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", device, *QUICK, *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "OK: loss went down" in out, out[-4000:]
    return out


@pytest.mark.parametrize("flags", [
    ("--backend", "aot_eager"),
    ("--backend", "aot_eager", "--checkpoint"),
    ("--checkpoint",),  # inductor, as the README's main job
    ("--no-compile",),
    ("--no-compile", "--checkpoint"),
], ids=lambda f: " ".join(f))
def test_example_trains_on_cpu(flags):
    out = run_example(*flags, device="cpu")
    if "--no-compile" not in flags:
        assert "compiled graphs:" in out


@pytest.mark.gpu
# Two of the GPU modes (each compiles for about 25 s): checkpointed, and checkpointed in CUDA graphs.
@pytest.mark.parametrize("flags", [("--checkpoint",), ("--cuda-graph", "--checkpoint")], ids=lambda f: " ".join(f))
def test_example_trains_on_cuda(flags):
    out = run_example(*flags, device="cuda")
    assert "peak memory:" in out


@pytest.mark.parametrize("flags", [
    ("--cp", "2", "--cp-layout", "Z"),
    ("--cp", "3", "--cp-layout", "D", "--checkpoint"),
    ("--cp", "2", "--compile", "--backend", "aot_eager"),  # min-cut partitioned, as inductor: a new plan each step
], ids=lambda f: " ".join(f))
def test_example_trains_context_parallel_on_cpu(flags):
    """--cp N: N gloo processes, each its rows of the packed row through gdn_kcp and
    short_conv_kcp; the script's own check at step 0 (the all-reduced loss and gradients
    against the model on the whole row) passed, the loss down."""
    out = run_example(*flags, device="cpu")
    assert "step 0 with KCP against one process on the whole row" in out and ": FAIL" not in out
    assert f"context parallel over {flags[1]} ranks" in out


def test_example_trains_context_parallel_under_torchrun():
    """--cp 2 under torchrun: the ranks and the rendezvous are torchrun's."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                          "--device", "cpu", "--cp", "2", *QUICK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "step 0 with KCP against one process on the whole row" in out and "OK: loss went down" in out, out[-4000:]


def test_example_refuses_context_parallel_traced():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--cp", "2", "--trace", "out"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--cp takes neither --cuda-graph" in res.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_example_trains_context_parallel_on_two_gpus():
    out = run_example("--cp", "2", device="cuda")
    assert "step 0 with KCP against one process on the whole row" in out and "peak memory of rank 0" in out
