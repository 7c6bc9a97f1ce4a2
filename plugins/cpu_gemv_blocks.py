"""qscheme's CPU GEMV over packed blocks (``qscheme._cpu_gemv.gemv_blocks``, C++ with AVX-512 /
AVX2 / scalar loops): the declaration of the ``cpu_gemv_blocks`` kernel, listed by the
``cpu_gemv`` plugin's hook beside ``cpu_gemv``.

It runs schemes of ``packing: blocks`` (GGUF's types Q4_0 ... Q6_K, IQ4_NL, IQ4_XS, MXFP4,
NVFP4) straight from the raw blocks the canonical weight holds: each block decoded in registers
as its declaration says (no type is known by name here or in the loops), the weight never stored.
On CPUs with AVX512-BF16 and VBMI, bfloat16 inputs on the 4-bit types in sub-blocks of 32 and on
the integer codes of 2 to 6 bits (Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K) take a loop of bfloat16 dot
products (``qscheme.cpu_gemv_blocks.dot_loop``; the numerics in the notes).
bfloat16 and float32 inputs (float16 through float32), with bias. The code is in
``qscheme_plugins.cpu_gemv_blocks_kernel`` and ``qscheme.cpu_gemv_blocks``.

Priority 56: below ``tinygemm_cpu`` (60), which also takes Q4_0, Q4_1 and Q4_K with bfloat16
inputs and was faster in the same runs of ``benchmarks/cpu_gemm.py --gguf`` (1.3-2x at M = 1, 2-5x
at M = 4 on one thread), though it rounds the block scales to bfloat16 and keeps a repacked copy
beside the blocks (about 2.1x the 4-bit data) where this kernel is float32-exact up to summation
order and keeps the blocks alone; above ``dequant_gemm`` (55, meant for M >= 16), the Triton
kernel (50) and ``cpu_gemv`` (45, which takes no blocks). For M <= 15 only (the GEMV reads the
weight once per 4 input rows), so larger batches go to the kernels meant for them.

The capability check is ``cpu_gemv``'s (the extension built, an AVX2 or AVX-512 CPU) plus the
block entry point in the built extension.

``cpu_gemv_blocks_bf16`` is the same kernel where its AVX512-BF16 loop runs (bfloat16 inputs on the
types above), declared under its own name with the check ``Bf16BlockLoop`` (this
CPU has AVX512-BF16 and VBMI), so that it ranks above ``tinygemm_cpu`` (62) only on CPUs where it was
measured faster or as fast at half the memory; elsewhere the ranking above holds.

``cpu_gemm_blocks`` is the blocks' GEMM for larger batches (``qscheme.cpu_gemv_blocks.gemm``): panels
of 32 weight rows decoded from the blocks into bfloat16 and multiplied on the AMX tiles or with
VDPBF16PS, on CPUs with AVX512-BF16 and VBMI (check ``BlocksGemm``), bfloat16 inputs, from M = 5 (4 for blocks
of 8 bits a weight, and for every type where the panels multiply on the AMX tiles: check
``BlocksGemmTiles``); priority 63: above the GEMVs, whose ranges end at 15, and ``dequant_gemm``,
which decodes row tiles for torch's GEMM from M = 16.
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
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
    Supports,
    WeightBits,
)

if TYPE_CHECKING:
    from qscheme.kernels.problem import Problem

# The block codes (BlockLayout.code_kind) of every quantized GGUF type; plain float blocks
# (F32, F16, BF16) are left to the dense kernels.
BLOCK_CODES: tuple[str, ...] = ("uint2", "uint3", "uint4", "uint5", "uint6", "int8", "table4", "e2m1")
VECTOR_ISAS: tuple[str, ...] = ("avx2", "avx512")

PACKED_BLOCKS = Supports(weights=("blocks",), block_codes=BLOCK_CODES)


@dataclass(frozen=True)
class NativeBlockLoops:
    """``qscheme._cpu_gemv`` is built with its packed-block entry point, on an AVX2 or AVX-512 CPU."""

    def check(self, problem: Problem) -> CheckResult:
        hint = "reinstall qscheme with a C++17 compiler: pip install --no-build-isolation -e ."
        try:
            module = importlib.import_module("qscheme._cpu_gemv")
        except ImportError as error:
            return CheckResult(False, f"the C++ extension qscheme._cpu_gemv is not built here ({error})", hint)
        if not hasattr(module, "gemv_blocks"):
            return CheckResult(False, "the built qscheme._cpu_gemv predates its packed-block loops", hint)
        supported = str(module.supported_isa())
        if supported not in VECTOR_ISAS:
            return CheckResult(
                False,
                f"this CPU runs neither AVX-512 nor AVX2 (qscheme._cpu_gemv has only its portable loop: {supported})",
                "run the layer on the reference kernel (the default here)",
            )
        return PASSED

    def describe(self) -> str:
        return "qscheme._cpu_gemv built with gemv_blocks, AVX-512 or AVX2 CPU"


BLOCK_GEMV_BATCHES = BatchRange(
    "cpu",
    0,
    15,
    source=(
        "cpu_gemv_blocks reads the weight once per 4 input rows; dequant_gemm (M >= 16) once per call: "
        "the boundary is dequant_gemm's own, as cpu_gemv's (benchmarks/cpu_gemm.py --gguf)"
    ),
)

CPU_GEMV_BLOCKS = KernelDeclaration(
    name="cpu_gemv_blocks",
    provider="qscheme",
    priority=56,
    description="qscheme's C++ CPU GEMV over packed blocks (GGUF): decoded in registers, float32 sums",
    supports=(PACKED_BLOCKS,),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.cpu_gemv_blocks_kernel:CpuGemvBlocksKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")), NativeBlockLoops()),
    batch_ranges=(BLOCK_GEMV_BATCHES,),
    prepared_state=PreparedState("canonical"),
    notes=(
        "per sub-block g of a block the kernel sums x_k * value(code_k) in float32 and adds s_g times that sum "
        "(minus, or plus, m_g times the sub-block's sum of x), where s_g and m_g are the float32 scale and minimum "
        "products the reference decoder forms; the reference rounds each weight s_g * value - m_g to float32 "
        "first: |y - y_ref| <= 2 * (K + 8) * 2**-24 * sum_k |x_k| * (|s_k * value_k| + |m_k|) before the output "
        "is rounded once to the input's dtype (a bias is added in float32 before that rounding), so with 16-bit "
        "outputs the two may also differ by one unit in the last place of the output",
        "AVX512-BF16 loop (QSCHEME_CPU_GEMV_BF16DOT=0 turns it off), on a CPU with AVX512-BF16 and VBMI running the "
        "AVX-512 loops, for bfloat16 inputs on 4-bit codes in sub-blocks of 32 read as nibble pairs (Q4_0, Q4_1, "
        "Q4_K, IQ4_NL, IQ4_XS, MXFP4), or on integer codes of up to 6 bits in one or two pieces in sub-blocks of 16 "
        "or 32 (Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K), whose code values are bfloat16 numbers, each zero or of a "
        "magnitude in [2**-8, 2**8], where every element of x is zero or of a magnitude in [2**-100, 2**64] (else "
        "the loops above run): x as it is times the code values with VDPBF16PS, each product exact and added in "
        "float32 (no product or sum is subnormal or overflows in that range), each sub-block's sums multiplied by "
        "s_g in float32: within the bound above",
        "float16 inputs are widened to float32 and the output rounded back once",
        "integer products for blocks of signed byte codes scaled by one fp16 field (Q8_0), one or two bfloat16 rows "
        "of x where QSCHEME_CPU_GEMV_GGUF_INT16 turns them on (by default on AMX CPUs, which have AVX512-VNNI; 1 "
        "needs AVX512-VNNI too): x rounded to 16-bit integers per block of 256 as the 4-bit types' integer products "
        "round it (cpu_gemv_blocks_bf16's notes: the bound grows by sum_k |w_k| * half the step of k's block), "
        "the codes widened to 16 bits and multiplied with VPMADDWD (exact 32-bit sums of two products), each "
        "block's sums times its scale in float32. On a 2-core Emerald Rapids (same process, the switch toggled "
        "call by call, M = 1, 4096x4096 and 14336x4096): 1.44-1.96x -> 1.86-2.45x bf16 F.linear at 1 and 2 "
        "threads; M = 2: 1.04-1.12x -> 1.43-1.72x",
        "keeps the canonical blocks as they are (no copy), plus one small program per scheme",
    ),
)


# The 4-bit GGUF types in sub-blocks of 32 (Q4_0, Q4_1, Q4_K: uint4; IQ4_NL, IQ4_XS: table4; MXFP4:
# e2m1), every one read as nibble pairs, which the AVX512-BF16 loop takes.
BF16_BLOCK_CODES: tuple[str, ...] = ("uint4", "table4", "e2m1")
PACKED_4BIT_G32 = Supports(
    weights=("blocks",), granularities=("group",), group_sizes=(32,), block_codes=BF16_BLOCK_CODES
)
# The integer codes of 2, 3, 5 and 6 bits in sub-blocks of 16 or 32 (Q2_K, Q3_K, Q6_K; Q5_0, Q5_1,
# Q5_K), each code from one or two pieces, which the loop takes 32 elements a step.
PLANE_BLOCK_CODES: tuple[str, ...] = ("uint2", "uint3", "uint5", "uint6")
PACKED_PLANES = Supports(
    weights=("blocks",), granularities=("group",), group_sizes=(16, 32), block_codes=PLANE_BLOCK_CODES
)


@dataclass(frozen=True)
class Bf16BlockLoop:
    """This CPU runs ``cpu_gemv_blocks``' AVX512-BF16 loop (``qscheme.cpu_gemv_blocks.bf16_loop_available``)."""

    def check(self, problem: Problem) -> CheckResult:
        from qscheme import cpu_gemv_blocks  # torch: the kernel's own requirement, checked before this

        if cpu_gemv_blocks.bf16_loop_available():
            return PASSED
        return CheckResult(
            False,
            "this CPU does not run cpu_gemv_blocks' AVX512-BF16 loop (it needs AVX512-BF16 and VBMI, the AVX-512 "
            "loops in use, and QSCHEME_CPU_GEMV_BF16DOT not 0)",
            "tinygemm_cpu or cpu_gemv_blocks run the layer here",
        )

    def describe(self) -> str:
        return "a CPU running cpu_gemv_blocks' AVX512-BF16 loop (AVX512-BF16 and VBMI)"


