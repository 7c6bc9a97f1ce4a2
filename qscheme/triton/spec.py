"""A scheme -> the constexpr parameters that specialise the Triton kernels (pure, no triton import).

Every choice the kernels make at compile time comes from the scheme descriptor through this
module, so a scheme added as YAML alone runs on the Triton kernels with no new code:

- weight: element format id, 4-bit packing (4-bit codes are read as int32 words of eight, laid
  out by ``qscheme.triton.layout``, and decoded a pair per register), whether the scale is decoded in the K loop
  ("tiled": group and block scales, indexed ``[n // scale_rows, k // scale_cols]``) or folded
  into a per-output-row float32 multiplier with the global scale (channel and tensor scales),
  the scale's storage format, and where zero points live (tiled like the scale, or per row);
- activation: none (16-bit input used as is) or an element format with a scale that is static
  (folded into the per-row multiplier), per token (an epilogue multiplier per input row) or per
  group along K (decoded in the K loop), and how that scale is computed by the pre-pass.

``unsupported_reason`` says, in words, why a scheme cannot run (None when it can); it is the
problem check behind the kernel declaration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch

from qscheme.descriptor import Scheme
from qscheme.errors import QuantizeError
from qscheme.formats.table import ANY_FLOAT, FORMAT_FACTS, is_float_scale, range_half

# Element formats the kernels decode (equal to the constants of qscheme.triton.decode). int2 and
# int3 codes are stored one signed value per byte in the canonical form, so they decode as int8.
ELEMENT_IDS = MappingProxyType(
    {"e2m1": 0, "int4": 1, "uint4": 2, "e4m3": 3, "e5m2": 4, "int8": 5, "uint8": 6, "int2": 5, "int3": 5}
)
FOUR_BIT_ELEMENTS = frozenset(name for name in ELEMENT_IDS if FORMAT_FACTS[name].bits == 4)
CODEBOOK_ID = 7
"""A 4-bit weight whose codes index a declared table (``weight.table``: NF4): the kernels decode the
codes as unsigned integers and load their values from the table (equal to qscheme.triton.decode's)."""

# Scale storage: uint8 bits for e4m3 and e8m0, any float dtype otherwise (loaded as is).
SCALE_FORMAT_IDS = MappingProxyType({"float": 0, "fp32": 0, "fp16": 0, "bf16": 0, "e4m3": 1, "e8m0": 2})

# The dtype 4-bit weights are decoded in (equal to the DECODE_* constants of qscheme.triton.decode).
DECODE_FP32, DECODE_FP16, DECODE_BF16 = 0, 1, 2

# The float dtypes that hold every value of a bit-coded scale format exactly (e4m3 fits float16's
# range and precision; e8m0's powers of two reach beyond float16's range). A 4-bit e2m1 value
# times such a scale (at most 6 significant bits) is exact in the same dtypes.
SCALE_EXACT_IN: Mapping[int, frozenset[torch.dtype]] = MappingProxyType(
    {
        SCALE_FORMAT_IDS["e4m3"]: frozenset({torch.float32, torch.bfloat16, torch.float16}),
        SCALE_FORMAT_IDS["e8m0"]: frozenset({torch.float32, torch.bfloat16}),
    }
)

# Zero points: none, laid out like a tiled (group or block) scale, or one per output row.
ZERO_NONE, ZERO_TILED, ZERO_PER_ROW = 0, 1, 2

# Activation scales: none or static (folded into the per-row multiplier), per token, per group.
ACT_SCALE_STATIC, ACT_SCALE_PER_TOKEN, ACT_SCALE_TILED = 0, 1, 2

# How the pre-pass finds an activation scale (the rules of qscheme.emulation).
ACT_RULE_STATIC, ACT_RULE_ABSMAX, ACT_RULE_NVFP4, ACT_RULE_MX = 0, 1, 2, 3

# The activation quantizations the pre-pass implements: (format, granularity, dynamic, scale
# format family) -> (rule, range half). The arithmetic of each is qscheme.emulation's.
_FLOAT_SCALE = ("float", "fp32")
_ACTIVATION_RULES: dict[tuple[str, str, bool, str], tuple[int, float]] = {
    ("e2m1", "group", True, "e4m3"): (ACT_RULE_NVFP4, range_half("e2m1")),
    ("e2m1", "group", True, "e8m0"): (ACT_RULE_MX, range_half("e2m1")),
    ("e4m3", "tensor", False, "float"): (ACT_RULE_STATIC, range_half("e4m3")),
    ("e4m3", "token", True, "float"): (ACT_RULE_ABSMAX, range_half("e4m3")),
    ("e4m3", "group", True, "float"): (ACT_RULE_ABSMAX, range_half("e4m3")),
    ("int8", "token", True, "float"): (ACT_RULE_ABSMAX, range_half("int8")),
}


@dataclass(frozen=True)
class Specialization:
    """The compile-time parameters of one scheme; field names are the kernels' constexpr names."""

    W_FORMAT: int
    W_FOUR_BIT: bool
    W_SCALE_TILED: bool
    W_SCALE_FORMAT: int
    W_SCALE_ROWS: int
    W_SCALE_COLS: int
    W_ZERO: int
    A_QUANTIZED: bool
    A_FORMAT: int
    A_SCALE: int
    A_SCALE_FORMAT: int
    A_GROUP: int
    A_RULE: int
    A_RANGE_HALF: float

    def gemm_constexprs(self) -> dict[str, Any]:
        """Keyword constexprs of ``quantized_gemm_kernel`` (the pre-pass-only ones left out)."""
        values = asdict(self)
        del values["A_RULE"], values["A_RANGE_HALF"]
        return values


def _activation_key(scheme: Scheme) -> tuple[str, str, bool, str] | None:
    activation = scheme.activation
    if activation is None:
        return None
    scale_format = activation.scale_format
    if activation.scale is not None:  # a static scale declares its own format
        scale_format = activation.scale.format
    family = ANY_FLOAT if is_float_scale(scale_format) else scale_format
    return (activation.format, activation.granularity, activation.dynamic, family)


def unsupported_reason(scheme: Scheme) -> str | None:
    """Why the Triton kernels cannot run ``scheme``, or None when they can."""
    weight = scheme.weight
    if weight.table is not None and (weight.format not in FOUR_BIT_ELEMENTS or len(weight.table) != 16):
        return f"a codebook of {len(weight.table)} values for {weight.format!r} codes; the kernels take 4-bit codebooks"
    if weight.format not in ELEMENT_IDS:
        return f"weight format {weight.format!r} is not one of {', '.join(ELEMENT_IDS)}"
    if weight.scale.format not in SCALE_FORMAT_IDS:
        return f"weight scale format {weight.scale.format!r} is not one of {', '.join(SCALE_FORMAT_IDS)}"
    key = _activation_key(scheme)
    if key is not None and key not in _ACTIVATION_RULES:
        format_, granularity, dynamic, family = key
        timing = "dynamic" if dynamic else "static"
        supported = "; ".join(
            f"{f} per {g} ({'dynamic' if d else 'static'}, {s} scale)" for f, g, d, s in _ACTIVATION_RULES
        )
        return (
            f"activation quantization {format_} per {granularity} ({timing}, {family} scale) has no Triton pre-pass; "
            f"supported: {supported}"
        )
    activation = scheme.activation
    if activation is not None and activation.granularity == "group":
        size = activation.group_size or 0
        if size < 1 or size & (size - 1):
            return f"activation group_size {activation.group_size} is not a power of two (the pre-pass tiles groups)"
    return None


def specialize(scheme: Scheme) -> Specialization:
    """The constexpr parameters for ``scheme``; QuantizeError (with the reason) if it cannot run."""
    reason = unsupported_reason(scheme)
    if reason is not None:
        raise QuantizeError(f"scheme {scheme.name}: the Triton kernels cannot run it: {reason}")
    weight = scheme.weight
    scale = weight.scale
    tiled = scale.granularity in ("group", "block")
    if scale.granularity == "group":
        assert scale.group_size is not None  # the parser requires it
        rows, cols = 1, scale.group_size
    elif scale.granularity == "block":
        assert scale.block is not None
        rows, cols = scale.block
    else:
        rows, cols = 1, 1
    zero = ZERO_NONE
    if weight.zero_point is not None:
        zero = ZERO_TILED if tiled else ZERO_PER_ROW

    activation = scheme.activation
    key = _activation_key(scheme)
    a_format = a_scale = a_scale_format = a_group = a_rule = 0
    range_half = 0.0
    if activation is not None and key is not None:
        a_rule, range_half = _ACTIVATION_RULES[key]
        a_format = ELEMENT_IDS[activation.format]
        if activation.granularity == "group":
            assert activation.group_size is not None
            a_scale, a_group = ACT_SCALE_TILED, activation.group_size
        elif activation.granularity == "token":
            a_scale = ACT_SCALE_PER_TOKEN
        else:
            a_scale = ACT_SCALE_STATIC
        a_scale_format = SCALE_FORMAT_IDS[key[3]]
    return Specialization(
        W_FORMAT=CODEBOOK_ID if weight.table is not None else ELEMENT_IDS[weight.format],
        W_FOUR_BIT=weight.format in FOUR_BIT_ELEMENTS,
        W_SCALE_TILED=tiled,
        W_SCALE_FORMAT=SCALE_FORMAT_IDS[scale.format] if tiled else 0,
        W_SCALE_ROWS=rows,
        W_SCALE_COLS=cols,
        W_ZERO=zero,
        A_QUANTIZED=activation is not None,
        A_FORMAT=a_format,
        A_SCALE=a_scale,
        A_SCALE_FORMAT=a_scale_format,
        A_GROUP=a_group,
        A_RULE=a_rule,
        A_RANGE_HALF=range_half,
    )
