"""Decoding packed blocks (``qscheme.descriptor.blocks``) into float32, exactly as declared.

``decode_blocks(raw, layout)`` turns the raw bytes of whole blocks into their weights. Every
value is computed in float32 the way the declaration writes it: the scale factors multiplied
left to right, then the element, then the minimum subtracted or added, each operation rounded
once (no fused multiply-add). That is the reference arithmetic of llama.cpp's dequantizers,
which the GGUF schemes' tests check bit for bit.

The bit unpacking is compiled once per layout (``compile_layout``) into gathers: for each piece
slot of an integer, the byte of every value, its shift, width and destination bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import torch
from torch import Tensor

from qscheme.descriptor.blocks import BlockField, BlockLayout, IntegerSpec, Plane
from qscheme.environment import env_flag
from qscheme.errors import QuantizeError
from qscheme.formats.elements import decode
from qscheme.huge_pages import empty as empty_huge
from qscheme.native_isa import IsaExtension


@dataclass(frozen=True)
class _Slot:
    """One piece of every value of an integer: bytes (block-relative), shifts, masks, destinations."""

    index: Tensor  # int64 [count]
    shift: Tensor  # int32 [count]
    mask: Tensor  # int32 [count]
    destination: Tensor  # int32 [count]


@dataclass(frozen=True)
class _CompiledInteger:
    spec: IntegerSpec
    slots: tuple[_Slot, ...]


@dataclass(frozen=True)
class CompiledLayout:
    """A layout with its gathers built (CPU tensors; moved to a device on first use there).

    ``native``: for the C loop (``qscheme._blocks``), per integer its pieces as int32
    [depth, 4, count] (byte, shift, mask, destination) and every raw code's value as float32
    [2**bits] (with its sign and offset); ``native_table`` the element's values (the integer's,
    the table's or the format's). Empty off the CPU."""

    layout: BlockLayout
    integers: dict[str, _CompiledInteger]
    element_table: Tensor | None  # float32 [2**bits] for table and format elements
    native: dict[str, tuple[Tensor, Tensor]] = dataclass_field(default_factory=dict)
    native_table: Tensor | None = None

    @property
    def native_slots(self) -> Tensor | None:
        element = self.layout.element
        return None if element is None or element.integer not in self.native else self.native[element.integer][0]


_COMPILED: dict[tuple[int, str], CompiledLayout] = {}


def _compile_integer(layout: BlockLayout, spec: IntegerSpec, device: torch.device) -> _CompiledInteger:
    fields = {field.name: field for field in layout.fields}
    depth = max(len(value) for value in spec.sources)
    slots = []
    for slot in range(depth):
        index, shift, mask, destination = [], [], [], []
        for value in spec.sources:
            # values with fewer pieces read byte 0 with an empty mask in the slots they lack
            if slot < len(value):
                field, byte, bit, width = value[slot]
                index.append(fields[field].offset + byte)
                shift.append(bit)
                mask.append((1 << width) - 1)
                destination.append(sum(piece[3] for piece in value[:slot]))
            else:
                index.extend([0])
                shift.append(0)
                mask.append(0)
                destination.append(0)
        slots.append(
            _Slot(
                torch.tensor(index, dtype=torch.int64, device=device),
                torch.tensor(shift, dtype=torch.int32, device=device),
                torch.tensor(mask, dtype=torch.int32, device=device),
                torch.tensor(destination, dtype=torch.int32, device=device),
            )
        )
    return _CompiledInteger(spec, tuple(slots))


def _element_table(layout: BlockLayout, device: torch.device) -> Tensor | None:
    rule = layout.element
    if rule is None or (rule.table is None and rule.format is None):
        return None
    if rule.table is not None:
        return torch.tensor(rule.table, dtype=torch.float32, device=device)
    spec = layout.integer(rule.integer)
    assert spec is not None and rule.format is not None
    codes = torch.arange(1 << spec.bits, dtype=torch.uint8)
    # + 0.0 turns a negative zero code into +0.0, as the producers' integer tables do
    return (decode(codes, rule.format).to(torch.float32) + 0.0).to(device)


def compile_layout(layout: BlockLayout, device: torch.device | str = "cpu") -> CompiledLayout:
    """The layout's gathers on ``device`` (cached per layout and device)."""
    device = torch.device(device)
    key = (id(layout), str(device))
    found = _COMPILED.get(key)
    if found is not None and found.layout is layout:
        return found
    integers = {spec.name: _compile_integer(layout, spec, device) for spec in layout.integers}
    table = _element_table(layout, device)
    native: dict[str, tuple[Tensor, Tensor]] = {}
    element_values = None
    if device.type == "cpu":
        for name, compiled_integer in integers.items():
            slots = torch.stack(
                [torch.stack([s.index.to(torch.int32), s.shift, s.mask, s.destination]) for s in compiled_integer.slots]
            ).contiguous()
            native[name] = (slots, _integer_values(compiled_integer.spec))
        if layout.element is not None:
            element_values = table if table is not None else native[layout.element.integer][1]
    compiled = CompiledLayout(layout, integers, table, native, element_values)
    _COMPILED[key] = compiled
    return compiled


