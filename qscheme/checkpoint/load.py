"""``load_checkpoint``: a checkpoint folder -> QuantLinear per quantized module, plain tensors, a report.

Order of work, so that nothing is half-loaded: plan (config, headers, detection, layouts),
split, then read and check every module's scale values, then canonicalise and fuse, and only
then build the QuantLinear modules. Any problem raises one CheckpointError listing all problems
of its stage, before a single module is returned.

One pipeline serves a single process and a tensor-parallel rank: its reader decides which bytes
are read. ``WholeReader`` (a single process, the degenerate split) reads whole tensors and
splits nothing; ``qscheme.parallel.reader.RankReader`` splits every layer by the TP plan and
the descriptor rules and reads only the rank's slices (``load_checkpoint_tp``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonicalize
from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.checkpoint.fuse import FUSE_POLICIES, FuseOutcome, fuse_members, scales_differ
from qscheme.checkpoint.plain import plain_problems
from qscheme.checkpoint.plan import FuseSpec, Plan, check_fuse_spec, format_problems, plan_checkpoint
from qscheme.checkpoint.report import CheckpointReport, LayerReport
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, QuantizeError, UsageError
from qscheme.kernels.registry import checked_kernel
from qscheme.modules import QuantLinear, checked_device, problem_for
from qscheme.parallel.agree import failures_shared, plan_digest
from qscheme.parallel.plan import LayerShard, TPPlan, checked_tp_plan
from qscheme.parallel.reader import RankReader
from qscheme.parallel.rules import Style, checked_degree
from qscheme.producers.gguf.config import is_gguf_file
from qscheme.storage import Progress, ReadCounter, auto_enabled
from qscheme.tensor_checks import BIAS, ModuleLayout, TensorProblem, check_values, value_reads
from qscheme.text import listing, shown

FusePolicyChoice = str | Mapping[str, str] | None


class UnknownModuleError(CheckpointError, KeyError):
    """``checkpoint[name]`` for a name that is not one of the checkpoint's quantized modules.

    A KeyError too, so that ``Mapping`` idioms (``in``, ``.get``, ``except KeyError``) keep working.
    """

    def __init__(self, message: str, name: object) -> None:
        super().__init__(message)
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])  # not KeyError's repr() of the message


class Checkpoint(Mapping[str, QuantLinear]):
    """A loaded checkpoint: module name -> QuantLinear, plus ``tensors`` and ``report``.

    Module names are the checkpoint's (``model.layers.0.self_attn.q_proj``, no ``.weight``);
    a fused module is named by its parent and the fused name (``...self_attn.qkv_proj``).
    ``tensors`` holds every unquantized tensor by its full checkpoint name (embeddings, norms,
    ignored layers' weights, KV-cache scales).
    """

    def __init__(
        self,
        path: Path,
        modules: dict[str, QuantLinear],
        tensors: dict[str, Tensor],
        report: CheckpointReport,
        plan: Plan,
    ) -> None:
        self.path = path
        self.modules = modules
        self.tensors = tensors
        self.report = report
        self.plan = plan

    def __getitem__(self, name: str) -> QuantLinear:
        layer = self.modules.get(name)
        if layer is None:
            raise self._unknown(name)
        return layer

    def __contains__(self, name: object) -> bool:
        return name in self.modules

    def get(self, name: str, default: QuantLinear | None = None) -> QuantLinear | None:  # type: ignore[override]
        return self.modules.get(name, default)  # a miss builds no "did you mean" message

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self) -> str:
        return (
            f"Checkpoint({str(self.path)!r}, {len(self.modules)} quantized modules, {len(self.tensors)} plain tensors)"
        )

    @property
    def producer(self) -> str:
        return self.report.producer

    def canonical(self, name: str) -> CanonicalWeight:
        """The canonical tensors behind one module (``module.weight_canonical``)."""
        return self[name].weight_canonical

    def _unknown(self, name: object) -> UnknownModuleError:
        """The error for a name that is not a module: the closest names, and where plain tensors are."""
        hint = " Module names carry no trailing '.weight' (e.g. 'model.layers.0.self_attn.q_proj')."
        if isinstance(name, str):
            base = name.removesuffix(".weight")
            fused_into = self.plan.fused_members.get(name)
            if name in self.tensors:
                hint = f" It is a plain (unquantized) tensor: use checkpoint.tensors[{name!r}]."
            elif base != name and base in self.modules:
                hint = f" Module names carry no trailing '.weight': use checkpoint[{base!r}]."
            elif fused_into is not None:
                hint = f" It was fused into {fused_into!r} (fuse=): use checkpoint[{fused_into!r}]."
            else:
                close = [module for module in self.modules if module.endswith(f".{base}")][:3]
                close = close or difflib.get_close_matches(base, list(self.modules), n=3, cutoff=0.6)
                if close:
                    hint = f" Did you mean {' or '.join(map(repr, close))}?" + hint
        return UnknownModuleError(
            f"{self.path}: no quantized module {name!r} among the checkpoint's {len(self.modules)}.{hint} "
            "Plain tensors (embeddings, norms, ignored layers) are in checkpoint.tensors, by their full names.",
            name,
        )


class ShardedCheckpoint(Checkpoint):
    """A Checkpoint holding rank ``tp_rank`` of ``tp_size``: shard-sized modules plus the split.

    ``shards[name]`` says how each layer was split (style, shard N and K, every tensor's
    slice); ``bytes_read`` counts the tensor bytes this rank read, per tensor name.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        tp_rank: int,
        tp_size: int,
        tp_plan: TPPlan,
        shards: dict[str, LayerShard],
        bytes_read: ReadCounter,
    ) -> None:
        super().__init__(checkpoint.path, checkpoint.modules, checkpoint.tensors, checkpoint.report, checkpoint.plan)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_plan = tp_plan
        self.shards = shards
        self.bytes_read = bytes_read

    def digest(self, extra: Sequence[object] = ()) -> bytes:
        """The checksum the ranks compare: every layer's split, the plain tensors, and ``extra``."""
        return plan_digest(self.tp_size, self.shards, list(self.tensors), extra)

    def style(self, name: str) -> Style:
        """column, row or replicate: how module ``name`` was split."""
        if name not in self.shards:
            raise self._unknown(name)
        return self.shards[name].style

    def __repr__(self) -> str:
        return (
            f"ShardedCheckpoint({str(self.path)!r}, rank {self.tp_rank} of {self.tp_size}, "
            f"{len(self.modules)} quantized modules, {len(self.tensors)} plain tensors)"
        )


