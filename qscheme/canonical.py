"""Canonical layer tensors: one form per format family, free of producer names and conventions.

Kernels see only ``CanonicalWeight``. The conversion from checkpoint tensors (keyed by their
checkpoint names, as a scheme declares them) is here, and so is the exact reference
dequantization that every kernel is tested against.

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
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from qscheme.api_checks import require_tensor_mapping
from qscheme.descriptor import Scheme
from qscheme.descriptor.consistency import FOUR_BIT, element_bits, packing_divisors
from qscheme.errors import QuantizeError
from qscheme.formats import (
    decode,
    get_element_format,
    pack_fp4_k,
    pack_int32_n,
    unpack_int4_n,
    unpack_int32_k,
    unpack_int32_n,
)


@dataclass(frozen=True)
class CanonicalWeight:
    """The kernel-facing tensors of one linear layer (see the module docstring)."""

    scheme: Scheme
    n: int
    k: int
    codes: Tensor
    scale: Tensor
    global_scale: Tensor | None = None
    global_scale_divisor: Tensor | None = None
    zero_point: Tensor | None = None
    partitions: tuple[int, ...] = ()
    input_scale: Tensor | None = None
    input_global_scale: Tensor | None = None
    input_global_scale_divisor: Tensor | None = None
    input_pre_scale: Tensor | None = None

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor field that is set, by field name (``TENSOR_FIELDS`` order)."""
        return {name: value for name in TENSOR_FIELDS if (value := getattr(self, name)) is not None}

    def kernel_tensors(self) -> dict[str, Tensor]:
        """The tensors a kernel consumes (excludes the exact-rounding provenance)."""
        fields = {
            "codes": self.codes,
            "scale": self.scale,
            "global_scale": self.global_scale,
            "zero_point": self.zero_point,
            "input_scale": self.input_scale,
            "input_global_scale": self.input_global_scale,
            "input_pre_scale": self.input_pre_scale,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def to(self, device: torch.device | str) -> CanonicalWeight:
        """The same tensors on another device."""
        moved: dict[str, Any] = {
            name: (value.to(device) if isinstance(value, Tensor) else value) for name, value in self.__dict__.items()
        }
        return replace(self, **moved)


# CanonicalWeight's tensor fields; the rest (scheme, n, k, partitions) describe them.
TENSOR_FIELDS: tuple[str, ...] = (
    "codes",
    "scale",
    "global_scale",
    "global_scale_divisor",
    "zero_point",
    "input_scale",
    "input_global_scale",
    "input_global_scale_divisor",
    "input_pre_scale",
)


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
    rows, columns = int(stored_shape[0]), int(stored_shape[-1])
    per_row, per_column = packing_divisors(weight.format, weight.packing)
    n_range = range(max(1, (rows - 1) * per_row + 1), rows * per_row + 1) if rows else range(0, 1)
    k_range = range(max(1, (columns - 1) * per_column + 1), columns * per_column + 1) if columns else range(0, 1)
    shape = tuple(int(size) for size in stored_shape)
    fits = [(n, k) for n in n_range for k in k_range if shape in weight.tensor.expected_shapes(n, k)]
    if not fits:  # the stored shape fits no declaration: the validator says so for the padded size
        return rows * per_row, columns * per_column
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


def layer_shape(scheme: Scheme, tensors: Mapping[str, Tensor]) -> tuple[int, int]:
    """N, K of a layer from its stored weight (and weight_shape where declared and given);
    QuantizeError where the stored weight leaves them ambiguous (see ``stored_layer_shape``)."""
    weight = scheme.weight
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


def canonical_zero_point(scheme: Scheme, raw: Tensor, rows: int) -> Tensor:
    """Stored zero points -> int16 values of the zero-point format (not yet reshaped); ``rows``:
    the scale's rows (N for group and channel scales), which ``int32_n`` words pack.

    ``int32_n`` words hold signed values offset by 2**(bits-1) and unsigned ones as they are.
    Unpacked 8-bit zero points stored in the 8-bit dtype of the other signedness (uint8 values
    in an int8 tensor) are read by their bits. Values outside the format's range raise
    QuantizeError: the kernels rely on the range.
    """
    spec = scheme.weight.zero_point
    assert spec is not None
    fmt = get_element_format(spec.format)
    bits, signed = fmt.bits, fmt.signed
    if spec.packing == "int32_n":
        values = unpack_int32_n(raw, bits, rows).to(torch.int16)  # stored value - 2**(bits-1)
        if not signed:
            values = values + (1 << (bits - 1))
        return values
    if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
        raise QuantizeError(
            f"scheme {scheme.name}: zero points {spec.tensor.name!r} must be stored as integers, found {raw.dtype}"
        )
    if bits == 8 and raw.dtype == (torch.int8 if not signed else torch.uint8):
        raw = raw.view(torch.uint8 if not signed else torch.int8)
    low, high = int(fmt.min_value), int(fmt.max_value)
    if raw.numel():
        found_low, found_high = int(raw.min()), int(raw.max())
        if found_low < low or found_high > high:
            raise QuantizeError(
                f"scheme {scheme.name}: zero points {spec.tensor.name!r} must lie in [{low}, {high}] "
                f"({spec.format}), found values in [{found_low}, {found_high}]"
            )
    return raw.to(torch.int16)


def stored_zero_points(scheme: Scheme, values: Tensor) -> Tensor:
    """The inverse of ``canonical_zero_point``: zero points (integers in their format's range,
    shaped as the scale) as the scheme stores them, before any reshape to the declared shape:
    ``int32_n`` words (signed values offset by 2**(bits-1)), 8-bit values in the 8-bit dtype of
    the other signedness by their bits, else cast to the tensor's dtype."""
    spec = scheme.weight.zero_point
    assert spec is not None
    fmt = get_element_format(spec.format)
    if spec.packing == "int32_n":
        offset = 0 if fmt.signed else 1 << (fmt.bits - 1)
        return pack_int32_n((values.to(torch.int16) - offset).to(torch.int8), fmt.bits)
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
    ``qscheme.checkpoint.validate``). What that cannot see is refused here with QuantizeError
    (naming ``layer`` when given): a mapping that does not hold plain tensors keyed by name,
    and scales whose product would dequantize to inf, NaN or zero (``qscheme.scale_checks``).
    ``check_finite=False`` skips that last check, for tensors derived from ones already checked
    (a conversion's target, built from a canonicalized source).
    """
    # imported here: scale_checks builds on this module's effective_scale
    from qscheme.scale_checks import require_finite_dequantization

    weight = scheme.weight
    require_tensor_mapping(
        tensors, f"layer {layer}, scheme {scheme.name}" if layer else f"scheme {scheme.name}", weight.tensor.name
    )
    if weight.tensor.name not in tensors:
        raise QuantizeError(f"scheme {scheme.name}: tensor {weight.tensor.name!r} is missing")
    # the weight is frozen: scales handed over as Parameters carry no autograd history into it
    tensors = {name: value.detach() for name, value in tensors.items()}
    if tensors[weight.tensor.name].ndim != 2:
        raise QuantizeError(
            f"scheme {scheme.name}: tensor {weight.tensor.name!r} must be 2-D {weight.tensor.describe_shapes()}, "
            f"found shape {list(tensors[weight.tensor.name].shape)}"
        )
    if n is None or k is None:
        n, k = layer_shape(scheme, tensors)
    stored = tensors[weight.tensor.name]

    if weight.packing == "nibbles_k":
        codes = stored.to(torch.uint8)
    elif weight.packing == "int32_k":
        codes = _int32_k_to_codes(stored, weight.format, k)
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
    )
    if check_finite:
        require_finite_dequantization(canonical, layer)
    return canonical


def _int_to_codes(values: Tensor, element: str) -> Tensor:
    """Integer values [N, K] of ``element`` (int4 in [-8, 7], uint4 in [0, 15], ...) -> canonical codes."""
    if element in ("int4", "uint4"):
        return pack_fp4_k((values.to(torch.int16) & 0xF).to(torch.uint8))
    if element == "int8":
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
    signed = not element.startswith("uint")
    if sys.byteorder == "little" and stored.dtype == torch.int32 and stored.ndim == 2:
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


# Decoded values of both nibbles of every byte, per 4-bit element format: [256, 2] float32.
def _nibble_pair_table(element: str) -> Tensor:
    nibbles = torch.arange(16, dtype=torch.uint8)
    if element == "int4":
        values = ((nibbles.to(torch.int16) ^ 8) - 8).to(torch.float32)
    elif element == "uint4":
        values = nibbles.to(torch.float32)
    else:
        values = decode(nibbles, element)
    low = values.repeat(16)  # byte b: low nibble b & 15
    high = values.repeat_interleave(16)  # high nibble b >> 4
    return torch.stack((low, high), dim=1).contiguous()


_NIBBLE_PAIR_TABLES: dict[tuple[str, torch.device], Tensor] = {}


def _decode_nibbles(codes: Tensor, element: str, k: int) -> Tensor:
    """uint8 [rows, ceil(k/2)] of two 4-bit codes -> float32 [rows, k]."""
    key = (element, codes.device)
    if key not in _NIBBLE_PAIR_TABLES:
        _NIBBLE_PAIR_TABLES[key] = _nibble_pair_table(element).to(codes.device)
    table = _NIBBLE_PAIR_TABLES[key]
    pairs = table.index_select(0, codes.reshape(-1).to(torch.int32))
    return pairs.view(codes.shape[0], -1)[:, :k]


_BYTE_TABLES: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _decode_float8(codes: Tensor) -> Tensor:
    """float8 codes -> float32 through a 256-entry table of torch's own conversion (the same
    values, bit for bit, several times faster than converting element by element on a CPU)."""
    key = (codes.dtype, codes.device)
    if key not in _BYTE_TABLES:
        every_byte = torch.arange(256, dtype=torch.uint8, device=codes.device)
        _BYTE_TABLES[key] = every_byte.view(codes.dtype).to(torch.float32)
    indices = codes.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return _BYTE_TABLES[key].index_select(0, indices).view(codes.shape)


def _decode_rows(weight: CanonicalWeight, rows: slice) -> Tensor:
    element = weight.scheme.weight.format
    codes = weight.codes[rows]
    if element in FOUR_BIT:
        return _decode_nibbles(codes, element, weight.k)
    if codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return _decode_float8(codes)
    return codes.to(torch.float32)


def element_values(weight: CanonicalWeight) -> Tensor:
    """The decoded elements as float32 [N, K] (before zero points and scales); e2m1's negative
    zero (code 0x8) decodes to +0.0."""
    return _decode_rows(weight, slice(0, weight.n))


def _expand_rows(per_partition: Tensor, partitions: tuple[int, ...]) -> Tensor:
    """[P] -> [N, 1] by repeating each partition's value over its rows."""
    sizes = torch.tensor(partitions, device=per_partition.device)
    return per_partition.repeat_interleave(sizes).reshape(-1, 1)


