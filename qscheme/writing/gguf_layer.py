"""One layer between GGUF blocks and a group-scaled scheme (compressed-tensors, ModelOpt).

Pure per-layer work, no files, the block counterpart of ``convert_layer``:

- ``blocks_to_layer``: a layer's raw blocks -> the target scheme's tensors. Where the codes are
  shared (``gguf_codes``) they are copied (re-packed as the target packs them) and the scales
  re-encoded; a scale the target's dtype cannot hold exactly is a change of math. Otherwise the
  conversion is refused (RequantizationRefusedError) unless ``allow_requantize``: the blocks are
  then decoded exactly and quantized with the target's arithmetic.
- ``layer_to_blocks``: a layer's tensors in a group-scaled scheme -> raw blocks of a GGUF type,
  the inverse; a global scale other than 1.0, a negative or NaN e4m3 scale, or a scale the block
  field cannot hold exactly changes the math (requantized with llama.cpp's arithmetic when
  allowed).

Every result carries the deviation between the source's and the target's dequantized weights
(float32 ulps and absolute), measured on the whole layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme.canonical import canonicalize, dequantize
from qscheme.canonical_blocks import canonical_blocks
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.errors import QuantizeError
from qscheme.formats import pack_fp4_k, pack_int4_n, pack_int32_k, unpack_fp4_k, unpack_int4_n, unpack_int32_k
from qscheme.formats.blocks import decode_blocks
from qscheme.quantize.write import dtype_name, dtype_of
from qscheme.writing.convert_deviation import compare_dequantized
from qscheme.writing.convert_layer import LayerConversion, RequantizationRefusedError, UnconvertibleLayerError
from qscheme.writing.error_report import compare_weights
from qscheme.writing.gguf_codes import (
    BlockCodes,
    block_codes,
    code_differences,
    element_codes,
    encode_blocks,
    scale_values,
)
from qscheme.writing.summary import LayerRow

__all__ = [
    "SHARED_PAIRS",
    "blocks_to_layer",
    "gguf_type_of",
    "layer_to_blocks",
    "preflight_blocks",
    "preflight_to_blocks",
    "summary_row",
]

_FIELD_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def gguf_type_of(scheme: Scheme) -> str:
    """The ggml type a ``gguf/<TYPE>`` scheme declares (its ``detect.gguf.type``)."""
    rule = scheme.detect.rules.get("gguf")
    types = getattr(rule, "types", ())
    return str(types[0]) if types else scheme.name.rpartition("/")[2]


def _refusal(module: str, source: str, target: str, differences: list[str], shared: str) -> RequantizationRefusedError:
    return RequantizationRefusedError(
        f"layer {module}: converting {source} to {target} changes the codes ({'; '.join(differences)}); only "
        f"schemes that share the codes convert exactly ({shared}). Pass allow_requantize=True "
        "(--allow-requantize) to dequantize exactly and quantize again in the target scheme, with the error "
        "reported per layer, or choose a target that shares the codes"
    )


def _activation_differences(module: str, target: Scheme) -> list[str]:
    """A target quantizing its inputs: dynamically is a change of how inputs are quantized; with
    static (calibrated) scales it cannot be made from a block layer at all."""
    activation = target.activation
    if activation is None:
        return []
    for role, spec in target.tensor_specs().items():
        if role.startswith("input_") and not spec.optional:
            raise UnconvertibleLayerError(
                f"layer {module}: {target.name} needs a calibrated static activation scale {spec.name!r}, which a "
                "GGUF layer does not hold; no conversion can make one. Choose a weight-only target (e.g. "
                "modelopt/W4A16_NVFP4) or quantize the unquantized model with `qscheme quantize --calibration`"
            )
    return [f"activation quantization: none (16-bit inputs) -> {activation.format}"]


def _shape(spec: TensorSpec, n: int, k: int, numel: int, target: Scheme, module: str) -> tuple[int, ...]:
    for shape in spec.expected_shapes(n, k):
        count = 1
        for size in shape:
            count *= size
        if count == numel:
            return shape
    raise UnconvertibleLayerError(
        f"layer {module}: {target.name} declares {spec.name!r} as {spec.describe_shapes()}, which for N={n}, "
        f"K={k} cannot hold {numel} values; check the target scheme's shapes"
    )


def _packed_weight(elements: Tensor, codes: BlockCodes, target: Scheme, module: str) -> Tensor:
    packing, bits = target.weight.packing, int(codes.element.removeprefix("int")) if codes.element != "e2m1" else 4
    if codes.element == "e2m1" and packing == "nibbles_k":
        return pack_fp4_k(elements)
    if codes.element.startswith("int"):
        if packing == "int32_k":
            return pack_int32_k(elements, bits)
        if packing == "int4_n" and bits == 4:
            return pack_int4_n(elements)
        if packing == "none" and bits == 8:
            return elements
    raise UnconvertibleLayerError(
        f"layer {module}: {target.name} packs {codes.element} codes as {packing!r}, which convert cannot write; "
        "choose a target with another packing"
    )


def _stored_scale(
    module: str, stored: Tensor, spec: TensorSpec, target: Scheme, allow_requantize: bool
) -> tuple[Tensor, str | None]:
    """The block scales in a dtype ``spec`` allows (a note when the cast rounded them)."""
    if stored.dtype == torch.uint8:  # e8m0 bytes, or e4m3 bytes of ue4m3 values
        wanted = dtype_of(spec.dtypes[0])
        return (stored if wanted == torch.uint8 else stored.view(wanted)), None
    if dtype_name(stored.dtype) in spec.dtypes:
        return stored, None
    for name in spec.dtypes:
        cast = stored.to(dtype_of(name))
        if torch.equal(cast.to(stored.dtype), stored):
            return cast, None
    cast = stored.to(dtype_of(spec.dtypes[0]))
    if not allow_requantize:
        raise RequantizationRefusedError(
            f"layer {module}: {target.name} stores {spec.name!r} as {', '.join(spec.dtypes)}, which cannot hold the "
            f"GGUF's {dtype_name(stored.dtype)} scales exactly; pass allow_requantize=True (--allow-requantize) to "
            "accept the rounding (reported as the deviation), or declare the dtype in the target scheme"
        )
    return cast, f"scales rounded from {dtype_name(stored.dtype)} to {dtype_name(cast.dtype)}"


SHARED_PAIRS = (
    "gguf/Q4_0 -> compressed-tensors/W4A16_G32, gguf/Q8_0 -> compressed-tensors/W8A16_G32, "
    "gguf/MXFP4 -> compressed-tensors/MXFP4A16, gguf/NVFP4 -> modelopt/W4A16_NVFP4"
)


def preflight_blocks(
    module: str, source: Scheme, target: Scheme, *, allow_requantize: bool
) -> tuple[list[str], list[str]]:
    """(weight differences, activation differences) of converting a ``source`` block layer to
    ``target``, from the descriptors alone; RequantizationRefusedError when there are any and
    ``allow_requantize`` is false, UnconvertibleLayerError when the target needs static input scales."""
    codes = block_codes(source)
    differences = [codes] if isinstance(codes, str) else code_differences(codes, target)
    activation = _activation_differences(module, target)
    if (differences or activation) and not allow_requantize:
        raise _refusal(module, source.name, target.name, [*differences, *activation], SHARED_PAIRS)
    return differences, activation


def blocks_to_layer(
    module: str, source: Scheme, raw: Tensor, n: int, k: int, target: Scheme, *, allow_requantize: bool = False
) -> LayerConversion:
    """The target tensors (by short name) of one GGUF layer, and a report (module docstring)."""
    differences, activation = preflight_blocks(module, source, target, allow_requantize=allow_requantize)
    original = canonical_blocks(source, raw, n, k, layer=module)  # refuses NaN fields, naming the block
    codes = block_codes(source)
    weight = decode_blocks(original.codes, _layout(source))
    if differences or isinstance(codes, str):
        return _requantized(module, source, target, weight, [*differences, *activation])
    elements = element_codes(raw, codes)
    out: dict[str, Tensor] = {}
    notes: list[str] = [f"activation quantization changes: {'; '.join(activation)}"] if activation else []
    for role, spec in target.tensor_specs().items():
        if role == "weight":
            value = _packed_weight(elements, codes, target, module)
        elif role == "weight_scale":
            value, note = _stored_scale(module, scale_values(raw, codes), spec, target, allow_requantize)
            notes.extend([note] if note else [])
        elif role == "weight_global_scale":
            dtype = torch.float32 if "float32" in spec.dtypes else dtype_of(spec.dtypes[0])
            value = torch.ones(1, dtype=dtype)
        elif role == "weight_shape":
            value = torch.tensor([n, k], dtype=dtype_of(spec.dtypes[0]))
        elif spec.optional or role.startswith("input_"):
            continue
        else:
            raise UnconvertibleLayerError(
                f"layer {module}: {target.name} needs {spec.name!r} ({role}), which a {source.name} layer does not hold"
            )
        out[spec.name] = value.reshape(_shape(spec, n, k, value.numel(), target, module))
    converted = dequantize(canonicalize(target, out, n, k, layer=module))
    deviation = compare_dequantized(weight, converted)
    return LayerConversion(
        module,
        source.name,
        target.name,
        "converted",
        out,
        deviation.max_ulps,
        deviation.max_abs_error,
        notes=tuple(notes),
    )


def _layout(scheme: Scheme):  # type: ignore[no-untyped-def]
    layout = scheme.weight.blocks
    assert layout is not None
    return layout


def _requantized(
    module: str, source: Scheme, target: Scheme, weight: Tensor, differences: list[str]
) -> LayerConversion:
    from qscheme.quantize import quantize_weight

    try:
        out = quantize_weight(weight, target)
    except QuantizeError as error:
        raise QuantizeError(f"layer {module}: requantizing {source.name} as {target.name} failed: {error}") from error
    requantized = dequantize(canonicalize(target, out, weight.shape[0], weight.shape[1], layer=module))
    deviation = compare_dequantized(weight, requantized)
    return LayerConversion(
        module,
        source.name,
        target.name,
        "requantized",
        out,
        deviation.max_ulps,
        deviation.max_abs_error,
        relative_error=compare_weights(weight, requantized).relative,
        notes=(f"requantized: {'; '.join(differences)}",),
    )


# --- the reverse: a group-scaled layer -> blocks -----------------------------------------------


def _elements(stored: Tensor, codes: BlockCodes, source: Scheme, n: int, k: int) -> Tensor:
    packing = source.weight.packing
    if packing == "nibbles_k":
        return unpack_fp4_k(stored.reshape(n, -1), k)
    if packing == "int32_k":
        return unpack_int32_k(stored.reshape(n, -1), codes.integer.bits, k)
    if packing == "int4_n":
        return unpack_int4_n(stored, n)
    return stored.reshape(n, k).view(torch.int8)


def _block_scales(stored: Tensor, codes: BlockCodes) -> Tensor | str:
    """The source's scales as the block field stores them, or why they do not fit it."""
    field = codes.scale_field
    if field.format in _FIELD_DTYPES:
        cast = stored.to(_FIELD_DTYPES[field.format])
        if not torch.equal(cast.to(stored.dtype), stored):
            return f"weight scale: {dtype_name(stored.dtype)} values -> {field.format} (not held exactly)"
        return cast
    raw = stored.contiguous().view(torch.uint8)
    if field.format == "ue4m3" and bool(((raw & 0x80) != 0).any() | (raw == 0x7F).any()):
        return "weight scale: negative or NaN e4m3 values -> ue4m3 (unsigned)"
    return raw


