"""tools/sass_budget.py parsing logic on synthetic SASS (no CUDA tools needed): it finds the innermost
loop with 128-bit loads between its label and backward branch, counts it without NOPs, scales to 32
elements, reads both nvdisasm (labels) and cuobjdump (absolute addresses) listings, and fails with a
message naming the fix when no disassembler is found."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("sass_budget", os.path.join(ROOT, "tools", "sass_budget.py"))
sb = importlib.util.module_from_spec(_spec)
sys.modules["sass_budget"] = sb  # dataclasses look their module up by name
_spec.loader.exec_module(sb)

NAME = "_ZN12megatron_opt46_GLOBAL__N__493d3292_13_grad_stats_cu_bcfce86917grad_stats_kernelINS_4BF16ELb0EEEvPKlS4_PdPj"

# nvdisasm -c style: a scalar loop (0x30-0x50), the vector loop (0x60-0x120: 13 instructions, one NOP,
# a guard branch inside), then a tail loop (0x140-0x160) with a 32-bit load.
NVDISASM = f"""
//--------------------- .text.{NAME} --------------------------
	.section	.text.{NAME},"ax",@progbits
.text.{NAME}:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   MOV R2, RZ ;
.L_x_1:
        /*0030*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0040*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   ISETP.GE.U32.AND P1, PT, R0, UR6, PT ;
        /*0070*/              @!P1 LDG.E.EF.128 R4, desc[UR12][R2.64] ;
        /*0080*/              @!P1 LDG.E.EF.128 R8, desc[UR12][R2.64+0x1000] ;
        /*0090*/                   BSSY B0, `(.L_x_3) ;
        /*00a0*/               @P1 BRA `(.L_x_4) ;
        /*00b0*/                   F2F.F64.F32 R16, R4 ;
        /*00c0*/                   DFMA R12, R16, R16, R12 ;
.L_x_4:
        /*00d0*/                   BSYNC B0 ;
.L_x_3:
        /*00e0*/                   NOP ;
        /*00f0*/                   IADD3 R0, P2, R0, 0x200, RZ ;
        /*0100*/                   IMAD.X R15, RZ, RZ, R15, P2 ;
        /*0110*/                   PLOP3.LUT P2, PT, PT, PT, UP0, 0x80, 0x0 ;
        /*0120*/              @!P2 BRA `(.L_x_2) ;
        /*0130*/                   BRA `(.L_x_5) ;
.L_x_6:
        /*0140*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0150*/                   IADD3 R2, R2, 0x4, RZ ;
        /*0160*/               @P0 BRA `(.L_x_6) ;
.L_x_5:
        /*0170*/                   EXIT ;
"""

# cuobjdump -sass style for the same vector loop: absolute targets and encoding comment lines.
CUOBJDUMP = f"""
	code for sm_90
		Function : {NAME}
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R2, RZ ;                  /* 0x000000ff00027202 */
                                                                 /* 0x000fe20000000f00 */
        /*0010*/              @!P1 LDG.E.EF.128 R4, desc[UR12][R2.64] ;      /* 0x0000000c02047981 */
                                                                 /* 0x000ea8000c1e9b00 */
        /*0020*/                   F2F.F64.F32 R16, R4 ;         /* 0x0000000400107310 */
        /*0030*/                   DFMA R12, R16, R16, R12 ;     /* 0x000000100c0c722b */
        /*0040*/              @!P2 BRA 0x10 ;                    /* 0xfffffff400e0a947 */
        /*0050*/                   EXIT ;                        /* 0x000000000000794d */
"""


def test_nvdisasm_listing_finds_vector_loop_and_counts():
    funcs = sb.parse_functions(NVDISASM)
    assert list(funcs) == [NAME]
    instrs = funcs[NAME]
    assert instrs[5].opcode == "BRA" and instrs[5].target == 0x30  # `(.L_x_1)` resolved to its address
    m = sb.KERNEL_RE.search(NAME)
    assert m and m.group(1) == "BF16" and m.group(2) == "0"
    r = sb.count_loop(NAME, instrs, elem_bytes=2, grad="bf16", count_zeros=False)
    assert (r.loop_start, r.loop_end) == (0x60, 0x120)
    assert r.instructions == 12  # 13 in [0x60, 0x120] less the NOP
    assert r.elements == 16  # two 128-bit loads of bf16
    assert r.per_32 == 24.0 and r.passed and not r.warnings
    assert r.top_opcodes["LDG"] == 2 and "NOP" not in r.top_opcodes


def test_cuobjdump_listing_absolute_targets():
    instrs = sb.parse_functions(CUOBJDUMP)[NAME]
    assert [x.addr for x in instrs] == [0x0, 0x10, 0x20, 0x30, 0x40, 0x50]  # encoding lines skipped
    r = sb.count_loop(NAME, instrs, elem_bytes=4)
    assert (r.loop_start, r.loop_end, r.instructions, r.elements, r.per_32) == (0x10, 0x40, 4, 4, 32.0)


def test_over_budget_and_out_of_line_branch_warning():
    body = "\n".join(f"        /*{0x10 * (i + 2):04x}*/                   IMAD R0, R0, R0, RZ ;" for i in range(200))
    sass = (f"\t\tFunction : {NAME}\n        /*0000*/              @!P1 LDG.E.128 R4, desc[UR4][R2.64] ;\n"
            f"        /*0010*/               @P3 BRA 0x9000 ;\n{body}\n        /*0ca0*/              @!P2 BRA 0x0 ;\n")
    r = sb.count_loop(NAME, sb.parse_functions(sass)[NAME], elem_bytes=4)
    assert r.instructions == 203 and r.elements == 4 and not r.passed
    assert r.warnings and "0x9000" in r.warnings[0]


def test_no_vector_loop_is_an_error():
    sass = NVDISASM.replace(".128", "")
    with pytest.raises(ValueError, match="128-bit"):
        sb.find_steady_loop(sb.parse_functions(sass)[NAME])


def test_missing_disassembler_names_the_fix(tmp_path, capsys):
    with pytest.raises(sb.DisassemblerNotFound, match="pip install .*nvidia-cuda-nvdisasm.*--disassembler"):
        sb.find_disassembler(search_dirs=[str(tmp_path)], use_path=False)
    binary = tmp_path / "x.cubin"
    binary.write_bytes(b"\x7fELF")
    assert sb.main([str(binary), "--disassembler", str(tmp_path / "nvdisasm")]) == 2
    assert "nvidia-cuda-nvdisasm" in capsys.readouterr().err


def test_so_input_needs_cuobjdump(tmp_path):
    binary = tmp_path / "_C.so"
    binary.write_bytes(b"\x7fELF")
    with pytest.raises(sb.DisassemblerNotFound, match="cuobjdump"):
        sb.disassemble(str(binary), {"nvdisasm": "/bin/true"}, "sm_90")
