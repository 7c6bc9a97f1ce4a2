"""What a descriptor must declare, beyond parsing, for its checkpoints to load.

A loader knows a layer's N and K only from its stored tensors: the stored weight's shape, read
back through the declared weight shape, or the values of a shape tensor (compressed-tensors'
``weight_shape``). A padded packed dimension such as ``ceil(K/8)`` maps eight values of K to
one stored size, so a descriptor that declares one and no (required) shape tensor parses, yet
no checkpoint of it loads (``qscheme.canonical.stored_layer_shape`` refuses the ambiguity).
``qscheme validate`` refuses such a descriptor up front with these problems.
"""

from __future__ import annotations

from dataclasses import replace

from qscheme.descriptor.model import Scheme
from qscheme.descriptor.shapes import Shape, format_shape

SHAPE_TENSOR_EXAMPLE = "shape_tensor: {name: weight_shape, dtype: int64, shape: [2]}"


def unfixed_sizes(shapes: tuple[Shape, ...]) -> dict[str, int]:
    """The layer sizes (``N``, ``K``) a stored weight of these declared shapes leaves open, each
    with how many values one stored size may stand for (a ``ceil(V/d)`` dimension: ``d``; a
    variable missing from a shape: unbounded, given as 0)."""
    unfixed: dict[str, int] = {}
    for shape in shapes:
        for variable in ("N", "K"):
            dims = [dim for dim in shape if dim.variable == variable]
            if not dims:
                unfixed[variable] = 0
            for dim in dims:
                if dim.ceil and dim.divisor > 1 and unfixed.get(variable) != 0:
                    unfixed[variable] = max(unfixed.get(variable, 1), dim.divisor)
    return unfixed


def exact_layout(shapes: tuple[Shape, ...]) -> str:
    """The declared shapes with every ``ceil(V/d)`` written as the exact ``V/d``."""
    exact = [
        tuple(replace(dim, ceil=False, text=f"{dim.variable}/{dim.divisor}") if dim.ceil else dim for dim in s)
        for s in shapes
    ]
    return " or ".join(format_shape(shape) for shape in exact)


def load_problems(scheme: Scheme) -> list[tuple[str, str]]:
    """(key path, message) for each reason checkpoints of ``scheme`` cannot load; [] if none."""
    weight = scheme.weight
    unfixed = unfixed_sizes(weight.tensor.shapes)
    if not unfixed:
        return []
    shape_tensor = weight.shape_tensor
    if shape_tensor is not None and not shape_tensor.optional:
        return []
    open_sizes = " and ".join(sorted(unfixed))
    detail = "; ".join(
        f"one stored size stands for {count} values of {variable}" if count else f"{variable} is not in the shape"
        for variable, count in sorted(unfixed.items())
    )
    declared = weight.tensor.describe_shapes()
    fixed = exact_layout(weight.tensor.shapes)
    if shape_tensor is not None:
        return [
            (
                "weight.shape_tensor.optional",
                f"{shape_tensor.name!r} is optional, but {declared} does not fix {open_sizes} without it: {detail}, so "
                f"a checkpoint that lacks it does not load; remove optional: true, or declare a layout that fixes "
                f"{open_sizes} ({fixed})",
            )
        ]
    return [
        (
            "weight.tensor.shape",
            f"{declared} does not fix {open_sizes}: {detail} (the last packed column may be padded), and no shape "
            f"tensor records the layer size, so no checkpoint of this scheme loads; declare a shape tensor "
            f"({SHAPE_TENSOR_EXAMPLE}), or a layout that fixes {open_sizes} ({fixed})",
        )
    ]
