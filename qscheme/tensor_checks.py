"""Check one layer's tensors against its scheme's declaration, before anything is built.

Two pure steps: ``check_layout`` (names, dtypes, shapes, from the tensors' facts alone: a
checkpoint's headers) and ``check_values`` (global and static scales > 0 and finite, weight
group / block scales finite and not negative, a bias finite, once the small tensors are read).
Each returns every problem it finds, each naming the file, the tensor, what was expected and
what was found; the loader raises them together. ``check_given`` runs both over one layer's
tensors given in memory (``QuantLinear.from_tensors``, ``dequantize_weight``), so that the API
refuses what the loader refuses.

Below the loader: the checks take any tensor facts with a name, dtype, shape and file (the
loader's ``TensorInfo``, or ``GivenTensor`` for tensors in memory), so that the modules a user
holds (``qscheme.modules``) check their tensors without importing the checkpoint loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from qscheme.api_checks import require_tensor_mapping
from qscheme.canonical import layer_state, stored_layer_shape
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.errors import QuantizeError
from qscheme.formats.scale_values import any_negative, any_nonfinite, negative, nonfinite, not_positive
from qscheme.text import shown_file

BIAS = "bias"  # a layer's bias, under its module: not declared by schemes, always allowed
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class TensorFacts(Protocol):
    """What the layout checks read of one tensor: its full name, dtype (torch name), shape and file."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def file(self) -> Path: ...


Facts = TypeVar("Facts", bound=TensorFacts)
Facts_co = TypeVar("Facts_co", bound=TensorFacts, covariant=True)


class LayerTensors(Protocol[Facts_co]):
    """One quantized module to check: its name, scheme, why it has that scheme (the config's
    origin), and its tensors' facts by short name (the loader's ``ModuleAssignment``)."""

    @property
    def module(self) -> str: ...

    @property
    def scheme(self) -> Scheme: ...

    @property
    def origin(self) -> str: ...

    @property
    def tensors(self) -> Mapping[str, Facts_co]: ...


@dataclass(frozen=True)
class GivenTensor:
    """The facts of a tensor given in memory; ``file`` names where it came from (a scheme)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path


@dataclass(frozen=True)
class GivenLayer:
    """One layer's tensors given in memory, as ``check_layout`` takes them."""

    module: str
    scheme: Scheme
    origin: str
    tensors: Mapping[str, GivenTensor]


@dataclass(frozen=True)
class TensorProblem:
    """One thing wrong with one tensor (or a missing one) of a module."""

    file: str
    tensor: str
    message: str

    def __str__(self) -> str:  # the file's name is the checkpoint's: escaped, so it cannot forge a line
        return f"{shown_file(Path(self.file))}: tensor {self.tensor!r}: {self.message}"


