"""torch.compile(fullgraph=True) of a loaded tiny Llama: no graph break, the eager logits, no
manual prepare(); on CPU with the reference kernel and with the Triton kernel interpreted.

The backend is ``aot_eager`` (dynamo, fake tensors through the ops' fake implementations,
AOTAutograd's joint graph; no code generation), which keeps the file fast on CPU. One slow test
runs inductor, which compiles C++ for the rest of the model.
"""

from __future__ import annotations

import os

import pytest
import torch
from checkpoint_cache import ct_checkpoint, single_threaded_torch  # noqa: F401
from checkpoint_factory import build_model

from qscheme.checkpoint.model import apply_to_model
from qscheme.modules import QuantLinear

TOKENS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(11))


def _loaded(kernel: str, preset: str = "NVFP4A16") -> torch.nn.Module:
    model = build_model()
    apply_to_model(model, ct_checkpoint(preset), kernel=kernel)
    layers = [module for module in model.modules() if isinstance(module, QuantLinear)]
    assert len(layers) == 7 and not any(layer.prepared for layer in layers)
    return model


def _skip_without_triton(kernel: str) -> None:
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize(
    ("kernel", "preset"),
    [
        ("reference", "NVFP4A16"),
        ("reference", "W4A16"),
        pytest.param("triton", "NVFP4A16", marks=pytest.mark.interpreter),
    ],
)
def test_fullgraph_compile_of_a_loaded_llama_has_no_graph_break_and_gives_the_eager_logits(
    kernel: str, preset: str
) -> None:
    _skip_without_triton(kernel)
    with torch.no_grad():
        expected = _loaded(kernel, preset)(TOKENS).logits
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_loaded(kernel, preset))(TOKENS)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(_loaded(kernel, preset), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        logits = compiled(TOKENS).logits
    assert torch.equal(logits, expected)


def test_a_compiled_model_trains_the_unquantized_parameters_through_the_quantized_layers() -> None:
    eager, compiled_model = _loaded("reference"), _loaded("reference")
    eager(TOKENS).logits.square().mean().backward()
    torch._dynamo.reset()
    torch.compile(compiled_model, fullgraph=True, backend="aot_eager")(TOKENS).logits.square().mean().backward()
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        expected = eager.get_parameter(name).grad
        assert expected is not None and bool(expected.abs().sum() > 0)
        torch.testing.assert_close(compiled_model.get_parameter(name).grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_inductor_compiles_a_loaded_llama_whole() -> None:
    with torch.no_grad():
        expected = _loaded("reference")(TOKENS).logits
        torch._dynamo.reset()
        logits = torch.compile(_loaded("reference"), fullgraph=True, backend="inductor")(TOKENS).logits
    # inductor fuses the unquantized ops (norms, rotary, softmax): float32 summation order only
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
