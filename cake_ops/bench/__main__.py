"""Benchmark of GDN training ops against the public peers: ``python -m cake_ops.bench``.

The command line: parses the flags, then in one process on one device measures the
bf16 matmul rate (the floor), loads the arms, checks every arm and op against the FP64
reference, times every (shape, op) cell and prints the table (``--kernels``: and the
per-kernel split), and writes the JSON (``--json``). ``--cp N``: context parallel
instead, one process a device, the slowest rank against the single device
(``cake_ops.bench.kcp_devices``); ``--cp N --emulate``: its ranks as threads on this one
device, their per-rank compute (``cake_ops.bench.kcp``). ``--cp 1,2,4,8``: each degree
in turn, then the scaling curve (``format_kcp_scaling``).

Interrupted (SIGTERM, e.g. from ``timeout``, or Ctrl-C) while timing: the cells timed
so far are still summarised, printed and written; a timing not finished for a cell is
null and listed in the row's ``untimed``, and the meta says where it stopped. A cold
machine spends minutes in the peers' compiles and autotuning, so a run cut short by a
time limit still reports what it measured.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .accuracy import check_accuracy, reference_outputs
from .arms import ARMS, OPS, load_arms
from .report import format_kernels, format_table, make_meta, summarize_rows, write_json
from .shapes import ACCURACY_SHAPE, KCP_SHAPES, QUICK_SHAPES, SHAPES, make_inputs, matmul_tflops
from .timing import Timer, time_cells


class BenchInterrupted(BaseException):
    """SIGTERM during a run (a BaseException, so an arm's ``except Exception`` does not
    take it for that arm's failure)."""


def _raise_interrupted(signum, frame):
    raise BenchInterrupted(signal.Signals(signum).name)


def run(args) -> dict:
    """The whole benchmark for parsed ``args``; returns the report (see cake_ops.bench.report)."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    shapes = [{**SHAPES, **QUICK_SHAPES}[s] for s in args.shapes]
    report: dict[str, Any] = {"meta": make_meta(args, device), "skipped_arms": {}, "accuracy": [], "results": []}
    meta = report["meta"]

    rate = matmul_tflops(device)
    meta["matmul_tflops"] = rate
    print(f"device {meta['device']} | torch {torch.__version__} | bf16 matmul {rate:.3g} TFLOP/s | gate {args.gate} | cu_seqlens {args.cu_seqlens}", flush=True)

    arms = load_arms(args.arms, device)
    for arm in arms:
        if arm.skip:
            report["skipped_arms"][arm.name] = arm.skip
            print(f"skip {arm.name}: {arm.skip}", flush=True)
    arms = [a for a in arms if not a.skip]

    # Accuracy on the small packed shape, every arm and op, before any timing.
    acc_inp = make_inputs(ACCURACY_SHAPE, device, args.gate, args.seed + 1)
    ref_o, ref_grads = reference_outputs(acc_inp)
    passed: dict[tuple[str, str], bool] = {}
    for arm in arms:
        for op in args.ops:
            entry = check_accuracy(arm, op, acc_inp, ref_o, ref_grads)
            report["accuracy"].append(entry)
            passed[(arm.name, op)] = entry["ok"]
            worst = max(entry["rel_rms"].values(), default=math.nan)
            status = "ok" if entry["ok"] else f"FAIL, not timed ({entry['error']})"
            if entry["ok"] and not entry["contract_ok"]:
                status += " (max-abs over the contract's 2e-2, docs/contract.md)"
            print(f"accuracy {arm.name:9s} {op:7s} worst rel-RMS {worst:.2e}: {status}", flush=True)
    del acc_inp

    timer = Timer(device)
    rows: dict[tuple[str, str, str], dict] = {}
    timed: set[tuple[str, str, str]] = set()  # (shape, op, timing) of the cells finished
    try:
        time_cells(args, shapes, arms, passed, rate, timer, rows, timed, meta)
    except (BenchInterrupted, KeyboardInterrupt) as e:
        meta["interrupted"] = f"{str(e) or type(e).__name__} while timing {meta['timing_now']}"
        print(f"interrupted: {meta['interrupted']}; reporting the cells timed so far", flush=True)
    meta.pop("timing_now", None)
    report["results"] = summarize_rows(rows, timed)
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cake_ops.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help=f"comma list; default all of {','.join(SHAPES)} (--quick: {','.join(QUICK_SHAPES)}; "
                                    f"with --cp: all of {','.join(KCP_SHAPES)}, and the others may be named)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(OPS)}")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--groups", type=int, default=3, help="timing groups, >= 3 (default 3)")
    p.add_argument("--calls", type=int, help="calls per arm appearance and timing (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, help="warm-up calls per arm and cell (default 3; --quick 1)")
    p.add_argument("--gate", default="mamba", choices=("mamba", "logsigmoid"), help="distribution of g (see cake_ops.bench.shapes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cu-seqlens", default="same", choices=("same", "fresh"),
        help="same tensor every call (default: a training step's later layers) or fresh copies (its first layer)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", help="write the report here (allow_nan=False; non-finite -> null)")
    p.add_argument("--kernels", action="store_true", help="also print each row's per-kernel times (always in the JSON)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few calls: a smoke test that also runs on a CPU")
    p.add_argument("--cp", default=None, metavar="N[,N...]",
                   help="context parallel over N ranks (cake_ops.kcp), one process a device (NCCL; gloo with "
                        "--device cpu; spawned, or torchrun's): the slowest rank against the single device; "
                        "a comma list runs each degree in turn and adds the scaling curve")
    p.add_argument("--emulate", action="store_true", help="with --cp: the ranks as threads on this one device "
                   "(per-rank compute and bytes)")
    p.add_argument("--layout", default="C", choices=("C", "Z", "D"), help="with --cp: the KCP layout")
    p.add_argument("--align", type=int, default=4096, metavar="TOKENS",
                   help="with --cp: build_context_kcp's align (default GRID_ALIGN, 4096: bitwise deterministic KCP; "
                        "1: the layout's exact cuts)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv

    def split(s: str, allowed: Sequence[str], what: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            p.error(f"--{what}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
        return list(dict.fromkeys(items))

    args.cp_degrees = None
    if args.cp is not None:
        try:
            degrees = [int(x) for x in args.cp.split(",") if x.strip()]
        except ValueError:
            p.error(f"--cp: a comma list of integers, got {args.cp!r}")
        if not degrees or min(degrees) < 1:
            p.error("--cp N needs N >= 1")
        args.cp_degrees = list(dict.fromkeys(degrees))
        args.cp = args.cp_degrees[0]
    default_shapes = QUICK_SHAPES if args.quick else (KCP_SHAPES if args.cp is not None else SHAPES)
    known = list(SHAPES) + list(QUICK_SHAPES) + (list(KCP_SHAPES) if args.cp is not None else [])
    args.shapes = split(args.shapes or ",".join(default_shapes), known, "shapes")
    args.ops = split(args.ops, OPS, "ops")
    args.arms = [a for a in ARMS if a in split(args.arms, ARMS, "arms")]  # canonical (palindrome) order
    args.calls = args.calls if args.calls is not None else (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.groups < 3:
        p.error("--groups must be >= 3 (docs/benchmark.md, Protocol)")
    if args.calls < 1 or args.warmup < 0:
        p.error("--calls must be >= 1 and --warmup >= 0")
    if args.emulate and args.cp is None:
        p.error("--emulate goes with --cp N")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Parse argv (default sys.argv[1:]), run, print the table(s), write the JSON; the report."""
    args = parse_args(argv)
    if args.cp is not None:
        return _main_kcp(args)
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        report = run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_table(report), flush=True)
    if args.kernels:
        print(format_kernels(report), flush=True)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", flush=True)
    return report