CPU_GEMV_BLOCKS_BF16 = KernelDeclaration(
    name="cpu_gemv_blocks_bf16",
    provider="qscheme",
    priority=62,
    description=(
        "cpu_gemv_blocks on its AVX512-BF16 loop: the 4-bit GGUF types in sub-blocks of 32 and the 2- to 6-bit integer "
        "codes, bf16 products of x and the code values, float32 sums"
    ),
    supports=(PACKED_4BIT_G32, PACKED_PLANES),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.cpu_gemv_blocks_kernel:CpuGemvBlocksKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16",)), NativeBlockLoops(), Bf16BlockLoop()),
    batch_ranges=(BLOCK_GEMV_BATCHES,),
    prepared_state=PreparedState("canonical"),
    notes=(
        "the cpu_gemv_blocks kernel where its AVX512-BF16 loop runs, under its own name so that the ranking follows "
        "the CPU: priority 62, above tinygemm_cpu (60), which takes Q4_0, Q4_1 and Q4_K with bfloat16 inputs. "
        "Same-run ratios to bf16 F.linear on a 2-core Zen 4 EPYC (benchmarks/cpu_gemm.py, 4096x4096 and "
        "14336x4096, 1 and 2 threads): Q4_0 3.71-4.79x at M = 1 and 2.01-2.43x at M = 4 (tinygemm_cpu 3.20-3.63x and "
        "1.71-2.05x); Q4_1 0.88-1.15x and Q4_K 0.76-0.95x tinygemm_cpu's speed; IQ4_NL, IQ4_XS and GGUF MXFP4 "
        "1.4-6x the float32 loops'. It holds the blocks alone (1.00x; tinygemm_cpu 2.11x, with bfloat16-rounded "
        "scales) and is float32-exact up to summation order. From memory, as a decode reads the layers "
        "(benchmarks/cpu_layer_stack.py, 16 Llama blocks, 2 threads), Q4_0 and Q4_1 run at 1.0x and 0.92x "
        "tinygemm_cpu's speed and Q4_K at 0.81x; a 1.1B GGUF Q4_0 model decodes at 0.96-1.01x tinygemm_cpu's "
        "tokens per second at 0.72x its resident memory (docs/benchmarks.md). QSCHEME_DISABLED_KERNELS="
        "cpu_gemv_blocks_bf16 sends these three to tinygemm_cpu",
        "the 2- to 6-bit integer codes (Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K), which no other CPU kernel takes, run "
        "1.3-3.8x faster at M = 1 and 1.4-3.3x at M = 4 than on the float32 loops in the same runs (4096x4096 and "
        "14336x4096, 2 threads, the loop switched by QSCHEME_CPU_GEMV_BF16DOT): 1.1-2.2x bf16 F.linear at M = 1 "
        "(Q6_K 1.43-1.53x, from 0.62-0.73x), 0.70-1.17x at M = 4",
        "numerics: cpu_gemv_blocks' (its AVX512-BF16 loop: bfloat16 inputs whose elements are zero or of a magnitude "
        "in [2**-100, 2**64], else its float32 loops in the same call); a layout of these codes the loop does not "
        "read (none of the built-in types) runs the float32 loops too (qscheme.cpu_gemv_blocks.dot_loop says which)",
        "integer products on AMX CPUs (Intel, where VDPBF16PS issues at half the FMA's rate): one or two rows of x "
        "on the 4-bit types whose code values are integers (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS; not MXFP4) are "
        "rounded to 16-bit integers per block of 256 elements over a power-of-two step (an element within 2**8 "
        "of its block's largest magnitude exactly, a smaller one within 2**-16 of that magnitude) and multiplied "
        "with VPDPWSSD, summed exactly in 32 bits; QSCHEME_CPU_GEMV_GGUF_INT16=0 or 1 (read at each call) turns "
        "them off or on (on needs AVX512-VNNI). On a 2-core Emerald Rapids (4096x4096, 1 thread, same process) "
        "Q4_0 went from 2.13x to 2.81x bf16 F.linear at M = 1, IQ4_NL 2.21x to 3.05x, Q4_1 2.08x to 2.57x, "
        "Q4_K 1.68x to 2.05x",
        "keeps the canonical blocks as they are (no copy), plus one small program per scheme",
    ),
)


