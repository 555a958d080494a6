import faulthandler
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cake_ops.testing import Accuracy, accuracy

HAS_CUDA = torch.cuda.is_available()

# Worst accuracy seen per tensor name over the whole session, with the test that saw it,
# printed at the end.
_WORST: dict[str, tuple[Accuracy, str]] = {}


def load_tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_ops():
    """``torch.ops.cake_cuda`` for the tests of the kernels themselves: skipped where the GPU
    is not a Hopper one (the kernels are sm_90a), failed where it is and they cannot be
    built (a missing nvcc or ninja is the machine's set-up to fix, not a kernel suite to
    report as skipped)."""
    from cake_ops import build

    reason = build.unavailable_reason()
    if reason is None:
        return build.load()
    hopper = HAS_CUDA and all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count()))
    if hopper:
        pytest.fail(f"a Hopper GPU is visible but the CUDA kernels cannot be used: {reason}")
    pytest.skip(reason)


def device_assert_output(setup: str, call: str) -> str:
    """Runs ``setup`` and then ``call`` (Python lines, with torch, cake_ops and
    cake_ops.testing.make_gdn_inputs imported) in a fresh process from the repository
    root, since a device-side assert leaves the CUDA context unusable; ``call`` must fail
    with a RuntimeError by the next synchronize. Returns the process's output."""
    body = "\n".join("    " + line for line in call.strip().splitlines())
    program = (f"import torch, cake_ops\nfrom cake_ops.testing import make_gdn_inputs\n{setup.strip()}\ntry:\n"
               f"{body}\n    torch.cuda.synchronize()\nexcept RuntimeError as e:\n    print('RAISED', e)\n"
               f"    raise SystemExit(3)\nprint('NO ERROR')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    return out


def _keep_if_worse(name: str, acc: Accuracy, test: str) -> None:
    old = _WORST.get(name)
    if old is None or (acc.rel_rms, acc.max_abs_ratio) > (old[0].rel_rms, old[0].max_abs_ratio) or not acc.finite:
        _WORST[name] = (acc, test)


def record_accuracy(name: str, acc: Accuracy) -> None:
    # pytest's "path::test[params] (call)" of the running test
    _keep_if_worse(name, acc, os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0])


# Under pytest-xdist (`-n N`) each worker keeps its own record; it hands it to the
# controller when it finishes, which merges the records and prints the one summary.
def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["cake_worst_accuracy"] = [
            (name, a.rel_rms, a.max_abs_ratio, a.finite, test) for name, (a, test) in _WORST.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for name, rel_rms, max_abs_ratio, finite, test in getattr(node, "workeroutput", {}).get("cake_worst_accuracy", ()):
        _keep_if_worse(name, Accuracy(rel_rms, max_abs_ratio, finite), test)


def assert_within_contract(prefix: str, pairs: dict, where: str) -> None:
    """Every (result, FP64 reference) pair of ``pairs`` (by tensor name) within the accuracy
    contract, each recorded under "``prefix`` name" for the session's summary; one failure
    names every tensor out of it, with ``where``."""
    failures = []
    for name, (x, ref) in pairs.items():
        assert x is not None, f"no gradient for {name}"
        acc = accuracy(x, ref)
        record_accuracy(f"{prefix} {name}", acc)
        if not acc.ok:
            failures.append(f"{name}: {acc}")
    assert not failures, f"{where}: " + "; ".join(failures)


# No test may run longer than this (seconds; CAKE_OPS_TEST_TIMEOUT, 0: no limit): a kernel
# that never finishes blocks the process in a CUDA call where no Python timeout reaches
# it, and would spend a device call's whole limit without a word. faulthandler's watchdog
# is a C thread: it prints every thread's stack (the test's file, line and function) to
# the terminal and exits the process with status 1.
TEST_TIMEOUT_S = float(os.environ.get("CAKE_OPS_TEST_TIMEOUT", "240"))
_watchdog_out = None


def pytest_configure(config):
    global _watchdog_out
    if TEST_TIMEOUT_S > 0:  # fd 2 as the terminal has it (the tests' own output is captured)
        _watchdog_out = os.fdopen(os.dup(2), "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _watchdog_out is None:
        yield
        return
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_watchdog_out)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if not _WORST:
        return
    terminalreporter.section("worst accuracy against the FP64 reference (contract: rel-RMS <= 1e-2, max-abs <= 2e-2 max|ref|)")
    for name in sorted(_WORST):
        a, test = _WORST[name]
        terminalreporter.write_line(f"{name:28s} rel-RMS {a.rel_rms:.3e}   max-abs/max|ref| {a.max_abs_ratio:.3e}   "
                                    f"finite {a.finite}   {test}")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
