"""torch's tinygemm int4 GEMM: declarations of ``tinygemm`` (CUDA) and ``tinygemm_cpu`` (CPU).

Both run weight-only int4 and uint4 weights (the ``int4`` family: compressed-tensors W4A16 and
W4A16_ASYM, ModelOpt W4A16_AWQ) with float group scales of 32, 64, 128 or 256 along K, or one
scale per output channel (exact: the channel scale is repeated over tinygemm's groups), with or
without zero points, through ``torch._weight_int4pack_mm`` (sm80+) and
``torch._weight_int4pack_mm_for_cpu``. tinygemm dequantizes ``(u - 8) * scale + zero`` with one
bfloat16 scale and zero per group and output row: int4 codes become ``u = q + 8`` and uint4
codes ``u = q``, with ``zero = -z * s`` (int4) or ``(8 - z) * s`` (uint4) for zero point z
(0 without one). Any N and K run: the layer is padded (N to 8 on CUDA and 16 on the CPU, K to
the group size) with zero scales and zero inputs, and the output sliced. The code is in
``qscheme_plugins.tinygemm_kernel``.

Only bfloat16 activations are declared, on both devices. CUDA's op takes nothing else. The CPU
op also takes float16 and float32, but runs them on a scalar path: on 4096x4096 (group 128, two
AVX512 cores) 15-21 ms at M = 1 and 60-82 ms at M = 4, 24-83x its bfloat16 path and 3-9x the
reference kernel's float32 matmul, so those inputs are left to the reference kernel. With
bfloat16 inputs ``tinygemm_cpu`` took 0.62-0.73 / 0.98-1.27 / 3.6-4.5 ms at M = 1 / 4 / 16 (two
idle runs, medians): 6.7-7.1x / 9.0-10.7x / 2.6-3.7x faster than the reference kernel (1.2x at
M = 256), and 3.5-4.1x / 2.1-2.3x / 0.83-0.88x bfloat16 ``F.linear`` on a dense weight; hence
its priority 60, above the Triton kernel (50, on a CPU only under the interpreter) and the
reference (0). ``cpu_gemv`` ranks above it for int4 and uint4 codes in groups of 64 or more (62:
as fast in the same runs, at half the memory), so on the CPU it runs those only where ``cpu_gemv``
cannot (the extension not built, a CPU without AVX2) or is disabled, groups of 32, and the packed
blocks (GGUF Q4_0, Q4_1, Q4_K) above ``cpu_gemv_blocks``.
"""

from __future__ import annotations

from qscheme_plugins.cpu_boundaries import BF16_DOT_BOUNDARY

from qscheme.kernels.declaration import (
    ActivationDtypes,
    BatchRange,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

# The group sizes both ops take (torch refuses 16 and 512).
TINYGEMM_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)

INT4_WEIGHT_ONLY = Supports(
    weights=("int4",),
    granularities=("group", "channel"),
    group_sizes=TINYGEMM_GROUP_SIZES,
    scale_formats=("fp32", "fp16", "bf16", "float"),
    zero_points=True,
    per_partition_scales=True,
    input_pre_scale=True,
)

# Packed blocks (GGUF) whose weights are affine in an unsigned code of at most 4 bits.
TINYGEMM_BLOCK_CODES: tuple[str, ...] = ("uint2", "uint3", "uint4")
BLOCKS_AFFINE = Supports(
    weights=("blocks",),
    granularities=("group",),
    group_sizes=TINYGEMM_GROUP_SIZES,
    block_codes=TINYGEMM_BLOCK_CODES,
)
_BLOCKS_NOTE = (
    "packed blocks (GGUF Q4_0, Q4_1, Q4_K: groups of 32) run as (u - 8) * s + zero with the block's float32 scale "
    "product s and zero = 8 * s + shift (shift = s * offset -/+ the float32 minimum product) each rounded once to "
    "bfloat16: each weight moves by at most 8 * 2**-8 * |s| + 2**-9 * |zero|, plus 2**-24 * |w| for the "
    "reference's own float32 rounding; the block bytes stay beside the packed copy (about 2.1x the 4-bit data)"
)
_SCALE_NOTE = (
    "scales are rounded to bfloat16, the only scale dtype the op takes with bfloat16 inputs: exact for "
    "bfloat16 scales; float16 or float32 scales (or a global scale folded in) move each weight by at most "
    "|u - 8| * |s - bf16(s)| <= 8 * 2**-8 * |s| (u - 8 = q for int4 codes, q - 8 for uint4 codes), plus "
    "2**-24 * |w| for the reference's own float32 rounding of (q - z) * s"
)
_ZERO_NOTE = (
    "zero points become float zeros rounded once to bfloat16, zero = -z * s for int4 codes and (8 - z) * s "
    "for uint4 codes: each weight moves by at most half a bfloat16 ulp of |zero| (<= 2**-8 * |zero|), plus "
    "2**-24 * |w| for the reference's own float32 rounding"
)
_PRE_SCALE_NOTE = (
    "an AWQ input pre-scale multiplies the input in float32 and the product is rounded to bfloat16 "
    "(at most half a bfloat16 ulp per input element)"
)
_MEMORY_NOTE = (
    "after the first forward a layer holds 2 + S / (C + S) times its 4-bit weight with scales (C code bytes, "
    "S scale bytes; 2.03x at group 128 with bfloat16 scales): the packed weight repeats the codes and the "
    "scale-and-zero pairs double the scales"
)

