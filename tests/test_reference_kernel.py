"""The reference kernel: dequantize-then-matmul checked in float64 for every built-in scheme, and
its activation emulation bit-identical to compressed-tensors' fake quantization."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from kernel_fakes import builtin_scheme, builtin_schemes, layer_tensors
from qscheme_plugins.reference import REFERENCE
from qscheme_plugins.reference_kernel import ReferenceKernel

from qscheme.canonical import CanonicalWeight, canonicalize, dequantize
from qscheme.checkpoint.fuse import concatenate
from qscheme.emulation import fake_quantize_activation
from qscheme.kernels.resolver import SchemeFeatures, check_scheme

CPU = torch.device("cpu")
SCHEME_NAMES = [scheme.name for scheme in builtin_schemes()]
# Built-in schemes no built-in kernel implements (NVFP4 weights with FP8 inputs): see test_resolver.
UNIMPLEMENTED = {"modelopt/W4A8_NVFP4_FP8"}


def expected_output(weight: CanonicalWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize-then-matmul in float64 (the input quantized by the scheme's emulation first)."""
    values = x.to(torch.float32)
    if weight.input_pre_scale is not None:
        values = values * weight.input_pre_scale.to(torch.float32)
    activation = weight.scheme.activation
    if activation is not None:
        values = fake_quantize_activation(
            values,
            activation,
            input_scale=weight.input_scale,
            input_global_scale=weight.input_global_scale,
        )
    y = values.double() @ dequantize(weight).double().t()
    return y if bias is None else y + bias.double()


def test_the_reference_declaration_covers_every_builtin_scheme_but_nvfp4_with_fp8() -> None:
    uncovered = {
        name for name in SCHEME_NAMES if not check_scheme(REFERENCE, SchemeFeatures.of(builtin_scheme(name)))[0]
    }
    assert uncovered == UNIMPLEMENTED


@pytest.mark.parametrize("scheme_name", sorted(set(SCHEME_NAMES) - UNIMPLEMENTED))
def test_matches_dequantize_then_matmul_in_float64(scheme_name: str) -> None:
    scheme = builtin_scheme(scheme_name)
    weight = canonicalize(scheme, layer_tensors(scheme))
    kernel = ReferenceKernel()
    state = kernel.prepare(weight, CPU)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, weight.k, generator=generator) * 2
    bias = torch.randn(weight.n, generator=generator)
    y = kernel.apply(state, x, bias)
    assert y.shape == (2, 3, weight.n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected_output(weight, x, bias), rtol=1e-5, atol=1e-5)
    y16 = kernel.apply(state, x.to(torch.bfloat16), None)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.double(), expected_output(weight, x.to(torch.bfloat16), None), rtol=1e-2, atol=1e-2)


def test_a_fused_w4a4_layer_quantizes_its_input_once_per_partition_scale() -> None:
    scheme = builtin_scheme("modelopt/NVFP4")
    members = [
        canonicalize(scheme, layer_tensors(scheme, n=32, k=128, seed=s, input_amax=a))
        for s, a in [(0, 4.0), (1, 9.0), (2, 4.0)]
    ]
    fused = concatenate(members)
    assert fused.partitions == (32, 32, 32)
    kernel = ReferenceKernel()
    fused_state = kernel.prepare(fused, CPU)
    assert [(s.start, s.stop) for s in fused_state.scalings] == [(0, 32), (32, 64), (64, 96)]
    x = torch.randn(5, 128) * 3
    separate = torch.cat([kernel.apply(kernel.prepare(m, CPU), x, None) for m in members], dim=-1)
    torch.testing.assert_close(kernel.apply(fused_state, x, None), separate, rtol=0, atol=1e-6)
    # Quantizing the shared input once with the first partition's scale would be wrong:
    shared = kernel.prepare(concatenate([members[0], members[0]]), CPU)
    assert len(shared.scalings) == 1


# --- bit-identity with compressed-tensors' fake quantization ---------------------------------------

CT_PRESETS = {
    "compressed-tensors/FP8": "FP8",
    "compressed-tensors/FP8_DYNAMIC": "FP8_DYNAMIC",
    "compressed-tensors/FP8_BLOCK": "FP8_BLOCK",
    "compressed-tensors/W8A8": "W8A8",
    "compressed-tensors/MXFP4": "MXFP4",
    "compressed-tensors/NVFP4": "NVFP4",
}


class _Module(torch.nn.Module):
    """What compressed-tensors' forward_quantize reads of a module: its status, static input scales."""

    def __init__(self) -> None:
        super().__init__()
        from compressed_tensors.quantization import QuantizationStatus

        self.quantization_status = QuantizationStatus.FROZEN


@pytest.mark.parametrize("scheme_name", sorted(CT_PRESETS))
def test_activation_emulation_is_bit_identical_to_compressed_tensors(scheme_name: str) -> None:
    scheme = builtin_scheme(scheme_name)
    # compressed-tensors stores NVFP4's input global scale as a divisor (2688 / amax) and rounds
    # with it; CanonicalWeight carries that divisor, so a non-power-of-two amax must agree too.
    amax = 5.37
    weight = canonicalize(scheme, layer_tensors(scheme, n=32, k=256, input_amax=amax))
    kernel = ReferenceKernel()
    state = kernel.prepare(weight, CPU)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4, 256, generator=generator)  # 3-D: compressed-tensors is per token only in 3-D
    x[0, 0, :32] = 0.0  # an all-zero group / token
    ((_, ours),) = kernel.quantize_input(state, x)

    args = preset_name_to_scheme(CT_PRESETS[scheme_name], ["Linear"]).input_activations
    module = _Module()
    if weight.input_scale is not None:
        module.input_scale = torch.nn.Parameter(weight.input_scale.clone(), requires_grad=False)
    if weight.input_global_scale is not None:
        divisor = weight.input_global_scale_divisor
        stored = divisor if divisor is not None else torch.reciprocal(weight.input_global_scale)
        module.input_global_scale = torch.nn.Parameter(stored.clone(), requires_grad=False)
    theirs = forward_quantize(module, x.clone(), "input", args)
    assert torch.equal(ours, theirs)
