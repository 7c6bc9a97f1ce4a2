"""Canonical layer tensors: one form per format family, free of producer names and conventions.

Kernels see only ``CanonicalWeight``. The conversion from checkpoint tensors (keyed by their
checkpoint names, as a scheme declares them) is here. The weight type itself, its decode and the
exact reference dequantization that every kernel is tested against are in
``qscheme.canonical_weight`` (below ``qscheme.scale_checks``, which canonicalizing runs) and are
re-exported here: ``qscheme.canonical`` is the path to import them from.

Canonical form
--------------
- ``codes``: 4-bit elements (e2m1, int4, uint4) as uint8 [N, ceil(K/2)], two per byte along K,
  element 2j in the low nibble (int4 as a two's-complement nibble); 8-bit elements as [N, K] in
  their storage dtype (float8_e4m3fn, float8_e5m2, int8, uint8).
- ``scale``: dequant multipliers in the stored element type (float8_e4m3fn, e8m0 bytes as
  uint8, or a float dtype): group [N, ceil(K/G)], channel [N, 1], block
  [ceil(N/R), ceil(K/C)], tensor [P] (one per fused partition).
- ``global_scale``: float32 [P] dequant multipliers, one per fused partition (None if the scheme
  has none). ``global_scale_divisor`` keeps the stored divisor when the file stored the
  reciprocal, only so that the reference dequantization reproduces the producer's rounding
  (block_scale / divisor) bit for bit; kernels use ``global_scale``.
- ``zero_point``: int16 [N, ceil(K/G)] (same layout as a group scale; [N, 1] for channel
  scales), or None. The values are the zero-point format's own: int4 in [-8, 7], uint4 in
  [0, 15], int8 in [-128, 127], uint8 in [0, 255] (``canonical_zero_point`` checks the range),
  so every zero-point format fits and a kernel may narrow them to the format's 8-bit dtype.
- ``partitions``: output sizes of fused partitions, summing to N (``(N,)`` for a plain layer).
- ``input_scale`` / ``input_global_scale``: float32 [P] multipliers of static activation scales;
  ``input_global_scale_divisor`` keeps a stored divisor, as ``global_scale_divisor`` does, so
  that activation emulation rounds exactly as compressed-tensors does.
- ``input_pre_scale``: [K] float multiplier applied to the input before anything else (AWQ).
- ``input_permutation``: int64 [K] or None: the codes, scales and zero points hold the input
  channels in this order (column j is input channel ``input_permutation[j]``), so that groups of
  columns are consecutive for a GPTQ act-order layer (``desc_act``: its ``g_idx`` assigns groups
  out of order); ``dequantize`` returns the weight in the input's own order, and only kernels that
  declare ``Supports.input_permutation`` (the reference kernel) take such a layer.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme.api_checks import require_tensor_mapping
from qscheme.canonical_blocks import canonical_blocks
from qscheme.canonical_weight import (
    TENSOR_FIELDS,
    CanonicalWeight,
    dequantize,
    dequantize_rows,
    effective_scale,
    element_values,
    expand_tiles,
    scale_tile,
)
from qscheme.descriptor import Scheme
from qscheme.descriptor.consistency import FOUR_BIT, element_bits, packing_ratios, unpacked_sizes
from qscheme.descriptor.model import ZeroPointSpec
from qscheme.descriptor.state import MAX_STATE_BYTES, StateValues, read_state
from qscheme.errors import QuantizeError
from qscheme.formats import (
    get_element_format,
    pack_fp4_k,
    pack_int32_n,
    unpack_fp4_k,
    unpack_int4_n,
    unpack_int32_k,
    unpack_int32_n,
)
from qscheme.formats.table import FORMAT_FACTS
from qscheme.scale_checks import require_finite_dequantization

__all__ = [
    "TENSOR_FIELDS",
    "CanonicalWeight",
    "canonical_zero_point",
    "canonicalize",
    "dequantize",
    "dequantize_rows",
    "effective_scale",
    "element_values",
    "expand_tiles",
    "layer_shape",
    "oriented_tensors",
    "scale_tile",
    "stored_layer_shape",
    "stored_zero_points",
    "zero_point_range",
]


def _as_multiplier(value: Tensor, stored: str) -> Tensor:
    """A float32 multiplier from a stored scale (reciprocal conventions are inverted)."""
    value = value.to(torch.float32)
    return value if stored == "multiplier" else torch.reciprocal(value)


def _per_partition(value: Tensor) -> Tensor:
    return value.reshape(-1).to(torch.float32)


def stored_layer_shape(
    scheme: Scheme, stored_shape: tuple[int, ...], weight_shape: tuple[int, int] | None = None
) -> tuple[int, int]:
    """N, K of a layer from the shape of its stored weight (or the weight_shape tensor's values).

    A packing that can hold padding (``int32_k``, ``nibbles_k``, ``int4_n``) admits several N or
    K for one stored shape; the scheme's declared weight shapes pick among them (``K/8`` admits
    one K, ``ceil(K/8)`` up to eight). Where more than one remains, the true size is only in the
    weight_shape tensor: QuantizeError says the range and asks for it.
    """
    if weight_shape is not None:
        return int(weight_shape[0]), int(weight_shape[1])
    weight = scheme.weight
    if weight.blocks is not None:  # whole blocks: K is the row's blocks times their elements
        return int(stored_shape[0]), int(stored_shape[-1]) // weight.blocks.bytes * weight.blocks.elements
    oriented = stored_shape[::-1] if weight.tensor.transposed and len(stored_shape) == 2 else stored_shape
    rows, columns = int(oriented[0]), int(oriented[-1])
    row_ratio, column_ratio = packing_ratios(weight.format, weight.packing)
    n_range, k_range = unpacked_sizes(rows, row_ratio), unpacked_sizes(columns, column_ratio)
    shape = tuple(int(size) for size in stored_shape)
    fits = [(n, k) for n in n_range for k in k_range if shape in weight.tensor.expected_shapes(n, k)]
    if not fits:  # the stored shape fits no declaration: the validator says so for the padded size
        if (
            weight.tensor.transposed
            and len(shape) == 2
            and shape[::-1] in weight.tensor.expected_shapes(n_range[-1], k_range[-1])
        ):
            raise QuantizeError(
                f"scheme {scheme.name}: {weight.tensor.name!r} of shape [{', '.join(str(s) for s in shape)}] is "
                f"the transpose of its declared layout {weight.tensor.describe_shapes()}; the producer stores it "
                "transposed: re-export the layer, or use a scheme that declares this layout"
            )
        return n_range[-1], k_range[-1]
    if len(fits) == 1:
        return fits[0]
    ns, ks = sorted({n for n, _ in fits}), sorted({k for _, k in fits})
    sizes = []
    if len(ns) > 1:
        sizes.append(f"N may be anything in [{ns[0]}, {ns[-1]}]")
    if len(ks) > 1:
        sizes.append(f"K may be anything in [{ks[0]}, {ks[-1]}]")
    if weight.shape_tensor is not None:
        advice = f"pass the scheme's {weight.shape_tensor.name!r} tensor ([N, K])"
    else:
        advice = "declare a shape_tensor in the scheme and pass it ([N, K]), or declare the shape with exact division"
    raise QuantizeError(
        f"scheme {scheme.name}: the layer size is ambiguous: {weight.tensor.name!r} of shape "
        f"[{', '.join(str(s) for s in shape)}] as declared {weight.tensor.describe_shapes()} means "
        f"{' and '.join(sizes)}; {advice}"
    )


def layer_state(scheme: Scheme, tensors: Mapping[str, Tensor], layer: str | None = None) -> StateValues | None:
    """The layer's checked JSON state (``weight.state``), or None when the scheme declares none;
    QuantizeError naming the tensor, the key and what is allowed when it does not check."""
    spec = scheme.weight.state
    if spec is None:
        return None
    name = spec.tensor.name
    value = tensors.get(name)
    where = f"layer {layer}, scheme {scheme.name}" if layer else f"scheme {scheme.name}"
    if value is None or value.dtype != torch.uint8 or value.ndim != 1:
        found = "missing" if value is None else f"{value.dtype} {list(value.shape)}"
        raise QuantizeError(f"{where}: state tensor {name!r} must be uint8 [bytes] holding JSON, found {found}")
    read = read_state(spec, value.cpu().numpy().tobytes() if value.numel() <= MAX_STATE_BYTES else b" " * value.numel())
    if isinstance(read, str):
        raise QuantizeError(f"{where}: state tensor {name!r}: {read}")
    return read


def unflattened(scheme: Scheme, tensors: Mapping[str, Tensor], n: int, k: int) -> dict[str, Tensor]:
    """The tensors with every one a scheme declares ``flat`` reshaped to its declared shape for N x K
    (QuantizeError when its element count is not that shape's)."""
    out = dict(tensors)
    for spec in scheme.tensor_specs().values():
        value = out.get(spec.name)
        if not spec.flat or value is None:
            continue
        shapes = spec.layout_shapes(n, k)
        fitting = [shape for shape in shapes if math.prod(shape) == value.numel()]
        if not fitting:
            raise QuantizeError(
                f"scheme {scheme.name}: flat tensor {spec.name!r} holds {value.numel()} values, expected the "
                f"{' or '.join(str(math.prod(shape)) for shape in shapes) or 'no'} of {spec.describe_shapes()} "
                f"for N={n}, K={k}"
            )
        out[spec.name] = value.reshape(fitting[0])
    return out


def layer_shape(scheme: Scheme, tensors: Mapping[str, Tensor]) -> tuple[int, int]:
    """N, K of a layer from its JSON state where declared, else from its stored weight (and
    weight_shape where declared and given); QuantizeError where the stored weight leaves them
    ambiguous (see ``stored_layer_shape``)."""
    weight = scheme.weight
    state = layer_state(scheme, tensors)
    if state is not None:
        return state.shape
    stored = tensors[weight.tensor.name]
    given = None
    if weight.shape_tensor is not None and weight.shape_tensor.name in tensors:
        values = [int(v) for v in tensors[weight.shape_tensor.name].reshape(-1).tolist()]
        if len(values) != 2:
            raise QuantizeError(
                f"scheme {scheme.name}: {weight.shape_tensor.name!r} holds {len(values)} values; expected [N, K]"
            )
        given = (values[0], values[1])
    return stored_layer_shape(scheme, tuple(stored.shape), given)


def zero_point_range(spec: ZeroPointSpec) -> tuple[int, int]:
    """The zero points a scheme can store: its format's range, and where words pack them
    (``int32_n``) with an ``offset``, only those whose stored value (zero + offset) fits the word's
    field (GPTQ v1 int4: [-7, 7], the unsigned zero 0 has no stored form)."""
    fmt = get_element_format(spec.format)
    low, high = int(fmt.min_value), int(fmt.max_value)
    if spec.packing == "int32_n":
        low, high = max(low, low - spec.offset), min(high, high - spec.offset)
    return low, high


def _check_zero_range(scheme: Scheme, spec: ZeroPointSpec, values: Tensor) -> None:
    fmt = get_element_format(spec.format)
    low, high = int(fmt.min_value), int(fmt.max_value)
    if values.numel():
        found_low, found_high = int(values.min()), int(values.max())
        if found_low < low or found_high > high:
            stored = f" (stored with offset {spec.offset:+d})" if spec.offset else ""
            raise QuantizeError(
                f"scheme {scheme.name}: zero points {spec.tensor.name!r}{stored} must lie in [{low}, {high}] "
                f"({spec.format}), found values in [{found_low}, {found_high}]"
            )


def canonical_zero_point(scheme: Scheme, raw: Tensor, rows: int, zero_point: ZeroPointSpec | None = None) -> Tensor:
    """Stored zero points -> int16 values of the zero-point format (not yet reshaped); ``rows``:
    the scale's rows (N for group and channel scales), which ``int32_n`` words pack.

    ``int32_n`` words hold signed values offset by 2**(bits-1) and unsigned ones as they are.
    Unpacked 8-bit zero points stored in the 8-bit dtype of the other signedness (uint8 values
    in an int8 tensor) are read by their bits. Values outside the format's range raise
    QuantizeError: the kernels rely on the range.
    """
    spec = scheme.weight.zero_point if zero_point is None else zero_point
    assert spec is not None
    fmt = get_element_format(spec.format)
    bits, signed = fmt.bits, fmt.signed
    if spec.packing == "int32_n":
        values = unpack_int32_n(raw, bits, rows, spec.pack_order).to(torch.int16)  # stored value - 2**(bits-1)
        if not signed:
            values = values + (1 << (bits - 1))
        if spec.offset:
            values = values - spec.offset
            _check_zero_range(scheme, spec, values)
        return values
    if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
        raise QuantizeError(
            f"scheme {scheme.name}: zero points {spec.tensor.name!r} must be stored as integers, found {raw.dtype}"
        )
    if bits == 8 and raw.dtype == (torch.int8 if not signed else torch.uint8):
        raw = raw.view(torch.uint8 if not signed else torch.int8)
    values = raw.to(torch.int16) - spec.offset
    _check_zero_range(scheme, spec, values)
    return values


def stored_zero_points(scheme: Scheme, values: Tensor, zero_point: ZeroPointSpec | None = None) -> Tensor:
    """The inverse of ``canonical_zero_point``: zero points (integers in their format's range,
    shaped as the scale) as the scheme stores them, before any reshape to the declared shape:
    ``int32_n`` words (signed values offset by 2**(bits-1)), 8-bit values in the 8-bit dtype of
    the other signedness by their bits, else cast to the tensor's dtype."""
    spec = scheme.weight.zero_point if zero_point is None else zero_point
    assert spec is not None
    fmt = get_element_format(spec.format)
    values = values.to(torch.int16) + spec.offset
    if spec.packing == "int32_n":
        offset = 0 if fmt.signed else 1 << (fmt.bits - 1)
        return pack_int32_n((values - offset).to(torch.int8), fmt.bits, spec.pack_order)
    dtype = getattr(torch, spec.tensor.dtypes[0])
    if fmt.bits == 8 and dtype == (torch.uint8 if fmt.signed else torch.int8):
        return values.to(torch.int8 if fmt.signed else torch.uint8).view(dtype)
    return values.to(dtype)


def canonicalize(
    scheme: Scheme,
    tensors: Mapping[str, Tensor],
    n: int | None = None,
    k: int | None = None,
    *,
    layer: str | None = None,
    check_finite: bool = True,
) -> CanonicalWeight:
    """Checkpoint tensors (by checkpoint name) of one layer -> CanonicalWeight.

    The tensors must already have been validated against the scheme (names, dtypes, shapes;
    ``qscheme.tensor_checks``). What that cannot see is refused here with QuantizeError
    (naming ``layer`` when given): a mapping that does not hold plain tensors keyed by name,
    and scales whose product would dequantize to inf, NaN or zero (``qscheme.scale_checks``).
    ``check_finite=False`` skips that last check, for tensors derived from ones already checked
    (a conversion's target, built from a canonicalized source).
    """
    weight = scheme.weight
    require_tensor_mapping(
        tensors, f"layer {layer}, scheme {scheme.name}" if layer else f"scheme {scheme.name}", weight.tensor.name
    )
    if weight.tensor.name not in tensors:
        raise QuantizeError(f"scheme {scheme.name}: tensor {weight.tensor.name!r} is missing")
    # the weight is frozen: scales handed over as Parameters carry no autograd history into it
    tensors = {name: value.detach() for name, value in tensors.items()}
    state = layer_state(scheme, tensors, layer)
    if state is not None and (n is None or k is None):
        n, k = state.shape
    if n is not None and k is not None:
        tensors = unflattened(scheme, tensors, n, k)
    if tensors[weight.tensor.name].ndim != 2:
        raise QuantizeError(
            f"scheme {scheme.name}: tensor {weight.tensor.name!r} must be 2-D {weight.tensor.describe_shapes()}, "
            f"found shape {list(tensors[weight.tensor.name].shape)}"
        )
    if n is None or k is None:
        n, k = layer_shape(scheme, tensors)
    tensors = oriented_tensors(scheme, tensors)
    stored = tensors[weight.tensor.name]
    if weight.blocks is not None:
        return canonical_blocks(scheme, stored, n, k, layer=layer, check_finite=check_finite)

    if weight.packing == "nibbles_k":
        codes = stored.to(torch.uint8)
        if weight.pack_order == (1, 0):  # element 2j in the high nibble: swap each byte's nibbles
            codes = (codes << 4) | (codes >> 4)
    elif weight.packing == "int32_k" and weight.pack_order is None:
        codes = _int32_k_to_codes(stored, weight.format, k)
    elif weight.packing in ("int32_k", "int32_n"):
        codes = _int32_to_codes(stored, weight.format, weight.packing, weight.pack_order, n, k)
    elif weight.packing == "int4_n":
        codes = _int_to_codes(unpack_int4_n(stored, n), weight.format)
    else:
        codes = stored
    if weight.format in FOUR_BIT and codes.shape != (n, (k + 1) // 2):
        raise QuantizeError(f"scheme {scheme.name}: codes of shape {tuple(codes.shape)} do not fit N={n}, K={k}")

    scale_spec = weight.scale
    scale = tensors[scale_spec.tensor.name]
    if scale_spec.granularity == "block":
        assert scale_spec.block is not None
        rows, cols = -(-n // scale_spec.block[0]), -(-k // scale_spec.block[1])
        if scale.numel() != rows * cols:
            raise QuantizeError(
                f"scheme {scheme.name}: block scale {scale_spec.tensor.name!r} has {scale.numel()} values, "
                f"expected {rows}x{cols} for a {n}x{k} weight in {scale_spec.block[0]}x{scale_spec.block[1]} blocks"
            )
        scale = scale.reshape(rows, cols)
    elif scale_spec.granularity == "tensor":
        scale = scale.reshape(1)
    elif scale_spec.granularity == "channel":
        scale = scale.reshape(n, 1)
    if scale_spec.stored == "reciprocal":
        scale = torch.reciprocal(scale.to(torch.float32))
    if scale_spec.quantized is not None:
        scale = restored_scales(scheme, scale, tensors, state, layer)
    if weight.table_tensor is not None:
        _check_table_copy(scheme, tensors[weight.table_tensor.name], layer)

    global_scale = divisor = None
    if weight.global_scale is not None:
        raw = tensors[weight.global_scale.tensor.name]
        global_scale = _per_partition(_as_multiplier(raw, weight.global_scale.stored))
        if weight.global_scale.stored == "reciprocal":
            divisor = _per_partition(raw)

    zero_point = None
    if weight.zero_point is not None:
        rows = scale.shape[0] if scale.ndim == 2 else 1
        zero_point = canonical_zero_point(scheme, tensors[weight.zero_point.tensor.name], rows).reshape(scale.shape)
    if weight.symmetric_zero_point is not None:
        _check_symmetric_zero_point(scheme, weight.symmetric_zero_point, tensors, scale, layer)
    permutation = None
    if scale_spec.group_index is not None and scale_spec.group_index.name in tensors:  # absent: k // group
        permutation = check_group_index(scheme, tensors[scale_spec.group_index.name], k, layer)
    if permutation is not None:
        codes = _permuted_columns(codes, weight.format, k, permutation)

    input_scale = input_global = input_divisor = pre_scale = None
    activation = scheme.activation
    if activation is not None and activation.scale is not None and activation.scale.tensor.name in tensors:
        input_scale = _per_partition(_as_multiplier(tensors[activation.scale.tensor.name], activation.scale.stored))
    if activation is not None and activation.global_scale is not None:
        name = activation.global_scale.tensor.name
        if name in tensors:
            input_global = _per_partition(_as_multiplier(tensors[name], activation.global_scale.stored))
            if activation.global_scale.stored == "reciprocal":
                input_divisor = _per_partition(tensors[name])
    if scheme.input_pre_scale is not None and scheme.input_pre_scale.name in tensors:
        pre_scale = tensors[scheme.input_pre_scale.name].reshape(-1)

    canonical = CanonicalWeight(
        scheme=scheme,
        n=n,
        k=k,
        codes=codes,
        scale=scale,
        global_scale=global_scale,
        global_scale_divisor=divisor,
        zero_point=zero_point,
        partitions=(n,),
        input_scale=input_scale,
        input_global_scale=input_global,
        input_global_scale_divisor=input_divisor,
        input_pre_scale=pre_scale,
        input_permutation=permutation,
    )
    if check_finite:
        require_finite_dequantization(canonical, layer)
    return canonical


def restored_scales(
    scheme: Scheme, codes: Tensor, tensors: Mapping[str, Tensor], state: StateValues | None, layer: str | None
) -> Tensor:
    """Scales stored quantized (``weight.scale.quantized``), restored to float32 in the codes' shape:
    ``table[code_j] * scale[j // group_size]``, then ``+ offset``, each rounded in float32, j counting
    the codes in row-major order (bitsandbytes' double quantization)."""
    spec = scheme.weight.scale.quantized
    assert spec is not None
    table = tensors[spec.table.name].reshape(-1).to(torch.float32)
    outer = tensors[spec.scale.name].reshape(-1).to(torch.float32)
    flat = codes.reshape(-1).to(torch.int64)
    blocks = torch.arange(flat.numel(), device=flat.device) // spec.group_size
    if flat.numel() and (int(flat.max()) >= table.numel() or int(blocks[-1]) >= outer.numel()):
        raise QuantizeError(
            f"{_where(scheme, layer)}: quantized scales {scheme.weight.scale.tensor.name!r} ({flat.numel()} codes up "
            f"to {int(flat.max())}) need a table of {int(flat.max()) + 1}+ values and {int(blocks[-1]) + 1} scales of "
            f"{spec.group_size}; {spec.table.name!r} holds {table.numel()} and {spec.scale.name!r} {outer.numel()}"
        )
    values = table.index_select(0, flat) * outer.index_select(0, blocks)
    if spec.offset is not None:
        assert state is not None, "the parser requires a state for an offset"
        values = values + torch.tensor(state.numbers[spec.offset], dtype=torch.float32, device=values.device)
    return values.reshape(codes.shape)


def _check_table_copy(scheme: Scheme, stored: Tensor, layer: str | None) -> None:
    """A stored copy of the weight's table must equal it bit for bit (its producer decodes with its own)."""
    table = scheme.weight.table
    assert table is not None and scheme.weight.table_tensor is not None
    expected = torch.tensor(table, dtype=torch.float32)
    found = stored.detach().reshape(-1).cpu()
    if (
        found.dtype != torch.float32
        or found.shape != expected.shape
        or not torch.equal(found.view(torch.int32), expected.view(torch.int32))
    ):
        raise QuantizeError(
            f"{_where(scheme, layer)}: tensor {scheme.weight.table_tensor.name!r} is not the scheme's table (it "
            f"starts {found[:4].tolist()}, expected {expected[:4].tolist()}); its producer decodes with its own "
            "table and never reads this copy, so the file means two things: re-export it"
        )


def oriented_tensors(scheme: Scheme, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The tensors with every one a scheme declares ``transposed`` turned to the canonical
    orientation ([N-major, K-major]) as views."""
    out = dict(tensors)
    for spec in scheme.tensor_specs().values():
        value = out.get(spec.name)
        if spec.transposed and value is not None and value.ndim == 2:
            out[spec.name] = value.T
    return out


def _int32_to_codes(
    stored: Tensor, element: str, packing: str, order: tuple[int, ...] | None, n: int, k: int
) -> Tensor:
    """int32 words along K or N (in a declared slot order) -> canonical codes."""
    bits = element_bits(element)
    if packing == "int32_n":
        values = unpack_int32_n(stored, bits, n, order)
    else:
        values = unpack_int32_k(stored, bits, k, order)
    if not FORMAT_FACTS[element].signed:
        values = values.to(torch.int16) + (1 << (bits - 1))
    return _int_to_codes(values, element)


def _where(scheme: Scheme, layer: str | None) -> str:
    return f"layer {layer} (scheme {scheme.name})" if layer else f"scheme {scheme.name}"


def _check_symmetric_zero_point(
    scheme: Scheme, spec: ZeroPointSpec, tensors: Mapping[str, Tensor], scale: Tensor, layer: str | None
) -> None:
    """A symmetric scheme's stored zero points must all equal the declared value (then dropped)."""
    assert spec.equals is not None  # the parser files such zero points here only
    rows = scale.shape[0] if scale.ndim == 2 else 1
    values = canonical_zero_point(scheme, tensors[spec.tensor.name], rows, spec)
    wrong = torch.ne(values, spec.equals)
    if bool(wrong.any()):
        position = [int(i) for i in wrong.nonzero()[0]]
        found = int(values[tuple(position)])
        offset = f", stored {found + spec.offset}" if spec.offset else ""
        raise QuantizeError(
            f"{_where(scheme, layer)}: zero points {spec.tensor.name!r} must all be {spec.equals} (the scheme is "
            f"symmetric{f'; stored with offset {spec.offset:+d}' if spec.offset else ''}), found {found}{offset} at "
            f"{position} ({int(wrong.sum())} of {wrong.numel()}); the config says sym but these weights are "
            "asymmetric: fix the config's sym, or use an asymmetric scheme"
        )


def check_group_index(scheme: Scheme, group_index: Tensor, k: int, layer: str | None = None) -> Tensor | None:
    """None when a per-column group index assigns column k to group k // group_size (the order
    qscheme's canonical form keeps); for another assignment of group_size columns per group
    (act-order: groups out of order) the permutation of the columns that makes each group
    consecutive (a stable sort by group: ``input_permutation``); anything else is refused as not a
    group assignment."""
    spec = scheme.weight.scale
    assert spec.group_index is not None
    name, size = spec.group_index.name, spec.group_size or max(k, 1)  # a channel scale: one group of K
    groups = -(-k // size)
    if tuple(group_index.shape) != (k,):
        raise QuantizeError(
            f"{_where(scheme, layer)}: group index {name!r} has shape {list(group_index.shape)}; expected [{k}] "
            "(one group per input channel)"
        )
    values = group_index.to(torch.int64)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= groups):
        raise QuantizeError(
            f"{_where(scheme, layer)}: group index {name!r} holds values in [{int(values.min())}, "
            f"{int(values.max())}]; allowed: group numbers 0..{groups - 1} ({k} columns in groups of {size}); "
            "the tensor is not a group assignment: re-export the layer"
        )
    expected = torch.arange(k, device=values.device) // size
    if torch.equal(values, expected):
        return None
    counts = torch.bincount(values, minlength=groups)
    sizes = torch.bincount(expected, minlength=groups)
    if not torch.equal(counts, sizes):
        group = int((counts != sizes).nonzero()[0])
        raise QuantizeError(
            f"{_where(scheme, layer)}: group index {name!r} puts {int(counts[group])} columns in group {group}, "
            f"which holds {int(sizes[group])} ({size} columns per group); it is not a group assignment of "
            f"{k} columns: re-export the layer"
        )
    return torch.sort(values, stable=True).indices


def _permuted_columns(codes: Tensor, element: str, k: int, permutation: Tensor) -> Tensor:
    """Canonical codes with column j taken from column ``permutation[j]``."""
    if element in FOUR_BIT:
        nibbles = unpack_fp4_k(codes.view(torch.uint8), k)
        return pack_fp4_k(nibbles.index_select(1, permutation)).view(codes.dtype)
    return codes.index_select(1, permutation)


def _int_to_codes(values: Tensor, element: str) -> Tensor:
    """Integer values [N, K] of ``element`` (int4 in [-8, 7], uint4 in [0, 15], ...) -> canonical codes."""
    if FORMAT_FACTS[element].bits == 4:
        return pack_fp4_k((values.to(torch.int16) & 0xF).to(torch.uint8))
    if FORMAT_FACTS[element].signed:  # int8, and narrower signed integers one per byte (int2)
        return values.to(torch.int8)
    return values.to(torch.uint8)


def _int32_k_to_codes(stored: Tensor, element: str, k: int) -> Tensor:
    """compressed-tensors ``pack-quantized`` words -> canonical codes.

    Signed values are stored offset by 2**(bits-1) and unsigned ones as they are. With 4 or 8
    bits no value straddles a byte, so on a little-endian host the words' bytes already hold
    the values in order (element 2j in the low nibble): flipping the offset bit of every
    value turns offset binary into two's complement without unpacking.
    """
    bits = element_bits(element)
    signed = FORMAT_FACTS[element].signed
    if sys.byteorder == "little" and stored.dtype == torch.int32 and stored.ndim == 2 and bits in (4, 8):
        width = -(-k // 2) if bits == 4 else k
        raw = stored.contiguous().view(torch.uint8)
        if raw.shape[-1] >= width:
            codes = raw[:, :width]
            codes = codes ^ (0x88 if bits == 4 else 0x80) if signed else codes.clone()
            if bits == 4 and k % 2:
                codes[:, -1] &= 0x0F  # the padding nibble of an odd K is zero in canonical codes
            return codes.view(torch.int8) if element == "int8" else codes
    values = unpack_int32_k(stored, bits, k)  # signed: stored value - 2**(bits-1)
    if not signed:
        values = values.to(torch.int16) + (1 << (bits - 1))
    return _int_to_codes(values, element)
