"""The parsed form of a scheme descriptor: frozen dataclasses, no behaviour beyond lookups.

See docs/schemes.md for the YAML each field comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from qscheme.descriptor.blocks import BlockLayout
from qscheme.descriptor.rules import DetectSpec
from qscheme.descriptor.shapes import Shape, evaluate_shape, format_shape
from qscheme.formats.table import FORMAT_FACTS, activation_formats, scale_formats

Stored = Literal["multiplier", "reciprocal"]
Granularity = Literal["tensor", "channel", "group", "block"]
ActivationGranularity = Literal["tensor", "token", "group"]
FusedPolicy = Literal["per_partition", "rescale", "requantize", "refuse"]

STORED_CHOICES: tuple[str, ...] = ("multiplier", "reciprocal")
GRANULARITIES: tuple[str, ...] = ("tensor", "channel", "group", "block")
ACTIVATION_GRANULARITIES: tuple[str, ...] = ("tensor", "token", "group")
WEIGHT_PACKINGS: tuple[str, ...] = ("none", "nibbles_k", "int32_k", "int32_n", "int4_n", "blocks")
BLOCKS = "blocks"
"""The weight format and family of a scheme whose weight is packed blocks (``packing: blocks``):
its elements, scales and minimums are declared by its ``BlockLayout``, not by ``format``."""
CODEBOOK = "codebook"
"""The weight family of a scheme whose codes index a declared table (``weight.table``)."""
ZERO_POINT_PACKINGS: tuple[str, ...] = ("none", "int32_n")
FUSED_POLICIES: tuple[str, ...] = ("per_partition", "rescale", "requantize", "refuse")
SCALE_FORMATS: tuple[str, ...] = scale_formats()
# Activation element formats: those with a kernel activation family (nvfp4/mxfp4/fp4, fp8, int8;
# see qscheme.kernels.declaration.ACTIVATION_FAMILIES). No kernel can declare int4 activations.
ACTIVATION_FORMATS: tuple[str, ...] = activation_formats()


@dataclass(frozen=True)
class TensorSpec:
    """A tensor stored in the checkpoint for each quantized linear: ``<module>.<name>``."""

    name: str
    dtypes: tuple[str, ...]
    shapes: tuple[Shape, ...]
    optional: bool = False
    transposed: bool = False
    """The file stores the tensor's transpose: a [K-major, N] layout (GPTQ, AWQ) for what is [N, K-major]
    in the canonical orientation. ``shapes`` are the stored shapes."""
    flat: bool = False
    """The file stores the tensor's elements in row-major order as one column, [P] or [P, 1] where P
    is the product of the declared shape (bitsandbytes' ``weight`` [N*K/2, 1] and ``weight.absmax``);
    ``shapes`` are the layout's shapes, which the loader restores with a reshape."""

    def layout_shapes(self, n: int, k: int) -> list[tuple[int, ...]]:
        """The declared shapes for an N x K layer, before any flattening (empty when N, K do not divide)."""
        out = []
        for shape in self.shapes:
            sizes = evaluate_shape(shape, n, k)
            if sizes is not None and sizes not in out:
                out.append(sizes)
        return out

    def expected_shapes(self, n: int, k: int) -> list[tuple[int, ...]]:
        """Every allowed stored shape for an N x K layer (empty when N, K do not divide)."""
        out = self.layout_shapes(n, k)
        if not self.flat:
            return out
        flat: list[tuple[int, ...]] = []
        for sizes in out:
            count = 1
            for size in sizes:
                count *= size
            flat.extend(form for form in ((count,), (count, 1)) if form not in flat)
        return flat

    def describe_shapes(self) -> str:
        if not self.shapes:
            return "[bytes] holding JSON"
        shown = " or ".join(format_shape(shape) for shape in self.shapes)
        return f"{shown} flattened to [P] or [P, 1]" if self.flat else shown


@dataclass(frozen=True)
class ScaleSpec:
    """The weight's (or a static activation's) scale: granularity, element format, convention."""

    granularity: Granularity
    format: str
    stored: Stored
    tensor: TensorSpec
    group_size: int | None = None
    block: tuple[int, int] | None = None
    group_index: TensorSpec | None = None
    """A per-input-channel group index ([K] integers: the group of each column of the weight,
    GPTQ's ``g_idx``); absent: column k is in group k // group_size."""
    signed: bool = False
    """The stored scales may be negative (AutoRound's symmetric scales carry the sign of each group's
    largest magnitude); otherwise a negative weight scale is refused as a corrupt file."""
    quantized: QuantizedScaleSpec | None = None
    """The scales are themselves stored quantized (bitsandbytes' double quantization): ``tensor``
    holds uint8 codes into ``quantized.table``, restored to float32 on load."""


@dataclass(frozen=True)
class QuantizedScaleSpec:
    """Scales stored as uint8 codes: scale j = ``table[code_j] * scale[j // group_size]`` in float32,
    then ``+ offset`` (a number of the layer's state, ``StateSpec.numbers``) in float32, j counting
    the scales in row-major order."""

    table: TensorSpec
    scale: TensorSpec
    group_size: int
    offset: str | None = None


@dataclass(frozen=True)
class StateSpec:
    """A uint8 tensor holding a UTF-8 JSON object of the layer's parameters (bitsandbytes'
    ``quant_state``): ``shape`` names the key holding [N, K], ``values`` the allowed values of other
    keys, ``numbers`` keys holding finite numbers (read by ``QuantizedScaleSpec.offset``). Every key
    named is required when ``required`` lists it, and no other key is allowed."""

    tensor: TensorSpec
    shape: str
    values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    numbers: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.shape, *self.values, *self.numbers)


