"""`qscheme quantize` on a tiny Qwen3-MoE: routers stay unquantized by default and the output loads.

The source is tests/test_experts.py's tiny Qwen3-MoE as its unquantized Hugging Face checkpoint
stores it (one Linear per expert and projection, ``mlp.gate`` the router). Quantized with the
default settings, the routers are copied as they are (the summary says so and why, the config's
ignore list names them), and ``from_pretrained`` loads the result; its logits equal those of the
same model with every quantized weight as ``qscheme.load_checkpoint`` dequantizes it and every
other tensor (routers included) as the source holds it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import single_threaded_torch  # noqa: F401
from safetensors.torch import load_file, save_file
from test_experts import EXPERTS, INNER, TOKENS, build_moe

import qscheme
from qscheme.modules import QuantLinear
from qscheme.transformers import via_qscheme
from qscheme.writing.quantize import quantize_checkpoint

LOGITS = 1e-5  # relative to max |logit|: float32 summation order only (as tests/test_transformers_moe.py)


def write_unquantized_moe(folder: Path) -> dict[str, torch.Tensor]:
    """The tiny MoE (seed 0) in float32 as its Hugging Face checkpoint holds it: per-expert Linears."""
    folder.mkdir(parents=True)
    model = build_moe()
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e in range(value.shape[0]):
                tensors[f"{module}.{e}.gate_proj.weight"] = value[e, :INNER].contiguous()
                tensors[f"{module}.{e}.up_proj.weight"] = value[e, INNER:].contiguous()
        elif leaf == "down_proj" and value.dim() == 3:
            for e in range(value.shape[0]):
                tensors[f"{module}.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(folder))
    return tensors


def dequantized_reference(folder: Path, source: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The tiny MoE with the quantized weights of ``folder`` dequantized, the rest from ``source``."""
    layers = qscheme.load_checkpoint(folder)
    weights = {f"{name}.weight": layer.dequantize() for name, layer in layers.modules.items()}
    model = build_moe(seed=1)  # other random values: everything must come from the checkpoint
    state = {}
    for name, value in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            state[name] = torch.stack(
                [
                    torch.cat([weights[f"{module}.{e}.gate_proj.weight"], weights[f"{module}.{e}.up_proj.weight"]])
                    for e in range(EXPERTS)
                ]
            )
        elif leaf == "down_proj" and value.dim() == 3:
            state[name] = torch.stack([weights[f"{module}.{e}.down_proj.weight"] for e in range(EXPERTS)])
        else:
            state[name] = weights.get(name, source[name])
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("preset", ["NVFP4A16", "W4A16"])
def test_routers_stay_unquantized_and_the_output_loads_through_from_pretrained(tmp_path: Path, preset: str) -> None:
    from transformers import AutoModelForCausalLM

    source = write_unquantized_moe(tmp_path / "src")
    summary = quantize_checkpoint(tmp_path / "src", tmp_path / "dst", f"compressed-tensors/{preset}")
    routers = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    rows = {row.name: row.action for row in summary.layers}
    assert all(rows[router] == "copied" for router in routers)
    assert sum(action == "quantized" for action in rows.values()) == 2 * (4 + 3 * 8)  # attention + experts
    note = next(note for note in summary.notes if "router" in note)
    assert "kept 2 MoE router(s) unquantized" in note and "model.layers.0.mlp.gate" in note
    written = load_file(str(tmp_path / "dst" / "model.safetensors"))
    for router in routers:
        assert torch.equal(written[f"{router}.weight"], source[f"{router}.weight"])  # copied bit for bit
    ignore = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore[0] == "lm_head" and any(entry.startswith("re:") and "gate" in entry for entry in ignore)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", config=via_qscheme(tmp_path / "dst")).eval()
    assert not isinstance(model.get_submodule("model.layers.0.mlp.gate"), QuantLinear)
    assert isinstance(model.get_submodule("model.layers.0.mlp.experts.3.down_proj"), QuantLinear)
    with torch.no_grad():
        logits = model(TOKENS).logits
        expected = dequantized_reference(tmp_path / "dst", source)(TOKENS).logits
    error = float((logits - expected).abs().max())
    assert error <= LOGITS * float(expected.abs().max()), error


def test_a_router_can_still_be_named_in_ignore_and_other_gates_are_quantized(tmp_path: Path) -> None:
    """Only router names are kept: ``gate_proj`` and a dense model's projections are quantized."""
    write_unquantized_moe(tmp_path / "src")
    summary = quantize_checkpoint(
        tmp_path / "src", tmp_path / "dst", "compressed-tensors/W4A16", ignore=["lm_head", "model.layers.0.mlp.gate"]
    )
    rows = {row.name: row.action for row in summary.layers}
    assert rows["model.layers.0.mlp.gate"] == rows["model.layers.1.mlp.gate"] == "copied"
    assert rows["model.layers.0.mlp.experts.0.gate_proj"] == "quantized"
    assert any("kept 1 MoE router(s)" in note for note in summary.notes)  # the other was ignored by name