def effective_scale(weight: CanonicalWeight, scale_rows: slice | None = None) -> Tensor:
    """float32 scale in its own layout with the global scale folded in as the producer does.

    For a stored divisor this is ``block_scale / divisor`` and for a multiplier
    ``block_scale * multiplier``, each rounded once in float32, exactly as compressed-tensors
    and ModelOpt compute it. ``scale_rows``: only these rows of the result (the same values as
    slicing the whole result: every element is computed on its own); a single tensor-wide scale
    stays one value.
    """
    spec = weight.scheme.weight.scale
    stored = weight.scale if scale_rows is None or spec.granularity == "tensor" else weight.scale[scale_rows]
    if spec.format == "e8m0":
        scale = decode(stored, "e8m0")
    else:
        scale = stored.to(torch.float32)
    if weight.global_scale is None:
        if spec.granularity == "tensor":
            rows = _expand_rows(scale.expand(len(weight.partitions)), weight.partitions)
            return rows if scale_rows is None else rows[scale_rows]
        return scale
    rows_of = _global_rows(weight, scale)
    if weight.global_scale_divisor is not None:
        return scale / _some_rows(rows_of(weight.global_scale_divisor), scale_rows)
    return scale * _some_rows(rows_of(weight.global_scale), scale_rows)


def _some_rows(value: Tensor, rows: slice | None) -> Tensor:
    """``value[rows]`` for a per-row value ([N, 1]); a single value as it is."""
    return value if rows is None or (value.ndim == 1 and value.shape[0] == 1) else value[rows]