@dataclass(frozen=True)
class BlocksGemm:
    """This CPU runs ``qscheme.cpu_gemv_blocks.gemm`` (AVX512-BF16 and VBMI, the AVX-512 loops in use)."""

    def check(self, problem: Problem) -> CheckResult:
        from qscheme import cpu_gemv_blocks  # torch: the kernel's own requirement, checked before this

        if cpu_gemv_blocks.gemm_available():
            return PASSED
        return CheckResult(
            False,
            "this CPU does not run the blocks' fused GEMM (it needs AVX512-BF16, VBMI and the AVX-512 loops in use)",
            "cpu_gemv_blocks up to M = 15 and dequant_gemm from M = 16 run the layer here",
        )

    def describe(self) -> str:
        return "a CPU running the blocks' fused GEMM (AVX512-BF16 and VBMI)"


# the blocks of 8 bits a weight and more (Q8_0, whose GEMV runs the float32 loop, not the bfloat16 one)
WIDE_BLOCK_GEMM_BATCHES = BatchRange(
    "cpu",
    4,
    None,
    source=(
        "benchmarks/cpu_gemm.py, 4096x4096, bf16, 2 threads, a 2-core Zen 4 EPYC, same-run ratios to bf16 F.linear, "
        "the fused GEMM / the blocks' GEMV, two runs (fifteenth pass, docs/notes/cpu-gemv-2026-12.md item 67): Q8_0 "
        "M = 4: 0.94x / 0.77x and 1.09x / 0.91x; M = 5: 0.90x / 0.75x and 0.94x / 0.72x; M = 3: 1.00x / 1.08x (the "
        "GEMV). The narrower blocks' GEMVs win or tie at M = 4 (Q4_0 1.38x / 1.67x, Q4_K 1.11x / 1.47x, Q5_K "
        "0.81x / 0.99x, Q6_K 0.87x / 0.84x and 0.94x / 1.08x, Q3_K 1.04x / 1.16x)"
    ),
    when=(WeightBits(8.0),),
)