def check_fuse_policy(choice: object, fuse: Mapping[str, Sequence[str]]) -> None:
    """``fuse_policy=`` checked before anything is read, against the (checked) ``fuse=`` spec.

    Every policy must be one of FUSE_POLICIES, every mapping key a fused name of ``fuse`` (or a
    full fused module name ending in one), and a policy needs ``fuse=``; UsageError otherwise.
    """
    if choice is None:
        return
    example = "fuse_policy='rescale' or fuse_policy={'qkv_proj': 'rescale'}"
    if not isinstance(choice, str | Mapping):
        raise UsageError(
            f"fuse_policy must be one of {', '.join(FUSE_POLICIES)} or a mapping fused name -> policy "
            f"({example}); got a {type(choice).__name__}: {choice!r}"
        )
    if not fuse:
        raise UsageError(
            f"fuse_policy={choice!r} applies to fused modules, but fuse= fuses none; pass fuse= too "
            "(e.g. fuse={'qkv_proj': ['q_proj', 'k_proj', 'v_proj']}) or drop fuse_policy"
        )
    entries: list[tuple[object, object]] = [(None, choice)] if isinstance(choice, str) else list(choice.items())
    for key, policy in entries:
        where = "fuse_policy" if key is None else f"fuse_policy[{key!r}]"
        if policy not in FUSE_POLICIES:
            raise UsageError(f"{where}: {policy!r} is not one of {', '.join(FUSE_POLICIES)}")
        if key is not None and (not isinstance(key, str) or key.rpartition(".")[2] not in fuse):
            close = difflib.get_close_matches(str(key).rpartition(".")[2], list(fuse), n=1)
            suggestion = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(
                f"{where}: {key!r} is not a fused name of fuse= ({', '.join(map(repr, fuse))}) nor a fused "
                f"module named after one{suggestion}"
            )


