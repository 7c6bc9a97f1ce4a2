"""YAML descriptor -> Scheme, collecting every problem with its file:line:column and key path."""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from qscheme.descriptor.blocks_parse import read_blocks
from qscheme.descriptor.consistency import (
    FOUR_BIT,
    SINGLE,
    Form,
    describe,
    scale_forms,
    scale_layout,
    transposed_forms,
    weight_forms,
    weight_layout,
    zero_point_forms,
)
from qscheme.descriptor.files import read_descriptor_text
from qscheme.descriptor.model import (
    ACTIVATION_FORMATS,
    ACTIVATION_GRANULARITIES,
    BLOCKS,
    FUSED_POLICIES,
    GRANULARITIES,
    SCALE_FORMATS,
    STORED_CHOICES,
    WEIGHT_PACKINGS,
    ZERO_POINT_PACKINGS,
    ActivationSpec,
    FusedSpec,
    GlobalScaleSpec,
    QuantizedScaleSpec,
    ScaleSpec,
    Scheme,
    StateSpec,
    TensorSpec,
    WeightSpec,
    ZeroPointSpec,
)
from qscheme.descriptor.nodes import INVALID, Node, read_yaml
from qscheme.descriptor.rules import DetectSpec, RuleKey, RuleSchema, rule_producers, rule_schemas
from qscheme.descriptor.shapes import MAX_SIZE, Shape, format_shape, parse_shape
from qscheme.errors import Location, Problem, SchemeError, UsageError
from qscheme.formats.table import FORMAT_FACTS, integer_formats, is_float_scale, scale_dtypes, weight_formats

T = TypeVar("T")

DTYPES: tuple[str, ...] = (
    "uint8",
    "int8",
    "int32",
    "int64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float16",
    "bfloat16",
    "float32",
)
ELEMENT_FORMATS: tuple[str, ...] = weight_formats()
# The values each integer format holds: a weight's zero points range over its own format's.
INTEGER_RANGE: dict[str, tuple[int, int]] = {
    name: (int(FORMAT_FACTS[name].min_value), int(FORMAT_FACTS[name].max_value)) for name in integer_formats()
}
INTEGER: frozenset[str] = frozenset(INTEGER_RANGE)
# Scale formats whose reciprocal is not, in general, a value of the format (a reciprocal e4m3
# scale cannot be stored exactly, and an e8m0 byte holds a power of two only as a multiplier).
NO_RECIPROCAL: frozenset[str] = frozenset(name for name in SCALE_FORMATS if not is_float_scale(name))
# A scale key that only one granularity takes: (that granularity, the message when it is missing).
_GRANULARITY_KEYS: dict[str, tuple[str, str]] = {
    "group_size": ("group", "granularity 'group' needs group_size >= 1 (e.g. group_size: 16)"),
    "block": ("block", "granularity 'block' needs block: [rows, columns] (e.g. block: [128, 128])"),
}
# The dtype a weight tensor has for each packing (None: the element format's own storage dtype).
# Zero points are integers: packed into int32 words along N, or one per stored value in any
# integer dtype (values outside the format's range are refused on load).
INTEGER_DTYPES: tuple[str, ...] = ("int8", "uint8", "int32", "int64")
ZERO_POINT_DTYPES: dict[str, tuple[str, ...]] = {"int32_n": ("int32",), "none": INTEGER_DTYPES}
PACKED_DTYPE: dict[str, str | None] = {
    "none": None,
    "nibbles_k": "uint8",
    "int32_k": "int32",
    "int32_n": "int32",
    "int4_n": "uint8",
}
INT32_PACKINGS: frozenset[str] = frozenset({"int32_k", "int32_n"})
# e2m1 codes have no unpacked dtype of their own (4-bit floats are always packed).
UNPACKED_DTYPE: dict[str, str] = {
    name: FORMAT_FACTS[name].storage_dtype
    for name in ELEMENT_FORMATS
    if FORMAT_FACTS[name].kind == "int" or FORMAT_FACTS[name].bits == 8
}
SCALE_DTYPES: dict[str, tuple[str, ...]] = {name: scale_dtypes(name) for name in SCALE_FORMATS}
NAME = re.compile(r"^[A-Za-z0-9._/-]+$")
"""The characters a scheme name may use; no segment between '/' may be empty, '.' or '..'."""


