"""What every producer folder provides, and the pieces of detection they share.

A producer (compressed-tensors, ModelOpt, qscheme's own self-describing config, ...) is a
``Producer``: how its config is found and read, how it assigns modules their schemes, which
schemes it writes and how it writes its config, and the module holding its quantization
arithmetic. ``qscheme.producers.PRODUCERS`` lists them; the loader (``checkpoint.config``,
``checkpoint.detect``) and the writer (``writing.producer_config``, ``quantize.weight``) iterate
that list and know no producer by name.

Shared here, below every producer: ``ConfigFields`` (typed access to a JSON object, failing with
the file and key path), the view of a checkpoint as modules (grouping tensors by module, telling
quantized and linear modules apart), target matching (exact names, ``re:`` patterns, class
names) and ``ignored_by``, the one ignore matcher the loader and the writer use.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from qscheme.checkpoint.patterns import MAX_NAME_LENGTH, any_of, compile_pattern
from qscheme.checkpoint.patterns import PREFIX as PATTERN_PREFIX
from qscheme.descriptor import Scheme
from qscheme.descriptor.rules import RuleSchema
from qscheme.errors import CheckpointError
from qscheme.text import shown

if TYPE_CHECKING:
    from qscheme.storage import TensorInfo

CONFIG_FILE = "config.json"

# ---------------------------------------------------------------------------- the protocol


class ProducerConfig(Protocol):
    """What the loader asks of any producer's config (the typed value its reader returns)."""

    @property
    def file(self) -> str | None: ...
    @property
    def producer(self) -> str: ...
    @property
    def producer_version(self) -> str | None: ...
    @property
    def producer_note(self) -> str | None: ...
    @property
    def has_kv_cache(self) -> bool: ...


Modules = Mapping[str, Mapping[str, "TensorInfo"]]


@dataclass(frozen=True)
class Detected:
    """A producer's answer for a checkpoint: module -> (scheme, origin), ignored modules with the
    entry that matched, and the config's targets that matched no module."""

    assigned: dict[str, tuple[Scheme, str]]
    ignored: dict[str, str]
    unused_targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class WriteRequest:
    """What a producer's config writer is given (see ``writing.producer_config.config_files``)."""

    scheme: Scheme
    ignore: Sequence[str]
    unquantized_modules: Sequence[str]
    descriptor_text: str | None = None
    note: str | None = None


@dataclass(frozen=True)
class StackedExperts:
    """A producer that stores every expert of a fused experts module in one tensor per projection:
    ``<experts>.<projection><separator><tensor>`` with a leading expert dimension [E, ...].

    The loader splits each into ``<experts>.<e>.<projection>.<tensor>`` (``checkpoint.stacked_experts``),
    the per-expert modules every other producer stores, each reading its own bytes. ``folded`` names
    tensors stored with one trailing dimension more than the scheme declares ({"blocks": 16}: the
    codes [R, C/32, 16] are read as [R, C/2], the same bytes), and that dimension's size.

    ``members`` names projections that hold the rows of several per-expert layers other producers
    store apart ({"gate_up_proj": ("gate_proj", "up_proj")}); ``interleaved`` says their rows
    alternate (member j holds rows j, j + m, ... of m members, gpt-oss's gate/up) instead of
    following each other. ``qscheme convert`` writes the members (``writing.convert_experts``)."""

    projections: tuple[str, ...]
    separator: str = "_"
    folded: Mapping[str, int] = field(default_factory=dict)
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    interleaved: bool = False


@dataclass(frozen=True)
class Producer:
    """One producer: reading, detecting, writing and its arithmetic.

    - ``quant_method``: the config.json ``quantization_config.quant_method`` that names it;
    - ``label`` / ``listed_as``: its name in messages ("a ModelOpt export") and in the list of
      methods qscheme reads ("'modelopt'");
    - ``config_type``: the class its readers return;
    - ``read_section``: its config from config.json's ``quantization_config`` (``ConfigFields``);
    - ``own_file`` / ``read_own_file``: a file of its own that wins over config.json when present
      (ModelOpt's hf_quant_config.json); ``read_own_file(path, json_object)`` returns its config;
    - ``detect(config, modules, schemes, quantized_names)``: which scheme each module uses;
    - ``writes(scheme)``: whether it is the producer that writes checkpoints of ``scheme``;
    - ``write_config(request)``: (config.json's ``quantization_config``, other files by name);
    - ``arithmetic``: the module holding its quantization rules (imported by ``quantize.weight``,
      which registers them; None when it has none of its own);
    - ``overlap(a, b)``: a config both schemes' rules match (described, and the config object or
      None), for ``qscheme validate``; ``overlap_fix`` says how to tell such rules apart;
    - ``rule_schema``: its ``detect.<name>`` rule in scheme descriptors (``descriptor.rules``),
      registered for the descriptor's parser by ``qscheme.producers`` (None: it has no rule);
    - ``transformers_owns_method``: transformers has a quantizer of its own for ``quant_method``
      (``compressed-tensors``, ``fp8``, ``gptq``, ...). qscheme leaves that name to it and registers
      the opt-in ``qscheme-<quant_method>`` instead (``qscheme.transformers.via_qscheme``);
    - ``stacked_experts``: how it stores experts stacked in one tensor (None: one module per expert).
    """

    name: str
    quant_method: str
    config_type: type
    read_section: Callable[[ConfigFields], ProducerConfig]
    detect: Callable[[Any, Modules, list[Scheme], frozenset[str]], Detected]
    writes: Callable[[Scheme], bool]
    write_config: Callable[[WriteRequest], tuple[dict[str, Any], dict[str, dict[str, Any]]]]
    label: str
    listed_as: str
    own_file: str | None = None
    read_own_file: Callable[[str, Mapping[str, Any]], ProducerConfig] | None = None
    arithmetic: str | None = None
    overlap: Callable[[Scheme, Scheme], tuple[str, Any] | None] | None = None
    overlap_fix: str = ""
    rule_schema: RuleSchema | None = None
    transformers_owns_method: bool = False
    stacked_experts: StackedExperts | None = None