def _check_policy_modules(choice: FusePolicyChoice, plan: Plan) -> None:
    """Full-name fuse_policy keys must name a fused module the plan builds."""
    if not isinstance(choice, Mapping):
        return
    fused = [group.name for group in plan.fuse_groups]
    for key in choice:
        if "." in key and key not in fused:
            shown = listing(fused, 6, sentence=True)
            raise UsageError(
                f"{plan.path}: fuse_policy[{key!r}] names no fused module of this checkpoint (fused: "
                f"{shown or 'none'}); give a full fused module name, or the fused name "
                f"{key.rpartition('.')[2]!r} for all of them"
            )


def _policy_for(name: str, choice: FusePolicyChoice) -> str | None:
    """The policy asked for one fused module (its full name first, then its fused name)."""
    if choice is None or isinstance(choice, str):
        return choice
    return choice.get(name, choice.get(name.rpartition(".")[2]))


def choose_fuse_policy(
    name: str,
    scheme: Scheme,
    members: Sequence[CanonicalWeight],
    device: torch.device,
    kernel: str | None,
    activation_dtype: str,
    requested: str | None,
) -> tuple[str, str]:
    """(policy, why): the user's choice, else the scheme's policy, falling back as it declares
    when no kernel on this device takes one scale per partition."""
    if requested is not None:
        return requested, "requested"
    if not scales_differ(members):
        return "per_partition", "scales equal"
    policy = scheme.fused.policy
    if policy != "per_partition":
        return policy, f"scheme {scheme.name} policy"
    from qscheme.checkpoint.fuse import concatenate
    from qscheme.kernels.registry import resolve_layer

    problem = problem_for(concatenate(members), activation_dtype, name)
    resolution = resolve_layer(scheme, problem, _facts_device(device), kernel)
    if resolution.kernel is not None:
        return "per_partition", f"kernel {resolution.kernel.name} takes one scale per partition"
    return scheme.fused.fallback, (
        f"no kernel on {device.type} takes per-partition scales; scheme {scheme.name} falls back to "
        f"{scheme.fused.fallback}"
    )