@dataclass(frozen=True)
class GlobalScaleSpec:
    """A per-tensor second-level scale (one per fused partition), always a float."""

    stored: Stored
    tensor: TensorSpec


@dataclass(frozen=True)
class ZeroPointSpec:
    """Asymmetric zero points: one per scale, stored in ``format``, packed as ``packing``."""

    format: str
    packing: str
    tensor: TensorSpec
    pack_order: tuple[int, ...] | None = None
    offset: int = 0
    """The file holds zero_point + offset (GPTQ's v1 format stores the zero point minus one)."""
    equals: int | None = None
    """Every zero point must equal this value (after ``offset``): a symmetric scheme whose producer
    still stores zero points; they are checked on load, then dropped."""


@dataclass(frozen=True)
class WeightSpec:
    """The quantized weight: element format, packing and its scales.

    With ``packing: blocks``, ``blocks`` declares the block (elements, scales and minimums
    inside the weight tensor), ``format`` is ``"blocks"`` and ``scale`` describes the finest
    scale the blocks hold (a float32 group scale of the sub-block size) with the weight tensor
    as its tensor: no tensor of its own is stored (``Scheme.tensor_specs`` leaves it out)."""

    format: str
    packing: str
    tensor: TensorSpec
    scale: ScaleSpec
    global_scale: GlobalScaleSpec | None = None
    zero_point: ZeroPointSpec | None = None
    shape_tensor: TensorSpec | None = None
    blocks: BlockLayout | None = None
    symmetric_zero_point: ZeroPointSpec | None = None
    """Zero points a symmetric scheme's producer still stores (``zero_point: {..., equals: V}``):
    every one must equal V (after its ``offset``); checked on load, then dropped, so the weight is
    symmetric for kernels (``zero_point`` is None)."""
    pack_order: tuple[int, ...] | None = None
    """For int32 packings: the element each slot of a word holds (slot i holds element
    ``pack_order[i]`` of the word's run; AWQ: 0, 2, 4, 6, 1, 3, 5, 7). Absent: slot i holds element i.
    For ``nibbles_k``: ``(1, 0)`` puts element 2j in the high nibble (bitsandbytes)."""
    table: tuple[float, ...] | None = None
    """A codebook: the weight's unsigned codes index these float32 values (NF4's 16 quantiles)
    instead of standing for themselves; the weight family is then ``codebook``."""
    table_tensor: TensorSpec | None = None
    """A stored copy of ``table`` (bitsandbytes' ``weight.quant_map``): it must equal the table bit for
    bit, checked on load (a file whose copy differs means two things)."""
    state: StateSpec | None = None
    """A JSON state tensor holding the layer's [N, K] and other parameters (see ``StateSpec``)."""