# ---------------------------------------------------------------------------- reading configs


@dataclass
class ConfigFields:
    """Typed access to one JSON object, failing with the file and key path."""

    file: str
    path: str
    items: Mapping[str, Any] = field(default_factory=dict)

    def _fail(self, key: str, expected: str, value: Any) -> CheckpointError:
        where = f"{self.path}.{key}" if self.path else key
        return CheckpointError(f"{self.file}: {where}: expected {expected}, found {json.dumps(value)}")

    def string(self, key: str, required: bool = False) -> str | None:
        value = self.items.get(key)
        if value is None:
            if required:
                raise self._fail(key, "a string", value)
            return None
        if not isinstance(value, str):
            raise self._fail(key, "a string", value)
        return value

    def integer(self, key: str) -> int | None:
        value = self.items.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, "an integer", value)
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.items.get(key)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self._fail(key, "a list of strings", value)
        return tuple(value)

    def mapping(self, key: str) -> Mapping[str, Any] | None:
        value = self.items.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self._fail(key, "an object", value)
        return value

    def child(self, key: str) -> ConfigFields | None:
        value = self.mapping(key)
        if value is None:
            return None
        return ConfigFields(self.file, f"{self.path}.{key}" if self.path else key, value)


# ---------------------------------------------------------------------------- module grouping


