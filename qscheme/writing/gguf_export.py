"""``export_gguf``: a compressed-tensors or ModelOpt checkpoint folder -> one GGUF file llama.cpp loads.

The reverse of ``gguf_convert``. The folder is planned as the loader plans it (``plan_checkpoint``),
so export accepts what ``load_checkpoint`` accepts; then:

- names: transformers' GGUF name map for the model's architecture read backwards
  (``gguf_export_names``); llama's q/k rows put in llama.cpp's order (the inverse of the order
  transformers' processor takes them in); per-expert layers stacked into ``ffn_*_exps`` [E, N, K];
- quantized layers: ``gguf_layer.layer_to_blocks``: where the codes are shared (``SHARED_PAIRS``)
  they are re-packed into blocks and the scales re-encoded, with the deviation reported; any other
  layer is refused before anything is written unless ``allow_requantize`` (then dequantized and
  quantized with llama.cpp's arithmetic);
- plain tensors (norms, embeddings, an unquantized head, biases) are copied as stored (F32, F16,
  BF16), except 1-D F16/BF16 tensors, widened exactly to F32 as llama.cpp's converter writes them;
- metadata: ``general.*``, the hyper-parameters through transformers' GGUF config table reversed,
  and the tokenizer through gguf-py's vocab readers (``gguf_export_metadata``); a folder without a
  tokenizer is refused unless ``without_tokenizer``.

Every tensor is built in memory before the file is written (``storage.write_gguf``: a temporary
file renamed into place), then the header is read back and checked; ``src`` is never modified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.checkpoint.plan import Plan, format_problems, plan_checkpoint
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.producers.base import natural_key, split_name
from qscheme.producers.gguf.rule import rule_of
from qscheme.storage import GGMLType, Progress, ggml_type_by_name, raise_on_termination, read_gguf_header, write_gguf
from qscheme.text import shown, shown_file
from qscheme.writing.convert_layer import LayerConversion
from qscheme.writing.gguf_export_metadata import model_metadata, tokenizer_metadata
from qscheme.writing.gguf_export_names import SKIPPED_SUFFIXES, ExportNames, architecture_of, export_names
from qscheme.writing.gguf_layer import layer_to_blocks, preflight_to_blocks, summary_row
from qscheme.writing.loads_back import check_flags
from qscheme.writing.source import SourceCheckpoint
from qscheme.writing.summary import LayerRow, WriteSummary, peak_rss_bytes

__all__ = ["export_gguf"]

_PLAIN_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _target(to: Scheme | str | Path) -> tuple[Scheme, GGMLType, int | None]:
    require_scheme_argument(to, "export_gguf")
    target = to if isinstance(to, Scheme) else load_scheme(to)
    rule = rule_of(target)
    if rule is None or len(rule.types) != 1 or target.weight.blocks is None:
        raise UsageError(
            f"export_gguf: {target.name} is not a GGUF type; a .gguf output takes a gguf/<TYPE> scheme, exactly for "
            "gguf/Q4_0 (from compressed-tensors/W4A16_G32), gguf/Q8_0 (W8A16_G32), gguf/MXFP4 (MXFP4A16) and "
            "gguf/NVFP4 (modelopt/W4A16_NVFP4)"
        )
    return target, ggml_type_by_name(rule.types[0]), rule.file_type


def _checked_plan(folder: Path) -> Plan:
    plan = plan_checkpoint(folder)
    if plan.problems:
        raise CheckpointError(
            f"{shown_file(folder)}: {len(plan.problems)} problem(s) found, nothing was written:\n"
            f"{format_problems(plan.problems)}"
        )
    return plan


@dataclass
class _Tensor:
    type: GGMLType
    shape: tuple[int, ...]  # torch order, the last size in weights (not bytes)
    data: Tensor


@dataclass
class _Stack:
    """The experts of one stacked GGUF tensor, collected one by one."""

    type: GGMLType | None = None
    columns: int = 0
    experts: dict[int, Tensor] = field(default_factory=dict)


class _Export:
    """The GGUF tensors of one folder, built layer by layer."""

    def __init__(self, source: SourceCheckpoint, plan: Plan, names: ExportNames) -> None:
        self.source = source
        self.plan = plan
        self.names = names
        self.folder = plan.path
        self.tensors: dict[str, _Tensor] = {}
        self.stacks: dict[str, _Stack] = {}
        self.notes: list[str] = []

    def add(self, name: str, kind: GGMLType, shape: tuple[int, ...], data: Tensor, origin: str) -> None:
        if name in self.tensors:
            raise CheckpointError(
                f"{shown_file(self.folder)}: tensors {shown(origin)!r} and another one both map to GGUF tensor "
                f"{shown(name)!r}; the folder holds a tensor twice (fused and unfused?)"
            )
        self.tensors[name] = _Tensor(kind, shape, data)

    def place(self, module: str, short: str, kind: GGMLType, data: Tensor, columns: int) -> None:
        """One tensor (raw blocks or float values) of ``module``: an expert's, or a whole GGUF tensor's."""
        expert = self.names.expert(module) if short == "weight" else None
        if expert is not None:
            stacked, index, _ = expert
            stack = self.stacks.setdefault(stacked, _Stack())
            if stack.type not in (None, kind) or (stack.columns and stack.columns != columns):
                other = stack.type.name if stack.type else "?"
                raise CheckpointError(
                    f"{shown_file(self.folder)}: expert {shown(module)!r} is {kind.name} [{data.shape[0]}, {columns}], "
                    f"unlike the other experts of {stacked} ({other}, K={stack.columns}); "
                    "a GGUF stacks experts of one type and shape: quantize every expert alike"
                )
            stack.type, stack.columns = kind, columns
            stack.experts[index] = data
            return
        name = self.names.tensor(f"{module}.{short}" if module else short)
        if name in self.stacks:
            self.add(name, kind, (), data, f"{module}.{short}")  # refused: the experts' stack holds that name
        order = self.names.gguf_rows(name, data.shape[0]) if data.dim() >= 1 else None
        if order is not None:
            data = data.index_select(0, order)
        shape = (*data.shape[:-1], columns) if kind.name not in _PLAIN_TYPES.values() else tuple(data.shape)
        self.add(name, kind, tuple(int(size) for size in shape), data, f"{module}.{short}")

    def layer(self, module: str, target: Scheme, kind: GGMLType, allow_requantize: bool) -> LayerConversion:
        layout = self.plan.layouts[module]
        tensors = {short: self.source.read(info.name) for short, info in layout.declared.items() if short != "bias"}
        raw, report = layer_to_blocks(
            module, layout.scheme, tensors, layout.n, layout.k, target, allow_requantize=allow_requantize
        )
        self.place(module, "weight", kind, raw, layout.k)
        if layout.bias is not None:
            self.plain(layout.bias.name)
        return report

    def plain(self, name: str) -> str:
        """Copy one plain tensor; the GGUF type it is written as."""
        value = self.source.read(name)
        type_name = _PLAIN_TYPES.get(value.dtype)
        if type_name is None:
            raise CheckpointError(
                f"{shown_file(self.folder)}: tensor {shown(name)!r} is {str(value.dtype).removeprefix('torch.')}; a "
                "plain GGUF tensor is F32, F16 or BF16: quantize this layer, or store it as a float"
            )
        if value.dim() == 1 and type_name != "F32":
            value = value.to(torch.float32)  # exact; llama.cpp's converter keeps 1-D tensors in F32
            type_name = "F32"
        module, short = split_name(name)
        self.place(module, short, ggml_type_by_name(type_name), value, int(value.shape[-1]) if value.dim() else 1)
        return type_name

    def stacked(self) -> None:
        """Every expert stack checked complete and added as one [E, N, K] tensor."""
        for name, stack in self.stacks.items():
            count = len(stack.experts)
            if sorted(stack.experts) != list(range(count)):
                raise CheckpointError(
                    f"{shown_file(self.folder)}: GGUF tensor {name} stacks experts {sorted(stack.experts)}; "
                    f"experts 0 to {count - 1} are needed, each once: the folder lacks some experts"
                )
            assert stack.type is not None
            data = torch.stack([stack.experts[index] for index in range(count)])
            rows = data.shape[1]
            self.add(name, stack.type, (count, rows, stack.columns), data, name)


def export_gguf(
    src: str | Path,
    dst: str | Path,
    to: Scheme | str | Path,
    *,
    allow_requantize: bool = False,
    without_tokenizer: bool = False,
    force: bool = False,
    progress: bool | None = None,
) -> WriteSummary:
    """Write the quantized checkpoint folder ``src`` as the GGUF file ``dst`` in ``to`` (a
    ``gguf/<TYPE>`` scheme); see the module docstring. Raises RequantizationRefusedError (before
    writing) for a layer whose codes ``to`` does not share unless ``allow_requantize``,
    MissingTokenizerError for a folder without a tokenizer unless ``without_tokenizer``, and
    UnsupportedArchitectureError for a model family without a GGUF export."""
    started = time.perf_counter()
    check_flags(
        "export_gguf",
        allow_requantize=allow_requantize,
        without_tokenizer=without_tokenizer,
        force=force,
        progress=progress,
    )
    target, kind, file_type = _target(to)
    dst_path = Path(dst)
    if dst_path.suffix.lower() != ".gguf":
        raise UsageError(f"export_gguf: the output is one .gguf file, not {str(dst_path)!r}")
    source = SourceCheckpoint.open(src)
    if source.folder is None:
        raise UsageError(f"{src}: a GGUF export needs the checkpoint folder (config.json, tokenizer), not one file")
    folder = source.folder
    model_type, architecture = architecture_of(folder, source.config)
    plan = _checked_plan(folder)
    for module, layout in plan.layouts.items():  # every descriptor refusal before any tensor is read
        preflight_to_blocks(module, layout.scheme, target, allow_requantize=allow_requantize)
    names = export_names(folder, source.config, architecture.gguf)
    summary = WriteSummary(command="convert", src=str(src), dst=str(dst_path), scheme=target.name)
    export = _Export(source, plan, names)
    layer_notes: list[str] = []
    plain = [name for name in plan.detection.plain if not name.endswith(SKIPPED_SUFFIXES)]
    skipped = sorted(set(plan.detection.plain) - set(plain))
    with raise_on_termination(), Progress(len(plan.layouts) + len(plain), "exporting", enabled=progress) as bar:
        for module in plan.layouts:
            report = export.layer(module, target, kind, allow_requantize)
            summary.layers.append(summary_row(report))
            layer_notes.extend(f"{module}: {note}" for note in report.notes)
            bar.advance(item=module)
        for name in plain:
            written = export.plain(name)
            module, short = split_name(name)
            if short == "weight" and len(source.tensors[name].shape) == 2:
                summary.layers.append(LayerRow(module, written, "copied"))
            bar.advance(item=name)
        export.stacked()
        name = _general_name(folder, architecture.name_marker)
        metadata = model_metadata(folder, names.config, model_type, architecture.gguf, name, file_type)
        if file_type is None:
            summary.notes.append(f"{target.name} declares no llama.cpp file type: general.file_type not written")
        if without_tokenizer:
            summary.notes.append("written without a tokenizer (without_tokenizer): llama.cpp cannot tokenize text")
        else:
            rows = _vocabulary_rows(export, source)
            tokenizer, notes = tokenizer_metadata(folder, rows, architecture.gguf)
            metadata.update(tokenizer)
            summary.notes.extend(notes)
        entries = [
            (name, tensor.type, tensor.shape, tensor.data)
            for name, tensor in sorted(export.tensors.items(), key=lambda item: natural_key(item[0]))
        ]
        write_gguf(dst_path, metadata, entries, overwrite=force)
    _read_back(dst_path, entries)
    if skipped:
        summary.notes.append(f"not written (llama.cpp computes them): {', '.join(skipped[:4])}")
    if plan.detection.kv_cache:
        summary.notes.append(f"{len(plan.detection.kv_cache)} KV-cache scale tensor(s) not written: GGUF has none")
    summary.notes.extend(layer_notes[:20])
    if len(layer_notes) > 20:
        summary.notes.append(f"... and {len(layer_notes) - 20} more layer note(s)")
    summary.shards = [str(dst_path)]
    summary.bytes_written = dst_path.stat().st_size
    summary.bytes_read = source.total_bytes
    summary.seconds = time.perf_counter() - started
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary


def _general_name(folder: Path, name_marker: str | None) -> str:
    """The folder's name, holding the family's marker where transformers needs one (Mistral)."""
    name = folder.resolve().name or "model"
    if name_marker is not None and name_marker not in name:
        name = f"{name_marker}-{name}"
    return name


def _vocabulary_rows(export: _Export, source: SourceCheckpoint) -> int:
    embedding = export.tensors.get("token_embd.weight")
    if embedding is not None:
        return int(embedding.shape[0])
    vocab_size = source.config.get("vocab_size")
    if isinstance(vocab_size, int):
        return vocab_size
    raise CheckpointError(
        f"{shown_file(export.folder)}: neither a token embedding nor config.json's vocab_size says how many tokens "
        "the model has; add vocab_size to config.json"
    )


def _read_back(path: Path, entries: list[tuple[str, GGMLType, tuple[int, ...], Tensor]]) -> None:
    written = read_gguf_header(path)
    for name, kind, shape, _ in entries:
        found = written.tensors.get(name)
        if found is None or found.type != kind or found.shape != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} did not read back as written; the disk may be failing")