def _facts_device(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else device.type


def _bias(biases: Mapping[str, Tensor], members: Sequence[str], n_by_member: Sequence[int]) -> Tensor | None:
    """The layer's bias from its members' (zeros for a member without one), or None."""
    found = [biases.get(m) for m in members]
    dtype = next((b.dtype for b in found if b is not None), None)
    if dtype is None:
        return None
    values = [
        b.to(dtype) if b is not None else torch.zeros(n, dtype=dtype) for b, n in zip(found, n_by_member, strict=True)
    ]
    return values[0] if len(values) == 1 else torch.cat(values)


class Reader(Protocol):
    """Which bytes a load reads: whole tensors (``WholeReader``), or one rank's slices
    (``qscheme.parallel.reader.RankReader``)."""

    tp_size: int
    where: str  # appended to "problem(s) found": "" or " on rank R"

    def split(self, plan: Plan) -> None: ...

    def member(self, plan: Plan, layout: ModuleLayout) -> tuple[ModuleLayout, dict[str, Tensor]]: ...

    def whole(self, plan: Plan, name: str) -> Tensor: ...

    def origin(self, name: str, origin: str) -> str: ...

    def notes(self) -> list[str]: ...


class WholeReader:
    """A single process: every tensor read whole, nothing split (tp_size 1)."""

    tp_size = 1
    where = ""

    def split(self, plan: Plan) -> None:
        return None

    def member(self, plan: Plan, layout: ModuleLayout) -> tuple[ModuleLayout, dict[str, Tensor]]:
        return layout, plan.files.get_many(value_reads(layout, every_declared=True))

    def whole(self, plan: Plan, name: str) -> Tensor:
        return plan.files.get(name)

    def origin(self, name: str, origin: str) -> str:
        return origin

    def notes(self) -> list[str]:
        return []


def _checked_member(
    plan: Plan,
    layout: ModuleLayout,
    checked: ModuleLayout,
    tensors: dict[str, Tensor],
    biases: dict[str, Tensor] | None,
    canonical: bool,
) -> tuple[CanonicalWeight | None, list[TensorProblem]]:
    """Load's value checks on what was read of one module (``checked``: its layout as read, the
    shard's N x K for a rank), then (with ``canonical``) canonicalization."""
    module = layout.module
    found = check_values(checked, tensors)
    bias = tensors.pop(BIAS, None)
    if bias is not None and biases is not None:
        biases[module] = bias
    if found or not canonical:
        return None, found
    try:
        return canonicalize(layout.scheme, tensors, checked.n, checked.k, layer=module), []
    except QuantizeError as error:  # values the scheme cannot dequantize (e.g. scales overflowing)
        weight = layout.declared.get(layout.scheme.weight.tensor.name)
        file = shown(weight.file.name) if weight is not None else str(plan.path)
        return None, [TensorProblem(file, weight.name if weight is not None else module, str(error))]


def check_module_values(
    plan: Plan, layout: ModuleLayout, biases: dict[str, Tensor] | None = None, canonical: bool = True
) -> tuple[CanonicalWeight | None, list[TensorProblem]]:
    """Read one module's tensors and run load's value checks on them: ``check_values``, then
    (with ``canonical``) canonicalization, whose QuantizeError (e.g. scales dequantizing to inf)
    becomes a problem. (canonical weight, []) when the module loads, else (None, problems);
    ``inspect`` runs this too, so that it reports what load refuses. ``biases``, when given,
    receives the module's bias."""
    checked, tensors = WholeReader().member(plan, layout)
    return _checked_member(plan, layout, checked, tensors, biases, canonical)


def _refuse(plan: Plan, problems: Sequence[TensorProblem], where: str = "") -> None:
    if problems:
        raise CheckpointError(
            f"{plan.path}: {len(problems)} problem(s) found{where}, nothing was loaded:\n{format_problems(problems)}"
        )


def _read_ahead(plan: Plan, reader: Reader) -> Iterator[tuple[ModuleLayout, dict[str, Tensor]]]:
    """``reader.member`` of every planned module, in order, each read on a reader thread while the
    caller checks the one before (the reads release the GIL): reading overlaps checking. One
    module is read ahead at most; a read's error is raised where that module is taken, as a
    plain loop would raise it."""
    layouts = list(plan.layouts.values())
    if len(layouts) <= 1:
        yield from (reader.member(plan, layout) for layout in layouts)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="qscheme-read") as pool:
        ahead = pool.submit(reader.member, plan, layouts[0])
        for index in range(len(layouts)):
            current = ahead
            if index + 1 < len(layouts):
                ahead = pool.submit(reader.member, plan, layouts[index + 1])
            yield current.result()


def _read_canonical(
    plan: Plan, reader: Reader, progress: Progress | None, biases: dict[str, Tensor] | None
) -> dict[str, CanonicalWeight]:
    """Every planned module's canonical tensors as ``reader`` reads them, after the value checks;
    raises on any problem."""
    canonical: dict[str, CanonicalWeight] = {}
    problems: list[TensorProblem] = []
    for (module, layout), (checked, tensors) in zip(plan.layouts.items(), _read_ahead(plan, reader), strict=True):
        weight, found = _checked_member(plan, layout, checked, tensors, biases, canonical=not problems)
        problems.extend(found)
        if weight is not None:
            canonical[module] = weight
        if progress is not None:
            progress.advance(item=module)
    _refuse(plan, problems, reader.where)
    return canonical


