"""The resolver: a pure function from (scheme, problem, device, declarations, overrides) to a kernel.

First the scheme's own layout is checked: every tensor it declares must have a shape for the
layer's N and K (``[N, K/16]`` needs K % 16 == 0); when one has none, no kernel is chosen and
``Resolution.layout`` says why. Then every declaration is judged at every stage, and every
failing check is kept (``Candidate.failures``), in the order of the stages:

1. ``disabled``: the user disabled it (QSCHEME_DISABLED_KERNELS or ``disabled=``);
2. ``scheme``: it does not implement the scheme's formats (weights, activations, scales, ...);
3. ``device``: wrong device type or compute capability, a missing torch feature, a missing
   kernel library, or an implementation that cannot be imported;
4. ``problem``: the layer's N, K, activation dtype, fused partitions or pre-scale do not suit it.

``Candidate.stage`` is the first failing stage. Candidates are ordered by priority (highest
first), then name: the kernel's priority, or for a scheme that Supports entries with their own
priority take, the highest of those (``KernelDeclaration.priority_for``). The first accepted
one wins, unless a kernel is forced, in which case only that one may win. A forced kernel that
cannot run leaves the resolution without a kernel: ``Resolution.require()`` then raises
``NoKernelError`` with the full trace. Nothing here reads the environment or imports kernels;
``qscheme.kernels.registry`` gathers those facts and passes them in.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from math import lcm

from qscheme.descriptor import Scheme
from qscheme.descriptor.shapes import describe_multiples, shape_multiples
from qscheme.errors import NoKernelError, UsageError
from qscheme.kernels.declaration import (
    ANY_DEVICE,
    CheckResult,
    KernelDeclaration,
    ProblemCheck,
    Supports,
    describe_batch,
    describe_capabilities,
    format_capability,
)
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.features import SchemeFeatures, activation_matches, formats_differ
from qscheme.kernels.plan import KernelPlan, MSplit, build_plan
from qscheme.kernels.problem import Problem
from qscheme.kernels.render import no_kernel_message
from qscheme.kernels.versions import satisfies

STAGES: tuple[str, ...] = ("disabled", "scheme", "device", "problem")


@dataclass(frozen=True)
class Failure:
    """One failing check: its stage, why it fails (actual and required values), and a fix."""

    stage: str
    reason: str
    hint: str = ""

    def as_json(self) -> dict[str, object]:
        return {"stage": self.stage, "reason": self.reason, "hint": self.hint}


@dataclass(frozen=True)
class Candidate:
    """One kernel of the trace: accepted, or rejected with every failing check.

    ``stage`` is the first failing stage, ``reason`` every failing check's reason joined with
    "; " (or why an accepted kernel was not chosen) and ``hint`` the first check's fix;
    ``failures`` keeps each check apart.
    """

    kernel: str
    provider: str
    priority: int
    plugin: str
    accepted: bool
    stage: str | None
    reason: str
    hint: str = ""
    chosen: bool = False
    failures: tuple[Failure, ...] = ()

    @property
    def verdict(self) -> str:
        if self.chosen:
            return "chosen"
        return "accepted" if self.accepted else "rejected"

    def as_json(self) -> dict[str, object]:
        return {
            "kernel": self.kernel,
            "provider": self.provider,
            "priority": self.priority,
            "plugin": self.plugin,
            "accepted": self.accepted,
            "chosen": self.chosen,
            "stage": self.stage,
            "reason": self.reason,
            "hint": self.hint,
            "failures": [f.as_json() for f in self.failures],
        }


@dataclass(frozen=True)
class Resolution:
    """The chosen kernel (None when no kernel can run the layer), the trace of every candidate,
    and the plan: which kernel runs which batch size M (``qscheme.kernels.plan``). ``kernel`` is
    the plan's kernel for M = 1 (decoding); with no batch ranges declared the plan is one entry,
    that kernel for every M."""

    scheme: Scheme = field(compare=False)
    problem: Problem
    device: DeviceFacts
    kernel: KernelDeclaration | None
    trace: tuple[Candidate, ...]
    forced: str | None = None
    disabled: frozenset[str] = frozenset()
    layout: Failure | None = None
    plan: KernelPlan = field(default_factory=lambda: KernelPlan(()))

    @property
    def resolved(self) -> bool:
        return self.kernel is not None

    def candidate(self, name: str) -> Candidate:
        for entry in self.trace:
            if entry.kernel == name:
                return entry
        raise KeyError(name)

    def require(
        self,
        failures: Sequence[object] = (),
        hint: str = "",
        declarations: Sequence[KernelDeclaration] | None = None,
    ) -> KernelDeclaration:
        """The chosen kernel, or NoKernelError whose message is the rendered trace."""
        if self.kernel is not None:
            return self.kernel
        error = NoKernelError(no_kernel_message(self, failures=failures, hint=hint, declarations=declarations))
        error.resolution = self  # type: ignore[attr-defined]
        raise error


# --- scheme stage -----------------------------------------------------------------------------


def _supports_mismatches(supports: Supports, features: SchemeFeatures) -> list[tuple[int, str]]:
    """Every way ``supports`` misses the scheme, as (rank, reason) in the order of the checks;
    empty when it covers the scheme. Rank 1, the activation, is worded by the caller, which
    sees every entry for the weight family."""
    family = features.weight_family
    found: list[tuple[int, str]] = []
    if not any(activation_matches(a, features.activation) for a in supports.activations):
        found.append((1, ""))
    if supports.weight_formats and features.weight_format not in supports.weight_formats:
        found.append(
            (
                2,
                f"takes {family} weights in {'/'.join(supports.weight_formats)}; "
                f"scheme has {features.weight_format} weights",
            )
        )
    if supports.granularities and features.granularity not in supports.granularities:
        found.append(
            (
                2,
                f"takes {family} weights with {'/'.join(supports.granularities)} scales; "
                f"scheme has {features.granularity} scales",
            )
        )
    if features.granularity == "group" and supports.group_sizes and features.group_size not in supports.group_sizes:
        found.append(
            (
                3,
                f"takes {family} weight groups of {'/'.join(str(g) for g in supports.group_sizes)}; "
                f"scheme has groups of {features.group_size}",
            )
        )
    if features.granularity == "block" and supports.blocks and features.block not in supports.blocks:
        blocks = "/".join(f"{r}x{c}" for r, c in supports.blocks)
        block = f"{features.block[0]}x{features.block[1]}" if features.block else "?"
        found.append((3, f"takes {family} weight blocks of {blocks}; scheme has {block} blocks"))
    if supports.scale_formats and features.scale_format not in supports.scale_formats:
        found.append(
            (
                4,
                f"takes {family} weights with {'/'.join(supports.scale_formats)} scales; "
                f"scheme has {features.scale_format} scales",
            )
        )
    if features.block_code is not None and supports.block_codes and features.block_code not in supports.block_codes:
        found.append(
            (
                2,
                f"takes {family} weights with {'/'.join(supports.block_codes)} codes; "
                f"scheme has {features.block_code} codes",
            )
        )
    if features.zero_point and not supports.zero_points:
        found.append((5, f"takes symmetric {family} weights only; scheme has zero points"))
    if features.input_pre_scale_required and not supports.input_pre_scale:
        found.append((6, "does not apply an input pre-scale; scheme always has one"))
    return found


def scheme_reasons(declaration: KernelDeclaration, features: SchemeFeatures) -> tuple[tuple[Supports, ...], list[str]]:
    """The declaration's Supports entries that cover the scheme, or () and every reason.

    Of several entries for the weight family, the one that gets furthest through the checks
    is described, with all its mismatches. When every entry misses the activation, the other
    mismatches listed are those every entry has (they would remain whatever the activation).
    """
    family = features.weight_family
    same_family = [s for s in declaration.supports if family in s.weights]
    if not same_family:
        families = sorted({w for s in declaration.supports for w in s.weights})
        return (), [f"implements {', '.join(families)} weights; scheme has {family} weights"]
    matching: list[Supports] = []
    missed: list[list[tuple[int, str]]] = []
    for supports in same_family:
        mismatches = _supports_mismatches(supports, features)
        if mismatches:
            missed.append(mismatches)
        else:
            matching.append(supports)
    if matching:
        return tuple(matching), []
    best = max(missed, key=lambda m: m[0][0])  # the first entry that gets furthest
    if best[0][0] > 1:
        return (), [reason for _, reason in best]
    wanted = features.activation
    # When the formats are what differs, only the entries that take the activation but for its
    # formats are named, with their formats; otherwise every entry, without formats.
    formats = formats_differ(family, wanted, same_family)
    taken: list[str] = []
    for supports in same_family:
        for a in supports.activations:
            described = a.describe(formats)
            if described not in taken and (not formats or activation_matches(a, wanted, formats=False)):
                taken.append(described)
    reasons = [
        f"takes {family} weights with {' or '.join(taken)} activations; "
        f"scheme has {wanted.describe(formats)} activations"
    ]
    shared = [reason for rank, reason in missed[0] if rank > 1 and all((rank, reason) in m for m in missed[1:])]
    return (), reasons + shared


def check_scheme(declaration: KernelDeclaration, features: SchemeFeatures) -> tuple[tuple[Supports, ...], str]:
    """The declaration's Supports entries that cover the scheme, or () and the reasons joined."""
    matching, reasons = scheme_reasons(declaration, features)
    return matching, "; ".join(reasons)


