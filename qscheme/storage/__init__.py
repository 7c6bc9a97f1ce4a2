"""Storage: reading and writing the files of a checkpoint, and nothing about what they mean.

Modules, by concern:

- ``safetensors_header``: one safetensors file's header, parsed and checked (``read_file_header``);
- ``safetensors_reader``: a checkpoint folder's safetensors files (one file, or shards and their
  index), each tensor read on demand into memory of its own (``CheckpointFiles``);
- ``gguf_types`` / ``gguf_header`` / ``gguf_reader`` / ``gguf_writer``: the GGUF container (llama.cpp's):
  its ggml types as data, one file's header parsed and checked (``read_gguf_header``), a tensor's
  raw bytes or a range of its rows (``read_gguf_tensor``), a file written atomically (``write_gguf``);
- ``rank_slices``: only one tensor-parallel rank's bytes of a tensor, counted (``read_slice``);
- ``shards``: safetensors shards and their index written, with a digest of every tensor;
- ``bytes_copy``: bytes that do not change, copied from a source shard by the kernel;
- ``output_folder`` / ``run_owner``: the temporary folder beside DST, renamed into place only
  when complete, and which run owns it;
- ``json_files``: JSON files read strictly and written as transformers writes them;
- ``progress``: the progress bar on stderr.

``checkpoint/``, ``writing/`` and ``parallel/`` read and write files through the names below;
nothing here imports them (tests/test_storage.py checks). A second container (GGUF) plugs in
here, as a header parser and a reader beside the safetensors ones, so that the loader above
sees tensors and byte ranges, not file formats.

Names are imported on first use, so that importing one of them (e.g. ``Terminated`` for the
command line) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qscheme.storage.bytes_copy import (
        MappedShard,
        RawSpan,
        copy_span,
        first_difference,
    )
    from qscheme.storage.gguf_header import (
        MAX_GGUF_HEADER_BYTES,
        GGUFHeader,
        GGUFTensorInfo,
        read_gguf_header,
    )
    from qscheme.storage.gguf_reader import read_gguf_tensor
    from qscheme.storage.gguf_types import (
        GGML_TYPES,
        GGMLType,
        ggml_type_by_name,
    )
    from qscheme.storage.gguf_writer import (
        GGUFMetadataValue,
        GGUFTensorEntry,
        write_gguf,
    )
    from qscheme.storage.json_files import (
        config_file_present,
        file_problem,
        read_json,
        write_json,
    )
    from qscheme.storage.output_folder import (
        OLD_MARK,
        PARTIAL_MARK,
        OutputFolder,
        Terminated,
        raise_on_termination,
        signals_held,
    )
    from qscheme.storage.progress import (
        LARGE_CHECKPOINT_BYTES,
        Progress,
        auto_enabled,
    )
    from qscheme.storage.rank_slices import (
        ReadCounter,
        read_slice,
        read_whole,
    )
    from qscheme.storage.run_owner import (
        OWNER_FILE,
        Owner,
        remove_dead_runs,
        remove_owner,
        this_run,
        write_owner,
    )
    from qscheme.storage.safetensors_header import (
        DTYPE_BY_TORCH_NAME,
        MAX_HEADER_BYTES,
        SAFETENSORS_DTYPES,
        Dtype,
        FileHeader,
        TensorInfo,
        read_file_header,
        read_header,
    )
    from qscheme.storage.safetensors_reader import (
        INDEX_FILE,
        SINGLE_FILE,
        CheckpointFiles,
        allocate_bytes,
        memory_bytes,
        read_checked_tensor,
        refuse_empty_path,
        too_large,
    )
    from qscheme.storage.shards import (
        DEFAULT_METADATA,
        ShardRecord,
        TensorRecord,
        dtype_code,
        sync_file,
        tensor_bytes,
        write_index,
        write_shard,
    )

_EXPORTS: dict[str, str] = {
    "GGML_TYPES": "gguf_types",
    "GGMLType": "gguf_types",
    "ggml_type_by_name": "gguf_types",
    "MAX_GGUF_HEADER_BYTES": "gguf_header",
    "GGUFHeader": "gguf_header",
    "GGUFTensorInfo": "gguf_header",
    "read_gguf_header": "gguf_header",
    "read_gguf_tensor": "gguf_reader",
    "GGUFMetadataValue": "gguf_writer",
    "GGUFTensorEntry": "gguf_writer",
    "write_gguf": "gguf_writer",
    "DTYPE_BY_TORCH_NAME": "safetensors_header",
    "MAX_HEADER_BYTES": "safetensors_header",
    "SAFETENSORS_DTYPES": "safetensors_header",
    "Dtype": "safetensors_header",
    "FileHeader": "safetensors_header",
    "TensorInfo": "safetensors_header",
    "read_file_header": "safetensors_header",
    "read_header": "safetensors_header",
    "INDEX_FILE": "safetensors_reader",
    "SINGLE_FILE": "safetensors_reader",
    "CheckpointFiles": "safetensors_reader",
    "allocate_bytes": "safetensors_reader",
    "memory_bytes": "safetensors_reader",
    "read_checked_tensor": "safetensors_reader",
    "refuse_empty_path": "safetensors_reader",
    "too_large": "safetensors_reader",
    "ReadCounter": "rank_slices",
    "read_slice": "rank_slices",
    "read_whole": "rank_slices",
    "DEFAULT_METADATA": "shards",
    "ShardRecord": "shards",
    "TensorRecord": "shards",
    "dtype_code": "shards",
    "sync_file": "shards",
    "tensor_bytes": "shards",
    "write_index": "shards",
    "write_shard": "shards",
    "MappedShard": "bytes_copy",
    "RawSpan": "bytes_copy",
    "copy_span": "bytes_copy",
    "first_difference": "bytes_copy",
    "OLD_MARK": "output_folder",
    "PARTIAL_MARK": "output_folder",
    "OutputFolder": "output_folder",
    "Terminated": "output_folder",
    "raise_on_termination": "output_folder",
    "signals_held": "output_folder",
    "OWNER_FILE": "run_owner",
    "Owner": "run_owner",
    "remove_dead_runs": "run_owner",
    "remove_owner": "run_owner",
    "this_run": "run_owner",
    "write_owner": "run_owner",
    "config_file_present": "json_files",
    "file_problem": "json_files",
    "read_json": "json_files",
    "write_json": "json_files",
    "LARGE_CHECKPOINT_BYTES": "progress",
    "Progress": "progress",
    "auto_enabled": "progress",
}

__all__ = [
    "DEFAULT_METADATA",
    "DTYPE_BY_TORCH_NAME",
    "GGML_TYPES",
    "INDEX_FILE",
    "LARGE_CHECKPOINT_BYTES",
    "MAX_GGUF_HEADER_BYTES",
    "MAX_HEADER_BYTES",
    "OLD_MARK",
    "OWNER_FILE",
    "PARTIAL_MARK",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "CheckpointFiles",
    "Dtype",
    "FileHeader",
    "GGMLType",
    "GGUFHeader",
    "GGUFMetadataValue",
    "GGUFTensorEntry",
    "GGUFTensorInfo",
    "MappedShard",
    "OutputFolder",
    "Owner",
    "Progress",
    "RawSpan",
    "ReadCounter",
    "ShardRecord",
    "TensorInfo",
    "TensorRecord",
    "Terminated",
    "allocate_bytes",
    "auto_enabled",
    "config_file_present",
    "copy_span",
    "dtype_code",
    "file_problem",
    "first_difference",
    "ggml_type_by_name",
    "memory_bytes",
    "raise_on_termination",
    "read_checked_tensor",
    "read_file_header",
    "read_gguf_header",
    "read_gguf_tensor",
    "read_header",
    "read_json",
    "read_slice",
    "read_whole",
    "refuse_empty_path",
    "remove_dead_runs",
    "remove_owner",
    "signals_held",
    "sync_file",
    "tensor_bytes",
    "this_run",
    "too_large",
    "write_gguf",
    "write_index",
    "write_json",
    "write_owner",
    "write_shard",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qscheme.storage' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qscheme.storage.{module}"), name)