def natural_key(name: str) -> tuple[object, ...]:
    """Sort ``layers.2`` before ``layers.10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def split_name(tensor: str) -> tuple[str, str]:
    """``model.layers.0.q_proj.weight_scale`` -> (``model.layers.0.q_proj``, ``weight_scale``)."""
    module, _, short = tensor.rpartition(".")
    return module, short


def group_by_module(tensors: Mapping[str, TensorInfo], dotted: Iterable[str] = ()) -> dict[str, dict[str, TensorInfo]]:
    """Tensors by module and short name. ``dotted``: declared names that contain dots (bitsandbytes'
    ``weight.absmax``): a tensor ending in ``.<one of them>`` belongs to the module before it."""
    suffixes = sorted({f".{name}" for name in dotted if "." in name}, key=len, reverse=True)
    heads = {name.split(".", 1)[0] for name in dotted if "." in name}
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        suffix = next((end for end in suffixes if name.endswith(end) and len(name) > len(end)), None)
        if suffix is None and heads:
            # an undeclared ``<module>.weight.<other>`` next to declared ``weight.*`` tensors stays with
            # its module (where the scheme's check names it unexpected), not a module of its own
            parent, _, rest = name.rpartition(".")
            module_name, _, head = parent.rpartition(".")
            if head in heads and module_name and parent in tensors:
                suffix = f".{head}.{rest}"
        if suffix is not None:
            module, short = name[: -len(suffix)], suffix[1:]
        else:
            module, short = split_name(name)
        modules.setdefault(module, {})[short] = info
    return modules


def dotted_tensor_names(schemes: Iterable[Scheme]) -> frozenset[str]:
    """Every tensor name a scheme declares that contains a dot (``weight.absmax``)."""
    return frozenset(name for name in quantized_tensor_names(schemes) if "." in name)


def quantized_tensor_names(schemes: Iterable[Scheme]) -> frozenset[str]:
    """Every tensor name a scheme declares for a quantized linear, except the plain ``weight``."""
    names: set[str] = set()
    for scheme in schemes:
        names.update(spec.name for spec in scheme.tensor_specs().values())
        names.update(scheme.tolerated)
    names.discard("weight")
    return frozenset(names)


def looks_quantized(tensors: Mapping[str, TensorInfo], quantized_names: frozenset[str]) -> bool:
    """Does a module store quantized-linear tensors (see ``checkpoint.detect``'s docstring)?"""
    if any(short in quantized_names for short in tensors):
        return True
    weight = tensors.get("weight")
    return weight is not None and weight.dtype not in _float_dtypes()


@functools.cache
def _float_dtypes() -> frozenset[str]:
    """tensor_checks' float dtype names, imported on first use: it imports torch, and reading a
    producer config (this module's other users) does not need it."""
    from qscheme.tensor_checks import FLOAT_DTYPES

    return FLOAT_DTYPES


def looks_linear(tensors: Mapping[str, TensorInfo], quantized_names: frozenset[str]) -> bool:
    weight = tensors.get("weight")
    return looks_quantized(tensors, quantized_names) or (weight is not None and len(weight.shape) == 2)


# ---------------------------------------------------------------------------- target matching


def is_class_target(target: str) -> bool:
    return not target.startswith(PATTERN_PREFIX) and "." not in target and target[:1].isupper()


def is_linear_class(target: str) -> bool:
    return target.endswith("Linear")


def match_rank(module: str, target: str, quantized: bool, compiled: Mapping[str, re.Pattern[str]]) -> int | None:
    """0 exact name, 1 regex, 2 class name; None when the target does not match.

    ``compiled`` holds every ``re:`` target's pattern."""
    if target.startswith(PATTERN_PREFIX):
        return 1 if compiled[target].match(module) else None
    if target == module:
        return 0
    if is_class_target(target) and is_linear_class(target) and quantized:
        return 2
    return None


@dataclass(frozen=True)
class Entries:
    """Targets or ignore entries, each paired with its owner, prepared for thousands of modules:
    a module that no entry can match is told apart with a set lookup and one joined regex."""

    pairs: tuple[tuple[Any, str], ...]
    names: frozenset[str]
    linear_class: bool
    regexes: bool
    any_regex: re.Pattern[str] | None
    compiled: Mapping[str, re.Pattern[str]]

    @classmethod
    def of(cls, pairs: Iterable[tuple[Any, str]], compiled: Mapping[str, re.Pattern[str]]) -> Entries:
        pairs = tuple(pairs)
        entries = [entry for _, entry in pairs]
        return cls(
            pairs=pairs,
            names=frozenset(entries),
            linear_class=any(is_class_target(e) and is_linear_class(e) for e in entries),
            regexes=any(e.startswith(PATTERN_PREFIX) for e in entries),
            any_regex=any_of(entries, compiled),
            compiled=compiled,
        )

    def possible(self, module: str, quantized: bool) -> bool:
        """Whether any entry matches ``module`` (one set lookup and one joined regex)."""
        return (
            module in self.names
            or (self.linear_class and quantized)
            or (self.regexes and (self.any_regex is None or self.any_regex.match(module) is not None))
        )

    def matching(self, module: str, quantized: bool) -> list[tuple[int, Any, str]]:
        """(rank, owner, entry) of every entry that matches ``module``, in order (see match_rank)."""
        if not self.possible(module, quantized):
            return []
        return [
            (rank, owner, entry)
            for owner, entry in self.pairs
            if (rank := match_rank(module, entry, quantized, self.compiled)) is not None
        ]


@functools.lru_cache(maxsize=256)
def _checked_pattern(entry: str) -> re.Pattern[str]:
    """``compile_pattern`` for ``ignored_by``'s callers that pass no compiled entry (checked once)."""
    return compile_pattern(entry)


def ignored_by(module: str, entries: Iterable[str], compiled: Mapping[str, re.Pattern[str]]) -> str | None:
    """The first ignore entry matching ``module`` (exact name, ``re:`` pattern from ``compiled``, or
    shell wildcard), or None. The writer matches ``--ignore`` with this same function.

    Bounded whatever the caller passes: a ``re:`` entry missing from ``compiled`` is checked for
    catastrophic backtracking before it runs (``compile_pattern``, CheckpointError when refused),
    and a module name longer than MAX_NAME_LENGTH is a CheckpointError before any pattern runs."""
    if len(module) > MAX_NAME_LENGTH:
        raise CheckpointError(
            f"module {shown(module, 80)} has a name of {len(module):,} characters; qscheme matches names of at most "
            f"{MAX_NAME_LENGTH:,} characters (real module names are under ~300), so that re: patterns run in "
            "bounded time: rename the tensor, or re-export the checkpoint"
        )
    for entry in entries:
        if entry.startswith(PATTERN_PREFIX):
            pattern = compiled.get(entry)
            if pattern is None:
                pattern = _checked_pattern(entry)
            if pattern.match(module):
                return entry
        elif any(char in entry for char in "*?["):
            if fnmatch.fnmatchcase(module, entry):
                return entry
        elif entry == module:
            return entry
    return None
