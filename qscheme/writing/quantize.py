"""``quantize_checkpoint``: an unquantized safetensors checkpoint -> a checkpoint in any scheme.

Round-to-nearest with the producer's arithmetic: every Linear weight goes through
``qscheme.quantize.quantize_weight`` (bit-exact with compressed-tensors / ModelOpt per weight),
shard by shard, and the result is written with the producer's names, dtypes and config.

Which tensors are quantized (as llm-compressor's ``model_free_ptq`` decides, from names and
shapes alone): every 2-D ``<module>.weight`` except modules matched by ``ignore`` (default
``lm_head``; matched by the loader's own ``ignored_by``, ``re:`` entries checked by its
backtracking guard), modules whose own name ends in ``norm``, embeddings (by their usual names),
which are not Linear layers, and MoE routers (``ROUTERS``: ``*.mlp.gate``, ``*.router``,
``*.shared_expert_gate``...), which llm-compressor's MoE recipes ignore (``re:.*mlp.gate$``,
``re:.*shared_expert_gate$``) and transformers' quantizers refuse quantized. Everything else is
copied.

Before anything is written: a source tensor that is copied under a name the writer produces for
a quantized module (``x.weight_scale`` beside a quantized ``x``) is refused (``NameCollisionError``);
the other files are checked (``qscheme.writing.other_files``). Each layer's result is checked as
the loader checks it (``canonicalize``) and its error measured (``error_report``); the written
folder is planned by the loader (``plan_checkpoint``) before it is renamed into place, and must
show exactly the modules quantized.

Fused partitions. Where a scheme has a per-tensor second-level scale (``weight.global_scale``:
NVFP4's global scale, ModelOpt's ``weight_scale_2``), the modules an inference engine fuses
(q/k/v of an attention block, gate/up of an MLP; see ``FUSED_SETS``) get one shared value: the
one computed for the member with the largest absmax, which is what llm-compressor's fused
observer and ModelOpt's export both give. Members in different shards are read for it (their
absmax only, and the largest one quantized once to learn its scale). Every other scale is per
module. Loading then keeps the partitions' scales as ``per_partition`` with equal values.

Memory. Tensors are read one at a time; a shard's quantized outputs are held until the shard is
written, and a fused group's members only until they are quantized.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qscheme.canonical import canonicalize
from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.checkpoint.detect import ignored_by
from qscheme.checkpoint.patterns import compile_entries, pattern_problem
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, QuantizeError, UsageError
from qscheme.quantize import quantize_weight
from qscheme.quantize.blocks import layer_quantizer
from qscheme.quantize.rules import get_rules
from qscheme.storage import (
    OutputFolder,
    Progress,
    ShardRecord,
    TensorInfo,
    raise_on_termination,
    write_index,
    write_json,
    write_shard,
)
from qscheme.text import shown
from qscheme.writing.calibration import Calibration, CalibrationError, activation_tensors, needs_calibration
from qscheme.writing.error_report import ErrorReport, quantization_error
from qscheme.writing.loads_back import check_flags, check_loads_back, refuse_collisions
from qscheme.writing.other_files import copy_other_files, plan_other_files
from qscheme.writing.producer_config import config_files, producer_of
from qscheme.writing.source import SourceCheckpoint
from qscheme.writing.summary import LayerRow, WriteSummary, peak_rss_bytes
from qscheme.writing.verify import verify_folder

DEFAULT_IGNORE: tuple[str, ...] = ("lm_head",)
WEIGHT_SUFFIX = ".weight"
QUANTIZABLE_DTYPES = frozenset({"float32", "float16", "bfloat16"})
# Module leaf names that are not Linear layers although they hold a 2-D weight.
# Embeddings by their usual leaf names only: a Linear named like one (GPT-NeoX's output head
# ``embed_out``) is quantized, as model_free_ptq quantizes every 2-D weight not ignored.
NOT_LINEAR = (
    re.compile(r".*norm"),
    re.compile(
        r"embed_tokens|embed_in|embed_positions|embeddings|word_embeddings|position_embeddings|"
        r"token_type_embeddings|wte|wpe"
    ),
)
# MoE routers: Linear layers that pick the experts, kept unquantized (module-name regexes, matched
# whole; written to a compressed-tensors config's ignore list as ``re:<regex>$``). The names of
# Qwen2/3-MoE, DeepSeek, OLMoE (``mlp.gate``), Mixtral / Phi-MoE (``block_sparse_moe.gate``),
# Llama 4 / Jamba (``feed_forward.router``), gpt-oss (``mlp.router``) and Qwen's shared-expert gate.
ROUTERS: tuple[str, ...] = (
    r".*\.(mlp|block_sparse_moe|moe|feed_forward)\.gate",
    r".*\.(mlp|feed_forward|moe)\.router",
    r".*\.shared_expert_gate",
)
# Modules that inference engines fuse into one GEMM: (parent regex, member leaf names). As
# llm-compressor's model_free_ptq (DEFAULT_FUSED_MAPPINGS) and ModelOpt (layers sharing an input).
FUSED_SETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r".*(attn|attention)", ("q_proj", "k_proj", "v_proj")),
    (r".*(attn|attention)", ("wq_a", "wkv_a_with_mqa")),
    (r".*mlp", ("gate_proj", "up_proj")),
    (r".*", ("w1", "w3")),
)


@dataclass(frozen=True)
class FusedGroup:
    parent: str
    members: tuple[str, ...]  # module names


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    scheme: Scheme | str | Path,
    *,
    ignore: Iterable[str] | None = None,
    calibration: str | Path | Calibration | Mapping[str, object] | None = None,
    force: bool = False,
    progress: bool | None = None,
) -> WriteSummary:
    """Quantize the unquantized checkpoint ``src`` (a folder or one ``.safetensors`` file) into ``dst``.

    ``scheme`` is a catalog name (``compressed-tensors/NVFP4A16``), a descriptor path or a Scheme.
    ``ignore`` lists modules to leave unquantized: exact names, ``re:<regex>`` (matched from the
    start, as compressed-tensors does) or shell wildcards (``*.mlp.gate``); the default is
    ``("lm_head",)`` and a list given replaces it. ``calibration`` (a calibration file, or its
    contents as a mapping) gives the input amax per module for schemes with static activation
    scales; they are refused without one. ``force`` replaces an existing ``dst``. ``progress``
    shows a bar on stderr (default: when stderr is a terminal).

    Everything that can be checked from the headers is checked before anything is written; a
    problem found later (a NaN weight) removes the partial output. ``src`` is never modified and
    ``dst`` appears only complete and verified. Returns a WriteSummary.
    """
    started = time.perf_counter()
    check_flags("quantize_checkpoint", force=force, progress=progress)
    require_scheme_argument(scheme, "quantize_checkpoint")
    chosen = load_scheme(scheme)
    ignore_entries, patterns = _checked_ignore(ignore)
    _check_quantizable(chosen)
    descriptor_text = _descriptor_text(chosen) if producer_of(chosen) == "qscheme" else None
    source = SourceCheckpoint.open(src)
    _refuse_quantized_source(source)
    plan = _plan(source, chosen, ignore_entries, patterns)
    refuse_collisions(source, _produced_names(chosen, plan.quantized), consumed=_weights(plan.quantized))
    calibrated = _calibration(chosen, calibration, plan.quantized)
    others = plan_other_files(source.folder, source.other_files()) if source.folder is not None else []
    output = OutputFolder(dst, force=force, sources=[source.path])
    summary = WriteSummary(command="quantize", src=str(src), dst=str(dst), scheme=chosen.name)
    summary.notes.extend(plan.notes)
    with raise_on_termination(), output as out, Progress(len(source.tensors), "quantizing", enabled=progress) as bar:
        summary.files_copied = copy_other_files(others, source.folder or source.path, out.path)
        writer = _ShardWriter(source, chosen, plan, calibrated, bar, summary)
        records = [writer.write(shard, out.path) for shard in source.shards]
        if source.sharded:
            weight_map = {tensor.name: record.path.name for record in records for tensor in record.tensors}
            write_index(out.path, weight_map, sum(record.data_bytes for record in records))
        note = f"quantized by qscheme (round-to-nearest) into {chosen.name}"
        configs = config_files(
            chosen,
            source.config,
            ignore=config_ignore(ignore_entries, plan.ignored, plan.routers),
            unquantized_modules=plan.unquantized_linear,
            descriptor_text=descriptor_text,
            note=note,
        )
        for name, value in configs.items():
            write_json(out.path / name, value)
        verify_folder(out.path, records)
        check_loads_back(out.path, plan.quantized, chosen.name)
        out.commit()
    summary.shards = [record.path.name for record in records]
    summary.bytes_written = sum(record.size for record in records)
    summary.bytes_read = source.total_bytes
    summary.seconds = time.perf_counter() - started
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary


# --- checks before anything is written ----------------------------------------------------------


def _checked_ignore(ignore: Iterable[str] | None) -> tuple[tuple[str, ...], dict[str, re.Pattern[str]]]:
    """The ignore entries and their ``re:`` patterns, checked and compiled by the loader's guard
    (``compile_entries``): a pattern that could backtrack catastrophically is a UsageError."""
    if ignore is None:
        entries = DEFAULT_IGNORE
    elif isinstance(ignore, str | bytes) or not isinstance(ignore, Iterable):
        raise UsageError(f"ignore must be a list of module names or patterns, e.g. ['lm_head'], not {ignore!r}")
    else:
        entries = tuple(ignore)
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise UsageError(f"ignore entries must be non-empty strings, got {entry!r}")
    try:
        patterns = compile_entries(entries, {}, "--ignore", "ignore")
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    return entries, patterns


def _is_wildcard(entry: str) -> bool:
    return not entry.startswith("re:") and any(char in entry for char in "*?[")


def config_ignore(
    entries: Sequence[str], ignored: Mapping[str, str] | None = None, routers: Sequence[str] = ()
) -> list[str]:
    """The ignore entries as a producer's config states them: exact names and ``re:`` patterns as
    given; a wildcard as the ``re:`` pattern it means (compressed-tensors knows no wildcards, so a
    ``*`` written as such would match nothing there and the layer would be taken as quantized),
    or, when the loader's guard would refuse that pattern (several ``*`` translate to more
    backtracking repeats than it allows), as the exact module names it matched (``ignored``:
    module -> entry); then one ``re:`` entry per ``ROUTERS`` regex in ``routers``."""
    written = []
    for entry in entries:
        if _is_wildcard(entry):
            translated = fnmatch.translate(entry)
            if pattern_problem(translated) is None:
                written.append("re:" + translated)
            else:
                written.extend(module for module, matched in (ignored or {}).items() if matched == entry)
            continue
        written.append(entry)
    written.extend(f"re:{router}$" for router in routers)
    return written


def _check_quantizable(scheme: Scheme) -> None:
    if layer_quantizer(scheme) is None:  # a producer that quantizes whole layers needs no rule set
        get_rules(scheme.rules)  # QuantizeError for an unknown rule set
    if scheme.input_pre_scale is not None:
        raise QuantizeError(
            f"scheme {scheme.name}: declares a pre-quantization scale ({scheme.input_pre_scale.name}, AWQ), which "
            "comes from an activation-aware search over calibration data, not from round-to-nearest; quantize with "
            "the producer's AWQ algorithm (ModelOpt, llm-compressor), or choose a scheme without a pre-scale"
        )


def _descriptor_text(scheme: Scheme) -> str:
    if scheme.path is None or not Path(scheme.path).is_file():
        raise UsageError(
            f"scheme {scheme.name} is recognised by no producer's config, so the checkpoint embeds its descriptor; "
            "this Scheme has no descriptor file to embed: save it as YAML and pass the file's path"
        )
    return Path(scheme.path).read_text(encoding="utf-8")


def _refuse_quantized_source(source: SourceCheckpoint) -> None:
    quantization = source.config.get("quantization_config")
    folder = source.folder
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else quantization
        raise CheckpointError(
            f"{source.path}: config.json has a quantization_config (quant_method {method!r}); quantize starts from an "
            "unquantized checkpoint: use `qscheme convert` to change the scheme of a quantized one"
        )
    if folder is not None and (folder / "hf_quant_config.json").exists():
        raise CheckpointError(
            f"{source.path}: has hf_quant_config.json (a ModelOpt export); quantize starts from an unquantized "
            "checkpoint: use `qscheme convert` to change the scheme of a quantized one"
        )


@dataclass
class _Plan:
    quantized: list[str]  # module names, in checkpoint order
    fused: dict[str, FusedGroup]  # member module -> its group (only for schemes with a global scale)
    unquantized_linear: list[str]  # 2-D weights left in 16 bits (ignored, embeddings, routers)
    ignored: dict[str, str]
    notes: list[str]
    routers: list[str]  # the ROUTERS regexes that matched a module


def _router(module: str) -> str | None:
    return next((pattern for pattern in ROUTERS if re.fullmatch(pattern, module)), None)


def _plan(
    source: SourceCheckpoint, scheme: Scheme, ignore: Sequence[str], patterns: Mapping[str, re.Pattern[str]]
) -> _Plan:
    quantized: list[str] = []
    unquantized: list[str] = []
    ignored: dict[str, str] = {}
    routers: dict[str, str] = {}
    problems: list[str] = []
    for name, info in source.tensors.items():
        if not name.endswith(WEIGHT_SUFFIX) or len(info.shape) != 2:
            continue
        module = name[: -len(WEIGHT_SUFFIX)]
        leaf = module.rpartition(".")[2]
        if any(pattern.fullmatch(leaf) for pattern in NOT_LINEAR):
            unquantized.append(module)
            continue
        entry = ignored_by(module, ignore, patterns)
        if entry is not None:
            ignored[module] = entry
            unquantized.append(module)
            continue
        router = _router(module)
        if router is not None:
            routers[module] = router
            unquantized.append(module)
            continue
        problem = _shape_problem(scheme, info)
        if problem is not None:
            problems.append(problem)
        quantized.append(module)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise QuantizeError(f"{problems[0]}{more}; nothing was written")
    if not quantized:
        raise QuantizeError(
            f"{source.path}: no Linear weight to quantize (every 2-D .weight is ignored, a norm or an embedding); "
            "check --ignore"
        )
    notes = [f"ignore entry {entry!r} matched no module" for entry in ignore if entry not in ignored.values()]
    if routers:
        shown = ", ".join(list(routers)[:3]) + (f" and {len(routers) - 3} more" if len(routers) > 3 else "")
        notes.append(
            f"kept {len(routers)} MoE router(s) unquantized ({shown}): a router picks the experts, is small, and "
            "transformers refuses a quantized one; llm-compressor's MoE recipes ignore them too"
        )
    fused = _fused_groups(quantized) if scheme.weight.global_scale is not None else {}
    return _Plan(quantized, fused, unquantized, ignored, notes, list(dict.fromkeys(routers.values())))


def _weights(modules: Sequence[str]) -> set[str]:
    return {module + WEIGHT_SUFFIX for module in modules}


def _produced_names(scheme: Scheme, modules: Sequence[str]) -> dict[str, str]:
    """Every tensor name the writer produces for the quantized ``modules`` -> its module."""
    shorts = [spec.name for spec in scheme.tensor_specs().values()]
    return {f"{module}.{short}": module for module in modules for short in shorts}


def _shape_problem(scheme: Scheme, info: TensorInfo) -> str | None:
    where = f"{shown(info.file.name)}: tensor {info.name!r}"
    if info.dtype not in QUANTIZABLE_DTYPES:
        return (
            f"{where} is {info.dtype}; only float32, float16 and bfloat16 weights can be quantized (is the checkpoint "
            "already quantized? ignore the module with --ignore if it is not a Linear layer)"
        )
    n, k = info.shape
    for spec in scheme.tensor_specs().values():
        if spec.shapes and not spec.expected_shapes(n, k):  # (a JSON state declares no shape)
            return (
                f"{where} has shape [{n}, {k}], which scheme {scheme.name} cannot take: its tensor {spec.name!r} is "
                f"declared {spec.describe_shapes()} (N and K must divide as that says); ignore the module with "
                "--ignore, or choose a scheme with another group size"
            )
    return None


def _fused_groups(modules: Sequence[str]) -> dict[str, FusedGroup]:
    present = set(modules)
    by_parent: dict[str, set[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
    groups: dict[str, FusedGroup] = {}
    for parent, leaves in by_parent.items():
        for parent_pattern, members in FUSED_SETS:
            if not set(members) <= leaves or not re.fullmatch(parent_pattern, parent):
                continue
            names = tuple(f"{parent}.{member}" if parent else member for member in members)
            if any(name in groups for name in names) or not all(name in present for name in names):
                continue
            group = FusedGroup(parent, names)
            for name in names:
                groups[name] = group
    return groups


def _calibration(
    scheme: Scheme, calibration: str | Path | Calibration | Mapping[str, object] | None, modules: list[str]
) -> Calibration | None:
    if not needs_calibration(scheme):
        return None
    if calibration is None:
        activation = scheme.activation
        assert activation is not None
        names = [spec.tensor.name for spec in (activation.scale, activation.global_scale) if spec is not None]
        raise CalibrationError(
            f"scheme {scheme.name} stores static activation scales ({', '.join(names)}), computed from each layer's "
            "input range on calibration data, which round-to-nearest cannot derive from the weights; pass "
            "--calibration FILE with the input amax of every quantized module (format in docs/writing.md), or "
            "choose a scheme with dynamic activations (e.g. a weight-only one)"
        )
    if isinstance(calibration, Calibration):
        loaded = calibration
    elif isinstance(calibration, Mapping):
        loaded = Calibration.from_mapping(calibration)
    elif isinstance(calibration, str | os.PathLike):
        loaded = Calibration.load(calibration)
    else:
        raise UsageError(
            f"calibration must be a file path, a Calibration or a mapping, not {type(calibration).__name__}"
        )
    loaded.require(modules)
    loaded.check_scales(scheme, modules)
    return loaded


# --- writing ------------------------------------------------------------------------------------


class _ShardWriter:
    """Quantizes and writes one shard at a time; remembers fused groups' shared global scales."""

    def __init__(
        self,
        source: SourceCheckpoint,
        scheme: Scheme,
        plan: _Plan,
        calibration: Calibration | None,
        bar: Progress,
        summary: WriteSummary,
    ) -> None:
        self.source = source
        self.scheme = scheme
        self.plan = plan
        self.quantized = set(plan.quantized)
        self.calibration = calibration
        self.bar = bar
        self.summary = summary
        self.global_name = scheme.weight.global_scale.tensor.name if scheme.weight.global_scale else None
        self.shared: dict[str, Tensor] = {}  # fused group parent+first member -> stored global scale
        self.pending: dict[str, dict[str, Tensor]] = {}  # results computed early (the group's largest member)
        self.current: set[str] = set()  # tensor names of the shard being written
        self.errors: dict[str, ErrorReport] = {}  # module -> its quantization error, until its row is written

    def write(self, shard_info: object, folder: Path) -> ShardRecord:
        from qscheme.writing.source import SourceShard

        assert isinstance(shard_info, SourceShard)
        tensors: dict[str, Tensor] = {}
        loaded: dict[str, Tensor] = {}
        self.current = set(shard_info.tensors)
        for name in shard_info.tensors:
            module = name[: -len(WEIGHT_SUFFIX)] if name.endswith(WEIGHT_SUFFIX) else None
            if module is not None and module in self.quantized:
                weight = loaded.pop(name, None)
                if weight is None and module not in self.pending:
                    weight = self.source.read(name)
                result = self._quantize(module, weight, loaded)
                for short, value in result.items():
                    tensors[f"{module}.{short}"] = value
                error = self.errors.pop(module)
                self.summary.layers.append(
                    LayerRow(
                        module,
                        self.scheme.name,
                        "quantized",
                        max_abs_error=error.max_abs,
                        relative_error=error.relative,
                    )
                )
            else:
                tensors[name] = loaded.pop(name) if name in loaded else self.source.read(name)
                if module is not None and module in self.plan.unquantized_linear:
                    self.summary.layers.append(LayerRow(module, self.scheme.name, "copied"))
            self.bar.advance(item=name)
        record = write_shard(folder / self.source.output_shard_name(shard_info), tensors)
        return record

    def _quantize(self, module: str, weight: Tensor | None, loaded: dict[str, Tensor]) -> dict[str, Tensor]:
        early = self.pending.pop(module, None)
        if early is not None:
            return early
        assert weight is not None
        given = self._activation_scales(module)
        group = self.plan.fused.get(module)
        if group is not None and self.global_name is not None:
            shared = self._shared_global_scale(group, module, weight, loaded)
            if module in self.pending:  # this module was the group's largest: quantized already
                return self.pending.pop(module)
            given[self.global_name] = shared
        return self._run(module, weight, given)

    def _run(self, module: str, weight: Tensor, given: dict[str, Tensor]) -> dict[str, Tensor]:
        """Quantize one weight; check the result as the loader does (``canonicalize``: a scale that
        would not dequantize is refused here, not by the loader later) and measure its error."""
        try:
            result = quantize_weight(weight, self.scheme, **given)
            n, k = weight.shape
            canonical = canonicalize(self.scheme, result, n, k, layer=module)
        except QuantizeError as exc:
            info = self.source.tensors[module + WEIGHT_SUFFIX]
            raise QuantizeError(f"{shown(info.file.name)}: tensor {info.name!r}: {exc}; nothing was written") from None
        self.errors[module] = quantization_error(weight, canonical)
        return result

    def _activation_scales(self, module: str) -> dict[str, Tensor]:
        if self.calibration is None:
            return {}
        return activation_tensors(self.scheme, self.calibration.input_amax[module])

    def _shared_global_scale(self, group: FusedGroup, module: str, weight: Tensor, loaded: dict[str, Tensor]) -> Tensor:
        key = group.members[0]
        cached = self.shared.get(key)
        if cached is not None:
            return cached
        largest: tuple[float, str] | None = None
        for member in group.members:
            name = member + WEIGHT_SUFFIX
            if member == module:
                tensor = weight
            elif name in loaded:
                tensor = loaded[name]
            else:
                tensor = self.source.read(name)
                if name in self.current:
                    loaded[name] = tensor  # read once: it is quantized later in this shard
            absmax = _absmax(tensor)
            if largest is None or absmax > largest[0] or absmax != absmax:
                largest = (absmax, member)
        assert largest is not None
        top = largest[1]
        top_name = top + WEIGHT_SUFFIX
        top_weight = weight if top == module else loaded.get(top_name)
        if top_weight is None:
            top_weight = self.source.read(top_name)
        result = self._run(top, top_weight, self._activation_scales(top))
        assert self.global_name is not None
        shared = result[self.global_name]
        self.shared[key] = shared
        if top == module or top_name in loaded:
            self.pending[top] = result  # reused when the member comes up (no second quantization)
            loaded.pop(top_name, None)
        return shared


def _absmax(tensor: Tensor) -> float:
    low, high = torch.aminmax(tensor)
    return float(torch.maximum(high.abs(), low.abs()).float())
