"""tools/gdn_bwd_fused_emulation.py (CPU): the fused backward's schedule, emulated."""

from conftest import load_tool


def _tool():
    return load_tool("gdn_bwd_fused_emulation")


def test_schedule_algebra_is_the_chunked_algorithm():
    """Every tile fp32: the fused schedule (dv from the chain's X, dbeta and dg from column
    sums of A o dA, dk's dXw term through a row-scaled A^T, value halves as partial sums)
    gives the recurrence's gradients to fp32 rounding, at one CTA a value head and at two."""
    tool = _tool()
    for case in ("edges", "gva3_strong"):
        for form, errs in tool.errors(case, 0, (1, 2), exact=True).items():
            assert max(r for r, _ in errs.values()) < 1e-5, (case, form, errs)


def test_schedule_rounding_within_contract():
    """The kernel's bf16 hand-over tiles and TF32 dA keep every gradient within the
    contract, and splitting the value columns over two CTAs (bf16 partials of dw, dPs,
    dkk) costs no more than a tenth of the unsplit error."""
    tool = _tool()
    errs = tool.errors("gva3_strong", 0, (1, 2))
    one, two = errs["fused, vsplit 1"], errs["fused, vsplit 2"]
    for name in tool.NAMES:
        assert one[name][0] < 8e-3 and one[name][1] < 1e-2, (name, one[name])
        assert two[name][0] < 1.1 * one[name][0] + 1e-4, (name, one[name], two[name])
    assert max(r for r, _ in one.values()) > 1e-3  # the roundings are there
