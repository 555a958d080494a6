"""tools/ncu_sass_stalls.py (CPU): stall samples per source line, from an Nsight Compute
SASS export and the line table of the kernel's cubin."""

import pytest

from conftest import load_tool

SASS = """\
.text._Z5otherv:
	//## File "/x/other.cu", line 3
        /*0000*/                   NOP ;
.text._ZN4cake12gdn_bwd_localEv:
	//## File "/x/k.cu", line 10
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @P0 BRA `(.L_x_1) ;
	//## File "/x/k.cu", line 12
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
.text._Z5afterv:
        /*0000*/                   NOP ;
"""
HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
       "stall_barrier", "stall_wait (Not Issued)"]


def _tool():
    return load_tool("ncu_sass_stalls")


def _rows(ops):
    base = 0x7F0000000000
    return [[hex(base + 16 * i), f"      {op}", str(smp), "10", str(w), str(b), "0"]
            for i, (op, smp, w, b) in enumerate(ops)]


def test_samples_go_to_the_lines_of_the_named_kernel():
    tool = _tool()
    table = tool.line_table(SASS, "gdn_bwd_local")
    assert table == {0: ("/x/k.cu", 10, "LDC"), 0x10: ("/x/k.cu", 10, "BRA"), 0x20: ("/x/k.cu", 12, "HMMA")}
    rows = _rows([("LDC R1, c[0x0][0x28]", 3, 1, 2), ("@P0 BRA `(.L_x_1)", 1, 1, 0), ("HMMA.16816.F32.BF16 R4", 6, 6, 0)])
    by_line = tool.samples_by_line(HDR, rows, table)
    assert by_line[("/x/k.cu", 10)]["all"] == 4 and by_line[("/x/k.cu", 10)]["barrier"] == 2
    assert by_line[("/x/k.cu", 12)]["all"] == 6 and by_line[("/x/k.cu", 12)]["wait"] == 6


def test_an_export_of_other_code_is_refused():
    tool = _tool()
    table = tool.line_table(SASS, "gdn_bwd_local")
    with pytest.raises(SystemExit, match="not the cubin's"):
        tool.samples_by_line(HDR, _rows([("LDC R1", 1, 1, 0), ("IMAD R2", 1, 1, 0)]), table)
    with pytest.raises(SystemExit, match="no function"):
        tool.line_table(SASS, "gdn_fwd_walk")
