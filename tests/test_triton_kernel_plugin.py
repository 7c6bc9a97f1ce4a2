"""The ``triton`` kernel as a plugin: its implementation class, the resolver choosing it on a CPU
under the interpreter, and QuantLinear running checkpoint tensors (as quantize_weight writes
them) through it against the reference kernel."""

from __future__ import annotations

import pytest
import torch
from qscheme_plugins.reference_kernel import ReferenceKernel
from qscheme_plugins.triton_declaration import TRITON
from qscheme_plugins.triton_kernel import TritonKernel
from triton_samples import assert_matches

from qscheme.canonical import canonicalize
from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme
from qscheme.kernels.interface import KernelImplementation
from qscheme.kernels.registry import load_implementation
from qscheme.modules import QuantLinear
from qscheme.quantize import quantize_weight
from qscheme.triton.spec import unsupported_reason

BUILTIN = [s for s in load_catalog(include_plugins=False) if s.weight.blocks is None]  # blocks: not Triton's


def test_the_declaration_names_this_implementation() -> None:
    assert TRITON.implementation == "qscheme_plugins.triton_kernel:TritonKernel"
    implementation = load_implementation(TRITON)
    assert isinstance(implementation, TritonKernel)
    assert isinstance(implementation, KernelImplementation)


@pytest.mark.parametrize("scheme", BUILTIN, ids=[s.name for s in BUILTIN])
def test_every_builtin_scheme_is_supported(scheme: Scheme) -> None:
    assert unsupported_reason(scheme) is None


def _static_inputs(scheme: Scheme, amax: float) -> dict[str, torch.Tensor]:
    """Calibrated activation scales, stored the way the scheme declares them."""
    activation = scheme.activation
    if activation is None:
        return {}
    given = {}
    if activation.scale is not None:
        multiplier = amax / 448.0
        value = multiplier if activation.scale.stored == "multiplier" else 1 / multiplier
        given[activation.scale.tensor.name] = torch.tensor([value])
    if activation.global_scale is not None:
        multiplier = amax / 2688.0
        value = multiplier if activation.global_scale.stored == "multiplier" else 1 / multiplier
        given[activation.global_scale.tensor.name] = torch.tensor([value])
    if scheme.input_pre_scale is not None:
        given[scheme.input_pre_scale.name] = torch.rand(256, generator=torch.Generator().manual_seed(2)) + 0.5
    return given


@pytest.mark.parametrize("scheme", BUILTIN, ids=[s.name for s in BUILTIN])
def test_checkpoint_tensors_through_the_kernel_match_the_reference(scheme: Scheme) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(160, 256, generator=generator) * 0.05
    tensors = quantize_weight(weight, scheme, **_static_inputs(scheme, amax=4.0))
    canonical = canonicalize(scheme, tensors)
    x = torch.randn(3, 256, generator=generator)
    bias = torch.randn(160, generator=generator)
    triton_kernel, reference = TritonKernel(), ReferenceKernel()
    actual = triton_kernel.apply(triton_kernel.prepare(canonical, torch.device("cpu")), x, bias)
    expected = reference.apply(reference.prepare(canonical, torch.device("cpu")), x, bias)
    assert_matches(actual, expected.double(), torch.float32, scheme.name)


def test_quant_linear_runs_the_triton_kernel_on_a_cpu_under_the_interpreter() -> None:
    scheme = load_catalog(include_plugins=False).get("compressed-tensors/NVFP4")
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    tensors = quantize_weight(weight, scheme, **_static_inputs(scheme, amax=4.0))
    layer = QuantLinear.from_tensors(scheme, tensors, kernel="triton", activation_dtype="bfloat16")
    assert layer.kernel.name == "triton"
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(canonicalize(scheme, tensors), torch.device("cpu")), x, None)
    assert_matches(layer(x), expected.double(), torch.bfloat16, "QuantLinear")


@pytest.mark.parametrize("file", ["fp4_g64_fp16_nvfp4_input.yaml", "uint8_channel_e4m3_int8_token.yaml"])
def test_the_repo_yaml_only_triton_schemes_run_through_quant_linear(file: str) -> None:
    """e2m1 weights with float group-64 scales under NVFP4 inputs, and uint8 weights with zero
    points under int8 per-token inputs: the declaration takes them, and the kernel the resolver
    picks agrees with the reference kernel."""
    from pathlib import Path

    from qscheme.descriptor import parse_scheme_file

    scheme = parse_scheme_file(Path(__file__).parent / "data" / "triton_schemes" / file)
    # (a weight of absmax ~4: compressed-tensors' e4m3 channel scales (max - min) / 255 stay normal)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    given = _static_inputs(scheme, amax=4.0)
    if scheme.weight.global_scale is not None:  # float group scales: the rules compute no global scale
        given[scheme.weight.global_scale.tensor.name] = torch.tensor([0.5])
    tensors = quantize_weight(weight, scheme, **given)
    layer = QuantLinear.from_tensors(scheme, tensors, kernel="triton", activation_dtype="float32")
    assert layer.kernel.name == "triton"
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    reference = ReferenceKernel()
    expected = reference.apply(reference.prepare(canonicalize(scheme, tensors), torch.device("cpu")), x, None)
    assert_matches(layer(x), expected.double(), torch.float32, "QuantLinear")
    exact = x.double() @ weight.double().T
    # W4A4 with FP4 inputs: ~15% of the largest output; wrapped zero points would be off by 100s of %
    assert float((expected.double() - exact).abs().max()) < 0.3 * float(exact.abs().max())


def test_a_scheme_without_a_pre_pass_is_refused_with_the_reason() -> None:
    from qscheme.descriptor import parse_scheme_text
    from qscheme.errors import QuantizeError
    from qscheme.triton.spec import specialize

    scheme = parse_scheme_text(
        """
name: test/FP8_DYNAMIC_PER_TENSOR
weight:
  format: e4m3
  tensor: {name: weight, dtype: float8_e4m3fn, shape: [N, K]}
  scale:
    granularity: tensor
    format: float
    stored: multiplier
    tensor: {name: weight_scale, dtype: float32, shape: [1]}
activation: {format: e4m3, granularity: tensor, dynamic: true}
"""
    )
    assert unsupported_reason(scheme) is not None
    with pytest.raises(QuantizeError, match=r"activation quantization e4m3 per tensor \(dynamic, float scale\) has no"):
        specialize(scheme)
