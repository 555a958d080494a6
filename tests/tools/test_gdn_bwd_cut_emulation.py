"""tools/gdn_bwd_cut_emulation.py (CPU): the reverse walk cut at a grid, exact cuts through
M^T and truncated cuts by a backward window, against the uncut walk."""

from conftest import load_tool


def test_exact_and_truncated_cuts_give_the_uncut_gradients():
    tool = load_tool("gdn_bwd_cut_emulation")
    # 10 chunks in segments of 4: the cut at chunk 4 has a 4-chunk window (-0.08 x 256
    # <= -20), the cut at chunk 8 none (its segment has 2 chunks, -10.2): exact there.
    out = tool.compare(640, 4, "-0.08", 1)
    assert out["exact"][1] == (0, 2) and out["truncated"][1] == (1, 2)
    for form in ("exact", "truncated"):
        diff, _, errs = out[form]
        assert diff < 1e-6, form
        assert max(errs.values()) < 1e-5, (form, errs)
