"""Reading a descriptor's ``blocks:`` section (see ``qscheme.descriptor.blocks``) with located errors."""

from __future__ import annotations

from typing import Protocol

from qscheme.descriptor.blocks import (
    FIELD_FORMATS,
    MAX_BLOCK_BYTES,
    MAX_BLOCK_ELEMENTS,
    BlockField,
    BlockLayout,
    ElementRule,
    IntegerSpec,
    Plane,
    field_value_bytes,
    plane_sources,
)
from qscheme.descriptor.nodes import Node
from qscheme.formats.table import FORMAT_FACTS

ELEMENT_CODE_FORMATS: tuple[str, ...] = tuple(
    name for name, facts in FORMAT_FACTS.items() if facts.weight and facts.kind == "float"
)
"""Element formats a block's codes may be decoded as (e2m1, e4m3, e5m2)."""

MAX_INTEGER_BITS = 16


class Reader(Protocol):
    def fail(self, node: Node | None, path: str, message: str) -> None: ...

    def mapping(
        self, node: Node, path: str, required: tuple[str, ...], optional: tuple[str, ...]
    ) -> dict[str, Node] | None: ...

    def integer(self, node: Node, path: str, minimum: int = 1, maximum: int = ...) -> int | None: ...

    def string(self, node: Node, path: str) -> str | None: ...

    def choice(self, node: Node, path: str, allowed: tuple[str, ...]) -> str | None: ...

    def boolean(self, node: Node, path: str) -> bool | None: ...


def _sequence(reader: Reader, node: Node, path: str, example: str) -> list[Node] | None:
    if not node.is_sequence or not node.value:
        reader.fail(node, path, f"{node.plain()!r} is not a non-empty list; e.g. {example}")
        return None
    return list(node.value)


def _signed_integer(reader: Reader, node: Node, path: str) -> int | None:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 1 << 16:
        reader.fail(node, path, f"{node.plain()!r} is not an integer from -65536 to 65536")
        return None
    return value


def _fields(reader: Reader, node: Node, path: str) -> tuple[BlockField, ...] | None:
    items = _sequence(reader, node, path, "[{name: d, format: fp16}, {name: qs, bytes: 16}]")
    if items is None:
        return None
    out: list[BlockField] = []
    offset = 0
    ok = True
    for index, item in enumerate(items):
        item_path = f"{path}[{index}]"
        keys = reader.mapping(item, item_path, ("name",), ("format", "count", "bytes"))
        if keys is None:
            ok = False
            continue
        name = reader.string(keys["name"], f"{item_path}.name") if "name" in keys else None
        if name is not None and any(field.name == name for field in out):
            reader.fail(keys["name"], f"{item_path}.name", f"field {name!r} is declared twice; give each its own name")
            name = None
        if ("format" in keys) == ("bytes" in keys):
            reader.fail(
                item, item_path, "give either format (floats, e.g. format: fp16) or bytes (raw bytes), not both"
            )
            ok = False
            continue
        if "bytes" in keys:
            if "count" in keys:
                reader.fail(keys["count"], f"{item_path}.count", "count is for float fields; raw bytes give bytes only")
                ok = False
            size = reader.integer(keys["bytes"], f"{item_path}.bytes", 1, MAX_BLOCK_BYTES)
            if name is None or size is None:
                ok = False
                continue
            out.append(BlockField(name, offset, size))
            offset += size
            continue
        field_format = reader.choice(keys["format"], f"{item_path}.format", FIELD_FORMATS)
        count = reader.integer(keys["count"], f"{item_path}.count", 1, MAX_BLOCK_BYTES) if "count" in keys else 1
        if name is None or field_format is None or count is None:
            ok = False
            continue
        size = count * field_value_bytes(field_format)
        out.append(BlockField(name, offset, size, field_format, count))
        offset += size
    return tuple(out) if ok else None


def _plane(reader: Reader, node: Node, path: str, fields: dict[str, BlockField]) -> Plane | None:
    keys = reader.mapping(node, path, ("field", "bits"), ("run", "first_byte"))
    if keys is None:
        return None
    raw = tuple(name for name, field in fields.items() if field.format is None)
    field = reader.choice(keys["field"], f"{path}.field", raw) if "field" in keys else None
    bits = reader.integer(keys["bits"], f"{path}.bits", 1, 8) if "bits" in keys else None
    run = reader.integer(keys["run"], f"{path}.run", 1, MAX_BLOCK_BYTES) if "run" in keys else 1
    first = reader.integer(keys["first_byte"], f"{path}.first_byte", 0, MAX_BLOCK_BYTES) if "first_byte" in keys else 0
    if field is None or bits is None or run is None or first is None:
        return None
    return Plane(field, bits, run, first)