def _quote(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(repr(value) for value in values)


def _absent(node: Node | None) -> bool:
    """Whether an optional key counts as not given: omitted, ``null`` or ``none``."""
    return node is None or node.value is None or node.value == "none"


def _shown(node: Node) -> str:
    """An absent-meaning value as it was written: ``null`` or ``'none'``."""
    return "null" if node.value is None else repr(node.value)


class _Reader:
    """Reads located nodes into values, recording a Problem for each bad one."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []

    def fail(self, node: Node | None, path: str, message: str) -> None:
        if node is not None and node.value is INVALID:
            return  # its tag was already reported
        path = path or "<top>"
        if node is None:
            location = Location(self.file, None, None, path)
        else:
            location = Location(self.file, node.line, node.column, path)
        self.problems.append(Problem(location, message))

    def fail_key(self, mapping: Node, key: str, path: str, message: str) -> None:
        """A problem with the key itself (not its value): located at the key."""
        line, column = mapping.keys.get(key, (mapping.line, mapping.column))
        self.problems.append(Problem(Location(self.file, line, column, path or "<top>"), message))

    def needs(self, node: Node, items: dict[str, Node], key: str, path: str, message: str) -> None:
        """Report ``key`` as required by another value: at the mapping when omitted, else at its value."""
        child = items.get(key)
        if child is None:
            self.fail(node, path, message)
        else:
            self.fail(child, f"{path}.{key}", f"{message}; {_shown(child)} means absent")

    def mapping(
        self, node: Node, path: str, required: tuple[str, ...], optional: tuple[str, ...]
    ) -> dict[str, Node] | None:
        if not node.is_mapping:
            self.fail(node, path, f"{node.plain()!r} is not a mapping; expected keys {_quote(required + optional)}")
            return None
        items: dict[str, Node] = node.value
        allowed = required + optional
        for key in items:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.fail_key(
                    node,
                    key,
                    f"{path}.{key}" if path else key,
                    f"unknown key {key!r}; allowed keys are {_quote(allowed)}{hint}",
                )
        for key in required:
            if key not in items:
                self.fail(node, path or "<top>", f"missing required key {key!r}")
        return items

    def string(self, node: Node, path: str) -> str | None:
        if not isinstance(node.value, str) or not node.value.strip():
            self.fail(node, path, f"{node.plain()!r} is not a non-empty string")
            return None
        return node.value

    def choice(self, node: Node, path: str, allowed: tuple[str, ...]) -> str | None:
        value = node.value
        if not isinstance(value, str) or value not in allowed:
            self.fail(node, path, f"{node.plain()!r} is not one of {_quote(allowed)}")
            return None
        return value

    def integer(self, node: Node, path: str, minimum: int = 1, maximum: int = MAX_SIZE) -> int | None:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(node, path, f"{node.plain()!r} is not an integer >= {minimum}")
            return None
        if value > maximum:
            shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}... ({len(str(value))} digits)"
            self.fail(node, path, f"{shown} is too large; use an integer from {minimum} to {maximum}")
            return None
        return value

    def boolean(self, node: Node, path: str) -> bool | None:
        if not isinstance(node.value, bool):
            self.fail(node, path, f"{node.plain()!r} is not one of true, false")
            return None
        return bool(node.value)

    def strings(self, node: Node, path: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...] | None:
        """A string or a list of strings."""
        items = node.value if node.is_sequence else [node]
        out: list[str] = []
        for index, item in enumerate(items):
            item_path = f"{path}[{index}]" if node.is_sequence else path
            value = self.choice(item, item_path, allowed) if allowed else self.string(item, item_path)
            if value is None:
                return None
            out.append(value)
        if not out:
            self.fail(node, path, "the list is empty; give at least one value")
            return None
        return tuple(out)

    def optional(self, items: dict[str, Node], key: str, path: str, read: Callable[[Node, str], T]) -> T | None:
        """The value of an optional key; None when it is not given (omitted, null or none: see ``_absent``).

        None is also returned for a given but bad value (then a problem is recorded): code that
        must know whether the key was given tests ``_absent(items.get(key))``, never ``key in items``.
        """
        node = items.get(key)
        if _absent(node):
            return None
        assert node is not None
        return read(node, f"{path}.{key}" if path else key)

    def required(self, items: dict[str, Node], key: str, path: str, read: Callable[[Node, str], T]) -> T | None:
        node = items.get(key)
        if node is None:
            return None  # already reported as missing
        return read(node, f"{path}.{key}" if path else key)

    # --- sections -----------------------------------------------------------------------

    def shape(self, node: Node, path: str) -> Shape | None:
        if not node.is_sequence:
            self.fail(node, path, f"{node.plain()!r} is not a list of dimensions such as [N, K/16]")
            return None
        dims = []
        for index, item in enumerate(node.value):
            try:
                dims.append(parse_shape([item.plain()])[0])
            except ValueError as exc:
                self.fail(item, f"{path}[{index}]", str(exc))
                return None
        return tuple(dims)

    def shapes(self, node: Node, path: str) -> tuple[Shape, ...] | None:
        if node.is_mapping:
            items = self.mapping(node, path, ("any_of",), ())
            if items is None or "any_of" not in items:
                return None
            alternatives = items["any_of"]
            if not alternatives.is_sequence or not alternatives.value:
                self.fail(alternatives, f"{path}.any_of", "give a non-empty list of shapes, e.g. [[N, 1], [1]]")
                return None
            out = [self.shape(item, f"{path}.any_of[{i}]") for i, item in enumerate(alternatives.value)]
            return None if any(shape is None for shape in out) else tuple(s for s in out if s is not None)
        shape = self.shape(node, path)
        return None if shape is None else (shape,)

    def tensor(self, node: Node, path: str) -> TensorSpec | None:
        items = self.mapping(node, path, ("name", "dtype", "shape"), ("optional", "transposed", "flat"))
        if items is None:
            return None
        name = self.required(items, "name", path, self.string)
        dtypes = self.required(items, "dtype", path, lambda n, p: self.strings(n, p, DTYPES))
        shapes = self.required(items, "shape", path, self.shapes)
        optional = self.optional(items, "optional", path, self.boolean)
        transposed = self.optional(items, "transposed", path, self.boolean)
        flat = self.optional(items, "flat", path, self.boolean)
        if transposed and shapes is not None and any(len(shape) != 2 for shape in shapes):
            self.fail(items["transposed"], f"{path}.transposed", "only a 2-D tensor can be stored transposed")
        if transposed and flat:
            self.fail(items["flat"], f"{path}.flat", "a flat tensor has no orientation: drop transposed or flat")
        if name is None or dtypes is None or shapes is None:
            return None
        return TensorSpec(
            name=name,
            dtypes=dtypes,
            shapes=shapes,
            optional=bool(optional),
            transposed=bool(transposed),
            flat=bool(flat),
        )

    def state(self, node: Node, path: str) -> StateSpec | None:
        """``weight.state``: a uint8 tensor of JSON, the key of [N, K], allowed values and numbers."""
        items = self.mapping(node, path, ("name", "shape_key"), ("values", "numbers"))
        if items is None:
            return None
        name = self.required(items, "name", path, self.string)
        shape_key = self.required(items, "shape_key", path, self.string)
        values: dict[str, tuple[Any, ...]] = {}
        values_node = items.get("values")
        if values_node is not None and not _absent(values_node):
            if not values_node.is_mapping:
                self.fail(values_node, f"{path}.values", "expected a mapping of keys to lists of allowed values")
            else:
                for key, allowed in values_node.value.items():
                    plain = allowed.plain()
                    if (
                        not isinstance(plain, list)
                        or not plain
                        or not all(isinstance(v, str | int) and not isinstance(v, bool) for v in plain)
                    ):
                        self.fail(allowed, f"{path}.values.{key}", "expected a non-empty list of strings or integers")
                        continue
                    values[str(key)] = tuple(plain)
        numbers = self.optional(items, "numbers", path, self.strings) or ()
        if name is None or shape_key is None:
            return None
        tensor = TensorSpec(name=name, dtypes=("uint8",), shapes=())
        return StateSpec(tensor=tensor, shape=shape_key, values=values, numbers=tuple(numbers))

    def quantized_scale(self, node: Node, path: str) -> QuantizedScaleSpec | None:
        """``weight.scale.quantized``: scales stored as uint8 codes into a table, with scales of their own."""
        items = self.mapping(node, path, ("table", "scale", "group_size"), ("offset",))
        if items is None:
            return None
        table = self.required(items, "table", path, self.tensor)
        scale = self.required(items, "scale", path, self.tensor)
        group_size = self.required(items, "group_size", path, self.integer)
        offset = self.optional(items, "offset", path, self.string)
        if table is not None:
            self.check_dtypes(items["table"], path + ".table", table, ("float32",), "a table of float32 scale values")
        if scale is not None:
            self.check_dtypes(items["scale"], path + ".scale", scale, ("float32",), "float32 scales of the scales")
        if table is None or scale is None or group_size is None:
            return None
        return QuantizedScaleSpec(table=table, scale=scale, group_size=group_size, offset=offset)

    def check_dtypes(self, node: Node, path: str, spec: TensorSpec, allowed: tuple[str, ...], why: str) -> None:
        bad = [dtype for dtype in spec.dtypes if dtype not in allowed]
        if bad:
            where = node.value.get("tensor", node) if node.is_mapping else node
            self.fail(where, f"{path}.tensor.dtype", f"{bad[0]!r} does not fit {why}; use {_quote(allowed)}")

    def check_shapes(
        self, node: Node, path: str, spec: TensorSpec, forms: tuple[Form, ...], why: str, single_block: bool = False
    ) -> None:
        """Every declared shape of ``node``'s tensor must be one of ``forms`` (what ``why`` implies).

        ``single_block``: a block scale may also list ``[]``/``[1]`` next to a full form, for a
        weight that is one block (as modelopt/fp8_pb_wo does).
        """
        if not forms:
            return
        if spec.transposed:
            forms, why = transposed_forms(forms), f"{why}, stored transposed"
        declared = _shape_nodes(node, f"{path}.tensor.shape")
        if len(declared) != len(spec.shapes):
            return  # the tensor section had problems of its own
        full = [any(form.admits(shape) for form in forms) for shape in spec.shapes]
        for shape, admitted, (shape_node, shape_path) in zip(spec.shapes, full, declared, strict=True):
            if admitted:
                continue
            if single_block and any(full) and any(form.admits(shape) for form in SINGLE):
                continue
            self.fail(shape_node, shape_path, f"{format_shape(shape)} does not fit {why}; declare {describe(forms)}")

    def scale(self, node: Node, path: str) -> ScaleSpec | None:
        items = self.mapping(
            node,
            path,
            ("granularity", "format", "stored", "tensor"),
            ("group_size", "block", "group_index", "signed", "quantized"),
        )
        if items is None:
            return None
        granularity = self.required(items, "granularity", path, lambda n, p: self.choice(n, p, GRANULARITIES))
        scale_format = self.required(items, "format", path, lambda n, p: self.choice(n, p, SCALE_FORMATS))
        stored = self.required(items, "stored", path, lambda n, p: self.choice(n, p, STORED_CHOICES))
        tensor = self.required(items, "tensor", path, self.tensor)
        group_size = self.optional(items, "group_size", path, self.integer)
        block = self.optional(items, "block", path, self.block)
        group_index = self.optional(items, "group_index", path, self.tensor)
        signed = self.optional(items, "signed", path, self.boolean)
        quantized = self.optional(items, "quantized", path, self.quantized_scale)
        if group_index is not None:
            self.check_group_index(items["group_index"], f"{path}.group_index", group_index, granularity)
        self.check_reciprocal(items, path, scale_format, stored)
        self.check_granularity_key(node, items, path, granularity, "group_size")
        self.check_granularity_key(node, items, path, granularity, "block")
        if quantized is not None and tensor is not None:
            if scale_format != "fp32" or stored != "multiplier":
                self.fail(items["quantized"], f"{path}.quantized", "quantized scales restore to fp32 multipliers")
            self.check_dtypes(node, path, tensor, ("uint8",), "quantized scales (uint8 codes into the table)")
        elif tensor is not None and scale_format is not None:
            self.check_dtypes(node, path, tensor, SCALE_DTYPES[scale_format], f"scale format {scale_format!r}")
        if tensor is not None and granularity is not None:
            self.check_shapes(
                node,
                path,
                tensor,
                scale_forms(granularity, group_size, block),
                scale_layout(granularity, group_size, block),
                single_block=granularity == "block",
            )
        if granularity is None or scale_format is None or stored is None or tensor is None:
            return None
        return ScaleSpec(
            granularity=granularity,  # type: ignore[arg-type]
            format=scale_format,
            stored=stored,  # type: ignore[arg-type]
            tensor=tensor,
            group_size=group_size,
            block=block,
            group_index=group_index,
            signed=bool(signed),
            quantized=quantized,
        )

    def check_group_index(self, node: Node, path: str, spec: TensorSpec, granularity: str | None) -> None:
        """A group index is one integer per input channel, for group (or channel: one group) scales."""
        if granularity is not None and granularity not in ("group", "channel"):
            self.fail(node, path, f"a group index assigns columns to groups; granularity {granularity!r} has none")
        bad = [dtype for dtype in spec.dtypes if dtype not in ("int32", "int64")]
        if bad:
            self.fail(
                node.value.get("dtype", node), f"{path}.dtype", f"{bad[0]!r} is not an index; use 'int32' or 'int64'"
            )
        if any(format_shape(shape) != "[K]" for shape in spec.shapes):
            self.fail(node.value.get("shape", node), f"{path}.shape", "a group index has one value per column: [K]")
        if spec.transposed:
            self.fail(node, f"{path}.transposed", "a 1-D group index cannot be stored transposed")

    def check_granularity_key(
        self, node: Node, items: dict[str, Node], path: str, granularity: str | None, key: str
    ) -> None:
        """``group_size`` / ``block`` is given exactly when the granularity is 'group' / 'block'
        (weight and activation scales)."""
        owner, needed = _GRANULARITY_KEYS[key]
        if granularity == owner and _absent(items.get(key)):
            self.needs(node, items, key, path, needed)
        if granularity not in (None, owner) and not _absent(items.get(key)):
            self.fail(
                items[key],
                f"{path}.{key}",
                f"{key} only applies to granularity {owner!r}, not {granularity!r}; remove {key}",
            )

    def block(self, node: Node, path: str) -> tuple[int, int] | None:
        if not node.is_sequence or len(node.value) != 2:
            self.fail(node, path, f"{node.plain()!r} is not [rows, columns], e.g. [128, 128]")
            return None
        rows = self.integer(node.value[0], f"{path}[0]")
        columns = self.integer(node.value[1], f"{path}[1]")
        return None if rows is None or columns is None else (rows, columns)

    def global_scale(self, node: Node, path: str) -> GlobalScaleSpec | None:
        items = self.mapping(node, path, ("stored", "tensor"), ())
        if items is None:
            return None
        stored = self.required(items, "stored", path, lambda n, p: self.choice(n, p, STORED_CHOICES))
        tensor = self.required(items, "tensor", path, self.tensor)
        if tensor is not None:
            self.check_dtypes(node, path, tensor, SCALE_DTYPES["float"], "a global scale")
            self.check_shapes(node, path, tensor, SINGLE, "a global scale (one value per tensor)")
        if stored is None or tensor is None:
            return None
        return GlobalScaleSpec(stored=stored, tensor=tensor)  # type: ignore[arg-type]

    def check_zero_point_range(self, node: Node, path: str, element: str, zp_format: str) -> None:
        """A zero point lies in the weight format's range, so its format must hold all of it."""
        if element not in INTEGER_RANGE:
            return  # reported by weight(): zero points need an integer weight format
        low, high = INTEGER_RANGE[element]
        held_low, held_high = INTEGER_RANGE[zp_format]
        if low < held_low or high > held_high:
            fits = sorted(f for f, (a, b) in INTEGER_RANGE.items() if a <= low and b >= high)
            self.fail(
                node,
                f"{path}.format",
                f"zero points of {element} weights lie in [{low}, {high}], which {zp_format!r} "
                f"([{held_low}, {held_high}]) cannot hold; use {' or '.join(repr(f) for f in fits)}",
            )

    def check_reciprocal(self, items: dict[str, Node], path: str, scale_format: str | None, stored: str | None) -> None:
        """e4m3 / e8m0 scales are stored as the multiplier (their reciprocals are not such values)."""
        if stored == "reciprocal" and scale_format in NO_RECIPROCAL:
            self.fail(
                items["stored"],
                f"{path}.stored",
                f"a {scale_format} scale is stored as the dequant multiplier; its reciprocal is not, in general, "
                f"a {scale_format} value; use stored: multiplier (or a float scale format for a reciprocal)",
            )

    def zero_point(self, node: Node, path: str) -> ZeroPointSpec | None:
        items = self.mapping(node, path, ("format", "tensor"), ("packing", "pack_order", "offset", "equals"))
        if items is None:
            return None
        zp_format = self.required(items, "format", path, lambda n, p: self.choice(n, p, tuple(sorted(INTEGER))))
        packing = self.optional(items, "packing", path, lambda n, p: self.choice(n, p, ZERO_POINT_PACKINGS)) or "none"
        tensor = self.required(items, "tensor", path, self.tensor)
        offset = self.optional(items, "offset", path, lambda n, p: self.integer(n, p, minimum=-255, maximum=255))
        equals = self.optional(items, "equals", path, lambda n, p: self.integer(n, p, minimum=-255, maximum=255))
        order = self.optional(items, "pack_order", path, self.pack_order_list)
        if order is not None and zp_format is not None:
            self.check_pack_order(items["pack_order"], f"{path}.pack_order", order, packing, zp_format)
        if equals is not None and zp_format is not None and zp_format in INTEGER_RANGE:
            low, high = INTEGER_RANGE[zp_format]
            if not low <= equals <= high:
                self.fail(items["equals"], f"{path}.equals", f"{equals} is not a {zp_format} value ([{low}, {high}])")
        if tensor is not None:
            allowed = ZERO_POINT_DTYPES.get(packing, INTEGER_DTYPES)
            self.check_dtypes(node, path, tensor, allowed, f"zero points with packing {packing!r} (integers)")
        if zp_format is None or tensor is None:
            return None
        return ZeroPointSpec(
            format=zp_format, packing=packing, tensor=tensor, pack_order=order, offset=offset or 0, equals=equals
        )

    def pack_order_list(self, node: Node, path: str) -> tuple[int, ...] | None:
        if not node.is_sequence or not all(
            isinstance(item.value, int) and not isinstance(item.value, bool) for item in node.value
        ):
            self.fail(
                node, path, f"expected a list of slot positions, e.g. [0, 2, 4, 6, 1, 3, 5, 7], found {_shown(node)}"
            )
            return None
        return tuple(int(item.value) for item in node.value)

    def check_pack_order(self, node: Node, path: str, order: tuple[int, ...], packing: str, element: str) -> None:
        """A pack order permutes the values of one int32 word (32 / bits of them), or the two nibbles
        of a byte (``nibbles_k``: ``[1, 0]`` puts element 2j in the high nibble)."""
        if packing == "nibbles_k":
            if sorted(order) != [0, 1]:
                self.fail(node, path, f"{list(order)} is not an order of a byte's two nibbles; give [0, 1] or [1, 0]")
            return
        if packing not in INT32_PACKINGS:
            self.fail(node, path, f"a pack order permutes the values of an int32 word; packing {packing!r} has none")
            return
        bits = FORMAT_FACTS[element].bits
        per_word = 32 // bits
        if 32 % bits or sorted(order) != list(range(per_word)):
            self.fail(
                node,
                path,
                f"{list(order)} is not an order of the {per_word} {bits}-bit values of an int32 word; "
                f"give each of 0..{per_word - 1} once",
            )

    def weight(self, node: Node, path: str) -> WeightSpec | None:
        packing_node = node.value.get("packing") if node.is_mapping else None
        if packing_node is not None and packing_node.value == BLOCKS:
            return self.block_weight(node, path)
        items = self.mapping(
            node,
            path,
            ("format", "tensor", "scale"),
            ("packing", "pack_order", "global_scale", "zero_point", "shape_tensor", "table", "table_tensor", "state"),
        )
        if items is None:
            return None
        element = self.required(items, "format", path, lambda n, p: self.choice(n, p, ELEMENT_FORMATS))
        packing = (
            "none"
            if _absent(items.get("packing"))
            else self.required(items, "packing", path, lambda n, p: self.choice(n, p, WEIGHT_PACKINGS))
        )
        tensor = self.required(items, "tensor", path, self.tensor)
        scale = self.required(items, "scale", path, self.scale)
        global_scale = self.optional(items, "global_scale", path, self.global_scale)
        zero_point = self.optional(items, "zero_point", path, self.zero_point)
        shape_tensor = self.optional(items, "shape_tensor", path, self.tensor)
        order = self.optional(items, "pack_order", path, self.pack_order_list)
        table = self.optional(items, "table", path, self.table)
        state = self.optional(items, "state", path, self.state)
        table_tensor = self.optional(items, "table_tensor", path, self.tensor)
        if table_tensor is not None and table is None:
            self.fail(items["table_tensor"], f"{path}.table_tensor", "a stored copy of the table needs table:")
        if table is not None and element is not None:
            facts = FORMAT_FACTS[element]
            if facts.kind != "int" or facts.signed or len(table) != 1 << facts.bits:
                self.fail(
                    items["table"],
                    f"{path}.table",
                    f"a table of {len(table)} values for format {element!r}; a table is indexed by unsigned codes: "
                    "give 2**bits values for uint4 or uint8",
                )
            if zero_point is not None:
                self.fail(items["table"], f"{path}.table", "a table's values are the weight: it takes no zero points")
        if order is not None and element is not None and packing is not None:
            self.check_pack_order(items["pack_order"], f"{path}.pack_order", order, packing, element)
        if zero_point is not None and element is not None:
            zp_items = items["zero_point"].value
            zp_node = zp_items.get("format", items["zero_point"]) if isinstance(zp_items, dict) else items["zero_point"]
            self.check_zero_point_range(zp_node, f"{path}.zero_point", element, zero_point.format)
        if element is not None and packing is not None:
            packing_node = items.get("packing", node)
            if packing in ("nibbles_k", "int4_n") and element not in FOUR_BIT:
                self.fail(
                    packing_node,
                    f"{path}.packing",
                    f"{packing!r} packs 4-bit elements, but format is {element!r}; use packing 'none'",
                )
            if packing == "int4_n" and element != "int4":
                self.fail(packing_node, f"{path}.packing", f"'int4_n' holds signed int4 only, not {element!r}")
            if packing in INT32_PACKINGS and element not in INTEGER:
                self.fail(
                    packing_node,
                    f"{path}.packing",
                    f"{packing!r} packs integers, not {element!r}; use 'nibbles_k' for e2m1",
                )
            if packing == "none" and element in FOUR_BIT:
                self.fail(
                    packing_node,
                    f"{path}.packing",
                    f"4-bit {element!r} must be packed: use 'nibbles_k', 'int32_k' or 'int4_n'",
                )
            if tensor is not None and packing in PACKED_DTYPE:
                expected = PACKED_DTYPE[packing] or UNPACKED_DTYPE.get(element)
                if expected is not None:
                    self.check_dtypes(node, path, tensor, (expected,), f"format {element!r} with packing {packing!r}")
        if zero_point is not None and element is not None and element not in INTEGER:
            self.fail(
                items["zero_point"],
                f"{path}.zero_point",
                f"zero points need an integer format, not {element!r}; use zero_point: none",
            )
        if tensor is not None and element is not None and packing in WEIGHT_PACKINGS:
            self.check_shapes(
                node,
                path,
                tensor,
                weight_forms(element, packing),
                f"format {element!r} with packing {packing!r} ({weight_layout(element, packing)})",
            )
        if zero_point is not None and scale is not None:
            forms = scale_forms(scale.granularity, scale.group_size, scale.block)
            self.check_shapes(
                items["zero_point"],
                f"{path}.zero_point",
                zero_point.tensor,
                zero_point_forms(forms, zero_point.packing, zero_point.format),
                f"one zero point per scale ({scale_layout(scale.granularity, scale.group_size, scale.block)}"
                + (", packed along N" if zero_point.packing == "int32_n" else "")
                + ")",
            )
        if element is None or tensor is None or scale is None or packing is None:
            return None
        return WeightSpec(
            format=element,
            packing=packing,
            tensor=tensor,
            scale=scale,
            global_scale=global_scale,
            zero_point=zero_point if zero_point is None or zero_point.equals is None else None,
            symmetric_zero_point=zero_point if zero_point is not None and zero_point.equals is not None else None,
            shape_tensor=shape_tensor,
            pack_order=order,
            table=table,
            table_tensor=table_tensor,
            state=state,
        )

    def table(self, node: Node, path: str) -> tuple[float, ...] | None:
        plain = node.plain()
        if (
            not isinstance(plain, list)
            or not plain
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in plain)
        ):
            self.fail(node, path, f"expected a list of numbers (the value of each code), found {_shown(node)}")
            return None
        return tuple(float(v) for v in plain)

    def block_weight(self, node: Node, path: str) -> WeightSpec | None:
        """A weight of packed blocks: ``packing: blocks``, its ``blocks:`` section and one uint8 tensor."""
        items = self.mapping(node, path, ("packing", "tensor", "blocks"), ())
        if items is None:
            return None
        tensor = self.required(items, "tensor", path, self.tensor)
        layout = self.required(items, "blocks", path, lambda n, p: read_blocks(self, n, p))
        if tensor is None or layout is None:
            return None
        self.check_dtypes(node, path, tensor, ("uint8",), "packed blocks (raw bytes)")
        expected = f"[N, K/{layout.elements}*{layout.bytes}]"
        for shape in tensor.shapes:
            dims = [(dim.variable, dim.divisor, dim.multiplier, dim.ceil) for dim in shape]
            if dims != [("N", 1, 1, False), ("K", layout.elements, layout.bytes, False)]:
                self.fail(
                    items["tensor"],
                    f"{path}.tensor.shape",
                    f"{format_shape(shape)} does not hold whole blocks; declare {expected}",
                )
        scale = ScaleSpec(
            granularity="group",
            format="fp32",
            stored="multiplier",
            tensor=tensor,
            group_size=layout.sub_block,
        )
        return WeightSpec(format=BLOCKS, packing=BLOCKS, tensor=tensor, scale=scale, blocks=layout)

    def static_scale(self, node: Node, path: str) -> ScaleSpec | None:
        items = self.mapping(node, path, ("stored", "tensor"), ("format",))
        if items is None:
            return None
        stored = self.required(items, "stored", path, lambda n, p: self.choice(n, p, STORED_CHOICES))
        tensor = self.required(items, "tensor", path, self.tensor)
        scale_format = self.optional(items, "format", path, lambda n, p: self.choice(n, p, SCALE_FORMATS)) or "float"
        self.check_reciprocal(items, path, scale_format, stored)
        if tensor is not None:
            self.check_dtypes(node, path, tensor, SCALE_DTYPES[scale_format], f"scale format {scale_format!r}")
            self.check_shapes(node, path, tensor, SINGLE, "a static activation scale (one value per tensor)")
        if stored is None or tensor is None:
            return None
        return ScaleSpec(granularity="tensor", format=scale_format, stored=stored, tensor=tensor)  # type: ignore[arg-type]

    def activation(self, node: Node, path: str) -> ActivationSpec | None:
        items = self.mapping(
            node, path, ("format", "granularity", "dynamic"), ("group_size", "scale_format", "scale", "global_scale")
        )
        if items is None:
            return None
        element = self.required(items, "format", path, lambda n, p: self.choice(n, p, ACTIVATION_FORMATS))
        granularity = self.required(
            items, "granularity", path, lambda n, p: self.choice(n, p, ACTIVATION_GRANULARITIES)
        )
        dynamic = self.required(items, "dynamic", path, self.boolean)
        group_size = self.optional(items, "group_size", path, self.integer)
        scale_format = (
            self.optional(items, "scale_format", path, lambda n, p: self.choice(n, p, SCALE_FORMATS)) or "fp32"
        )
        scale = self.optional(items, "scale", path, self.static_scale)
        global_scale = self.optional(items, "global_scale", path, self.global_scale)
        self.check_granularity_key(node, items, path, granularity, "group_size")
        if dynamic is False and _absent(items.get("scale")):
            self.needs(node, items, "scale", path, "a static activation (dynamic: false) needs scale: {stored, tensor}")
        if dynamic is True and not _absent(items.get("scale")):
            self.fail(
                items["scale"],
                f"{path}.scale",
                "a dynamic activation computes its scales; remove scale or set dynamic: false",
            )
        if dynamic is False and granularity not in (None, "tensor"):
            self.fail(
                items["granularity"],
                f"{path}.granularity",
                f"static activation scales are per tensor, not {granularity!r}",
            )
        if element is None or granularity is None or dynamic is None:
            return None
        return ActivationSpec(
            format=element,
            granularity=granularity,  # type: ignore[arg-type]
            dynamic=dynamic,
            scale_format=scale_format,
            group_size=group_size,
            scale=scale,
            global_scale=global_scale,
        )

    def fused(self, node: Node, path: str) -> FusedSpec | None:
        items = self.mapping(node, path, ("policy",), ("fallback",))
        if items is None:
            return None
        policy = self.required(items, "policy", path, lambda n, p: self.choice(n, p, FUSED_POLICIES))
        fallback = (
            self.optional(items, "fallback", path, lambda n, p: self.choice(n, p, FUSED_POLICIES[1:])) or "refuse"
        )
        if policy is None:
            return None
        return FusedSpec(policy=policy, fallback=fallback)  # type: ignore[arg-type]

    def arguments(self, node: Node, path: str, key: RuleKey) -> dict[str, Any] | None:
        items = self.mapping(node, path, (), key.arguments)
        if items is None:
            return None
        for name, child in items.items():
            problem = key.check(name, child.plain()) if key.check is not None else None
            if problem is not None:
                self.fail(child, f"{path}.{name}", problem)
        return {name: child.plain() for name, child in items.items()}

    def detect(self, node: Node, path: str) -> DetectSpec | None:
        schemas = rule_schemas()
        items = self.mapping(node, path, (), tuple(schema.producer for schema in schemas))
        if items is None:
            return None
        rules: dict[str, Any] = {}
        for schema in schemas:
            rule = self.optional(items, schema.producer, path, functools.partial(self.rule, schema=schema))
            if rule is not None:
                rules[schema.producer] = rule
        return DetectSpec(rules=rules)

    def rule(self, node: Node, path: str, schema: RuleSchema) -> Any:
        """``detect.<producer>``: the keys its producer's ``RuleSchema`` declares, as its typed rule."""
        items = self.mapping(node, path, schema.required, schema.optional)
        if items is None:
            return None
        values: dict[str, Any] = {}
        for key in schema.keys:
            read = self._rule_reader(key)
            if key.required:
                values[key.name] = self.required(items, key.name, path, read)
            else:
                values[key.name] = self.optional(items, key.name, path, read)
        if any(values[name] is None for name in schema.required):
            return None
        return schema.build(values)

    def _rule_reader(self, key: RuleKey) -> Callable[[Node, str], Any]:
        if key.kind == "strings":
            return self.strings
        if key.kind == "integer":
            return self.integer
        return lambda n, p: self.arguments(n, p, key)


