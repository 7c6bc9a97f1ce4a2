"""Stacked experts converted into the per-expert layers compressed-tensors and ModelOpt store.

Some producers store every expert of a MoE layer in one tensor per projection (gpt-oss:
``<experts>.gate_up_proj_blocks`` [E, R, C/32, 16]), as their ``StackedExperts`` declares; the
loader reads them as one module per expert (``<experts>.<e>.gate_up_proj``, see
``checkpoint.stacked_experts``). The producers convert writes store one linear per expert and
projection instead, ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` (llm-compressor
linearizes gpt-oss's experts so: its ``GptOssLinearExperts``), so converting such a checkpoint

- consumes the stacked tensors themselves (none is copied through);
- writes each expert's projections as their own layers, a projection that holds several
  (``StackedExperts.members``: gate_up_proj -> gate_proj, up_proj) split by rows: the even and odd
  rows where they alternate (``interleaved``), else the first and second halves;
- splits each expert's bias the same way (``<experts>.<e>.gate_proj.bias``).

Selecting rows keeps every code and every scale as it is: a layer's rows dequantize on their own
only when each of its tensors is either per row (its first dimension is N: codes, group and
channel scales, zero points) or one value for the layer (a per-tensor scale, copied to each
member). Anything else (128 x 128 block scales, codes packed across rows) cannot be split by rows
and is refused, naming the layer and the tensor. Pure, no files: the writer
(``writing.convert``) reads the stacked tensors and writes what ``expert_layers`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

from torch import Tensor

from qscheme.checkpoint.plan import Plan
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.producers import PRODUCERS
from qscheme.producers.base import StackedExperts, split_name
from qscheme.storage import DTYPE_BY_TORCH_NAME, TensorInfo
from qscheme.tensor_checks import ModuleLayout
from qscheme.writing.convert_layer import UnconvertibleLayerError

__all__ = ["ExpertLayer", "ExpertsPlan", "StackedProjection", "check_splittable", "expert_layers", "plan_experts"]


@dataclass(frozen=True)
class ExpertLayer:
    """One layer written for a stacked source: ``module`` (``<experts>.<e>.gate_proj``) holds the
    rows ``rows`` of the source module ``source`` (``<experts>.<e>.gate_up_proj``)."""

    module: str
    source: str
    rows: slice


@dataclass(frozen=True)
class StackedProjection:
    """One stacked projection of an experts module: its tensors as stored (``stored``: short name
    -> stored tensor name, ``bias`` included) and the per-expert source modules, expert by expert."""

    experts: str
    projection: str
    stored: dict[str, str]
    sources: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.experts}.{self.projection}"


@dataclass(frozen=True)
class ExpertsPlan:
    """What convert writes for a checkpoint's stacked experts (empty for any other checkpoint)."""

    layers: dict[str, tuple[ExpertLayer, ...]]  # source module -> the layers written for it
    stacked: dict[str, StackedProjection]  # stored tensor name -> its projection

    def written(self, modules: Mapping[str, Scheme]) -> dict[str, str]:
        """Every module convert writes -> the source module it comes from (``modules``: the source's
        quantized modules)."""
        out: dict[str, str] = {}
        for module in modules:
            for layer in self.layers.get(module, (ExpertLayer(module, module, slice(None)),)):
                out[layer.module] = module
        return out


def _layout_of(plan: Plan) -> StackedExperts | None:
    return next((p.stacked_experts for p in PRODUCERS if isinstance(plan.config, p.config_type)), None)


def _member_rows(rows: int, members: tuple[str, ...], interleaved: bool, source: str) -> list[slice]:
    count = len(members)
    if rows % count:
        raise UnconvertibleLayerError(
            f"layer {source}: its {rows} rows cannot be split into {count} layers ({', '.join(members)}) of equal "
            "size; the checkpoint is not the layout its producer declares"
        )
    size = rows // count
    if interleaved:
        return [slice(index, rows, count) for index in range(count)]
    return [slice(index * size, (index + 1) * size) for index in range(count)]


def _per_row(spec: TensorSpec | None, info: TensorInfo) -> bool:
    """Whether the tensor splits by rows: one value for the layer, or its declared first dimension is N."""
    if info.numel == 1:
        return True
    return spec is not None and any(shape and str(shape[0]) == "N" for shape in spec.shapes)


