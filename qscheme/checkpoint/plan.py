"""What loading a checkpoint will do, worked out from its config and headers alone.

``plan_checkpoint`` reads the producer config, the safetensors headers, detects each module's
scheme, checks every module's layout (names, dtypes, shapes) and resolves the ``fuse=`` groups.
It reads no tensor data except the tiny ``weight_shape`` tensors. load, inspect and resolve all
start from a Plan; only load turns problems into an exception.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qscheme.checkpoint.config import ProducerConfig, read_producer_config
from qscheme.checkpoint.detect import Detection, ModuleAssignment, detect, split_name
from qscheme.checkpoint.reader import CheckpointFiles
from qscheme.checkpoint.validate import ModuleLayout, TensorProblem, check_layout
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError

FuseSpec = Mapping[str, Sequence[str]]


@dataclass(frozen=True)
class FuseGroup:
    """One fused module: its name and its members' checkpoint module names, in output order."""

    name: str
    members: tuple[str, ...]


@dataclass
class Plan:
    """A checkpoint's modules and what is wrong with them, before any tensor data is read."""

    path: Path
    files: CheckpointFiles
    config: ProducerConfig
    detection: Detection
    layouts: dict[str, ModuleLayout]
    fuse_groups: tuple[FuseGroup, ...] = ()
    problems: list[TensorProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fused_members(self) -> dict[str, str]:
        """member module -> fused module name."""
        return {member: group.name for group in self.fuse_groups for member in group.members}

    def layers(self) -> list[tuple[str, tuple[str, ...]]]:
        """(layer name, member modules) for every layer load builds, in checkpoint order."""
        fused = self.fused_members
        out: list[tuple[str, tuple[str, ...]]] = []
        seen: set[str] = set()
        groups = {group.name: group for group in self.fuse_groups}
        for module in self.layouts:
            name = fused.get(module)
            if name is None:
                out.append((module, (module,)))
            elif name not in seen:
                seen.add(name)
                out.append((name, groups[name].members))
        return out


def _weight_shape(files: CheckpointFiles, assignment: ModuleAssignment) -> tuple[tuple[int, int] | None, str | None]:
    """The values of a declared weight_shape tensor (None when absent or malformed)."""
    spec = assignment.scheme.weight.shape_tensor
    if spec is None or spec.name not in assignment.tensors:
        return None, None
    info = assignment.tensors[spec.name]
    if info.dtype not in spec.dtypes or info.numel != 2:
        return None, None  # check_layout reports the dtype / shape
    values = files.get(info.name).reshape(-1).to(torch.int64).tolist()
    n, k = int(values[0]), int(values[1])
    if n <= 0 or k <= 0:
        return None, f"expected two positive sizes [N, K], found {values}"
    return (n, k), None


def plan_fuse(fuse: FuseSpec | None, detection: Detection) -> tuple[tuple[FuseGroup, ...], list[str]]:
    """Fuse groups for ``fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``.

    A group forms under every parent module whose first member is a module of the
    checkpoint. All members must then be quantized modules; members that are all
    unquantized (ignored layers) stay separate plain tensors, which is noted.
    """
    if not fuse:
        return (), []
    groups: list[FuseGroup] = []
    notes: list[str] = []
    claimed: dict[str, str] = {}
    known_modules = set(detection.modules) | set(detection.ignored)
    for fused_name, members in fuse.items():
        if not members or isinstance(members, str):
            raise CheckpointError(f"fuse[{fused_name!r}] must list the member module names, e.g. ['q_proj', 'k_proj']")
        first = members[0]
        parents = sorted(
            {split_name(module)[0] for module in known_modules if split_name(module)[1] == first}
            | ({""} if first in known_modules else set())
        )
        for parent in parents:
            prefix = f"{parent}." if parent else ""
            names = tuple(prefix + member for member in members)
            name = prefix + fused_name
            quantized = [m for m in names if m in detection.modules]
            if not quantized:
                notes.append(f"{name}: members {', '.join(names)} are not quantized; left unfused")
                continue
            missing = [m for m in names if m not in detection.modules]
            if missing:
                raise CheckpointError(
                    f"cannot fuse {name}: {', '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not a quantized module of the checkpoint "
                    f"(found {', '.join(quantized)}); every member of a fused module must be quantized"
                )
            for member in names:
                if member in claimed:
                    raise CheckpointError(f"{member} is a member of both {claimed[member]} and {name}; check fuse=")
                claimed[member] = name
            groups.append(FuseGroup(name=name, members=names))
    return tuple(groups), notes


def catalog_schemes() -> list[Scheme]:
    """The catalog's schemes (``load_catalog`` reparses only when a descriptor file changes)."""
    from qscheme.catalog import load_catalog

    return list(load_catalog())


def plan_checkpoint(
    path: str | Path,
    *,
    schemes: Iterable[Scheme] | None = None,
    fuse: FuseSpec | None = None,
) -> Plan:
    """Config + headers + detection + layout checks for a checkpoint folder."""
    folder = Path(path)
    files = CheckpointFiles(folder)
    config = read_producer_config(folder)
    if schemes is None:
        schemes = catalog_schemes()
    detection = detect(config, files.tensors, schemes)
    layouts: dict[str, ModuleLayout] = {}
    problems: list[TensorProblem] = []
    for module, assignment in detection.modules.items():
        weight_shape, shape_problem = _weight_shape(files, assignment)
        layout = check_layout(assignment, weight_shape)
        if shape_problem is not None:
            spec = assignment.scheme.weight.shape_tensor
            assert spec is not None
            info = assignment.tensors[spec.name]
            layout.problems.append(TensorProblem(str(info.file), info.name, shape_problem))
        layouts[module] = layout
        problems.extend(layout.problems)
    groups, notes = plan_fuse(fuse, detection)
    for group in groups:
        first = layouts[group.members[0]]
        for member in group.members[1:]:
            other = layouts[member]
            if other.scheme.name != first.scheme.name:
                raise CheckpointError(
                    f"cannot fuse {group.name}: {first.module} uses {first.scheme.name} but {member} uses "
                    f"{other.scheme.name}; fused members must share one scheme"
                )
            if other.ok and first.ok and other.k != first.k:
                raise CheckpointError(
                    f"cannot fuse {group.name}: {first.module} has K={first.k} but {member} has K={other.k}"
                )
    return Plan(
        path=folder,
        files=files,
        config=config,
        detection=detection,
        layouts=layouts,
        fuse_groups=groups,
        problems=problems,
        notes=notes,
    )


def format_problems(problems: Sequence[object], limit: int = 20) -> str:
    lines = [f"  - {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more (run `qscheme inspect` to list them all)")
    return "\n".join(lines)
