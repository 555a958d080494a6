#!/usr/bin/env python
"""One-shot GPU check of the CUDA GDN forward (csrc/gdn/fwd*.cu): build, tests, timings.

    python tools/gdn_fwd_gpu_check.py [--no-tests] [--segments 0,16,32,64] [--splits 1,2]
                                      [--shapes s16k_long,s32k_h2]   # repo root, Hopper GPU

Stages, each guarded so that one failure does not hide the others:
  1. environment: torch, CUDA, device;
  2. build: cake_ops.build.load() (JIT, cached), plus ptxas register / spill lines and
     the tensor-core instructions (HGMMA, HMMA) of the kernels, compiled again here with -Xptxas -v;
  3. tests: tests/cuda/test_gdn_fwd_cuda.py through pytest.main (accuracy against FP64,
     determinism, CUDA graphs, the six benchmark shapes against FP64);
  4. timing: the six benchmark shapes (docs/benchmark.md, Shapes) (mamba gate, in-op L2 norm): median of 20
     CUDA-event-timed calls after warm-up, then per-kernel device time from
     torch.profiler in a second pass (CUPTI slows launches once attached), against
     the FLOP floor at 790 TFLOP/s; for the deterministic and the non-deterministic plan,
     and per kernel for each forced cut grid of --segments (in chunks, 0 = uncut); with
     --splits, each of those again with the walks' value-column split forced (1 or 2).
     --shapes limits the timings to the shapes named.
Everything printed also goes to $OUT/gdn_fwd_gpu_check.log when $OUT is set.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)

import torch  # noqa: E402

# The files of the folder layout, then those of the flat csrc/ and tests/ of older trees
# (tools/ab_csrc.py runs this script on trees of either kind).
KERNEL_SOURCES = (("gdn/fwd_prep.cu", "gdn_fwd_prep.cu"), ("gdn/fwd_walk.cu", "gdn_fwd_walk.cu"),
                  ("gdn/fwd_chain.cu", "gdn_fwd_chain.cu"))
GDN_TESTS = ("tests/cuda/test_gdn_fwd_cuda.py", "tests/test_gdn_cuda.py")


def _first_present(paths, root=ROOT) -> Path:
    for path in paths:
        if (root / path).is_file():
            return root / path
    raise FileNotFoundError(f"none of {', '.join(paths)} under {root}")


PEAK_TFLOPS = 790.0
HBM_TBPS = 4.2
WARMUP, CALLS, PROFILED_CALLS = 3, 20, 5
FAILED: list[str] = []


class Tee:
    def __init__(self, *streams):
        self.streams = [s for s in streams if s is not None]

    def write(self, data):
        for s in self.streams:
            s.write(data)
            s.flush()
        return len(data)

    def flush(self):
        for s in self.streams:
            s.flush()

    def isatty(self):
        return False

    def fileno(self):
        return self.streams[0].fileno()


@contextlib.contextmanager
def stage(name: str):
    print(f"\n===== {name} =====", flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - report and go on
        if isinstance(e, KeyboardInterrupt):
            raise
        FAILED.append(name)
        print(f"!!!!! stage {name} failed: {type(e).__name__}: {e}")
        traceback.print_exc()
    print(f"----- {name}: {time.perf_counter() - start:.1f} s", flush=True)


def environment():
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"device {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()} "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    from torch.utils import cpp_extension

    print(f"CUDA_HOME {cpp_extension.CUDA_HOME}")


def compile_stats():
    """ptxas -v for each GDN kernel file, and the tensor-core instructions of its SASS."""
    from torch.utils import cpp_extension

    home = Path(cpp_extension.CUDA_HOME or "/usr/local/cuda")
    nvcc = home / "bin" / "nvcc"
    cuobjdump = home / "bin" / "cuobjdump"
    if not nvcc.is_file():
        print(f"no nvcc at {nvcc}: skipping ptxas stats")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for names in KERNEL_SOURCES:
            path = _first_present(names, ROOT / "csrc")
            src = path.relative_to(ROOT / "csrc").as_posix()
            obj = Path(tmp) / (src.replace("/", "__") + ".o")
            # -I the csrc root: the folder layout's includes are relative to it.
            cmd = [str(nvcc), "-c", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-O3",
                   "-std=c++17", f"-I{ROOT / 'csrc'}", str(path), "-o", str(obj)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            for line in (r.stdout + r.stderr).splitlines():
                if any(w in line for w in ("Compiling entry", "registers", "spill", "error", "warning", "C75")):
                    print(f"  {src}: {line.strip()}")
            if cuobjdump.is_file() and obj.is_file():
                sass = subprocess.run([str(cuobjdump), "--dump-sass", str(obj)], capture_output=True, text=True).stdout
                print(f"  {src}: SASS HGMMA (wgmma) {sass.count('HGMMA')}, HMMA (mma.sync) {sass.count('HMMA')}")


def run_tests() -> int:
    import pytest

    args = [str(_first_present(GDN_TESTS)), "-q", "-rA", "-p", "no:cacheprovider"]
    if os.environ.get("OUT"):
        args.append(f"--junitxml={Path(os.environ['OUT']) / 'test_gdn_cuda.xml'}")
    class Outcomes:
        def __init__(self):
            self.counts = {"passed": 0, "failed": 0, "skipped": 0}

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1

    outcomes = Outcomes()
    rc = int(pytest.main(args, plugins=[outcomes]))
    print(f"pytest exit code {rc}, outcomes {outcomes.counts}")
    if rc != 0:
        raise RuntimeError(f"tests failed (pytest exit code {rc})")
    if outcomes.counts["skipped"]:
        raise RuntimeError(f"{outcomes.counts['skipped']} tests were skipped on the GPU machine")
    return rc


def bench_inputs(shape, deterministic=True, segment_chunks=-1, value_splits=-1):
    from cake_ops.bench import make_inputs

    inp = make_inputs(shape, torch.device("cuda"), "mamba", seed=0)
    return (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_seqlens, None, shape.K**-0.5, True, deterministic,
            segment_chunks, value_splits)


def floors_ms(shape):
    from cake_ops.bench import chunks_per_head, fwd_flop_per_head_chunk

    flop = chunks_per_head(shape.docs) * shape.HV * fwd_flop_per_head_chunk(shape.K, shape.V, shape.HV // shape.H)
    T = shape.T
    bytes_ = 2 * T * shape.H * shape.K * 2 + 2 * T * shape.HV * shape.V * 2 + 2 * T * shape.HV * 4
    return flop / (PEAK_TFLOPS * 1e12) * 1e3, bytes_ / (HBM_TBPS * 1e12) * 1e3


def _event_times(ops, args) -> list[float]:
    """CUDA-event time of CALLS calls, each timed alone (after the caller's warm-up)."""
    times = []
    for _ in range(CALLS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ops.gdn_fwd(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_events(ops, shapes) -> None:
    for shape in shapes:
        try:
            args = bench_inputs(shape)
            for _ in range(WARMUP):
                o, ht = ops.gdn_fwd(*args)
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(o.float()).all()) and bool(torch.isfinite(ht).all())
            times = _event_times(ops, args)
            med = statistics.median(times)
            flop_ms, byte_ms = floors_ms(shape)
            print(f"{shape.name:10s} docs {len(shape.docs):3d} x ~{shape.T // len(shape.docs):5d}  (H, HV) = "
                  f"({shape.H:2d}, {shape.HV:2d})  median {med:7.3f} ms  (min {min(times):.3f}, max {max(times):.3f})"
                  f"  floors: flop {flop_ms:.3f} ms, bytes {byte_ms:.3f} ms  -> {flop_ms / med * 100:5.1f} % of "
                  f"tensor peak  finite {finite}")
            del args, o, ht
        except Exception as e:  # noqa: BLE001
            FAILED.append(f"timing {shape.name}")
            print(f"{shape.name}: FAILED {type(e).__name__}: {e}")
            traceback.print_exc()


def _kernel_stage(name: str) -> str:
    if "gdn_fwd_plan" in name:
        return "F0 plan"
    if "gdn_fwd_prep" in name:
        return "F1 prep"
    if "gdn_fwd_walk_kernel<false" in name:
        return "F2 summaries"
    if "gdn_fwd_chain" in name:
        return "F3 chain"
    if "gdn_fwd_walk_kernel<true" in name:
        return "F4 walk"
    return "other"


def _busy_ms(prof, calls: int) -> float:
    """The union of the kernels' device intervals per call: where kernels of a call
    overlap (several streams), their sum overstates the time."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, end = 0.0, -1.0
    for a, b in spans:
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy / 1e3 / calls


def time_profiler(ops, shapes, plans):
    """Per-kernel device time for each plan: (label, deterministic, segment_chunks, value_splits), with
    the busy time (union of kernel intervals) and, measured first (CUPTI then slows
    launches), each plan's CUDA-event median."""
    from torch.profiler import ProfilerActivity, profile

    plan_event_ms = {}
    for shape, (label, *plan) in ((s, p) for s in shapes for p in plans):
        try:
            args = bench_inputs(shape, *plan)
            ops.gdn_fwd(*args)  # warm-up
            plan_event_ms[shape.name, label] = statistics.median(_event_times(ops, args))
        except Exception as e:  # noqa: BLE001
            FAILED.append(f"events {shape.name} {label}")
            print(f"{shape.name} {label}: event timing FAILED {type(e).__name__}: {e}")
    for shape, (label, *plan) in ((s, p) for s in shapes for p in plans):
        try:
            args = bench_inputs(shape, *plan)
            ops.gdn_fwd(*args)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(PROFILED_CALLS):
                    ops.gdn_fwd(*args)
                torch.cuda.synchronize()
            per_stage: dict[str, float] = {}
            for item in prof.key_averages():
                us = getattr(item, "device_time_total", None)
                if us is None:
                    us = getattr(item, "cuda_time_total", 0.0)
                if us and item.key:
                    key = _kernel_stage(item.key)
                    if key == "other" and us < 1.0:
                        continue
                    per_stage[key] = per_stage.get(key, 0.0) + us / 1e3 / PROFILED_CALLS
            total = sum(v for k, v in per_stage.items() if k != "other")
            parts = "  ".join(f"{k} {v:.3f}" for k, v in sorted(per_stage.items()))
            print(f"{shape.name:10s} {label:8s} kernels {total:7.3f} ms/call  busy {_busy_ms(prof, PROFILED_CALLS):.3f}  "
                  f"event {plan_event_ms.get((shape.name, label), float('nan')):.3f}  [{parts}]")
            del args
        except Exception as e:  # noqa: BLE001
            FAILED.append(f"profile {shape.name}")
            print(f"{shape.name} {label}: profiler FAILED {type(e).__name__}: {e}")
            traceback.print_exc()


def main() -> int:
    out_dir = os.environ.get("OUT")
    log = None
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(out_dir) / "gdn_fwd_gpu_check.log", "w")
    sys.stdout = Tee(sys.__stdout__, log)
    sys.stderr = Tee(sys.__stderr__, log)
    # The build cache in a writable place that survives between calls on one machine.
    os.environ.setdefault("CAKE_OPS_CACHE", str(Path(tempfile.gettempdir()) / "cake_ops_cache"))

    ops = None
    with stage("environment"):
        environment()
    with stage("build"):
        from cake_ops import build

        start = time.perf_counter()
        ops = build.load()
        print(f"built/loaded {build.cache_dir() / build.build_key()} in {time.perf_counter() - start:.1f} s")
    with stage("compile stats"):
        compile_stats()
    if "--no-tests" not in sys.argv[1:]:
        with stage("tests"):
            run_tests()
    if ops is not None:
        from cake_ops.bench import SHAPES

        def option(name):
            return sys.argv[sys.argv.index(name) + 1].split(",") if name in sys.argv else []

        shapes = [SHAPES[n] for n in option("--shapes")] or list(SHAPES.values())
        with stage("timing (CUDA events, back to back)"):
            time_events(ops, shapes)
        plans = [("det", True, -1, -1), ("nd", False, -1, -1)]
        plans += [(f"cut{g}", True, int(g), -1) for g in option("--segments")]
        plans += [(f"{label}/s{n}", d, g, int(n)) for n in option("--splits") for label, d, g, _ in list(plans)]
        with stage("timing (profiler, per kernel)"):
            time_profiler(ops, shapes, plans)
    print(f"\n===== summary: {'all stages passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)} =====")
    if log is not None:
        sys.stdout.flush()
        log.close()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