# --- device stage -----------------------------------------------------------------------------


def check_device(
    declaration: KernelDeclaration, device: DeviceFacts, unavailable: Mapping[str, str] | None = None
) -> str:
    """Empty when the kernel can run on the device here, else every reason it cannot."""
    return "; ".join(device_reasons(declaration, device, unavailable))


def device_reasons(
    declaration: KernelDeclaration, device: DeviceFacts, unavailable: Mapping[str, str] | None = None
) -> list[str]:
    """Every reason the kernel cannot run on the device here (empty when it can)."""
    reasons: list[str] = []
    placement = _check_placement(declaration, device)
    if placement:
        reasons.extend(placement)
    missing_features = [f for f in declaration.torch_features if f not in device.torch_features]
    if missing_features:
        names = ", ".join(f"torch.{f}" for f in missing_features)
        reasons.append(f"needs {names}, which torch {device.torch_version or '(not installed)'} lacks")
    if device.type in ("cuda", "rocm") and device.cpu_only_torch and not placement:
        if all(d.type != ANY_DEVICE for d in declaration.devices):
            reasons.append(
                f"torch {device.torch_version or '(version unknown)'} here is a CPU-only build: it has no "
                f"{device.type} kernels "
                "(install a CUDA build of torch)"
            )
    missing_modules = [m for m in declaration.requires_modules if m not in device.modules]
    if missing_modules:
        if not device.modules:
            where = (
                " (these device facts list no importable module at all: build them with "
                "qscheme.kernels.registry.device_for(...), which checks the environment)"
            )
        elif device.simulated:
            where = " (optional kernel libraries are checked in the local environment)"
        else:
            where = ""
        reasons.append(f"needs module {', '.join(missing_modules)}, not importable here{where}")
    for distribution, specifier in declaration.requires_versions:
        if distribution in missing_modules:
            continue  # already said: not importable
        version = device.distribution_version(distribution)
        if version is None:
            reasons.append(f"needs {distribution} {specifier}; no installed {distribution} distribution was found")
        elif not satisfies(version, specifier):
            reasons.append(f"needs {distribution} {specifier}; {distribution} {version} is installed")
    if declaration.implementation is None:
        reasons.append("declared only: no implementation is installed")
    elif unavailable and declaration.name in unavailable:
        reasons.append(f"implementation {declaration.implementation} failed to load: {unavailable[declaration.name]}")
    elif declaration.implementation_module not in device.modules:
        reasons.append(f"implementation {declaration.implementation} is not importable here")
    return reasons


