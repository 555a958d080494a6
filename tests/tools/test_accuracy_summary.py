"""The worst-accuracy summary (tests/conftest.py) of a run in several pytest-xdist worker
processes: each worker's record reaches the controller, which prints the worst per name."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

PROBE = """
    import os

    from cake_ops.testing import Accuracy
    from conftest import record_accuracy

    WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw-")

    def test_records_its_worker():
        record_accuracy(f"probe {WORKER}", Accuracy(1e-4, 2e-4, True))

    def test_records_a_shared_name():
        # worse on the second worker: the summary must take it from there
        record_accuracy("probe shared", Accuracy(3e-3 if WORKER == "gw1" else 1e-3, 4e-3, True))
    """


def summary_lines(tmp_path: Path, *args: str) -> list[str]:
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    # Without this run's own xdist variables: under `pytest -n`, the worker running this test
    # would otherwise hand its PYTEST_XDIST_WORKER to the probe's single process.
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(TESTS)
    # tests/conftest.py as a plugin: the probe lives outside tests/, so nothing else is collected.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", *args,
                           "test_probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith("probe ")]


def test_the_workers_records_are_merged(tmp_path):
    # --dist each: every worker runs every test, so both records hold every name.
    lines = summary_lines(tmp_path, "-n", "2", "--dist", "each")
    assert [line.split()[1] for line in lines] == ["gw0", "gw1", "shared"], lines
    shared = lines[2].split()
    assert shared[3] == "3.000e-03" and shared[-1] == "test_probe.py::test_records_a_shared_name", lines


def test_one_process_prints_its_own_record(tmp_path):
    lines = summary_lines(tmp_path)
    assert [line.split()[1] for line in lines] == ["gw-", "shared"] and lines[1].split()[3] == "1.000e-03", lines
