"""Native FP8 GEMMs (W8A8: e4m3 weights x e4m3 activations) through torch's scaled matmuls.

Four kernels, one per way torch multiplies FP8 operands; their code is
``qscheme_plugins.native_fp8_kernel``. Each quantizes the activation itself with exactly the
codes and scales of the reference emulation (``qscheme.emulation.quantize_activation``), so the
only differences from the ``reference`` kernel are the GEMM's float32 accumulation order and
its output rounding (stated in each declaration's ``notes``). N and K are padded (zero weight
rows, zero columns in both operands) where the GEMM needs multiples of 16 or 128, and the
output sliced back, so no shape is refused.

- ``native_fp8``: cuBLASLt tensor-wise scaling, CUDA compute capability 8.9 or newer. Tensor
  weights x static per-tensor inputs (compressed-tensors/FP8, modelopt/FP8). A fused layer runs
  one GEMM per run of adjacent partitions sharing their weight and input scales, so different
  per-partition scales are exact. The GEMM writes float32; the bias is added in float32 and the
  sum rounded once to the input's dtype, as the reference does.
- ``native_fp8_rowwise``: row-wise scaling (one scale per token, one per output channel), which
  torch runs with CUTLASS (or cuBLASLt >= 12.9 on 9.0) on compute capability 8.9, 9.x and
  10.0-10.3 only (not 12.x). Channel or tensor weights x dynamic per-token inputs
  (compressed-tensors/FP8_DYNAMIC), and channel weights x static per-tensor inputs (the input
  scale expanded to rows, one GEMM per run of partitions sharing it). Older torch releases' row-wise
  kernels write bf16 only, so the GEMM always writes bf16: the kernel declares bf16 and fp16
  activations (fp16 results are cast from the bf16 output) and leaves fp32 to other kernels.
- ``native_fp8_block``: DeepSeek-style block scaling (128x128 weight blocks x dynamic 1x128
  input groups, compressed-tensors/FP8_BLOCK) through ``torch.nn.functional.scaled_mm``, which
  torch 2.13 runs on compute capability 9.0 only (cuBLASLt >= 12.9: the implementation refuses
  to load under a torch built with an older CUDA). The GEMM writes bf16, so bf16 and fp16
  activations.
- ``native_fp8_cpu``: torch 2.13's CPU ``_scaled_mm`` (tensor-wise and row-wise scaling, any
  output dtype, float32 bias added before the one output rounding; no block scaling: it refuses
  1x128 / 128x128 scales). The schemes of ``native_fp8`` and ``native_fp8_rowwise``, bf16, fp16
  and fp32 activations. It keeps a transposed 8-bit copy of the weight (2.00x the canonical
  tensors, where the reference kernel keeps none) and torch's CPU ``_scaled_mm`` widens the whole
  weight to float32 during each call; it ran about 3x slower than the reference kernel (which
  dequantizes chunks of rows at every call) at M = 1 and 16 on a 4096x4096 layer (bf16 inputs,
  2 CPU threads; benchmarks/cpu_gemm.py). Its priority is below the reference kernel's: it runs when forced (or
  with the reference disabled).

Not claimed: modelopt/fp8_pb_wo is weight-only (16-bit inputs); a W8A8 GEMM would add an
activation quantization the scheme does not have, so its layers go to weight-only kernels. FP8
weights with e5m2 elements (``weight_formats`` is e4m3 only) are rejected at resolution.
"""

from __future__ import annotations