BLOCK_GEMM_BATCHES = BatchRange(
    "cpu",
    5,
    None,
    source=(
        "benchmarks/cpu_gemm.py, 4096x4096, bf16, 2 threads, a 2-core Zen 4 EPYC, same-run ratios to bf16 "
        "F.linear, the fused GEMM / the blocks' GEMV (four weight rows at every M), fifteenth pass "
        "(docs/notes/cpu-gemv-2026-12.md item 67): M = 5: Q4_0 1.15x / 1.19x, Q4_K 0.99x / 0.95x, Q5_K 0.81x / "
        "0.64x, Q6_K 0.79x / 0.54x and 0.88x / 0.72x, Q2_K 0.96x / 0.65x, Q3_K 0.97x / 0.74x, Q5_0 0.89x / 0.60x,"
        " Q5_1 0.97x / 0.67x, IQ4_XS 1.35x / 1.35x, Q4_1 1.12x / 1.13x; M = 6: Q4_0 1.14x / 1.13x, Q4_K 1.00x / "
        "0.91x; M = 8: Q4_0 1.25x / 1.02x; at M = 4 the GEMV wins or ties but for Q8_0 (declared apart, from 4), "
        "Q5_0 (0.95x / 0.80x in one run) and Q2_K (1.13x / 1.06x)"
    ),
)


