"""Loading plugins with fault isolation, and collecting what they contribute.

Every plugin is loaded, registered and called on its own: a plugin that fails to import,
whose hook raises, or that returns something malformed is recorded as a ``PluginFailure``
(plugin, distribution, version, stage, error) and skipped, and every other plugin keeps
working. ``QSCHEME_STRICT_PLUGINS=1`` turns the first failure into a ``PluginError``.

Which plugins load:

- the built-in plugins (``BUILTIN_PLUGINS``), from the ``qscheme`` distribution's own entry
  points, or directly when running from a checkout that is not installed;
- third-party entry points in the ``qscheme`` group, unless
  ``QSCHEME_DISABLE_PLUGIN_AUTOLOAD=1``; ``QSCHEME_PLUGINS=a,b`` loads only the entry points or
  distributions named (an empty value loads none);
- switches take 1/true/yes/on or 0/false/no/off/empty; any other value, or a
  ``QSCHEME_PLUGINS`` entry that is not a name, is a UsageError naming the variable
  (``qscheme.environment``);
- objects registered in-process with ``register_plugin``.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import pluggy

from qscheme.descriptor import parse_scheme_file
from qscheme.environment import env_flag, env_names
from qscheme.errors import PluginError, Problem, SchemeError
from qscheme.folder_catalog import descriptor_files, folder_scheme_names
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.plugins import hookspecs

ENTRY_POINT_GROUP = "qscheme"
BUILTIN_DISTRIBUTION = "qscheme"
STRICT_VARIABLE = "QSCHEME_STRICT_PLUGINS"
DISABLE_AUTOLOAD_VARIABLE = "QSCHEME_DISABLE_PLUGIN_AUTOLOAD"
ALLOW_VARIABLE = "QSCHEME_PLUGINS"

# The one list of built-in plugins (entry point name -> module). pyproject.toml's
# [project.entry-points.qscheme] declares the same table for installs; tests/test_packaging.py
# checks that it, the installed distribution's entry points and a built wheel's equal this.
BUILTIN_PLUGINS: dict[str, str] = {
    "reference": "qscheme_plugins.reference",
    "triton": "qscheme_plugins.triton_declaration",
    "marlin": "qscheme_plugins.marlin",
    "native_fp4": "qscheme_plugins.native_fp4",
    "native_fp8": "qscheme_plugins.native_fp8",
    "tinygemm": "qscheme_plugins.tinygemm",
    "dequant_gemm": "qscheme_plugins.dequant_gemm",
    "cpu_gemv": "qscheme_plugins.cpu_gemv",
}
HOOKS: tuple[str, ...] = ("qscheme_kernels", "qscheme_schemes")


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be used, or one of its contributions that was refused."""

    plugin: str
    distribution: str | None
    version: str | None
    stage: str
    error: str

    def __str__(self) -> str:
        origin = f"{self.distribution} {self.version or '(unknown version)'}" if self.distribution else "in-process"
        return f"{self.plugin} ({origin}) {self.stage}: {self.error}"

    def as_json(self) -> dict[str, object]:
        return {
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "stage": self.stage,
            "error": self.error,
        }


@dataclass(frozen=True)
class PluginInfo:
    """One plugin as `qscheme plugins` shows it."""

    name: str
    distribution: str | None
    version: str | None
    builtin: bool
    loaded: bool
    origin: str
    kernels: tuple[str, ...] = ()
    schemes: tuple[str, ...] = ()
    failures: tuple[PluginFailure, ...] = ()
    skipped: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "loaded": self.loaded,
            "origin": self.origin,
            "kernels": list(self.kernels),
            "schemes": list(self.schemes),
            "errors": [f.as_json() for f in self.failures],
            "skipped": self.skipped or None,
        }


class EntryPointLike(Protocol):
    """What loading needs of an ``importlib.metadata.EntryPoint`` (tests pass stand-ins)."""

    name: str
    value: str

    def load(self) -> Any: ...


@dataclass
class _Record:
    name: str
    distribution: str | None
    version: str | None
    builtin: bool
    origin: str
    plugin: object = None
    loaded: bool = False
    skipped: str = ""
    kernels: list[str] = field(default_factory=list)
    schemes: list[str] = field(default_factory=list)


