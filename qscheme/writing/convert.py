"""``convert_checkpoint``: a quantized checkpoint in one scheme -> the same checkpoint in another.

The source is read with the checkpoint loader's own planning (``plan_checkpoint``: producer
config, headers, each module's scheme, layout checks), so that convert accepts exactly what
``load_checkpoint`` accepts. Each quantized module then goes through ``convert_layer``: renamed
and re-conventioned as the two descriptors say, codes untouched, with the deviation of its
dequantized weight reported. Everything else (embeddings, norms, unquantized layers, biases,
KV-cache scales) and the other files (tokenizer, generation config) are copied through, and
the target producer's ``config.json`` (and ``hf_quant_config.json`` for ModelOpt) written.

Before anything is written every module is checked from the headers alone: a conversion that
would change codes is refused (RequantizationRefusedError) unless ``allow_requantize``, and one
that needs data the source lacks (UnconvertibleLayerError) always is. Writing then streams one
source shard at a time into a temporary folder beside ``dst`` (``OutputFolder``), verified by
re-reading before it is renamed into place.

Provenance of inverted scales. A scale stored as a multiplier in one scheme and a reciprocal in
the other is inverted in float32, which rounds: ``fl(1/fl(1/x))`` is not always ``x``. Each
output shard records, in its safetensors metadata under ``ORIGINALS_KEY``, the source tensor
every inverted scale came from (name, dtype, shape and bytes). Converting back restores a
recorded original when inverting it gives exactly the tensor found, so that a round trip gives
the original files' tensors bit for bit. Libraries that read the files ignore the metadata.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.checkpoint.config import NoQuantization
from qscheme.checkpoint.detect import split_name
from qscheme.checkpoint.plan import Plan, format_problems, plan_checkpoint
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.storage import (
    DEFAULT_METADATA,
    DTYPE_BY_TORCH_NAME,
    MappedShard,
    OutputFolder,
    Progress,
    RawSpan,
    ShardRecord,
    dtype_code,
    raise_on_termination,
    sync_file,
    write_index,
    write_json,
    write_shard,
)
from qscheme.writing.convert_deviation import Deviation
from qscheme.writing.convert_experts import ExpertsPlan, StackedProjection, expert_layers, plan_experts
from qscheme.writing.convert_layer import LayerConversion, check_conversion, convert_layer
from qscheme.writing.convert_math import compare_schemes
from qscheme.writing.loads_back import check_flags, check_loads_back, refuse_collisions
from qscheme.writing.other_files import copy_other_files, plan_other_files
from qscheme.writing.producer_config import config_files, producer_of
from qscheme.writing.source import SourceCheckpoint, SourceShard
from qscheme.writing.summary import LayerRow, WriteSummary, peak_rss_bytes
from qscheme.writing.verify import verify_folder, verify_shard

ORIGINALS_KEY = "qscheme.convert.originals"


class NotQuantizedError(CheckpointError):
    """The source checkpoint holds no quantized module: there is nothing to convert."""


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    to: Scheme | str | Path,
    *,
    allow_requantize: bool = False,
    force: bool = False,
    progress: bool | None = None,
) -> WriteSummary:
    """Convert the quantized checkpoint folder ``src`` into scheme ``to``, written to ``dst``.

    ``to`` is a catalog name (``compressed-tensors/NVFP4A16``), a descriptor path or a Scheme.
    Schemes that share the math convert exactly (see ``qscheme.writing.convert_math``); others
    are refused with RequantizationRefusedError naming the layer, both schemes and what differs,
    unless ``allow_requantize`` (then dequantized and quantized again, the error reported per
    layer). ``force`` replaces an existing ``dst``; ``progress`` shows a bar on stderr (default:
    when stderr is a terminal). Nothing is written when a check fails; ``src`` is never
    modified. Returns a WriteSummary whose rows carry each layer's largest deviation in ulps.
    """
    started = time.perf_counter()
    check_flags("convert_checkpoint", allow_requantize=allow_requantize, force=force, progress=progress)
    require_scheme_argument(to, "convert_checkpoint")
    target = load_scheme(to)
    if producer_of(target) == "qscheme":
        raise UsageError(
            f"convert_checkpoint: {target.name} is a scheme no producer writes; convert writes compressed-tensors "
            "or ModelOpt schemes. Quantize the unquantized model with `qscheme quantize` for a YAML-only scheme"
        )
    source = SourceCheckpoint.open(src)
    if source.folder is None:
        raise UsageError(
            f"{src}: convert needs the checkpoint folder (its config.json names the quantization), "
            "not one .safetensors file"
        )
    plan = _checked_plan(source.folder)
    layers = _preflight(plan, target, allow_requantize)
    experts = plan_experts(plan, source.tensors)  # stacked experts: written one layer per expert and projection
    written = experts.written(layers)
    summary = WriteSummary(command="convert", src=str(src), dst=str(dst), scheme=target.name)
    writer = _Writer(source, plan, target, layers, allow_requantize, summary, experts)
    produced = {f"{module}.{spec.name}": module for module in written for spec in target.tensor_specs().values()}
    produced.update({f"{layer.module}.bias": layer.module for split in experts.layers.values() for layer in split})
    refuse_collisions(source, produced, consumed=writer.owner)
    others = plan_other_files(source.folder, source.other_files())
    output = OutputFolder(dst, force=force, sources=[source.path])
    with (
        raise_on_termination(),
        output as out,
        Progress(len(source.tensors), "converting", enabled=progress) as bar,
    ):
        summary.files_copied = copy_other_files(others, source.folder, out.path)
        records = writer.write_all(out.path, bar)
        if source.sharded:
            weight_map = {tensor.name: record.path.name for record in records for tensor in record.tensors}
            write_index(out.path, weight_map, sum(record.data_bytes for record in records))
        unquantized = _unquantized_linear(plan)
        configs = config_files(
            target,
            source.config,
            ignore=unquantized,
            unquantized_modules=unquantized,
            note=f"converted by qscheme from {', '.join(sorted(plan.detection.scheme_counts()))}",
        )
        for file_name, contents in configs.items():
            write_json(out.path / file_name, contents)
        verify_folder(out.path, records, reread=False)  # each shard was re-read by write_all
        check_loads_back(out.path, list(written), target.name)
        out.commit()
    summary.notes.extend(writer.notes())
    summary.shards = [record.path.name for record in records]
    summary.bytes_written = sum(record.size for record in records)
    summary.bytes_read = source.total_bytes
    summary.seconds = time.perf_counter() - started
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary


# --- checks before anything is written -----------------------------------------------------------


def _checked_plan(folder: Path) -> Plan:
    plan = plan_checkpoint(folder)
    if plan.problems:
        raise CheckpointError(
            f"{folder}: {len(plan.problems)} problem(s) found, nothing was written:\n{format_problems(plan.problems)}"
        )
    if not plan.detection.modules:
        why = plan.config.reason if isinstance(plan.config, NoQuantization) else "no module is quantized"
        raise NotQuantizedError(
            f"{folder}: not a quantized checkpoint ({why}); convert changes the scheme of a quantized checkpoint. "
            "Use `qscheme quantize SRC DST --scheme NAME` (quantize_checkpoint) for an unquantized model"
        )
    return plan


def _preflight(plan: Plan, target: Scheme, allow_requantize: bool) -> dict[str, Scheme]:
    """Every module's source scheme, after checking from the headers that it converts."""
    layers: dict[str, Scheme] = {}
    comparisons = {}
    for module, layout in plan.layouts.items():
        source = layout.scheme
        if source.name not in comparisons:
            comparisons[source.name] = compare_schemes(source, target)
        check_conversion(module, comparisons[source.name], layout.declared, allow_requantize=allow_requantize)
        layers[module] = source
    return layers


