"""The fix for a quantized MoE router: its model module is a router, not an nn.Linear.

transformers 5 builds routers (``mlp.gate`` of Qwen-MoE, ``block_sparse_moe.gate`` of Mixtral,
``feed_forward.router`` of Llama 4) as their own module types, so a checkpoint that quantized
one cannot be loaded into the model; llm-compressor's MoE recipes and ``qscheme quantize``
leave them unquantized. The refusals (apply_to_model, from_pretrained, tensor-parallel
apply_to_model) end with ``router_hint``: the ``--ignore`` entry that requantizes without it.
"""

from __future__ import annotations

import re

# Module names of MoE routers (matched whole); qscheme quantize's ROUTERS list the same names.
_ROUTER = re.compile(r".*\.(?:mlp|block_sparse_moe|moe|feed_forward)\.(?:gate|router)|.*\.shared_expert_gate")
_LAYER_INDEX = re.compile(r"^.*\.\d+\.")


def ignore_entry(module: str) -> str:
    """The ``--ignore`` entry matching ``module`` in every layer: ``re:.*<name after the layer index>$``
    (``model.layers.3.mlp.gate`` -> ``re:.*mlp.gate$``, llm-compressor's spelling)."""
    return f"re:.*{_LAYER_INDEX.sub('', module)}$"


def router_hint(module: str, kind: str) -> str:
    """For a quantized module whose model module (of type ``kind``) is not an nn.Linear: the fix
    when it is an MoE router (its name says so, or its type's), else ""."""
    if not (_ROUTER.fullmatch(module) or "router" in kind.lower()):
        return ""
    entry = ignore_entry(module)
    return (
        f" {module!r} is an MoE router ({kind}), which stays unquantized (as llm-compressor's MoE recipes "
        f"and qscheme quantize's defaults leave it): requantize with --ignore '{entry}' (qscheme quantize; "
        f"llm-compressor: ignore=['{entry}'])"
    )
