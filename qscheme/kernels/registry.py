"""The edge between plugins, the environment and the pure resolver.

Collects kernel declarations from the plugins, fills device facts with what is importable and
which variables are set, reads the overrides (QSCHEME_KERNEL, QSCHEME_DISABLED_KERNELS),
imports implementations lazily by their "module:attribute" reference, and turns a failed
resolution into a NoKernelError with a hint.

Resolution matches execution: a kernel is only ever reported as chosen once its implementation
has been imported and found to have ``prepare`` and ``apply``. The import happens the first time
a kernel would be chosen (or `qscheme kernels` asks whether it is available) and its outcome is
kept for the process, so resolving stays a dictionary lookup after that; a kernel whose import
failed is rejected at the device stage with the import error as its reason.
"""

from __future__ import annotations

import difflib
import importlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from qscheme.errors import NoKernelError, PluginError, UsageError
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.devices import SIMULATED_DEVICES, DeviceFacts, device_facts, simulated_device, with_environment
from qscheme.kernels.plan import M_SPLIT_VARIABLE, MSplit, parse_m_split
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import Resolution, Resolver, check_device, ordered

if TYPE_CHECKING:
    from qscheme.descriptor import Scheme
    from qscheme.kernels.interface import KernelImplementation

KERNEL_VARIABLE = "QSCHEME_KERNEL"
DISABLED_VARIABLE = "QSCHEME_DISABLED_KERNELS"

_lock = threading.RLock()
_implementations: dict[str, Any] = {}
_implementation_failures: dict[str, str] = {}
_resolvers: dict[tuple[object, ...], Resolver] = {}
_quick: dict[tuple[object, ...], tuple[tuple[KernelDeclaration, ...], DeviceFacts, Resolver]] = {}
_devices: dict[tuple[object, ...], tuple[tuple[KernelDeclaration, ...], DeviceFacts]] = {}
_QUICK_LIMIT = 256  # callers passing fresh DeviceFacts objects must not grow the fast-path table forever
_declarations_cache: tuple[object, tuple[KernelDeclaration, ...]] | None = None


def declarations() -> tuple[KernelDeclaration, ...]:
    """Every declared kernel, highest priority first (loads the plugins on first use)."""
    global _declarations_cache
    from qscheme.plugins import get_plugins

    raw = get_plugins().kernel_declarations()
    cached = _declarations_cache
    if cached is not None and cached[0] is raw:
        return cached[1]
    if _declarations_cache is None or _declarations_cache[0] is not raw:
        _declarations_cache = (raw, tuple(ordered(raw)))
    return _declarations_cache[1]


def plugin_failures() -> tuple[object, ...]:
    from qscheme.plugins import get_plugins

    return get_plugins().failures()