TINYGEMM = KernelDeclaration(
    name="tinygemm",
    provider="torch",
    priority=70,
    description="torch's tinygemm int4 GEMM (torch._weight_int4pack_mm) on bf16 tensor cores",
    supports=(INT4_WEIGHT_ONLY, BLOCKS_AFFINE),
    devices=(DeviceSupport("cuda", capabilities=(CapabilityRange((8, 0)),)),),
    implementation="qscheme_plugins.tinygemm_kernel:TinygemmKernel",
    torch_features=("ops.aten._convert_weight_to_int4pack", "ops.aten._weight_int4pack_mm"),
    checks=(ActivationDtypes(("bfloat16",)),),
    notes=(
        "dequantizes by a bfloat16 fma, bf16(u - 8) * s + zero rounded once to bfloat16, so each weight also "
        "moves by up to half a bfloat16 ulp of |w|; products are summed in float32 (mma m16n8k16) and the "
        "output rounded once to bfloat16; a bias is added to that bfloat16 output and the sum rounded again "
        "(at most 2**-8 * (|x W^T| + |y|) more)",
        _SCALE_NOTE,
        _ZERO_NOTE,
        _PRE_SCALE_NOTE,
        _MEMORY_NOTE,
        _BLOCKS_NOTE,
    ),
)

# Where torch's CPU int4 GEMM stops paying: from M = 16 the dequant_gemm tiles (AMX) beat it on every
# measurement (benchmarks/cpu_plan.py, W4A16 g128 4096x4096 bf16, two shared AVX-512/AMX cores:
# tinygemm_cpu 3.3-14 / 64-88 / 280 ms at M = 16 / 64 / 256 against the tiles' 1.4 / 3.1-3.4 / 25 ms).
TINYGEMM_CPU_BATCHES = BatchRange(
    "cpu",
    0,
    15,
    source="benchmarks/cpu_plan.py, W4A16 g128 4096x4096 bf16, 1 and 2 threads: dequant_gemm's AMX tiles are "
    "2-10x faster from M = 16 on",
)

TINYGEMM_CPU = KernelDeclaration(
    name="tinygemm_cpu",
    provider="torch",
    priority=60,
    description="torch's tinygemm int4 GEMM for CPUs (torch._weight_int4pack_mm_for_cpu)",
    supports=(INT4_WEIGHT_ONLY, BLOCKS_AFFINE),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.tinygemm_kernel:TinygemmCpuKernel",
    torch_features=("ops.aten._convert_weight_to_int4pack_for_cpu", "ops.aten._weight_int4pack_mm_for_cpu"),
    checks=(ActivationDtypes(("bfloat16",)),),
    notes=(
        "dequantizes in float32, fma(u - 8, s, zero) with s and zero widened from bfloat16, sums in float32 "
        "and rounds the output once to bfloat16: with bfloat16 scales, no zero points and no global scale each "
        "weight is the reference's exactly; a bias is added to that bfloat16 output and the sum rounded again "
        "(at most 2**-8 * (|x W^T| + |y|) more)",
        _SCALE_NOTE,
        _ZERO_NOTE,
        _PRE_SCALE_NOTE,
        "float16 and float32 inputs are not declared: the op runs them on a scalar path 24-83x slower than "
        "bfloat16 and 3-9x slower than the reference kernel (4096x4096, M = 1-4)",
        _MEMORY_NOTE,
        _BLOCKS_NOTE,
    ),
    # below the VDPBF16PS tile GEMM's boundary where it holds (qscheme_plugins.cpu_boundaries), else M <= 15
    batch_ranges=(BF16_DOT_BOUNDARY.gemv_range(), TINYGEMM_CPU_BATCHES),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [TINYGEMM, TINYGEMM_CPU]