class Plugins:
    """The plugins of one process: a pluggy manager, a record of each plugin, and failures."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self._records: dict[str, _Record] = {}
        self._failures: list[PluginFailure] = []
        self._kernels: tuple[KernelDeclaration, ...] | None = None
        self._contributed: list[tuple[_Record, Path, str]] | None = None
        self._lock = threading.RLock()

    # -- loading -------------------------------------------------------------------------------

    def _fail(self, record: _Record, stage: str, error: str, once: bool = False) -> None:
        """Record a failure (``once``: unless this plugin already has the same one); strict: raise."""
        failure = PluginFailure(record.name, record.distribution, record.version, stage, error)
        if not (once and failure in self._failures):
            self._failures.append(failure)
        if self.strict:
            raise PluginError(f"plugin {failure} ({STRICT_VARIABLE}=1 makes plugin failures fatal)")

    def register(
        self,
        plugin: object,
        name: str,
        distribution: str | None = None,
        version: str | None = None,
        builtin: bool = False,
        origin: str = "in-process",
    ) -> bool:
        """Register a plugin object; False (and a recorded failure) when pluggy refuses it."""
        with self._lock:
            record = _Record(name, distribution, version, builtin, origin, plugin)
            if name in self._records and self._records[name].loaded:
                self._fail(record, "register", f"a plugin named {name!r} is already registered")
                return False
            self._records[name] = record
            self._invalidate()
            try:
                self.manager.register(plugin, name=name)
            except Exception as exc:
                self._fail(record, "register", _describe_error(exc))
                return False
            unknown = [c.name for c in self.manager.get_hookcallers(plugin) or [] if not c.has_spec()]
            if unknown:
                self.manager.unregister(plugin, name=name)
                self._fail(record, "register", f"unknown hook {', '.join(unknown)}; known hooks: {', '.join(HOOKS)}")
                return False
            record.loaded = True
            return True

    def unregister(self, name: str) -> None:
        with self._lock:
            record = self._records.pop(name, None)
            if record is not None and record.loaded:
                self.manager.unregister(name=name)
            self._invalidate()

    def load_entry_point(self, entry_point: EntryPointLike, builtin: bool = False) -> bool:
        distribution, version = _distribution_of(entry_point)
        record = _Record(entry_point.name, distribution, version, builtin, f"entry point {entry_point.value}")
        try:
            plugin = entry_point.load()
        except BaseException as exc:  # SystemExit or KeyboardInterrupt from a plugin import too
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._records[entry_point.name] = record
            self._fail(record, "import", _describe_error(exc))
            return False
        return self.register(plugin, entry_point.name, distribution, version, builtin, record.origin)

    def skip(self, entry_point: EntryPointLike, reason: str) -> None:
        distribution, version = _distribution_of(entry_point)
        self._records[entry_point.name] = _Record(
            entry_point.name, distribution, version, False, f"entry point {entry_point.value}", skipped=reason
        )

    def load_builtins(self, entry_points: Iterable[EntryPointLike]) -> None:
        """The built-in plugins: from the qscheme distribution's entry points, else directly."""
        found = {ep.name: ep for ep in entry_points if ep.name in BUILTIN_PLUGINS}
        version = _version(BUILTIN_DISTRIBUTION)
        for name, module in BUILTIN_PLUGINS.items():
            if name in found:
                self.load_entry_point(found[name], builtin=True)
                continue
            record = _Record(name, BUILTIN_DISTRIBUTION, version, True, f"module {module}")
            try:
                plugin = importlib.import_module(module)
            except Exception as exc:
                self._records[name] = record
                self._fail(record, "import", _describe_error(exc))
                continue
            self.register(plugin, name, BUILTIN_DISTRIBUTION, version, True, record.origin)

    # -- contributions -------------------------------------------------------------------------

    def _invalidate(self) -> None:
        self._kernels = None
        self._contributed = None

    def _call_each(self, hook: str) -> list[tuple[_Record, object]]:
        """Call every implementation of a hook on its own; failures are recorded, not raised."""
        results: list[tuple[_Record, object]] = []
        implementations = {impl.plugin_name: impl for impl in getattr(self.manager.hook, hook).get_hookimpls()}
        for name, record in self._records.items():
            impl = implementations.get(name)
            if impl is None or not record.loaded:
                continue
            try:
                results.append((record, impl.function()))
            except BaseException as exc:  # SystemExit from a hook too, as at import
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._fail(record, f"hook {hook}", _describe_error(exc))
        return results

    def kernel_declarations(self) -> tuple[KernelDeclaration, ...]:
        """Every valid kernel declaration, each stamped with its plugin's name; names unique."""
        found = self._kernels
        if found is not None:
            return found
        with self._lock:
            if self._kernels is not None:
                return self._kernels
            declarations: dict[str, KernelDeclaration] = {}
            for record in self._records.values():
                record.kernels.clear()
            for record, result in self._call_each("qscheme_kernels"):
                for item in _items(result, KernelDeclaration):
                    if not isinstance(item, KernelDeclaration):
                        self._fail(
                            record,
                            "hook qscheme_kernels",
                            f"returned {_short(item)} ({type(item).__name__}), not a KernelDeclaration",
                        )
                        continue
                    previous = declarations.get(item.name)
                    if previous is not None:
                        self._fail(
                            record,
                            "hook qscheme_kernels",
                            f"kernel {item.name!r} is already declared by plugin {previous.plugin!r}; rename it",
                        )
                        continue
                    declarations[item.name] = replace(item, plugin=record.name)
                    record.kernels.append(item.name)
            self._kernels = tuple(declarations.values())
            return self._kernels

    def _scheme_contributions(self) -> list[tuple[_Record, Path, str]]:
        """(plugin, file, scheme name) of every descriptor the plugins ship that parses.

        The hooks are called and the files parsed once per set of registered plugins; paths
        that do not exist and descriptors that do not parse are recorded as failures here.
        """
        if self._contributed is not None:
            return self._contributed
        contributed: list[tuple[_Record, Path, str]] = []
        for record, result in self._call_each("qscheme_schemes"):
            for item in _items(result, (str, Path)):
                if not isinstance(item, (str, Path)):
                    self._fail(record, "hook qscheme_schemes", f"returned {_short(item)}, not a path")
                    continue
                path = Path(item)
                if not path.exists():
                    self._fail(record, "hook qscheme_schemes", f"{path} does not exist")
                    continue
                unreadable: list[Problem] = []
                files = descriptor_files(path, problems=unreadable) if path.is_dir() else [path]
                for problem in unreadable:
                    self._fail(record, "hook qscheme_schemes", str(problem))
                for file in files:
                    try:
                        scheme = parse_scheme_file(file, source=f"plugin:{record.name}")
                    except SchemeError as exc:
                        self._fail(record, "hook qscheme_schemes", f"invalid descriptor: {exc}")
                        continue
                    contributed.append((record, file, scheme.name))
        self._contributed = contributed
        return contributed

    def scheme_files(self, taken: Mapping[str, str] | None = None) -> list[tuple[str, Path]]:
        """(source, file) of every valid descriptor that plugins ship, for the catalog.

        ``taken`` maps the names the catalog already defines (built-ins, QSCHEME_SCHEME_PATH
        folders) to where each is defined; by default the catalog is asked. A plugin scheme
        whose name is taken, by those or by an earlier plugin, is refused as that plugin's
        failure (recorded once), so it never breaks the catalog of the other schemes.
        """
        with self._lock:
            contributed = self._scheme_contributions()
            defined = dict(folder_scheme_names() if taken is None else taken)
            files: list[tuple[str, Path]] = []
            for record in self._records.values():
                record.schemes.clear()
            for record, file, name in contributed:
                if name in defined:
                    self._fail(
                        record,
                        "hook qscheme_schemes",
                        f"scheme {name!r} in {file} is already defined by {defined[name]}; "
                        "scheme names must be unique: rename the plugin's scheme or the other one",
                        once=True,
                    )
                    continue
                defined[name] = f"{file} (plugin:{record.name})"
                files.append((f"plugin:{record.name}", file))
                record.schemes.append(name)
            return files

    # -- reports -------------------------------------------------------------------------------

    def failures(self) -> tuple[PluginFailure, ...]:
        return tuple(self._failures)

    def infos(self) -> list[PluginInfo]:
        """Every plugin seen (loaded, failed or skipped), built-ins first, with what it added."""
        self.kernel_declarations()
        try:
            self.scheme_files()
        except SchemeError:  # a broken built-in catalog is reported by the catalog itself
            pass
        infos = []
        for record in self._records.values():
            infos.append(
                PluginInfo(
                    record.name,
                    record.distribution,
                    record.version,
                    record.builtin,
                    record.loaded,
                    record.origin,
                    tuple(record.kernels),
                    tuple(record.schemes),
                    tuple(f for f in self._failures if f.plugin == record.name),
                    record.skipped,
                )
            )
        return sorted(infos, key=lambda i: (not i.builtin, i.name))