@dataclass(frozen=True)
class ActivationSpec:
    """How the layer's input is quantized (absent for 16-bit activations)."""

    format: str
    granularity: ActivationGranularity
    dynamic: bool
    scale_format: str
    group_size: int | None = None
    scale: ScaleSpec | None = None
    global_scale: GlobalScaleSpec | None = None


@dataclass(frozen=True)
class FusedSpec:
    """What to do with per-partition scales when several checkpoint modules form one layer."""

    policy: FusedPolicy = "per_partition"
    fallback: FusedPolicy = "refuse"


@dataclass(frozen=True)
class Scheme:
    """A complete, validated quantization scheme."""

    name: str
    producer: str | None
    description: str
    rules: str
    weight: WeightSpec
    activation: ActivationSpec | None
    input_pre_scale: TensorSpec | None
    tolerated: tuple[str, ...]
    fused: FusedSpec
    detect: DetectSpec
    source: str = "file"
    path: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def weight_family(self) -> str:
        """nvfp4, mxfp4, fp8, int4, int8, blocks or the element format's name."""
        if self.weight.blocks is not None:
            return BLOCKS
        if self.weight.table is not None:
            return CODEBOOK
        return weight_family(self.weight.format, self.weight.scale.format)

    @property
    def activation_family(self) -> str:
        """none for 16-bit activations; else nvfp4, mxfp4, fp8, int8, ..."""
        if self.activation is None:
            return "none"
        return weight_family(self.activation.format, self.activation.scale_format)

    @property
    def group_size(self) -> int | None:
        return self.weight.scale.group_size

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every declared tensor keyed by its role (weight, weight_scale, ...)."""
        weight = self.weight
        roles: dict[str, TensorSpec | None] = {
            "weight": weight.tensor,
            "weight_scale": None if weight.blocks is not None else weight.scale.tensor,
            "weight_global_scale": weight.global_scale.tensor if weight.global_scale else None,
            "weight_zero_point": weight.zero_point.tensor if weight.zero_point else None,
            "weight_symmetric_zero_point": weight.symmetric_zero_point.tensor if weight.symmetric_zero_point else None,
            "weight_shape": weight.shape_tensor,
            "weight_state": weight.state.tensor if weight.state else None,
            "weight_table": weight.table_tensor,
            "weight_scale_table": weight.scale.quantized.table if weight.scale.quantized else None,
            "weight_scale_scale": weight.scale.quantized.scale if weight.scale.quantized else None,
            "weight_group_index": None if weight.blocks is not None else weight.scale.group_index,
            "input_pre_scale": self.input_pre_scale,
        }
        if self.activation is not None:
            act = self.activation
            roles["input_scale"] = act.scale.tensor if act.scale else None
            roles["input_global_scale"] = act.global_scale.tensor if act.global_scale else None
        return {role: spec for role, spec in roles.items() if spec is not None}

    def stored_convention(self, role: str) -> Stored | None:
        """multiplier / reciprocal for a scale role, None for non-scale roles."""
        weight, act = self.weight, self.activation
        table: dict[str, Stored | None] = {
            "weight_scale": None if weight.blocks is not None else weight.scale.stored,
            "weight_global_scale": weight.global_scale.stored if weight.global_scale else None,
        }
        if act is not None:
            table["input_scale"] = act.scale.stored if act.scale else None
            table["input_global_scale"] = act.global_scale.stored if act.global_scale else None
        return table.get(role)


_FAMILY_BY_PAIR: dict[tuple[str, str], str] = {
    ("e2m1", "e4m3"): "nvfp4",
    ("e2m1", "e8m0"): "mxfp4",
}
_FAMILY_BY_ELEMENT: dict[str, str] = {
    name: facts.family for name, facts in FORMAT_FACTS.items() if facts.family is not None
}


def weight_family(element_format: str, scale_format: str) -> str:
    """The format family of an element format with its scale format."""
    pair = _FAMILY_BY_PAIR.get((element_format, scale_format))
    if pair is not None:
        return pair
    return _FAMILY_BY_ELEMENT.get(element_format, element_format)
