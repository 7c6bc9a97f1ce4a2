"""``AutoModelForCausalLM.from_pretrained`` on ModelOpt exports, against ModelOpt's own model.

The shipped fixtures (tests/fixtures/modelopt/: NVFP4, W4A16_NVFP4, FP8, int4 AWQ) load through
qscheme's ``modelopt`` quantizer. The oracle (tests/modelopt_model_oracle.py, run in the ModelOpt
venv named by QSCHEME_MODELOPT_PYTHON) makes ModelOpt's model hold the committed fixture's
tensors and runs it: for FP8 and AWQ its fake-quantized model (quantizers, pre_quant_scale and
folded norms as ModelOpt's own quantize run lays them out, every number replaced by the
fixture's); for the NVFP4 family, whose fake quantization ModelOpt runs on CUDA only, the fixture's
model with ModelOpt's own dequantized weights and NVFP4 input quantization (its NVFP4QTensor).

Machine independence (docs/testing.md): nothing here depends on ModelOpt recomputing the fixture.
Rebuilding it from its seed is not reproducible across CPUs (torch's ``normal_`` draws other
numbers without AVX2; calibration sums float32 activations; AWQ's scale search moved a scale by
2.4e-7 on an AVX-512 Xeon). What must be bit-exact is only what is exact on any CPU: ModelOpt's
packing of the fixture's weights with the fixture's scales (round to nearest, elementwise) must
give the fixture back byte for byte.

Tolerance: the models are float32 and both sides compute the same products; only the order of
float32 sums differs (matmul blocking, attention, norms), so logits agree to 1e-5 of their largest
magnitude. Greedy ``generate()`` tokens must be equal: the top-2 logit gaps of these six steps
are 1e-2 or more, three orders of magnitude above the tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from checkpoint_cache import modelopt_fixture

import qscheme  # noqa: F401  (registers the quantizers)
from qscheme.modules import QuantLinear
from qscheme.transformers import registered

MODELOPT_PYTHON = os.environ.get("QSCHEME_MODELOPT_PYTHON")
ORACLE = Path(__file__).parent / "modelopt_model_oracle.py"
FIXTURES = {"nvfp4": "qtensor", "w4a16_nvfp4": "qtensor", "fp8": "fake_quant", "w4a16_awq": "fake_quant"}
INPUT_IDS = torch.tensor([[1, 5, 9, 200, 33, 7, 100, 2]])
LOGIT_TOLERANCE = 1e-5  # relative to max |logit|: float32 summation order only
# ModelOpt's fake quantization rescales by amax / bound in its own order: code * scale within 2 ulps
FAKE_QUANT_WEIGHT_ULPS = 2
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def oracles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """ModelOpt's numbers for every fixture, from one run of the oracle (its import is the slow part)."""
    if not MODELOPT_PYTHON:
        pytest.skip("set QSCHEME_MODELOPT_PYTHON to a Python with nvidia-modelopt")
    folder = tmp_path_factory.mktemp("modelopt_model_oracle")
    source, target = folder / "in.pt", folder / "out.pt"
    torch.save({"input_ids": INPUT_IDS}, source)
    done = subprocess.run(
        [MODELOPT_PYTHON, str(ORACLE), str(source), str(target), *sorted(FIXTURES)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, object]] = torch.load(target)
    return result


def safetensors_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return list(handle.keys())