def _check_placement(declaration: KernelDeclaration, device: DeviceFacts) -> list[str]:
    """Empty when some DeviceSupport admits the device type, capability and environment."""
    options = [d for d in declaration.devices if d.type in (ANY_DEVICE, device.type)]
    if not options:
        types = ", ".join(d.type for d in declaration.devices)
        return [f"runs on {types}; device is {device.type}"]
    failures: list[str] = []
    for option in options:
        problems: list[str] = []
        if option.capabilities:
            if device.capability is None:
                problems.append(f"needs {describe_capabilities(option.capabilities)}; device reports none")
            elif not any(r.contains(device.capability) for r in option.capabilities):
                problems.append(
                    f"needs {describe_capabilities(option.capabilities)}; "
                    f"device is {format_capability(device.capability)}"
                )
        for variable, value in option.environment:
            actual = device.env(variable)
            if actual != value:
                shown = "unset" if actual is None else f"{variable}={actual}"
                problems.append(f"on {device.type} needs {variable}={value} ({shown})")
        if not problems:
            return []
        failures.extend(problems)
    return failures


# --- problem stage ----------------------------------------------------------------------------


def check_problem(
    declaration: KernelDeclaration, matching: Sequence[Supports], features: SchemeFeatures, problem: Problem
) -> list[Failure]:
    """Every way the layer does not suit the kernel, each with its fix (empty when it suits).

    ``matching`` are the Supports entries that cover the scheme (the entries for its weight
    family when none does, so that a kernel rejected for its formats is judged as it would be)."""
    failures: list[Failure] = []
    if problem.partitions > 1 and problem.partition_scales_differ and not any(s.per_partition_scales for s in matching):
        failures.append(
            Failure(
                "problem",
                f"takes one global scale per layer; its {problem.partitions} fused partitions have different scales",
                "load the partitions as separate layers, or rescale them to one shared global scale",
            )
        )
    pre_scale = features.input_pre_scale_required if problem.input_pre_scale is None else problem.input_pre_scale
    if pre_scale and not any(s.input_pre_scale for s in matching):
        failures.append(
            Failure(
                "problem",
                "does not apply an input pre-scale (AWQ pre_quant_scale); the layer has one",
                "fold the pre-scale into the preceding layer",
            )
        )
    if problem.input_permutation and not any(s.input_permutation for s in matching):
        failures.append(
            Failure(
                "problem",
                "takes input channels in order; the layer's are permuted (GPTQ act-order: g_idx assigns groups "
                "out of order)",
                "re-quantize without act-order (desc_act: false), or run the layer on a kernel that permutes its input",
            )
        )
    for check in declaration.checks:
        result = _run_check(declaration, check, problem)
        if not result.ok:
            failures.append(Failure("problem", result.reason, result.hint))
    return failures


