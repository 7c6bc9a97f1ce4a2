"""qscheme_plugins.cpu_boundaries: each GEMV/GEMM boundary declared once, the two ranges meeting at it
under the same conditions, and the check on the loops an extension runs."""

from __future__ import annotations

import pytest
from qscheme_plugins.cpu_boundaries import (
    BF16_DOT_BOUNDARY,
    E4M3_BF16_DOT_BOUNDARY,
    FLOAT32_BOUNDARY,
    Boundary,
    ExtensionLoops,
)
from qscheme_plugins.cpu_gemv import CPU_GEMV
from qscheme_plugins.dequant_gemm import DEQUANT_GEMM
from qscheme_plugins.tinygemm import TINYGEMM_CPU

from qscheme import cpu_gemv, tile_gemm
from qscheme.kernels.problem import Problem


@pytest.mark.parametrize("boundary", [E4M3_BF16_DOT_BOUNDARY, BF16_DOT_BOUNDARY, FLOAT32_BOUNDARY])
def test_the_gemv_and_gemm_ranges_meet_at_the_boundary(boundary: Boundary) -> None:
    gemv, gemm = boundary.gemv_range(), boundary.gemm_range()
    assert (gemv.m_min, gemv.m_max, gemm.m_min, gemm.m_max) == (0, gemm.m_min - 1, boundary.first_gemm_m, None)
    assert gemv.when == gemm.when and gemv.source == gemm.source and gemv.source
    # the kernels declare them before their unconditional ranges
    assert gemm in DEQUANT_GEMM.batch_ranges[:-1] and gemv in CPU_GEMV.batch_ranges[:-1]
    assert DEQUANT_GEMM.batch_ranges[-1].when == () and CPU_GEMV.batch_ranges[-1].when == ()
    # tinygemm_cpu takes bfloat16 inputs only: the bf16 boundary alone
    assert (gemv in TINYGEMM_CPU.batch_ranges) == (boundary is BF16_DOT_BOUNDARY)


def test_the_loops_check_reads_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    check = ExtensionLoops("tile_gemm", ("avx512",))
    assert check.describe() == "qscheme._tile_gemm's avx512 loops"
    monkeypatch.setattr(tile_gemm, "isa", lambda: "avx512")
    assert check.check(Problem(8, 8)).ok
    monkeypatch.setattr(tile_gemm, "isa", lambda: "amx")
    failed = check.check(Problem(8, 8))
    assert not failed.ok and failed.reason == "qscheme._tile_gemm runs its amx loops here, not avx512"
    monkeypatch.setattr(cpu_gemv, "isa", lambda: "avx2")
    assert not ExtensionLoops("cpu_gemv", ("avx512",)).check(Problem(8, 8)).ok


def test_the_boundaries_hold_only_under_their_conditions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tile_gemm, "isa", lambda: "avx512")
    monkeypatch.setattr(cpu_gemv, "isa", lambda: "avx512")
    bf16, f32 = Problem(8, 8, "bfloat16", weight_format="nvfp4"), Problem(8, 8, "float32", weight_format="nvfp4")
    assert DEQUANT_GEMM.batch_range("cpu", bf16) == (5, None) and CPU_GEMV.batch_range("cpu", bf16) == (0, 4)
    assert DEQUANT_GEMM.batch_range("cpu", f32) == (48, None) and CPU_GEMV.batch_range("cpu", f32) == (0, 47)
    blocks = Problem(8, 8, "float32", weight_format="blocks")
    assert DEQUANT_GEMM.batch_range("cpu", blocks) == (16, None)
    # e4m3 weights with bfloat16 inputs: the tiles from 4 (their table decode); float32 inputs as any weight
    fp8, fp8_f32 = Problem(8, 8, "bfloat16", weight_format="e4m3"), Problem(8, 8, "float32", weight_format="e4m3")
    assert DEQUANT_GEMM.batch_range("cpu", fp8) == (4, None) and CPU_GEMV.batch_range("cpu", fp8) == (0, 3)
    assert DEQUANT_GEMM.batch_range("cpu", fp8_f32) == (48, None)
    monkeypatch.setattr(tile_gemm, "isa", lambda: "amx")
    assert DEQUANT_GEMM.batch_range("cpu", bf16) == (16, None) and TINYGEMM_CPU.batch_range("cpu", bf16) == (0, 15)
    assert DEQUANT_GEMM.batch_range("cpu", fp8) == (16, None) and CPU_GEMV.batch_range("cpu", fp8) == (0, 15)
