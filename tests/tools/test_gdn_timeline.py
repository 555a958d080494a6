"""tools/gdn_timeline.py's summary of a trace: busy time as the union of the kernels'
intervals, the gaps between them, each stream's sum."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from gdn_timeline import summary  # noqa: E402


def ev(ts, dur, stream):
    return {"ts": ts, "dur": dur, "args": {"stream": stream}}


def test_summary_of_overlapping_and_separate_kernels():
    # [100, 110) on stream 7; [105, 125) on 28 overlapping it; a gap; [140, 150) on 7.
    s = summary([ev(100.0, 10.0, 7), ev(105.0, 20.0, 28), ev(140.0, 10.0, 7)])
    assert s["step"] == 50.0
    assert s["busy"] == 35.0  # 25 of the union [100, 125), 10 of [140, 150)
    assert s["gaps"] == [(25.0, 15.0)]
    assert s["per_stream"] == {7: 20.0, 28: 20.0}


def test_summary_of_a_kernel_inside_another():
    s = summary([ev(0.0, 100.0, 7), ev(10.0, 5.0, 28), ev(120.0, 1.0, 7)])
    assert s["busy"] == 101.0
    assert s["gaps"] == [(100.0, 20.0)]