def _pieces(
    reader: Reader, node: Node, path: str, field: str, size: int
) -> tuple[tuple[tuple[str, int, int, int], ...], ...] | None:
    values = _sequence(
        reader, node, path, "[[[0, 0, 6]], [[8, 0, 4], [0, 6, 2]]] (per value: [byte, first_bit, width])"
    )
    if values is None:
        return None
    out = []
    for index, value in enumerate(values):
        value_path = f"{path}[{index}]"
        pieces = _sequence(reader, value, value_path, "[[8, 0, 4], [0, 6, 2]]")
        if pieces is None:
            return None
        parsed = []
        for number, piece in enumerate(pieces):
            piece_path = f"{value_path}[{number}]"
            triple = piece.plain()
            if (
                not isinstance(triple, list)
                or len(triple) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in triple)
            ):
                reader.fail(piece, piece_path, f"{triple!r} is not [byte, first_bit, width]")
                return None
            byte, shift, width = triple
            if not (0 <= byte < size and 0 <= shift < 8 and 1 <= width <= 8 - shift):
                reader.fail(
                    piece,
                    piece_path,
                    f"{triple!r} is outside the {size}-byte field {field!r}; need 0 <= byte < {size}, "
                    "0 <= first_bit < 8 and 1 <= width <= 8 - first_bit",
                )
                return None
            parsed.append((field, byte, shift, width))
        out.append(tuple(parsed))
    return tuple(out)


def _integer(reader: Reader, name: str, node: Node, path: str, fields: dict[str, BlockField]) -> IntegerSpec | None:
    keys = reader.mapping(node, path, ("count",), ("planes", "pieces", "field", "signed", "offset"))
    if keys is None:
        return None
    count = reader.integer(keys["count"], f"{path}.count", 1, MAX_BLOCK_ELEMENTS) if "count" in keys else None
    signed = reader.boolean(keys["signed"], f"{path}.signed") if "signed" in keys else False
    offset = _signed_integer(reader, keys["offset"], f"{path}.offset") if "offset" in keys else 0
    if ("planes" in keys) == ("pieces" in keys):
        reader.fail(node, path, "give either planes (regular bit planes) or pieces (a table per value), not both")
        return None
    if count is None or signed is None or offset is None:
        return None
    sources: list[list[tuple[str, int, int, int]]] = [[] for _ in range(count)]
    found_planes: list[Plane] = []
    if "planes" in keys:
        if "field" in keys:
            reader.fail(keys["field"], f"{path}.field", "planes name their own field; remove field")
            return None
        planes = _sequence(reader, keys["planes"], f"{path}.planes", "[{field: qs, bits: 4, run: 16}]")
        if planes is None:
            return None
        for index, plane_node in enumerate(planes):
            plane_path = f"{path}.planes[{index}]"
            plane = _plane(reader, plane_node, plane_path, fields)
            if plane is None:
                return None
            found = plane_sources(plane, count, fields[plane.field].size)
            if isinstance(found, str):
                reader.fail(plane_node, plane_path, f"{found}; fix bits, run, first_byte or count")
                return None
            for value, source in zip(sources, found, strict=True):
                value.append(source)
            found_planes.append(plane)
    else:
        raw = tuple(n for n, f in fields.items() if f.format is None)
        field = reader.choice(keys["field"], f"{path}.field", raw) if "field" in keys else None
        if "field" not in keys:
            reader.fail(node, path, "pieces need field: the raw field they index")
        if field is None:
            return None
        table = _pieces(reader, keys["pieces"], f"{path}.pieces", field, fields[field].size)
        if table is None:
            return None
        if len(table) != count:
            reader.fail(keys["pieces"], f"{path}.pieces", f"{len(table)} values listed, but count is {count}")
            return None
        sources = [list(value) for value in table]
    bits = {sum(width for *_, width in value) for value in sources}
    if len(bits) != 1 or max(bits) > MAX_INTEGER_BITS:
        reader.fail(
            node, path, f"every value must have the same width of at most {MAX_INTEGER_BITS} bits; got {sorted(bits)}"
        )
        return None
    return IntegerSpec(
        name, count, bits.pop(), signed, offset, tuple(tuple(value) for value in sources), tuple(found_planes)
    )


def _factors(reader: Reader, node: Node, path: str, names: dict[str, int], elements: int) -> tuple[str, ...] | None:
    items = _sequence(reader, node, path, "[d, sc]")
    if items is None:
        return None
    out = []
    for index, item in enumerate(items):
        name = reader.choice(item, f"{path}[{index}]", tuple(names))
        if name is None:
            return None
        if elements % names[name]:
            reader.fail(item, f"{path}[{index}]", f"{name!r} has {names[name]} values, which do not divide {elements}")
            return None
        out.append(name)
    return tuple(out)


