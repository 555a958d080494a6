"""tools/gdn_bwd_tape_precision.py (CPU): the backward's tape precision, emulated."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gdn_bwd_tape_precision.py"


def test_fp32_tapes_are_exact_and_bf16_tapes_within_contract():
    spec = importlib.util.spec_from_file_location("gdn_bwd_tape_precision", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    errs = tool.errors("edges")
    assert max(errs["fp32"].values()) < 1e-5  # the chunked algorithm in fp32 is the recurrence
    assert 1e-4 < max(errs["bf16 all"].values()) < 1e-2  # bf16 tapes cost something, within the contract
