"""tools/gdn_host_overhead.py --stub-kernels on the CPU: the ops' kernels replaced by their
fake kernels (meta/gdn.py), every layer of both --op modes timed, and its cProfile printed.
In a subprocess: the stubs are registered for the process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("op, layers", [("fwd", ["cake_ops.gdn, grad", "cake::gdn_fwd, no_grad"]),
                                        ("fwdbwd", ["fwdbwd step", "cake:: fwd + bwd, no_grad"])])
def test_stubbed_layers_timed_on_the_cpu(op, layers):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gdn_host_overhead.py"), "--stub-kernels", "--op", op,
                          "--shape", "s32k_h2", "--calls", "5", "--profile"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{op} at s32k_h2, CPU, stubbed kernels" in out.stdout
    for name in layers:
        m = re.search(rf"^{re.escape(name)}\s+host\s+([\d.]+) us/call\s+wall\s+([\d.]+) us/call$", out.stdout, re.M)
        assert m and float(m.group(1)) > 0, (name, out.stdout)
    assert "Ordered by: internal time" in out.stdout  # --profile's cProfile of the first layer