@dataclass(frozen=True)
class BlocksGemmTiles:
    """The blocks' fused GEMM multiplies on the AMX tiles here (``qscheme.cpu_gemv_blocks.gemm_loops``)."""

    def check(self, problem: Problem) -> CheckResult:
        from qscheme import cpu_gemv_blocks  # torch: the kernel's own requirement, checked before this

        loops = cpu_gemv_blocks.gemm_loops()
        if loops == "amx":
            return PASSED
        return CheckResult(
            False,
            f"the blocks' fused GEMM multiplies with {loops or 'nothing'} here, not on the AMX tiles (AMX-BF16, the "
            "tile state granted, QSCHEME_CPU_GEMM_BLOCKS_AMX not 0)",
            "the kernel's other declared batch ranges hold here",
        )

    def describe(self) -> str:
        return "the blocks' fused GEMM on the AMX tiles"


# AMX CPUs: the panels multiply on the AMX tiles, where up to M = 16 the decode is nearly all a call costs
AMX_SOURCE = (
    "benchmarks/cpu_gemm.py --gguf --kernel cpu_gemm_blocks --kernel cpu_gemv_blocks, 4096x4096 and 14336x4096, "
    "bf16, 2 and 1 threads, a 2-core Intel Xeon with AMX (Emerald Rapids), same-run ratios to bf16 F.linear, the "
    "fused GEMM on the AMX tiles / the blocks' GEMV (seventeenth pass, docs/notes/cpu-gemv-2026-12.md item 75): "
    "M = 4: Q4_K 1.02x / 0.84x, 1.36x / 1.00x, 1.26x / 1.07x, 0.98x / 1.10x; Q4_0 1.13x / 1.00x, 1.43x / 1.46x, "
    "1.28x / 1.20x, 1.13x / 1.11x; IQ4_XS 1.33-1.80x / 0.83-1.10x; Q8_0 0.77-0.88x / 0.64-0.95x; Q6_K 0.72-0.88x / "
    "0.69-0.87x; Q5_K 0.62-0.83x / 0.68-0.99x (the one type it loses); M = 3: the GEMV wins or ties but for Q8_0 "
    "and IQ4_XS. Against the same GEMM multiplying with VDPBF16PS (QSCHEME_CPU_GEMM_BLOCKS_AMX=0, same process, "
    "4096x4096, 2 threads), Q4_K / Q4_0 / Q6_K / Q8_0: M = 16 1.02x / 1.10x / 0.72x / 0.80x against 0.31-0.37x, "
    "M = 64 1.59x / 1.34x / 0.94x / 0.99x against 0.17-0.28x, M = 256 0.69x / 0.97x / 0.83x / 1.12x against "
    "0.11-0.18x (dequant_gemm's row tiles, which took M >= 48 there before: 0.26-0.68x)"
)
AMX_BLOCK_GEMM_BATCHES = BatchRange("cpu", 4, None, source=AMX_SOURCE, when=(BlocksGemmTiles(),))