def _run_check(declaration: KernelDeclaration, check: ProblemCheck, problem: Problem) -> CheckResult:
    """The check's result; a check that raises or returns something else rejects its kernel
    (plugin code must not take the resolution, and with it every other kernel, down)."""
    name = type(check).__name__
    try:
        result = check.check(problem)
    except (Exception, SystemExit) as error:  # sys.exit in a plugin's check must not end the command
        found = f"raised {type(error).__name__}: {error}"
    else:
        if (
            isinstance(result, CheckResult)
            and isinstance(result.ok, bool)
            and isinstance(result.reason, str)
            and isinstance(result.hint, str)
        ):
            return result
        found = f"returned {result!r:.80}, not a CheckResult(ok: bool, reason: str, hint: str)"
    return CheckResult(
        False,
        f"its check {name} (plugin {declaration.plugin or '?'}) {found}",
        f"fix the plugin's check, or skip the kernel: QSCHEME_DISABLED_KERNELS={declaration.name}",
    )


# --- the scheme's own layout ------------------------------------------------------------------


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def check_layout(scheme: Scheme, problem: Problem) -> Failure | None:
    """None when every tensor the scheme declares has a shape for the layer's N x K; else why
    not, what the scheme stores, and the nearest size it stores.

    Read from the declared shapes alone (``[N, K/2]`` for two e2m1 codes a byte, ``[N, K/16]``
    for scales of groups of 16; ``ceil(K/d)`` pads, so it stores any K): no table per scheme.
    """
    n, k = problem.n, problem.k
    blocked: list[str] = []
    constraints: list[list[tuple[int, int]]] = []
    for spec in scheme.tensor_specs().values():
        options = list(dict.fromkeys(shape_multiples(shape) for shape in spec.shapes))
        if not options or (1, 1) in options:
            continue
        constraints.append(options)
        if not spec.expected_shapes(n, k):
            needs = " or ".join(describe_multiples(*option) for option in options)
            blocked.append(f"{spec.name} {spec.describe_shapes()} needs {needs}")
    if not blocked:
        return None
    best: tuple[tuple[int, int, int], tuple[int, int]] | None = None
    for choice in itertools.product(*constraints):
        multiples = (lcm(*(c[0] for c in choice)), lcm(*(c[1] for c in choice)))
        padded_n, padded_k = _round_up(n, multiples[0]), _round_up(k, multiples[1])
        key = (padded_n * padded_k, padded_n, padded_k)
        if best is None or key < best[0]:
            best = (key, multiples)
    assert best is not None  # blocked is not empty, so neither is constraints
    (_, padded_n, padded_k), multiples = best
    return Failure(
        "layout",
        f"scheme {scheme.name} stores layers with {describe_multiples(*multiples)}, not N={n}, K={k} "
        f"({'; '.join(blocked)})",
        f"pad the layer to N={padded_n}, K={padded_k} for scheme {scheme.name}, or quantize it with a scheme "
        "whose declared shapes round up (ceil(K/d))",
    )