def _integer_values(spec: IntegerSpec) -> Tensor:
    """float32 [2**bits]: the value of every raw code of an integer (sign, then offset)."""
    codes = torch.arange(1 << spec.bits, dtype=torch.int64)
    if spec.signed:
        codes = codes - ((codes >> (spec.bits - 1)) & 1) * (1 << spec.bits)
    return (codes + spec.offset).to(torch.float32)


# ggml's unsigned e4m3 (bias 7): bit 7 is ignored, 0x00 and 0x7F decode to 0, no NaN.
def _ue4m3_table() -> Tensor:
    codes = torch.arange(256, dtype=torch.int32)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 7).to(torch.float32)
    normal = (1.0 + mantissa / 8.0) * torch.pow(2.0, (exponent - 7).to(torch.float32))
    subnormal = mantissa * 2.0**-9
    values = torch.where(exponent == 0, subnormal, normal)
    return torch.where((codes == 0) | (codes == 0x7F), torch.zeros_like(values), values)


_UE4M3: dict[str, Tensor] = {}


def float_field_values(blocks: Tensor, field: BlockField) -> Tensor:
    """[B, count] float32 values of a float field of [B, bytes] blocks."""
    raw = blocks[:, field.offset : field.offset + field.size]
    if field.format in ("fp16", "bf16", "fp32"):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[field.format]
        # through a flat copy: a one-block slice counts as contiguous with the block's stride
        return raw.contiguous().reshape(-1).view(dtype).to(torch.float32).view(raw.shape[0], field.count)
    if field.format == "e4m3":
        return raw.contiguous().reshape(-1).view(torch.float8_e4m3fn).to(torch.float32).view(raw.shape)
    if field.format == "e8m0":
        return decode(raw.contiguous(), "e8m0").to(torch.float32)
    assert field.format == "ue4m3", field.format
    key = str(blocks.device)
    if key not in _UE4M3:
        _UE4M3[key] = _ue4m3_table().to(blocks.device)
    return _UE4M3[key].index_select(0, raw.reshape(-1).to(torch.int64)).view(raw.shape)


def _plane_values(blocks: Tensor, field: BlockField, plane: Plane, count: int) -> Tensor:
    """[B, count] uint8 values of one bit plane, unpacked by reshapes and shifts (no gather)."""
    per_byte = 8 // plane.bits
    runs = count // (plane.run * per_byte)
    start = field.offset + plane.first_byte
    raw = blocks[:, start : start + runs * plane.run].reshape(-1, runs, 1, plane.run)
    if per_byte == 1:
        return raw.reshape(-1, count)
    shifts = _SHIFTS.setdefault((plane.bits, str(blocks.device)), _shift_table(plane.bits, blocks.device))
    return ((raw >> shifts) & ((1 << plane.bits) - 1)).reshape(-1, count)


