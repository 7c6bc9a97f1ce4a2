"""tinygemm runs GGUF's affine 4-bit blocks (Q4_0, Q4_1, Q4_K) within its declared bound.

The blocks' weights are ``scale * u + shift`` per sub-block of 32; tinygemm takes them as
``(u - 8) * bf16(scale) + bf16(8 * scale + shift)``. The declaration's note bounds each weight's
move by ``8 * 2**-8 * |s| + 2**-9 * |zero|`` (plus the reference's own float32 rounding); the
tests check the output against the exactly dequantized weight within that bound, and that the
other GGUF types are rejected with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qscheme_plugins.cpu_gemv_blocks import NativeBlockLoops
from qscheme_plugins.tinygemm import TINYGEMM, TINYGEMM_CPU

from qscheme import cpu_gemv_blocks
from qscheme.catalog import load_scheme
from qscheme.formats.blocks import affine_parts, decode_blocks
from qscheme.kernels import registry
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import SchemeFeatures, check_scheme
from qscheme.modules import QuantLinear

CLAIMED = ["gguf/Q4_0", "gguf/Q4_1", "gguf/Q4_K"]
REJECTED = {
    "gguf/Q8_0": "uint2/uint3/uint4 codes; scheme has int8 codes",
    "gguf/Q5_K": "scheme has uint5 codes",
    "gguf/IQ4_NL": "scheme has table4 codes",
    "gguf/MXFP4": "scheme has e2m1 codes",
    "gguf/Q2_K": "groups of 32/64/128/256; scheme has groups of 16",
    "gguf/Q6_K": "scheme has uint6 codes",
}


def _blocks(name: str, rows: int, k: int, seed: int) -> torch.Tensor:
    layout = load_scheme(name).weight.blocks
    assert layout is not None
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * k // layout.elements, layout.bytes), dtype=np.uint8)
    for field in layout.fields:
        if field.format == "fp16":
            values = (rng.standard_normal(raw.shape[0] * field.count) * 0.01).astype(np.float16)
            raw[:, field.offset : field.offset + field.size] = values.view(np.uint8).reshape(raw.shape[0], -1)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("declaration", [TINYGEMM, TINYGEMM_CPU], ids=["tinygemm", "tinygemm_cpu"])
def test_the_declarations_claim_the_affine_4_bit_blocks_with_groups_of_32(declaration: KernelDeclaration) -> None:
    for name in CLAIMED:
        assert check_scheme(declaration, SchemeFeatures.of(load_scheme(name)))[0], name
    for name, reason in REJECTED.items():
        supports, why = check_scheme(declaration, SchemeFeatures.of(load_scheme(name)))
        assert not supports and reason in why, (name, why)


@pytest.mark.parametrize("name", CLAIMED)
@pytest.mark.parametrize("bf16_loop", [True, False])
def test_the_cpu_picks_tinygemm_cpu_for_bfloat16(name: str, bf16_loop: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless the CPU runs cpu_gemv_blocks' AVX512-BF16 loop (its check's answer set either way here):
    then cpu_gemv_blocks_bf16 (62) ranks above it."""
    monkeypatch.setattr(cpu_gemv_blocks, "bf16_loop_available", lambda: bf16_loop)
    scheme = load_scheme(name)
    built = NativeBlockLoops().check(Problem(4096, 4096)).ok
    registry.reset()  # resolutions are memoised per process: forget them before and after
    try:
        bf16 = registry.resolve_layer(scheme, Problem(4096, 4096, "bfloat16"), device="cpu", environ={}).kernel
        fp32 = registry.resolve_layer(scheme, Problem(4096, 4096, "float32"), device="cpu", environ={}).kernel
    finally:
        registry.reset()
    assert bf16 is not None and bf16.name == ("cpu_gemv_blocks_bf16" if bf16_loop and built else "tinygemm_cpu")
    # float32 inputs (tinygemm takes 16-bit ones): cpu_gemv_blocks where its loops are built
    assert fp32 is not None and fp32.name == ("cpu_gemv_blocks" if built else "reference")


@pytest.mark.parametrize("name", CLAIMED)
@pytest.mark.parametrize(("n", "k"), [(48, 512), (19, 256)])
def test_tinygemm_cpu_output_is_within_the_declared_bound(name: str, n: int, k: int) -> None:
    raw = _blocks(name, n, k, 3)
    layout = load_scheme(name).weight.blocks
    assert layout is not None
    layer = QuantLinear.from_tensors(
        name, {"weight": raw.clone()}, activation_dtype=torch.bfloat16, kernel="tinygemm_cpu"
    )
    assert layer.kernel.name == "tinygemm_cpu"
    x = torch.randn(5, k).to(torch.bfloat16)
    exact = decode_blocks(raw, layout)
    _, scale, shift = affine_parts(raw, layout)
    zero = 8 * scale.double() + shift
    per_weight = (8 * 2.0**-8 * scale.abs().double() + 2.0**-9 * zero.abs()).repeat_interleave(32, dim=1)
    bound = x.double().abs() @ (per_weight + 2.0**-24 * exact.abs().double()).t()
    want = x.double() @ exact.double().t()
    got = layer(x).double()
    # plus the output's own bfloat16 rounding
    assert bool(((got - want).abs() <= bound + 2.0**-8 * want.abs() + 1e-6).all())
    assert not torch.equal(got, torch.zeros_like(got))