# --- the resolver -----------------------------------------------------------------------------


def ordered(declarations: Iterable[KernelDeclaration]) -> list[KernelDeclaration]:
    """Highest priority first, then by name: the order in which candidates are tried."""
    return sorted(declarations, key=KernelDeclaration.sort_key)


def _unknown_kernel(name: str, declarations: Sequence[KernelDeclaration]) -> UsageError:
    names = [d.name for d in declarations]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return UsageError(
        f"unknown kernel {name!r} was forced.{hint} Known kernels: {', '.join(sorted(names)) or 'none'} "
        "(`qscheme kernels` lists them; `qscheme plugins` shows plugins that failed to load)"
    )


def resolve(
    scheme: Scheme,
    problem: Problem,
    device: DeviceFacts,
    declarations: Iterable[KernelDeclaration],
    force: str | None = None,
    disabled: Iterable[str] = (),
    unavailable: Mapping[str, str] | None = None,
    m_split: MSplit | None = None,
) -> Resolution:
    """Choose the kernel for one layer and explain the choice (see the module docstring).

    The accepted kernels form the plan over batch sizes (``build_plan``; ``m_split`` overrides
    the declared ranges); the kernel reported as chosen is the plan's for M = 1.

    ``unavailable`` maps kernel names to reasons their implementation cannot be used (learned
    by the caller, e.g. an import that failed); those kernels are rejected at stage device.
    Raises UsageError when ``force`` names no declared kernel or an argument has the wrong type.
    """
    for value, expected, fix in (
        (scheme, Scheme, "qscheme.load_scheme(name)"),
        (problem, Problem, "qscheme.kernels.Problem(n, k)"),
        (device, DeviceFacts, "qscheme.kernels.registry.device_for('cpu' | 'cuda' | 'sm90' ...)"),
    ):
        if not isinstance(value, expected):
            raise UsageError(f"resolve() takes a {expected.__name__}, not {type(value).__name__} {value!r}; use {fix}")
    if problem.weight_format is None:  # for batch ranges declared per weight format
        problem = replace(problem, weight_format=scheme.weight.format)
    blocks = scheme.weight.blocks
    if problem.weight_bits is None and blocks is not None:  # and per block width
        problem = replace(problem, weight_bits=blocks.bits_per_weight)
    candidates = ordered(declarations)
    if force is not None and not any(d.name == force for d in candidates):
        raise _unknown_kernel(force, candidates)
    disabled_set = frozenset(disabled)
    features = SchemeFeatures.of(scheme)
    layout = check_layout(scheme, problem)
    judged: list[tuple[KernelDeclaration, int, list[Failure]]] = []
    for declaration in candidates:
        failures, matching = _judge(declaration, features, problem, device, disabled_set, unavailable)
        judged.append((declaration, declaration.priority_for(matching), failures))
    # a Supports entry may rank its kernel otherwise for the schemes it takes (Supports.priority)
    judged.sort(key=lambda item: (-item[1], item[0].name))
    accepted = [d for d, _, failures in judged if not failures and (force is None or d.name == force)]
    plan = build_plan(accepted if layout is None else [], device.type, force, m_split, problem)
    chosen = plan.kernel_for(1) if plan.entries else None
    trace: list[Candidate] = []
    for declaration, priority, failures in judged:
        is_chosen = chosen is not None and declaration.name == chosen.name
        reason = "; ".join(f.reason for f in failures)
        if not failures:
            if layout is not None:
                reason = f"not chosen: scheme {scheme.name} cannot store this layer (see layout)"
            elif force is not None and declaration.name != force:
                reason = f"not chosen: kernel {force!r} is forced"
            elif plan.split:
                reason = _plan_reason(plan, declaration)
            elif not is_chosen and chosen is not None:
                reason = f"not chosen: {chosen.name} ranks higher"
        trace.append(
            Candidate(
                declaration.name,
                declaration.provider,
                priority,
                declaration.plugin,
                not failures,
                failures[0].stage if failures else None,
                reason,
                next((f.hint for f in failures if f.hint), ""),
                is_chosen,
                tuple(failures),
            )
        )
    return Resolution(scheme, problem, device, chosen, tuple(trace), force, disabled_set, layout, plan)


