"""tools/ab_csrc.py without a GPU: export from a scratch git repository, then `run` with
the build, the timing script and pytest replaced by a fake that records what csrc/,
cake_ops/, meta/ and tests/ held in the checkout at each step."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ab_csrc.py"
PARTS = ("csrc", "cake_ops", "meta", "tests")

# The files of each revision (each holds the revision's name): a flat csrc/ with the old
# test file, the same without meta/, and the folder tree with the new one.
REVISIONS = {
    "flat": ["csrc/binding.cpp", "csrc/gdn_fwd.cu", "cake_ops/build.py", "meta/__init__.py",
             "tests/conftest.py", "tests/test_gdn_cuda.py"],
    "flat_no_meta": ["csrc/binding.cpp", "csrc/gdn_fwd.cu", "cake_ops/build.py", "tests/test_gdn_cuda.py"],
    "folders": ["csrc/common/dtype.h", "csrc/gdn/binding.cpp", "csrc/gdn/fwd.cu", "cake_ops/build.py",
                "cake_ops/bench/__init__.py", "meta/__init__.py", "meta/gdn.py", "tests/conftest.py",
                "tests/cuda/test_gdn_fwd_cuda.py"],
    "no_gdn_tests": ["csrc/gdn/fwd.cu", "cake_ops/build.py", "meta/__init__.py", "tests/conftest.py"],
    "with_bwd": ["csrc/gdn/fwd.cu", "csrc/gdn/bwd_chain.cu", "cake_ops/build.py", "meta/__init__.py",
                 "tests/conftest.py", "tests/cuda/test_gdn_bwd_cuda.py", "tests/cuda/test_gdn_bwd_walk_cuda.py"],
}
# The checkout's own, uncommitted tree, to be put back after a run.
CHECKOUT = REVISIONS["folders"] + ["cake_ops/dispatch.py", "tests/op/test_ops.py"]


def _write(repo: Path, files, text: str) -> None:
    for part in PARTS:
        shutil.rmtree(repo / part, ignore_errors=True)
    for relative in files:
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        (repo / relative).write_text(text)


def _state(repo: Path) -> dict[str, str]:
    """Every file of the four swapped folders, by relative path, with its text."""
    return {
        p.relative_to(repo).as_posix(): p.read_text()
        for part in PARTS if (repo / part).is_dir()
        for p in sorted((repo / part).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
    }


def _expected(tree: str) -> dict[str, str]:
    """The checkout while ``tree`` runs: its files, and the checkout's for a part it lacks."""
    state = {f: tree for f in REVISIONS[tree]}
    have = {f.split("/")[0] for f in REVISIONS[tree]}
    state.update({f: "checkout" for f in CHECKOUT if f.split("/")[0] not in have})
    return state


@pytest.fixture()
def ab(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ab_csrc", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    for rev, files in REVISIONS.items():
        _write(repo, files, rev)
        git("add", "-A")
        git("commit", "-q", "-m", rev)
        git("tag", rev)
    _write(repo, CHECKOUT, "checkout")
    monkeypatch.setattr(module, "ROOT", repo)
    monkeypatch.setattr(module, "AB", repo / ".ab")
    monkeypatch.delenv("OUT", raising=False)
    return module, repo


def test_the_swap_set_is_the_sources_the_build_the_fakes_and_the_tests(ab):
    module, _ = ab
    assert module.SWAPPED == PARTS


def test_export_takes_the_four_parts_of_each_revision(ab):
    module, repo = ab
    module.export(list(REVISIONS))
    for rev, files in REVISIONS.items():
        exported = repo / ".ab" / rev
        assert _state(exported) == {f: rev for f in files}, rev  # a part the revision lacks is left out
    assert [line.split()[0] for line in (repo / ".ab" / "order").read_text().split("\n") if line] == list(REVISIONS)
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}


