"""tools/gdn_bits.py on the CPU: a tiny shape saved twice is bitwise equal; a changed
element is reported with its tensor, count and size; a shape missing from a later file
is reported."""

import torch

from cake_ops.bench.shapes import Shape

from conftest import load_tool

bits = load_tool("gdn_bits")

TINY = Shape("tiny", (70, 5), H=1, HV=2)


def test_saved_twice_bitwise_equal_and_a_change_reported(tmp_path):
    a, b, c = (str(tmp_path / f"{n}.pt") for n in ("a", "b", "c"))
    bits.save(a, [TINY], torch.device("cpu"), 0)
    bits.save(b, [TINY], torch.device("cpu"), 0)
    saved = torch.load(a)["tiny"]
    assert set(saved) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
    assert all(torch.isfinite(x.float()).all() for x in saved.values())
    assert saved["o"].shape == (75, 2, 128) and saved["dinitial_state"].shape == (2, 2, 128, 128)
    lines, equal = bits.compare([a, b])
    assert equal and lines == ["tiny: b bitwise equal to a"]

    changed = {"tiny": dict(saved)}
    changed["tiny"]["dk"] = saved["dk"].clone()
    changed["tiny"]["dk"].view(-1)[7] += 1.0
    torch.save(changed, c)
    lines, equal = bits.compare([a, b, c])
    assert not equal
    assert lines[0] == "tiny: b bitwise equal to a"
    assert lines[1].startswith("tiny: c differs from a: dk 1 of 9600 elements (max |diff| ")


def test_a_shape_missing_from_a_later_file_is_reported(tmp_path):
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    bits.save(a, [TINY], torch.device("cpu"), 0)
    torch.save({}, b)
    lines, equal = bits.compare([a, b])
    assert not equal and lines == ["tiny: b has no result"]
