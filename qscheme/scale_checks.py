"""Scales whose product cannot dequantize: the rule loading and quantizing share.

A weight dequantizes as ``(element - zero point) x scale x global multiplier`` in float32 (the
reference divides by a stored global divisor instead; kernels multiply by its reciprocal). Each
stored scale can be finite and their product still not be usable. ``canonicalize`` (so
``load_checkpoint``, ``dequantize_weight`` and ``QuantLinear.from_tensors``) refuses, with
QuantizeError naming the layer, the tensor, the first bad value, its position and region:

- a NaN or infinite element of a float weight format (fp8 codes);
- a global multiplier (or a stored divisor's reciprocal) that is not finite, or that is not a
  normal float32 > 0 while its partition holds a nonzero element: kernels take the multiplier,
  and a subnormal one is flushed to zero by some of them (ModelOpt writes a subnormal one for
  an all-zero weight, which stays allowed);
- a static activation multiplier (as stored, or a stored divisor's reciprocal) that is not a
  normal float32 > 0, or whose product with the largest block scale the activation's scale
  format holds (e4m3: 448) and its largest element overflows, or with the smallest block scale
  and smallest nonzero element falls below the smallest normal: activations would then
  quantize to zero or NaN, or small ones flush to zero. No exception for all-zero weights: the
  input is unknown. A non-finite pre-scale;
- a scale whose product (with the global multiplier or divisor) times the largest element the
  layer's formats can hold is not finite in float32: the rule ``quantize_weight`` applies to
  what it writes (``qscheme.quantize.checks``). Refused wherever it is, since even a zero
  element times an infinite multiplier is NaN;
- a nonzero scale whose product falls below float32's smallest normal (to zero, or to a
  subnormal that kernels flushing denormals make zero) over a region holding a nonzero element.
  A stored zero scale over all-zero elements stays allowed: producers write them.

The common case costs one min/max pass over the stored scale: only a layer whose extreme scales
come near float32's limits gets the elementwise pass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
from torch import Tensor

from qscheme.canonical_weight import CanonicalWeight, effective_scale, element_values, expand_tiles, scale_tile
from qscheme.descriptor import GlobalScaleSpec, ScaleSpec, Scheme
from qscheme.errors import QuantizeError
from qscheme.formats import FORMAT_ALIASES, decode, get_element_format, representable_values
from qscheme.formats.elements import E8M0_NAN
from qscheme.formats.scale_values import any_nonfinite, nonfinite
from qscheme.formats.table import FORMAT_FACTS

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
_FLOAT_CODES = (torch.float8_e4m3fn, torch.float8_e5m2)
AMINMAX_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def largest_element(scheme: Scheme) -> float:
    """The largest magnitude a weight scale multiplies: the element format's largest value, or
    with zero points the largest ``element - zero point`` their formats allow."""
    spec = scheme.weight
    element = get_element_format(spec.format)
    if spec.zero_point is None:
        return float(max(abs(element.min_value), abs(element.max_value)))
    zero = get_element_format(spec.zero_point.format)
    return float(max(abs(element.max_value - zero.min_value), abs(element.min_value - zero.max_value)))


def dequantizes_to_nonfinite(multiplier: Tensor, largest: float) -> Tensor:
    """True where ``multiplier x largest`` is not finite in float32 (NaN multipliers included)."""
    return ~torch.isfinite(multiplier.to(torch.float32) * largest)


def require_finite_dequantization(weight: CanonicalWeight, layer: str | None = None) -> None:
    """QuantizeError when ``weight`` would dequantize (or run through a kernel) to an inf, a NaN,
    or zeros in place of nonzero elements (see the module docstring)."""
    where = f"layer {layer}, scheme {weight.scheme.name}" if layer else f"scheme {weight.scheme.name}"
    _require_finite_codes(weight, where)
    _require_usable_global(weight, where)
    _require_usable_activation_scales(weight, where)
    if _products_are_far_from_limits(weight):
        return
    _require_usable_products(weight, where)


# --- the checks -------------------------------------------------------------------------------


def _require_finite_codes(weight: CanonicalWeight, where: str) -> None:
    codes = weight.codes
    if codes.dtype not in _FLOAT_CODES or not any_nonfinite(codes):
        return
    bad = nonfinite(codes)
    position, count = first_true(bad)
    name = weight.scheme.weight.tensor.name
    value = float(codes[position].to(torch.float32))
    raise QuantizeError(
        f"{where}: weight {name!r} holds {value:g} at {list(position)} "
        f"({count_text(count, codes.numel(), 'element')}); "
        f"allowed: finite {weight.scheme.weight.format} elements; the file is corrupt: re-export the layer"
    )


def _require_usable_global(weight: CanonicalWeight, where: str) -> None:
    multiplier = weight.global_scale
    spec = weight.scheme.weight.global_scale
    if multiplier is None or spec is None:
        return
    bad = ~torch.isfinite(multiplier)
    vanishing = ~_is_normal_positive(multiplier) & ~bad
    if bool(vanishing.any()):  # harmless over all-zero elements: producers write them for zero weights
        bad |= vanishing & _partitions_with_nonzero_elements(weight)
    if not bool(bad.any()):
        return
    position, count = first_true(bad)
    index = position[0]
    name = spec.tensor.name
    value = float(multiplier[index])
    if weight.global_scale_divisor is not None:
        stored = float(weight.global_scale_divisor[index])
        found = f"{name!r} holds the divisor {stored:g}, whose reciprocal, the multiplier kernels use, is {value:g}"
    else:
        found = f"{name!r} holds {value:g}"
    at = f" at [{index}]" if multiplier.numel() > 1 else ""
    raise QuantizeError(
        f"{where}: {found} in float32{at} ({count_text(count, multiplier.numel(), 'value')}); allowed: a multiplier "
        f"that is a finite, normal float32 > 0 ({FLOAT32_TINY:g} to {FLOAT32_MAX:g}), or any finite one over "
        f"all-zero elements; {_fix(weight)}"
    )


def _require_usable_activation_scales(weight: CanonicalWeight, where: str) -> None:
    activation = weight.scheme.activation
    if activation is not None:
        elements = _magnitudes(activation.format)
        if activation.scale is not None and weight.input_scale is not None:
            # a static per-tensor scale multiplies the elements directly: no block scale between
            _require_usable_activation_multiplier(
                weight, where, activation.scale, weight.input_scale, None, None, elements
            )
        if activation.global_scale is not None and weight.input_global_scale is not None:
            _require_usable_activation_multiplier(
                weight,
                where,
                activation.global_scale,
                weight.input_global_scale,
                weight.input_global_scale_divisor,
                _activation_block_range(activation.scale_format),
                elements,
            )
    pre_scale, pre_spec = weight.input_pre_scale, weight.scheme.input_pre_scale
    if pre_scale is not None and pre_spec is not None and any_nonfinite(pre_scale):
        position, count = first_true(nonfinite(pre_scale))
        raise QuantizeError(
            f"{where}: input pre-scale {pre_spec.name!r} holds {float(pre_scale[position]):g} at {list(position)} "
            f"({count_text(count, pre_scale.numel(), 'value')}); allowed: finite factors; re-export the layer"
        )


def _require_usable_activation_multiplier(
    weight: CanonicalWeight,
    where: str,
    spec: ScaleSpec | GlobalScaleSpec,
    multiplier: Tensor,
    divisor: Tensor | None,
    blocks: tuple[float, float] | None,
    elements: tuple[float, float],
) -> None:
    """The weight rule for a static activation multiplier m, with the activation's own formats:
    m a normal float32 > 0, m x the largest block scale x the largest element finite, and
    m x the smallest nonzero block scale x the smallest nonzero element normal (``blocks``:
    the block scales' range, None without them). The products are [P], so this costs nothing."""
    values = multiplier.to(torch.float32).reshape(-1)
    block_low, block_high = blocks or (1.0, 1.0)
    smallest, largest = block_low * elements[0], block_high * elements[1]
    what_largest = f"the largest element ({elements[1]:g})"
    what_smallest = f"the smallest nonzero element ({elements[0]:g})"
    if blocks is not None:
        what_largest = f"the largest block scale ({block_high:g}) x {what_largest}"
        what_smallest = f"the smallest block scale ({block_low:g}) x {what_smallest}"
    bad = ~_is_normal_positive(values)
    problem = "is not a finite, normal float32 > 0: kernels would quantize every activation to zero or NaN"
    if not bool(bad.any()):
        # float32 products as kernels form them (m x block x element), and as compressed-tensors
        # does from a stored divisor (block / divisor x element)
        tops, bottoms = [values * block_high * elements[1]], [values * block_low * elements[0]]
        if divisor is not None:
            stored = divisor.to(torch.float32).reshape(-1)
            tops.append(block_high / stored * elements[1])
            bottoms.append(block_low / stored * elements[0])
        overflows = torch.stack([~torch.isfinite(top) for top in tops]).any(dim=0)
        vanishes = torch.stack([bottom.abs() < FLOAT32_TINY for bottom in bottoms]).any(dim=0)
        if bool(overflows.any()):
            problem = f"times {what_largest} overflows float32: activations would quantize to zero or to inf"
            bad = overflows
        elif bool(vanishes.any()):
            bad = vanishes
            problem = (
                f"times {what_smallest} is below float32's smallest normal: kernels flushing subnormals "
                "would dequantize small nonzero activations to zero"
            )
        else:
            return
    position, count = first_true(bad)
    index = position[0]
    name = spec.tensor.name
    if divisor is not None:
        found = (
            f"{name!r} holds the divisor {float(divisor.reshape(-1)[index]):g}, whose reciprocal, the multiplier "
            f"kernels use, is {float(values[index]):g}"
        )
    else:
        found = f"{name!r} holds the multiplier {float(values[index]):g}"
    at = f" at [{index}]" if values.numel() > 1 else ""
    low, high = FLOAT32_TINY / min(smallest, 1.0), FLOAT32_MAX / max(largest, 1.0)
    convention = "a divisor (the multiplier is 1 / its value)" if spec.stored == "reciprocal" else "a multiplier"
    raise QuantizeError(
        f"{where}: activation scale {found}{at} ({count_text(count, values.numel(), 'value')}): the multiplier "
        f"{problem}; allowed: a multiplier from {low:.6g} to {high:.6g} (normal, x {largest:g} finite, "
        f"x {smallest:g} normal in float32); "
        f"scheme {weight.scheme.name} reads {name!r} as {convention}: if the file stores the other convention, use "
        "a scheme that declares it; else the activation calibration is corrupt: recalibrate and re-export the layer"
    )


@functools.cache
def _magnitudes(name: str) -> tuple[float, float]:
    """(smallest nonzero, largest) magnitude a format of at most 8 bits holds."""
    values = representable_values(name).abs()
    return float(values[values > 0].min()), float(values.max())


def _activation_block_range(scale_format: str) -> tuple[float, float] | None:
    """The range of the dynamic block scales a static activation global scale multiplies. Only
    an fp8 block scale spans a fixed, narrow range whatever the input; e8m0 and float block
    scales follow each block's amax across float32's range, so they bound nothing here."""
    facts = FORMAT_FACTS.get(FORMAT_ALIASES.get(scale_format, scale_format))
    return _magnitudes(facts.name) if facts is not None and facts.kind == "float" and facts.bits == 8 else None


def _products_are_far_from_limits(weight: CanonicalWeight) -> bool:
    """True when the stored scale's extremes, times the global multiplier's, keep every product
    and every dequantized element inside float32's normal range (by a factor of two, which
    covers the float32 roundings of both products)."""
    bounds = _magnitude_bounds(weight.scale)
    if bounds is None:
        return False
    low, high = bounds
    if weight.global_scale is not None:
        values = weight.global_scale.to(torch.float64)
        low, high = low * float(values.min()), high * float(values.max())
    return high * largest_element(weight.scheme) < FLOAT32_MAX / 2 and low > 2 * FLOAT32_TINY


def _require_usable_products(weight: CanonicalWeight, where: str) -> None:
    """The elementwise rule over the products the reference and the kernels compute."""
    products = [effective_scale(weight)]
    if weight.global_scale_divisor is not None:  # kernels multiply by the divisor's reciprocal
        products.append(effective_scale(replace(weight, global_scale_divisor=None)))
    stored = torch.broadcast_to(_stored_multipliers(weight), products[0].shape)
    largest = largest_element(weight.scheme)
    for product in products:
        overflows = dequantizes_to_nonfinite(product, largest)
        if bool(overflows.any()):
            position, count = first_true(overflows)
            raise QuantizeError(
                f"{where}: {_product_text(weight, product, position)}: the largest possible element ({largest:g}) "
                f"of {_region(weight, position)} dequantizes to {_overflowed(product[position], largest)} in float32 "
                f"({count_text(count, product.numel(), 'scale')}); allowed: |scale"
                f"{' x global multiplier' if weight.global_scale is not None else ''} x {largest:g}| <= "
                f"{FLOAT32_MAX:g}; {_fix(weight)}"
            )
    vanishes = torch.zeros(products[0].shape, dtype=torch.bool, device=stored.device)
    for product in products:
        vanishes |= product.abs() < FLOAT32_TINY
    vanishes &= stored != 0
    if not bool(vanishes.any()):
        return
    vanishes &= regions_with_nonzero_elements(weight, products[0])
    if not bool(vanishes.any()):
        return
    position, count = first_true(vanishes)
    product = next(p for p in products if bool(p[position].abs() < FLOAT32_TINY))
    raise QuantizeError(
        f"{where}: {_product_text(weight, product, position)}, below float32's smallest normal ({FLOAT32_TINY:g}), "
        f"but {_region(weight, position)} holds nonzero elements, which would dequantize to zero or to subnormals "
        f"that kernels flush to zero ({count_text(count, product.numel(), 'scale')}); allowed: a product >= "
        f"{FLOAT32_TINY:g}, or a zero scale over all-zero elements; {_fix(weight)}"
    )


# --- helpers ----------------------------------------------------------------------------------


def _is_normal_positive(value: Tensor) -> Tensor:
    value = value.to(torch.float32)
    return torch.isfinite(value) & (value >= FLOAT32_TINY)


def _magnitude_bounds(scale: Tensor) -> tuple[float, float] | None:
    """(smallest nonzero, largest) magnitude of a canonical scale's multipliers, from one
    min/max pass when every scale is > 0 (a second over the magnitudes when some are zero or
    negative: a zero scale multiplies to zero, so only nonzero ones bound the products);
    ``(inf, 0)`` when all are zero; None when one is NaN or infinite."""
    if scale.dtype == torch.uint8:  # e8m0 bytes: the value grows with the byte, 0xFF is NaN
        low_exponent, high_exponent = (int(v) for v in torch.aminmax(scale))
        if high_exponent == E8M0_NAN:
            return None
        return 2.0 ** (low_exponent - 127), 2.0 ** (high_exponent - 127)
    if scale.dtype == torch.float8_e4m3fn:  # positive values grow with the byte; 0x7F is NaN
        raw = scale.reshape(-1).view(torch.int8)
        low, high = torch.aminmax(raw)
        if int(high) == 0x7F:
            return None
        if int(low) <= 0:
            magnitude = raw.view(torch.uint8) & 0x7F
            low, high = torch.where(magnitude == 0, 0x7E, magnitude).min(), magnitude.max()
            if int(high) == 0x7F:
                return None
            if int(high) == 0:
                return math.inf, 0.0
        values = torch.stack([low, high]).view(torch.float8_e4m3fn).to(torch.float64)
    else:
        value = scale if scale.dtype in AMINMAX_DTYPES else scale.to(torch.float32)
        low, high = torch.aminmax(value)
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            return None
        if float(low) <= 0:
            magnitude = value.abs()
            high = magnitude.max()
            if float(high) == 0:
                return math.inf, 0.0
            low = torch.where(magnitude == 0, high, magnitude).min()
        values = torch.stack([low, high]).to(torch.float64)
    return float(values[0]), float(values[1])


def _stored_multipliers(weight: CanonicalWeight) -> Tensor:
    """The canonical scale as float32 multipliers, before the global scale."""
    if weight.scheme.weight.scale.format == "e8m0":
        return decode(weight.scale, "e8m0")
    return weight.scale.to(torch.float32)


def regions_with_nonzero_elements(weight: CanonicalWeight, product: Tensor) -> Tensor:
    """True where the weight elements under a scale (``product``'s layout) include a nonzero
    ``element - zero point``; decodes the whole layer, so only run on the way to an error."""
    n, k = weight.n, weight.k
    tile = scale_tile(weight, product)
    nonzero = _nonzero_elements(weight)
    if product.numel() == 1:
        return nonzero.any().reshape(product.shape)
    rows, columns = product.shape
    tile_rows, tile_columns = tile
    padded = torch.zeros(rows * tile_rows, columns * tile_columns, dtype=torch.bool, device=nonzero.device)
    padded[:n, :k] = nonzero
    return padded.reshape(rows, tile_rows, columns, tile_columns).any(dim=3).any(dim=1)


def _nonzero_elements(weight: CanonicalWeight) -> Tensor:
    """True where ``element - zero point`` is nonzero, [N, K]; decodes the whole layer."""
    values = element_values(weight)
    if weight.zero_point is not None:
        tile = scale_tile(weight, weight.zero_point)
        values = values - expand_tiles(weight.zero_point.to(torch.float32), tile, slice(0, weight.n), weight.k)
    return values != 0


def _partitions_with_nonzero_elements(weight: CanonicalWeight) -> Tensor:
    """True per fused partition holding a nonzero element, [P]."""
    rows = _nonzero_elements(weight).any(dim=1)
    return torch.stack([part.any() for part in rows.split(list(weight.partitions))])


def _product_text(weight: CanonicalWeight, product: Tensor, position: tuple[int, ...]) -> str:
    """``weight_scale[r, c] = 448 x weight_global_scale 1e+38 = inf`` for the scale at ``position``."""
    spec = weight.scheme.weight
    scale_position = position if weight.scale.numel() > 1 else (0,) * weight.scale.ndim
    raw = weight.scale[scale_position]
    name = f"{spec.scale.tensor.name}{list(scale_position) if weight.scale.numel() > 1 else ''}"
    if spec.scale.format == "e8m0":
        byte = int(raw)
        scale = f"{name} = byte 0x{byte:02X} (2^{byte - 127})"
    elif spec.scale.stored == "reciprocal":
        scale = f"1 / {name} = {float(raw.to(torch.float32)):g}"
    else:
        scale = f"{name} = {float(raw.to(torch.float32)):g}"
    result = f"{float(product[position]):g}"
    if weight.global_scale is None or spec.global_scale is None:
        return f"{scale}, a multiplier of {result}"
    index = _partition_of(weight, position[0]) if weight.global_scale.numel() > 1 else 0
    global_name, multiplier = spec.global_scale.tensor.name, float(weight.global_scale[index])
    if weight.global_scale_divisor is not None:
        divisor = float(weight.global_scale_divisor[index])
        return f"{scale}, times 1 / {global_name} {divisor:g} (multiplier {multiplier:g}), is {result}"
    return f"{scale}, times {global_name} {multiplier:g}, is {result}"


def _partition_of(weight: CanonicalWeight, row: int) -> int:
    for index, end in enumerate(torch.tensor(weight.partitions).cumsum(0).tolist()):
        if row < end:
            return index
    return len(weight.partitions) - 1


def _region(weight: CanonicalWeight, position: tuple[int, ...]) -> str:
    """Which weight elements the scale at ``position`` (of ``effective_scale``'s layout) covers."""
    spec = weight.scheme.weight.scale
    if spec.granularity == "tensor":
        return "the whole weight"
    row = position[0]
    if spec.granularity == "channel":
        return f"row {row}"
    column = position[1]
    rows, columns = spec.block if spec.block is not None else (1, spec.group_size or weight.k)
    first_column, last_column = column * columns, min((column + 1) * columns, weight.k) - 1
    if spec.granularity == "group":
        return f"row {row}, group {column} (columns {first_column}-{last_column})"
    first_row, last_row = row * rows, min((row + 1) * rows, weight.n) - 1
    return f"block [{row}, {column}] (rows {first_row}-{last_row}, columns {first_column}-{last_column})"


def _overflowed(multiplier: Tensor, largest: float) -> str:
    value = float(multiplier.to(torch.float32)) * largest
    return "NaN" if math.isnan(value) else "infinity"


def _fix(weight: CanonicalWeight) -> str:
    spec = weight.scheme.weight.global_scale
    if spec is None:
        return "the scales are corrupt: re-export the layer with its producer"
    convention = (
        "a divisor (the multiplier is 1 / its value)" if spec.stored == "reciprocal" else "a multiplier (not a divisor)"
    )
    return (
        f"scheme {weight.scheme.name} reads {spec.tensor.name!r} as {convention}: if the file stores the other "
        "convention, use a scheme that declares it; else the scales are corrupt: re-export the layer with its producer"
    )


def first_true(mask: Tensor) -> tuple[tuple[int, ...], int]:
    """(position of the first True of ``mask``, how many are True)."""
    flat = mask.reshape(-1)
    index = int(torch.argmax(flat.to(torch.uint8)))
    position = []
    for size in reversed(mask.shape):
        index, rest = divmod(index, size)
        position.append(rest)
    return tuple(reversed(position)), int(flat.sum())


def count_text(count: int, total: int, noun: str) -> str:
    """'3 of 4096 scales': how many of how many values a message is about."""
    return f"{count} of {total} {noun}{'s' if total > 1 else ''}"
