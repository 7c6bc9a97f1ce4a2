"""``qscheme quantize SRC.gguf DST.gguf --scheme gguf/<TYPE>``: llama.cpp's quantization of a GGUF file.

The source is a GGUF whose weights are floats (F32, F16 or BF16: what llama.cpp's
``convert_hf_to_gguf.py`` writes). Every weight tensor (a name ending in ``.weight`` with two or
more dimensions: linear layers, stacked experts, the embedding and the output head) is quantized
to the scheme's type with llama.cpp's own reference arithmetic
(``qscheme.producers.gguf.quants``), as ``llama-quantize --pure`` does without an importance
matrix; every other tensor (norms, biases, 1-D tensors) and every metadata key is copied as it is,
with ``general.file_type`` set to the scheme's llama.cpp file type. A weight whose rows are not
whole blocks of the type is refused, naming it (llama.cpp would quietly pick another type).

The output is written beside itself and renamed into place complete (``storage.write_gguf``);
the source is never modified. Each weight's quantization error is measured against the source
(relative Frobenius and largest absolute), as ``qscheme quantize`` reports it for safetensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, UsageError
from qscheme.formats.blocks import decode_blocks
from qscheme.producers.gguf.arithmetic import FLOAT_TYPES, quantizable_types, quantize_type
from qscheme.producers.gguf.rule import rule_of
from qscheme.storage import (
    GGUFHeader,
    GGUFTensorInfo,
    ggml_type_by_name,
    read_gguf_header,
    read_gguf_tensor,
    write_gguf,
)
from qscheme.writing.error_report import ErrorSums
from qscheme.writing.summary import LayerRow, WriteSummary, peak_rss_bytes

ROWS_PER_CHUNK = 4096  # rows quantized at once (bounds the float32 copy of a large tensor)


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def _target(scheme: Scheme | str | Path) -> tuple[Scheme, str, int]:
    require_scheme_argument(scheme, "quantize")
    resolved = scheme if isinstance(scheme, Scheme) else load_scheme(scheme)
    rule = rule_of(resolved)
    if rule is None or len(rule.types) != 1:
        raise UsageError(
            f"scheme {resolved.name} is not a GGUF type; a .gguf output takes a gguf/<TYPE> scheme "
            f"(`qscheme schemes`), one of {', '.join('gguf/' + t for t in quantizable_types())}"
        )
    type_name = rule.types[0]
    if type_name not in quantizable_types():
        raise UsageError(
            f"qscheme cannot yet quantize to {type_name} bit for bit as llama.cpp does; quantizable GGUF types: "
            f"{', '.join(quantizable_types())}"
        )
    if rule.file_type is None:
        raise UsageError(f"scheme {resolved.name} declares no detect.gguf.file_type to write; add one")
    return resolved, type_name, rule.file_type


def _is_weight(info: GGUFTensorInfo) -> bool:
    return info.name.endswith(".weight") and len(info.shape) >= 2


def _source_rows(header: GGUFHeader, info: GGUFTensorInfo, rows: slice) -> Tensor:
    raw = read_gguf_tensor(header, info.name, rows)
    return raw.reshape(-1).view(FLOAT_TYPES[info.type.name]).to(torch.float32).reshape(raw.shape[0], -1)


def _quantized(header: GGUFHeader, info: GGUFTensorInfo, scheme: Scheme, type_name: str, errors: ErrorSums) -> Tensor:
    layout = scheme.weight.blocks
    assert layout is not None
    if info.type.name not in FLOAT_TYPES:
        raise CheckpointError(
            f"{header.path}: tensor {info.name!r} is {info.type.name}; qscheme quantizes float weights "
            f"({', '.join(FLOAT_TYPES)}) only: quantize from the file convert_hf_to_gguf.py wrote"
        )
    k = info.shape[-1]
    if k % layout.elements:
        raise CheckpointError(
            f"{header.path}: tensor {info.name!r} has rows of {k} weights, not whole blocks of {layout.elements} "
            f"({type_name}); leave it unquantized or choose a type with smaller blocks"
        )
    out = torch.empty((info.rows, k // layout.elements * layout.bytes), dtype=torch.uint8)
    for start in range(0, info.rows, ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, info.rows)
        weights = _source_rows(header, info, slice(start, stop))
        blocks = quantize_type(weights, type_name, info.name)
        out[start:stop] = blocks
        errors.add(weights, decode_blocks(blocks, layout))
    return out


def quantize_gguf(
    src: str | Path,
    dst: str | Path,
    scheme: Scheme | str | Path,
    *,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> WriteSummary:
    """Quantize the float GGUF ``src`` into ``dst`` (see the module docstring); a WriteSummary."""
    started = time.perf_counter()
    target, type_name, file_type = _target(scheme)
    src_path, dst_path = Path(src), Path(dst)
    if not is_gguf_path(dst_path):
        raise UsageError(f"the output of a GGUF quantization is one .gguf file, not {str(dst_path)!r}")
    if src_path.resolve() == dst_path.resolve():
        raise UsageError(f"the output {dst_path} is the source; write to another file (the source is never modified)")
    header = read_gguf_header(src_path)
    kind = ggml_type_by_name(type_name)
    summary = WriteSummary(command="quantize", src=str(src_path), dst=str(dst_path), scheme=target.name)
    metadata = {key: (header.metadata_types[key], value) for key, value in header.metadata.items()}
    metadata["general.file_type"] = ("UINT32", file_type)
    metadata["general.quantization_version"] = ("UINT32", 2)
    entries = []
    for info in header.tensors.values():
        if _is_weight(info):
            if progress is not None:
                progress(info.name)
            errors = ErrorSums()
            data = _quantized(header, info, target, type_name, errors)
            report = errors.report()
            entries.append((info.name, kind, info.shape, data))
            summary.layers.append(LayerRow(info.name, target.name, "quantized", None, report.max_abs, report.relative))
        else:
            entries.append((info.name, info.type, info.shape, read_gguf_tensor(header, info.name)))
            summary.layers.append(LayerRow(info.name, info.type.name, "copied"))
        summary.bytes_read += info.nbytes
    write_gguf(dst_path, metadata, entries, alignment=header.alignment, overwrite=force)
    written = read_gguf_header(dst_path)  # read back: every tensor where and as it was meant
    for name, kind_written, shape, _ in entries:
        found = written.tensors.get(name)
        if found is None or found.type != kind_written or found.shape != tuple(shape):
            raise CheckpointError(f"{dst_path}: tensor {name!r} did not read back as written; the disk may be failing")
    summary.shards.append(str(dst_path))
    summary.bytes_written = written.file_size
    summary.seconds = time.perf_counter() - started
    summary.peak_rss_bytes = peak_rss_bytes()
    return summary
