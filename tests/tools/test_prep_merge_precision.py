"""tools/prep_merge_precision.py (CPU): the emulated blocked inverse of the prep against
fp64, the evidence for its merge precision (docs/experiments.md; csrc/gdn/fwd_prep.cu)."""

import pytest
import torch

from conftest import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("prep_merge_precision")


def test_round_tf32_keeps_ten_mantissa_bits_to_nearest(tool):
    x = torch.tensor([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-11, 1.0 + 2.0**-11 + 2.0**-20, -3.0 - 2.0**-12])
    want = torch.tensor([1.0, 1.0 + 2.0**-10, 1.0 + 2.0**-10, 1.0 + 2.0**-10, -3.0])
    assert torch.equal(tool.round_tf32(x), want)


def test_blocked_inverse_in_fp32_is_the_inverse(tool):
    gen = torch.Generator().manual_seed(3)
    lower = torch.tril(torch.rand(64, 64, generator=gen) * 0.4 - 0.2, -1)
    a = tool.blocked_inverse(lower, lambda x: x)
    torch.testing.assert_close(a @ (torch.eye(64) + lower), torch.eye(64), atol=1e-5, rtol=0)


def test_tf32_merges_cost_nothing_for_unit_keys(tool):
    """After A's rounding to bf16, one TF32 product per merge (unit keys' path) is as
    accurate as fp32 merges (raw keys' 3xTF32), and both sit at bf16's level."""
    worst = tool.worst_errors("unit", chunks=4, decay=0.1)
    (rel32, max32), (rel_tf, max_tf) = worst["fp32"], worst["tf32"]
    assert rel32 < 2.5e-3 and max32 < 3e-3
    assert rel_tf <= 1.02 * rel32 and max_tf <= 1.02 * max32