def _main_kcp(args) -> dict | None:
    """``--cp``: each degree in turn, its table printed as it ends, then with several the
    scaling curve. The report: the one degree's, or ``{"degrees": [...], "scaling":
    [...]}``; None on torchrun's ranks other than 0."""
    from .kcp import format_kcp_kernels, format_kcp_scaling, format_kcp_table, kcp_scaling, run_kcp
    from .kcp_devices import format_kcp_devices_table, run_kcp_devices

    if not args.emulate and "WORLD_SIZE" in os.environ and len(args.cp_degrees) > 1:
        raise SystemExit(f"--cp {','.join(map(str, args.cp_degrees))} under torchrun: one degree, its WORLD_SIZE")
    reports = []
    for n in args.cp_degrees:
        one = copy.copy(args)
        one.cp = n
        if args.emulate:
            report = run_kcp(one)
            print(format_kcp_table(report), flush=True)
            if args.kernels:
                print(format_kcp_kernels(report), flush=True)
        else:
            report = run_kcp_devices(one)
            if report is None:  # torchrun's ranks other than 0
                return None
            print(format_kcp_devices_table(report), flush=True)
        reports.append(report)
    if len(reports) == 1:
        report = reports[0]
    else:
        report = {"degrees": reports, "scaling": kcp_scaling(reports)}
        print(format_kcp_scaling(report["scaling"], reports[0]["meta"]), flush=True)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", flush=True)
    return report


if __name__ == "__main__":
    main()
