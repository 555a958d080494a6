"""The tests' watchdog (tests/conftest.py): a test that runs past CAKE_OPS_TEST_TIMEOUT
ends the process with its stack printed, instead of stalling the suite."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path: Path, body: str, timeout_s: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, CAKE_OPS_TEST_TIMEOUT=timeout_s, PYTHONPATH=str(TESTS))
    # tests/conftest.py as a plugin: the probe lives outside tests/, so nothing else is collected.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "test_probe.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_hanging_test_ends_the_run_with_its_stack(tmp_path):
    done = run_pytest(tmp_path, """
        import time

        def test_fast():
            pass

        def test_hangs_here():
            time.sleep(60)
        """, "2")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Timeout (0:00:02)!" in out and "in test_hangs_here" in out, out


def test_tests_within_the_limit_pass(tmp_path):
    done = run_pytest(tmp_path, """
        import time

        def test_short():
            time.sleep(1.5)

        def test_another():
            time.sleep(1.5)
        """, "2")
    assert done.returncode == 0, done.stdout + done.stderr
