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
    assert {off: t[:3] for off, t in table.items()} == {
        0: ("/x/k.cu", 10, "LDC"), 0x10: ("/x/k.cu", 10, "BRA"), 0x20: ("/x/k.cu", 12, "HMMA")}
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


# A warp-specialised kernel as nvdisasm --print-line-info-inline prints it: each instruction's
# inlined chain, innermost first; role A entered at line 50, role B at line 60.
SASS_INLINE = """\
.text._ZN4cake6fusedEv:
	//## File "/x/f.cu", line 5 inlined at "/x/f.cu", line 20
	//## File "/x/f.cu", line 20 inlined at "/x/f.cu", line 50
	//## File "/x/f.cu", line 50
        /*0000*/              @P0 BRA `(.L_x_1) ;
	//## File "/x/f.cu", line 5 inlined at "/x/f.cu", line 30
	//## File "/x/f.cu", line 30 inlined at "/x/f.cu", line 60
	//## File "/x/f.cu", line 60
        /*0010*/              @P0 BRA `(.L_x_2) ;
        /*0020*/                   NOP ;
	//## File "/x/f.cu", line 31 inlined at "/x/f.cu", line 60
	//## File "/x/f.cu", line 60
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
	//## File "/x/f.cu", line 70
        /*0040*/                   EXIT ;
"""


def test_samples_go_to_roles_and_their_sites_through_the_inlined_chain():
    tool = _tool()
    table = tool.line_table(SASS_INLINE, "fused")
    assert table[0][:2] == ("/x/f.cu", 5) and table[0][3] == (("/x/f.cu", 5), ("/x/f.cu", 20), ("/x/f.cu", 50))
    assert table[0x20][3] == table[0x10][3]  # an instruction without lines of its own keeps the chain before it
    rows = _rows([("@P0 BRA `(.L_x_1)", 7, 0, 0), ("@P0 BRA `(.L_x_2)", 5, 5, 0), ("NOP", 1, 0, 1),
                  ("HMMA.16816.F32.BF16 R4", 3, 3, 0), ("EXIT", 2, 0, 0)])
    by_role = tool.samples_by_role(HDR, rows, table, {("f.cu", 50): "A", ("f.cu", 60): "B"})
    assert by_role["A"][("/x/f.cu", 20)]["all"] == 7  # the same wait (line 5) reached from each role's own line
    assert by_role["B"][("/x/f.cu", 30)]["all"] == 6 and by_role["B"][("/x/f.cu", 30)]["wait"] == 5
    assert by_role["B"][("/x/f.cu", 31)]["all"] == 3
    assert by_role["other"][("/x/f.cu", 70)]["all"] == 2
    # the line summary still goes by the innermost line
    by_line = tool.samples_by_line(HDR, rows, table)
    assert by_line[("/x/f.cu", 5)]["all"] == 13
