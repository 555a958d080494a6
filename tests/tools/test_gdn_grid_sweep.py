"""tools/gdn_grid_sweep.py: its arguments, refused before any GPU work, and (on a Hopper
GPU) the tool end to end on one small shape."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gdn_grid_sweep as tool  # noqa: E402


def test_grids_parsed_and_checked():
    assert tool.parse_grids("-1,0,16,32") == [-1, 0, 16, 32]
    with pytest.raises(ValueError, match="comma-separated integers"):
        tool.parse_grids("16,x")
    with pytest.raises(ValueError, match="-1 .the plan's., 0 .uncut."):
        tool.parse_grids("-2,16")
    with pytest.raises(ValueError, match="repeats"):
        tool.parse_grids("16,16")


def test_shapes_are_the_benchmarks():
    from cake_ops.bench.shapes import shape_names

    assert shape_names("s32k_h2,s16k_h8") == ["s32k_h2", "s16k_h8"]
    with pytest.raises(ValueError, match="unknown"):
        shape_names("s32k_h2,s1k")
    with pytest.raises(ValueError, match="empty list"):
        shape_names(",")


@pytest.mark.parametrize("argv", [["--grids", "16,abc"], ["--shapes", "nope"], ["--calls", "0"]])
def test_arguments_refused_before_any_gpu_work(argv):
    with pytest.raises(SystemExit):
        tool.main(argv)


@pytest.mark.gpu
def test_tool_runs_on_a_small_shape(capsys):
    tool.main(["--shapes", "s16k_h8", "--grids", "32,-1", "--calls", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("s16k_h8")]
    assert [r[1] for r in rows] == ["-1", "32"]  # the plan's first, the ratios' base
    assert rows[0][5] == "1.000" and all(float(r[4]) > 0 for r in rows)