def _global_rows(weight: CanonicalWeight, scale: Tensor):  # type: ignore[no-untyped-def]
    spec = weight.scheme.weight.scale
    if spec.granularity in ("group", "channel"):
        return lambda value: _expand_rows(value, weight.partitions)
    if len(weight.partitions) != 1:
        raise QuantizeError(
            f"scheme {weight.scheme.name}: per-partition global scales need a group or channel scale, "
            f"not {spec.granularity!r}"
        )
    return lambda value: value.reshape(1)


def scale_tile(weight: CanonicalWeight, scale: Tensor) -> tuple[int, int]:
    """Weight rows and columns under one element of ``effective_scale``'s result."""
    spec = weight.scheme.weight.scale
    if spec.granularity == "group":
        assert spec.group_size is not None
        return 1, spec.group_size
    if spec.granularity == "block":
        assert spec.block is not None
        return spec.block
    return 1, weight.k  # channel, or tensor scales as one per row


def expand_tiles(value: Tensor, tile: tuple[int, int], rows: slice, k: int) -> Tensor:
    """The per-tile ``value`` over weight rows ``rows`` as [rows, k] (or broadcastable)."""
    tile_rows, tile_columns = tile
    first, last = rows.start // tile_rows, -(-rows.stop // tile_rows)
    part = value[first:last]
    if tile_rows > 1:
        offset = rows.start - first * tile_rows
        part = part.repeat_interleave(tile_rows, dim=0)[offset : offset + rows.stop - rows.start]
    if part.shape[-1] == 1:
        return part
    return part.repeat_interleave(tile_columns, dim=1)[:, :k]