def load_canonical(
    plan: Plan, progress: Progress | None = None, biases: dict[str, Tensor] | None = None
) -> dict[str, CanonicalWeight]:
    """Every planned module's canonical tensors, after the value checks; raises on any problem.
    ``biases``, when given, receives each module's bias as read for the checks."""
    _refuse(plan, plan.problems)
    return _read_canonical(plan, WholeReader(), progress, biases)


def checked_schemes(schemes: object, caller: str = "load_checkpoint") -> list[Scheme]:
    """``schemes=`` as a list of Scheme objects: one scheme (object, catalog name or descriptor
    path) or an iterable of them; UsageError before anything is read otherwise."""
    if isinstance(schemes, Scheme | str | os.PathLike):
        schemes = [schemes]
    if not isinstance(schemes, Iterable) or isinstance(schemes, bytes | Mapping):
        raise UsageError(
            f"{caller}(schemes=...): pass scheme names, descriptor paths or Scheme objects (a list, or one), "
            f"not {type(schemes).__name__}; e.g. schemes=['compressed-tensors/NVFP4'], or None for the whole catalog"
        )
    found: list[Scheme] = []
    for scheme in schemes:
        require_scheme_argument(scheme, f"{caller}(schemes=...)")
        found.append(load_scheme(scheme if isinstance(scheme, Scheme | str) else Path(scheme)))
    if not found:
        raise UsageError(f"{caller}(schemes=[]): no scheme to detect with; pass None for the whole catalog")
    return found


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    activation_dtype: str = "bfloat16",
    schemes: Iterable[Scheme] | None = None,
    progress: bool | None = None,
    tp_rank: int | None = None,
    tp_size: int = 1,
    tp_plan: object = None,
) -> Checkpoint:
    """Load a compressed-tensors or ModelOpt checkpoint folder, or a GGUF file, exactly.

    ``device`` is "cpu", "cuda", "cuda:N" or a torch.device; ``kernel`` forces one kernel for
    every layer; ``fuse`` builds one module from several (``{"qkv_proj": ["q_proj", "k_proj",
    "v_proj"]}``); ``fuse_policy`` ("per_partition", "rescale", "requantize", "refuse", or a
    mapping fused name -> policy; needs ``fuse``) overrides what the scheme and the kernels
    decide for fused members whose scales differ. A bad ``device``, ``kernel`` (not a declared
    kernel's name), ``fuse`` or ``fuse_policy`` raises UsageError before anything is read;
    CheckpointError (nothing loaded) on any malformed config, file or tensor, or on ``fuse``
    members the checkpoint does not have.

    ``tp_rank`` (default: the torch.distributed rank) / ``tp_size`` / ``tp_plan``: load one
    tensor-parallel rank's shards, reading only their bytes (``load_checkpoint_tp``,
    docs/parallel.md); ShardError naming every layer a split would cut,
    with the degrees that would work.

    A ``.gguf`` file (llama.cpp) loads under transformers' module names: each quantized weight a
    layer of scheme ``gguf/<TYPE>``, stacked experts one layer per expert, float tensors plain
    (``checkpoint.gguf_plan``; needs the optional gguf and transformers packages). Tensor
    parallelism is refused for it (UsageError).
    """
    if tp_rank is not None or tp_size != 1 or tp_plan is not None:
        if tp_rank is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise UsageError(
                    f"load_checkpoint: tp_size={tp_size!r} needs tp_rank (this process's rank), or an initialised "
                    "torch.distributed process group to take it from"
                )
            tp_rank = torch.distributed.get_rank()
        return load_checkpoint_tp(
            path,
            tp_rank,
            tp_size,
            tp_plan,
            device=device,
            kernel=kernel,
            fuse=fuse,
            fuse_policy=fuse_policy,
            activation_dtype=activation_dtype,
            schemes=schemes,
            progress=progress,
        )
    if not isinstance(path, str | Path):
        raise UsageError(f"load_checkpoint: path must be a folder path (str or Path), not {type(path).__name__}")
    return _load(path, WholeReader(), device, kernel, fuse, fuse_policy, activation_dtype, schemes, progress)


