"""``from_pretrained(dir, gguf_file=name, quantization_config=QSchemeGgufConfig())``: qscheme's opt-in GGUF route.

The model it gives holds ``gguf/<TYPE>`` QuantLinear layers and computes what ``from_gguf`` (and a
dense model of the exactly dequantized weights) computes; transformers' own GGUF route keeps its
behaviour (a dense model) in the same process; a quantized embedding is dequantized into the
embedding; a replaced GGUF quantizer is not overridden.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package writes the test files: pip install gguf")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")

import gguf_tiny as tiny
from transformers import AutoModelForCausalLM

from qscheme.errors import UsageError
from qscheme.modules import QuantLinear
from qscheme.transformers import QSchemeGgufConfig, from_gguf

IDS = torch.tensor([[1, 5, 9, 3, 7]])


def _route(path: Path, **config: object) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, quantization_config=QSchemeGgufConfig(**config), dtype=torch.float32
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_route_keeps_weights_quantized_and_computes_what_from_gguf_does(tmp_path: Path, family: str) -> None:
    path = tmp_path / f"{family}.gguf"
    tiny.write_tiny_gguf(path, family, tiny.uniform("Q4_0"))
    model = _route(path)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert "model.layers.0.self_attn.q_proj" in layers
    assert {layer.weight_canonical.scheme.name for layer in layers.values()} == {"gguf/Q4_0"}
    with torch.no_grad():
        want = from_gguf(path, dtype=torch.float32)(IDS).logits
        got = model(IDS).logits
    assert torch.equal(got, want)
    dense = tiny.dense_model(path)  # the exactly dequantized weights in a plain model
    with torch.no_grad():
        assert float((dense(IDS).logits - got).abs().max()) <= 1e-4


def test_transformers_own_gguf_route_is_unchanged_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    tiny.write_tiny_gguf(path, "llama", tiny.uniform("Q8_0"))
    _route(path)  # enables the route
    own = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    assert not any(isinstance(m, QuantLinear) for m in own.modules())
    with torch.no_grad():
        assert float((own(IDS).logits - tiny.dense_model(path)(IDS).logits).abs().max()) <= 1e-4


def test_a_quantized_embedding_is_dequantized_into_the_embedding(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    tiny.write_tiny_gguf(path, "llama", tiny.uniform("Q8_0"), tie=True)
    model = _route(path, kernel="reference")
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    with torch.no_grad():
        want = from_gguf(path, dtype=torch.float32, kernel="reference")(IDS).logits
        assert torch.equal(model(IDS).logits, want)


def test_a_foreign_gguf_quantizer_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.quantizers import auto
    from transformers.quantizers.base import HfQuantizer

    class Other(HfQuantizer):
        pass

    monkeypatch.setitem(auto.AUTO_QUANTIZER_MAPPING, "gguf", Other)
    with pytest.raises(UsageError, match=r"replaced by .*Other; qscheme adds its route to transformers' own only"):
        QSchemeGgufConfig()
    assert auto.AUTO_QUANTIZER_MAPPING["gguf"] is Other


def test_a_bad_kernel_argument_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="kernel must be a kernel name"):
        QSchemeGgufConfig(kernel=3)  # type: ignore[arg-type]
