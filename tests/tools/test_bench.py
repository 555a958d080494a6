"""The benchmark (cake_ops.bench): its arithmetic, and a CPU smoke run of ``--quick``."""

import contextlib
import json
import math
import os
import signal

import pytest
import torch

from cake_ops.bench import timing
from cake_ops.bench.__main__ import main, parse_args
from cake_ops.bench.accuracy import GRAD_NAMES
from cake_ops.bench.arms import ARMS, FRESH_CU_SEQLENS, OPS, Arm, make_step
from cake_ops.bench.report import format_kernels, format_table, sanitize
from cake_ops.bench.shapes import KCP_SHAPES, QUICK_SHAPES, SHAPES, chunks_per_head, fwd_flop_per_head_chunk, gdn_flop
from cake_ops.bench.timing import (
    busy_us,
    drift,
    is_unstable,
    kernel_split,
    median_split,
    palindrome,
    short_kernel_name,
)


def test_chunks_per_head():
    assert chunks_per_head(SHAPES["s32k_h16"].docs) == 172 + 188 + 153 == 513
    assert chunks_per_head((4096,) * 16) == 16 * 64
    assert chunks_per_head((1, 64, 65)) == 1 + 1 + 2
    assert chunks_per_head(()) == 0


def test_forward_flop_matches_kernels_md():
    # docs/benchmark.md, Timings: 3a + 3b + 2a/G + inverse = 11.7 MFLOP at G = 1, 10.3 at G = 3.
    assert fwd_flop_per_head_chunk(128, 128, 1) == pytest.approx(11.7e6, rel=0.01)
    assert fwd_flop_per_head_chunk(128, 128, 3) == pytest.approx(10.3e6, rel=0.01)
    a, b = 2 * 64 * 64 * 128, 2 * 64 * 128 * 128
    assert fwd_flop_per_head_chunk(128, 128, 2) == pytest.approx(3 * a + 3 * b + a + 2 * 64**3 / 3)


def test_gdn_flop_per_op():
    s = SHAPES["s32k_h16"]
    fwd = gdn_flop(s, "fwd")
    assert fwd == pytest.approx(513 * 48 * fwd_flop_per_head_chunk(128, 128, 3))
    assert gdn_flop(s, "fwdbwd") == pytest.approx(3.9 * fwd)
    assert gdn_flop(s, "ckpt") == pytest.approx(4.9 * fwd)
    # The fwdbwd floor at s32k_h16 is about 1.2 ms (on ~790 TFLOP/s).
    assert gdn_flop(s, "fwdbwd") / 790e12 * 1e3 == pytest.approx(1.25, abs=0.1)


def test_palindrome():
    assert palindrome(["a", "b", "c"]) == ["a", "b", "c", "c", "b", "a"]
    assert palindrome([]) == []
    order = palindrome(range(5))
    mean_pos = {x: sum(i for i, y in enumerate(order) if y == x) / 2 for x in range(5)}
    assert len(set(mean_pos.values())) == 1


def test_drift_and_unstable():
    assert drift([1.0, 1.01, 1.03]) == pytest.approx(0.03 / 1.01)
    assert drift([2.0, 5.0, 2.0]) == 0.0  # first and last only
    assert math.isnan(drift([1.0]))
    assert math.isnan(drift([1.0, math.nan, 1.0]))
    assert math.isnan(drift([0.0, 0.0, 0.0]))
    assert is_unstable(0.021) and not is_unstable(0.02) and not is_unstable(math.nan)


def test_sanitize_makes_strict_json():
    report = {"a": math.nan, "b": [1.0, math.inf, -math.inf, (2, 3.5)], "c": {1: True, "d": None, "e": "x"}}
    clean = sanitize(report)
    assert clean == {"a": None, "b": [1.0, None, None, [2, 3.5]], "c": {"1": True, "d": None, "e": "x"}}
    json.dumps(clean, allow_nan=False)
    with pytest.raises(ValueError):
        json.dumps(report, allow_nan=False)