CPU_GEMM_BLOCKS = KernelDeclaration(
    name="cpu_gemm_blocks",
    provider="qscheme",
    priority=63,
    description=(
        "qscheme's C++ GEMM over packed blocks (GGUF) for larger batches: 32-row panels decoded from the blocks into "
        "bf16, multiplied on the AMX tiles (AMX-BF16) or with VDPBF16PS (AVX512-BF16)"
    ),
    supports=(PACKED_BLOCKS,),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.cpu_gemv_blocks_kernel:CpuGemmBlocksKernel",
    requires_modules=("torch",),
    checks=(ActivationDtypes(("bfloat16",)), NativeBlockLoops(), BlocksGemm()),
    batch_ranges=(AMX_BLOCK_GEMM_BATCHES, WIDE_BLOCK_GEMM_BATCHES, BLOCK_GEMM_BATCHES),
    prepared_state=PreparedState("canonical"),
    notes=(
        "numerics: each weight is the reference decoder's float32 value rounded once to bfloat16 (at most "
        "2**-9 * |w|; a float32 subnormal weight counts as zero, as VDPBF16PS reads bfloat16 subnormal inputs as "
        "zero), products of bfloat16 values are exact and summed in float32, the output rounded once to bfloat16 "
        "with the bias added in float32 before: dequant_gemm's bound on AVX-512 BF16",
        "same-run ratios to bf16 F.linear on a 2-core Zen 4 EPYC (benchmarks/cpu_gemm.py, 4096x4096 and 14336x4096, "
        "2 threads): Q4_0, Q4_1, Q4_K, IQ4_XS 1.27-1.57x at M = 8, 1.12-1.54x at M = 16, 1.01-1.26x at M = 64, "
        "0.93-1.08x at M = 256; Q2_K 0.95-1.33x; Q8_0 0.86-1.11x; Q3_K, Q5_0, Q5_K, Q6_K 0.71-1.04x (dequant_gemm's "
        "row tiles on the same CPU: 0.24-0.69x at M = 16-256)",
        "a layout the blocks' vector decoder does not read (none of the built-in types: blocks of a multiple of 32 "
        "elements, each 16 of a chunk's bytes within one 16-byte window) is refused when the layer is prepared, "
        "naming the scheme",
        "keeps the canonical blocks as they are (no copy); while it runs, each thread holds a panel of at most "
        "32 x 4128 bfloat16 weights (258 KiB) and its float32 sums, freed past 1 MiB",
    ),
)