def load_checkpoint_tp(
    path: str | Path,
    tp_rank: int,
    tp_size: int,
    tp_plan: object = None,
    *,
    device: str | torch.device = "cpu",
    kernel: str | None = None,
    fuse: FuseSpec | None = None,
    fuse_policy: FusePolicyChoice = None,
    activation_dtype: str = "bfloat16",
    schemes: Iterable[Scheme] | None = None,
    progress: bool | None = None,
    verify_ranks: bool = True,
) -> ShardedCheckpoint:
    """Load rank ``tp_rank`` of ``tp_size``: shard-sized QuantLinear modules, reading only their bytes.

    ``tp_plan`` maps module-name patterns to ``column`` / ``row`` / ``replicate`` (None: the
    Llama default of ``qscheme.parallel.plan.DEFAULT_TP_PLAN``); the other arguments are
    ``load_checkpoint``'s. UsageError for bad arguments before anything is read; ShardError
    (a CheckpointError) naming every layer a split would cut, with the degrees that would work,
    before any tensor data is read; CheckpointError as ``load_checkpoint`` for bad files.

    When the default process group is this tensor-parallel group (rank ``tp_rank`` of
    ``tp_size``), the ranks compare their plans' checksums (``qscheme.parallel.agree``) and every
    rank raises PlanMismatchError, naming the ranks that differ, unless all hold the same plan;
    a rank that fails announces it, so the others raise too. ``verify_ranks=False`` skips this,
    for a process that loads a shard alone (the group's other ranks would wait for it).
    """
    if not isinstance(path, str | Path):
        raise UsageError(f"load_checkpoint: path must be a folder path (str or Path), not {type(path).__name__}")
    if is_gguf_file(path):
        raise UsageError(
            f"load_checkpoint({str(path)!r}, tp_size={tp_size!r}): tensor parallelism is not offered for GGUF files; "
            "load the file in one process (no tp_rank / tp_size / tp_plan), or convert it to a safetensors "
            "checkpoint first"
        )
    tp_size, tp_rank = checked_degree(tp_size, tp_rank)
    if not isinstance(verify_ranks, bool):
        raise UsageError(f"load_checkpoint: verify_ranks must be True or False, not {verify_ranks!r}")
    what = f"load_checkpoint({str(path)!r}, tp_rank={tp_rank}, tp_size={tp_size})"
    with failures_shared(what, tp_rank, tp_size, verify_ranks) as done:
        reader = RankReader(tp_rank, tp_size, checked_tp_plan(tp_plan))
        base = _load(path, reader, device, kernel, fuse, fuse_policy, activation_dtype, schemes, progress)
        checkpoint = ShardedCheckpoint(base, tp_rank, tp_size, reader.tp_plan, reader.shards, reader.counter)
        done(checkpoint.digest())
    return checkpoint