def dequantize(weight: CanonicalWeight) -> Tensor:
    """The float32 [N, K] weight, bit-identical to the producer's own float32 dequantization.

    ``(element - zero_point) * effective_scale``, one rounding, computed slab by slab of rows
    (see qscheme.quantize.slabs; imported here, not at the top, to keep this core module's
    imports free of the quantize package).
    """
    from qscheme.quantize import slabs

    with slabs.single_threaded_caller():
        return dequantize_rows(weight, 0, weight.n)


def dequantize_rows(weight: CanonicalWeight, start: int, stop: int, out: Tensor | None = None) -> Tensor:
    """Rows [start, stop) of ``dequantize(weight)`` as float32 [stop - start, K], bit for bit,
    computed from those rows' codes, scales and zero points only (a kernel that must not hold
    the whole float32 weight dequantizes it a chunk of rows at a time). ``out``: a contiguous
    float32 [stop - start, K] tensor on the weight's device to write them into (a buffer reused
    from chunk to chunk).

    The slabs run on qscheme's worker threads as for ``dequantize``, but the calling thread's
    torch thread count is left as it is: changing it costs milliseconds per call (the BLAS
    re-initializes), which a kernel calling this chunk after chunk cannot afford."""
    from qscheme.quantize import slabs

    if not 0 <= start <= stop <= weight.n:
        raise QuantizeError(
            f"scheme {weight.scheme.name}: rows [{start}, {stop}) are not within the weight's N={weight.n} rows; "
            f"pass 0 <= start <= stop <= {weight.n}"
        )
    return _dequantize_slabs(weight, slabs, start, stop, out)


def _dequantize_slabs(
    weight: CanonicalWeight, slabs: types.ModuleType, start: int, stop: int, out: Tensor | None
) -> Tensor:
    k = weight.k
    tile = scale_tile(weight, weight.scale)
    # the scale (and zero-point) rows under weight rows [start, stop); weight row r is row
    # r - offset of them
    first, last = start // tile[0], -(-stop // tile[0])
    offset = first * tile[0]
    scale = effective_scale(weight, slice(first, last))
    if weight.scheme.weight.scale.granularity == "tensor" and scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(last - first, 1)  # one scale, broadcast as one per row
    zero = None if weight.zero_point is None else weight.zero_point[first:last].to(torch.float32)
    shape = (stop - start, k)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=weight.codes.device)
    elif (
        out.shape != shape or out.dtype != torch.float32 or out.device != weight.codes.device or not out.is_contiguous()
    ):
        raise QuantizeError(
            f"scheme {weight.scheme.name}: out= must be a contiguous float32 [{shape[0]}, {k}] tensor on "
            f"{weight.codes.device} for rows [{start}, {stop}), got {out.dtype} {list(out.shape)} on {out.device}; "
            "pass such a tensor or out=None"
        )
    # group scales over whole groups multiply through a view, without expanding the scale
    grouped = tile[0] == 1 and tile[1] < k and k % tile[1] == 0

    # the workers run in the caller's inference mode (thread-local), or writing into an ``out``
    # made under torch.inference_mode() would be refused
    inference = torch.is_inference_mode_enabled()

    def work(rows: slice) -> None:
        with torch.inference_mode(inference):
            _work(rows)

    def _work(rows: slice) -> None:
        values = _decode_rows(weight, slice(start + rows.start, start + rows.stop))
        local = slice(start + rows.start - offset, start + rows.stop - offset)
        if grouped:
            groups = (rows.stop - rows.start, k // tile[1], tile[1])
            values = values.reshape(groups)
            if zero is not None:
                values = values - zero[local].unsqueeze(-1)
            torch.mul(values, scale[local].unsqueeze(-1), out=out[rows].view(groups))
            return
        if zero is not None:
            values = values - expand_tiles(zero, tile, local, k)
        torch.mul(values, expand_tiles(scale, tile, local, k), out=out[rows])

    slabs.run_slabs(work, slabs.slabs_for(out.device, stop - start, k, tile[0]), out.device)
    return out
