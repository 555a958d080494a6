"""tools/ab_csrc.py without a GPU: export from a scratch git repository, then `run` with
the build, the timing script and pytest replaced by a fake that records which csrc/ and
tests/ were in the checkout at each step."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ab_csrc.py"


@pytest.fixture()
def ab(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ab_csrc", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    repo = tmp_path / "repo"
    (repo / "csrc").mkdir(parents=True)
    (repo / "tests").mkdir()

    def git(*args):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    for rev in ("old", "new"):
        (repo / "csrc" / "k.cu").write_text(rev)
        (repo / "tests" / "test_k.py").write_text(rev)
        git("add", "-A")
        git("commit", "-q", "-m", rev)
        git("tag", rev)
    # The checkout's own (uncommitted) sources, to be put back after a run.
    (repo / "csrc" / "k.cu").write_text("checkout")
    (repo / "tests" / "test_k.py").write_text("checkout")
    monkeypatch.setattr(module, "ROOT", repo)
    monkeypatch.setattr(module, "AB", repo / ".ab")
    monkeypatch.delenv("OUT", raising=False)
    return module, repo


def test_export_takes_csrc_and_tests_of_each_revision(ab):
    module, repo = ab
    module.export(["old", "new"])
    for rev in ("old", "new"):
        assert (repo / ".ab" / rev / "csrc" / "k.cu").read_text() == rev
        assert (repo / ".ab" / rev / "tests" / "test_k.py").read_text() == rev
    assert [line.split()[0] for line in (repo / ".ab" / "order").read_text().split("\n") if line] == ["old", "new"]


def test_run_swaps_each_trees_csrc_and_tests_in_and_puts_the_checkouts_back(ab, monkeypatch, capsys):
    module, repo = ab
    module.export(["old", "new"])
    seen = []  # (step, csrc/k.cu, tests/test_k.py) in the checkout when each step ran
    prep_ms = {"old": "0.400", "new": "0.300"}

    def fake_run(cmd, cwd=None, capture_output=False, text=False, timeout=None, **kwargs):
        step = "build" if "cake_ops.build" in cmd else "time" if any("gdn_fwd_gpu_check" in c for c in cmd) else "pytest"
        tree = (repo / "csrc" / "k.cu").read_text()
        seen.append((step, tree, (repo / "tests" / "test_k.py").read_text()))
        out = {"build": "built", "pytest": "1 passed"}.get(step, "")
        if step == "time":
            out = f"s64k_h16   det      kernels   0.9 ms/call  busy 0.9  [F1 prep {prep_ms[tree]}  F4 walk 0.600]"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    assert module.run("s64k_h16", tests=True, trees=None, rounds=2) == 0
    # Palindromic order, each tree's own tests beside its kernels, tested on the first visit only.
    assert [(s, c) for s, c, _ in seen if s != "build"] == [
        ("time", "old"), ("pytest", "old"), ("time", "new"), ("pytest", "new"), ("time", "new"), ("time", "old"),
    ]
    assert all(csrc == tests for _, csrc, tests in seen)
    assert (repo / "csrc" / "k.cu").read_text() == "checkout"
    assert (repo / "tests" / "test_k.py").read_text() == "checkout"
    assert not (repo / ".ab" / "_checkout").exists()
    table = capsys.readouterr().out.split("===== kernel ms per call")[1]
    assert "s64k_h16   det old" in table and "[prep 0.400  walk 0.600]  rounds 1.000 1.000" in table
    assert "s64k_h16   det new" in table and "[prep 0.300  walk 0.600]  rounds 0.900 0.900" in table


def test_run_puts_the_checkout_back_when_a_step_raises(ab, monkeypatch):
    module, repo = ab
    module.export(["old"])

    def broken_run(cmd, **kwargs):
        if "cake_ops.build" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout="built", stderr="")
        raise subprocess.TimeoutExpired(cmd, 300)

    monkeypatch.setattr(module.subprocess, "run", broken_run)
    with pytest.raises(subprocess.TimeoutExpired):
        module.run("s64k_h16", tests=False, trees=None)
    assert (repo / "csrc" / "k.cu").read_text() == "checkout"
    assert (repo / "tests" / "test_k.py").read_text() == "checkout"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