def _unquantized_linear(plan: Plan) -> list[str]:
    """Modules holding a plain 2-D ``weight`` (unquantized linears, embeddings): the target's ignore list."""
    files = plan.files.tensors
    out = []
    for name in plan.detection.plain:
        module, short = split_name(name)
        if short == "weight" and len(files[name].shape) == 2:
            out.append(module)
    return sorted(set(out))


# --- provenance of inverted scales ----------------------------------------------------------------


def _record(name: str, value: Tensor) -> dict[str, Any]:
    data = value.detach().contiguous().reshape(-1).view(torch.uint8)
    return {
        "name": name,
        "dtype": str(value.dtype).removeprefix("torch."),
        "shape": list(value.shape),
        "hex": bytes(data.tolist()).hex(),
    }


def _from_record(record: object) -> tuple[str, Tensor] | None:
    """(original tensor name, tensor) of a metadata record; None for anything malformed."""
    if not isinstance(record, Mapping):
        return None
    name, dtype_name, shape, text = (record.get(key) for key in ("name", "dtype", "shape", "hex"))
    if not (isinstance(name, str) and isinstance(dtype_name, str) and isinstance(text, str)):
        return None
    if not isinstance(shape, list) or not all(isinstance(size, int) and 0 <= size for size in shape):
        return None
    found = DTYPE_BY_TORCH_NAME.get(dtype_name)
    if found is None or found.torch_dtype is None or found.bits < 8:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    numel = 1
    for size in shape:
        numel *= size
    if len(raw) != numel * found.bits // 8 or numel > 4096:
        return None
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(found.torch_dtype).reshape(shape).clone()
    return name, tensor