def _load(fixture: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(modelopt_fixture(fixture)).eval()


def test_modelopt_quantizer_is_registered() -> None:
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert registered()["modelopt"] == "qscheme"
    assert AUTO_QUANTIZER_MAPPING["modelopt"].__module__.startswith("qscheme.transformers")
    # transformers' own compressed-tensors quantizer keeps its name
    assert AUTO_QUANTIZER_MAPPING["compressed-tensors"].__module__.startswith("transformers.")


@pytest.mark.parametrize("fixture", sorted(FIXTURES))
@pytest.mark.oracle
def test_logits_and_greedy_tokens_equal_modelopts_model(fixture: str, oracles: dict[str, dict[str, object]]) -> None:
    """qscheme's model of the fixture against ModelOpt's model holding the fixture's tensors.

    Holds on any CPU: both sides run on this machine from the same committed tensors, and the
    only bit-exact check is ModelOpt's re-export, which rounds the fixture's weights with the
    fixture's scales (elementwise division and round to nearest, exact in IEEE arithmetic).
    """
    oracle = oracles[fixture]
    assert oracle["oracle"] == FIXTURES[fixture]
    stored = safetensors_names(modelopt_fixture(fixture) / "model.safetensors")
    assert oracle["loaded"] == sorted(stored)  # the oracle's model holds every tensor of the fixture
    if oracle["oracle"] == "fake_quant":
        # ModelOpt packs the fixture's weights and scales back into the fixture, byte for byte
        assert oracle["reexport_differs"] == []
        assert oracle["weight_ulps"] <= FAKE_QUANT_WEIGHT_ULPS  # its fake-quant weights are the fixture's
    model = _load(fixture)
    quantized = [name for name, module in model.named_modules() if isinstance(module, QuantLinear)]
    assert len(quantized) == 7, quantized  # q, k, v, o, gate, up, down of the one layer
    with torch.no_grad():
        logits = model(INPUT_IDS).logits.float()
        tokens = model.generate(INPUT_IDS, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = oracle["logits"]
    assert isinstance(expected, torch.Tensor)
    error = float((logits - expected).abs().max())
    assert error <= LOGIT_TOLERANCE * float(expected.abs().max()), error
    assert torch.equal(tokens, oracle["tokens"])  # type: ignore[arg-type]


def test_plain_tensors_come_from_the_checkpoint_and_nothing_is_left_over() -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = modelopt_fixture("w4a16_awq")
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    state = load_file(str(folder / "model.safetensors"))
    norm = model.get_submodule("model.layers.0.input_layernorm").weight
    assert torch.equal(norm, state["model.layers.0.input_layernorm.weight"])  # AWQ-folded, not ones
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(layer, QuantLinear) and layer.weight_canonical.input_pre_scale is not None


def test_the_model_reads_weight_metadata_and_refuses_training() -> None:
    from qscheme.modules import QuantizedWeightError

    model = _load("fp8")
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert (layer.weight.shape, layer.weight.dtype, layer.weight.device) == (
        (128, 128),
        torch.float32,
        layer.torch_device,
    )
    assert model.dtype == torch.float32
    assert not any("q_proj" in name for name, _ in model.named_parameters())
    with pytest.raises(QuantizedWeightError, match=r"q_proj.*cannot be trained"):
        layer.weight.requires_grad_(True)
    with pytest.raises(QuantizedWeightError, match=r"q_proj.*cannot be trained"):
        torch.optim.SGD([layer.weight], lr=0.1)
    with pytest.raises(QuantizedWeightError, match=r"q_proj.*holds no values.*dequantize"):
        torch.nn.functional.linear(torch.zeros(1, 128), layer.weight)


def test_tied_embeddings_with_a_quantized_lm_head_are_refused(tmp_path: Path) -> None:
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from qscheme.errors import CheckpointError

    folder = tmp_path / "tied"
    shutil.copytree(modelopt_fixture("fp8"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config["quantization_config"]["ignore"] = ["model.embed_tokens"]
    (folder / "config.json").write_text(json.dumps(config))
    quant = json.loads((folder / "hf_quant_config.json").read_text())
    quant["quantization"]["exclude_modules"] = ["model.embed_tokens"]
    (folder / "hf_quant_config.json").write_text(json.dumps(quant))
    # copy a quantized linear to lm_head: the checkpoint now quantizes the tied output layer
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    del state["lm_head.weight"]
    for key in [k for k in state if k.startswith("model.layers.0.mlp.gate_proj.")]:  # [256, 128], as lm_head
        state[key.replace("model.layers.0.mlp.gate_proj", "lm_head")] = state[key].clone()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lm_head.*tie_word_embeddings"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_the_registration_leaves_a_taken_name_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.quantizers import auto

    import qscheme.transformers as integration

    class Other(auto.HfQuantizer):  # type: ignore[misc]
        pass

    monkeypatch.setitem(auto.AUTO_QUANTIZER_MAPPING, "modelopt", Other)
    monkeypatch.setattr(integration, "_REGISTERED", {})
    assert integration.register()["modelopt"].startswith("left to ")
    assert auto.AUTO_QUANTIZER_MAPPING["modelopt"] is Other


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
