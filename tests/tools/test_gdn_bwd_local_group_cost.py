"""tools/gdn_bwd_local_group_cost.py: the fit of a CTA's time as F + G h, the group sizes
it runs, and (on a Hopper GPU) the tool end to end on a small pack."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gdn_bwd_local_group_cost as tool  # noqa: E402


def test_fit_recovers_fixed_and_per_head_cost():
    groups = [1, 2, 3, 4, 6, 12]
    F, h, res = tool.fit_fixed_and_per_head(groups, [10.0 + 7.0 * g for g in groups])
    assert F == pytest.approx(10.0) and h == pytest.approx(7.0)
    assert all(abs(r) < 1e-9 for r in res)
    # Noise moves the fit by about its size, and the residuals show it.
    F, h, res = tool.fit_fixed_and_per_head([1, 2, 3], [17.5, 24.0, 31.5])
    assert F == pytest.approx(10.33, abs=0.01) and h == pytest.approx(7.0)
    assert res == pytest.approx([0.1667, -0.3333, 0.1667], abs=1e-3)
    with pytest.raises(ValueError, match="two different group sizes"):
        tool.fit_fixed_and_per_head([3, 3], [1.0, 2.0])


def test_group_sizes_divide_the_value_heads():
    assert tool.group_sizes(12, [1, 2, 3, 4, 5, 6, 12, 24]) == [1, 2, 3, 4, 6, 12]
    assert tool.group_sizes(6, [4, 0, 3]) == [3]


def test_arguments_refused_before_any_gpu_work():
    with pytest.raises(SystemExit):
        tool.main(["--tokens", "1000"])  # not a multiple of 4096
    with pytest.raises(SystemExit):
        tool.main(["--hv", "5", "--groups", "2,3"])  # no size divides 5


@pytest.mark.gpu
def test_tool_runs_on_a_small_pack(capsys):
    tool.main(["--hv", "6", "--tokens", "8192", "--groups", "1,2,3,6", "--calls", "2", "--l2", "on"])
    out = capsys.readouterr().out
    assert "fit: per CTA = F + G h" in out and out.count("\n  1   6 ") == 1
