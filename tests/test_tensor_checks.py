"""qscheme.tensor_checks: layout and value checks of one module against its scheme."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_cache import single_threaded_torch  # noqa: F401  (autouse)

from qscheme.catalog import load_scheme
from qscheme.checkpoint.detect import ModuleAssignment
from qscheme.storage import TensorInfo
from qscheme.tensor_checks import TensorProblem, check_layout, check_values

FILE = Path("model.safetensors")


def _assignment(scheme_name: str, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> ModuleAssignment:
    infos = {short: TensorInfo(f"m.{short}", dtype, shape, FILE) for short, (dtype, shape) in tensors.items()}
    return ModuleAssignment("m", load_scheme(scheme_name), "test", infos)


AWQ = {
    "weight": ("uint8", (64, 256)),
    "weight_scale": ("float32", (128, 2)),
}


def test_a_valid_layout_has_no_problems_and_infers_n_k() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", AWQ))
    assert layout.ok and (layout.n, layout.k) == (128, 256)
    assert set(layout.declared) == {"weight", "weight_scale"}  # the optional pre_quant_scale may be absent


def test_optional_tensor_shape_is_still_checked() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", {**AWQ, "pre_quant_scale": ("float32", (128,))}))
    (problem,) = layout.problems
    assert str(problem) == (
        "model.safetensors: tensor 'm.pre_quant_scale': expected shape [K] = [256] for N=128, K=256 from "
        "weight [64, 256], found [128]"
    )


def test_bias_is_allowed_but_shape_checked() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", {**AWQ, "bias": ("float32", (128,))}))
    assert layout.ok and layout.bias is not None
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", {**AWQ, "bias": ("float32", (64,))}))
    assert "expected bias shape [128]" in str(layout.problems[0])


def test_missing_weight_and_indivisible_shapes() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", {"weight_scale": ("float32", (128, 2))}))
    assert "missing: scheme modelopt/W4A16_AWQ stores the weight as 'weight'" in str(layout.problems[0])
    odd = check_layout(
        _assignment("modelopt/W4A16_AWQ", {"weight": ("uint8", (64, 100)), "weight_scale": ("float32", (128, 1))})
    )
    assert "shape [N, K/128] does not divide for N=128, K=100" in str(odd.problems[0])


def test_weight_shape_tensor_gives_n_and_k() -> None:
    tensors = {
        "weight_packed": ("int32", (128, 17)),
        "weight_scale": ("float32", (128, 2)),
        "weight_shape": ("int64", (2,)),
    }
    layout = check_layout(_assignment("compressed-tensors/W4A16", tensors), weight_shape=(128, 130))
    assert layout.ok and (layout.n, layout.k) == (128, 130)


def test_value_checks_on_a_layout() -> None:
    tensors = {
        "weight": ("float8_e4m3fn", (64, 128)),
        "weight_scale": ("float32", ()),
        "input_scale": ("float32", ()),
    }
    layout = check_layout(_assignment("modelopt/FP8", tensors))
    assert layout.ok
    good = {"weight_scale": torch.tensor(0.01), "input_scale": torch.tensor(0.02)}
    assert check_values(layout, good) == []
    bad = {"weight_scale": torch.tensor(float("nan")), "input_scale": torch.tensor(-1.0)}
    messages = sorted(str(p) for p in check_values(layout, bad))
    assert messages == [
        "model.safetensors: tensor 'm.input_scale': expected a finite scale > 0, found -1.0; a zero, negative or "
        "non-finite global or static scale cannot be dequantized: re-export the layer",
        "model.safetensors: tensor 'm.weight_scale': expected finite scales, found 1 NaN/inf value (first: nan)",
    ]


NVFP4 = {
    "weight_packed": ("uint8", (64, 64)),
    "weight_scale": ("float8_e4m3fn", (64, 8)),
    "weight_global_scale": ("float32", (1,)),
    "input_global_scale": ("float32", (1,)),
}


def _nvfp4_values() -> dict[str, torch.Tensor]:
    return {
        "weight_scale": torch.full((64, 8), 2.0).to(torch.float8_e4m3fn),
        "weight_global_scale": torch.tensor([100.0]),
        "input_global_scale": torch.tensor([50.0]),
    }


def test_negative_group_scales_are_a_value_problem() -> None:
    layout = check_layout(_assignment("compressed-tensors/NVFP4", NVFP4))
    assert layout.ok
    values = _nvfp4_values()
    zero = values["weight_scale"].view(torch.uint8).clone()
    zero[0, 0] = 0x00  # an all-zero group: scale 0 is fine
    zero[0, 1] = 0x80  # -0.0 is zero too
    assert check_values(layout, {**values, "weight_scale": zero.view(torch.float8_e4m3fn)}) == []
    negative = values["weight_scale"].to(torch.float32)
    negative[2, 3] = -4.0
    negative[5, 0] = -1.0
    (problem,) = check_values(layout, {**values, "weight_scale": negative.to(torch.float8_e4m3fn)})
    assert str(problem) == (
        "model.safetensors: tensor 'm.weight_scale': expected weight scales >= 0, found 2 negative values "
        "(first: -4.0 at [2, 3]); producers store scale magnitudes, so the file is corrupt: re-export the layer"
    )


def test_negative_float_group_scales_are_a_value_problem() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", AWQ))
    scale = torch.full((128, 2), 0.01)
    assert check_values(layout, {"weight_scale": scale}) == []
    scale[7, 1] = -0.01
    (problem,) = check_values(layout, {"weight_scale": scale})
    assert "expected weight scales >= 0, found 1 negative value (first: -0.0099" in str(problem)


def test_a_bias_that_is_not_a_float_is_a_dtype_problem() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", {**AWQ, "bias": ("int32", (128,))}))
    (problem,) = layout.problems
    assert str(problem).startswith("model.safetensors: tensor 'm.bias': expected a float bias (bfloat16 or float16")
    assert "found int32" in str(problem)


def test_a_non_finite_bias_is_a_value_problem() -> None:
    layout = check_layout(_assignment("modelopt/W4A16_AWQ", {**AWQ, "bias": ("bfloat16", (128,))}))
    scale = torch.full((128, 2), 0.01)
    bias = torch.zeros(128, dtype=torch.bfloat16)
    assert check_values(layout, {"weight_scale": scale, "bias": bias}) == []
    bias[9] = float("inf")
    (problem,) = check_values(layout, {"weight_scale": scale, "bias": bias})
    assert str(problem).startswith(
        "model.safetensors: tensor 'm.bias': expected a finite bias, found 1 NaN/inf value (first: inf at [9])"
    )


@pytest.mark.parametrize(
    ("scheme", "tensors", "extra", "said"),
    [
        (
            "compressed-tensors/W4A16",
            {
                "weight_packed": ("int32", (64, 32)),
                "weight_scale": ("bfloat16", (64, 2)),
                "weight_shape": ("int64", (2,)),
            },
            ("weight_g_idx", ("int32", (256,))),
            "GPTQ activation ordering by group (actorder: group)",
        ),
        (
            "modelopt/FP8",
            {"weight": ("float8_e4m3fn", (64, 256)), "weight_scale": ("float32", ()), "input_scale": ("float32", ())},
            ("pre_quant_scale", ("bfloat16", (256,))),
            "an AWQ input pre-scale, which this scheme does not take",
        ),
    ],
)
def test_tensors_of_unsupported_producer_features_say_why(
    scheme: str,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    extra: tuple[str, tuple[str, tuple[int, ...]]],
    said: str,
) -> None:
    shape = (64, 256) if "weight_shape" in tensors else None
    layout = check_layout(_assignment(scheme, {**tensors, extra[0]: extra[1]}), weight_shape=shape)
    messages = [problem.message for problem in layout.problems]
    assert len(messages) == 1 and messages[0].startswith(f"unexpected for scheme {scheme} (test)"), messages
    assert said in messages[0] and "re-export" in messages[0]


def test_a_tensor_problem_escapes_the_checkpoint_file_name() -> None:
    """A file name is the checkpoint's choice: a newline in it must not start a line of its own."""
    shown = str(TensorProblem("/ckpt/a\nproblems: none\x1b[2J.safetensors", "w", "bad value"))
    assert "\n" not in shown and "\x1b" not in shown
    assert shown == "/ckpt/a\\nproblems: none\\x1b[2J.safetensors: tensor 'w': bad value"