def _fake(repo, seen, prep_ms, fail_build=()):
    """subprocess.run for the build, the timer and pytest: records the step, the tree
    the checkout held (every file of the four parts) and pytest's test file."""

    def fake_run(cmd, cwd=None, capture_output=False, text=False, timeout=None, **kwargs):
        step = "build" if "cake_ops.build" in cmd else "time" if any("gdn_fwd_gpu_check" in c for c in cmd) else "pytest"
        tree = (repo / "cake_ops" / "build.py").read_text()
        test_file = None
        if step == "pytest":
            test_file = next(c for c in cmd if c.endswith(".py"))
            assert (repo / test_file).read_text() == tree  # the tree's own test file, present
        seen.append((step, tree, _state(repo), test_file))
        if step == "build" and tree in fail_build:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="nvcc: error")
        out = {"build": "built", "pytest": "1 passed"}.get(step, "")
        if step == "time":
            out = f"s64k_h16   det      kernels   0.9 ms/call  busy 0.9  [F1 prep {prep_ms[tree]}  F4 walk 0.600]"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    return fake_run


def test_run_swaps_each_trees_four_parts_in_and_puts_the_checkouts_back(ab, monkeypatch, capsys):
    module, repo = ab
    module.export(["flat", "flat_no_meta", "folders"])
    seen = []
    prep_ms = {"flat": "0.400", "flat_no_meta": "0.350", "folders": "0.300"}
    monkeypatch.setattr(module.subprocess, "run", _fake(repo, seen, prep_ms))
    assert module.run("s64k_h16", tests=True, trees="flat,folders,flat_no_meta", rounds=2) == 0
    # Palindromic order (in export order), each tree tested on its first visit only.
    assert [(step, tree) for step, tree, _, _ in seen if step != "build"] == [
        ("time", "flat"), ("pytest", "flat"), ("time", "flat_no_meta"), ("pytest", "flat_no_meta"),
        ("time", "folders"), ("pytest", "folders"),
        ("time", "folders"), ("time", "flat_no_meta"), ("time", "flat"),
    ]
    # At every step the checkout held exactly the tree's csrc/, cake_ops/, meta/ and tests/
    # (nothing of the checkout's or another tree's), the checkout's meta/ where it has none.
    for step, tree, state, _ in seen:
        assert state == _expected(tree), (step, tree)
    # The GDN-forward tests of the tree's own layout.
    assert {tree: test for step, tree, _, test in seen if step == "pytest"} == {
        "flat": "tests/test_gdn_cuda.py", "flat_no_meta": "tests/test_gdn_cuda.py",
        "folders": "tests/cuda/test_gdn_fwd_cuda.py",
    }
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}
    assert not (repo / ".ab" / "_checkout").exists()
    out = capsys.readouterr().out
    assert "tests tests/cuda/test_gdn_fwd_cuda.py: 1 passed" in out
    table = out.split("===== kernel ms per call")[1]
    assert "s64k_h16   det flat " in table and "[prep 0.400  walk 0.600]  rounds 1.000 1.000" in table
    assert "s64k_h16   det folders " in table and "[prep 0.300  walk 0.600]  rounds 0.900 0.900" in table


def test_a_tree_without_gdn_tests_fails_and_the_checkout_comes_back(ab, monkeypatch, capsys):
    module, repo = ab
    module.export(["no_gdn_tests", "folders"])
    seen = []
    monkeypatch.setattr(module.subprocess, "run", _fake(repo, seen, {"no_gdn_tests": "0.5", "folders": "0.3"},
                                                        fail_build=("folders",)))
    assert module.run("s64k_h16", tests=True, trees=None) == 1
    assert [(step, tree) for step, tree, _, _ in seen] == [
        ("build", "no_gdn_tests"), ("time", "no_gdn_tests"), ("build", "folders"),
    ]
    out = capsys.readouterr().out
    assert "FAILED: no_gdn_tests: tests, folders: build" in out
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}


