"""tools/gdn_bwd_fused_emulation.py (CPU): the fused backward's schedule, emulated."""

import importlib.util
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gdn_bwd_fused_emulation.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gdn_bwd_fused_emulation", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_tf32_rounding():
    tool = _tool()
    x = torch.tensor([1.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-12, -3.0e-5])
    # 10 mantissa bits: 1 + 2^-11 is a tie (to even: 1), 1 + 3 * 2^-11 rounds up to 1 + 2^-9.
    assert tool._tf32(x).tolist()[:4] == [1.0, 1.0, 1.0 + 2.0**-9, 1.0]
    assert abs(tool._tf32(x)[4].item() / -3.0e-5 - 1) < 2.0**-10


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