def preflight_to_blocks(module: str, source: Scheme, target: Scheme, *, allow_requantize: bool) -> list[str]:
    """What differs, from the descriptors alone, between ``source``'s codes and the blocks of
    ``target`` (a ``gguf/<TYPE>`` scheme); RequantizationRefusedError when anything does and
    ``allow_requantize`` is false. ``layer_to_blocks`` checks the values (global scale, scales the
    block field cannot hold) as well."""
    codes = block_codes(target)
    differences = [codes] if isinstance(codes, str) else code_differences(codes, source)
    if differences and not allow_requantize:
        raise _refusal(module, source.name, target.name, differences, SHARED_PAIRS)
    return differences


def layer_to_blocks(
    module: str,
    source: Scheme,
    tensors: Mapping[str, Tensor],
    n: int,
    k: int,
    target: Scheme,
    *,
    allow_requantize: bool = False,
) -> tuple[Tensor, LayerConversion]:
    """The raw blocks of ``target`` (a ``gguf/<TYPE>`` scheme) for one layer of ``source``, and a report."""
    canonical = canonicalize(source, tensors, n, k, layer=module)
    weight = dequantize(canonical)
    codes = block_codes(target)
    differences = [codes] if isinstance(codes, str) else code_differences(codes, source)
    specs = source.tensor_specs()
    global_spec = specs.get("weight_global_scale")
    if global_spec is not None and global_spec.name in tensors:
        value = tensors[global_spec.name].to(torch.float32).reshape(-1)
        if not bool((value == 1.0).all()):
            differences.append(f"weight global scale: {float(value[0])} -> none (only 1.0 carries over)")
    scales: Tensor | str = "no scale"
    if not differences and not isinstance(codes, str):
        scales = _block_scales(tensors[specs["weight_scale"].name], codes)
        if isinstance(scales, str):
            differences.append(scales)
    notes: list[str] = []
    if source.activation is not None:
        notes.append(f"activation quantization dropped: {source.activation.format} inputs -> 16-bit inputs")
    if differences and not allow_requantize:
        raise _refusal(module, source.name, target.name, [str(item) for item in differences], SHARED_PAIRS)
    layout = _layout(target)
    if differences or isinstance(codes, str) or isinstance(scales, str):
        from qscheme.producers.gguf.quants import quantize_blocks

        raw = quantize_blocks(weight, gguf_type_of(target), tensor_name=f"{module}.weight")
        decoded = decode_blocks(raw, layout)
        deviation = compare_dequantized(weight, decoded)
        report = LayerConversion(
            module,
            source.name,
            target.name,
            "requantized",
            {"weight": raw},
            deviation.max_ulps,
            deviation.max_abs_error,
            relative_error=compare_weights(weight, decoded).relative,
            notes=(f"requantized: {'; '.join(str(item) for item in differences)}", *notes),
        )
        return raw, report
    elements = _elements(tensors[source.weight.tensor.name], codes, source, n, k)
    raw = encode_blocks(elements, scales, codes)
    deviation = compare_dequantized(weight, decode_blocks(raw, layout))
    report = LayerConversion(
        module,
        source.name,
        target.name,
        "converted",
        {"weight": raw},
        deviation.max_ulps,
        deviation.max_abs_error,
        notes=tuple(notes),
    )
    return raw, report


def summary_row(result: LayerConversion) -> LayerRow:
    """The summary's line of a converted layer: its ulps when exact, its relative error when requantized."""
    requantized = result.action == "requantized"
    return LayerRow(
        result.module,
        result.target_scheme,
        result.action,
        None if requantized else float(result.max_ulps),
        result.max_abs_error,
        result.relative_error if requantized else None,
    )
