"""``inspect_checkpoint``: what a checkpoint holds and what is wrong with it, without loading it.

Unlike ``load_checkpoint`` it never raises on a bad checkpoint: a config or detection error
becomes the one fatal problem, and every tensor problem (layout and values) is listed. The
value checks are load's own (``check_module_values``: finite scales, then scales whose product
dequantizes to inf, NaN or zero), so inspect finds a problem wherever load refuses; they read
each module's tensors, weights included, one module at a time (``read_values=False`` skips them).
Names from the checkpoint are shown escaped (``shown``), so none can forge a line of output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from qscheme.checkpoint.plan import FuseSpec, Plan, plan_checkpoint
from qscheme.errors import CheckpointError, UsageError
from qscheme.text import group_label, listing, problem_lines, shown

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def module_pattern(name: str) -> str:
    """``model.layers.12.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj`` (for grouping)."""
    return _INDEX.sub(".*", name)


@dataclass(frozen=True)
class ModuleRow:
    module: str
    scheme: str
    n: int
    k: int
    origin: str

    def as_json(self) -> dict[str, object]:
        return {"module": self.module, "scheme": self.scheme, "n": self.n, "k": self.k, "origin": self.origin}


@dataclass
class Inspection:
    """The data ``qscheme inspect`` prints."""

    path: str
    producer: str = "?"
    producer_version: str | None = None
    producer_note: str | None = None
    config_file: str | None = None
    files: tuple[str, ...] = ()
    total_bytes: int = 0
    modules: list[ModuleRow] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    plain: tuple[str, ...] = ()
    kv_cache: tuple[str, ...] = ()
    tolerated: tuple[str, ...] = ()
    unused_targets: tuple[str, ...] = ()
    fused: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def scheme_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.modules:
            counts[row.scheme] = counts.get(row.scheme, 0) + 1
        return dict(sorted(counts.items()))

    def grouped(self) -> list[tuple[str, str, int, int, int]]:
        """(module pattern, scheme, N, K, count), in first-seen order; a MoE block's experts show
        their index range (``experts.{0..7}.gate_proj``, see ``group_label``)."""
        groups: dict[tuple[str, str, int, int], list[str]] = {}
        for row in self.modules:
            key = (module_pattern(row.module), row.scheme, row.n, row.k)
            groups.setdefault(key, []).append(row.module)
        return [(group_label(key[0], names), *key[1:], len(names)) for key, names in groups.items()]

    def as_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "producer": {
                "name": self.producer,
                "version": self.producer_version,
                "note": self.producer_note,
                "config": self.config_file,
            },
            "files": list(self.files),
            "total_bytes": self.total_bytes,
            "schemes": self.scheme_counts(),
            "modules": [row.as_json() for row in self.modules],
            "ignored": self.ignored,
            "plain_tensors": list(self.plain),
            "kv_cache_tensors": list(self.kv_cache),
            "tolerated_tensors": list(self.tolerated),
            "unused_targets": list(self.unused_targets),
            "fused": [{"module": name, "members": list(members)} for name, members in self.fused],
            "notes": self.notes,
            "problems": self.problems,
            "ok": self.ok,
        }


def _fill(inspection: Inspection, plan: Plan, read_values: bool) -> None:
    config = plan.config
    inspection.producer = config.producer
    inspection.producer_version = config.producer_version
    inspection.producer_note = config.producer_note
    inspection.config_file = getattr(config, "file", None)
    detection = plan.detection
    inspection.modules = [
        ModuleRow(
            module=module,
            scheme=layout.scheme.name,
            n=layout.n,
            k=layout.k,
            origin=detection.modules[module].origin,
        )
        for module, layout in plan.layouts.items()
    ]
    inspection.ignored = detection.ignored
    inspection.plain = detection.plain
    inspection.kv_cache = detection.kv_cache
    inspection.tolerated = tuple(f"{m}.{t}" for m, layout in plan.layouts.items() for t in layout.tolerated)
    inspection.unused_targets = detection.unused_targets
    inspection.fused = [(group.name, group.members) for group in plan.fuse_groups]
    inspection.notes = [*plan.files.notes, *plan.notes]
    inspection.problems = [str(p) for p in plan.problems]
    try:
        plan.layers()  # load refuses two layers of one name before it reads a value: so does inspect
    except CheckpointError as exc:
        inspection.problems.append(str(exc))
    inspection.problems.extend(oversized_tensors(plan))
    if read_values:
        from qscheme.checkpoint.load import check_module_values  # load imports the kernels: only when needed
        from qscheme.checkpoint.plain import read_plain_problems

        for layout in plan.layouts.values():
            if layout.problems:
                continue
            try:
                _, found = check_module_values(plan, layout)
            except CheckpointError as exc:
                inspection.problems.append(str(exc))
                continue
            inspection.problems.extend(str(p) for p in found)
        inspection.problems.extend(read_plain_problems(plan.files, plan.detection.plain))
    inspection.problems = list(dict.fromkeys(inspection.problems))  # an oversized tensor is also refused when read


def oversized_tensors(plan: Plan) -> list[str]:
    """Tensors whose header claims more bytes than this machine's memory (a sparse file can claim
    terabytes): load refuses them when it reads them; inspect says so from the headers."""
    from qscheme.storage import memory_bytes, too_large

    memory = memory_bytes()
    found = (too_large(info, memory) for info in plan.files.tensors.values())
    return [problem for problem in found if problem is not None]


def inspect_checkpoint(path: str | Path, *, fuse: FuseSpec | None = None, read_values: bool = True) -> Inspection:
    """Everything ``qscheme inspect`` shows; problems are collected, never raised."""
    inspection = Inspection(path=str(path))
    try:
        plan = plan_checkpoint(path, fuse=fuse)
    except CheckpointError as exc:
        inspection.problems.append(str(exc))
        return inspection
    except UsageError:
        raise  # the caller's mistake (an empty path, a bad fuse=), not the checkpoint's
    except (RecursionError, ValueError, OSError) as exc:  # a backstop: inspect reports, it never raises
        inspection.problems.append(f"{path}: cannot be inspected: {type(exc).__name__}: {exc}")
        return inspection
    inspection.files = tuple(p.name for p in plan.files.files)
    inspection.total_bytes = plan.files.total_bytes
    _fill(inspection, plan, read_values)
    return inspection


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def render_inspection(inspection: Inspection) -> str:
    """The text ``qscheme inspect`` prints."""
    from qscheme.kernels.render import text_table

    lines = [f"checkpoint: {shown(inspection.path, 1000)}"]
    if inspection.files:
        lines.append(f"files: {listing(list(inspection.files), 3)} ({_size(inspection.total_bytes)})")
    if inspection.config_file is not None or inspection.producer != "?":
        version = f" {shown(inspection.producer_version)}" if inspection.producer_version else ""
        config = shown(Path(inspection.config_file or "-").name)
        lines.append(f"producer: {shown(inspection.producer)}{version} ({config})")
    if inspection.producer_note:
        lines.append(f"  {shown(inspection.producer_note, 1000)}")
    if inspection.modules:
        counts = inspection.scheme_counts()
        lines.append(
            f"quantized modules: {len(inspection.modules)} ("
            + ", ".join(f"{shown(name)}: {count}" for name, count in counts.items())
            + ")"
        )
        rows = [
            (shown(pattern), shown(scheme), f"{n}x{k}", str(count))
            for pattern, scheme, n, k, count in inspection.grouped()
        ]
        lines.extend(["", text_table(rows, ("module", "scheme", "N x K", "count"), "  "), ""])
    elif inspection.config_file is not None:
        lines.append("quantized modules: 0")
    if inspection.ignored:
        entries = [f"{m} ({p!r})" for m, p in inspection.ignored.items()]
        lines.append(f"ignored modules ({len(entries)}): {listing(entries, 6)}")
    if inspection.plain:
        lines.append(f"plain tensors ({len(inspection.plain)}): {listing(list(inspection.plain), 6)}")
    if inspection.kv_cache:
        lines.append(f"kv-cache tensors ({len(inspection.kv_cache)}): {listing(list(inspection.kv_cache), 6)}")
    lines.append(
        f"tolerated tensors dropped ({len(inspection.tolerated)})"
        + (f": {listing(list(inspection.tolerated), 6)}" if inspection.tolerated else "")
    )
    for name, members in inspection.fused:
        lines.append(f"fused: {shown(name)} = {' + '.join(shown(member) for member in members)}")
    notes = [f"{shown(target)} matches no module" for target in inspection.unused_targets]
    notes += [shown(note, 2000) for note in inspection.notes]
    # a config with thousands of unused targets gets a few lines and a count, as problems do
    lines.extend(problem_lines(notes, bullet="note: "))
    if inspection.problems:
        lines.append(f"problems ({len(inspection.problems)}):")
        lines.extend(problem_lines(inspection.problems))
    else:
        lines.append("problems: none")
    return "\n".join(lines)