def test_fwdbwd_times_by_the_trees_bench_and_runs_its_backward_tests(ab, monkeypatch, capsys):
    """--op fwdbwd: the tree's own cake_ops.bench (cake arm, fwdbwd), its JSON's kernel
    split and peak memory in the table; the tree's tests/cuda/test_gdn_bwd*.py, all of
    them; a tree without them fails its tests."""
    import json

    module, repo = ab
    module.export(["with_bwd", "no_gdn_tests"])
    seen = []

    def fake_run(cmd, cwd=None, capture_output=False, text=False, timeout=None, **kwargs):
        tree = (repo / "cake_ops" / "build.py").read_text()
        if "cake_ops.build" in cmd:
            seen.append(("build", tree, None))
        elif "cake_ops.bench" in cmd:
            assert cmd[cmd.index("--ops") + 1] == "fwdbwd" and cmd[cmd.index("--arms") + 1] == "cake"
            local = 2.0 if tree == "with_bwd" else 3.0
            cells = [{"shape": "s32k_h16", "op": "fwdbwd", "arm": "cake", "error": None,
                      "peak_mem_bytes": 3424 * 2**20,
                      "kernels": {"cake::gdn_bwd_local_kernel": local,
                                  "cake::gdn_fwd_walk_kernel<(cake::gdn_walk::WalkMode)0, 2>": 0.5,
                                  "cake::gdn_fwd_walk_kernel<(cake::gdn_walk::WalkMode)2, 2>": 0.25}}]
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"results": cells}))
            seen.append(("bench", tree, None))
        else:
            assert cmd[cmd.index("-n") + 1] == "3"  # --test-workers
            seen.append(("pytest", tree, [c for c in cmd if c.endswith(".py")]))
            return subprocess.CompletedProcess(cmd, 0, stdout="9 passed", stderr="")
        return subprocess.CompletedProcess(cmd, 0, stdout="built", stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    assert module.run("s32k_h16", tests=True, trees=None, op="fwdbwd", test_workers=3) == 1
    assert seen == [
        ("build", "with_bwd", None), ("bench", "with_bwd", None),
        ("pytest", "with_bwd", ["tests/cuda/test_gdn_bwd_cuda.py", "tests/cuda/test_gdn_bwd_walk_cuda.py"]),
        ("build", "no_gdn_tests", None), ("bench", "no_gdn_tests", None),
    ]
    out = capsys.readouterr().out
    table = out.split("===== kernel ms per call")[1]
    assert ("s32k_h16   fwdbwd with_bwd                 2.750  [gdn_bwd_local_kernel 2.000  "
            "gdn_fwd_walk_kernel_mode_0_2 0.500  gdn_fwd_walk_kernel_mode_2_2 0.250]  peak 3424 MiB") in table
    assert "s32k_h16   fwdbwd no_gdn_tests             3.750" in table
    assert "FAILED: no_gdn_tests: tests" in out
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}


def test_bits_saved_by_each_tree_on_its_first_visit_and_compared_at_the_close(ab, monkeypatch, capsys):
    """--bits: tools/gdn_bits.py save while the tree is swapped in (once a tree, over all
    rounds, into a file by its name), then one compare of the files in export order, its
    report printed; a tree whose save fails is listed as failed and left out of it."""
    module, repo = ab
    module.export(["flat", "flat_no_meta", "folders"])
    (repo / ".ab" / "_bits").mkdir()
    (repo / ".ab" / "_bits" / "stale.pt").write_text("an earlier run's")
    seen = []

    def fake_run(cmd, cwd=None, capture_output=False, text=False, timeout=None, **kwargs):
        tree = (repo / "cake_ops" / "build.py").read_text()
        if "tools/gdn_bits.py" in cmd and "save" in cmd:
            path = Path(cmd[cmd.index("save") + 1])
            assert cmd[cmd.index("--shapes") + 1] == "s64k_h16"
            seen.append(("save", tree, path.name))
            if tree == "flat_no_meta":
                return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ImportError")
            path.write_text(tree)
            return subprocess.CompletedProcess(cmd, 0, stdout="saved", stderr="")
        if "tools/gdn_bits.py" in cmd:
            files = [Path(c).name for c in cmd[cmd.index("compare") + 1:]]
            seen.append(("compare", tree, files))
            return subprocess.CompletedProcess(cmd, 1, stdout="s64k_h16: folders differs from flat: dq 3 of 8", stderr="")
        if "cake_ops.build" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout="built", stderr="")
        out = "s64k_h16   det      kernels   0.9 ms/call  busy 0.9  [F1 prep 0.400  F4 walk 0.600]"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    assert module.run("s64k_h16", tests=False, trees=None, rounds=2, bits=True) == 1
    assert seen == [
        ("save", "flat", "flat.pt"), ("save", "flat_no_meta", "flat_no_meta.pt"), ("save", "folders", "folders.pt"),
        ("compare", "checkout", ["flat.pt", "folders.pt"]),
    ]
    out = capsys.readouterr().out
    assert "===== bits" in out and "s64k_h16: folders differs from flat: dq 3 of 8" in out
    assert "FAILED: flat_no_meta: bits" in out
    assert not (repo / ".ab" / "_bits" / "stale.pt").exists()
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}


