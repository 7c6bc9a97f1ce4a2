"""Static activation scales whose multiplier cannot quantize activations (qscheme.scale_checks).

Each scale is finite, yet the layer would quantize every activation to zero (an overflowing
multiplier), to NaN, or flush small ones to zero: canonicalize, and so QuantLinear.from_tensors,
dequantize_weight and load_checkpoint, refuse them as they refuse weight scales.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    copy_checkpoint,
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file, save_file

from qscheme.canonical import canonicalize
from qscheme.catalog import load_scheme
from qscheme.checkpoint import load_checkpoint
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, QuantizeError
from qscheme.modules import QuantLinear
from qscheme.quantize import quantize_weight

LAYER = "model.layers.0.self_attn.q_proj"
FP8_FIX = (
    "scheme modelopt/FP8 reads 'input_scale' as a multiplier: if the file stores the other convention, use a scheme "
    "that declares it; else the activation calibration is corrupt: recalibrate and re-export the layer"
)


@functools.cache
def _builtin(name: str) -> Scheme:
    return load_scheme(name)


def _tensors(name: str, value: float) -> dict[str, torch.Tensor]:
    """A layer of ``name`` whose static activation scale (as the file stores it) is ``value``."""
    scheme = _builtin(name)
    activation = scheme.activation
    assert activation is not None
    spec = activation.scale or activation.global_scale
    assert spec is not None
    key = spec.tensor.name
    tensors = quantize_weight(
        torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), scheme, **{key: torch.tensor([1.0])}
    )
    tensors[key] = torch.tensor(value).reshape(tensors[key].shape)
    return tensors


def _refusal(name: str, value: float) -> str:
    with pytest.raises(QuantizeError) as info:
        canonicalize(_builtin(name), _tensors(name, value), layer=LAYER)
    return str(info.value)


def test_an_fp8_input_scale_whose_product_with_the_largest_element_overflows_is_refused() -> None:
    # 3e38 is finite, but x / 3e38 quantizes every activation to zero and 448 x 3e38 is inf
    assert _refusal("modelopt/FP8", 3e38) == (
        f"layer {LAYER}, scheme modelopt/FP8: activation scale 'input_scale' holds the multiplier 3e+38 (1 of 1 "
        "value): the multiplier times the largest element (448) overflows float32: activations would quantize to "
        "zero or to inf; allowed: a multiplier from 6.01853e-36 to 7.59559e+35 (normal, x 448 finite, x 0.00195312 "
        f"normal in float32); {FP8_FIX}"
    )


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        # ModelOpt NVFP4: input_scale is the global multiplier of e4m3 block scales x e2m1 elements
        ("modelopt/NVFP4", 3e38, "times the largest block scale (448) x the largest element (6) overflows float32"),
        (
            "modelopt/NVFP4",
            1e-44,
            "is not a finite, normal float32 > 0",
        ),  # subnormal, as a weight multiplier is refused
        (
            "modelopt/NVFP4",
            1e-36,
            "times the smallest block scale (0.00195312) x the smallest nonzero element (0.5) is "
            "below float32's smallest normal",
        ),
        # compressed-tensors stores the divisor: 1e-37 is the multiplier 1e37, 3e38 a subnormal one
        ("compressed-tensors/NVFP4", 1e-37, "times the largest block scale (448) x the largest element (6) overflows"),
        ("compressed-tensors/NVFP4", 3e38, "is not a finite, normal float32 > 0"),
        ("modelopt/FP8", 1e-44, "is not a finite, normal float32 > 0"),
        ("modelopt/FP8", 1e-37, "times the smallest nonzero element (0.00195312) is below float32's smallest normal"),
        ("modelopt/W4A8_NVFP4_FP8", 3e38, "times the largest element (448) overflows float32"),
    ],
)
def test_an_unusable_static_activation_multiplier_is_refused(name: str, value: float, problem: str) -> None:
    message = _refusal(name, value)
    assert message.startswith(f"layer {LAYER}, scheme {name}: activation scale ")
    assert f"(1 of 1 value): the multiplier {problem}" in message
    assert "; allowed: a multiplier from " in message and "recalibrate and re-export the layer" in message


@pytest.mark.parametrize(
    ("name", "inside", "outside"),
    [
        ("modelopt/FP8", (6.1e-36, 7.5e35), (5.9e-36, 7.7e35)),
        ("modelopt/NVFP4", (1.21e-35, 1.26e35), (1.19e-35, 1.27e35)),
        ("compressed-tensors/NVFP4", (1 / 1.26e35, 1 / 1.21e-35), (1 / 1.27e35, 1 / 1.19e-35)),
    ],
)
def test_the_allowed_range_of_a_static_activation_multiplier_is_exactly_what_the_message_says(
    name: str, inside: tuple[float, float], outside: tuple[float, float]
) -> None:
    for value in inside:
        layer = canonicalize(_builtin(name), _tensors(name, value))
        assert layer.input_scale is not None or layer.input_global_scale is not None
    for value in outside:
        _refusal(name, value)


def test_from_tensors_refuses_what_would_output_all_zeros() -> None:
    with pytest.raises(QuantizeError, match="activation scale 'input_scale' holds the multiplier 3e\\+38"):
        QuantLinear.from_tensors("modelopt/FP8", _tensors("modelopt/FP8", 3e38), layer_name=LAYER)
    layer = QuantLinear.from_tensors("modelopt/FP8", _tensors("modelopt/FP8", 1.0), layer_name=LAYER)
    assert bool((layer(torch.randn(2, 64)) != 0).any())


def _rewrite(folder: Path, key: str, value: torch.Tensor) -> None:
    path = folder / "model.safetensors"
    tensors = {name: tensor.clone() for name, tensor in load_file(str(path)).items()}
    tensors[key] = value.to(tensors[key].dtype).reshape(tensors[key].shape)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("source", "key", "value", "found"),
    [
        ("nvfp4", "input_scale", 3e38, "'input_scale' holds the multiplier 3e+38"),
        ("nvfp4", "input_scale", 1e-44, "'input_scale' holds the multiplier 9.80909e-45"),
        ("fp8", "input_scale", 3e38, "'input_scale' holds the multiplier 3e+38"),
        ("ct:NVFP4", "input_global_scale", 1e-37, "'input_global_scale' holds the divisor 1e-37"),
    ],
)
def test_load_checkpoint_refuses_an_unusable_activation_multiplier(
    source: str, key: str, value: float, found: str, tmp_path: Path
) -> None:
    original = ct_checkpoint(source[3:]) if source.startswith("ct:") else modelopt_fixture(source)
    folder = copy_checkpoint(original, tmp_path / "checkpoint")
    _rewrite(folder, f"{LAYER}.{key}", torch.tensor(value))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, kernel="reference")
    message = str(info.value)
    assert "nothing was loaded" in message
    assert f"layer {LAYER}, scheme " in message and f"activation scale {found}" in message
