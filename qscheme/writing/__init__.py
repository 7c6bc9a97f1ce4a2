"""Writing whole checkpoints: ``quantize_checkpoint`` and ``convert_checkpoint``.

Modules, by concern:

- ``source``: the checkpoint read from (shards, tensors one at a time, files to copy through);
- ``verify``: the written folder re-read and checked against the digests ``write_shard`` recorded,
  before the rename;
- ``producer_config``: config.json / hf_quant_config.json as each producer writes them, or a
  self-describing config for a scheme no producer writes;
- ``calibration``: the file of per-module input amax values for static activation scales;
- ``quantize``: ``quantize_checkpoint`` (round-to-nearest, shard by shard);
- ``convert`` / ``convert_layer``: ``convert_checkpoint`` (between schemes that share the math);
- ``summary``: ``WriteSummary``, what both return.

The files themselves go through ``qscheme.storage``: the temporary output folder beside DST,
renamed into place only when complete (``OutputFolder``), safetensors shards and their index
with a digest of every tensor written (``write_shard``, ``write_index``), JSON files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qscheme.writing.summary import LayerRow, WriteSummary

if TYPE_CHECKING:
    from qscheme.writing.convert import convert_checkpoint
    from qscheme.writing.quantize import quantize_checkpoint

__all__ = ["LayerRow", "WriteSummary", "convert_checkpoint", "quantize_checkpoint"]

_LAZY = {"quantize_checkpoint": "qscheme.writing.quantize", "convert_checkpoint": "qscheme.writing.convert"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qscheme.writing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