def _originals(shard: SourceShard) -> dict[str, tuple[str, Tensor]]:
    """The shard's records of inverted scales: converted tensor name -> (original name, tensor)."""
    metadata = shard.header.metadata or {}
    text = metadata.get(ORIGINALS_KEY)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    out = {}
    if isinstance(value, Mapping):
        for name, record in value.items():
            parsed = _from_record(record)
            if isinstance(name, str) and parsed is not None:
                out[name] = parsed
    return out


# --- writing --------------------------------------------------------------------------------------


def _key(value: Tensor) -> tuple[int, int, torch.dtype]:
    return value.data_ptr(), value.numel(), value.dtype


def _unchanged_span(
    mapped: MappedShard, sources: Mapping[tuple[int, int, torch.dtype], str], value: Tensor
) -> RawSpan | None:
    """``value`` as bytes of the source file when it is a source tensor of this shard as it is
    (the same memory, reshaped at most), else None."""
    name = sources.get(_key(value))
    if name is None or name not in mapped.header.tensors or not value.is_contiguous():
        return None
    shape = tuple(int(size) for size in value.shape)
    code, bits = dtype_code(value)
    if bits == 4:
        shape = (*shape[:-1], shape[-1] * 2)
    span = mapped.span(name, code, shape)
    if span.nbytes != value.numel() * value.element_size():
        return None
    return span


_Pending = list[tuple[int, LayerConversion, "Future[Deviation]"]]  # (summary row, result, its report)


@dataclass
class _Counts:
    converted: int = 0
    requantized: int = 0
    inverted: int = 0
    restored: int = 0
    deviating: int = 0