def _load(
    path: str | Path,
    reader: Reader,
    device: str | torch.device,
    kernel: str | None,
    fuse: FuseSpec | None,
    fuse_policy: FusePolicyChoice,
    activation_dtype: str,
    schemes: Iterable[Scheme] | None,
    progress: bool | None,
) -> Checkpoint:
    """The one pipeline: check the arguments, plan, split (``reader``), read and check every
    module's values, read the plain tensors, then build every layer."""
    if schemes is not None:
        schemes = checked_schemes(schemes)
    torch_device = checked_device(device)
    checked_kernel(kernel, "load_checkpoint")
    check_fuse_policy(fuse_policy, check_fuse_spec(fuse))
    plan = plan_checkpoint(path, schemes=schemes, fuse=fuse)
    _check_policy_modules(fuse_policy, plan)
    _refuse(plan, plan.problems)
    reader.split(plan)
    show = auto_enabled(plan.files.total_bytes // reader.tp_size, progress)
    layers = plan.layers()
    with Progress(len(plan.layouts) + len(layers), "loading", enabled=show) as bar:
        biases: dict[str, Tensor] = {}
        canonical = _read_canonical(plan, reader, bar, biases)
        detection = plan.detection
        # Read before any module is built: a file that changed since its header was checked
        # fails here, with nothing half-loaded.
        tensors = {name: reader.whole(plan, name) for name in (*detection.plain, *detection.kv_cache)}
        _refuse(plan, plain_problems(plan.files, {name: tensors[name] for name in detection.plain}), reader.where)
        modules: dict[str, QuantLinear] = {}
        reports: list[LayerReport] = []
        for name, members in layers:
            weights = [canonical[m] for m in members]
            bias = _bias(biases, members, [w.n for w in weights])
            layer, layer_report = build_layer(
                plan,
                name,
                members,
                weights,
                bias,
                device=torch_device,
                kernel=kernel,
                activation_dtype=activation_dtype,
                fuse_policy=fuse_policy,
                origin=reader.origin(name, detection.modules[members[0]].origin),
            )
            modules[name] = layer
            reports.append(layer_report)
            bar.advance(item=name)
    if torch_device.type != "cpu":
        tensors = {name: value.to(torch_device) for name, value in tensors.items()}
    report = checkpoint_report(plan, reports, [*plan.notes, *reader.notes()])
    return Checkpoint(plan.path, modules, tensors, report, plan)


def build_layer(
    plan: Plan,
    name: str,
    members: Sequence[str],
    weights: Sequence[CanonicalWeight],
    bias: Tensor | None,
    *,
    device: torch.device,
    kernel: str | None,
    activation_dtype: str,
    fuse_policy: FusePolicyChoice,
    origin: str | None = None,
) -> tuple[QuantLinear, LayerReport]:
    """One layer's QuantLinear from its members' canonical weights (fused by the chosen policy
    when there are several), and its report row (``origin``: the detection's, unless given)."""
    outcome: FuseOutcome | None = None
    reason = ""
    if len(members) == 1:
        weight = weights[0]
    else:
        requested = _policy_for(name, fuse_policy)
        policy, reason = choose_fuse_policy(
            name, weights[0].scheme, list(weights), device, kernel, activation_dtype, requested
        )
        weight, outcome = fuse_members(name, list(members), list(weights), policy)
    layer = QuantLinear.from_canonical(
        weight, device=device, kernel=kernel, bias=bias, layer_name=name, activation_dtype=activation_dtype
    )
    layouts = [plan.layouts[m] for m in members]
    report = LayerReport(
        name=name,
        scheme=weight.scheme.name,
        n=weight.n,
        k=weight.k,
        origin=origin if origin is not None else plan.detection.modules[members[0]].origin,
        members=tuple(members),
        kernel=layer.kernel.name,
        tolerated=tuple(f"{lay.module}.{t}" for lay in layouts for t in lay.tolerated),
        fuse=outcome,
        fuse_reason=reason,
    )
    return layer, report


def checkpoint_report(plan: Plan, reports: Sequence[LayerReport], notes: Sequence[str]) -> CheckpointReport:
    """What a load did: the plan's files and detection, one row per layer, and ``notes``."""
    detection = plan.detection
    return CheckpointReport(
        path=str(plan.path),
        producer=plan.config.producer,
        producer_version=plan.config.producer_version,
        config_file=getattr(plan.config, "file", None),
        files=tuple(p.name for p in plan.files.files),
        total_bytes=plan.files.total_bytes,
        layers=tuple(reports),
        ignored=detection.ignored,
        plain_tensors=detection.plain,
        kv_cache_tensors=detection.kv_cache,
        tolerated_tensors=tuple(t for r in reports for t in r.tolerated),
        notes=tuple(notes),
    )