@dataclass(frozen=True)
class ModuleLayout(Generic[Facts]):
    """What the tensors' facts say about one quantized module, and what is wrong with it."""

    module: str
    scheme: Scheme
    n: int
    k: int
    declared: dict[str, Facts]  # checkpoint short name -> facts, declared by the scheme
    tolerated: tuple[str, ...]  # short names dropped because the scheme tolerates them
    bias: Facts | None
    problems: list[TensorProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _full(module: str, short: str) -> str:
    return f"{module}.{short}" if module else short


def _shape_list(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_layout(
    assignment: LayerTensors[Facts], weight_shape: tuple[int, int] | None = None, may_be_absent: Iterable[str] = ()
) -> ModuleLayout[Facts]:
    """Names, dtypes and shapes of one module's tensors against its scheme (headers only);
    the roles in ``may_be_absent`` are not required."""
    scheme, module, tensors = assignment.scheme, assignment.module, assignment.tensors
    specs = scheme.tensor_specs()
    problems: list[TensorProblem] = []
    any_file = str(next(iter(tensors.values())).file) if tensors else "?"
    weight_spec = scheme.weight.tensor
    weight = tensors.get(weight_spec.name)
    n = k = 0
    if weight is None:
        problems.append(
            TensorProblem(
                any_file,
                _full(module, weight_spec.name),
                f"missing: scheme {scheme.name} stores the weight as {weight_spec.name!r}; "
                f"found only {', '.join(sorted(tensors)) or 'nothing'}",
            )
        )
    elif len(weight.shape) != 2:
        problems.append(
            TensorProblem(
                str(weight.file),
                weight.name,
                f"expected a 2-D weight {weight_spec.describe_shapes()}, found shape {_shape_list(weight.shape)}",
            )
        )
    elif 0 in weight.shape:
        problems.append(
            TensorProblem(
                str(weight.file),
                weight.name,
                f"expected a weight {weight_spec.describe_shapes()} with N >= 1 and K >= 1, found shape "
                f"{_shape_list(weight.shape)}: an empty layer; re-export it, or drop the module",
            )
        )
    elif scheme.weight.state is not None and weight_shape is None:
        pass  # N and K are in the layer's state, which is missing or reported: the shapes are unknown
    else:
        try:
            n, k = stored_layer_shape(scheme, weight.shape, weight_shape)
        except QuantizeError as exc:  # K (or N) is ambiguous without the weight_shape tensor
            problems.append(TensorProblem(str(weight.file), weight.name, str(exc)))
    origin = f"N={n}, K={k}"
    if weight is not None and weight_shape is None:
        origin += f" from {weight_spec.name} {_shape_list(weight.shape)}"
    elif weight_shape is not None:
        origin += " from weight_shape"

    declared: dict[str, Facts] = {}
    optional_roles = {"weight", *may_be_absent}  # the weight's absence is reported above
    for role, spec in specs.items():
        info = tensors.get(spec.name)
        if info is None:
            if not spec.optional and role not in optional_roles:
                problems.append(
                    TensorProblem(
                        any_file,
                        _full(module, spec.name),
                        f"missing: scheme {scheme.name} declares {spec.name} ({role}) as "
                        f"{'/'.join(spec.dtypes)} {spec.describe_shapes()}",
                    )
                )
            continue
        declared[spec.name] = info
        # the weight_shape tensor's own shape ([2]) does not depend on N and K
        shape_known = (n > 0 and k > 0) or spec is scheme.weight.shape_tensor
        problems.extend(_check_tensor(spec, info, n, k, origin, shape_known))

    tolerated = tuple(sorted(short for short in tensors if short in scheme.tolerated and short not in declared))
    bias = tensors.get(BIAS)
    if bias is not None and bias.dtype not in FLOAT_DTYPES:
        problems.append(
            TensorProblem(
                str(bias.file),
                bias.name,
                f"expected a float bias ({' or '.join(sorted(FLOAT_DTYPES))}), found {bias.dtype}; "
                "a bias is added to the float output: store it in the model's float dtype",
            )
        )
    if bias is not None and bias.shape != (n,) and n:
        problems.append(
            TensorProblem(
                str(bias.file), bias.name, f"expected bias shape [{n}] ({origin}), found {_shape_list(bias.shape)}"
            )
        )
    known = set(declared) | set(tolerated) | {BIAS}
    for short in sorted(set(tensors) - known):
        info = tensors[short]
        allowed = sorted({spec.name for spec in specs.values()} | set(scheme.tolerated) | {BIAS})
        problems.append(
            TensorProblem(
                str(info.file),
                info.name,
                f"unexpected for scheme {scheme.name} ({assignment.origin}); the scheme declares {', '.join(allowed)}"
                + _UNSUPPORTED_TENSORS.get(short, ""),
            )
        )
    return ModuleLayout(
        module=module,
        scheme=scheme,
        n=n,
        k=k,
        declared=declared,
        tolerated=tolerated,
        bias=bias,
        problems=problems,
    )


def _check_tensor(
    spec: TensorSpec, info: TensorFacts, n: int, k: int, origin: str, shape_known: bool
) -> list[TensorProblem]:
    problems = []
    if info.dtype not in spec.dtypes:
        problems.append(
            TensorProblem(str(info.file), info.name, f"expected dtype {' or '.join(spec.dtypes)}, found {info.dtype}")
        )
    if not spec.shapes:  # a JSON state tensor: a 1-D byte string of any length
        if len(info.shape) != 1:
            problems.append(
                TensorProblem(
                    str(info.file), info.name, f"expected a 1-D uint8 tensor of JSON, found {_shape_list(info.shape)}"
                )
            )
    elif shape_known:
        expected = spec.expected_shapes(n, k)
        if not expected:
            problems.append(
                TensorProblem(
                    str(info.file),
                    info.name,
                    f"shape {spec.describe_shapes()} does not divide for {origin}; found {_shape_list(info.shape)}",
                )
            )
        elif info.shape not in expected:
            shown = " or ".join(_shape_list(s) for s in expected)
            problems.append(
                TensorProblem(
                    str(info.file),
                    info.name,
                    f"expected shape {spec.describe_shapes()} = {shown}{f' for {origin}' if n and k else ''}, "
                    f"found {_shape_list(info.shape)}",
                )
            )
    return problems


# Tensors of producer features no scheme describes: why they cannot load, and what would.
_UNSUPPORTED_TENSORS = {
    "weight_g_idx": ". weight_g_idx holds GPTQ activation ordering by group (actorder: group): each column takes "
    "the scale of the group its index names, which no scheme describes; re-export with actorder 'weight' or "
    "'static' (or none), which keep groups contiguous",
    "pre_quant_scale": ". pre_quant_scale is an AWQ input pre-scale, which this scheme does not take (ModelOpt writes "
    "it for int4 AWQ layers, which modelopt/W4A16_AWQ loads); re-export this layer without AWQ smoothing",
}

# ---------------------------------------------------------------------------- values


def _first(value: Tensor, mask: Tensor) -> str:
    index = int(mask.reshape(-1).nonzero()[0, 0])
    element = value.reshape(-1)[index]
    shown = element.to(torch.float32).item() if element.dtype != torch.uint8 else f"byte 0x{int(element):02X}"
    position = list(torch.unravel_index(torch.tensor(index), value.shape)) if value.dim() else []
    where = f" at {[int(p) for p in position]}" if position else ""
    return f"{shown}{where}"


def _value_roles(scheme: Scheme) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(positive scales: global and static activation scales; finite-only scales)."""
    positive: list[TensorSpec] = []
    # packed blocks hold their scales inside the weight: qscheme.canonical_blocks checks their fields
    finite: list[TensorSpec] = [] if scheme.weight.blocks is not None else [scheme.weight.scale.tensor]
    quantized = scheme.weight.scale.quantized
    if quantized is not None:  # uint8 codes: their table and outer scales are what must be finite
        finite = [quantized.table, quantized.scale]
    if scheme.weight.global_scale is not None:
        positive.append(scheme.weight.global_scale.tensor)
    activation = scheme.activation
    if activation is not None:
        if activation.global_scale is not None:
            positive.append(activation.global_scale.tensor)
        if activation.scale is not None:
            positive.append(activation.scale.tensor)
    if scheme.input_pre_scale is not None:
        finite.append(scheme.input_pre_scale)
    return positive, finite


def value_tensor_names(scheme: Scheme) -> list[str]:
    """The declared tensors whose values ``check_values`` reads (besides the bias)."""
    positive, finite = _value_roles(scheme)
    return [spec.name for spec in positive + finite]


def value_reads(layout: ModuleLayout, every_declared: bool = False) -> dict[str, str]:
    """Short name -> tensor name of what to read for ``check_values``: the scales it checks (or
    every declared tensor, which canonicalization needs too) and the bias."""
    shorts = layout.declared if every_declared else value_tensor_names(layout.scheme)
    reads = {short: layout.declared[short].name for short in shorts if short in layout.declared}
    if layout.bias is not None:
        reads[BIAS] = layout.bias.name
    return reads


def _nonfinite_problem(value: Tensor, info: TensorFacts, expected: str, advice: str = "") -> TensorProblem:
    """``expected <what>, found N NaN/inf values (first: ...)`` for a tensor holding some."""
    bad = nonfinite(value)
    count = int(bad.sum())
    return TensorProblem(
        str(info.file),
        info.name,
        f"expected {expected}, found {count} NaN/inf value{'s' if count > 1 else ''} (first: {_first(value, bad)})"
        + advice,
    )


def check_values(layout: ModuleLayout, tensors: Mapping[str, Tensor]) -> list[TensorProblem]:
    """Global / static scales finite and > 0; every scale finite (no NaN, no inf); weight group
    and block scales not negative (producers store magnitudes; a negative one is corrupt);
    the bias, when given under ``bias``, finite."""
    problems: list[TensorProblem] = []
    positive, finite = _value_roles(layout.scheme)
    for spec in positive:
        value = tensors.get(spec.name)
        info = layout.declared.get(spec.name)
        if value is None or info is None:
            continue
        bad = not_positive(value)
        if bool(bad.any()):
            problems.append(
                TensorProblem(
                    str(info.file),
                    info.name,
                    f"expected a finite scale > 0, found {_first(value, bad)}; a zero, negative or "
                    "non-finite global or static scale cannot be dequantized: re-export the layer",
                )
            )
    for spec in finite:
        value = tensors.get(spec.name)
        info = layout.declared.get(spec.name)
        if value is None or info is None:
            continue
        if any_nonfinite(value):
            problems.append(_nonfinite_problem(value, info, "finite scales"))
    problems.extend(_negative_weight_scales(layout, tensors))
    bias, bias_info = tensors.get(BIAS), layout.bias
    if bias is not None and bias_info is not None and bias.is_floating_point() and any_nonfinite(bias):
        advice = "; every output through it would be NaN/inf: re-export the layer"
        problems.append(_nonfinite_problem(bias, bias_info, "a finite bias", advice))
    return problems


def _negative_weight_scales(layout: ModuleLayout, tensors: Mapping[str, Tensor]) -> list[TensorProblem]:
    if layout.scheme.weight.blocks is not None:
        return []  # block scales may be negative (llama.cpp's Q4_0 divides by -8): they are not magnitudes
    if layout.scheme.weight.scale.signed:
        return []  # the scheme says its producer stores signed scales (AutoRound's symmetric ones)
    spec = layout.scheme.weight.scale.tensor
    value, info = tensors.get(spec.name), layout.declared.get(spec.name)
    if value is None or info is None or not any_negative(value):
        return []
    bad = negative(value)
    count = int(bad.sum())
    return [
        TensorProblem(
            str(info.file),
            info.name,
            f"expected weight scales >= 0, found {count} negative value{'s' if count > 1 else ''} "
            f"(first: {_first(value, bad)}); producers store scale magnitudes, so the file is corrupt: "
            "re-export the layer",
        )
    ]


# ---------------------------------------------------------------------------- given tensors


def _given_weight_shape(scheme: Scheme, tensors: Mapping[str, Tensor]) -> tuple[int, int] | None:
    """N, K from a declared weight_shape tensor of the right dtype and size (else None:
    ``check_layout`` then reports it, or infers the shape from the stored weight)."""
    if scheme.weight.state is not None:
        state_tensor = tensors.get(scheme.weight.state.tensor.name)
        if state_tensor is None or state_tensor.dtype != torch.uint8 or state_tensor.ndim != 1:
            return None  # check_layout reports it
        state = layer_state(scheme, tensors)
        return None if state is None else state.shape
    spec = scheme.weight.shape_tensor
    value = tensors.get(spec.name) if spec is not None else None
    if spec is None or value is None or _dtype_name(value) not in spec.dtypes or value.numel() != 2:
        return None
    n, k = (int(v) for v in value.reshape(-1).tolist())
    if n <= 0 or k <= 0:
        raise QuantizeError(
            f"scheme {scheme.name}: tensor {spec.name!r} holds [{n}, {k}]; expected two positive sizes [N, K]"
        )
    return n, k


def _dtype_name(value: Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


_INPUT_ROLES = ("input_scale", "input_global_scale", "input_pre_scale")


def check_given(
    scheme: Scheme, tensors: Mapping[str, object], layer: str | None = None, weight_only: bool = False
) -> ModuleLayout[GivenTensor]:
    """The layout of one layer's tensors given in memory, keyed by checkpoint short name, with
    every problem in its ``problems``:
    names (missing, undeclared: a misspelt optional tensor would otherwise be dropped), dtypes,
    shapes and values, as the checkpoint loader checks them. Tolerated names and ``bias`` pass.
    ``weight_only``: the activation's tensors may be absent (only the weight is wanted).

    Raises QuantizeError at once for a key that is not a str or a value that is not a dense,
    materialised tensor (``qscheme.api_checks``: nothing else can be checked).
    """
    source = f"scheme {scheme.name}"
    given = dict(require_tensor_mapping(tensors, source, scheme.weight.tensor.name))
    module = layer or ""
    infos = {
        short: GivenTensor(_full(module, short), _dtype_name(value), tuple(value.shape), Path(source))
        for short, value in given.items()
    }
    assignment = GivenLayer(module, scheme, "given tensors", infos)
    layout = check_layout(assignment, _given_weight_shape(scheme, given), _INPUT_ROLES if weight_only else ())
    if not layout.problems:
        layout.problems.extend(check_values(layout, given))
    return layout


def require_valid_tensors(
    scheme: Scheme, tensors: Mapping[str, Tensor], layer: str | None = None, weight_only: bool = False
) -> tuple[int, int]:
    """``check_given``, raising QuantizeError that lists every problem found; else the layer's
    N and K (to hand to ``canonicalize``, which would otherwise work them out again)."""
    if not isinstance(tensors, Mapping):
        raise QuantizeError(
            f"scheme {scheme.name}: tensors must be a mapping of checkpoint names to tensors "
            f"(e.g. {{'{scheme.weight.tensor.name}': ...}}), not {type(tensors).__name__}"
        )
    layout = check_given(scheme, tensors, layer, weight_only)
    problems = layout.problems
    if problems:
        listed = "\n".join(f"  tensor {problem.tensor!r}: {problem.message}" for problem in problems)
        where = f"layer {layer}, scheme {scheme.name}" if layer else f"scheme {scheme.name}"
        raise QuantizeError(f"{where}: {len(problems)} problem(s) with the given tensors:\n{listed}")
    return layout.n, layout.k