TOP_REQUIRED: tuple[str, ...] = ("name", "weight")
TOP_OPTIONAL: tuple[str, ...] = (
    "producer",
    "description",
    "rules",
    "activation",
    "input_pre_scale",
    "tolerated",
    "fused",
    "detect",
)


def parse_scheme_text(text: str, file: str = "<string>", source: str = "file") -> Scheme:
    """Parse a descriptor's YAML text; raise SchemeError listing every problem found."""
    if not isinstance(text, str):
        raise SchemeError(f"{file}: a descriptor is YAML text (str), not {type(text).__name__}")
    root, problems = read_yaml(text, file)
    reader = _Reader(file)
    reader.problems.extend(problems)
    scheme = None if root is None else _read_scheme(reader, root)
    if reader.problems or scheme is None:
        if not reader.problems:
            reader.fail(root, "", "the descriptor is incomplete")
        ordered = sorted(reader.problems, key=lambda p: (p.location.line or 0, p.location.column or 0))
        raise SchemeError(ordered)
    path = None if file.startswith("<") else file
    return Scheme(**{**scheme.__dict__, "source": source, "path": path})


def parse_scheme_file(path: str | Path, source: str = "file") -> Scheme:
    """Parse a descriptor file; raise SchemeError (not a regular file, over 1 MiB, unreadable, or
    every problem in it)."""
    if not isinstance(path, str | os.PathLike):
        raise UsageError(
            f"parse_scheme_file: path must be a str or os.PathLike naming a descriptor file, not "
            f"{type(path).__name__}; e.g. parse_scheme_file('schemes/my-scheme.yaml')"
        )
    file = str(path)
    return parse_scheme_text(read_descriptor_text(path), file, source)


