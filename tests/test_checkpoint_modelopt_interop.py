"""ModelOpt interop: checkpoints exported by nvidia-modelopt itself (tests/fixtures/modelopt/).

Each fixture's reference.safetensors holds ModelOpt's own float32 dequantization of every
quantized linear (its NVFP4QTensor / FP8QTensor / MXFP4QTensor), the fixed input and, where
ModelOpt can run on a CPU, its fake-quantized outputs. ModelOpt has no int4 unpacker, so for
W4A16_AWQ the weights are compared exactly with an independent unpacking (q x scale) and with
ModelOpt's fake-quantized weight up to its own float32 rounding (<= 2 ulp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file, save_file

from qscheme.canonical import dequantize
from qscheme.checkpoint import load_checkpoint
from qscheme.checkpoint.load import load_canonical
from qscheme.checkpoint.plan import plan_checkpoint
from qscheme.errors import NoKernelError

EXACT = ["nvfp4", "w4a16_nvfp4", "fp8", "fp8_pb_wo", "mxfp4", "nvfp4_exclude"]
OUTPUT_TOLERANCE = 1e-6  # relative to max |output|: float32 summation order only


def _reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(modelopt_fixture(name) / "reference.safetensors"))


@pytest.mark.parametrize("fixture", EXACT)
def test_dequantized_weights_equal_modelopts_own(fixture: str) -> None:
    checkpoint = load_checkpoint(modelopt_fixture(fixture), kernel="reference")
    reference = _reference(fixture)
    assert len(checkpoint) >= 6
    for name, layer in checkpoint.items():
        assert torch.equal(layer.dequantize(), reference[name]), name


@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("fixture", ["fp8", "fp8_pb_wo", "w4a16_awq"])
def test_outputs_match_modelopts_forward(fixture: str, kernel: str) -> None:
    """Each layer's output on ModelOpt's own recorded input, as ModelOpt's forward gave it, on
    the reference kernel and on the Triton kernel (interpreted on the CPU: float32 dot)."""
    from qscheme.triton.linear import interpreted

    if kernel == "triton" and not interpreted():
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    checkpoint = load_checkpoint(modelopt_fixture(fixture), kernel=kernel, activation_dtype="float32")
    reference = _reference(fixture)
    tolerance = OUTPUT_TOLERANCE if kernel == "reference" else 1e-5  # the GEMM's own summation order
    for name, layer in checkpoint.items():
        assert layer.kernel.name == kernel
        expected = reference[f"{name}.output_export"]
        error = float((layer(reference[f"{name}.input"]) - expected).abs().max())
        assert error <= tolerance * float(expected.abs().max()), (name, error)


def _unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt int4: two output rows per byte, row 2i in the low nibble, signed."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    rows = torch.stack([low, high], dim=1).reshape(packed.shape[0] * 2, packed.shape[1])
    return torch.where(rows > 7, rows - 16, rows).to(torch.float32)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in float32 units in the last place (+0 and -0 are equal)."""
    different = a != b
    if not bool(different.any()):
        return 0
    ia, ib = a[different].view(torch.int32).to(torch.int64), b[different].view(torch.int32).to(torch.int64)
    return int((ia - ib).abs().max())


def test_w4a16_awq_weights_and_pre_quant_scale() -> None:
    folder = modelopt_fixture("w4a16_awq")
    checkpoint = load_checkpoint(folder, kernel="reference")
    reference = _reference("w4a16_awq")
    state = load_file(str(folder / "model.safetensors"))
    with_pre_scale = []
    for name, layer in checkpoint.items():
        scale = state[f"{name}.weight_scale"]
        independent = _unpack_int4_rows(state[f"{name}.weight"]) * scale.repeat_interleave(128, dim=1)
        assert torch.equal(layer.dequantize(), independent), name
        fake = reference[f"{name}.fake_quant"]
        assert _ulps(layer.dequantize(), fake) <= 2, name
        if layer.weight_canonical.input_pre_scale is not None:
            with_pre_scale.append(name)
    assert with_pre_scale == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"]