def _element(
    reader: Reader, node: Node, path: str, integers: dict[str, IntegerSpec], elements: int
) -> ElementRule | None:
    keys = reader.mapping(node, path, ("integer",), ("table", "format"))
    if keys is None or "integer" not in keys:
        return None
    name = reader.choice(keys["integer"], f"{path}.integer", tuple(integers))
    if name is None:
        return None
    spec = integers[name]
    if spec.count != elements:
        reader.fail(keys["integer"], f"{path}.integer", f"{name!r} has {spec.count} values; the block has {elements}")
        return None
    if "table" in keys and "format" in keys:
        reader.fail(node, path, "give table or format, not both")
        return None
    if "table" in keys:
        table_node = keys["table"]
        values = table_node.plain()
        size = 1 << spec.bits
        if (
            not isinstance(values, list)
            or len(values) != size
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        ):
            reader.fail(table_node, f"{path}.table", f"give a list of {size} numbers, one per {spec.bits}-bit code")
            return None
        if spec.signed or spec.offset:
            reader.fail(table_node, f"{path}.table", "a table is indexed by the raw code: the integer takes no offset")
            return None
        return ElementRule(name, table=tuple(float(v) for v in values))
    if "format" in keys:
        element_format = reader.choice(keys["format"], f"{path}.format", ELEMENT_CODE_FORMATS)
        if element_format is None:
            return None
        if FORMAT_FACTS[element_format].bits != spec.bits or spec.offset or spec.signed:
            reader.fail(
                keys["format"],
                f"{path}.format",
                f"{element_format!r} codes are {FORMAT_FACTS[element_format].bits} bits; {name!r} is {spec.bits}"
                " bits (or has an offset or sign)",
            )
            return None
        return ElementRule(name, format=element_format)
    return ElementRule(name)


def read_blocks(reader: Reader, node: Node, path: str) -> BlockLayout | None:
    """The ``blocks:`` section, or None after recording its problems."""
    keys = reader.mapping(node, path, ("elements", "bytes", "fields", "scale"), ("integers", "element", "minimum"))
    if keys is None:
        return None
    elements = (
        reader.integer(keys["elements"], f"{path}.elements", 1, MAX_BLOCK_ELEMENTS) if "elements" in keys else None
    )
    size = reader.integer(keys["bytes"], f"{path}.bytes", 1, MAX_BLOCK_BYTES) if "bytes" in keys else None
    fields = _fields(reader, keys["fields"], f"{path}.fields") if "fields" in keys else None
    if elements is None or size is None or fields is None:
        return None
    total = sum(field.size for field in fields)
    if total != size:
        reader.fail(keys["fields"], f"{path}.fields", f"the fields hold {total} bytes, but bytes is {size}")
        return None
    by_name = {field.name: field for field in fields}
    integers: dict[str, IntegerSpec] = {}
    if "integers" in keys:
        node_integers = keys["integers"]
        if not node_integers.is_mapping:
            reader.fail(node_integers, f"{path}.integers", "give a mapping of name: {count, planes | pieces}")
            return None
        for name, item in node_integers.value.items():
            if name in by_name:
                reader.fail(item, f"{path}.integers.{name}", f"{name!r} is already a field; give it another name")
                return None
            spec = _integer(reader, name, item, f"{path}.integers.{name}", by_name)
            if spec is None:
                return None
            integers[name] = spec
    counts = {name: field.count for name, field in by_name.items() if field.format is not None}
    counts.update({name: spec.count for name, spec in integers.items()})
    scale = _factors(reader, keys["scale"], f"{path}.scale", counts, elements) if "scale" in keys else None
    element = _element(reader, keys["element"], f"{path}.element", integers, elements) if "element" in keys else None
    if scale is None or ("element" in keys and element is None):
        return None
    minimum: tuple[str, ...] = ()
    sign = "subtract"
    if "minimum" in keys:
        minimum_keys = reader.mapping(keys["minimum"], f"{path}.minimum", (), ("subtract", "add"))
        if minimum_keys is None or len(minimum_keys) != 1:
            reader.fail(keys["minimum"], f"{path}.minimum", "give exactly one of subtract: [...] or add: [...]")
            return None
        sign = next(iter(minimum_keys))
        found = _factors(reader, minimum_keys[sign], f"{path}.minimum.{sign}", counts, elements)
        if found is None:
            return None
        minimum = found
    used = set(scale) | set(minimum) | ({element.integer} if element else set())
    unused = sorted(set(integers) - used)
    if unused:
        reader.fail(
            keys["integers"], f"{path}.integers", f"{unused[0]!r} is declared but not used by scale, minimum or element"
        )
        return None
    consumed = {source[0] for spec in integers.values() for value in spec.sources for source in value}
    idle = [
        f.name for f in fields if (f.format is None and f.name not in consumed) or (f.format and f.name not in used)
    ]
    if idle:
        reader.fail(
            keys["fields"], f"{path}.fields", f"field {idle[0]!r} is declared but never read; use it or remove it"
        )
        return None
    return BlockLayout(elements, size, fields, tuple(integers.values()), element, scale, minimum, sign)  # type: ignore[arg-type]