def test_run_puts_the_checkout_back_when_a_step_raises(ab, monkeypatch):
    module, repo = ab
    module.export(["flat"])

    def broken_run(cmd, **kwargs):
        if "cake_ops.build" in cmd:
            assert _state(repo) == _expected("flat")
            return subprocess.CompletedProcess(cmd, 0, stdout="built", stderr="")
        raise subprocess.TimeoutExpired(cmd, 300)

    monkeypatch.setattr(module.subprocess, "run", broken_run)
    with pytest.raises(subprocess.TimeoutExpired):
        module.run("s64k_h16", tests=False, trees=None)
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_deadline_starts_no_visit_that_would_end_past_it_and_still_closes(ab, monkeypatch, capsys):
    """--deadline: with every build and bench taking 10 s of a fake clock, a 50 s deadline runs
    the first round of two trees (20 s each) and not the second round's visits (each expected
    to take 20 s more at 40 s); the table gives what ran, and the checkout comes back."""
    import json

    module, repo = ab
    module.export(["with_bwd", "folders"])
    clock = [0.0]
    calls = []

    def fake_run(cmd, cwd=None, capture_output=False, text=False, timeout=None, **kwargs):
        clock[0] += 10.0
        tree = (repo / "cake_ops" / "build.py").read_text()
        calls.append(tree)
        if "cake_ops.bench" in cmd:
            cells = [{"shape": "s32k_h16", "op": "fwdbwd", "arm": "cake", "error": None, "peak_mem_bytes": 2**30,
                      "kernels": {"cake::gdn_bwd_local_kernel": 1.0}}]
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"results": cells}))
        return subprocess.CompletedProcess(cmd, 0, stdout="built", stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    assert module.run("s32k_h16", tests=False, trees=None, rounds=3, op="fwdbwd", deadline=50) == 0
    assert calls == ["with_bwd", "with_bwd", "folders", "folders"]
    out = capsys.readouterr().out
    assert "deadline: 50 s; visits 3 .. 6 not started" in out
    table = out.split("===== kernel ms per call")[1]
    assert "with_bwd" in table and "folders" in table and "rounds" in table
    assert _state(repo) == {f: "checkout" for f in CHECKOUT}



def test_a_failing_test_is_named_in_the_log(ab, monkeypatch, capsys):
    """A tree whose backward tests fail: the log holds pytest's FAILED lines and the tail of
    its report, not only the count (the device call that ran it may be the session's last)."""
    module, repo = ab
    module.export(["with_bwd"])
    report = ("F\n___ test_relay ___\nE   AssertionError: dh0\n"
              "FAILED tests/cuda/test_gdn_bwd_cuda.py::test_relay[G1] - AssertionError: dh0\n1 failed, 33 passed")

    def fake_run(cmd, cwd=None, capture_output=False, text=False, timeout=None, **kwargs):
        if "pytest" in cmd:
            assert "-rfE" in cmd
            return subprocess.CompletedProcess(cmd, 1, stdout=report, stderr="")
        if "cake_ops.bench" in cmd:
            Path(cmd[cmd.index("--json") + 1]).write_text('{"results": []}')
        return subprocess.CompletedProcess(cmd, 0, stdout="built", stderr="")

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    assert module.run("s32k_h16", tests=True, trees=None, op="fwdbwd") == 1
    out = capsys.readouterr().out
    assert "tests tests/cuda/test_gdn_bwd_cuda.py tests/cuda/test_gdn_bwd_walk_cuda.py: 1 failed, 33 passed" in out
    assert "FAILED tests/cuda/test_gdn_bwd_cuda.py::test_relay[G1] - AssertionError: dh0" in out
    assert "E   AssertionError: dh0" in out
    assert "FAILED: with_bwd: tests" in out