def test_exclude_modules_are_returned_as_plain_tensors() -> None:
    folder = modelopt_fixture("nvfp4_exclude")
    checkpoint = load_checkpoint(folder, kernel="reference")
    assert "model.layers.0.mlp.down_proj" not in checkpoint
    assert not any(name.startswith("model.layers.1.") for name in checkpoint)
    plain = checkpoint.tensors
    assert plain["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert plain["model.layers.0.mlp.down_proj.weight"].shape == (128, 256)
    assert checkpoint.report.ignored["model.layers.1.mlp.up_proj"] == "model.layers.1*"


def test_w4a8_nvfp4_fp8_dequantizes_exactly_whatever_the_kernels() -> None:
    plan = plan_checkpoint(modelopt_fixture("w4a8_nvfp4_fp8"))
    assert plan.detection.scheme_counts() == {"modelopt/W4A8_NVFP4_FP8": 7}
    reference = _reference("w4a8_nvfp4_fp8")
    for name, weight in load_canonical(plan).items():
        assert torch.equal(dequantize(weight), reference[name]), name


def test_a_scheme_no_kernel_can_run_raises_no_kernel_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from qscheme.kernels.registry import declarations

    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", ",".join(d.name for d in declarations()))
    with pytest.raises(NoKernelError) as caught:
        load_checkpoint(modelopt_fixture("w4a8_nvfp4_fp8"))
    message = str(caught.value)
    assert "no kernel can run layer model.layers.0.mlp.down_proj (scheme modelopt/W4A8_NVFP4_FP8" in message


def _divisor_for(multiplier: torch.Tensor) -> torch.Tensor | None:
    """A float32 d with fl(1 / d) == multiplier exactly, if one exists (it usually does)."""
    target = multiplier.reshape(1).to(torch.float32)
    first = torch.reciprocal(target)
    for step in range(-4, 5):
        d = first
        for _ in range(abs(step)):
            d = torch.nextafter(d, torch.tensor([0.0 if step < 0 else float("inf")]))
        if torch.equal(torch.reciprocal(d), target):
            return d
    return None


def _write_ct_nvfp4(folder: Path, tensors: dict[str, torch.Tensor], ignore: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    arguments = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    group = {"targets": ["Linear"], "weights": arguments, "input_activations": {**arguments, "dynamic": "local"}}
    quant = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ignore,
    }
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))


def _write_modelopt_nvfp4(folder: Path, tensors: dict[str, torch.Tensor], exclude: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    section = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude}
    (folder / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": section})
    )


def _assert_identical_canonical(first: Path, second: Path, modules: set[str] | None = None) -> int:
    a, b = load_checkpoint(first, kernel="reference"), load_checkpoint(second, kernel="reference")
    assert list(a) == list(b)
    compared = 0
    for name in a:
        if modules is not None and name not in modules:
            continue
        left, right = a.canonical(name).kernel_tensors(), b.canonical(name).kernel_tensors()
        assert left.keys() == right.keys()
        for key in left:
            assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), (name, key)
        # each side dequantizes as its producer does (s * m vs s / d): equal up to float32 rounding
        assert _ulps(a[name].dequantize(), b[name].dequantize()) <= 2
        compared += 1
    return compared


def test_compressed_tensors_and_modelopt_nvfp4_give_identical_canonical_tensors(tmp_path: Path) -> None:
    """The same NVFP4 weights written both ways: a compressed-tensors checkpoint (written by the
    library) re-expressed with ModelOpt names and multipliers m = fl(1 / d), and a ModelOpt export
    re-expressed with compressed-tensors names and divisors d such that fl(1 / d) = m (modules
    whose multipliers have no such float32 divisor cannot be written identically and are
    skipped; most have one)."""
    from checkpoint_cache import ct_checkpoint

    source = ct_checkpoint("NVFP4")
    as_modelopt: dict[str, torch.Tensor] = {}
    for name, value in load_file(str(source / "model.safetensors")).items():
        module, _, short = name.rpartition(".")
        renamed = {
            "weight_packed": "weight",
            "weight_global_scale": "weight_scale_2",
            "input_global_scale": "input_scale",
        }
        if short in ("weight_global_scale", "input_global_scale"):
            value = torch.reciprocal(value.to(torch.float32)).reshape(())
        as_modelopt[f"{module}.{renamed.get(short, short)}"] = value
    _write_modelopt_nvfp4(tmp_path / "modelopt", as_modelopt, ["lm_head"])
    assert _assert_identical_canonical(source, tmp_path / "modelopt") == 7

    exported = modelopt_fixture("nvfp4")
    as_ct: dict[str, torch.Tensor] = {}
    modules, inexact = set(), set()
    for name, value in load_file(str(exported / "model.safetensors")).items():
        module, _, short = name.rpartition(".")
        modules.add(module)
        if short == "weight" and value.dtype == torch.uint8:
            as_ct[f"{module}.weight_packed"] = value
        elif short in ("weight_scale_2", "input_scale"):
            divisor = _divisor_for(value)
            if divisor is None:
                inexact.add(module)
                divisor = torch.reciprocal(value.reshape(1).to(torch.float32))
            as_ct[f"{module}.{'weight_global_scale' if short == 'weight_scale_2' else 'input_global_scale'}"] = divisor
        else:
            as_ct[name] = value
    _write_ct_nvfp4(tmp_path / "ct", as_ct, ["lm_head", "model.embed_tokens"])
    assert _assert_identical_canonical(exported, tmp_path / "ct", modules - inexact) >= 4
