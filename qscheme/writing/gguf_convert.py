"""``convert_gguf``: a quantized GGUF file -> a compressed-tensors or ModelOpt checkpoint folder.

The file is planned as the loader plans it (``plan_checkpoint`` on a ``.gguf`` path:
transformers' names, llama's q/k rows put back in transformers' order, each 2-D weight's ggml
type as the scheme ``gguf/<TYPE>``), so convert accepts what ``load_checkpoint`` accepts. Then:

- each quantized linear layer goes through ``gguf_layer.blocks_to_layer``: where the GGUF type
  and the target share the codes (Q4_0 -> ``compressed-tensors/W4A16_G32``, Q8_0 ->
  ``compressed-tensors/W8A16_G32``, MXFP4 -> ``compressed-tensors/MXFP4A16``, NVFP4 ->
  ``modelopt/W4A16_NVFP4``) the codes are copied and the scales re-encoded, with the deviation
  reported; any other layer (a mixed file's Q6_K layers, say) is refused before anything is
  written unless ``allow_requantize``, as ``convert_checkpoint`` refuses;
- a quantized tensor that is no linear layer (the token embedding) is dequantized exactly to
  float32, the dtype transformers' own GGUF loader gives it, and listed in the target's ignore
  list; float tensors (norms, biases, F16/F32 weights) are copied in the dtype they are stored in;
- ``config.json`` is transformers' config built from the GGUF metadata (its GGUF mapping), with
  the target producer's quantization config.

The folder is written beside ``dst``, re-read through the loader's planning and renamed into
place (``OutputFolder``); ``src`` is never modified.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.checkpoint.gguf_files import GGUFFiles
from qscheme.checkpoint.plan import Plan, format_problems, plan_checkpoint
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.formats.blocks import decode_blocks
from qscheme.storage import (
    OutputFolder,
    Progress,
    ShardRecord,
    raise_on_termination,
    write_index,
    write_json,
    write_shard,
)
from qscheme.text import shown_file
from qscheme.writing.gguf_layer import blocks_to_layer, preflight_blocks, summary_row
from qscheme.writing.loads_back import check_flags, check_loads_back
from qscheme.writing.producer_config import config_files, producer_of
from qscheme.writing.summary import LayerRow, WriteSummary, peak_rss_bytes
from qscheme.writing.verify import verify_folder

__all__ = ["SHARD_BYTES", "convert_gguf"]

SHARD_BYTES = 4 << 30  # a shard is closed once it holds this many bytes
_NOT_LINEAR = ("TOKEN_EMBD", "POS_EMBD", "TOKEN_TYPES")  # gguf-py tensor kinds that are embeddings


def _embedding_tensors() -> tuple[str, ...]:
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    return tuple(TENSOR_NAMES[MODEL_TENSOR[kind]] for kind in _NOT_LINEAR)


def _checked_plan(path: Path) -> Plan:
    plan = plan_checkpoint(path)
    if plan.problems:
        raise CheckpointError(
            f"{shown_file(path)}: {len(plan.problems)} problem(s) found, nothing was written:\n"
            f"{format_problems(plan.problems)}"
        )
    return plan


def _source_config(files: GGUFFiles) -> dict[str, Any]:
    """transformers' config of the file as config.json holds it, with the model class named."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = files.names.config
    out: dict[str, Any] = config.to_diff_dict()  # what save_pretrained writes
    out.pop("_name_or_path", None)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if model_class and not out.get("architectures"):
        out["architectures"] = [model_class]
    if not out.get("dtype"):
        out["dtype"] = "float32"  # the dtype transformers' GGUF loader dequantizes to
    return out


