"""GGUF tensor names -> transformers parameter names, and llama.cpp's row order undone, by
transformers' own tables.

llama.cpp's converter renames every tensor (``blk.0.attn_q.weight`` for
``model.layers.0.self_attn.q_proj.weight``) and, for the llama family, reorders the rows of the
q and k projections (its rotary embedding pairs neighbouring rows, transformers' pairs halves).
transformers' GGUF loader undoes both: ``get_gguf_hf_weights_map`` maps the names through
gguf-py's ``TensorNameMap`` and the parameter names of a model built from the file's config, and
a ``TensorProcessor`` per architecture (``TENSOR_PROCESSORS``) reverses the permutation. This
module asks those very tables, so that a name or a row lands where transformers puts it:

- the config (``gguf_model_config``): ``AutoConfig.from_pretrained(folder, gguf_file=name)``;
- the names: the map for a model built from that config on the meta device (no memory);
- the rows of a quantized weight: the processor applied to the row indices ``[0, 1, ..., N-1]``
  gives the row order, which moves the raw rows of blocks (a block never spans two rows) and
  changes no byte. A processor that changes values there (not a pure row order) is refused;
- plain tensors: the processor applied to their values, as transformers applies it.

transformers and gguf are optional dependencies: a UsageError says how to install them.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qscheme.errors import CheckpointError, UsageError
from qscheme.text import shown, shown_file

__all__ = ["GGUFNames", "gguf_model_config", "gguf_names", "require_gguf_libraries"]


def require_gguf_libraries(path: str | Path) -> None:
    """UsageError unless the optional ``gguf`` and ``transformers`` packages can be imported."""
    missing = []
    for package in ("gguf", "transformers"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise UsageError(
            f"{shown_file(Path(path))}: loading a GGUF file needs the optional package(s) {' and '.join(missing)} "
            "(gguf-py's tensor names and transformers' GGUF config and name tables): pip install gguf transformers"
        )


def _quiet() -> contextlib.AbstractContextManager[object]:
    """transformers' GGUF reader prints a progress bar and logs every key it skips."""
    return contextlib.redirect_stderr(io.StringIO())


def gguf_model_config(path: str | Path) -> Any:
    """The transformers config of a GGUF file, as ``from_pretrained(..., gguf_file=...)`` builds it."""
    from transformers import AutoConfig

    path = Path(path)
    require_gguf_libraries(path)
    try:
        with _quiet():
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers' config checks raise their own classes too
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"{shown_file(path)}: transformers cannot build a config from its metadata ({type(exc).__name__}: "
            f"{shown(str(exc), 300)}); check the architecture's hyper-parameters in the header (block_count, "
            "embedding_length, attention.head_count ...) or re-convert the model with llama.cpp"
        ) from None
    _complete_experts(path, config)
    return config


# Sizes llama.cpp writes that transformers' GGUF config table (integrations.ggml) leaves out, so
# that its configs keep the class defaults (Qwen3-MoE's expert width 768, Qwen3's head_dim 128):
# GGUF key under the architecture -> config attribute, set where the config has that attribute.
EXPERT_WIDTHS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
HEAD_SIZES = {"attention.key_length": "head_dim"}


def _complete_experts(path: Path, config: Any) -> None:
    """Set the sizes the file states (``EXPERT_WIDTHS``, ``HEAD_SIZES``) on the transformers config."""
    from qscheme.storage import read_gguf_header

    metadata = read_gguf_header(path).metadata
    architecture = metadata.get("general.architecture")
    for key, attribute in {**EXPERT_WIDTHS, **HEAD_SIZES}.items():
        value = metadata.get(f"{architecture}.{key}")
        if hasattr(config, attribute) and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(config, attribute, value)