def check_splittable(module: str, layout: ModuleLayout[TensorInfo], members: tuple[str, ...]) -> None:
    """UnconvertibleLayerError unless every tensor of ``layout`` is per row or one value (see the
    module docstring): the layer ``module`` can then be split into ``members`` by rows."""
    specs = {spec.name: spec for spec in layout.scheme.tensor_specs().values()}
    for short, info in layout.declared.items():
        if not _per_row(specs.get(short), info):
            spec = specs.get(short)
            shapes = spec.describe_shapes() if spec is not None else "undeclared"
            raise UnconvertibleLayerError(
                f"layer {module}: its rows hold {', '.join(members)}, which convert writes as layers of their own, but "
                f"{layout.scheme.name} stores {short!r} as {shapes} (found {list(info.shape)}), not one row per output "
                "row: its rows cannot be taken apart without changing the tensor, so this checkpoint cannot be "
                "written as per-expert layers; load it as it is (qscheme.load_checkpoint, apply_to_model)"
            )


def plan_experts(plan: Plan, stored: Collection[str]) -> ExpertsPlan:
    """The layers written for each stacked source module, and the stored tensors they consume
    (``stored``: the names the checkpoint's files hold). UnconvertibleLayerError for a layer that
    cannot be split by rows (see the module docstring)."""
    layout = _layout_of(plan)
    if layout is None:
        return ExpertsPlan({}, {})
    projections: dict[tuple[str, str], list[str]] = {}
    names_of: dict[tuple[str, str], dict[str, str]] = {}
    layers: dict[str, tuple[ExpertLayer, ...]] = {}
    for module, module_layout in plan.layouts.items():
        expert_path, projection = split_name(module)
        experts, index = split_name(expert_path)
        if not index.isdigit() or projection not in layout.projections:
            continue
        shorts = [*module_layout.declared, *module_layout.tolerated]
        if module_layout.bias is not None:
            shorts.append("bias")
        names = {short: f"{experts}.{projection}{layout.separator}{short}" for short in shorts}
        if not all(name in stored for name in names.values()):
            continue  # this producer stored the expert on its own: converted as any module
        projections.setdefault((experts, projection), []).append(module)
        names_of[(experts, projection)] = names
        members = layout.members.get(projection)
        if members is None:
            layers[module] = (ExpertLayer(module, module, slice(None)),)
            continue
        check_splittable(module, module_layout, members)
        rows = _member_rows(module_layout.n, members, layout.interleaved, module)
        layers[module] = tuple(
            ExpertLayer(f"{expert_path}.{member}", module, part) for member, part in zip(members, rows, strict=True)
        )
    stacked: dict[str, StackedProjection] = {}
    for key, modules in projections.items():
        ordered = tuple(sorted(modules, key=_expert_index))
        found = StackedProjection(key[0], key[1], names_of[key], ordered)
        for name in found.stored.values():
            stacked[name] = found
    return ExpertsPlan(layers, stacked)


def _expert_index(module: str) -> int:
    return int(split_name(split_name(module)[0])[1])


def _expert_tensor(stack: Tensor, index: int, info: TensorInfo) -> Tensor:
    """Expert ``index`` of a stacked tensor, in the per-expert shape the loader reads (``info``)."""
    shape = list(info.shape)
    if DTYPE_BY_TORCH_NAME[info.dtype].bits == 4:
        shape[-1] //= 2  # two FP4 values per torch element
    return stack[index].reshape(shape)


def _rows(value: Tensor, rows: slice) -> Tensor:
    if rows == slice(None) or value.numel() == 1:
        return value
    return value[rows].contiguous()


def expert_layers(
    plan: Plan, experts: ExpertsPlan, projection: StackedProjection, read: Callable[[str], Tensor]
) -> Iterator[tuple[ExpertLayer, dict[str, Tensor], Tensor | None]]:
    """(layer, its source tensors by the source scheme's short names, its bias or None) for every
    layer written from one stacked projection, expert by expert; ``read`` gives a stored tensor."""
    stacks = {short: read(name) for short, name in projection.stored.items()}
    for source in projection.sources:
        layout = plan.layouts[source]
        index = _expert_index(source)
        infos = {**layout.declared, **({"bias": layout.bias} if layout.bias is not None else {})}
        whole = {short: _expert_tensor(stacks[short], index, info) for short, info in infos.items()}
        for short in layout.tolerated:
            whole[short] = stacks[short][index]
        bias = whole.pop("bias", None)
        for layer in experts.layers[source]:
            tensors = {short: _rows(value, layer.rows) for short, value in whole.items()}
            yield layer, tensors, None if bias is None else _rows(bias, layer.rows)
