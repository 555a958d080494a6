"""tools/gdn_bwd_tape_precision.py (CPU): the backward's tape precision, emulated."""

from conftest import load_tool


def _tool():
    return load_tool("gdn_bwd_tape_precision")


def test_fp32_tapes_are_exact_and_bf16_tapes_within_contract():
    tool = _tool()
    errs = tool.errors("edges")
    assert max(errs["fp32"].values()) < 1e-5  # the chunked algorithm in fp32 is the recurrence
    assert 1e-4 < max(errs["bf16 all"].values()) < 1e-2  # bf16 tapes cost something, within the contract


def test_exact_first_state_and_last_state_gradient_keep_dg_in_contract():
    """Where e^gl <dS_end, h> dominates dg (a one-token document, strong decay, a random
    initial state and final-state gradient), the bf16 tapes alone put dg past 1e-2; the
    kernel's form, which reads both factors there in fp32, keeps it under 4e-3."""
    tool = _tool()
    for seed in (0, 2):
        errs = tool.errors("gva3_strong", seed)
        assert errs["bf16 all"]["dg"] > 1e-2, seed
        assert max(errs[tool.KERNEL].values()) < 4e-3, seed