def test_parse_args():
    args = parse_args(["--quick", "--arms", "torch,cake", "--ops", "fwd"])
    assert args.shapes == list(QUICK_SHAPES) and args.ops == ["fwd"]
    assert args.arms == ["cake", "torch"]  # canonical order, whatever the order asked
    assert args.calls == 2 and args.groups == 3
    full = parse_args([])
    assert full.shapes == list(SHAPES) and full.arms == list(ARMS) and full.ops == list(OPS)
    assert set(SHAPES) == {"s32k_h16", "s64k_h16", "s16k_long", "s256k_h2", "s16k_h8", "s32k_h2"}
    for bad in (["--groups", "2"], ["--arms", "nope"], ["--shapes", "s1"], ["--ops", ""]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_parse_args_cp_degrees_and_their_default_shapes():
    """``--cp``: one degree or a comma list (each once, in the order given); its default
    shapes are the KCP packs, and the other shapes may be named."""
    args = parse_args(["--cp", "1,2,4,8,2"])
    assert args.cp_degrees == [1, 2, 4, 8] and args.cp == 1 and args.shapes == list(KCP_SHAPES)
    assert parse_args(["--cp", "2", "--shapes", "s256k_h2"]).shapes == ["s256k_h2"]
    assert parse_args([]).cp_degrees is None
    for bad in (["--cp", "0"], ["--cp", "2,x"], ["--cp", ","], ["--shapes", "s256k_1doc_h16"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_kcp_shapes_are_quarter_million_token_packs_of_one_to_six_documents():
    """Issue 21's shapes: 262144 tokens (equal parts for FLA's CP at CP 1 to 8), one to
    six documents, at (H, HV) = (16, 48) and at (2, 6)."""
    by_heads = {}
    for s in KCP_SHAPES.values():
        assert s.T == 262144 and min(s.docs) > 0 and s.T % 16 == 0
        by_heads.setdefault((s.H, s.HV), []).append(len(s.docs))
    assert by_heads == {(16, 48): [1, 2, 3, 4, 5, 6], (2, 6): [1, 2, 3, 4, 5, 6]}
    assert not set(KCP_SHAPES) & set(SHAPES)


def test_table_marks_unstable_and_wall_clock():
    row = dict(shape="s", op="fwd", floor_ms=0.1, error=None)
    report = {
        "meta": {"timing": "wall-clock", "matmul_tflops": 1.0},
        "results": [
            {**row, "arm": "cake", "kernel_ms": 1.0, "stream_ms": 2.0, "sync_ms": 3.0,
             "unstable_timings": ["stream_ms"], "cake_over_arm_kernel": 1.0, "cake_over_arm_stream": 1.0,
             "peak_mem_bytes": 3 << 20},
            {**row, "arm": "fla", "kernel_ms": 2.0, "stream_ms": 2.0, "sync_ms": 3.0,
             "unstable_timings": ["kernel_ms"], "cake_over_arm_kernel": 0.5, "cake_over_arm_stream": 1.0,
             "peak_mem_bytes": None},
            {**row, "arm": "torch", "kernel_ms": None, "stream_ms": None, "sync_ms": None,
             "unstable_timings": [], "cake_over_arm_kernel": None, "cake_over_arm_stream": None,
             "error": "failed the accuracy check"},
        ],
    }
    lines = format_table(report).splitlines()
    assert lines[0].split() == [
        "shape", "op", "arm", "kernel_ms", "stream_ms", "sync_ms", "floor_ms", "cake/arm", "cake/arm_s", "peak_MiB",
    ]
    assert "2.000*" in lines[1] and "1.000*" not in lines[1]
    # fla: its kernel_ms is shaky (0.50*), its stream ratio is shaky through cake's stream_ms (1.00*).
    assert lines[2].split()[7:9] == ["0.50*", "1.00*"] and "2.000*" in lines[2]
    assert "failed the accuracy check" in lines[3]
    assert any("NO CUDA" in line for line in lines)
    # peak memory: MiB in the last column, "-" where not measured (no CUDA) or missing.
    assert [line.split()[9] for line in lines[1:4]] == ["3.0", "-", "-"]


def test_kernel_names_are_shortened():
    assert short_kernel_name(
        "void cake::(anonymous namespace)::gdn_fwd_walk_kernel<true, 2>(cake::GdnFwdArgs, cake::WalkMaps)"
    ) == "cake::gdn_fwd_walk_kernel<true, 2>"
    assert short_kernel_name("main_kernel") == "main_kernel"
    assert short_kernel_name("void f<(int)3>(float*)") == "f<(int)3>"
    assert len(short_kernel_name("k" * 200)) == 90


def test_kernel_split_tells_repeated_names_apart_by_rank():
    # Two calls of: main_kernel (1 us), prep (2 us), main_kernel (4 us); plus one stray copy.
    call = [("main_kernel", 1.0), ("void prep(int)", 2.0), ("main_kernel", 4.0)]
    split = kernel_split(call + call + [("Memcpy DtoD", 6.0)], n=2)
    assert split == pytest.approx({"main_kernel#0": 1e-3, "prep": 2e-3, "main_kernel#1": 4e-3, "Memcpy DtoD": 3e-3})
    assert sum(split.values()) == pytest.approx((2 * 7.0 + 6.0) / 1e3 / 2)
    # Medians per kernel over samples; a kernel missing from a sample counts 0 there.
    med = median_split([{"a": 1.0, "b": 3.0}, {"a": 2.0, "b": 5.0}, {"a": 9.0}])
    assert list(med) == ["b", "a"] and med == {"b": 3.0, "a": 2.0}


def test_busy_time_counts_overlapping_kernels_once():
    # One stream: kernels back to back (and a gap) add up.
    assert busy_us([(0.0, 2.0), (2.0, 5.0), (7.0, 8.0)]) == 6.0
    # Two streams: a kernel inside another, one overlapping its end, one after a gap.
    assert busy_us([(0.0, 10.0), (1.0, 4.0), (8.0, 12.0), (20.0, 21.0)]) == 13.0
    assert busy_us([]) == 0.0


def test_kernel_table_lists_each_rows_stages():
    report = {"results": [
        {"shape": "s", "op": "fwd", "arm": "cake", "kernel_ms": 1.0,
         "kernels": {"walk": 0.6, "prep": 0.395, "plan": 0.003, "chain": 0.002}},
        {"shape": "s", "op": "fwd", "arm": "fla", "kernel_ms": None, "error": "x"},
    ]}
    lines = format_kernels(report).splitlines()
    assert lines[1] == "s fwd cake  (kernel_ms 1.000)"
    assert [line.split()[-1] for line in lines[2:]] == ["walk", "prep", "other"]
    assert lines[-1].split()[0] == "0.005"


def test_fresh_cu_seqlens_are_new_tensors_each_call():
    """--cu-seqlens fresh: every call passes another tensor object with the same values,
    more of them than the peers' identity-keyed caches hold (4), so those caches miss;
    by default the one tensor is passed every time."""
    seen = []

    def fn(q, k, v, g, beta, cu):
        seen.append(cu)
        return q * 2

    arm = Arm("spy", batched=False, fn=fn)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    leaves = [torch.ones(5, 1, 2, requires_grad=True) for _ in range(5)]
    step = make_step(arm, "fwd", leaves, cu, torch.ones(5, 1, 2), fresh_cu=True)
    for _ in range(2 * FRESH_CU_SEQLENS):
        step()
    assert FRESH_CU_SEQLENS > 4
    assert all(torch.equal(c, cu) for c in seen)
    ids = [id(c) for c in seen]
    assert len(set(ids)) == FRESH_CU_SEQLENS and all(c is not cu for c in seen)
    assert all(ids[i] != ids[i + 1] for i in range(len(ids) - 1))
    assert all(ids[i] == ids[i + FRESH_CU_SEQLENS] for i in range(FRESH_CU_SEQLENS))
    seen.clear()
    same = make_step(arm, "fwd", leaves, cu, torch.ones(5, 1, 2))
    same(), same()
    assert seen[0] is cu and seen[1] is cu
    assert parse_args(["--cu-seqlens", "fresh"]).cu_seqlens == "fresh"
    assert parse_args([]).cu_seqlens == "same"


def test_quick_run_on_cpu(tmp_path):
    """``--quick`` end to end on the CPU: accuracy against FP64, timings, strict JSON."""
    path = tmp_path / "json"
    ops = ["fwd", "fwdbwd", "ckpt"]
    report = main(
        ["--quick", "--device", "cpu", "--shapes", "q_single", "--calls", "1", "--warmup", "0", "--json", str(path)]
    )
    text = path.read_text()

    def no_constants(name):
        raise AssertionError(f"non-finite {name} in the JSON")

    data = json.loads(text, parse_constant=no_constants)
    assert set(data) == {"meta", "skipped_arms", "accuracy", "results"}
    assert data["meta"]["timing"] == "wall-clock" and data["meta"]["matmul_tflops"] > 0
    # The peers need CUDA: skipped with a message, never an error.
    assert "needs a CUDA device" in data["skipped_arms"]["fla"]
    assert "needs a CUDA device" in data["skipped_arms"]["flashqla"]
    timed = [a for a in ARMS if a not in data["skipped_arms"]]
    assert {"cake", "cake-nd", "cake-aa"} <= set(timed)

    acc = {(e["arm"], e["op"]): e for e in data["accuracy"]}
    assert set(acc) == {(a, op) for a in timed for op in ops}
    for (arm, op), e in acc.items():
        assert e["ok"], (arm, op, e["error"])
        names = {"o"} if op == "fwd" else {"o", *GRAD_NAMES}
        assert set(e["rel_rms"]) == names and all(0 <= x <= 1e-2 for x in e["rel_rms"].values())

    rows = {(r["shape"], r["op"], r["arm"]): r for r in data["results"]}
    assert set(rows) == {("q_single", op, a) for a in timed for op in ops}
    for key, r in rows.items():
        assert r["error"] is None, (key, r["error"])
        assert r["untimed"] == [], key
        for t in ("kernel_ms", "stream_ms", "sync_ms", "floor_ms"):
            assert r[t] is not None and r[t] > 0, (key, t)
        assert len(r["group_medians"]["kernel_ms"]) == 3
        assert set(r["drift"]) == {"kernel_ms", "stream_ms", "sync_ms"}
        assert r["flop"] == pytest.approx(gdn_flop(QUICK_SHAPES["q_single"], r["op"]))
        assert (r["cake_over_arm_kernel"] == 1.0) if r["arm"] == "cake" else r["cake_over_arm_kernel"] > 0
        # Peak memory of one call, every arm and op: null without CUDA.
        assert "peak_mem_bytes" in r and r["peak_mem_bytes"] is None, key
    assert report["results"][0]["shape"] == "q_single"
    table = format_table(report).splitlines()
    assert table[0].split()[-1] == "peak_MiB"
    assert all(line.split()[9] == "-" for line in table[1 : 1 + len(rows)])


def test_sigterm_reports_the_cells_timed_so_far(tmp_path, monkeypatch):
    """A SIGTERM (what ``timeout`` sends) in the profiler pass: the CUDA-event timings
    already taken are still summarised and written, the unfinished ones are null and
    listed in ``untimed``, the meta says where it stopped, and the handler is restored."""
    real_time_cell, calls = timing.time_cell, []

    def time_cell(shape, op, arms, inp, timer, timings, args):
        calls.append((shape.name, op, tuple(timings)))
        if timings == ("kernel_ms",):  # the first cell of the second pass
            os.kill(os.getpid(), signal.SIGTERM)
        return real_time_cell(shape, op, arms, inp, timer, timings, args)

    monkeypatch.setattr(timing, "time_cell", time_cell)
    before = signal.getsignal(signal.SIGTERM)
    path = tmp_path / "json"
    argv = ["--quick", "--device", "cpu", "--shapes", "q_single", "--ops", "fwd,fwdbwd", "--arms", "cake,cake-nd"]
    report = main(argv + ["--calls", "1", "--warmup", "0", "--json", str(path)])
    assert signal.getsignal(signal.SIGTERM) is before
    assert calls == [("q_single", "fwd", ("stream_ms", "sync_ms")), ("q_single", "fwdbwd", ("stream_ms", "sync_ms")),
                     ("q_single", "fwd", ("kernel_ms",))]
    data = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-finite {name}"))
    assert data["meta"]["interrupted"] == "SIGTERM while timing q_single fwd [kernel_ms]"
    assert "timing_now" not in data["meta"]
    rows = {(r["op"], r["arm"]): r for r in data["results"]}
    assert set(rows) == {(op, arm) for op in ("fwd", "fwdbwd") for arm in ("cake", "cake-nd")}
    for key, r in rows.items():
        assert r["error"] is None and r["untimed"] == ["kernel_ms"], key
        assert r["kernel_ms"] is None and r["stream_ms"] > 0 and r["sync_ms"] > 0, key
        assert "peak_mem_bytes" in r, key  # taken in the first pass (null without CUDA)
    assert "INTERRUPTED (SIGTERM while timing q_single fwd [kernel_ms])" in format_table(report)


def test_tools_imports_stay_at_the_package():
    """tools/gdn_fwd_gpu_check.py and tests/cuda import these from cake_ops.bench."""
    import cake_ops.bench as bench
    from cake_ops.bench import shapes

    assert bench.SHAPES is SHAPES and bench.make_inputs is shapes.make_inputs
    assert bench.chunks_per_head is chunks_per_head and bench.fwd_flop_per_head_chunk is fwd_flop_per_head_chunk


def test_peak_memory_is_null_without_cuda():
    calls = []
    assert timing.Timer(torch.device("cpu")).peak_memory(lambda: calls.append(1)) is None
    assert calls == []


def test_arm_context_covers_the_backward_and_the_recompute():
    """An arm's context (the torch arm: cake_ops.pytorch_implementation) is entered
    around the whole call, so the backward, and ckpt's recompute, run inside it too."""
    inside = []
    seen = {"fwd": [], "bwd": []}

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["fwd"].append(bool(inside))
            ctx.save_for_backward(x)  # what ckpt's recompute recomputes
            return x * x

        @staticmethod
        def backward(ctx, dy):
            seen["bwd"].append(bool(inside))
            (x,) = ctx.saved_tensors
            return 2 * x * dy

    @contextlib.contextmanager
    def context():
        inside.append(1)
        try:
            yield
        finally:
            inside.pop()

    def fn(q, k, v, g, beta, cu):
        return Spy.apply(q) + 0 * sum(x.sum() for x in (k, v, g, beta))

    arm = Arm("spy", batched=False, fn=fn, context=context)
    leaves = [torch.ones(5, 1, 2, requires_grad=True) for _ in range(5)]
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for op, n_fwd in (("fwd", 1), ("fwdbwd", 1), ("ckpt", 2)):
        seen["fwd"].clear(), seen["bwd"].clear()
        make_step(arm, op, leaves, cu, torch.ones(5, 1, 2))()
        assert seen["fwd"] == [True] * n_fwd, op
        assert seen["bwd"] == ([] if op == "fwd" else [True]), op
    assert not inside


def test_torch_arm_runs_under_pytorch_implementation():
    import cake_ops
    from cake_ops.bench.arms import load_arms

    (torch_arm,) = load_arms(["torch"], torch.device("cpu"))
    assert torch_arm.skip is None and torch_arm.slow
    assert torch_arm.context is cake_ops.pytorch_implementation
    cake_arm, fla_arm = load_arms(["cake", "fla"], torch.device("cpu"))
    assert cake_arm.context is None and "needs a CUDA device" in fla_arm.skip


def test_cp_emulate_on_cpu(tmp_path):
    """``--cp N --emulate`` end to end on the CPU: gdn_kcp on rank threads checked against
    FP64, the per-rank times and the bytes per collective in strict JSON."""
    path = tmp_path / "json"
    report = main(["--quick", "--device", "cpu", "--shapes", "q_packed", "--calls", "1", "--warmup", "0", "--cp", "2",
                   "--emulate", "--layout", "Z", "--align", "1", "--kernels", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["accuracy"]["ok"] and all(0 <= x <= 1e-2 for x in data["accuracy"]["rel_rms"].values())
    (row,) = data["results"]
    assert row["shape"] == "q_packed" and row["single_ms"] > 0 and row["kcp_all_ranks_ms"] > 0
    assert row["per_rank_ms"] == pytest.approx(row["kcp_all_ranks_ms"] / 2)
    # Each rank alone, its collectives served from a threaded step: the threaded step's bits.
    assert row["alone_bitwise"] and len(row["rank_alone_ms"]) == 2 and min(row["rank_alone_ms"]) > 0
    assert row["slowest_alone_ms"] == max(row["rank_alone_ms"]) == row["rank_alone_ms"][row["slowest_rank"]]
    assert row["rank_alone_peak_bytes"] == [None, None]  # the allocator's peaks: CUDA only
    assert set(row["kernels"]) == {"single", "kcp"}  # per-kernel splits: empty without the profiler
    assert row["comm_bytes_per_rank"]["gdn summaries, forward all-gather"] > 0  # documents cross the boundary
    assert report["meta"]["cp"] == 2 and report["meta"]["layout"] == "Z"
    with pytest.raises(SystemExit):
        main(["--quick", "--emulate"])  # --emulate without --cp


def test_cp_emulate_scaling_curve_on_cpu(tmp_path):
    """``--cp 1,2 --emulate``: each degree's report, and per shape the curve of the slowest
    rank's time alone over the single device's, each degree against its own single-device
    time."""
    path = tmp_path / "json"
    main(["--quick", "--device", "cpu", "--shapes", "q_packed", "--calls", "1", "--warmup", "0", "--cp", "1,2",
          "--emulate", "--align", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert [d["meta"]["cp"] for d in data["degrees"]] == [1, 2]
    assert all(d["accuracy"]["ok"] for d in data["degrees"])
    (row,) = data["scaling"]
    assert row["shape"] == "q_packed" and row["op"] == "fwdbwd" and set(row["by_cp"]) == {"1", "2"}
    for cp, degree in zip(("1", "2"), data["degrees"]):
        (r,) = degree["results"]
        cell = row["by_cp"][cp]
        assert cell["ms"] == pytest.approx(r["slowest_alone_ms"]) and cell["single_ms"] == pytest.approx(r["single_ms"])
        assert cell["over_single"] == pytest.approx(r["slowest_alone_ms"] / r["single_ms"])


@pytest.mark.parametrize("world, layout", [(2, "Z"), (3, "D")])  # D at 3: relays, chained by hops (shifts)
def test_kcp_rank_alone_is_the_threaded_bits_and_notices_other_collectives(world, layout):
    """A rank's step alone (``--emulate``'s per-rank times): served the collectives a
    threaded step received, its outputs and gradients are that step's bits; served other
    values, they are not; served more or fewer calls, or a call of another shape, it fails."""
    from cake_ops.bench.kcp import _EmulatedKcp
    from cake_ops.bench.shapes import make_inputs

    inp = make_inputs(QUICK_SHAPES["q_packed"], torch.device("cpu"), "mamba", 0)
    kcp = _EmulatedKcp(inp, world, layout, 1)
    kcp.record()
    assert all(len(kcp.collectives.calls[r]) > 0 for r in range(world))  # documents cross the boundaries
    for r in range(world):
        alone = kcp.alone(r)
        alone()
        assert alone.check()
    calls = kcp.collectives.calls[1]
    name, shape, y = calls[0]
    calls[0] = (name, shape, y + 1)  # another value received
    alone = kcp.alone(1)
    alone()
    assert not alone.check()
    calls[0] = (name, shape, y)
    calls.append(calls[-1])  # a call the step does not make
    with pytest.raises(RuntimeError, match="collectives, the threaded step's"):
        kcp.alone(1)()
    calls.pop()
    calls.pop()  # a call the step makes, missing
    with pytest.raises(RuntimeError, match="the threaded step's was none"):
        kcp.alone(1)()
    calls[0] = (name, (shape[0] + 1, *shape[1:]), y)
    with pytest.raises(RuntimeError, match="the threaded step's was"):
        kcp.alone(1)()


def test_cp_emulate_reports_ranks_alone_that_fail(monkeypatch, capsys):
    """Ranks alone that fail leave the row's threaded timings and say why, in the row and
    the table; the scaling curve skips them."""
    from cake_ops.bench import kcp

    def fail(self):
        raise RuntimeError("served out of step")

    monkeypatch.setattr(kcp._EmulatedKcp, "record", fail)
    report = main(["--quick", "--device", "cpu", "--shapes", "q_packed", "--calls", "1", "--warmup", "0", "--cp", "2",
                   "--emulate", "--align", "1"])
    (row,) = report["results"]
    assert row["kcp_all_ranks_ms"] > 0 and row["slowest_alone_ms"] is None
    assert row["alone_error"] == "RuntimeError: served out of step"
    assert "alone failed: RuntimeError: served out of step" in capsys.readouterr().out
    assert kcp.kcp_scaling([report]) == []


def test_kcp_scaling_of_device_reports_takes_the_slowest_rank_per_op():
    """The curve of ``--cp N,M`` without ``--emulate``: per (shape, op), the slowest rank's
    stream_ms over that degree's own single-device time."""
    from cake_ops.bench.kcp import format_kcp_scaling, kcp_scaling

    def report(cp, rows):
        return {"meta": {"cp": cp, "emulate": False, "layout": "C"},
                "results": [{"shape": "s", "op": op, "single": {"stream_ms": single}, "slowest": {"stream_ms": ms}}
                            for op, single, ms in rows]}

    rows = kcp_scaling([report(2, [("fwd", 10.0, 6.0), ("fwdbwd", 40.0, 22.0)]), report(8, [("fwdbwd", 42.0, 8.4)])])
    assert [(r["op"], sorted(r["by_cp"])) for r in rows] == [("fwd", [2]), ("fwdbwd", [2, 8])]
    assert rows[1]["by_cp"][2]["over_single"] == pytest.approx(0.55)
    assert rows[1]["by_cp"][8] == {"single_ms": 42.0, "ms": 8.4, "over_single": pytest.approx(0.2)}
    text = format_kcp_scaling(rows, {"emulate": False, "layout": "C"})
    assert "slowest rank" in text and "(0.200)" in text and text.splitlines()[2].rstrip().endswith("-")


def test_cp_devices_on_cpu(tmp_path):
    """``--cp N`` without ``--emulate`` on the CPU: N spawned gloo processes, gdn_kcp
    checked against FP64, every op timed on every rank; the slowest rank against the
    single device in strict JSON."""
    path = tmp_path / "json"
    report = main(["--quick", "--device", "cpu", "--shapes", "q_packed", "--calls", "1", "--warmup", "0", "--cp", "2",
                   "--layout", "D", "--align", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["accuracy"]["ok"] and all(0 <= x <= 1e-2 for x in data["accuracy"]["rel_rms"].values())
    assert data["meta"]["cp"] == 2 and data["meta"]["backend"] == "gloo" and not data["meta"]["emulate"]
    assert [r["op"] for r in data["results"]] == ["fwd", "fwdbwd", "ckpt"]
    for row in data["results"]:
        assert len(row["ranks"]) == 2 and all(r["stream_ms"] > 0 for r in row["ranks"])
        assert row["slowest"]["stream_ms"] == max(r["stream_ms"] for r in row["ranks"])
        assert row["slowest_over_single"]["stream_ms"] == pytest.approx(row["slowest"]["stream_ms"]
                                                                        / row["single"]["stream_ms"])
        # Layout D: each document over both ranks three times (a relay), chained by hops.
        assert row["comm_bytes_per_rank"]["gdn chain states, forward shifts"] > 0
        assert row["fla"] is None and row["fla_skipped"] == "FLA's kernels need CUDA"  # and FLA has no D
    assert report["results"][0]["shape"] == "q_packed"


@pytest.mark.parametrize("layout", ["C", "Z"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_fla_cp_rows_are_flas_equal_parts(layout, world):
    """The rows each rank gives FLA's own CP (``--cp`` devices mode, the fla arm): every
    token once over the ranks; contiguous, rank r's W-th part; zigzag, parts r and
    2W - 1 - r of 2W, in that order. None where FLA cannot cut T or has no layout."""
    from cake_ops.bench.kcp_devices import fla_cp_rows

    T = 2 * world * 5
    every = [fla_cp_rows(T, world, r, layout) for r in range(world)]
    assert torch.equal(torch.cat(every).sort().values, torch.arange(T))
    n = T // (world if layout == "C" else 2 * world)
    for r, rows in enumerate(every):
        firsts = [r] if layout == "C" else [r, 2 * world - 1 - r]
        assert torch.equal(rows, torch.cat([torch.arange(p * n, (p + 1) * n) for p in firsts]))
    assert fla_cp_rows(T + 1, world, 0, layout) is None
    assert fla_cp_rows(T, world, 0, "D") is None