def _items(result: object, single: type | tuple[type, ...]) -> list[object]:
    """A hook's result as a list: None -> [], a lone item -> [item], an iterable -> its items."""
    if result is None:
        return []
    if isinstance(result, single):
        return [result]
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable):
        return [result]
    return list(result)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except Exception:
        return None


def _distribution_of(entry_point: object) -> tuple[str | None, str | None]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return None, None
    try:
        return dist.metadata["Name"], dist.version
    except Exception:
        return getattr(dist, "name", None), None


def discover_entry_points() -> list[metadata.EntryPoint]:
    """Entry points of the ``qscheme`` group, de-duplicated and in a stable order."""
    seen: set[tuple[str, str, str]] = set()
    found = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        distribution, _ = _distribution_of(ep)
        key = ((distribution or "").lower(), ep.name, ep.value)
        if key not in seen:
            seen.add(key)
            found.append(ep)
    return sorted(found, key=lambda ep: ((_distribution_of(ep)[0] or "").lower(), ep.name))


def load_plugins(
    environ: Mapping[str, str] | None = None, entry_points: Iterable[EntryPointLike] | None = None
) -> Plugins:
    """Built-ins, then third-party entry points as the environment allows (module docstring)."""
    env = os.environ if environ is None else environ
    strict = env_flag(STRICT_VARIABLE, env)  # every variable checked before any plugin loads
    allowed = env_names(ALLOW_VARIABLE, env)
    autoload = not env_flag(DISABLE_AUTOLOAD_VARIABLE, env)
    plugins = Plugins(strict=strict)
    points = list(discover_entry_points() if entry_points is None else entry_points)
    builtin = [ep for ep in points if (_distribution_of(ep)[0] or "").lower() == BUILTIN_DISTRIBUTION]
    plugins.load_builtins(builtin)
    for ep in points:
        if any(ep is b for b in builtin):
            continue
        distribution, _ = _distribution_of(ep)
        if not autoload:
            plugins.skip(ep, f"{DISABLE_AUTOLOAD_VARIABLE}=1")
        elif allowed is not None and ep.name not in allowed and (distribution or "") not in allowed:
            plugins.skip(ep, f"not named in {ALLOW_VARIABLE}")
        else:
            plugins.load_entry_point(ep)
    return plugins


_current: Plugins | None = None
_current_lock = threading.Lock()


def get_plugins() -> Plugins:
    """The process's plugins, loaded on first use."""
    global _current
    current = _current
    if current is not None:
        return current
    with _current_lock:
        if _current is None:
            _current = load_plugins()
        return _current


def reset_plugins(plugins: Plugins | None = None) -> None:
    """Forget the loaded plugins (the next use reloads them), or install ``plugins`` instead."""
    global _current
    with _current_lock:
        _current = plugins


def register_plugin(plugin: object, name: str) -> bool:
    """Register a plugin object in this process (for applications and tests)."""
    return get_plugins().register(plugin, name)


def unregister_plugin(name: str) -> None:
    get_plugins().unregister(name)


def plugin_scheme_files(taken: Mapping[str, str] | None = None) -> list[tuple[str, Path]]:
    """(source, descriptor file) pairs that plugins contribute, for ``qscheme.catalog``.

    ``taken``: scheme names already defined, and where (``Plugins.scheme_files``)."""
    return get_plugins().scheme_files(taken)


def kernel_declarations() -> tuple[KernelDeclaration, ...]:
    return get_plugins().kernel_declarations()


def plugin_failures() -> tuple[PluginFailure, ...]:
    return get_plugins().failures()
