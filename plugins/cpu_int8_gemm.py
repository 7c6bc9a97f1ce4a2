"""qscheme's int8 x int8 CPU GEMM (``qscheme._int8_gemm``, C++ with AVX512-VNNI and portable loops):
the declaration of the ``cpu_int8_gemm`` kernel, listed by the ``cpu_gemv`` plugin's hook beside
``cpu_gemv``.

It runs int8 weights with one scale per output channel and int8 activations quantized per token
at run time (compressed-tensors W8A8), at every batch size: the input is quantized exactly as the
reference kernel quantizes it, and the products of the codes are summed exactly in 32-bit integers
(VPDPBUSD), so that only the two scales and the bias round. The weight is read as stored; the
kernel keeps each row's sum of codes and its float32 scale beside it (8 bytes a row). The code is
in ``qscheme_plugins.cpu_int8_gemm_kernel`` and ``qscheme.int8_gemm``.

Priority 64: above the kernels that also take these layers on a CPU, ``cpu_gemv`` (45, up to
M = 15, which multiplies the codes as floats) and ``dequant_gemm`` (55, from M = 16, which decodes
the weight into bfloat16 tiles for a bfloat16 GEMM): on the 2-core Zen 4 EPYC it was faster than
both at every M measured (the figures are beside the entry), so it declares no batch range.

The capability check ``Int8Loops`` rejects the kernel where the extension was not built or the
CPU lacks AVX512-VNNI (the portable loop gives the same bits, slower than ``cpu_gemv`` there), and
``ExactSums`` where K is 2**17 or more (the integer sums could overflow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qscheme.kernels.declaration import (
    FLOAT_SCALE_FORMATS,
    PASSED,
    ActivationDtypes,
    ActivationSupport,
    CheckResult,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
    Supports,
)

if TYPE_CHECKING:
    from qscheme.kernels.problem import Problem

MAX_K = (1 << 17) - 1  # qscheme.int8_gemm.MAX_K (a test checks they agree; declarations import no torch)

INT8_TOKEN_PAIR = Supports(
    weights=("int8",),
    weight_formats=("int8",),
    granularities=("channel",),
    scale_formats=("fp32", "fp16", "bf16", "float"),
    activations=(
        ActivationSupport("int8", "token", dynamic=True, formats=("int8",), scale_formats=FLOAT_SCALE_FORMATS),
    ),
    per_partition_scales=True,
)


@dataclass(frozen=True)
class Int8Loops:
    """The extension ``qscheme._int8_gemm`` is built and this CPU runs its AVX512-VNNI loops."""

    def check(self, problem: Problem) -> CheckResult:
        from qscheme import int8_gemm  # torch: the kernel's own requirement, checked before this

        if not int8_gemm.available():
            return CheckResult(
                False,
                "the C++ extension qscheme._int8_gemm is not built here",
                "reinstall qscheme with a C++17 compiler: pip install --no-build-isolation -e .",
            )
        if int8_gemm.supported_isa() != "vnni":
            return CheckResult(
                False,
                "this CPU lacks AVX512-VNNI (qscheme._int8_gemm has only its portable loop here)",
                "cpu_gemv up to M = 15 and dequant_gemm from M = 16 run the layer here",
            )
        return PASSED

    def describe(self) -> str:
        return "qscheme._int8_gemm built, AVX512-VNNI CPU"


@dataclass(frozen=True)
class ExactSums:
    """K below 2**17, so that every dot product of int8 codes is exact in 32-bit integers."""

    def check(self, problem: Problem) -> CheckResult:
        if problem.k <= MAX_K:
            return PASSED
        return CheckResult(
            False,
            f"sums int8 products in 32-bit integers, exact for K <= {MAX_K}; layer has K={problem.k}",
            "split the layer along K, or run it on cpu_gemv or dequant_gemm (float32 sums)",
        )

    def describe(self) -> str:
        return f"K <= {MAX_K}"


CPU_INT8_GEMM = KernelDeclaration(
    name="cpu_int8_gemm",
    provider="qscheme",
    priority=64,
    description=(
        "qscheme's C++ int8 x int8 GEMM: the input quantized per token as the scheme says, exact 32-bit integer "
        "sums with VPDPBUSD (AVX512-VNNI), the weight read as stored"
    ),
    supports=(INT8_TOKEN_PAIR,),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.cpu_int8_gemm_kernel:CpuInt8GemmKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float32")), Int8Loops(), ExactSums()),
    prepared_state=PreparedState("canonical"),
    notes=(
        "the input's codes and per-token scales are the reference kernel's, bit for bit (s = absmax / 127.5 in "
        "float32, q = round-half-even(clamp(x / s, -128, 127))); each output is float(sum_k q_k w_k) * s_x * s_w "
        "(+ bias) in float32, the integer sum exact, one rounding per operation, then rounded once to the input's "
        "dtype: |y - y_ref| <= (K + 8) * 2**-24 * sum_k |x_k w_k| before that rounding, where the reference rounds "
        "each dequantized code and sums K float32 products",
        "at M <= 15 four streams of weight rows are multiplied by up to four rows of x at a time, 64 bytes a step "
        "(the weight read once from memory); from M = 16 panels of 64 weight rows are repacked per thread, 4096 "
        "columns at a time, into VPDPBUSD's column layout (256 KiB) and multiplied by six rows of x at a time",
        "same-run ratios to bf16 F.linear on a 2-core Zen 4 EPYC (4096x4096 and 14336x4096, bf16, 2 threads): see "
        "docs/benchmarks.md",
        "keeps the canonical codes as they are (no copy) plus 8 bytes per output row (the row's sum of codes and "
        "its float32 scale); while it runs, the input's codes (M x K bytes) and, per thread from M = 16, one panel "
        "(at most 64 x 4096 bytes, kept for the next call) and its int32 sums (M x 64, kept up to 1 MiB)",
    ),
)
