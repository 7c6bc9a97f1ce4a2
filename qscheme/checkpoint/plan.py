"""What loading a checkpoint will do, worked out from its config and headers alone.

``plan_checkpoint`` reads the producer config, the safetensors headers, detects each module's
scheme, checks every module's layout (names, dtypes, shapes) and resolves the ``fuse=`` groups.
It reads no tensor data except the tiny ``weight_shape`` tensors. load, inspect and resolve all
start from a Plan; only load turns problems into an exception.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qscheme.checkpoint.config import ProducerConfig, read_producer_config
from qscheme.checkpoint.detect import Detection, ModuleAssignment, detect, split_name
from qscheme.checkpoint.gguf_plan import is_gguf_file, read_gguf_checkpoint
from qscheme.checkpoint.stacked_experts import split_for_producer
from qscheme.descriptor import Scheme
from qscheme.descriptor.state import MAX_STATE_BYTES, read_state
from qscheme.errors import CheckpointError, UsageError
from qscheme.storage import CheckpointFiles, refuse_empty_path
from qscheme.tensor_checks import ModuleLayout, TensorProblem, check_layout
from qscheme.text import problem_lines

FuseSpec = Mapping[str, Sequence[str]]
_FUSE_EXAMPLE = "fuse={'qkv_proj': ['q_proj', 'k_proj', 'v_proj']}"


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
        """(layer name, member modules) for every layer load builds, in checkpoint order.

        Layer names are unique: a name that two layers would share raises CheckpointError.
        """
        fused = self.fused_members
        out: list[tuple[str, tuple[str, ...]]] = []
        built: dict[str, tuple[str, ...]] = {}
        groups = {group.name: group for group in self.fuse_groups}
        for module in self.layouts:
            name = fused.get(module)
            members = (module,) if name is None else groups[name].members
            name = module if name is None else name
            if name in built:
                if built[name] == members:
                    continue  # a later member of a fused module already listed
                raise CheckpointError(
                    f"{self.path}: two layers would be named {name} (from {', '.join(built[name])} and from "
                    f"{', '.join(members)}); choose a fused name in fuse= that is not a module of the checkpoint"
                )
            built[name] = members
            out.append((name, members))
        return out


def _weight_shape(files: CheckpointFiles, assignment: ModuleAssignment) -> tuple[tuple[int, int] | None, str | None]:
    """The values of a declared weight_shape tensor, or of the shape key of a declared JSON state
    (None when absent or malformed; the problem when a state does not check)."""
    state = assignment.scheme.weight.state
    if state is not None:
        found = assignment.tensors.get(state.tensor.name)
        if found is None or found.dtype != "uint8" or len(found.shape) != 1:
            return None, None  # check_layout reports it
        data = files.get(found.name).numpy().tobytes() if found.numel <= MAX_STATE_BYTES else b" " * found.numel
        read = read_state(state, data)
        return (None, read) if isinstance(read, str) else (read.shape, None)
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


def check_fuse_spec(fuse: object) -> dict[str, tuple[str, ...]]:
    """``fuse=`` checked before anything is read: fused name -> its distinct member names.

    Raises UsageError unless ``fuse`` maps non-empty, dot-free fused names to non-empty
    sequences of distinct, non-empty, dot-free member names (``{"qkv_proj": ["q_proj", ...]}``).
    """
    if fuse is None:
        return {}
    if not isinstance(fuse, Mapping):
        raise UsageError(
            f"fuse must map each fused module name to its member module names, e.g. {_FUSE_EXAMPLE}; "
            f"got a {type(fuse).__name__}: {fuse!r}"
        )
    spec: dict[str, tuple[str, ...]] = {}
    for fused_name, members in fuse.items():
        if not isinstance(fused_name, str) or not fused_name or "." in fused_name:
            raise UsageError(
                f"fuse: fused name {fused_name!r} must be a non-empty module name without dots, e.g. 'qkv_proj' "
                "(the fused module is placed under the members' parent)"
            )
        if isinstance(members, str | bytes) or not isinstance(members, Sequence) or not members:
            raise UsageError(
                f"fuse[{fused_name!r}] must list the member module names, e.g. ['q_proj', 'k_proj', 'v_proj']; "
                f"got {members!r}"
            )
        for member in members:
            if not isinstance(member, str) or not member or "." in member:
                raise UsageError(
                    f"fuse[{fused_name!r}]: member {member!r} must be a module's own name under its parent, "
                    "a non-empty string without dots, e.g. 'q_proj'"
                )
        repeated = sorted({member for member in members if members.count(member) > 1})
        if repeated:
            raise UsageError(
                f"fuse[{fused_name!r}] lists {', '.join(map(repr, repeated))} more than once; "
                "each member may appear once"
            )
        spec[fused_name] = tuple(members)
    return spec


def _occupied_names(detection: Detection) -> dict[str, str]:
    """Every module name the checkpoint already uses -> what it is (quantized, ignored, ...)."""
    occupied: dict[str, str] = {}
    tensor_modules = [split_name(tensor)[0] for tensor in (*detection.plain, *detection.kv_cache)]
    for module in (*detection.modules, *detection.ignored, *tensor_modules):
        parts = module.split(".")
        for end in range(1, len(parts)):
            occupied.setdefault(".".join(parts[:end]), "a module holding other modules")
    for module in tensor_modules:
        occupied[module] = "a module holding plain tensors"
    for module in detection.ignored:
        occupied[module] = "an unquantized (ignored) module"
    for module in detection.modules:
        occupied[module] = "a quantized module"
    return occupied


def _unknown_member_error(fused_name: str, members: tuple[str, ...], unknown: str, own_names: set[str]) -> str:
    close = difflib.get_close_matches(unknown, sorted(own_names), n=3, cutoff=0.6)
    hint = (
        f"close module names: {', '.join(close)}"
        if close
        else f"the checkpoint's module names include {', '.join(sorted(own_names)[:8])}"
    )
    return (
        f"cannot fuse {fused_name!r} = {list(members)}: member {unknown!r} matches no quantized or ignored "
        f"module of the checkpoint; {hint}. Fix the member's name in fuse="
    )


def plan_fuse(spec: Mapping[str, tuple[str, ...]], detection: Detection) -> tuple[tuple[FuseGroup, ...], list[str]]:
    """Fuse groups for ``fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``.

    A group forms under every parent module that has any of the members. All members must
    then be quantized modules; members that are all unquantized (ignored layers) stay separate
    plain tensors, which is noted. A member that names no module anywhere in the checkpoint,
    or a fused name that is already a module of the checkpoint (other than one of its own
    members), raises CheckpointError. ``spec`` is ``fuse=`` as ``check_fuse_spec`` returns it.
    """
    if not spec:
        return (), []
    groups: list[FuseGroup] = []
    notes: list[str] = []
    claimed: dict[str, str] = {}
    known_modules = set(detection.modules) | set(detection.ignored)
    own_names = {split_name(module)[1] for module in known_modules}
    occupied = _occupied_names(detection)
    for fused_name, members in spec.items():
        for member in members:
            if member not in own_names:
                raise CheckpointError(_unknown_member_error(fused_name, members, member, own_names))
        parents = sorted({split_name(module)[0] for module in known_modules if split_name(module)[1] in members})
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
            if name in occupied and name not in names:
                raise CheckpointError(
                    f"cannot fuse {', '.join(names)} as {name}: the checkpoint already has {name}, "
                    f"{occupied[name]} that is not one of the members; choose another fused name than "
                    f"{fused_name!r} in fuse="
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
    """Config + headers + detection + layout checks for a checkpoint folder or a GGUF file
    (UsageError for an empty path, which would name the current folder)."""
    refuse_empty_path(path)
    fuse_spec = check_fuse_spec(fuse)  # a malformed fuse= is a UsageError before any file is read
    folder = Path(path)
    if schemes is None:
        schemes = catalog_schemes()
    files: CheckpointFiles
    config: ProducerConfig
    if is_gguf_file(folder):  # one .gguf file, its tensors by transformers name (checkpoint.gguf_plan)
        files, config, detection = read_gguf_checkpoint(folder, schemes)
    else:
        files = CheckpointFiles(folder)
        config = read_producer_config(folder)
        split = split_for_producer(config, files.tensors)  # one module per expert (checkpoint.stacked_experts)
        if split is not None:
            files.tensors = split
        detection = detect(config, files.tensors, schemes)
    layouts: dict[str, ModuleLayout] = {}
    problems: list[TensorProblem] = []
    for module, assignment in detection.modules.items():
        weight_shape, shape_problem = _weight_shape(files, assignment)
        layout = check_layout(assignment, weight_shape)
        if shape_problem is not None:
            spec = assignment.scheme.weight.shape_tensor
            if assignment.scheme.weight.state is not None:
                spec = assignment.scheme.weight.state.tensor
            assert spec is not None
            info = assignment.tensors[spec.name]
            layout.problems.append(TensorProblem(str(info.file), info.name, shape_problem))
        layouts[module] = layout
        problems.extend(layout.problems)
    groups, notes = plan_fuse(fuse_spec, detection)
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


def format_problems(problems: Sequence[object], limit: int = 10) -> str:
    """Bullet lines: a few problems of each kind and how many more like them, ``limit`` kinds at most."""
    hint = " (run `qscheme inspect` to list them all)"
    return "\n".join(problem_lines(problems, max_kinds=limit, rest_hint=hint))
