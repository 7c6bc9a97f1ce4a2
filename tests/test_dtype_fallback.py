"""The warning that a model's dtype sends quantized layers to the reference kernel, from
``apply_to_model``, ``from_pretrained`` and the grouping it names the layers with."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_cache import ct_checkpoint

from qscheme.catalog import load_scheme
from qscheme.checkpoint import apply_to_model
from qscheme.dtype_fallback import KernelFallbackWarning, dtype_fallbacks, grouped_names, warn_dtype_fallbacks
from qscheme.modules import QuantLinear
from qscheme.triton.samples import random_weight

W4A16 = "compressed-tensors/W4A16"


@pytest.fixture(autouse=True)
def _no_interpreted_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests run with TRITON_INTERPRET=1, under which the triton kernel takes float16 and
    float32 layers on a CPU: leave it out, as a CPU without the interpreter does; and cpu_gemv,
    which takes them too, so that these layers fall back to the reference as on a CPU without it."""
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "triton,cpu_gemv")


def _bf16_kernel() -> str:
    """The kernel a bf16 W4A16 layer gets on this machine (skip where it is the reference too)."""
    layer = QuantLinear.from_canonical(random_weight(load_scheme(W4A16), 64, 128))
    kernel = layer.kernel_for("bfloat16").name
    if kernel == "reference":
        pytest.skip("no kernel but the reference runs bf16 W4A16 layers on this CPU")
    return kernel


def _stack(dtype: str, count: int = 3, **options: object) -> torch.nn.Module:
    layers = {
        f"layer{i}": QuantLinear.from_canonical(
            random_weight(load_scheme(W4A16), 64, 128, seed=i),
            activation_dtype=dtype,
            layer_name=f"model.layers.{i}.mlp.up_proj",
            **options,  # type: ignore[arg-type]
        )
        for i in range(count)
    }
    return torch.nn.ModuleDict(layers)


def test_layers_on_the_reference_because_of_their_dtype_are_grouped_with_the_kernel_bf16_gets() -> None:
    kernel = _bf16_kernel()
    model = _stack("float16")
    with pytest.warns(KernelFallbackWarning) as caught:
        fallbacks = warn_dtype_fallbacks(model, "apply_to_model")
    assert len(caught) == 1
    ((fallback,),) = [fallbacks]
    assert (fallback.dtype, fallback.better_kernel, fallback.better_dtype) == ("float16", kernel, "bfloat16")
    assert fallback.layers == tuple(f"model.layers.{i}.mlp.up_proj" for i in range(3))
    message = str(caught[0].message)
    assert message.startswith("apply_to_model: 3 quantized layers run on the slow reference kernel")
    assert "because the model's dtype is float16; bfloat16 inputs would run on " + kernel in message
    assert "Layers: model.layers.*.mlp.up_proj (3)." in message
    assert "dtype=torch.bfloat16" in message


def test_nothing_is_said_for_bf16_layers_forced_kernels_or_schemes_only_the_reference_runs() -> None:
    _bf16_kernel()
    nvfp4 = QuantLinear.from_canonical(random_weight(load_scheme("compressed-tensors/NVFP4A16"), 64, 128), "cpu")
    forced = _stack("float32", kernel="reference")
    assert dtype_fallbacks([*_stack("bfloat16").named_children(), ("nvfp4", nvfp4)]) == []
    assert dtype_fallbacks(list(forced.named_children())) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_dtype_fallbacks(_stack("bfloat16"), "from_pretrained") == []


def test_names_are_grouped_by_pattern_and_bounded() -> None:
    names = [f"model.layers.{i}.{p}" for i in range(30) for p in ("self_attn.q_proj", "mlp.down_proj")]
    names += ["lm_head", *(f"extra{i}.{j}.proj" for i in range(9) for j in range(2))]
    text = grouped_names(names, limit=4)
    assert text == (
        "model.layers.*.self_attn.q_proj (30), model.layers.*.mlp.down_proj (30), lm_head, extra0.*.proj (2) "
        "and 8 more groups"
    )
    assert len(grouped_names([f"m.{i}.p{i}" for i in range(10_000)])) < 200


def _model(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    del config.quantization_config
    return LlamaForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_to_model_warns_once_for_a_float32_model(dtype: torch.dtype) -> None:
    kernel = _bf16_kernel()
    folder = ct_checkpoint("W4A16")
    model = _model(folder, dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_to_model(model, folder)
    told = [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
    if dtype == torch.bfloat16:
        assert told == []
        return
    assert len(told) == 1
    message = str(told[0].message)
    assert message.startswith("apply_to_model: 7 quantized layers run on the slow reference kernel")
    assert f"float32; bfloat16 inputs would run on {kernel}" in message
    assert "model.layers.*.self_attn.q_proj" not in message  # one decoder layer: no index to group
    assert "model.layers.0.self_attn.q_proj" in message and "and 1 more group" in message


def test_from_pretrained_warns_once_for_a_float16_model() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from qscheme.transformers import via_qscheme

    kernel = _bf16_kernel()
    folder = ct_checkpoint("W4A16", num_layers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(folder, config=via_qscheme(folder), dtype=torch.float16)
    told = [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
    assert len(told) == 1
    message = str(told[0].message)
    assert message.startswith("from_pretrained: 14 quantized layers run on the slow reference kernel")
    assert f"float16; bfloat16 inputs would run on {kernel}" in message
    assert "model.layers.*.self_attn.q_proj (2)" in message
