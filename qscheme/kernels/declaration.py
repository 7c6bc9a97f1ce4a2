"""Kernel declarations: what a kernel implements and where it runs, as plain frozen data.

A plugin builds its declarations at import time, and ``qscheme kernels`` lists them, without
importing any kernel code: this module imports nothing heavy (no torch). The code itself is
named by ``implementation`` ("module:attribute") and imported only when a layer uses it.

Vocabulary (the same words the scheme descriptors use):

- weight families: ``nvfp4`` (e2m1 + e4m3 group scales), ``mxfp4`` (e2m1 + e8m0), ``fp4``,
  ``int4``, ``int8``, ``fp8`` (see ``qscheme.descriptor.model.weight_family``), and ``blocks``
  (packed blocks whose layout a descriptor declares: GGUF's types; a kernel takes them only by
  naming the family), and ``codebook`` (codes indexing a table a descriptor declares: NF4; likewise);
- activation families: ``none`` (16-bit or fp32 inputs, weight-only) or a family as above;
- weight scale granularities: tensor, channel, group, block; activation ones: tensor, token,
  group;
- device types: cpu, cuda, rocm, mps, xpu; CUDA compute capabilities as (major, minor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from qscheme.descriptor.model import (
    ACTIVATION_FORMATS,
    ACTIVATION_GRANULARITIES,
    BLOCKS,
    CODEBOOK,
    GRANULARITIES,
    SCALE_FORMATS,
    weight_family,
)
from qscheme.formats.table import weight_formats
from qscheme.kernels.versions import parse_specifier

if TYPE_CHECKING:
    from collections.abc import Sequence

    from qscheme.kernels.problem import Problem

Capability = tuple[int, int]

WEIGHT_FAMILIES: tuple[str, ...] = ("nvfp4", "mxfp4", "fp4", "int2", "int3", "int4", "int8", "fp8", BLOCKS, CODEBOOK)
# The element formats a descriptor's weight may name (qscheme.formats.table's weight rows).
WEIGHT_ELEMENT_FORMATS: tuple[str, ...] = weight_formats()
ACTIVATION_FAMILIES: tuple[str, ...] = ("none", "nvfp4", "mxfp4", "fp4", "int8", "fp8")
WEIGHT_GRANULARITIES: tuple[str, ...] = GRANULARITIES
# The element and scale formats a descriptor's activation block may name (its ``format`` and
# ``scale_format`` / ``scale.format``), as the descriptor model lists them, and the element
# formats of each activation family (as ``weight_family`` groups them).
ACTIVATION_SCALE_FORMATS: tuple[str, ...] = SCALE_FORMATS
FAMILY_FORMATS: dict[str, tuple[str, ...]] = {
    family: tuple(
        element
        for element in ACTIVATION_FORMATS
        if any(weight_family(element, scale) == family for scale in ACTIVATION_SCALE_FORMATS)
    )
    for family in ACTIVATION_FAMILIES
    if family != "none"
}
DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "rocm", "mps", "xpu")
ANY_DEVICE = "any"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _format_in_families(element: str, families: tuple[str, ...]) -> bool:
    """Whether some scale format makes ``element`` a weight of one of ``families``."""
    return any(weight_family(element, scale) in families for scale in SCALE_FORMATS)


def format_capability(capability: Capability) -> str:
    """(10, 0) -> ``10.0``."""
    return f"{capability[0]}.{capability[1]}"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _tuple_of(value: object, kind: type, what: str) -> None:
    _require(
        isinstance(value, tuple) and all(isinstance(v, kind) for v in value),
        f"{what} must be a tuple of {kind.__name__}, not {value!r}",
    )


@dataclass(frozen=True)
class CapabilityRange:
    """CUDA compute capabilities from ``low`` to ``high`` inclusive; ``high=None`` means "or newer".

    Hardware families are ranges, not minimums: Blackwell datacenter parts are 10.0-10.3 and
    consumer Blackwell 12.0-12.1, two ranges with different instructions.
    """

    low: Capability
    high: Capability | None = None

    def __post_init__(self) -> None:
        for end in (self.low, self.high):
            if end is None:
                continue
            _require(
                isinstance(end, tuple) and len(end) == 2 and all(isinstance(v, int) and v >= 0 for v in end),
                f"a compute capability is (major, minor), not {end!r}",
            )
        _require(self.high is None or self.high >= self.low, f"capability range {self.low}-{self.high} is empty")

    def contains(self, capability: Capability) -> bool:
        return capability >= self.low and (self.high is None or capability <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{format_capability(self.low)} or newer"
        if self.high == self.low:
            return format_capability(self.low)
        return f"{format_capability(self.low)}-{format_capability(self.high)}"


def describe_capabilities(ranges: tuple[CapabilityRange, ...]) -> str:
    """``compute capability 10.0-10.3 or 12.0-12.1`` (never a toolkit-looking ``CUDA>=``)."""
    return "compute capability " + " or ".join(str(r) for r in ranges)


@dataclass(frozen=True)
class DeviceSupport:
    """One device type a kernel runs on and what it needs there.

    ``capabilities`` (CUDA only) lists accepted compute-capability ranges, empty for any;
    ``environment`` lists variables that must have a value, e.g. (("TRITON_INTERPRET", "1"),)
    for a Triton kernel interpreted on a CPU. ``type`` may be ``"any"``.
    """

    type: str
    capabilities: tuple[CapabilityRange, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _require(
            self.type in (*DEVICE_TYPES, ANY_DEVICE),
            f"device type {self.type!r} is not one of {', '.join((*DEVICE_TYPES, ANY_DEVICE))}",
        )
        _tuple_of(self.capabilities, CapabilityRange, "capabilities")
        _tuple_of(self.environment, tuple, "environment")

    def describe(self) -> str:
        text = "any device" if self.type == ANY_DEVICE else self.type
        if self.capabilities:
            text += f" ({describe_capabilities(self.capabilities)})"
        if self.environment:
            text += " with " + ", ".join(f"{name}={value}" for name, value in self.environment)
        return text


@dataclass(frozen=True)
class ActivationSupport:
    """An activation format a kernel takes: a family and, where it matters, how it is scaled.

    ``none`` means the inputs are not quantized (16-bit or fp32). None in ``granularity``,
    ``group_size`` and ``dynamic`` means "any"; so does an empty ``formats`` (element formats,
    e.g. ``("e4m3",)`` where the family ``fp8`` would also take ``e5m2``) or ``scale_formats``
    (the activation's ``scale_format``; a static activation's ``scale.format`` as well, and a
    kernel must take both). FP8 static per tensor is ``("fp8", "tensor", dynamic=False)``;
    NVFP4's dynamic groups of 16 (with a static global scale) ``("nvfp4", "group", 16, True)``;
    FP8 e4m3 dynamic per token with float32 scales
    ``("fp8", "token", dynamic=True, formats=("e4m3",), scale_formats=("fp32", "float"))``.
    """

    family: str
    granularity: str | None = None
    group_size: int | None = None
    dynamic: bool | None = None
    formats: tuple[str, ...] = ()
    scale_formats: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(
            self.family in ACTIVATION_FAMILIES,
            f"activation family {self.family!r} is not one of {', '.join(ACTIVATION_FAMILIES)}",
        )
        _require(
            self.granularity is None or self.granularity in ACTIVATION_GRANULARITIES,
            f"activation granularity {self.granularity!r} is not one of {', '.join(ACTIVATION_GRANULARITIES)}",
        )
        _tuple_of(self.formats, str, "activation formats")
        _tuple_of(self.scale_formats, str, "activation scale_formats")
        if self.family == "none":
            _require(
                not self.formats and not self.scale_formats,
                "activation family 'none' (16-bit inputs) takes no formats or scale_formats",
            )
            return
        family_formats = FAMILY_FORMATS[self.family]
        bad = [f for f in self.formats if f not in family_formats]
        _require(
            not bad,
            f"activation formats {bad} are not {self.family} element formats ({', '.join(family_formats)})",
        )
        bad = [f for f in self.scale_formats if f not in ACTIVATION_SCALE_FORMATS]
        _require(not bad, f"activation scale_formats {bad} are not among {', '.join(ACTIVATION_SCALE_FORMATS)}")

    def describe(self, formats: bool = False) -> str:
        """``fp8 dynamic per token``; with ``formats``, ``fp8 dynamic per token (e4m3, fp32/float scales)``."""
        if self.family == "none":
            return "none (16-bit)"
        parts = [self.family]
        if self.dynamic is not None:
            parts.append("dynamic" if self.dynamic else "static")
        if self.granularity == "group":
            parts.append(f"per group of {self.group_size}" if self.group_size else "per group")
        elif self.granularity is not None:
            parts.append(f"per {self.granularity}")
        text = " ".join(parts)
        if formats:
            details = []
            if self.formats:
                details.append("/".join(self.formats))
            if self.scale_formats:
                details.append("/".join(self.scale_formats) + " scales")
            if details:
                text += f" ({', '.join(details)})"
        return text


WEIGHT_ONLY = ActivationSupport("none")


@dataclass(frozen=True)
class Supports:
    """One set of scheme features a kernel implements; a kernel lists one or more.

    Empty tuples mean "any". ``weight_formats`` names the weight element formats taken (e.g.
    ``("e4m3",)`` where the family ``fp8`` would also take ``e5m2``; ``("int4", "uint4")``).
    ``group_sizes`` applies to group-wise weight scales, ``blocks`` to block-wise ones.
    ``per_partition_scales``: the kernel takes one global (or per-tensor) scale per fused
    partition, so fused layers whose partitions' scales differ run exactly.
    ``input_pre_scale``: the kernel multiplies the input by a per-channel pre-scale (AWQ).
    ``input_permutation``: the kernel takes a canonical weight whose columns are the input
    channels permuted (``CanonicalWeight.input_permutation``, GPTQ act-order): it permutes its
    input the same way, or dequantizes the weight in the input's order.
    ``block_codes``: for the ``blocks`` family, the codes taken (``BlockLayout.code_kind``:
    ``uint4`` for an affine 4-bit code, ``table4``, ``e2m1``, ...); empty takes any. The group
    size of packed blocks is their finest scale's sub-block.
    ``priority``: the kernel's priority for the schemes this entry takes, where it differs from
    the kernel's own (None: the kernel's). A scheme several entries take gets the highest of
    theirs (``KernelDeclaration.priority_for``). This is how a kernel that is fastest for some
    formats only ranks first for those, with the measurement in the declaration's notes.
    """

    weights: tuple[str, ...]
    activations: tuple[ActivationSupport, ...] = (WEIGHT_ONLY,)
    weight_formats: tuple[str, ...] = ()
    granularities: tuple[str, ...] = ()
    group_sizes: tuple[int, ...] = ()
    blocks: tuple[tuple[int, int], ...] = ()
    scale_formats: tuple[str, ...] = ()
    zero_points: bool = False
    per_partition_scales: bool = False
    input_pre_scale: bool = False
    block_codes: tuple[str, ...] = ()
    input_permutation: bool = False
    priority: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.priority is None or (isinstance(self.priority, int) and not isinstance(self.priority, bool)),
            f"priority must be an int or None, not {self.priority!r}",
        )
        _tuple_of(self.weights, str, "weights")
        _require(bool(self.weights), "weights must name at least one weight family")
        unknown = [w for w in self.weights if w not in WEIGHT_FAMILIES]
        _require(not unknown, f"weight families {unknown} are not among {', '.join(WEIGHT_FAMILIES)}")
        _tuple_of(self.activations, ActivationSupport, "activations")
        _require(bool(self.activations), "activations must list at least one ActivationSupport")
        _tuple_of(self.weight_formats, str, "weight_formats")
        bad = [f for f in self.weight_formats if f not in WEIGHT_ELEMENT_FORMATS]
        _require(not bad, f"weight_formats {bad} are not among {', '.join(WEIGHT_ELEMENT_FORMATS)}")
        foreign = [f for f in self.weight_formats if not _format_in_families(f, self.weights)]
        _require(
            not foreign,
            f"weight_formats {foreign} are not element formats of the families {', '.join(self.weights)}",
        )
        _tuple_of(self.granularities, str, "granularities")
        bad = [g for g in self.granularities if g not in WEIGHT_GRANULARITIES]
        _require(not bad, f"granularities {bad} are not among {', '.join(WEIGHT_GRANULARITIES)}")
        _tuple_of(self.group_sizes, int, "group_sizes")
        _tuple_of(self.blocks, tuple, "blocks")
        _tuple_of(self.scale_formats, str, "scale_formats")
        _tuple_of(self.block_codes, str, "block_codes")

    def describe(self) -> str:
        """``nvfp4 weights (group 16) x none (16-bit), nvfp4 dynamic per group of 16``."""
        details = []
        if self.weight_formats:
            details.append("/".join(self.weight_formats))
        if self.granularities:
            details.append("/".join(self.granularities))
        if self.group_sizes:
            details.append("group " + "/".join(str(g) for g in self.group_sizes))
        if self.blocks:
            details.append("blocks " + "/".join(f"{r}x{c}" for r, c in self.blocks))
        if self.scale_formats:
            details.append("/".join(self.scale_formats) + " scales")
        if self.zero_points:
            details.append("zero points")
        if self.block_codes:
            details.append("/".join(self.block_codes) + " codes")
        weights = ", ".join(self.weights) + " weights"
        if details:
            weights += f" ({', '.join(details)})"
        ranked = "" if self.priority is None else f" [priority {self.priority}]"
        return f"{weights} x {', '.join(a.describe() for a in self.activations)}{ranked}"


# Every weight family with 16-bit activations, zero points included: the entry of a kernel that
# dequantizes any weight of a scale-and-codes layout (with per-partition scales and AWQ
# pre-scales). Packed blocks are a family of their own (BLOCKS_WEIGHT_ONLY): a kernel decodes
# them only where it says so.
BLOCKS_WEIGHT_ONLY = Supports(weights=(BLOCKS,), activations=(WEIGHT_ONLY,))
"""Packed blocks of any declared layout, with 16-bit or fp32 activations (the reference kernel)."""
CODEBOOK_WEIGHT_ONLY = Supports(weights=(CODEBOOK,), activations=(WEIGHT_ONLY,), per_partition_scales=True)
"""Codes indexing a declared table (``weight.table``: NF4, bitsandbytes' FP4) with group scales, with
16-bit or fp32 activations: a kernel decodes them only where it says so (the reference and Triton kernels)."""

ANY_WEIGHT_ONLY = Supports(
    weights=("nvfp4", "mxfp4", "fp4", "int2", "int3", "int4", "int8", "fp8"),
    activations=(WEIGHT_ONLY,),
    zero_points=True,
    per_partition_scales=True,
    input_pre_scale=True,
)

# The activation-quantized pairs that deployed W8A8-style kernels run besides NVFP4 x NVFP4 (whose
# block-scale limits differ per kernel): FP8 (e4m3) x FP8 static per tensor, dynamic per token and
# per group of 128; int8 (and uint8, with or without zero points) x int8 per token; MXFP4 x MXFP4.
# Both built-in kernels dequantize the weight (zero points included) independently of how the
# input is quantized, so the weight side is as general as weight-only. Element and scale formats are those
# qscheme.emulation.SUPPORTED_ACTIVATIONS emulates and the Triton pre-pass quantizes
# (qscheme.triton.spec): float scales of any width for a static scale (both the activation's
# scale_format and its scale.format), float32 ones for dynamic scales; no e5m2 or uint8 inputs.
# A kernel implementing all of them (with per-partition scales and AWQ pre-scales) lists these
# entries as they are.
FLOAT_SCALE_FORMATS: tuple[str, ...] = ("fp32", "float")
STATIC_FLOAT_SCALE_FORMATS: tuple[str, ...] = ("fp32", "float", "fp16", "bf16")
DEPLOYED_ACTIVATION_PAIRS: tuple[Supports, ...] = (
    Supports(
        weights=("fp8",),
        activations=(
            ActivationSupport(
                "fp8", "tensor", dynamic=False, formats=("e4m3",), scale_formats=STATIC_FLOAT_SCALE_FORMATS
            ),
            ActivationSupport("fp8", "token", dynamic=True, formats=("e4m3",), scale_formats=FLOAT_SCALE_FORMATS),
            ActivationSupport("fp8", "group", 128, dynamic=True, formats=("e4m3",), scale_formats=FLOAT_SCALE_FORMATS),
        ),
        per_partition_scales=True,
        input_pre_scale=True,
    ),
    Supports(
        weights=("int8",),
        activations=(
            ActivationSupport("int8", "token", dynamic=True, formats=("int8",), scale_formats=FLOAT_SCALE_FORMATS),
        ),
        zero_points=True,
        per_partition_scales=True,
        input_pre_scale=True,
    ),
    Supports(
        weights=("mxfp4",),
        activations=(
            ActivationSupport("mxfp4", "group", 32, dynamic=True, formats=("e2m1",), scale_formats=("e8m0",)),
        ),
        per_partition_scales=True,
        input_pre_scale=True,
    ),
)

# NVFP4 activations as the built-in kernels quantize them: e2m1 in dynamic groups of 16 with e4m3
# block scales (and a static global scale).
NVFP4_ACTIVATIONS = ActivationSupport("nvfp4", "group", 16, dynamic=True, formats=("e2m1",), scale_formats=("e4m3",))

# NVFP4 activations with e2m1 weights, as the built-in kernels (reference, triton) run them: NVFP4
# weights (e4m3 scales) and FP4 weights with float scales, any scale granularity and group size
# (the weight is dequantized, or its scales decoded in the K loop, independently of the input's
# groups of 16).
NVFP4_ACTIVATION_PAIR = Supports(
    weights=("nvfp4", "fp4"),
    activations=(NVFP4_ACTIVATIONS,),
    per_partition_scales=True,
    input_pre_scale=True,
)


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one problem check: ok, or the reason it failed and what would fix it."""

    ok: bool
    reason: str = ""
    hint: str = ""


PASSED = CheckResult(True)


@runtime_checkable
class ProblemCheck(Protocol):
    """A condition on the layer (N, K, activation dtype, ...): plain data with a ``check``."""

    def check(self, problem: Problem) -> CheckResult: ...

    def describe(self) -> str: ...


def describe_check(check: ProblemCheck) -> str:
    """``check.describe()``; a plugin's describe() that raises (or returns a non-str) is shown as
    such, so listing the kernels never fails on one plugin's bug."""
    try:
        text = check.describe()
    except (Exception, SystemExit) as error:
        return f"{type(check).__name__} (its describe() raised {type(error).__name__}: {error})"
    return text if isinstance(text, str) else f"{type(check).__name__} (its describe() returned {text!r:.60})"


@dataclass(frozen=True)
class ShapeAlignment:
    """N and K must be multiples of one of the (n_multiple, k_multiple) options."""

    options: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        _require(
            bool(self.options)
            and all(
                isinstance(o, tuple) and len(o) == 2 and all(isinstance(v, int) and v >= 1 for v in o)
                for o in self.options
            ),
            f"ShapeAlignment options must be (n_multiple, k_multiple) pairs of positive ints, not {self.options!r}",
        )

    def check(self, problem: Problem) -> CheckResult:
        if any(problem.n % n_mult == 0 and problem.k % k_mult == 0 for n_mult, k_mult in self.options):
            return PASSED
        n_mult, k_mult = self.options[0]
        padded_n, padded_k = -(-problem.n // n_mult) * n_mult, -(-problem.k // k_mult) * k_mult
        return CheckResult(
            False,
            f"needs {self.describe()}; layer has N={problem.n}, K={problem.k}",
            f"pad the layer to N={padded_n}, K={padded_k}",
        )

    def describe(self) -> str:
        return ", or ".join(f"N % {n} == 0 and K % {k} == 0" for n, k in self.options)


@dataclass(frozen=True)
class ActivationDtypes:
    """The layer's inputs must arrive in one of these dtypes (bfloat16, float16, float32)."""

    dtypes: tuple[str, ...]

    def check(self, problem: Problem) -> CheckResult:
        if problem.activation_dtype in self.dtypes:
            return PASSED
        return CheckResult(
            False,
            f"takes {self.describe()}; layer has {problem.activation_dtype}",
            f"cast the inputs to {self.dtypes[0]}",
        )

    def describe(self) -> str:
        return " or ".join(self.dtypes) + " activations"


@dataclass(frozen=True)
class WeightFormats:
    """The layer's weight format (``Problem.weight_format``, which the resolver takes from the
    scheme: ``"blocks"`` for packed blocks) is one of ``formats``, or with ``exclude`` none of
    them. Meant for ``BatchRange.when``: a boundary measured for some formats only."""

    formats: tuple[str, ...]
    exclude: bool = False

    def check(self, problem: Problem) -> CheckResult:
        found = problem.weight_format
        if found is not None and (found in self.formats) != self.exclude:
            return PASSED
        return CheckResult(False, f"takes {self.describe()}; layer has {found or 'an unknown'} weights")

    def describe(self) -> str:
        return (
            ("weights other than " if self.exclude else "")
            + " or ".join(self.formats)
            + ("" if self.exclude else " weights")
        )


@dataclass(frozen=True)
class WeightBits:
    """The layer's weights are packed blocks of at least ``at_least`` bits a weight
    (``Problem.weight_bits``, which the resolver takes from the scheme's blocks: GGUF Q6_K 6.5625,
    Q8_0 8.5, Q4_K 4.5). Meant for ``BatchRange.when``: a boundary measured for the wider blocks."""

    at_least: float

    def __post_init__(self) -> None:
        value = self.at_least
        _require(
            not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0,
            f"WeightBits.at_least must be a positive number, not {value!r}",
        )

    def check(self, problem: Problem) -> CheckResult:
        found = problem.weight_bits
        if found is not None and found >= self.at_least:
            return PASSED
        has = "weights that are not packed blocks" if found is None else f"blocks of {found:g} bits a weight"
        return CheckResult(False, f"takes {self.describe()}; layer has {has}")

    def describe(self) -> str:
        return f"packed blocks of at least {self.at_least:g} bits a weight"


PREPARED_STATE_KINDS: tuple[str, ...] = ("canonical", "repack")


@dataclass(frozen=True)
class BatchRange:
    """The batch sizes a kernel is meant for on one device type: M (rows of the input,
    ``x.numel() // K``) from ``m_min`` to ``m_max`` inclusive; ``m_max=None`` means no upper end.

    ``source`` says where the boundary comes from (a benchmark and its figures): a boundary is a
    measurement, not a guess. A kernel with no BatchRange for a device is meant for every M there
    (the resolver's plan gives it every M it wins). ``device`` is a device type or ``"any"``.

    ``when``: checks on the layer's problem (its activation dtype, what the CPU runs) under which
    this entry applies; without them it always does. A kernel's entries are tried in order (its
    device's own, then ``"any"``) and the first that applies is its range, so an entry with
    ``when`` comes before the one that holds elsewhere: a boundary measured on one kind of CPU
    moves only there.
    """

    device: str
    m_min: int = 0
    m_max: int | None = None
    source: str = ""
    when: tuple[ProblemCheck, ...] = ()

    def __post_init__(self) -> None:
        _require(
            self.device in (*DEVICE_TYPES, ANY_DEVICE),
            f"batch range device {self.device!r} is not one of {', '.join((*DEVICE_TYPES, ANY_DEVICE))}",
        )
        _require(
            isinstance(self.m_min, int) and not isinstance(self.m_min, bool) and self.m_min >= 0,
            f"batch range m_min must be an int >= 0, not {self.m_min!r}",
        )
        _require(
            self.m_max is None
            or (isinstance(self.m_max, int) and not isinstance(self.m_max, bool) and self.m_max >= self.m_min),
            f"batch range m_max must be None or an int >= m_min ({self.m_min}), not {self.m_max!r}",
        )
        _require(isinstance(self.source, str), f"batch range source must be a str, not {self.source!r}")
        _require(
            isinstance(self.when, tuple) and all(isinstance(c, ProblemCheck) for c in self.when),
            f"batch range when must be a tuple of objects with check(problem) and describe(), not {self.when!r}",
        )

    def applies(self, problem: Problem | None) -> bool:
        """Whether this entry holds for ``problem``: always without ``when``; with it, only for a
        problem that passes every check (a check that raises counts as failed)."""
        if not self.when:
            return True
        if problem is None:
            return False
        for check in self.when:
            try:
                result = check.check(problem)
            except (Exception, SystemExit):  # a plugin's check may raise anything: the entry does not hold
                return False
            if not isinstance(result, CheckResult) or not result.ok:
                return False
        return True

    def describe(self) -> str:
        """``M >= 16 on cpu``, ``M <= 15 on any device``, ``M 4-15 on cuda``, ``M >= 5 on cpu for
        bfloat16 activations``."""
        where = "any device" if self.device == ANY_DEVICE else self.device
        condition = f" for {' and '.join(describe_check(c) for c in self.when)}" if self.when else ""
        return f"{describe_batch(self.m_min, self.m_max)} on {where}{condition}"


def describe_batch(m_min: int, m_max: int | None) -> str:
    """``every M``, ``M >= 16``, ``M <= 15``, ``M = 4``, ``M 4-15``."""
    if m_max is None:
        return "every M" if m_min == 0 else f"M >= {m_min}"
    if m_min == 0:
        return f"M <= {m_max}"
    return f"M = {m_min}" if m_min == m_max else f"M {m_min}-{m_max}"


@dataclass(frozen=True)
class PreparedState:
    """What a kernel's ``prepare`` keeps besides the canonical tensors.

    ``canonical``: the CanonicalWeight's own tensors (on the CPU the very tensors, elsewhere
    moved to the device) and small per-layer data: no copy of the weight. ``repack``: a copy of
    the weight in the kernel's own layout, of about ``extra`` times the bytes of the canonical
    tensors (None: not declared). A plan combines at most one repacking kernel with kernels
    that keep the canonical tensors (``qscheme.kernels.plan``).
    """

    kind: str = "repack"
    extra: float | None = None

    def __post_init__(self) -> None:
        _require(
            self.kind in PREPARED_STATE_KINDS,
            f"prepared state kind {self.kind!r} is not one of {', '.join(PREPARED_STATE_KINDS)}",
        )
        _require(
            self.extra is None
            or (isinstance(self.extra, (int, float)) and not isinstance(self.extra, bool) and self.extra >= 0),
            f"prepared state extra must be None or a number >= 0, not {self.extra!r}",
        )
        _require(
            self.kind == "repack" or not self.extra,
            "a prepared state that keeps the canonical tensors declares no extra bytes",
        )

    @property
    def shares_canonical(self) -> bool:
        return self.kind == "canonical"

    def describe(self) -> str:
        if self.shares_canonical:
            return "the canonical tensors (no copy)"
        if self.extra is None:
            return "a repacked copy (size not declared)"
        return f"a repacked copy of about {self.extra:g}x the canonical tensors"


REPACKED = PreparedState()


@dataclass(frozen=True)
class KernelDeclaration:
    """Everything the resolver needs to know about a kernel, without importing it.

    ``priority``: higher wins; ties are broken by name. ``implementation``: "module:attribute"
    of a class (instantiated without arguments) or an object with ``prepare`` and ``apply``;
    None for a kernel declared ahead of its code. ``requires_modules``: modules that must be
    importable (kernel libraries such as vllm or flashinfer). ``requires_versions``: installed
    distributions and the version ranges the kernel supports, e.g. ``(("vllm", ">=0.33,<0.34"),)``
    (read from package metadata, nothing imported). ``torch_features``: attributes
    of the ``torch`` module it needs (e.g. ``float4_e2m1fn_x2``), dotted paths below it
    (``nn.functional.scaled_mm``) or operators (``ops.aten._weight_int4pack_mm``). ``notes``:
    facts a user should know before relying on the kernel (its numerical error against the
    reference, what it approximates), shown by ``qscheme kernels``. ``plugin`` is set by the
    plugin manager to the plugin that contributed the declaration.
    """

    name: str
    provider: str
    priority: int
    supports: tuple[Supports, ...]
    devices: tuple[DeviceSupport, ...]
    implementation: str | None = None
    requires_modules: tuple[str, ...] = ()
    requires_versions: tuple[tuple[str, str], ...] = ()
    torch_features: tuple[str, ...] = ()
    checks: tuple[ProblemCheck, ...] = ()
    description: str = ""
    notes: tuple[str, ...] = ()
    plugin: str = field(default="", compare=False)
    batch_ranges: tuple[BatchRange, ...] = ()
    prepared_state: PreparedState = REPACKED

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(_NAME.match(self.name)), f"kernel name {self.name!r} is invalid")
        _require(isinstance(self.provider, str) and bool(self.provider), f"kernel {self.name}: provider is empty")
        _require(
            isinstance(self.priority, int) and not isinstance(self.priority, bool),
            f"kernel {self.name}: priority must be an int, not {self.priority!r}",
        )
        _tuple_of(self.supports, Supports, f"kernel {self.name}: supports")
        _require(bool(self.supports), f"kernel {self.name}: supports is empty")
        _tuple_of(self.devices, DeviceSupport, f"kernel {self.name}: devices")
        _require(bool(self.devices), f"kernel {self.name}: devices is empty")
        _require(
            self.implementation is None
            or (isinstance(self.implementation, str) and bool(_REFERENCE.match(self.implementation))),
            f"kernel {self.name}: implementation must be 'module:attribute', not {self.implementation!r}",
        )
        _tuple_of(self.requires_modules, str, f"kernel {self.name}: requires_modules")
        _require(
            isinstance(self.requires_versions, tuple)
            and all(
                isinstance(v, tuple) and len(v) == 2 and all(isinstance(p, str) and p for p in v)
                for v in self.requires_versions
            ),
            f"kernel {self.name}: requires_versions must be a tuple of (distribution, specifier) pairs, "
            f"not {self.requires_versions!r}",
        )
        for distribution, specifier in self.requires_versions:
            try:
                parse_specifier(specifier)
            except ValueError as error:
                raise ValueError(f"kernel {self.name}: requires_versions {distribution}: {error}") from None
        _tuple_of(self.torch_features, str, f"kernel {self.name}: torch_features")
        _tuple_of(self.notes, str, f"kernel {self.name}: notes")
        _require(
            isinstance(self.checks, tuple) and all(isinstance(c, ProblemCheck) for c in self.checks),
            f"kernel {self.name}: checks must be a tuple of objects with check(problem) and describe()",
        )
        _tuple_of(self.batch_ranges, BatchRange, f"kernel {self.name}: batch_ranges")
        _require(
            isinstance(self.prepared_state, PreparedState),
            f"kernel {self.name}: prepared_state must be a PreparedState, not {self.prepared_state!r}",
        )

    @property
    def implementation_module(self) -> str | None:
        return None if self.implementation is None else self.implementation.split(":", 1)[0]

    def sort_key(self) -> tuple[int, str]:
        """Highest priority first, then by name."""
        return (-self.priority, self.name)

    def priority_for(self, matching: Sequence[Supports]) -> int:
        """The priority for a scheme that the entries ``matching`` take: the highest entry
        priority among them (an entry without one has the kernel's), the kernel's when none."""
        return max((self.priority if s.priority is None else s.priority for s in matching), default=self.priority)

    def batch_entry(self, device_type: str, problem: Problem | None = None) -> BatchRange | None:
        """The declared BatchRange for a device type and layer: the first entry of the device's
        own that applies to ``problem`` (``BatchRange.when``), else the first ``any`` one; None
        when none does (the kernel is meant for every M there)."""
        for wanted in (device_type, ANY_DEVICE):
            for entry in self.batch_ranges:
                if entry.device == wanted and entry.applies(problem):
                    return entry
        return None

    def batch_range(self, device_type: str, problem: Problem | None = None) -> tuple[int, int | None] | None:
        """The declared (m_min, m_max) of ``batch_entry``; None when the kernel declares none
        there: every M."""
        entry = self.batch_entry(device_type, problem)
        return None if entry is None else (entry.m_min, entry.m_max)

    def describe_devices(self) -> str:
        return "; ".join(d.describe() for d in self.devices)

    def describe_supports(self) -> list[str]:
        return [s.describe() for s in self.supports]

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "provider": self.provider,
            "priority": self.priority,
            "plugin": self.plugin,
            "description": self.description,
            "implementation": self.implementation,
            "supports": self.describe_supports(),
            "devices": [d.describe() for d in self.devices],
            "requires_modules": list(self.requires_modules),
            "requires_versions": [f"{d} {s}" for d, s in self.requires_versions],
            "torch_features": list(self.torch_features),
            "checks": [describe_check(c) for c in self.checks],
            "notes": list(self.notes),
            "batch_ranges": [
                {
                    "device": b.device,
                    "m_min": b.m_min,
                    "m_max": b.m_max,
                    "source": b.source,
                    "when": [describe_check(c) for c in b.when],
                }
                for b in self.batch_ranges
            ],
            "prepared_state": {"kind": self.prepared_state.kind, "extra": self.prepared_state.extra},
        }