from qscheme.kernels.declaration import (
    FLOAT_SCALE_FORMATS,
    STATIC_FLOAT_SCALE_FORMATS,
    ActivationDtypes,
    ActivationSupport,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

# The weight scale formats the built-in FP8 schemes store (float multipliers of any width).
WEIGHT_SCALE_FORMATS: tuple[str, ...] = ("fp32", "float", "fp16", "bf16")

STATIC_PER_TENSOR = ActivationSupport(
    "fp8", "tensor", dynamic=False, formats=("e4m3",), scale_formats=STATIC_FLOAT_SCALE_FORMATS
)
DYNAMIC_PER_TOKEN = ActivationSupport(
    "fp8", "token", dynamic=True, formats=("e4m3",), scale_formats=FLOAT_SCALE_FORMATS
)
DYNAMIC_GROUPS_OF_128 = ActivationSupport(
    "fp8", "group", 128, dynamic=True, formats=("e4m3",), scale_formats=FLOAT_SCALE_FORMATS
)

TENSOR_WEIGHTS_STATIC_INPUTS = Supports(
    weights=("fp8",),
    weight_formats=("e4m3",),
    activations=(STATIC_PER_TENSOR,),
    granularities=("tensor",),
    scale_formats=WEIGHT_SCALE_FORMATS,
    per_partition_scales=True,
)
ROW_WEIGHTS_TOKEN_INPUTS = Supports(
    weights=("fp8",),
    weight_formats=("e4m3",),
    activations=(DYNAMIC_PER_TOKEN,),
    granularities=("channel", "tensor"),
    scale_formats=WEIGHT_SCALE_FORMATS,
    per_partition_scales=True,
)
CHANNEL_WEIGHTS_STATIC_INPUTS = Supports(
    weights=("fp8",),
    weight_formats=("e4m3",),
    activations=(STATIC_PER_TENSOR,),
    granularities=("channel",),
    scale_formats=WEIGHT_SCALE_FORMATS,
    per_partition_scales=True,
)
BLOCK_WEIGHTS_GROUP_INPUTS = Supports(
    weights=("fp8",),
    weight_formats=("e4m3",),
    activations=(DYNAMIC_GROUPS_OF_128,),
    granularities=("block",),
    blocks=((128, 128),),
    scale_formats=WEIGHT_SCALE_FORMATS,
    per_partition_scales=True,
)

# torch's row-wise FP8 kernels dispatch on these compute capabilities (CUTLASS sm89 / sm90 /
# sm100 builds; cuBLASLt >= 12.9 on 9.0); consumer Blackwell (12.x) is not among them in 2.13.
ROWWISE_CAPABILITIES = (
    CapabilityRange((8, 9), (8, 9)),
    CapabilityRange((9, 0), (9, 9)),
    CapabilityRange((10, 0), (10, 3)),
)

# The error each kernel's notes state, against the reference kernel, per output (y_ref: the
# reference's output; x, w: the quantized input and weight as the reference dequantizes them).
EXACT_ACTIVATIONS = (
    "activation codes and scales are the reference emulation's bit for bit (qscheme.emulation), so only "
    "the GEMM's accumulation and output rounding differ from the reference kernel"
)
FLOAT32_OUTPUT_ERROR = (
    "|y - y_ref| <= 2**-12 * sum_k |x_k * w_k| (tensor-core FP8 accumulation) + u * |y_ref| with u = 0 for "
    "float32, 2**-7 for bf16, 2**-10 for fp16 inputs: the GEMM writes float32, the bias is added in float32 "
    "and the sum rounded once to the input's dtype"
)
BF16_OUTPUT_ERROR = (
    "|y - y_ref| <= 2**-12 * sum_k |x_k * w_k| (tensor-core FP8 accumulation) + 3 * 2**-8 * (|y_ref| + |bias|): "
    "the GEMM writes bf16, the bias is added after it in float32, fp16 outputs are cast from it"
)

NATIVE_FP8 = KernelDeclaration(
    name="native_fp8",
    provider="torch",
    priority=90,
    description="FP8 tensor-core GEMM via torch._scaled_mm with tensor-wise scales (cuBLASLt)",
    supports=(TENSOR_WEIGHTS_STATIC_INPUTS,),
    devices=(DeviceSupport("cuda", capabilities=(CapabilityRange((8, 9)),)),),
    implementation="qscheme_plugins.native_fp8_kernel:NativeFp8Kernel",
    torch_features=("_scaled_mm", "float8_e4m3fn"),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
    notes=(
        EXACT_ACTIVATIONS,
        FLOAT32_OUTPUT_ERROR,
        "fused partitions with different weight or input scales run one GEMM per run of partitions sharing them",
    ),
)

NATIVE_FP8_ROWWISE = KernelDeclaration(
    name="native_fp8_rowwise",
    provider="torch",
    priority=90,
    description="FP8 tensor-core GEMM via torch._scaled_mm with row-wise scales (per token x per channel)",
    supports=(ROW_WEIGHTS_TOKEN_INPUTS, CHANNEL_WEIGHTS_STATIC_INPUTS),
    devices=(DeviceSupport("cuda", capabilities=ROWWISE_CAPABILITIES),),
    implementation="qscheme_plugins.native_fp8_kernel:NativeFp8RowwiseKernel",
    torch_features=("_scaled_mm", "float8_e4m3fn"),
    checks=(ActivationDtypes(("bfloat16", "float16")),),
    notes=(
        EXACT_ACTIVATIONS,
        BF16_OUTPUT_ERROR,
        "the GEMM writes bf16 because older torch releases' row-wise kernels take no other output; "
        "fp32 layers go to other kernels",
    ),
)

NATIVE_FP8_BLOCK = KernelDeclaration(
    name="native_fp8_block",
    provider="torch",
    priority=90,
    description="FP8 GEMM with 128x128 weight blocks x 1x128 input groups via torch.nn.functional.scaled_mm",
    supports=(BLOCK_WEIGHTS_GROUP_INPUTS,),
    devices=(DeviceSupport("cuda", capabilities=(CapabilityRange((9, 0), (9, 0)),)),),
    implementation="qscheme_plugins.native_fp8_kernel:NativeFp8BlockKernel",
    torch_features=("nn.functional.scaled_mm", "nn.functional.ScalingType", "float8_e4m3fn"),
    checks=(ActivationDtypes(("bfloat16", "float16")),),
    notes=(
        EXACT_ACTIVATIONS,
        BF16_OUTPUT_ERROR,
        "needs a torch built with CUDA 12.9 or newer (cuBLASLt block scaling); under an older build its "
        "implementation refuses to load and the layer goes to the next kernel",
    ),
)

NATIVE_FP8_CPU = KernelDeclaration(
    name="native_fp8_cpu",
    provider="torch",
    priority=-10,
    description="torch._scaled_mm on the CPU (row-wise scales), FP8 weights kept in 8 bits",
    supports=(TENSOR_WEIGHTS_STATIC_INPUTS, ROW_WEIGHTS_TOKEN_INPUTS, CHANNEL_WEIGHTS_STATIC_INPUTS),
    devices=(DeviceSupport("cpu"),),
    implementation="qscheme_plugins.native_fp8_kernel:NativeFp8CpuKernel",
    torch_features=("_scaled_mm", "float8_e4m3fn"),
    checks=(ActivationDtypes(("bfloat16", "float16", "float32")),),
    notes=(
        EXACT_ACTIVATIONS,
        "|y - y_ref| <= 2**-16 * sum_k |x_k * w_k| (float32 accumulation order) + u * |y_ref| with u = 0 for "
        "float32, 2**-7 for bf16, 2**-10 for fp16 inputs: torch adds the float32 bias before the one rounding",
        "keeps a transposed 8-bit copy of the weight (the reference kernel keeps none) and torch 2.13's CPU "
        "_scaled_mm widens it to float32 in each call, about 3x slower than the reference kernel at M = 1 and 16 "
        "(4096x4096, bf16 inputs, 2 threads): below the reference by priority, it runs when forced or with the "
        "reference disabled",
    ),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [NATIVE_FP8, NATIVE_FP8_ROWWISE, NATIVE_FP8_BLOCK, NATIVE_FP8_CPU]