def checked_kernel(kernel: object, caller: str) -> str | None:
    """``kernel=`` as given (None, or a declared kernel's name); UsageError otherwise.

    Meant to run before anything is read, so that a wrong argument costs nothing: a value that is
    not a str (a declaration, an implementation object, a number), an empty name, or a name no
    plugin declares.
    """
    if kernel is None:
        return None
    names = sorted(d.name for d in declarations())
    known = ", ".join(names) or "none"
    if not isinstance(kernel, str):
        given = getattr(kernel, "name", None)
        example = f"kernel={given!r}" if isinstance(given, str) else "kernel='triton'"
        raise UsageError(
            f"{caller}(kernel={kernel!r}): kernel= takes a kernel's name (str), not a {type(kernel).__name__}; "
            f"e.g. {example}. Known kernels: {known} (`qscheme kernels` lists them)"
        )
    if kernel not in names:
        close = difflib.get_close_matches(kernel, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        what = "an empty kernel name was given" if not kernel.strip() else f"unknown kernel {kernel!r} was forced"
        raise UsageError(
            f"{caller}(kernel={kernel!r}): {what}.{hint} Known kernels: {known} (`qscheme kernels` lists them, "
            "`qscheme plugins` shows plugins that failed to load); pass one of them, or kernel=None to let the "
            "resolver choose"
        )
    return kernel


def get_declaration(name: str) -> KernelDeclaration:
    for declaration in declarations():
        if declaration.name == name:
            return declaration
    known = ", ".join(d.name for d in declarations())
    raise UsageError(f"unknown kernel {name!r}; known kernels: {known}")


def overrides(kernel: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[str | None, frozenset[str]]:
    """(forced kernel, disabled kernels): an explicit ``kernel`` wins over QSCHEME_KERNEL."""
    env = os.environ if environ is None else environ
    forced = kernel or env.get(KERNEL_VARIABLE, "").strip() or None
    disabled = frozenset(p.strip() for p in env.get(DISABLED_VARIABLE, "").split(",") if p.strip())
    return forced, disabled


def m_split_override(
    m_split: MSplit | str | int | None = None, environ: Mapping[str, str] | None = None, origin: str = "m_split"
) -> MSplit | None:
    """The batch-range override: an explicit ``m_split`` wins over QSCHEME_M_SPLIT; UsageError
    naming the value (and the variable or argument) when it is not one of the forms
    ``qscheme.kernels.plan.parse_m_split`` takes, or names an undeclared kernel."""
    names = [d.name for d in declarations()]
    if m_split is not None and not (isinstance(m_split, str) and not m_split.strip()):
        return parse_m_split(m_split, origin, names)
    env = os.environ if environ is None else environ
    return parse_m_split(env.get(M_SPLIT_VARIABLE), M_SPLIT_VARIABLE, names)


def _requirements(decls: Sequence[KernelDeclaration]) -> tuple[set[str], set[str], set[str], set[str]]:
    """The modules, environment variables, torch features and distributions the declarations ask about."""
    modules: set[str] = set()
    variables: set[str] = set()
    features: set[str] = set()
    distributions: set[str] = set()
    for declaration in decls:
        distributions.update(name for name, _ in declaration.requires_versions)
        modules.update(declaration.requires_modules)
        if declaration.implementation_module:
            modules.add(declaration.implementation_module)
        for support in declaration.devices:
            variables.update(name for name, _ in support.environment)
        features.update(declaration.torch_features)
    return modules, variables, features, distributions


def complete_facts(facts: DeviceFacts, decls: Sequence[KernelDeclaration] | None = None) -> DeviceFacts:
    """Device facts plus the modules, variables and torch features the declarations ask about."""
    modules, variables, features, distributions = _requirements(declarations() if decls is None else decls)
    return with_environment(facts, modules, variables, torch_features=features, distributions=distributions)


def device_for(device: DeviceFacts | str | None = None) -> DeviceFacts:
    """Facts for ``None``/"auto" (probe), "cpu", "cuda", "sm90"..., a torch device, or facts as given.

    The facts of one name are probed once per process and reused while the declared kernels
    and the environment variables they read stay the same (one object, so memoised
    resolutions keyed on it are shared by every layer).
    """
    if isinstance(device, DeviceFacts):
        return device
    name = None if device is None else str(device)
    if name is not None and name.startswith("cuda:"):
        name = "cuda"
    decls = declarations()
    _, variables, _, _ = _requirements(decls)
    key = (name, id(decls), tuple((v, os.environ.get(v)) for v in sorted(variables)))
    hit = _devices.get(key)
    if hit is not None and hit[0] is decls:
        return hit[1]
    facts = complete_facts(device_facts(name), decls)
    with _lock:
        _devices[key] = (decls, facts)
    return facts


def resolver(
    device: DeviceFacts,
    kernel: str | None = None,
    environ: Mapping[str, str] | None = None,
    m_split: MSplit | str | int | None = None,
) -> Resolver:
    """A memoising resolver for the device, the declared kernels and the current overrides
    (QSCHEME_KERNEL, QSCHEME_DISABLED_KERNELS, QSCHEME_M_SPLIT; ``kernel`` and ``m_split`` win)."""
    decls = declarations()
    env = os.environ if environ is None else environ
    # Fast path: the same declarations, device object and raw overrides as a previous call.
    split_key = m_split.text if isinstance(m_split, MSplit) else m_split
    quick = (id(decls), id(device), kernel, split_key, *_raw_overrides(env), _failure_count())
    hit = _quick.get(quick)
    if hit is not None and hit[0] is decls and hit[1] is device:
        return hit[2]
    forced, disabled = overrides(kernel, env)
    _check_override_names(decls, kernel, forced, disabled)
    split = m_split_override(m_split, env)
    with _lock:
        unavailable = dict(_implementation_failures)
        key = (id(decls), device, forced, disabled, split, tuple(sorted(unavailable.items())))
        found = _resolvers.get(key)
        if found is None or found.declarations != decls:
            found = Resolver(device, decls, forced, disabled, unavailable, split)
            _resolvers[key] = found
        if len(_quick) >= _QUICK_LIMIT:
            _quick.clear()
        _quick[quick] = (decls, device, found)
        return found


def _check_override_names(
    decls: Sequence[KernelDeclaration], kernel: str | None, forced: str | None, disabled: frozenset[str]
) -> None:
    """Kernel names read from the environment must be declared: a typo is an error, never ignored."""
    names = {d.name for d in decls}
    known = ", ".join(sorted(names)) or "none"
    if forced is not None and kernel is None and forced not in names:
        close = difflib.get_close_matches(forced, sorted(names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise UsageError(
            f"{KERNEL_VARIABLE}={forced!r} names no declared kernel{hint} Known kernels: {known} "
            f"(`qscheme kernels` lists them); fix or unset {KERNEL_VARIABLE}"
        )
    unknown = sorted(disabled - names)
    if unknown:
        guesses = [difflib.get_close_matches(name, sorted(names), n=1) for name in unknown]
        hints = [
            f"{name!r} (did you mean {g[0]!r}?)" if g else repr(name) for name, g in zip(unknown, guesses, strict=True)
        ]
        raise UsageError(
            f"{DISABLED_VARIABLE} names undeclared kernel(s) {', '.join(hints)}; known kernels: {known}. "
            f"Give a comma-separated list of declared names, or remove the unknown ones"
        )


def _raw_overrides(env: Mapping[str, str]) -> tuple[object, object, object]:
    """The raw QSCHEME_KERNEL, QSCHEME_DISABLED_KERNELS and QSCHEME_M_SPLIT values, read once per resolution.

    os.environ.get costs more than a whole memoised resolution (it encodes the key and raises
    KeyError internally when unset), so for os.environ itself the encoded mapping is read.
    """
    data = getattr(env, "_data", None) if env is os.environ else None
    if isinstance(data, dict) and _ENCODED_KEYS is not None:
        return data.get(_ENCODED_KEYS[0]), data.get(_ENCODED_KEYS[1]), data.get(_ENCODED_KEYS[2])
    return env.get(KERNEL_VARIABLE), env.get(DISABLED_VARIABLE), env.get(M_SPLIT_VARIABLE)


def _encoded_keys() -> tuple[object, object, object] | None:
    encode = getattr(os.environ, "encodekey", None)
    try:
        return (encode(KERNEL_VARIABLE), encode(DISABLED_VARIABLE), encode(M_SPLIT_VARIABLE)) if encode else None
    except Exception:
        return None


_ENCODED_KEYS = _encoded_keys()


def _failure_count() -> int:
    return len(_implementation_failures)


def resolve_layer(
    scheme: Scheme,
    problem: Problem,
    device: DeviceFacts | str | None = None,
    kernel: str | None = None,
    environ: Mapping[str, str] | None = None,
    m_split: MSplit | str | int | None = None,
) -> Resolution:
    """Resolve one layer with the installed kernels and the environment's overrides.

    The implementation of every kernel of the plan is imported (once per process) before it is
    reported: one
    that fails to import is recorded and the layer resolved again, so it appears in the trace as
    rejected at the device stage with its import error (a forced kernel then leaves the layer
    without a kernel). When no kernel is chosen although some were accepted (another kernel is
    forced), those are imported too, so that the trace and the hint offer only kernels that run.
    """
    facts = device_for(device)
    while True:
        memo = resolver(facts, kernel, environ, m_split)
        resolution = memo.resolve(scheme, problem)
        if resolution.kernel is not None:
            failed = [
                d for d in resolution.plan.kernels if d.name not in _implementations and implementation_failure(d)
            ]
            if not failed:
                return resolution
            continue  # the failures are now in _implementation_failures: the next round rejects them
        accepted = {c.kernel for c in resolution.trace if c.accepted}
        untried = [
            d
            for d in memo.declarations
            if d.name in accepted and d.name not in _implementations and d.name not in _implementation_failures
        ]
        if not [d for d in untried if implementation_failure(d)]:
            return resolution


def implementation_failure(declaration: KernelDeclaration) -> str:
    """Empty when the kernel's implementation imports and has prepare and apply, else why not
    (imported at most once per process; the outcome is kept either way)."""
    if declaration.name in _implementations:
        return ""
    try:
        load_implementation(declaration)
    except PluginError:
        with _lock:
            return _implementation_failures.setdefault(declaration.name, "no implementation")
    return ""


def verified_failures(kernels: Sequence[KernelDeclaration], device: DeviceFacts) -> dict[str, str]:
    """Import failures of every implemented kernel that could otherwise run on ``device``
    (`qscheme kernels` calls this: a kernel is listed as available only when its code imports)."""
    for declaration in kernels:
        if declaration.implementation is not None and not check_device(declaration, device, _implementation_failures):
            implementation_failure(declaration)
    return implementation_failures()


def hint_for(resolution: Resolution) -> str:
    """One hint for a failed resolution: another kernel, device or catalog scheme that works."""
    from qscheme.kernels.hints import suggest

    if resolution.kernel is not None:
        return ""
    decls = declarations()
    schemes: list[Scheme] = []
    try:
        from qscheme.catalog import load_catalog

        schemes = list(load_catalog())
    except Exception:  # the hint is a courtesy: a broken catalog must not hide the real error
        schemes = []
    devices = [complete_facts(simulated_device(name), decls) for name in SIMULATED_DEVICES]
    return suggest(resolution, decls, devices, schemes, dict(_implementation_failures))


def no_kernel_error(resolution: Resolution) -> NoKernelError:
    """The NoKernelError for a failed resolution: trace, plugin failures and one hint."""
    try:
        resolution.require(plugin_failures(), hint_for(resolution), declarations())
    except NoKernelError as error:
        return error
    raise ValueError("no_kernel_error needs a resolution without a kernel")


def load_implementation(declaration: KernelDeclaration) -> KernelImplementation:
    """Import (once) and return the kernel's implementation; PluginError naming the cause."""
    with _lock:
        if declaration.name in _implementations:
            implementation: KernelImplementation = _implementations[declaration.name]
            return implementation
        if declaration.name in _implementation_failures:
            raise PluginError(f"kernel {declaration.name}: {_implementation_failures[declaration.name]}")
        reference = declaration.implementation
        if reference is None:
            raise PluginError(f"kernel {declaration.name} is declared without an implementation")
        module_name, _, attribute = reference.partition(":")
        try:
            implementation = _import_implementation(module_name, attribute, reference)
        except (Exception, SystemExit) as exc:  # a plugin's module may raise anything while it imports
            reason = f"{type(exc).__name__}: {exc}"
            _implementation_failures[declaration.name] = reason
            raise PluginError(
                f"kernel {declaration.name} (plugin {declaration.plugin or '?'}): implementation {reference} "
                f"failed to load: {reason}"
            ) from exc
        _implementations[declaration.name] = implementation
        return implementation


def _import_implementation(module_name: str, attribute: str, reference: str) -> Any:
    """The object ``module:attribute`` names (a class is instantiated); raises on any failure."""
    target: Any = importlib.import_module(module_name)
    path = module_name
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise AttributeError(
                f"{path} has no attribute {part!r} (the declaration's implementation {reference!r} names it)"
            )
        target = getattr(target, part)
        path = f"{path}.{part}"
    implementation = target() if isinstance(target, type) else target
    missing = [m for m in ("prepare", "apply") if not callable(getattr(implementation, m, None))]
    if missing:
        raise TypeError(
            f"{reference} does not implement the kernel interface: no {' or '.join(missing)} method "
            "(a kernel needs prepare(weight, device) and apply(state, x, bias))"
        )
    return implementation


def select_kernel(
    scheme: Scheme,
    problem: Problem,
    device: DeviceFacts | str | None = None,
    kernel: str | None = None,
    environ: Mapping[str, str] | None = None,
    m_split: MSplit | str | int | None = None,
) -> tuple[Resolution, KernelDeclaration, KernelImplementation]:
    """Resolve and import the chosen kernel's code. A kernel whose code fails to import is
    recorded and resolution repeats without it, unless it was forced: then NoKernelError
    (``resolve_layer`` does the importing)."""
    resolution = resolve_layer(scheme, problem, device, kernel, environ, m_split)
    if resolution.kernel is None:
        raise no_kernel_error(resolution)
    return resolution, resolution.kernel, load_implementation(resolution.kernel)  # imported: a lookup


def implementation_failures() -> dict[str, str]:
    """Kernel name -> why its implementation could not be used, for the kernels tried so far."""
    return dict(_implementation_failures)


def unavailable_kernels() -> list[dict[str, str]]:
    """``{"kernel", "plugin", "reason"}`` of each declared kernel whose implementation failed to
    import in this process (rejected by every resolution since), in priority order."""
    failures = implementation_failures()
    return [
        {"kernel": d.name, "plugin": d.plugin, "reason": failures[d.name]} for d in declarations() if d.name in failures
    ]


def unavailable_lines() -> list[str]:
    """The text form of ``unavailable_kernels()``: a heading and one line a kernel (none if none)."""
    found = unavailable_kernels()
    if not found:
        return []
    lines = ["kernels rejected: their code failed to import (`qscheme kernels` lists them):"]
    return lines + [f"  {u['kernel']} (plugin {u['plugin'] or '?'}): {u['reason']}" for u in found]


def reset() -> None:
    """Forget imported implementations, failures and memoised resolutions (for tests)."""
    global _declarations_cache
    with _lock:
        _implementations.clear()
        _implementation_failures.clear()
        _resolvers.clear()
        _quick.clear()
        _devices.clear()
        _declarations_cache = None
