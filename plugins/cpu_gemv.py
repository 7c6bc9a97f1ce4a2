"""qscheme's CPU GEMV (``qscheme._cpu_gemv``, C++ with AMX tile / AVX-512 / AVX2 / scalar loops):
the declaration of the ``cpu_gemv`` kernel.

It runs the scale-and-code formats on the CPU without dequantizing the weight: e2m1 (NVFP4,
MXFP4, FP4 with float scales), e4m3 (FP8 per tensor, channel or 128x128 block), int8 and uint8
(W8A16, W8A8's weights), int4 and uint4, 4-bit codes into a 16-value codebook (bitsandbytes NF4
and FP4), with zero points, per-partition global scales and AWQ pre-scales; bfloat16, float16
(through float32) and float32 inputs. Schemes that quantize their activations run with the
reference kernel's exact activation emulation (``qscheme.emulation``) ahead of the GEMV. The
code is in ``qscheme_plugins.cpu_gemv_kernel`` and ``qscheme.cpu_gemv``.

Priority 45: above the reference kernel (0) on every format it takes, and below the Triton kernel
(50), which runs on a CPU only under the Triton interpreter (a test path); 62 for int4 and uint4
codes in groups of 64 or more or per channel (``INT4_FORMATS``) and for int4 codes in groups of 32
without zero points (``INT4_G32_FORMATS``), above ``tinygemm_cpu`` (60): as
fast within the noise of same-run measurements, at half its memory (the figures are beside the
entry).

The capability check ``NativeLoops`` rejects the kernel, with its reason in the resolve trace,
where the extension was not built (no C++ compiler at install) or the CPU runs neither AVX-512
nor AVX2 (the portable loop is correct but slower than torch's matmul there); it imports the
extension, a plain CPython module, and nothing else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qscheme_plugins.cpu_boundaries import BF16_DOT_BOUNDARY, E4M3_BF16_DOT_BOUNDARY, FLOAT32_BOUNDARY

from qscheme.descriptor.model import SCALE_FORMATS, weight_family
from qscheme.kernels.declaration import (
    DEPLOYED_ACTIVATION_PAIRS,
    NVFP4_ACTIVATION_PAIR,
    PASSED,
    ActivationDtypes,
    BatchRange,
    CheckResult,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
    Supports,
)
from qscheme.plugins import hookimpl

if TYPE_CHECKING:
    from qscheme.kernels.problem import Problem

# The element formats of the weight codes the loops decode.
CODE_FORMATS: tuple[str, ...] = ("e2m1", "int4", "uint4", "e4m3", "int8", "uint8")
VECTOR_ISAS: tuple[str, ...] = ("avx2", "avx512")

WEIGHT_ONLY_FORMATS = Supports(
    weights=("nvfp4", "mxfp4", "fp4", "int4", "int8", "fp8"),
    weight_formats=CODE_FORMATS,
    granularities=("tensor", "channel", "group", "block"),
    scale_formats=("e4m3", "e8m0", "fp32", "fp16", "bf16", "float"),
    zero_points=True,
    per_partition_scales=True,
    input_pre_scale=True,
    input_permutation=True,
)


# int4 and uint4 codes in groups of 64 or more, or per channel (compressed-tensors W4A16 / W4A16_ASYM,
# GPTQ, AWQ, ModelOpt W4A16_AWQ), ranked above tinygemm_cpu (60), which takes them too with bfloat16
# inputs: same-run medians on a 2-core Zen 4 EPYC (4096x4096 and 14336x4096, M = 1 and 4, 1 and 2
# threads; cpu_gemv with its VNNI loop) put the two within 0.72-1.28x of each other (both 2.7-6.0x bf16
# F.linear at M = 1), and cpu_gemv holds the canonical tensors alone where tinygemm_cpu holds 2.0x them
# (a repacked copy beside the codes). Groups of 32 with zero points stay below tinygemm_cpu: with them
# cpu_gemv flushes its integer sums every 64 elements and was 1.6-1.7x slower at M = 4 (GPTQ
# W4A16_ASYM_G32, same runs); without zero points see INT4_G32_FORMATS.
INT4_GROUPS = (64, 128, 256, 512, 1024)
INT4_FORMATS = Supports(
    weights=("int4",),
    weight_formats=("int4", "uint4"),
    granularities=("group", "channel"),
    group_sizes=INT4_GROUPS,
    scale_formats=("fp32", "fp16", "bf16", "float"),
    zero_points=True,
    per_partition_scales=True,
    input_pre_scale=True,
    input_permutation=True,
    priority=62,
)
# int4 codes in groups of 32 without zero points (compressed-tensors W4A16_G32, GPTQ W4A16_G32 with
# symmetric codes, GGUF Q4_0 converted), ranked above tinygemm_cpu too since the AVX512-BF16 loop
# (x as it is, one scale multiply per group per 64 elements, no integer conversion): same-run
# medians on the 2-core Zen 4 EPYC (benchmarks/cpu_gemm.py, 4096x4096 and 14336x4096, M = 1 and 4,
# 1 and 2 threads) put cpu_gemv at 0.93-1.28x tinygemm_cpu's speed (6 of 8 cells at or above 1.0x),
# at half its memory; on that CPU the VNNI loop runs these layers within 0.84-1.0x of the BF16 loop
# (benchmarks/cpu_gemv_loops.py).
INT4_G32_FORMATS = Supports(
    weights=("int4",),
    weight_formats=("int4",),
    granularities=("group",),
    group_sizes=(32,),
    scale_formats=("fp32", "fp16", "bf16", "float"),
    per_partition_scales=True,
    input_permutation=True,
    priority=62,
)

# 4-bit codes into a declared table of 16 values (bitsandbytes NF4 and FP4) with group scales
CODEBOOK_FORMATS = Supports(weights=("codebook",), granularities=("group",), per_partition_scales=True)


def _restricted(entry: Supports) -> Supports:
    """An activation pair of the reference kernel, with the weights these loops decode."""
    formats = tuple(f for f in CODE_FORMATS if f in _family_formats(entry.weights))
    return Supports(
        weights=entry.weights,
        activations=entry.activations,
        weight_formats=formats,
        zero_points=entry.zero_points,
        per_partition_scales=entry.per_partition_scales,
        input_pre_scale=entry.input_pre_scale,
    )


def _family_formats(families: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f for f in CODE_FORMATS if any(weight_family(f, s) in families for s in SCALE_FORMATS))


@dataclass(frozen=True)
class NativeLoops:
    """The extension ``qscheme._cpu_gemv`` is built and this CPU runs its AVX2 or AVX-512 loops."""

    def check(self, problem: Problem) -> CheckResult:
        try:
            module = importlib.import_module("qscheme._cpu_gemv")
        except ImportError as error:
            return CheckResult(
                False,
                f"the C++ extension qscheme._cpu_gemv is not built here ({error})",
                "reinstall qscheme with a C++17 compiler: pip install --no-build-isolation -e .",
            )
        supported = str(module.supported_isa())
        if supported not in VECTOR_ISAS:
            return CheckResult(
                False,
                f"this CPU runs neither AVX-512 nor AVX2 (qscheme._cpu_gemv has only its portable loop: {supported})",
                "run the layer on the reference kernel (the default here)",
            )
        return PASSED

    def describe(self) -> str:
        return "qscheme._cpu_gemv built, AVX-512 or AVX2 CPU"


# Up to M = 16 it was faster than dequant_gemm (row tiles dequantized, then torch's GEMM) and at
# M = 32 slower: the GEMM reads the weight once for all rows, these loops once per 8 rows. The
# boundary is dequant_gemm's own (M >= 16), so that no single M falls to a third kernel.
GEMV_BATCHES = BatchRange(
    "cpu",
    0,
    15,
    source=(
        "cpu_gemv vs dequant_gemm (QuantLinear, kernel forced) on 4096x4096, bf16 inputs, 2 threads, "
        "2-core Xeon under load: NVFP4A16 7.7 vs 32.8 ms at M=4, 19.2 vs 39.7 ms at M=16, 33.3 vs 27.4 ms "
        "at M=32; W8A16_G32 12.1 vs 15.0 ms at M=16, 70.8 vs 41.2 ms at M=32"
    ),
)

CPU_GEMV = KernelDeclaration(
    name="cpu_gemv",
    provider="qscheme",
    priority=45,
    description="qscheme's C++ CPU GEMV: codes decoded in registers, float32 sums (AMX tiles / AVX-512 / AVX2)",
    supports=(
        INT4_FORMATS,
        INT4_G32_FORMATS,
        WEIGHT_ONLY_FORMATS,
        CODEBOOK_FORMATS,
        _restricted(NVFP4_ACTIVATION_PAIR),
        *(_restricted(entry) for entry in DEPLOYED_ACTIVATION_PAIRS),
    ),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.cpu_gemv_kernel:CpuGemvKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")), NativeLoops()),
    # below the tile GEMM's boundaries where they hold (qscheme_plugins.cpu_boundaries), else M <= 15
    batch_ranges=(
        E4M3_BF16_DOT_BOUNDARY.gemv_range(),
        BF16_DOT_BOUNDARY.gemv_range(),
        FLOAT32_BOUNDARY.gemv_range(),
        GEMV_BATCHES,
    ),
    prepared_state=PreparedState("canonical"),
    notes=(
        "each weight is the reference's float32 value, (code - zero) * effective scale, formed in registers; the "
        "products are summed in float32 with fused multiply-adds in another order than the reference's matmul "
        "(with one input row and no zero points the scale multiplies each group's partial sum instead)",
        "AMX tile path (on the AVX-512 loops, where cpuid shows AMX-BF16, AVX512-BF16 and VBMI and Linux grants the "
        "tile state; QSCHEME_CPU_GEMV_AMX=0 turns it off): from 4 rows of x (int8 / uint8 codes: 5; 4-bit codes the "
        "VNNI loop takes: 5, but 4 for byte scales in groups of 32 or more, MXFP4's; with fewer the float32 and "
        "integer loops are faster; QSCHEME_CPU_GEMV_AMX=all takes "
        "every M), where every element of x is a bfloat16 value, zero or at least 2**-100 in magnitude, and the "
        "layer has no zero points and code values exact in bfloat16 (e2m1, int4, uint4, e4m3, int8, uint8), 16 "
        "weight rows are decoded to bfloat16 32 columns at a time and multiplied by up to 16 rows of x with "
        "TDPBF16PS (the weight read once for all of them); 4-bit codes times byte scales (NVFP4's e4m3, MXFP4's "
        "e8m0) are exact in bfloat16 and folded into the decode (a row with a scale whose products are not exact, "
        "normal and finite in bfloat16 runs the float32 loop), a per-row global scale multiplies or divides the "
        "row's sum at the end, and other scales multiply each scale group's float32 tile sums; products are exact "
        "and sums float32, one rounding per addition, in sequence along K",
        "bound: each side's float32 result is within (K + 4) * 2**-24 * sum_k |x_k * w_k| of the exact sum (up to K "
        "additions in sequence, and the roundings that form the weight or apply the scales), so |y - y_ref| <= "
        "(2K + 8) * 2**-24 * sum_k |x_k * w_k| before the output is rounded once to the input's dtype (a bias is "
        "added in float32 before that rounding); with 16-bit outputs the two may also differ by one unit in the "
        "last place of the output",
        "VNNI integer loop (QSCHEME_CPU_GEMV_INT16=0 turns it off): one to four bfloat16 rows of x (ahead of the "
        "tiles, unless QSCHEME_CPU_GEMV_AMX=all) on 4-bit codes whose values times a power of two up to 16 are "
        "integers (e2m1, int4, uint4), with zero points times that power of two within 2047 or none, scale groups of "
        "16, 32 or a multiple of 64, on a CPU with "
        "AVX512-VNNI: each block of 256 elements of x is rounded to 16-bit integers over the smallest power-of-two "
        "step that holds its largest magnitude (every element within 2**7 of it is exact, any other is off by at "
        "most half a step, 2**-16 of that magnitude), the products are summed exactly in 32-bit integers and each "
        "group's sum is multiplied by its effective scale in float32; the bound above grows by sum_k |w_k| * (half "
        "the step of k's block)",
        "AVX512-BF16 loop (QSCHEME_CPU_GEMV_BF16DOT=0 / 1 turns it off / on; by default off on CPUs with AMX-BF16, "
        "Intel's, where VDPBF16PS issues at half the FMA's rate and the VNNI loop ran 1.2-1.6x faster: NVFP4A16, "
        "MXFP4A16, W4A16 at M = 1-3, 4096x4096 and 14336x4096, a 2-core Emerald Rapids), instead of the VNNI loop on a"
        " CPU with AVX512-BF16, where the layer has no zero points, its code values are exact in bfloat16 and its "
        "scale groups are of 16 or 32 (NVFP4, MXFP4, int4 in groups of 32) or x has two to four rows (any group), and "
        "every element of x is zero or of a magnitude in [2**-100, 2**64] (else the VNNI loop runs): x as it is times "
        "the code values, each product exact and added in float32 (VDPBF16PS; no product or sum is subnormal or "
        "overflows in that range), each group's sums multiplied by its effective scale in float32: within the float32 "
        "bound above, with no rounding of x",
        "float16 inputs are widened to float32 and the output rounded back once; AWQ pre-scales and activation "
        "quantization are applied to the input exactly as the reference kernel applies them, except that with "
        "bfloat16 inputs and no activation quantization the pre-scaled input (x * pre-scale in float32) is rounded "
        "once to bfloat16, so that the bfloat16 loops take it (at most half a bfloat16 ulp per element: the bound "
        "grows by 2**-9 * sum_k |x_k * w_k|, and the VNNI loop's steps are those of that input); where the quantized "
        "input is e4m3 or int8 code values times one float32 scale per row (per-tensor or per-token: FP8, "
        "FP8_DYNAMIC, W8A8), the codes are multiplied by the weight and each output row by its scale afterwards "
        "(scale * (codes . w): one rounding where the reference rounds each code times the scale)",
        "act-order layers (GPTQ desc_act, input channels permuted in the canonical weight): the input's columns are "
        "permuted into the codes' order (after any pre-scale), the same products summed in another order",
        "keeps the canonical tensors as they are (no copy): plus 4 bytes per output row where a global or "
        "per-tensor scale is folded per row, and two small value tables",
    ),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    from qscheme_plugins.cpu_gemv_blocks import (  # packed blocks (GGUF)
        CPU_GEMM_BLOCKS,
        CPU_GEMV_BLOCKS,
        CPU_GEMV_BLOCKS_BF16,
    )
    from qscheme_plugins.cpu_int8_gemm import CPU_INT8_GEMM  # int8 x int8 (W8A8)

    return [CPU_GEMV, CPU_GEMV_BLOCKS, CPU_GEMV_BLOCKS_BF16, CPU_GEMM_BLOCKS, CPU_INT8_GEMM]
