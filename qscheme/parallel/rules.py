"""Tensor-parallel sharding rules, derived from a scheme descriptor's tensor shapes alone.

A column-parallel layer splits N (its output features) across ranks, a row-parallel layer
splits K (its input features). Every tensor a scheme declares has its shape written in N and K
(``[N, K/2]``, ``[ceil(N/8), ceil(K/128)]``, ``[1]``), so the rule for each tensor follows from
that expression, with no code per scheme:

* a dimension written in the split variable is split along with it; its divisor is the unit a
  shard must hold whole (two FP4 values per byte, eight int4 values per int32 word, a group of
  16 scales, a 128x128 block, zero points packed eight per word along N);
* a tensor without such a dimension is replicated: per-tensor and per-partition global scales,
  static input scales, ``weight_shape`` (whose values become the shard's N and K), and an AWQ
  pre-scale ``[K]`` of a column-parallel layer (row-parallel splits it with K);
* activations quantized in groups along K (NVFP4's 16, FP8 block's 128) need whole groups per
  rank when K is split.

A split that would cut one of these units raises ShardError naming the layer, the dimension,
the sizes and the tensor-parallel degrees that would work. Fused modules (q/k/v -> qkv) split
each member by these rules, so that every rank holds matching q, k and v rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import lcm
from typing import TYPE_CHECKING, Literal

from qscheme.descriptor import Scheme, TensorSpec
from qscheme.descriptor.consistency import weight_layout
from qscheme.descriptor.shapes import Shape, evaluate_shape, format_shape
from qscheme.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from torch import Tensor

Style = Literal["column", "row", "replicate"]
STYLES: tuple[str, ...] = ("column", "row", "replicate")
SPLIT_VARIABLE: dict[str, str | None] = {"column": "N", "row": "K", "replicate": None}
MAX_LISTED_DEGREE = 64
"""Working degrees are listed up to this size (1 .. 64 covers every machine in use)."""


@dataclass(frozen=True)
class Unit:
    """What a shard must hold whole along the split dimension: ``multiple`` rows or columns."""

    multiple: int
    what: str  # "a scale group of 16 (weight_scale [N, K/16])"


@dataclass(frozen=True)
class TensorShard:
    """How one stored tensor of a layer is split: ``dim`` (None: replicated) of ``full_shape``.

    ``rewrite`` marks the ``weight_shape`` tensor, whose values (not bytes) change per rank:
    the loader writes the shard's [N, K] instead of reading it. ``rebase`` marks a group index
    (GPTQ's ``g_idx``) split with K: rank r's values are ``r * rebase`` less (``values``), so that
    each shard numbers its own groups from 0.
    """

    role: str
    name: str
    full_shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    dim: int | None = None
    rewrite: bool = False
    rebase: int = 0

    def values(self, rank: int, part: Tensor) -> Tensor:
        """Rank ``rank``'s slice ``part`` of the stored tensor as the shard holds it."""
        return part - rank * self.rebase if self.rebase else part

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def index(self, rank: int) -> tuple[slice, ...]:
        """The slices of the stored tensor that rank ``rank`` holds."""
        if self.dim is None:
            return tuple(slice(0, size) for size in self.full_shape)
        size = self.shard_shape[self.dim]
        out = [slice(0, full) for full in self.full_shape]
        out[self.dim] = slice(rank * size, (rank + 1) * size)
        return tuple(out)

    def describe(self) -> str:
        """``weight_packed [4096, 512] -> [2048, 512] (dim 0)`` or ``... replicated``."""
        full = _shape_text(self.full_shape)
        if self.rewrite:
            return f"{self.name} {full}: holds the shard's [N, K]"
        if self.dim is None:
            return f"{self.name} {full}: replicated"
        return f"{self.name} {full} -> {_shape_text(self.shard_shape)} (dim {self.dim})"


@dataclass(frozen=True)
class ShardLayout:
    """One layer (or one fused member) split ``tp_size`` ways: shard sizes and every tensor's split."""

    layer: str
    scheme: str
    style: Style
    n: int
    k: int
    tp_size: int
    shard_n: int
    shard_k: int
    tensors: Mapping[str, TensorShard]  # by checkpoint short name (weight_packed, weight_scale, ...)
    units: tuple[Unit, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def dimension(self) -> str | None:
        return SPLIT_VARIABLE[self.style]

    def as_json(self) -> dict[str, object]:
        return {
            "layer": self.layer,
            "scheme": self.scheme,
            "style": self.style,
            "n": self.n,
            "k": self.k,
            "tp_size": self.tp_size,
            "shard_n": self.shard_n,
            "shard_k": self.shard_k,
            "tensors": {
                name: {
                    "shape": list(t.full_shape),
                    "shard_shape": list(t.shard_shape),
                    "split_dim": t.dim,
                    "rewrite": t.rewrite,
                    **({"rebase": t.rebase} if t.rebase else {}),
                }
                for name, t in self.tensors.items()
            },
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class SplitProblem:
    """Why one layer cannot be split ``tp_size`` ways, and which degrees would work."""

    layer: str
    scheme: str
    style: Style
    dimension: str
    size: int
    tp_size: int
    reason: str
    working: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"layer {self.layer} ({self.scheme}, {self.style}-parallel): {self.reason}; "
            f"{describe_degrees(self.dimension, self.size, self.working)}"
        )


class ShardError(CheckpointError):
    """A tensor-parallel split would cut a packed word, a scale group or block, or an activation group.

    ``problems`` holds one SplitProblem per layer that cannot be split, each naming the layer,
    the dimension, the sizes and the degrees that would work.
    """

    def __init__(self, problems: Sequence[SplitProblem], context: str = "") -> None:
        self.problems = tuple(problems)
        lines = [str(problem) for problem in self.problems]
        fix = (
            "choose a tensor-parallel degree every layer allows (`qscheme resolve PATH --tp auto` lists them), "
            "or replicate these layers with tp_plan={'<pattern>': 'replicate'}"
        )
        head = f"{context}: " if context else ""
        if len(lines) == 1:
            text = f"{head}{lines[0]}. Fix: {fix}"
        else:
            text = f"{head}{len(lines)} layers cannot be split:\n" + "\n".join(f"  - {line}" for line in lines)
            text += f"\nFix: {fix}"
        super().__init__(text)

    @property
    def layer(self) -> str:
        return self.problems[0].layer


def checked_style(style: object, where: str = "style") -> Style:
    """``style`` as one of STYLES; UsageError otherwise."""
    if style == "column":
        return "column"
    if style == "row":
        return "row"
    if style == "replicate":
        return "replicate"
    raise UsageError(f"{where}: {style!r} is not a parallel style; use one of {', '.join(STYLES)}")


def checked_degree(tp_size: object, tp_rank: object = 0) -> tuple[int, int]:
    """(tp_size, tp_rank) as ints with tp_size >= 1 and 0 <= tp_rank < tp_size; UsageError otherwise."""
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{name} must be an int, not {value!r} ({type(value).__name__})")
    assert isinstance(tp_size, int) and isinstance(tp_rank, int)
    if tp_size < 1:
        raise UsageError(f"tp_size must be >= 1, not {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise UsageError(f"tp_rank must be in 0..{tp_size - 1} for tp_size={tp_size}, not {tp_rank}")
    return tp_size, tp_rank


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(size) for size in shape) + "]"


def _specs(scheme: Scheme) -> dict[str, TensorSpec]:
    return scheme.tensor_specs()


def _unit_name(scheme: Scheme, role: str, variable: str, divisor: int) -> str:
    """What a divisor of a declared dimension stands for, from the scheme's own declarations."""
    weight = scheme.weight
    if role == "weight" and weight.blocks is not None:
        return f"a block of {weight.blocks.elements} weights ({weight.blocks.bytes} bytes)"
    if role == "weight":
        return f"a packed word ({weight_layout(weight.format, weight.packing)})"
    if role == "weight_scale":
        scale = weight.scale
        if scale.granularity == "block" and scale.block is not None:
            return f"a {scale.block[0]}x{scale.block[1]} scale block"
        if scale.granularity == "group":
            return f"a scale group of {scale.group_size}"
    if role == "weight_zero_point" and weight.zero_point is not None:
        if variable == "K":
            return f"a zero-point group of {divisor}"
        return f"a zero-point word ({divisor} zero points packed along N, {weight.zero_point.packing})"
    return f"a unit of {divisor}"


def split_units(scheme: Scheme, style: Style) -> tuple[Unit, ...]:
    """Every unit a shard must hold whole when ``style`` splits a layer of ``scheme``."""
    variable = SPLIT_VARIABLE[style]
    if variable is None:
        return ()
    units: list[Unit] = []
    for role, spec in _specs(scheme).items():
        for shape in spec.shapes:
            for dim in shape:
                if dim.variable == variable and dim.divisor > 1:
                    what = f"{_unit_name(scheme, role, variable, dim.divisor)} ({spec.name} {format_shape(shape)})"
                    unit = Unit(dim.divisor, what)
                    if unit not in units:
                        units.append(unit)
    activation = scheme.activation
    if variable == "K" and activation is not None and activation.granularity == "group" and activation.group_size:
        units.append(
            Unit(activation.group_size, f"an activation group of {activation.group_size} (inputs quantized along K)")
        )
    return tuple(units)


def split_multiple(scheme: Scheme, style: Style) -> int:
    """What each shard's size along the split dimension must be a multiple of."""
    return lcm(1, *(unit.multiple for unit in split_units(scheme, style)))


def working_degrees(size: int, multiple: int, limit: int = MAX_LISTED_DEGREE) -> tuple[int, ...]:
    """The degrees t <= limit that split ``size`` into equal shards, each a multiple of ``multiple``
    (1 always: an unsplit layer keeps its own padding)."""
    return (1, *(t for t in range(2, limit + 1) if size % t == 0 and (size // t) % multiple == 0))


def describe_degrees(dimension: str, size: int, working: Sequence[int]) -> str:
    """``N = 1856 splits whole at tp_size 1, 2, 4, 29, 58`` (``only at tp_size 1`` when nothing else)."""
    if list(working) == [1]:
        return f"{dimension} = {size} splits whole only at tp_size 1 (keep the layer replicated)"
    shown = ", ".join(str(t) for t in working)
    return f"{dimension} = {size} splits whole at tp_size {shown} (degrees up to {MAX_LISTED_DEGREE} listed)"


def split_problem(scheme: Scheme, n: int, k: int, style: Style, tp_size: int, layer: str = "") -> SplitProblem | None:
    """Why ``tp_size`` cannot split this layer (the first unit it would cut), or None when it can."""
    variable = SPLIT_VARIABLE[style]
    if variable is None or tp_size == 1:
        return None
    size = n if variable == "N" else k
    whole = whole_layer_tensors(scheme)
    if whole:
        whole_reason = (
            f"scheme {scheme.name} stores {whole}, counted over the whole layer; qscheme does not split such "
            "layers: load them with tp_size 1"
        )
        return SplitProblem(layer or "?", scheme.name, style, variable, size, tp_size, whole_reason, (1,))
    units = split_units(scheme, style)
    working = working_degrees(size, lcm(1, *(unit.multiple for unit in units)))
    reason = None
    if size % tp_size:
        reason = (
            f"tp_size {tp_size} does not divide {variable} = {size} evenly "
            f"({size} / {tp_size} = {size / tp_size:.4g} per rank)"
        )
    else:
        shard = size // tp_size
        for unit in units:
            if shard % unit.multiple:
                reason = (
                    f"tp_size {tp_size} splits {variable} = {size} into {shard} per rank, which cuts {unit.what}: "
                    f"{shard} % {unit.multiple} = {shard % unit.multiple}"
                )
                break
    if reason is None:
        return None
    return SplitProblem(layer or "?", scheme.name, style, variable, size, tp_size, reason, working)


def whole_layer_tensors(scheme: Scheme) -> str:
    """What of a scheme's layout is counted over the whole layer (flat tensors, a JSON state, scales
    quantized in flat blocks), described; empty when every tensor splits along N or K."""
    weight = scheme.weight
    found = [f"flat tensor {spec.name!r}" for spec in scheme.tensor_specs().values() if spec.flat]
    if weight.state is not None:
        found.append(f"the JSON state {weight.state.tensor.name!r}")
    if weight.scale.quantized is not None:
        found.append(f"scales quantized in flat blocks of {weight.scale.quantized.group_size}")
    return ", ".join(found)


def _chosen_shape(spec: TensorSpec, n: int, k: int, stored: tuple[int, ...] | None) -> Shape:
    """The declared shape alternative the stored tensor uses (the first that evaluates otherwise)."""
    for shape in spec.shapes:
        sizes = evaluate_shape(shape, n, k)
        if sizes is not None and (stored is None or sizes == stored):
            return shape
    return spec.shapes[0] if spec.shapes else ()  # a JSON state tensor declares no shape


def shard_layout(
    scheme: Scheme,
    n: int,
    k: int,
    style: Style,
    tp_size: int,
    *,
    layer: str = "",
    stored_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> ShardLayout:
    """Split an N x K layer of ``scheme`` ``tp_size`` ways as ``style`` says; ShardError when
    the split would cut a packed word, a scale group or block, or an activation group.

    ``stored_shapes`` (checkpoint short name -> header shape) picks among a tensor's declared
    shape alternatives (ModelOpt's 0-dim scale of a single-block weight); without it the first
    alternative that fits N x K is used. Optional tensors are listed whether stored or not.
    """
    style = checked_style(style)
    checked_degree(tp_size)
    problem = split_problem(scheme, n, k, style, tp_size, layer)
    if problem is not None:
        raise ShardError([problem])
    variable = SPLIT_VARIABLE[style]
    shard_n = n // tp_size if variable == "N" else n
    shard_k = k // tp_size if variable == "K" else k
    stored_shapes = stored_shapes or {}
    tensors: dict[str, TensorShard] = {}
    shape_tensor = scheme.weight.shape_tensor
    for role, spec in _specs(scheme).items():
        stored = stored_shapes.get(spec.name)
        shape = _chosen_shape(spec, n, k, stored)
        full = stored if stored is not None else (evaluate_shape(shape, n, k) or ())
        split_dims = [i for i, dim in enumerate(shape) if variable is not None and dim.variable == variable]
        if spec is shape_tensor:
            tensors[spec.name] = TensorShard(role, spec.name, full, (2,), None, rewrite=True)
        elif not split_dims or tp_size == 1:
            tensors[spec.name] = TensorShard(role, spec.name, full, full, None)
        else:
            dim = split_dims[0]
            shard = list(full)
            shard[dim] = full[dim] // tp_size
            group = scheme.weight.scale.group_size
            rebase = shard_k // group if role == "weight_group_index" and group else 0
            tensors[spec.name] = TensorShard(role, spec.name, full, tuple(shard), dim, rebase=rebase)
    return ShardLayout(
        layer=layer,
        scheme=scheme.name,
        style=style,
        n=n,
        k=k,
        tp_size=tp_size,
        shard_n=shard_n,
        shard_k=shard_k,
        tensors=tensors,
        units=split_units(scheme, style),
        notes=_notes(scheme, style, tp_size),
    )


def _notes(scheme: Scheme, style: Style, tp_size: int) -> tuple[str, ...]:
    """What a split changes besides the bytes: dynamic activation scales of a K split."""
    activation = scheme.activation
    if style != "row" or tp_size == 1 or activation is None or not activation.dynamic:
        return ()
    if activation.granularity in ("token", "tensor"):
        return (
            f"dynamic per-{activation.granularity} activation scales are taken from each rank's slice of K, as "
            "engines do; outputs differ from the unsharded layer within quantization error",
        )
    return ()