class _Writer:
    """Converts and writes one source shard at a time."""

    def __init__(
        self,
        source: SourceCheckpoint,
        plan: Plan,
        target: Scheme,
        layers: Mapping[str, Scheme],
        allow_requantize: bool,
        summary: WriteSummary,
        experts: ExpertsPlan,
    ) -> None:
        self.source = source
        self.plan = plan
        self.target = target
        self.layers = layers
        self.allow_requantize = allow_requantize
        self.summary = summary
        self.counts = _Counts()
        self.layer_notes: list[str] = []
        self.owner: dict[str, str] = {}  # tensor name -> its quantized module
        for module, assignment in plan.detection.modules.items():
            for short, info in assignment.tensors.items():
                if short != "bias":
                    self.owner[info.name] = module
        self.experts = experts
        self.owner.update({name: projection.key for name, projection in experts.stacked.items()})
        # stacked projection -> stored tensor -> what is written from it, in the stored tensor's shard
        self.stacked_outputs: dict[str, dict[str, dict[str, Tensor]]] = {}
        self.unquantized = set(_unquantized_linear(plan))

    def write_all(self, folder: Path, bar: Progress) -> list[ShardRecord]:
        """Every shard written, flushed to the disk and re-read (``verify_shard``). Worker threads
        overlap the work with the writing: one computes the shard's deviation reports while its
        bytes are copied, two flush and re-read each written shard while the next one is written
        (torch, zlib, numpy and the system calls release the GIL). Torch runs one thread per op
        meanwhile, which on few cores is faster than its threads contending with these."""
        records: list[ShardRecord] = []
        checks: list[Future[object]] = []
        reports = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qscheme-convert-report")
        flushes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="qscheme-convert-verify")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            previous: _Pending = []
            for shard in self.source.shards:
                record, pending = self.write(shard, folder, bar, reports)
                # one shard's reports run on while the next is written; at most two shards' codes are mapped
                self.collect(previous)
                previous = pending
                records.append(record)
                checks.append(flushes.submit(sync_file, record.path))  # both before the commit, in parallel
                checks.append(flushes.submit(verify_shard, record))
            self.collect(previous)
            for check in checks:
                check.result()
        finally:
            for pool in (reports, flushes):
                pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)
        return records

    def write(
        self, shard: SourceShard, folder: Path, bar: Progress, pool: ThreadPoolExecutor
    ) -> tuple[ShardRecord, _Pending]:
        """Convert and write one shard (flushed to the disk and re-read by ``write_all``).

        Bytes that do not change (copied-through tensors, untouched codes) go straight from the
        source file to the output (``bytes_copy``); each layer's deviation report runs in ``pool``
        while the shard (and the next one) is written: the reports still to collect are returned."""
        mapped = MappedShard(shard.path, shard.header)
        tensors: dict[str, Tensor | RawSpan] = {}
        records: dict[str, dict[str, Any]] = {}
        originals = _originals(shard)
        pending: _Pending = []
        for name in shard.tensors:
            module = self.owner.get(name)
            projection = self.experts.stacked.get(name)
            if projection is not None:
                if projection.key not in self.stacked_outputs:
                    self.stacked_outputs[projection.key] = self._convert_stacked(projection, mapped, pending, pool)
                tensors.update(self.stacked_outputs[projection.key].pop(name))
            elif module is None:
                tensors[name] = mapped.span(name)
                owner, short = split_name(name)
                if short == "weight" and owner in self.unquantized:
                    self.summary.layers.append(LayerRow(owner, self.target.name, "copied"))
            elif name == self.plan.layouts[module].declared[self.layers[module].weight.tensor.name].name:
                sources, result = self._convert(module, originals, mapped)
                if result.pending is not None:
                    pending.append((len(self.summary.layers) - 1, result, pool.submit(result.pending)))
                for short, value in result.tensors.items():
                    tensors[f"{module}.{short}"] = _unchanged_span(mapped, sources, value) or value
                for short, value in result.originals.items():
                    source_name = self._source_name(module, result, short)
                    records[f"{module}.{short}"] = _record(source_name, value)
            bar.advance(item=name)
        metadata = dict(DEFAULT_METADATA)
        if records:
            metadata[ORIGINALS_KEY] = json.dumps(records, sort_keys=True, separators=(",", ":"))
        record = write_shard(folder / self.source.output_shard_name(shard), tensors, metadata, fsync=False)
        mapped.close()  # the mapping goes once the pending reports are done with its codes
        return record, pending

    def collect(self, pending: _Pending) -> None:
        """Wait for deviation reports and put them in the summary."""
        for index, result, future in pending:
            self._report(index, result.with_deviation(future.result()))

    def _source_name(self, module: str, result: LayerConversion, target_short: str) -> str:
        source = self.layers[module]
        role = next(role for role, spec in self.target.tensor_specs().items() if spec.name == target_short)
        return f"{module}.{source.tensor_specs()[role].name}"

    def _convert(
        self, module: str, originals: Mapping[str, tuple[str, Tensor]], mapped: MappedShard
    ) -> tuple[dict[tuple[int, int, torch.dtype], str], LayerConversion]:
        """(the source tensors' names by (data pointer, size, dtype); the layer's conversion)."""
        layout = self.plan.layouts[module]
        names = {short: info.name for short, info in layout.declared.items() if short != "bias"}
        names.update({short: f"{module}.{short}" for short in layout.tolerated})
        tensors = {short: self._read(name, mapped) for short, name in names.items()}
        result = self._convert_tensors(module, module, tensors, originals)
        by_pointer = {names[short]: value for short, value in tensors.items()}
        return {_key(value): name for name, value in by_pointer.items() if value.numel()}, result

    def _convert_stacked(
        self, projection: StackedProjection, mapped: MappedShard, pending: _Pending, pool: ThreadPoolExecutor
    ) -> dict[str, dict[str, Tensor]]:
        """Every layer written from one stacked experts projection (``writing.convert_experts``), by
        the stored tensor each output comes from (a code from the codes, a scale from the scales), so
        that each is written in the shard of its source."""
        read = functools.partial(self._read, mapped=mapped)
        source_names = {role: spec.name for role, spec in self.layers[projection.sources[0]].tensor_specs().items()}
        weight = projection.stored[source_names["weight"]]
        outputs: dict[str, dict[str, Tensor]] = {name: {} for name in projection.stored.values()}
        for layer, values, bias in expert_layers(self.plan, self.experts, projection, read):
            result = self._convert_tensors(layer.module, layer.source, values, {})
            if result.pending is not None:
                pending.append((len(self.summary.layers) - 1, result, pool.submit(result.pending)))
            for role, spec in self.target.tensor_specs().items():
                if spec.name in result.tensors:
                    stored = projection.stored.get(source_names.get(role, ""), weight)
                    outputs[stored][f"{layer.module}.{spec.name}"] = result.tensors[spec.name]
            if bias is not None:
                outputs[projection.stored["bias"]][f"{layer.module}.bias"] = bias
        return outputs

    def _convert_tensors(
        self,
        module: str,
        source_module: str,
        tensors: Mapping[str, Tensor],
        originals: Mapping[str, tuple[str, Tensor]],
    ) -> LayerConversion:
        """One layer ``module`` converted from the tensors of ``source_module`` (the same module, or the
        stacked expert it is part of), with its summary row."""
        source = self.layers[source_module]
        restore = self._restore(module, source, originals)
        result = convert_layer(
            module,
            source,
            self.target,
            tensors,
            allow_requantize=self.allow_requantize,
            restore=restore,
            defer_deviation=True,
        )
        self.summary.layers.append(LayerRow(module, self.target.name, result.action))
        counts = self.counts
        counts.converted += result.action == "converted"
        counts.requantized += result.action == "requantized"
        counts.inverted += len(result.inverted)
        counts.restored += len(result.restored)
        self.layer_notes.extend(f"{module}: {note}" for note in result.notes)
        if result.pending is None:
            self._report(len(self.summary.layers) - 1, result)
        return result

    def _read(self, name: str, mapped: MappedShard) -> Tensor:
        """A tensor of this shard viewing its mapping; one in another shard (a layer cut by a shard
        boundary) read into memory of its own."""
        if name in mapped.header.tensors:
            return mapped.tensor(name)
        return self.source.read(name)

    def _report(self, index: int, result: LayerConversion) -> None:
        requantized = result.action == "requantized"  # ulps of a new rounding say nothing: its relative error does
        self.summary.layers[index] = LayerRow(
            result.module,
            self.target.name,
            result.action,
            None if requantized else float(result.max_ulps),
            result.max_abs_error,
            result.relative_error if requantized else None,
        )
        self.counts.deviating += result.action == "converted" and result.max_ulps > 0

    def _restore(self, module: str, source: Scheme, originals: Mapping[str, tuple[str, Tensor]]) -> dict[str, Tensor]:
        """Recorded originals for this module's scales, keyed by the target's short names."""
        restore = {}
        target_specs = self.target.tensor_specs()
        for role, spec in source.tensor_specs().items():
            found = originals.get(f"{module}.{spec.name}")
            if found is None or role not in target_specs:
                continue
            name, tensor = found
            if name == f"{module}.{target_specs[role].name}":
                restore[target_specs[role].name] = tensor
        return restore

    def notes(self) -> list[str]:
        counts = self.counts
        out = []
        if counts.inverted:
            out.append(
                f"{counts.inverted} scale(s) inverted between multiplier and reciprocal conventions "
                f"({counts.restored} restored bit for bit from the source's record); {counts.deviating} layer(s) "
                "dequantize differently by the float32 rounding of the inversion (see max_ulps)"
            )
        if counts.requantized:
            out.append(
                f"{counts.requantized} layer(s) requantized (--allow-requantize): see relative_error and max_abs_error"
            )
        kv_cache = self.plan.detection.kv_cache
        if kv_cache:
            out.append(
                f"{len(kv_cache)} KV-cache scale tensor(s) copied through; the target config does not declare "
                "the KV-cache quantization"
            )
        shown = self.layer_notes[:20]
        out.extend(shown)
        if len(self.layer_notes) > len(shown):
            out.append(f"... and {len(self.layer_notes) - len(shown)} more layer note(s)")
        return out