_SHIFTS: dict[tuple[int, str], Tensor] = {}


def _shift_table(bits: int, device: torch.device) -> Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device).view(1, 1, -1, 1)


def _integer(blocks: Tensor, compiled: _CompiledInteger, layout: BlockLayout) -> Tensor:
    """[B, count] values of an integer (offset and sign applied): uint8 or int16 from planes of
    at most 8 bits in all, else int32."""
    spec = compiled.spec
    if spec.planes and spec.bits <= 8 and not spec.signed and spec.offset == 0:
        value: Tensor | None = None
        shift = 0
        for plane in spec.planes:
            field = layout.field(plane.field)
            assert field is not None
            part = _plane_values(blocks, field, plane, spec.count)
            value = part if value is None else value | (part << shift)
            shift += plane.bits
        assert value is not None
        return value
    out: Tensor | None = None
    for slot in compiled.slots:
        part = blocks.index_select(1, slot.index).to(torch.int32)
        part = ((part >> slot.shift) & slot.mask) << slot.destination
        out = part if out is None else out | part
    assert out is not None
    if spec.signed:
        out = out - ((out >> (spec.bits - 1)) & 1) * (1 << spec.bits)
    if spec.offset:
        out = out + spec.offset
    return out


def _times(left: Tensor, right: Tensor) -> Tensor:
    """``left * right`` of two per-block arrays of different counts (one divides the other), with
    each value covering its share of the block: [B, a] x [B, b] -> [B, max(a, b)]."""
    a, b = left.shape[1], right.shape[1]
    rows = left.shape[0]
    if a == b:
        return left * right
    if a < b:
        return (left.view(rows, a, 1) * right.view(rows, a, b // a)).view(rows, b)
    return (left.view(rows, b, a // b) * right.view(rows, b, 1)).view(rows, a)


def _factor(blocks: Tensor, compiled: CompiledLayout, name: str) -> Tensor:
    field = compiled.layout.field(name)
    if field is not None:
        return float_field_values(blocks, field)
    native = native_decoder() if name in compiled.native and blocks.is_contiguous() else None
    if native is not None:  # the integer's values through the C loop, times a scale of 1 (exact)
        slots, values = compiled.native[name]
        count = slots.shape[2]
        out = torch.empty((blocks.shape[0], count), dtype=torch.float32)
        ones = torch.ones(blocks.shape[0], 1)
        native.decode(
            blocks.data_ptr(), out.data_ptr(), ones.data_ptr(), 0, slots.data_ptr(), values.data_ptr(),
            blocks.shape[0], compiled.layout.bytes, count, slots.shape[0], 1, 0, -1,
        )  # fmt: skip
        return out
    return _integer(blocks, compiled.integers[name], compiled.layout).to(torch.float32)


def _product(blocks: Tensor, compiled: CompiledLayout, names: tuple[str, ...]) -> Tensor:
    value = _factor(blocks, compiled, names[0])
    for name in names[1:]:
        value = _times(value, _factor(blocks, compiled, name))
    return value


ISA_CHOICES: tuple[str, ...] = ("scalar", "avx2", "avx512")
"""The C loop's vector widths (``QSCHEME_BLOCKS_ISA`` chooses one, at most what the CPU runs)."""
_EXTENSION = IsaExtension("qscheme._blocks", ISA_CHOICES, "QSCHEME_BLOCKS_ISA", "blocks")


def native_decoder() -> Any:
    """The C loop (``qscheme._blocks``), or None where it was not built or is switched off
    (``QSCHEME_BLOCKS_TORCH=1``: the torch decoder, bit-identical, slower). Its vector loops are
    the widest the CPU runs (AVX-512, AVX2, else scalar) unless ``QSCHEME_BLOCKS_ISA`` names
    narrower ones; every width gives the same bits."""
    if env_flag("QSCHEME_BLOCKS_TORCH"):
        return None
    return _EXTENSION.native()


def empty_output(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """A new CPU tensor for a decoder to fill, advised onto huge pages when large (see
    ``qscheme.huge_pages``: a 64 MB output then takes a few dozen page faults, not 16,000)."""
    return empty_huge(shape, dtype)


def _decode_native(native: Any, blocks: Tensor, compiled: CompiledLayout, out: Tensor, fresh: bool) -> None:
    layout = compiled.layout
    assert compiled.native_slots is not None and compiled.native_table is not None
    scale = _product(blocks, compiled, layout.scale).contiguous()
    minimum = _product(blocks, compiled, layout.minimum).contiguous() if layout.minimum else None
    assert layout.element is not None
    spec = compiled.integers[layout.element.integer].spec
    if len(spec.planes) == 1 and spec.planes[0].bits in (1, 2, 4, 8):  # one bit plane: the tabulated loop
        plane = spec.planes[0]
        field = layout.field(plane.field)
        assert field is not None
        native.decode_plane(
            blocks.data_ptr(), out.data_ptr(), scale.data_ptr(), 0 if minimum is None else minimum.data_ptr(),
            compiled.native_table.data_ptr(), blocks.shape[0], layout.bytes, layout.elements,
            field.offset + plane.first_byte, plane.bits,
            layout.elements if plane.bits == 8 else plane.run,  # one code per byte: one run of them
            scale.shape[1],
            0 if minimum is None else minimum.shape[1], 1 if layout.minimum_sign == "add" else -1, fresh,
        )  # fmt: skip
        return
    native.decode(
        blocks.data_ptr(),
        out.data_ptr(),
        scale.data_ptr(),
        0 if minimum is None else minimum.data_ptr(),
        compiled.native_slots.data_ptr(),
        compiled.native_table.data_ptr(),
        blocks.shape[0],
        layout.bytes,
        layout.elements,
        compiled.native_slots.shape[0],
        scale.shape[1],
        0 if minimum is None else minimum.shape[1],
        1 if layout.minimum_sign == "add" else -1,
        fresh,
    )


def decode_blocks(raw: Tensor, layout: BlockLayout, out: Tensor | None = None, *, fresh: bool = False) -> Tensor:
    """float32 [rows, K] of uint8 [rows, K / elements * bytes] raw blocks, bit-exact; written into
    ``out`` (a contiguous float32 [rows, K] tensor on the same device) when given. ``fresh``: ``out``
    was just allocated and is not yet written (a hint for the C loop's stores; same bits)."""
    if raw.dtype != torch.uint8 or raw.ndim != 2 or raw.shape[1] % layout.bytes:
        raise QuantizeError(
            f"packed blocks must be uint8 [rows, a multiple of {layout.bytes}] bytes, got {raw.dtype} "
            f"{list(raw.shape)}; pass whole blocks"
        )
    rows = raw.shape[0]
    k = raw.shape[1] // layout.bytes * layout.elements
    if out is not None and (out.shape != (rows, k) or out.dtype != torch.float32 or not out.is_contiguous()):
        raise QuantizeError(
            f"out= must be a contiguous float32 [{rows}, {k}] tensor, got {out.dtype} {list(out.shape)}"
        )
    blocks = raw.contiguous().reshape(-1, layout.bytes)
    compiled = compile_layout(layout, raw.device)
    native = native_decoder() if compiled.native_slots is not None else None
    if native is not None:
        if out is None:
            out, fresh = empty_output((rows, k)), True
        _decode_native(native, blocks, compiled, out, fresh)
        return out
    decoded = _decode_torch(blocks, compiled).reshape(rows, -1)
    if out is None:
        return decoded
    out.copy_(decoded)
    return out


def _decode_torch(blocks: Tensor, compiled: CompiledLayout) -> Tensor:
    layout = compiled.layout
    value = _product(blocks, compiled, layout.scale)
    rule = layout.element
    if rule is not None:
        codes = _integer(blocks, compiled.integers[rule.integer], layout)
        if compiled.element_table is not None:
            element = compiled.element_table.index_select(0, codes.reshape(-1).to(torch.int64)).view(codes.shape)
        else:
            element = codes.to(torch.float32)
        value = _times(value, element)
    if layout.minimum:
        minimum = _product(blocks, compiled, layout.minimum)
        counts = value.shape[1]
        if minimum.shape[1] != counts:
            minimum = minimum.repeat_interleave(counts // minimum.shape[1], dim=1)
        value = value - minimum if layout.minimum_sign == "subtract" else value + minimum
    if value.shape[1] != layout.elements:
        value = value.repeat_interleave(layout.elements // value.shape[1], dim=1)
    return value


def _finer(value: Tensor, count: int) -> Tensor:
    """[B, c] per-block values repeated to [B, count] (count a multiple of c)."""
    return value if value.shape[1] == count else value.repeat_interleave(count // value.shape[1], dim=1)


def _affine_spec(layout: BlockLayout) -> IntegerSpec:
    kind = layout.code_kind
    if not kind.startswith("uint") or layout.element is None:
        raise QuantizeError(f"only affine unsigned codes split into scale and shift, not {kind!r} codes")
    spec = layout.integer(layout.element.integer)
    assert spec is not None
    return spec


def affine_codes(raw: Tensor, layout: BlockLayout) -> Tensor:
    """uint8 [rows, K]: the raw unsigned codes of an affine layout (before their offset)."""
    spec = _affine_spec(layout)
    compiled = compile_layout(layout, raw.device)
    plain = IntegerSpec(spec.name, spec.count, spec.bits, False, 0, spec.sources, spec.planes)
    blocks = raw.reshape(-1, layout.bytes)
    codes = _integer(blocks, _CompiledInteger(plain, compiled.integers[spec.name].slots), layout)
    return codes.to(torch.uint8).reshape(raw.shape[0], -1)


def affine_scales(raw: Tensor, layout: BlockLayout) -> tuple[Tensor, Tensor]:
    """(scale float32 [rows, G], shift float64 [rows, G]) of an affine layout, for G groups per row
    (the finest of the scale and minimum factors): see ``affine_parts``."""
    spec = _affine_spec(layout)
    blocks = raw.reshape(-1, layout.bytes)
    compiled = compile_layout(layout, raw.device)
    scale = _product(blocks, compiled, layout.scale)
    minimum = _product(blocks, compiled, layout.minimum) if layout.minimum else None
    groups = max(scale.shape[1], minimum.shape[1] if minimum is not None else 1)
    scale = _finer(scale, groups)
    shift = scale.to(torch.float64) * spec.offset
    if minimum is not None:
        term = _finer(minimum, groups).to(torch.float64)
        shift = shift - term if layout.minimum_sign == "subtract" else shift + term
    rows = raw.shape[0]
    return scale.reshape(rows, -1), shift.reshape(rows, -1)


def affine_parts(raw: Tensor, layout: BlockLayout) -> tuple[Tensor, Tensor, Tensor]:
    """The weights of an affine layout (``code_kind`` ``uint<b>``) as ``scale * code + shift``.

    Returns (codes uint8 [rows, K], the raw unsigned codes; scale float32 [rows, G]; shift float64
    [rows, G]) for G groups per row (the finest of the scale and minimum factors), where
    ``scale * code + shift`` equals, in exact arithmetic, the declared ``scale * (code + offset)
    -/+ minimum``. ``scale`` and the minimum are the float32 products ``decode_blocks`` forms;
    ``decode_blocks`` then rounds the weight itself (at most 2**-24 relative more). A kernel with
    its own scale-and-offset form (tinygemm's ``(u - 8) * s + zero``) starts from these
    (``affine_codes`` and ``affine_scales`` give either half alone).
    """
    return (affine_codes(raw, layout), *affine_scales(raw, layout))
