"""GGUF blocks <-> a group-scaled scheme's tensors, where the two store the same codes.

A block scheme (``packing: blocks``) shares its codes with a group-scaled scheme when its block
declaration reads as ``weight = scale * element(q)`` with one float field as the scale of each
group and nothing else: no minimum, no codebook, no inner integer scales. That is decided from the
declarations alone (``block_codes``), then compared with the target field by field
(``code_differences``), as ``convert_math`` compares two group-scaled schemes:

- the element: an e2m1 field is e2m1; a signed b-bit integer is int<b>; an unsigned one with the
  offset ``-2**(b-1)`` (llama.cpp's ``q - 8``) is int<b> too, its value ``q + offset``;
- the group: the weights under one scale value (Q4_0, Q8_0, MXFP4: 32; NVFP4: 16);
- the scale format: fp16/bf16/fp32 fields are ``float``, e8m0 is e8m0, and ggml's unsigned e4m3
  (``ue4m3``: bias 7, the top bit ignored, 0x7F read as 0) is e4m3: the same value's byte is
  ``b & 0x7F`` (0x7F becomes 0x00, the zero it decodes to);
- a target global scale is written as 1.0 (the block scale alone is the scale); a target with
  zero points or static activation scales shares nothing with a block.

The integers are unpacked and packed from the declaration's pieces (``IntegerSpec.sources``), so
the same code serves every plane order a descriptor declares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.descriptor.blocks import BlockField, BlockLayout, IntegerSpec
from qscheme.errors import QuantizeError
from qscheme.formats.blocks import float_field_values

__all__ = [
    "BlockCodes",
    "block_codes",
    "code_differences",
    "pack_block_integers",
    "unpack_block_integers",
]

_FLOAT_FIELDS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# a block scale field's format -> the scale format a group-scaled descriptor declares for it
_SCALE_FORMATS = {"fp16": "float", "bf16": "float", "fp32": "float", "e8m0": "e8m0", "ue4m3": "e4m3"}


@dataclass(frozen=True)
class BlockCodes:
    """A block layout read as ``scale * element(q)`` per group (see the module docstring)."""

    layout: BlockLayout
    integer: IntegerSpec
    scale_field: BlockField
    element: str  # the element format of the codes: e2m1, int4, int8
    group_size: int
    scale_format: str  # float, e8m0 or e4m3

    @property
    def groups_per_block(self) -> int:
        return self.scale_field.count


def block_codes(scheme: Scheme) -> BlockCodes | str:
    """``scheme``'s blocks as codes and one scale per group, or why they are not (a sentence)."""
    layout = scheme.weight.blocks
    if layout is None:
        return f"{scheme.name} is not a scheme of packed blocks"
    rule = layout.element
    if rule is None:
        return f"{scheme.name} stores plain floats, not codes"
    if rule.table is not None:
        return f"{scheme.name} decodes its codes through a lookup table"
    if layout.minimum:
        return f"{scheme.name} subtracts or adds a minimum (affine codes with a per-block offset)"
    if len(layout.scale) != 1 or layout.field(layout.scale[0]) is None:
        return f"{scheme.name} multiplies its scale from several factors ({' * '.join(layout.scale)})"
    field = layout.field(layout.scale[0])
    assert field is not None
    integer = layout.integer(rule.integer)
    assert integer is not None
    if field.format not in _SCALE_FORMATS or layout.elements % field.count:
        return f"{scheme.name}'s scale field {field.name!r} is {field.format}, which no group-scaled scheme stores"
    if rule.format is not None:
        if integer.signed or integer.offset:
            return f"{scheme.name}'s {rule.format} codes are offset"
        element = rule.format
    elif integer.signed and integer.offset == 0:
        element = f"int{integer.bits}"
    elif not integer.signed and integer.offset == -(1 << (integer.bits - 1)):
        element = f"int{integer.bits}"
    else:
        return f"{scheme.name}'s codes are unsigned with offset {integer.offset} (not a symmetric int{integer.bits})"
    return BlockCodes(layout, integer, field, element, layout.elements // field.count, _SCALE_FORMATS[field.format])


def code_differences(codes: BlockCodes, target: Scheme) -> list[str]:
    """What differs between the blocks' codes and ``target``'s (empty: they share the codes),
    each as "what: block value -> target value"."""
    out: list[str] = []
    weight = target.weight
    scale = weight.scale

    def differ(what: str, source: object, wanted: object) -> None:
        if source != wanted:
            out.append(f"{what}: {source} -> {wanted}")

    if weight.blocks is not None:
        out.append("weight packing: codes and group scales -> packed blocks of another layout")
        return out
    differ("weight element format", codes.element, weight.format)
    differ("weight scale granularity", "group", scale.granularity if scale else None)
    differ("weight group size", codes.group_size, scale.group_size if scale else None)
    differ("weight scale format", codes.scale_format, scale.format if scale else None)
    if scale is not None and scale.stored != "multiplier":
        out.append(f"weight scale convention: multiplier -> {scale.stored}")
    if weight.zero_point is not None:
        out.append(f"weight zero points: none -> {weight.zero_point.format}")
    return out


# --- the integers, by the declaration's pieces -------------------------------------------------


def _pieces(layout: BlockLayout, spec: IntegerSpec) -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """Per piece slot: (absolute byte in the block, shift in that byte, width, destination bit), one
    entry per value (a value with fewer pieces has width 0 in the slots it lacks)."""
    offsets = {field.name: field.offset for field in layout.fields}
    depth = max(len(pieces) for pieces in spec.sources)
    slots = []
    for slot in range(depth):
        index, shift, width, destination = [], [], [], []
        for pieces in spec.sources:
            done = sum(piece[3] for piece in pieces[:slot])
            if slot < len(pieces):
                field, byte, bit, size = pieces[slot]
                index.append(offsets[field] + byte)
                shift.append(bit)
                width.append(size)
            else:
                index.append(0)
                shift.append(0)
                width.append(0)
            destination.append(done)
        slots.append((index, shift, width, destination))
    return slots


def unpack_block_integers(raw: Tensor, layout: BlockLayout, spec: IntegerSpec) -> Tensor:
    """The raw unsigned bits of integer ``spec`` of every block: int32 [rows, K] (no sign, no offset)."""
    blocks = raw.reshape(-1, layout.bytes).to(torch.int32)
    value = torch.zeros((blocks.shape[0], spec.count), dtype=torch.int32)
    for index, shift, width, destination in _pieces(layout, spec):
        picked = blocks[:, torch.tensor(index, dtype=torch.int64)]
        mask = (1 << torch.tensor(width, dtype=torch.int32)) - 1
        value |= ((picked >> torch.tensor(shift, dtype=torch.int32)) & mask) << torch.tensor(
            destination, dtype=torch.int32
        )
    return value.reshape(raw.shape[0], -1)


def pack_block_integers(values: Tensor, blocks: Tensor, layout: BlockLayout, spec: IntegerSpec) -> None:
    """Write the raw unsigned bits ``values`` (int [B, count], each below 2**bits) into ``blocks``
    (uint8 [B, bytes], its integer bytes zero), the inverse of ``unpack_block_integers``."""
    wide = torch.zeros(blocks.shape, dtype=torch.int32)
    values = values.to(torch.int32)
    for index, shift, width, destination in _pieces(layout, spec):
        mask = (1 << torch.tensor(width, dtype=torch.int32)) - 1
        bits = ((values >> torch.tensor(destination, dtype=torch.int32)) & mask) << torch.tensor(
            shift, dtype=torch.int32
        )
        wide.index_add_(1, torch.tensor(index, dtype=torch.int64), bits)
    if int(wide.max()) > 255 if wide.numel() else False:
        raise QuantizeError("packing block integers: two values overlap in one byte; the declaration is inconsistent")
    blocks |= wide.to(torch.uint8)


# --- codes and scales out of blocks, and back -------------------------------------------------


def element_codes(raw: Tensor, codes: BlockCodes) -> Tensor:
    """The codes of every weight: uint8 e2m1 codes (0..15), or the int8 values of int<b> codes."""
    bits = unpack_block_integers(raw, codes.layout, codes.integer)
    spec = codes.integer
    if codes.element == "e2m1":
        return bits.to(torch.uint8)
    if spec.signed:
        bits = torch.where(bits >= 1 << (spec.bits - 1), bits - (1 << spec.bits), bits)
    return (bits + spec.offset).to(torch.int8)


def scale_values(raw: Tensor, codes: BlockCodes) -> Tensor:
    """The scale of every group as the field stores it: its float dtype (fp16/bf16/fp32), the
    e8m0 exponent byte (uint8), or the e4m3 byte of a ue4m3 value (uint8): [rows, K / group]."""
    field = codes.scale_field
    blocks = raw.reshape(-1, codes.layout.bytes)
    stored = blocks[:, field.offset : field.offset + field.size].contiguous()
    if field.format in _FLOAT_FIELDS:
        value = stored.view(_FLOAT_FIELDS[field.format])
    elif field.format == "ue4m3":
        value = stored & 0x7F
        value = torch.where(value == 0x7F, torch.zeros_like(value), value)
    else:
        value = stored
    return value.reshape(raw.shape[0], -1)


def scale_floats(raw: Tensor, codes: BlockCodes) -> Tensor:
    """The scales as float32 values, as the block decoder reads them: [rows, K / group]."""
    blocks = raw.reshape(-1, codes.layout.bytes)
    return float_field_values(blocks, codes.scale_field).reshape(raw.shape[0], -1)


def encode_blocks(elements: Tensor, scales: Tensor, codes: BlockCodes) -> Tensor:
    """Raw blocks uint8 [rows, K / elements * bytes] holding ``elements`` (as ``element_codes``
    gives them) and ``scales`` (as ``scale_values`` gives them): their inverse."""
    layout, spec, field = codes.layout, codes.integer, codes.scale_field
    rows = elements.shape[0]
    values = elements.to(torch.int32)
    if codes.element != "e2m1":
        values = values - spec.offset
        if spec.signed:
            values = values & ((1 << spec.bits) - 1)
    blocks = torch.zeros((elements.numel() // layout.elements, layout.bytes), dtype=torch.uint8)
    pack_block_integers(values.reshape(-1, spec.count), blocks, layout, spec)
    stored = scales.contiguous().reshape(blocks.shape[0], -1).view(torch.uint8)
    blocks[:, field.offset : field.offset + field.size] = stored
    return blocks.reshape(rows, -1)
