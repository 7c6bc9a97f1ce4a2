"""``from_gguf``: a transformers model from a GGUF file, its quantized weights kept quantized.

transformers' ``from_pretrained(..., gguf_file=...)`` always goes through its own GGUF quantizer
(a ``quantization_config`` of another method is refused with a GGUF file), so qscheme's route is
a function of its own: the model is built from the file's config (transformers' GGUF config
mapping, ``AutoConfig.from_pretrained(folder, gguf_file=name)``) without initialising its
weights, and ``apply_to_model`` then swaps every quantized layer for a ``QuantLinear`` of scheme
``gguf/<TYPE>`` (stacked experts for a ``QuantExperts``), dequantizes a quantized ``token_embd``
into the embedding (in ``dtype``), and loads norms and other plain tensors. The float weights of
the layers it replaces are allocated but never written: on the CPU, untouched pages cost no
memory; on a GPU the dense model must fit once while it is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qscheme.checkpoint.gguf_names import gguf_model_config
from qscheme.checkpoint.model import apply_to_model
from qscheme.errors import UsageError

__all__ = ["from_gguf"]


def from_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    kernel: str | None = None,
    strict: bool = True,
) -> Any:
    """A transformers ``AutoModelForCausalLM`` of the GGUF file at ``path``, in eval mode, its
    quantized layers qscheme's (see the module docstring). ``kernel`` forces one kernel for every
    layer; ``strict`` is ``apply_to_model``'s. The loaded ``Checkpoint`` (its report says what was
    done) is ``model.qscheme_checkpoint``."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(f"from_gguf: dtype must be a float torch.dtype such as torch.bfloat16, not {dtype!r}")
    config = gguf_model_config(path)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # skipped with the initialisation: an lm_head tied to the embeddings (no output.weight)
    model.qscheme_checkpoint = apply_to_model(model, path, kernel=kernel, strict=strict)
    return model.eval()
