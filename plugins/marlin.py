"""Marlin (weight-only FP4, int4, int8 and FP8 with 16-bit activations) through vLLM's ops.

The GEMM and the weight repack are vLLM's compiled ops (``marlin_gemm``, ``gptq_marlin_repack``
in ``vllm._custom_ops``, vLLM 0.33); the scale, zero-point and padding transforms are qscheme's
own (``qscheme_plugins.marlin_layout``, checked against vLLM's Python helpers). The code is in
``qscheme_plugins.marlin_kernel``.

What vLLM 0.33's Marlin takes (``marlin_utils.query_marlin_supported_quant_types`` and
``MARLIN_SUPPORTED_GROUP_SIZES``, ``marlin_utils_fp4`` / ``marlin_utils_fp8``):

- scalar types ``uint4b8`` (int4), ``uint4`` with zero points (int4 / uint4 codes with zero
  points; only 4-bit weights take zero points), ``uint8b128`` (int8), ``float8_e4m3fn`` and
  ``float4_e2m1f`` (NVFP4 with e4m3 groups of 16);
- integer scales per channel or in groups of 32, 64 or 128 along K; FP8 scales per tensor,
  per channel or in groups of 128 (128x128 blocks are groups of 128 repeated along N: vLLM
  builds FP8 Marlin for channel scales and groups of 128 only); compute capability 8.0 or newer;
  bfloat16 or float16 activations, which also set the scales' dtype;
- N and K multiples of (64, 128) or (128, 64): other shapes are zero-padded at prepare (as
  vLLM 0.33 does, ``marlin_padded_nk``), the input padded and the output sliced per call, so no
  shape is rejected;
- one global scale per GEMM: fused NVFP4 partitions whose global scales differ run one GEMM per
  partition (exact, one launch each); FP8 per-tensor partition scales become channel scales.

MXFP4 (e8m0 groups of 32) is a second declaration, ``marlin_mxfp4``, on the same code: vLLM 0.33
compiles its MXFP4 Marlin for bfloat16 activations only, and a declaration's dtype check holds
for all its schemes. Compute capability 7.5 (Turing, float16 only) is not claimed.

The ops change signature across vLLM releases; only 0.33 is checked (``requires_versions``).
"""

from __future__ import annotations

from dataclasses import replace

from qscheme.kernels.declaration import (
    ActivationDtypes,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    Supports,
)
from qscheme.plugins import hookimpl

# The vLLM releases whose Marlin ops the implementation calls (only 0.33.0 is checked).
VLLM_VERSIONS = ">=0.33,<0.34"
# Float formats of integer and FP8 weight scales (e4m3 / e8m0 scales are FP4 formats to Marlin).
_FLOAT_SCALES = ("fp32", "fp16", "bf16", "float")
_GROUPS = (32, 64, 128)

MARLIN = KernelDeclaration(
    name="marlin",
    provider="vllm",
    priority=80,
    description="vLLM's Marlin mixed-precision GEMM (weights repacked into Marlin tiles at prepare)",
    supports=(
        Supports(
            weights=("nvfp4",),
            granularities=("group",),
            group_sizes=(16,),
            scale_formats=("e4m3",),
            per_partition_scales=True,
            input_pre_scale=True,
        ),
        Supports(
            weights=("int4",),
            weight_formats=("int4", "uint4"),
            granularities=("channel", "group"),
            group_sizes=_GROUPS,
            scale_formats=_FLOAT_SCALES,
            zero_points=True,
            per_partition_scales=True,
            input_pre_scale=True,
        ),
        Supports(
            weights=("int8",),
            weight_formats=("int8",),
            granularities=("channel", "group"),
            group_sizes=_GROUPS,
            scale_formats=_FLOAT_SCALES,
            per_partition_scales=True,
            input_pre_scale=True,
        ),
        Supports(
            weights=("fp8",),
            weight_formats=("e4m3",),
            granularities=("tensor", "channel", "group", "block"),
            group_sizes=(128,),
            blocks=((128, 128),),
            scale_formats=_FLOAT_SCALES,
            per_partition_scales=True,
            input_pre_scale=True,
        ),
    ),
    # 8.0 or newer: vLLM 0.33's Turing (7.5) build runs float16 activations only ("Turing only
    # support FP16 or INT8 activation"), which a kernel-wide dtype check cannot say per device.
    devices=(DeviceSupport("cuda", capabilities=(CapabilityRange((8, 0)),)),),
    implementation="qscheme_plugins.marlin_kernel:MarlinKernel",
    requires_modules=("vllm",),
    requires_versions=(("vllm", VLLM_VERSIONS),),
    checks=(ActivationDtypes(("bfloat16", "float16")),),
    notes=(
        "unverified on a GPU: the GEMM has not run on hardware in qscheme's tests (CPU tests check "
        "the operands passed to vLLM's ops with a stub vLLM)",
        "scales are rounded to the activation dtype (bfloat16 or float16), as vLLM does; NVFP4 "
        "group scales are re-encoded exactly (vLLM's S0E5M3 bytes), an AWQ pre-scale multiplies the "
        "input in the activation dtype (one more rounding than the reference's float32)",
        "shapes off Marlin's tiles (N % 64 and K % 128, or N % 128 and K % 64) are zero-padded: the "
        "input is padded and the output sliced on every call",
        "fused NVFP4 partitions with different global scales run one GEMM per partition",
        "not claimed: MXFP4, which marlin_mxfp4 declares (vLLM 0.33 compiles MXFP4 Marlin for bfloat16 "
        "activations only), and compute capability 7.5 (float16 only)",
    ),
)

# The same code for MXFP4 weights, declared apart because vLLM 0.33 compiles its MXFP4 Marlin
# kernels for bfloat16 activations only (a float16 call fails), and a declaration's dtype check
# holds for every scheme it takes.
MARLIN_MXFP4 = replace(
    MARLIN,
    name="marlin_mxfp4",
    description="vLLM's Marlin GEMM for MXFP4 weights (e8m0 groups of 32), bfloat16 activations",
    supports=(
        Supports(
            weights=("mxfp4",),
            granularities=("group",),
            group_sizes=(32,),
            scale_formats=("e8m0",),
            # MXFP4 has no global scale: every scale is a per-row block scale.
            per_partition_scales=True,
            input_pre_scale=True,
        ),
    ),
    checks=(ActivationDtypes(("bfloat16",)),),
    notes=(
        "unverified on a GPU: the GEMM has not run on hardware in qscheme's tests (CPU tests check "
        "the operands passed to vLLM's ops with a stub vLLM; the e8m0 scales are bit-exact against vLLM 0.33)",
        "bfloat16 activations only: vLLM 0.33 compiles no float16 MXFP4 Marlin kernel",
    ),
)


@hookimpl
def qscheme_kernels() -> list[KernelDeclaration]:
    return [MARLIN, MARLIN_MXFP4]
