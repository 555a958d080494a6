#!/usr/bin/env python
"""A/B the CUDA sources of several revisions in one device call.

Here (with git), export each revision's csrc/, cake_ops/, meta/ and tests/ into .ab/
(git-ignored):

    python tools/ab_csrc.py export main try/p-one-product try/no-qkn

There (the device, which gets the working tree without .git; carry ".ab"):

    python tools/ab_csrc.py run [--shapes s64k_h16,s256k_h2] [--tests] [--trees main,try_x] [--rounds 2]
    python tools/ab_csrc.py run --op fwdbwd [--shapes s32k_h16,s64k_h16] [--tests] [--bits] ...

For each exported tree in the order given: its csrc/, cake_ops/, meta/ and tests/ are
swapped in (so each tree builds with its own cake_ops/build.py: a flat csrc/ of old
revisions such as 6ed5175 and the folder tree of newer ones alike), built into
$CAKE_OPS_CACHE (a key per tree), timed per kernel with the checkout's
tools/gdn_fwd_gpu_check.py --no-tests (deterministic and non-deterministic plans; it
imports the tree's cake_ops.bench), and with --tests checked by the tree's own GPU
tests of the GDN forward (tests/cuda/test_gdn_fwd_cuda.py, or tests/test_gdn_cuda.py in
old trees: whichever the tree has), so a branch's new tests run with its kernels. With
--op fwdbwd the timer is the tree's own `python -m cake_ops.bench --arms cake --ops
fwdbwd --kernels --groups 3 --calls 5` (one forward+backward: the kernel split and the
peak memory from its JSON) and the tests are the tree's GPU tests of the backward
(tests/cuda/test_gdn_bwd*.py). A
part a revision does not have stays the checkout's. The checkout's own four folders are
put back at the end, whatever happened. A table of each tree's kernel times per shape and plan closes the output,
which also goes to $OUT/ab_csrc.log when $OUT is set. Trees are timed one after
another; with --rounds R the order is palindromic (A B C, C B A, A B C, ...; each tree
built once, tested on its first visit) and the table gives each tree's mean over the
rounds with the per-round totals: the first tree timed in a call has read 2 % slow
against its usual time. Compare within one call only (the clock and the neighbours of
the machine differ between calls).

With --deadline S (seconds from the start of the run), a visit that would end past it, by
the longest visit of its kind so far (a first visit, with its tests and bits, or a later one),
is not started, nor any after it; the table and the bits' close still come, from what ran. A
device call's own time limit kills the tool with nothing printed: set the deadline under it.

With --bits, each tree on its first visit also saves one forward+backward's outputs and
gradients at the shapes (the checkout's tools/gdn_bits.py, importing the tree's
cake_ops), and the close says per shape whether each tree's bits are those of the first
tree (which tensors differ, and by how much, where they are not): a change meant to keep
the arithmetic shows bitwise equal in the same call. A difference is reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AB = ROOT / ".ab"
# What each exported tree replaces in the checkout while it runs: the sources and the
# build that compiles them (cake_ops/build.py, whose layout rules changed with the
# csrc/ folders), the fake kernels, and the tests that go with them.
SWAPPED = ("csrc", "cake_ops", "meta", "tests")
# The GPU tests of the GDN forward, newest layout first: the first one a tree has is run.
GDN_TESTS = ("tests/cuda/test_gdn_fwd_cuda.py", "tests/test_gdn_cuda.py")
# The backward's: every one the tree has.
GDN_BWD_TESTS = "tests/cuda/test_gdn_bwd*.py"
LINE = re.compile(r"^(\S+)\s+(det|nd)\s+kernels\s+([\d.]+) ms/call.*\[(.*)\]")
KERNEL = re.compile(r"F\d+ (\w+) ([\d.]+)")
PEAK = re.compile(r"peak ([\d.]+)")
BUSY = re.compile(r"busy ([\d.]+)")
STREAM = re.compile(r"stream ([\d.]+)")


def bench_samples(results: list[dict]) -> list[tuple[str, str]]:
    """(shape, sample) per cake fwdbwd cell of a bench JSON's results, the sample in the
    forward timer's bracket form ("F0 <kernel> <ms>  F1 ...", kernels by time, names
    shortened to a word), then "busy <ms>" and "stream <ms>" (the cell's kernel_ms and
    stream_ms: with kernels on two streams the per-kernel times add up to more than the
    device is busy) and "peak <MiB>" (the cell's peak memory)."""
    out = []
    for cell in results:
        if cell.get("arm") != "cake" or cell.get("error") or not cell.get("kernels"):
            continue
        parts, words = [], set()
        for name, ms in sorted(cell["kernels"].items(), key=lambda kv: -kv[1]):
            word = re.sub(r"[^A-Za-z0-9]+", "_", name.replace("cake::gdn_walk::WalkMode", "mode").replace("cake::", ""))
            word = word.strip("_")
            while word in words:  # (a kernel name the bench cut short, twice)
                word += "_"
            words.add(word)
            parts.append(f"F{len(parts)} {word} {ms:.3f}")
        for key, label in (("kernel_ms", "busy"), ("stream_ms", "stream")):
            if isinstance(cell.get(key), (int, float)):
                parts.append(f"{label} {cell[key]:.3f}")
        if cell.get("peak_mem_bytes") is not None:
            parts.append(f"peak {cell['peak_mem_bytes'] / 2**20:.1f}")
        out.append((cell["shape"], "  ".join(parts)))
    return out


def summarize(samples: list[str]) -> str:
    """One table cell from a tree's timings of one (shape, plan), one bracket per round
    ("F0 plan 0.002  F1 prep 0.394  ..."): the mean total and per-kernel means, then
    the per-round totals when there are several."""
    rounds = [{name: float(ms) for name, ms in KERNEL.findall(sample)} for sample in samples]
    totals = [sum(r.values()) for r in rounds]
    names = list(rounds[0])
    means = {n: sum(r.get(n, 0.0) for r in rounds) / len(rounds) for n in names}
    cell = f"{sum(totals) / len(totals):.3f}  [" + "  ".join(f"{n} {means[n]:.3f}" for n in names) + "]"
    for label, pattern in (("busy", BUSY), ("stream", STREAM)):
        values = [float(m.group(1)) for m in (pattern.search(sample) for sample in samples) if m]
        if values:
            cell += f"  {label} {sum(values) / len(values):.3f}"
    peaks = [float(m.group(1)) for m in (PEAK.search(sample) for sample in samples) if m]
    if peaks:
        cell += f"  peak {max(peaks):.0f} MiB"
    if len(samples) > 1:
        cell += "  rounds " + " ".join(f"{t:.3f}" for t in totals)
    return cell


def export(revs: list[str]) -> None:
    if AB.exists():
        shutil.rmtree(AB)
    AB.mkdir()
    names = []
    for rev in revs:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", rev)
        dest = AB / name
        dest.mkdir()
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, *SWAPPED], check=True,
                                capture_output=True, text=True).stdout.split()
        parts = [part for part in SWAPPED if part in listed]  # git archive refuses a path the revision lacks
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *parts], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                             text=True).stdout.strip()
        names.append(f"{name} {sha}")
    (AB / "order").write_text("\n".join(names) + "\n")
    print(f"exported to {AB}: " + ", ".join(names) + '  (carry ".ab" to the device)')