def _plan_reason(plan: KernelPlan, declaration: KernelDeclaration) -> str:
    """An accepted kernel's place in a plan of several kernels: the M it runs, or why none."""
    mine = plan.ranges_of(declaration.name)
    if mine:
        where = ", ".join(describe_batch(e.m_min, e.m_max) for e in mine)
        return f"runs {where} (plan: {mine[0].reason})" if not mine[0].covers(1) else f"runs {where}"
    for name, why in plan.skipped:
        if name == declaration.name:
            return why
    return f"not chosen: {', '.join(k.name for k in plan.kernels)} rank higher for the M it is meant for"


def judge(
    declaration: KernelDeclaration,
    features: SchemeFeatures,
    problem: Problem,
    device: DeviceFacts,
    disabled: frozenset[str] = frozenset(),
    unavailable: Mapping[str, str] | None = None,
) -> list[Failure]:
    """Every failing check of one kernel, stage by stage (empty when it is accepted)."""
    return _judge(declaration, features, problem, device, disabled, unavailable)[0]


def _judge(
    declaration: KernelDeclaration,
    features: SchemeFeatures,
    problem: Problem,
    device: DeviceFacts,
    disabled: frozenset[str],
    unavailable: Mapping[str, str] | None,
) -> tuple[list[Failure], tuple[Supports, ...]]:
    """``judge``'s failures, and the kernel's Supports entries that take the scheme (empty when
    none does)."""
    failures: list[Failure] = []
    if declaration.name in disabled:
        failures.append(
            Failure("disabled", "disabled by the user (QSCHEME_DISABLED_KERNELS)", f"re-enable {declaration.name}")
        )
    matching, reasons = scheme_reasons(declaration, features)
    failures.extend(Failure("scheme", reason) for reason in reasons)
    failures.extend(Failure("device", reason) for reason in device_reasons(declaration, device, unavailable))
    checked = matching
    if not checked:
        same_family = [s for s in declaration.supports if features.weight_family in s.weights]
        checked = tuple(same_family or declaration.supports)
    failures.extend(check_problem(declaration, checked, features, problem))
    return failures, matching


class Resolver:
    """``resolve`` memoised for one device, set of declarations and overrides.

    Resolutions are cached per (scheme object, problem); the layer name takes no part in the
    key, so every layer of one shape and scheme shares one resolution (renamed for messages).
    """

    def __init__(
        self,
        device: DeviceFacts,
        declarations: Iterable[KernelDeclaration],
        force: str | None = None,
        disabled: Iterable[str] = (),
        unavailable: Mapping[str, str] | None = None,
        m_split: MSplit | None = None,
    ) -> None:
        self.device = device
        self.m_split = m_split
        self.declarations = tuple(ordered(declarations))
        self.force = force
        self.disabled = frozenset(disabled)
        self.unavailable = dict(unavailable or {})
        self._cache: dict[tuple[int, Problem], tuple[Scheme, Resolution]] = {}

    def resolve(self, scheme: Scheme, problem: Problem) -> Resolution:
        key = (id(scheme), problem)
        hit = self._cache.get(key)
        if hit is None or hit[0] is not scheme:
            resolution = resolve(
                scheme,
                problem,
                self.device,
                self.declarations,
                self.force,
                self.disabled,
                self.unavailable,
                self.m_split,
            )
            self._cache[key] = (scheme, resolution)
            return resolution
        resolution = hit[1]
        if resolution.problem.layer != problem.layer:
            # The same resolution for another layer: a shallow copy naming it (a frozen
            # dataclass's __init__ would cost more than the whole cache lookup).
            renamed = object.__new__(Resolution)
            renamed.__dict__.update(resolution.__dict__)
            renamed.__dict__["problem"] = problem
            resolution = renamed
        return resolution
