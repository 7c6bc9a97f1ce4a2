"""transformers parameter names -> GGUF tensor names and llama.cpp's row order, for a GGUF export.

The exact inverse of what the GGUF loader (``checkpoint.gguf_names``) does, asked of the same
transformers tables so that a file written here loads back where it came from:

- the architecture: the config's ``model_type`` in ``ARCHITECTURES`` (the families whose GGUF
  files transformers and qscheme load); any other is refused (UnsupportedArchitectureError);
- the names: transformers' ``get_gguf_hf_weights_map`` (gguf-py's ``TensorNameMap`` for the
  architecture) for a model built from the folder's config on the meta device, read backwards;
- stacked experts: ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` go to the GGUF
  tensor ``blk.N.ffn_{gate,up,down}_exps`` [E, N, K] the map names for ``<experts>``'s parameter;
- the rows: the architecture's ``TensorProcessor`` applied to the row indices gives the order in
  which transformers takes a GGUF tensor's rows (llama's q/k); its inverse permutation gives the
  order llama.cpp stores them in. A processor that changes values, not only the order of rows, is
  refused: the export could not undo it exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qscheme.checkpoint.gguf_names import processor_row_order
from qscheme.errors import CheckpointError, InputError
from qscheme.text import shown, shown_file

__all__ = ["ARCHITECTURES", "ExportNames", "UnsupportedArchitectureError", "export_names"]


class UnsupportedArchitectureError(CheckpointError, InputError):
    """The folder's model family has no GGUF export (exit code 2)."""


@dataclass(frozen=True)
class Architecture:
    """How one transformers ``model_type`` is written as GGUF."""

    gguf: str  # general.architecture
    name_marker: str | None = None  # a word general.name must hold for transformers to read the family back


# transformers model_type -> GGUF architecture. llama.cpp writes Mistral as llama; transformers tells
# it apart by "mistral" in general.name.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama"),
    "mistral": Architecture("llama", name_marker="mistral"),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3"),
    "qwen3_moe": Architecture("qwen3moe"),
}
_EXPERT = re.compile(r"^(?P<parent>.+)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)$")
_EXPERT_ENDINGS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers llama.cpp's converter leaves out too


def architecture_of(folder: Path, config: dict[str, Any]) -> tuple[str, Architecture]:
    """(model_type, its GGUF architecture), or UnsupportedArchitectureError naming both."""
    model_type = config.get("model_type")
    found = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if found is None or not isinstance(model_type, str):
        raise UnsupportedArchitectureError(
            f"{shown_file(folder / 'config.json')}: model_type {shown(repr(model_type), 60)} has no GGUF export; "
            f"supported: {', '.join(ARCHITECTURES)} (the families whose GGUF files transformers and qscheme load "
            "back). Convert this model with llama.cpp's convert_hf_to_gguf.py instead"
        )
    return model_type, found


@dataclass
class ExportNames:
    """The GGUF name of every parameter of the folder's model, and the rows llama.cpp reorders."""

    folder: Path
    architecture: str
    config: Any  # the transformers config built from config.json
    to_gguf: dict[str, list[str]]  # transformers parameter (".weight" included) -> GGUF tensor name(s)
    processor: Any

    def tensor(self, parameter: str) -> str:
        """The GGUF tensor of transformers parameter ``parameter`` ("model.norm.weight" -> "output_norm.weight")."""
        found = self.to_gguf.get(parameter)
        if not found or len(found) != 1:
            raise CheckpointError(
                f"{shown_file(self.folder)}: tensor {shown(parameter)!r} has no GGUF name in the {self.architecture} "
                "name map (transformers' get_gguf_hf_weights_map, built on gguf-py's TensorNameMap); the folder "
                "holds a tensor the model does not: remove it, or convert with llama.cpp's convert_hf_to_gguf.py"
            )
        return found[0]

    def expert(self, module: str) -> tuple[str, int, str] | None:
        """(stacked GGUF tensor, expert index, projection) of a per-expert module, or None."""
        match = _EXPERT.match(module)
        if match is None:
            return None
        parent, projection = match["parent"], match["projection"]
        ending = _EXPERT_ENDINGS[projection]
        for parameter in (f"{parent}.{projection}", f"{parent}.gate_up_proj", f"{parent}.{projection}.weight"):
            for name in self.to_gguf.get(parameter, ()):
                if name.removesuffix(".weight").endswith(ending):
                    return f"{name.removesuffix('.weight')}.weight", int(match["expert"]), projection
        return None

    def gguf_rows(self, tensor: str, rows: int) -> torch.Tensor | None:
        """The permutation taking a tensor's rows in transformers' order to llama.cpp's (``out = rows[p]``),
        None when they are the same; CheckpointError when the processor changes values."""
        try:
            order = processor_row_order(self.processor, tensor, rows)
        except ValueError:
            raise CheckpointError(
                f"{shown_file(self.folder)}: GGUF tensor {shown(tensor)!r}: transformers' {self.architecture} GGUF "
                f"reader ({type(self.processor).__name__}) changes its values, not only the order of its rows, so the "
                "export cannot write it exactly; convert this model with llama.cpp's convert_hf_to_gguf.py"
            ) from None
        return None if order is None else torch.from_numpy(np.argsort(order, kind="stable"))


def export_names(folder: Path, config: dict[str, Any], architecture: str) -> ExportNames:
    """transformers' name map and row processor for the model ``config`` (config.json's contents) describes."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    try:
        model_config = AutoConfig.for_model(**plain)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model_config.to_dict())
        mapping = get_gguf_hf_weights_map(model, processor, model_type=architecture)
    except (ValueError, KeyError, TypeError, NotImplementedError) as exc:
        raise CheckpointError(
            f"{shown_file(folder / 'config.json')}: transformers cannot build the model or its GGUF name map "
            f"({type(exc).__name__}: {shown(str(exc), 300)}); check config.json"
        ) from None
    to_gguf: dict[str, list[str]] = {}
    for gguf_name, parameter in mapping.items():
        to_gguf.setdefault(parameter, []).append(gguf_name)
    return ExportNames(folder, architecture, model_config, to_gguf, processor)
