"""Reference outputs for the Triton tests: float64 products of the exact emulation."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, dequantize
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.emulation import apply_pre_scale, fake_quantize_activation

UINT8_ZERO_POINT = '{format: uint8, tensor: {name: weight_zero_point, dtype: uint8, shape: [N, "ceil(K/32)"]}}'


def uint8_group_scheme(name: str = "test/UINT8_G32_ZP_WO", zero_point: str = UINT8_ZERO_POINT) -> Scheme:
    """uint8 weights with zero points (``zero_point``: their YAML), groups of 32, weight-only: no
    shipped scheme stores unsigned 8-bit codes (they need zero points), so the tests declare one."""
    return parse_scheme_text(
        f"""
name: {name}
weight:
  format: uint8
  tensor: {{name: weight, dtype: uint8, shape: [N, K]}}
  scale: {{granularity: group, group_size: 32, format: fp32, stored: multiplier,
          tensor: {{name: weight_scale, dtype: float32, shape: [N, "ceil(K/32)"]}}}}
  zero_point: {zero_point}
activation: none
"""
    )


def with_shared_activation_scales(weight: CanonicalWeight) -> CanonicalWeight:
    """The same layer with every partition's static activation scale set to the first one's."""
    shared = {}
    for name in ("input_scale", "input_global_scale"):
        value = getattr(weight, name)
        if value is not None:
            shared[name] = value[:1].expand(value.numel()).clone()
    return replace(weight, **shared)


def reference_output(weight: CanonicalWeight, x: Tensor, bias: Tensor | None = None) -> Tensor:
    """float64 [..., N]: (pre-scaled, fake-quantized) x @ dequantize(weight)^T (+ bias).

    Activations are quantized per fused partition with that partition's static scales.
    """
    values = x.float()
    if weight.input_pre_scale is not None:
        values = apply_pre_scale(x, weight.input_pre_scale)
    w = dequantize(weight).double()
    activation = weight.scheme.activation
    partitions = weight.partitions or (weight.n,)
    outputs = []
    start = 0
    for index, size in enumerate(partitions):
        rows = w[start : start + size]
        inputs = values
        if activation is not None:
            static = {}
            if weight.input_scale is not None and activation.scale is not None:
                static["input_scale"] = weight.input_scale.reshape(-1)[index : index + 1]
            if weight.input_global_scale is not None and activation.global_scale is not None:
                static["input_global_scale"] = weight.input_global_scale.reshape(-1)[index : index + 1]
            inputs = fake_quantize_activation(values, activation, **static)
        outputs.append(inputs.double() @ rows.T)
        start += size
    out = torch.cat(outputs, dim=-1)
    if bias is not None:
        out = out + bias.double()
    return out


_ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_matches(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str = "") -> None:
    """``actual`` (in ``dtype``) equals the float64 ``expected`` up to float32 accumulation
    (1e-5 of the output's largest magnitude) plus one unit in the last place of ``dtype``."""
    assert actual.dtype == dtype, f"{what}: output dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, (
        f"{what}: output shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    )
    error = (actual.double() - expected).abs()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    allowed = 1e-5 * scale + _ULP[dtype] * expected.abs()
    worst = float((error - allowed).max()) if expected.numel() else 0.0
    assert worst <= 0, (
        f"{what}: max error {float(error.max()):.3e} exceeds the tolerance "
        f"(output scale {scale:.3e}, dtype {dtype}) by {worst:.3e}"
    )


def float64_weight(scheme: Scheme, tensors: dict[str, Tensor], n: int, k: int) -> Tensor:
    """float64 [n, k]: (value - zero point) * scale straight from the checkpoint tensors of an
    unpacked 8-bit integer weight with float group or channel scales, zero points unpacked or
    in ``int32_n`` words; written out here, apart from qscheme.canonical and qscheme.formats."""
    spec = scheme.weight
    assert spec.format in ("int8", "uint8") and spec.packing == "none", spec.format
    assert spec.scale.granularity in ("group", "channel") and spec.scale.format in ("fp32", "fp16", "bf16", "float")
    values = tensors[spec.tensor.name].to(torch.float64)
    scale = tensors[spec.scale.tensor.name].to(torch.float64)
    if spec.scale.stored == "reciprocal":
        scale = 1.0 / scale
    columns = spec.scale.group_size if spec.scale.granularity == "group" else k
    assert columns is not None
    zero = torch.zeros_like(scale)
    if spec.zero_point is not None:
        raw = tensors[spec.zero_point.tensor.name]
        unsigned = spec.zero_point.format.startswith("u")
        if spec.zero_point.packing == "int32_n":  # four bytes per word along N, value + 128 if signed
            words = raw.to(torch.int64) & 0xFFFFFFFF
            rows = [(words[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(scale.shape[0])]
            zero = torch.stack(rows).to(torch.float64) - (0 if unsigned else 128)
        else:
            wide = raw.to(torch.int64)
            if raw.dtype in (torch.int8, torch.uint8):  # 8-bit storage: the value is in the bits
                wide = wide & 0xFF
                if not unsigned:
                    wide = torch.where(wide > 127, wide - 256, wide)
            zero = wide.to(torch.float64).reshape(scale.shape)
    expand = [index // columns for index in range(k)]
    return (values - zero[:, expand]) * scale[:, expand]