def run(shapes: str, tests: bool, trees: str | None, rounds: int = 1, op: str = "fwd", bits: bool = False,
        deadline: float | None = None, test_workers: int = 1) -> int:
    order = [line.split() for line in (AB / "order").read_text().splitlines() if line.strip()]
    if trees:
        wanted = trees.split(",")
        unknown = [t for t in wanted if t not in {name for name, _ in order}]
        if unknown:
            raise SystemExit(f"--trees: not exported: {', '.join(unknown)} (have {', '.join(n for n, _ in order)})")
        order = [entry for entry in order if entry[0] in wanted]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log = open(out_dir / "ab_csrc.log", "w") if out_dir else None

    def say(text: str) -> None:
        print(text, flush=True)
        if log:
            log.write(text + "\n")
            log.flush()

    bits_dir = AB / "_bits"  # --bits: each tree's tools/gdn_bits.py file, by tree name
    if bits:  # this run's files only
        shutil.rmtree(bits_dir, ignore_errors=True)
        bits_dir.mkdir(parents=True)
    saved = AB / "_checkout"
    for part in SWAPPED:
        shutil.copytree(ROOT / part, saved / part, dirs_exist_ok=False)
    samples: dict[tuple[str, str, str], list[str]] = {}
    failed: list[str] = []
    visits = [entry for r in range(rounds) for entry in (order if r % 2 == 0 else order[::-1])]
    seen: set[str] = set()
    start = time.monotonic()
    took: dict[bool, float] = {}  # the longest visit so far, by whether it was a tree's first
    try:
        for index, (name, sha) in enumerate(visits):
            if any(f.startswith(name + ":") for f in failed):
                continue
            first = name not in seen
            expect = took.get(first, max(took.values(), default=0.0))  # unknown kind: the longest known
            if deadline is not None and time.monotonic() - start + expect > deadline:
                say(f"deadline: {deadline:.0f} s; visits {index + 1} .. {len(visits)} not started "
                    f"(this one would take about {expect:.0f} s more, at {time.monotonic() - start:.0f} s)")
                break
            seen.add(name)
            visit_start = time.monotonic()
            for part in SWAPPED:  # (a tree exported without one of them keeps the checkout's)
                source = AB / name / part if (AB / name / part).exists() else saved / part
                shutil.rmtree(ROOT / part)
                # Without the bytecode of another tree's modules.
                shutil.copytree(source, ROOT / part, ignore=shutil.ignore_patterns("__pycache__"))
            say(f"===== {name} ({sha})")
            build = subprocess.run([sys.executable, "-m", "cake_ops.build"], cwd=ROOT, capture_output=True, text=True)
            say((build.stdout + build.stderr).strip().splitlines()[-1] if (build.stdout + build.stderr).strip() else "")
            if build.returncode != 0:
                failed.append(f"{name}: build")
                say(build.stdout[-3000:] + build.stderr[-3000:])
                continue
            if op == "fwd":
                check = subprocess.run(
                    [sys.executable, "tools/gdn_fwd_gpu_check.py", "--no-tests", "--shapes", shapes],
                    cwd=ROOT, capture_output=True, text=True, timeout=300,
                )
                for line in check.stdout.splitlines():
                    m = LINE.match(line.strip())
                    if m:
                        say(line.strip())
                        samples.setdefault((m.group(1), m.group(2), name), []).append(m.group(4))
            else:
                report = AB / f"_{name}.json"
                bench = subprocess.run(
                    [sys.executable, "-m", "cake_ops.bench", "--arms", "cake", "--ops", "fwdbwd", "--shapes", shapes,
                     "--kernels", "--groups", "3", "--calls", "5", "--json", str(report)],
                    cwd=ROOT, capture_output=True, text=True, timeout=400,
                )
                if bench.returncode != 0 or not report.is_file():
                    failed.append(f"{name}: bench")
                    say(bench.stdout[-3000:] + bench.stderr[-3000:])
                    continue
                for shape, sample in bench_samples(json.loads(report.read_text())["results"]):
                    say(f"{shape} fwdbwd [{sample}]")
                    samples.setdefault((shape, "fwdbwd", name), []).append(sample)
            if bits and first:
                saved_bits = subprocess.run(
                    [sys.executable, "tools/gdn_bits.py", "save", str(bits_dir / f"{name}.pt"), "--shapes", shapes],
                    cwd=ROOT, capture_output=True, text=True, timeout=400,
                )
                if saved_bits.returncode != 0:
                    failed.append(f"{name}: bits")
                    say(saved_bits.stdout[-3000:] + saved_bits.stderr[-3000:])
            if tests and first:
                if op == "fwd":
                    found = [path for path in GDN_TESTS if (ROOT / path).is_file()][:1]
                    wanted = " or ".join(GDN_TESTS)
                else:
                    found = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(GDN_BWD_TESTS))
                    wanted = GDN_BWD_TESTS
                if not found:
                    say(f"tests: the tree has none of {wanted}")
                    failed.append(f"{name}: tests")
                    continue
                pytest = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "--tb=short", *found, "-p", "no:cacheprovider",
                     *(["-n", str(test_workers)] if test_workers > 1 else [])],
                    cwd=ROOT, capture_output=True, text=True, timeout=400,
                )
                lines = pytest.stdout.strip().splitlines() or ["(no output)"]
                say(f"tests {' '.join(found)}: " + lines[-1])
                if pytest.returncode != 0:
                    failed.append(f"{name}: tests")
                    # The failure itself, not only the count: a later call should not be needed to find it.
                    say("\n".join(line for line in lines if line.startswith(("FAILED", "ERROR"))))
                    say(pytest.stdout[-4000:] + pytest.stderr[-2000:])
            took[first] = max(took.get(first, 0.0), time.monotonic() - visit_start)
    finally:
        for part in SWAPPED:
            shutil.rmtree(ROOT / part, ignore_errors=True)
            shutil.copytree(saved / part, ROOT / part)
        shutil.rmtree(saved)
    say("===== kernel ms per call (each tree: the kernels' sum  [per kernel]  (fwdbwd) busy and stream ms"
        + ("  rounds" if rounds > 1 else "") + ")")
    for shape, plan in sorted({(s, p) for s, p, _ in samples}):
        for name, _ in order:
            if (shape, plan, name) in samples:
                say(f"{shape:10s} {plan:3s} {name:24s} {summarize(samples[(shape, plan, name)])}")
    bit_files = [str(bits_dir / f"{name}.pt") for name, _ in order if (bits_dir / f"{name}.pt").is_file()]
    if bits and len(bit_files) > 1:
        compared = subprocess.run([sys.executable, "tools/gdn_bits.py", "compare", *bit_files], cwd=ROOT,
                                  capture_output=True, text=True, timeout=400)
        say("===== bits (tools/gdn_bits.py, against the first tree)")
        say((compared.stdout + compared.stderr).strip())
    if failed:
        say("FAILED: " + ", ".join(failed))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="export the csrc/, cake_ops/, meta/ and tests/ of each revision into .ab/ (needs git)")
    ex.add_argument("revs", nargs="+")
    rn = sub.add_parser("run", help="build, time (and test) each exported tree in turn (needs a Hopper GPU)")
    rn.add_argument("--shapes", default="s64k_h16,s256k_h2,s32k_h16,s16k_long")
    rn.add_argument("--tests", action="store_true", help="also run each tree's own GPU tests: with --op fwd its GDN-forward tests (" + " or ".join(GDN_TESTS) + "), with --op fwdbwd every " + GDN_BWD_TESTS)
    rn.add_argument("--trees", help="comma list of exported tree names (default: all, in export order)")
    rn.add_argument("--rounds", type=int, default=1, help="time the trees this many times, in palindromic order")
    rn.add_argument("--op", choices=("fwd", "fwdbwd"), default="fwd",
                    help="fwd: the forward's kernels (tools/gdn_fwd_gpu_check.py); fwdbwd: one forward+backward "
                    "(the tree's python -m cake_ops.bench), with the backward's tests")
    rn.add_argument("--deadline", type=float, help="seconds from the start after which no visit is started "
                    "that would end past it (by the longest visit of its kind so far)")
    rn.add_argument("--bits", action="store_true",
                    help="compare one forward+backward's outputs and gradients bitwise across the trees (tools/gdn_bits.py)")
    rn.add_argument("--test-workers", type=int, default=1,
                    help="with --tests, run each tree's tests in this many processes (pytest-xdist's -n; the "
                    "FP64 reference's token loops are host-bound)")
    args = parser.parse_args()
    if args.cmd == "export":
        export(args.revs)
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.test_workers < 1:
        parser.error("--test-workers must be >= 1")
    return run(args.shapes, args.tests, args.trees, args.rounds, args.op, args.bits, args.deadline, args.test_workers)


if __name__ == "__main__":
    sys.exit(main())