class _Shards:
    """Tensors collected into shards of about ``SHARD_BYTES``, written as they fill."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending: dict[str, Tensor] = {}
        self.size = 0
        self.records: list[ShardRecord] = []

    def add(self, name: str, value: Tensor) -> None:
        self.pending[name] = value.contiguous()
        self.size += value.numel() * value.element_size()
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            path = self.folder / f"part-{len(self.records):05d}.safetensors"
            self.records.append(write_shard(path, self.pending, fsync=False))
            self.pending, self.size = {}, 0

    def finish(self) -> list[ShardRecord]:
        """Every shard renamed as transformers names them (an index when there are several)."""
        self.flush()
        count = len(self.records)
        final = []
        for index, record in enumerate(self.records):
            name = "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            record.path.rename(self.folder / name)
            final.append(replace(record, path=self.folder / name))
        if count > 1:
            weight_map = {tensor.name: record.path.name for record in final for tensor in record.tensors}
            write_index(self.folder, weight_map, sum(record.data_bytes for record in final))
        return final


def convert_gguf(
    src: str | Path,
    dst: str | Path,
    to: Scheme | str | Path,
    *,
    allow_requantize: bool = False,
    force: bool = False,
    progress: bool | None = None,
) -> WriteSummary:
    """Convert the quantized GGUF file ``src`` into a checkpoint folder ``dst`` in scheme ``to``
    (see the module docstring). Raises RequantizationRefusedError (before writing anything) for a
    layer whose codes the target does not share, unless ``allow_requantize``."""
    started = time.perf_counter()
    check_flags("convert_gguf", allow_requantize=allow_requantize, force=force, progress=progress)
    require_scheme_argument(to, "convert_gguf")
    target = load_scheme(to)
    if producer_of(target) == "qscheme" or target.weight.blocks is not None:
        raise UsageError(
            f"convert_gguf: {target.name} is not a compressed-tensors or ModelOpt scheme; a GGUF file converts to "
            "compressed-tensors/W4A16_G32 (Q4_0), compressed-tensors/W8A16_G32 (Q8_0), compressed-tensors/MXFP4A16 "
            "(MXFP4) or modelopt/W4A16_NVFP4 (NVFP4)"
        )
    path = Path(src)
    plan = _checked_plan(path)
    files = plan.files
    assert isinstance(files, GGUFFiles)
    embeddings = _embedding_tensors()
    dequantized = sorted(
        module for module in plan.layouts if files.placed[f"{module}.weight"].tensor.startswith(embeddings)
    )
    layers = [module for module in plan.layouts if module not in dequantized]
    for module in layers:  # every refusal before anything is written
        preflight_blocks(module, plan.layouts[module].scheme, target, allow_requantize=allow_requantize)
    summary = WriteSummary(command="convert", src=str(src), dst=str(dst), scheme=target.name)
    plain_linear = sorted(
        name.removesuffix(".weight")
        for name in plan.detection.plain
        if name.endswith(".weight") and len(files.tensors[name].shape) == 2
    )
    unquantized = sorted({*plain_linear, *dequantized})
    notes: list[str] = []
    output = OutputFolder(dst, force=force, sources=[path])
    with raise_on_termination(), output as out, Progress(len(files.tensors), "converting", enabled=progress) as bar:
        shards = _Shards(out.path)
        for module in layers:
            layout = plan.layouts[module]
            raw = files.get(layout.declared["weight"].name)
            # the layout's N and K: an expert of stacked experts has no parameter of its own in the model
            result = blocks_to_layer(
                module, layout.scheme, raw, layout.n, layout.k, target, allow_requantize=allow_requantize
            )
            for short, value in result.tensors.items():
                shards.add(f"{module}.{short}", value)
            bias = layout.bias  # a quantized layer's bias (qwen2's q/k/v)
            if bias is not None:
                shards.add(f"{module}.bias", files.get(bias.name))
            summary.layers.append(summary_row(result))
            notes.extend(f"{module}: {note}" for note in result.notes)
            bar.advance(item=module)
        for module in dequantized:
            layout = plan.layouts[module]
            raw = files.get(layout.declared["weight"].name)
            blocks = layout.scheme.weight.blocks
            assert blocks is not None
            shards.add(f"{module}.weight", decode_blocks(raw, blocks))
            summary.layers.append(LayerRow(module, "float32", "copied"))
            notes.append(
                f"{module}: {layout.scheme.name} embedding dequantized exactly to float32 (not a linear layer)"
            )
            bar.advance(item=module)
        for name in plan.detection.plain:
            shards.add(name, files.get(name))
            bar.advance(item=name)
        records = shards.finish()
        configs = config_files(
            target,
            _source_config(files),
            ignore=unquantized,
            unquantized_modules=unquantized,
            note=f"converted by qscheme from {shown_file(path)} ({', '.join(sorted(plan.detection.scheme_counts()))})",
        )
        for file_name, contents in configs.items():
            write_json(out.path / file_name, contents)
        verify_folder(out.path, records, reread=True)
        check_loads_back(out.path, layers, target.name)
        out.commit()
    summary.notes.extend(notes[:20])
    if len(notes) > 20:
        summary.notes.append(f"... and {len(notes) - 20} more layer note(s)")
    summary.notes.extend(files.notes)
    summary.shards = [record.path.name for record in records]
    summary.bytes_written = sum(record.size for record in records)
    summary.bytes_read = files.total_bytes
    summary.seconds = time.perf_counter() - started
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary
