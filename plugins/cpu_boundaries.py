"""Where the CPU GEMV kernels hand a layer over to the tile GEMM (``dequant_gemm``), per condition.

A boundary depends on what the CPU runs and on the input dtype, so each is declared once here with
the conditions it was measured under (``BatchRange.when``) and the measurement itself: the GEMVs
(``cpu_gemv``, ``tinygemm_cpu``) take the batch sizes below it (``gemv_range``), ``dequant_gemm``
those from it (``gemm_range``). Where no condition holds, each kernel's unconditional range (M = 16)
applies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qscheme.kernels.declaration import (
    PASSED,
    ActivationDtypes,
    BatchRange,
    CheckResult,
    ProblemCheck,
    WeightFormats,
)

if TYPE_CHECKING:
    from qscheme.kernels.problem import Problem


@dataclass(frozen=True)
class ExtensionLoops:
    """One of qscheme's CPU extensions runs one of these loops here: ``qscheme.<module>.isa()``
    (``tile_gemm``: "amx", "avx512" for VDPBF16PS dot products on CPUs without AMX, "scalar";
    ``cpu_gemv``: "avx512", "avx2", "scalar")."""

    module: str
    isas: tuple[str, ...]

    def check(self, problem: Problem) -> CheckResult:
        loops = importlib.import_module(f"qscheme.{self.module}").isa()  # torch: imported only when a plan asks
        if loops in self.isas:
            return PASSED
        return CheckResult(
            False,
            f"qscheme._{self.module} runs its {loops} loops here, not {' or '.join(self.isas)}",
            "the kernels' other declared batch ranges hold here",
        )

    def describe(self) -> str:
        return f"qscheme._{self.module}'s {' or '.join(self.isas)} loops"


@dataclass(frozen=True)
class Boundary:
    """The first M the tile GEMM takes under ``when``, and the measurement it comes from."""

    first_gemm_m: int
    when: tuple[ProblemCheck, ...]
    source: str

    def gemv_range(self) -> BatchRange:
        return BatchRange("cpu", 0, self.first_gemm_m - 1, source=self.source, when=self.when)

    def gemm_range(self) -> BatchRange:
        return BatchRange("cpu", self.first_gemm_m, None, source=self.source, when=self.when)


# bfloat16 inputs where the tile GEMM runs VDPBF16PS dot products (AVX512-BF16, no AMX): the GEMVs' loops
# for more than four rows of x fall behind it from M = 5
BF16_DOT_BOUNDARY = Boundary(
    5,
    (ActivationDtypes(("bfloat16",)), ExtensionLoops("tile_gemm", ("avx512",))),
    "benchmarks/cpu_gemm.py, 4096x4096, bf16, 2 threads, 2-core Zen 4 EPYC (AVX512-BF16, no AMX), same-run "
    "ratios to bf16 F.linear, dequant_gemm / cpu_gemv: M = 5: NVFP4A16 1.35-1.55x / 0.82-0.95x, W4A16 1.68x / "
    "1.01x, W4A16_ASYM 1.68x / 0.92x, MXFP4A16 1.42x / 0.91x, FP8 0.96x / 0.98x, W8A16_G32 0.94x / 0.84x; M = 8: "
    "1.45-1.71x / 0.48-0.87x (4-bit), 0.97-1.13x / 0.43-0.73x (8-bit, FP8_DYNAMIC included); GPTQ "
    "W4A16_ASYM_G32 M = 5-12: 1.35-1.52x, tinygemm_cpu 0.89-1.11x; at M = 4 the GEMVs win (NVFP4A16 2.20x / "
    "1.60x dequant_gemm, FP8 1.28x / 1.06x, tinygemm_cpu 1.77x / 1.63x)",
)

# e4m3 weights (FP8, FP8_DYNAMIC, FP8 blocks), bfloat16 inputs, the same CPUs: the tiles decode e4m3 codes
# through a table per group, and take four rows of x faster than cpu_gemv's float32 loop does
E4M3_BF16_DOT_BOUNDARY = Boundary(
    4,
    (ActivationDtypes(("bfloat16",)), ExtensionLoops("tile_gemm", ("avx512",)), WeightFormats(("e4m3",))),
    "benchmarks/cpu_gemm.py, 4096x4096 and 14336x4096, bf16, 2 threads, 2-core Zen 4 EPYC (AVX512-BF16, no AMX), "
    "same-run ratios to bf16 F.linear, dequant_gemm / cpu_gemv: M = 4: FP8 1.33x / 1.15x and 1.42x / 1.29x, "
    "FP8_DYNAMIC 1.36x / 1.17x and 1.38x / 1.19x, fp8_pb_wo 1.22x / 1.21x and 1.33x / 1.15x; M = 3: cpu_gemv wins "
    "(1.26-1.50x against 1.19-1.39x)",
)

# float32 inputs of weights other than packed blocks on cpu_gemv's AVX-512 loops: its GEMV beats the
# float32 tiles (decoded rows, torch's float32 GEMM) up to M = 32-48; the blocks' float32 GEMV loses from 16-32
FLOAT32_BOUNDARY = Boundary(
    48,
    (ActivationDtypes(("float32",)), ExtensionLoops("cpu_gemv", ("avx512",)), WeightFormats(("blocks",), exclude=True)),
    "QuantLinear with the kernel forced, 4096x4096, float32 inputs, 2 threads, 2-core Zen 4 EPYC, time of "
    "dequant_gemm over cpu_gemv's: M = 16: NVFP4A16 1.09x, FP8 1.79x, W4A16 1.91x, FP8_DYNAMIC 1.80x; M = 32: "
    "1.07x, 1.21x, 1.29x, 1.20x; M = 48: 0.90x, 1.03x, 1.13x, 1.05x; M = 64: 0.81x, 0.90x, 0.95x, 0.90x "
    "(GGUF blocks: cpu_gemv_blocks loses from M = 16-32, Q6_K 1.83x slower at 16, so they keep M = 16)",
)
