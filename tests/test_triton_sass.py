"""Reading a kernel's main loop from its SASS (qscheme.triton.sass), on text in cuobjdump's form."""

from __future__ import annotations

import pytest

from qscheme.triton.sass import main_loop, opcode_class, parse_sass

# The shape of `cuobjdump -sass` output: an address comment, the instruction, its encoding.
SASS = """
        Function : quantized_gemm_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe40000000800 */
        /*0010*/                   MOV R2, RZ ;                            /* 0x000000ff00027202 */
        /*0020*/                   LDG.E.U8 R3, desc[UR4][R4.64] ;         /* 0x0000000404037981 */
        /*0030*/                   LOP3.LUT R5, R3, 0xf, RZ, 0xc0, !PT ;    /* 0x0000000f03057812 */
        /*0040*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;  /* 0x000000100c08723c */
        /*0050*/               @P0 LDGSTS.E.BYPASS.128 [R6], desc[UR4][R4.64] ;
        /*0060*/                   IMAD.MOV.U32 R12, RZ, RZ, R13 ;        /* 0x000000ffff0c7224 */
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;           /* 0x0000000000007b1d */
        /*0080*/              @!P1 BRA 0x20 ;                              /* 0xfffffffc00489947 */
        /*0090*/                   LDS.128 R20, [R1] ;                     /* 0x0000000001147984 */
        /*00a0*/                   BRA 0xa0 ;                              /* 0xfffffffc00fc7947 */
"""


def test_parse_drops_predicates_and_encodings() -> None:
    instructions = parse_sass(SASS)
    assert instructions[0] == (0x0, "LDC R1, c[0x0][0x28]")
    assert (0x50, "LDGSTS.E.BYPASS.128 [R6], desc[UR4][R4.64]") in instructions
    assert (0x80, "BRA 0x20") in instructions
    assert len(instructions) == 11


def test_main_loop_is_the_backward_branch_holding_the_mma() -> None:
    loop = main_loop(parse_sass(SASS))
    assert loop is not None
    # 0x20..0x80: LDG, LOP3, HMMA, LDGSTS, IMAD.MOV, BAR, BRA (the BRA 0xa0 self-loop has no MMA)
    assert loop.instructions == 7
    assert loop.opcodes["LDG.E.U8"] == 1 and "LDS.128" not in loop.opcodes
    assert loop.classes == {
        "global_load": 1,
        "integer": 1,
        "mma": 1,
        "async_copy": 1,
        "move": 1,
        "barrier": 1,
        "control": 1,
    }
    assert loop.count("global_load") == 1 and loop.count("shared_store") == 0


def test_no_loop_gives_none() -> None:
    assert main_loop(parse_sass("/*0000*/ EXIT ;")) is None


@pytest.mark.parametrize(
    ("opcode", "kind"),
    [
        ("HGMMA.64x16x16.F32.BF16", "mma"),
        ("UTCHMMA", "mma"),
        ("LDG.E.128", "global_load"),
        ("LDGSTS.E.BYPASS.128", "async_copy"),
        ("UTMALDG.2D", "async_copy"),
        ("LDSM.16.M88.4", "shared_load"),
        ("STS.U16", "shared_store"),
        ("PRMT", "move"),
        ("IMAD.MOV.U32", "move"),
        ("IMAD.SHL.U32", "integer"),
        ("HMUL2.BF16_V2", "float"),
        ("F2FP.BF16.F32.PACK_AB", "convert"),
        ("WARPGROUP.ARRIVE", "barrier"),
    ],
)
def test_opcode_classes(opcode: str, kind: str) -> None:
    assert opcode_class(opcode) == kind