@dataclass
class GGUFNames:
    """transformers' view of one GGUF file: its config, the GGUF -> transformers name map, the
    shape of every parameter of a model built from the config, and the architecture's processor."""

    path: Path
    architecture: str
    config: Any
    to_transformers: dict[str, str]
    parameter_shapes: dict[str, tuple[int, ...]]
    processor: Any

    def target(self, tensor: str) -> str | None:
        """The transformers parameter of GGUF tensor ``tensor`` (stacked experts are mapped without
        their ``.weight``, as transformers maps them), or None."""
        found = self.to_transformers.get(tensor)
        if found is None and tensor.endswith(".weight"):
            found = self.to_transformers.get(tensor.removesuffix(".weight"))
        return found

    def row_order(self, tensor: str, rows: int) -> torch.Tensor | None:
        """The order in which transformers takes the rows of 2-D tensor ``tensor`` (None: as stored);
        CheckpointError when the architecture's processor does more than reorder its rows."""
        try:
            order = processor_row_order(self.processor, tensor, rows)
        except ValueError:
            raise CheckpointError(
                f"{shown_file(self.path)}: tensor {shown(tensor)!r}: transformers' {self.architecture} converter "
                f"({type(self.processor).__name__}) changes its values, not only the order of its rows, so it cannot "
                "stay quantized; convert this tensor to F16/F32 with llama-quantize (--tensor-type), or load the file "
                "with transformers' own GGUF loader"
            ) from None
        return None if order is None else torch.from_numpy(order.copy())

    def processed(self, tensor: str, values: np.ndarray) -> np.ndarray:
        """A plain tensor's values as transformers' processor leaves them."""
        result = self.processor.process(weights=values, name=tensor)
        if result.name != tensor:
            raise CheckpointError(
                f"{shown_file(self.path)}: tensor {shown(tensor)!r}: transformers' {self.architecture} converter "
                "renames or consumes it; qscheme cannot place it"
            )
        return np.asarray(result.weights)


@functools.cache
def _name_map(architecture: Any, blocks: int) -> Any:
    import gguf

    return gguf.tensor_mapping.get_tensor_name_map(architecture, blocks)


@contextlib.contextmanager
def _shared_name_maps() -> Iterator[None]:
    """transformers' ``get_gguf_hf_weights_map`` builds gguf's name map of the architecture anew for
    every module of the model (about 60 times, a third of a GGUF load): meanwhile, gguf's
    ``get_tensor_name_map`` returns one map per (architecture, block count), built once."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = _name_map
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def processor_row_order(processor: Any, tensor: str, rows: int) -> np.ndarray | None:
    """The order in which transformers' GGUF ``processor`` takes the rows of 2-D ``tensor`` (None:
    as stored), found by running it on the row indices; ValueError when it does more than reorder
    rows (renames the tensor, changes values or the shape)."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    result = processor.process(weights=index, name=tensor)
    order = np.asarray(result.weights).reshape(-1)
    if result.name != tensor or order.shape != (rows,) or not np.array_equal(np.sort(order), index[:, 0]):
        raise ValueError(f"{type(processor).__name__} changes the values of {tensor!r}")
    return None if np.array_equal(order, index[:, 0]) else order


def gguf_names(path: Path, architecture: str) -> GGUFNames:
    """transformers' tables for the file at ``path`` (its header already checked)."""
    require_gguf_libraries(path)
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    config = gguf_model_config(path)
    try:
        with _quiet():
            parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        # the file's own architecture names its tensors (transformers' mistral, a llama file, has no gguf-py name)
        with _shared_name_maps():
            mapping = get_gguf_hf_weights_map(model, processor, model_type=architecture)
    except (ValueError, KeyError, TypeError, NotImplementedError) as exc:
        raise CheckpointError(
            f"{shown_file(path)}: transformers cannot map its {architecture} tensors ({type(exc).__name__}: "
            f"{shown(str(exc), 300)}); re-convert the model with a current llama.cpp"
        ) from None
    shapes = {name: tuple(int(size) for size in value.shape) for name, value in model.state_dict().items()}
    return GGUFNames(path, architecture, config, dict(mapping), shapes, processor)