def _read_scheme(reader: _Reader, root: Node) -> Scheme | None:
    items = reader.mapping(root, "", TOP_REQUIRED, TOP_OPTIONAL)
    if items is None:
        return None
    name = reader.required(items, "name", "", reader.string)
    producer = reader.optional(items, "producer", "", lambda n, p: reader.choice(n, p, rule_producers()))
    description = reader.optional(items, "description", "", reader.string) or ""
    rules = reader.optional(items, "rules", "", lambda n, p: reader.choice(n, p, rule_producers()))
    weight = reader.required(items, "weight", "", reader.weight)
    activation = reader.optional(items, "activation", "", reader.activation)
    pre_scale = reader.optional(items, "input_pre_scale", "", reader.tensor)
    tolerated = reader.optional(items, "tolerated", "", reader.strings) or ()
    fused = reader.optional(items, "fused", "", reader.fused) or FusedSpec()
    detect = reader.optional(items, "detect", "", reader.detect) or DetectSpec()
    if name is not None:
        _check_name(reader, items["name"], name)
    if weight is not None:
        names = [spec.name for spec in _tensor_names(weight, activation, pre_scale)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            reader.fail(
                items["weight"],
                "weight",
                f"tensor name {duplicates[0]!r} is declared twice; each tensor needs its own name",
            )
        clash = sorted(set(tolerated) & set(names))
        if clash:
            reader.fail(
                items["tolerated"],
                "tolerated",
                f"{clash[0]!r} is both declared and tolerated; remove it from tolerated",
            )
    if name is None or weight is None:
        return None
    return Scheme(
        name=name,
        producer=producer,
        description=description,
        rules=rules or producer or "compressed-tensors",
        weight=weight,
        activation=activation,
        input_pre_scale=pre_scale,
        tolerated=tolerated,
        fused=fused,
        detect=detect,
    )


def _check_name(reader: _Reader, node: Node, name: str) -> None:
    """Scheme names are ASCII paths: letters, digits, '-', '_', '.', with '/' between segments."""
    allowed = "use letters, digits, '-', '_', '.', and '/' between parts (e.g. 'acme/W4A16_G64')"
    if not NAME.match(name):
        bad = next(ch for ch in name if not NAME.match(ch))
        what = "whitespace" if bad.isspace() else f"the character {bad!r}"
        reader.fail(node, "name", f"{name!r} contains {what}; {allowed}")
    elif any(part in ("", ".", "..") for part in name.split("/")):
        reader.fail(node, "name", f"{name!r} has an empty, '.' or '..' part between '/'; {allowed}")
    elif name.lower() == "none":
        reader.fail(node, "name", f"{name!r} means absent in descriptors; choose another name")


def _shape_nodes(section: Node, path: str) -> list[tuple[Node, str]]:
    """The node of each declared shape of ``section``'s tensor (each any_of alternative), with its path."""
    tensor = section.value.get("tensor") if section.is_mapping else None
    shape = tensor.value.get("shape") if tensor is not None and tensor.is_mapping else None
    if shape is None:
        return []
    if shape.is_mapping:
        alternatives = shape.value.get("any_of")
        if alternatives is None or not alternatives.is_sequence:
            return []
        return [(item, f"{path}.any_of[{index}]") for index, item in enumerate(alternatives.value)]
    return [(shape, path)]


def _tensor_names(
    weight: WeightSpec, activation: ActivationSpec | None, pre_scale: TensorSpec | None
) -> list[TensorSpec]:
    specs = [weight.tensor] if weight.blocks is not None else [weight.tensor, weight.scale.tensor]
    if weight.global_scale:
        specs.append(weight.global_scale.tensor)
    if weight.zero_point:
        specs.append(weight.zero_point.tensor)
    if weight.symmetric_zero_point:
        specs.append(weight.symmetric_zero_point.tensor)
    if weight.blocks is None and weight.scale.group_index:
        specs.append(weight.scale.group_index)
    if weight.shape_tensor:
        specs.append(weight.shape_tensor)
    if pre_scale:
        specs.append(pre_scale)
    if activation is not None:
        if activation.scale:
            specs.append(activation.scale.tensor)
        if activation.global_scale:
            specs.append(activation.global_scale.tensor)
    return specs
