"""``qscheme.int8_gemm`` (the ``qscheme._int8_gemm`` extension): int8 per-token codes and exact sums.

- ``quantize_tokens`` gives ``qscheme.emulation.quantize_activation``'s int8 per-token codes and
  scales bit for bit (bfloat16 and float32 rows, zero rows, ragged K), on every loop this CPU runs;
- ``linear`` gives, bit for bit, ``float(dot) * s_x * s_w (+ bias)`` in float32 with ``dot`` the
  exact integer sum computed here in int64, rounded once to bfloat16 for bfloat16 inputs: over M on
  both sides of the panel path's start (16), ragged N and K (a panel's tail, K past one 4096-column
  chunk), M = 0, 1 and 2 threads, with and without bias, on the portable and the VNNI loops;
- the largest sums (K = MAX_K, every product +-2**14) stay exact;
- the ISA switch, typed refusals, and the op's fake implementation (opcheck, torch.compile).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kernel_fakes import builtin_scheme
from qscheme_plugins import cpu_int8_gemm as declaration

from qscheme import int8_gemm
from qscheme.emulation import quantize_activation
from qscheme.errors import UsageError

pytestmark = pytest.mark.skipif(not int8_gemm.available(), reason="qscheme._int8_gemm is not built")

ACTIVATION = builtin_scheme("compressed-tensors/W8A8").activation
BF16, FP32 = torch.bfloat16, torch.float32


def _isa_param(name: str) -> object:
    runs = int8_gemm.ISA_CHOICES.index(name) <= int8_gemm.ISA_CHOICES.index(int8_gemm.supported_isa())
    return pytest.param(name, marks=pytest.mark.skipif(not runs, reason=f"this CPU does not run {name}"))


@pytest.fixture(params=[_isa_param(name) for name in int8_gemm.ISA_CHOICES])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    before = int8_gemm.isa()
    int8_gemm.set_isa(request.param)
    try:
        yield request.param
    finally:
        int8_gemm.set_isa(before)


def expected_output(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the loops compute, from the emulation's codes and an int64 matmul."""
    quantized = quantize_activation(x.float(), ACTIVATION)
    dot = quantized.codes.long() @ w.long().t()
    assert int(dot.abs().max()) < 2**31 if dot.numel() else True
    y = (dot.float() * quantized.block_scale().reshape(-1, 1)) * scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("k", [1, 3, 64, 100, 4097])
def test_quantize_tokens_gives_the_emulation_s_codes(isa: str, dtype: torch.dtype, k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    x = (torch.randn(7, k, generator=generator) * torch.logspace(-3, 3, 7).reshape(-1, 1)).to(dtype)
    x[2] = 0  # a zero row: float32 eps as its scale
    x[4, 0] = 1e4  # one large element: most codes of that row round to 0
    codes, scales = int8_gemm.quantize_tokens(x)
    expected = quantize_activation(x.float(), ACTIVATION)
    assert torch.equal(codes.to(torch.int16) - 128, expected.codes.to(torch.int16))
    assert torch.equal(scales, expected.block_scale().reshape(-1))
    padded = codes.as_strided((codes.shape[0], codes.stride(0)), (codes.stride(0), 1))
    assert codes.stride(0) % 4 == 0 and bool((padded[:, k:] == 0).all())  # the pad the loops read past K


SHAPES = [(1, 37, 100), (3, 4, 1), (4, 130, 64), (5, 9, 4097), (15, 65, 200), (16, 64, 4096), (17, 70, 4099),
          (40, 130, 9), (33, 3, 8200), (0, 8, 32), (4100, 70, 8)]  # fmt: skip
# (4100 rows: each thread's sums, M x 64, pass the 1 MiB it keeps, and are freed after the call)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_linear_is_the_exact_sum_scaled(isa: str, m: int, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = torch.rand(n, generator=generator) * 0.02 + 1e-4
    layer = int8_gemm.layer_of(w, scale.reshape(n, 1))
    bias = torch.randn(n, generator=generator)
    for dtype in (BF16, FP32):
        x = torch.randn(m, k, generator=generator).to(dtype)
        for threads in (1, 2):
            for b in (None, bias.to(dtype)):
                y = int8_gemm.linear(layer, x, b, threads=threads)
                assert y.dtype == dtype and y.shape == (m, n)
                assert torch.equal(y, expected_output(x, w, scale, b)), (dtype, threads, b is None)


def test_the_largest_sums_stay_exact(isa: str) -> None:
    k = int8_gemm.MAX_K
    w = torch.full((3, k), -128, dtype=torch.int8)
    w[1] = 127
    scale = torch.ones(3)
    layer = int8_gemm.layer_of(w, scale)
    x = torch.ones(2, k, dtype=FP32)
    x[1] = -1  # every code of a row +-127 or -128: each product up to 2**14, the sums near 2**31
    dot = quantize_activation(x, ACTIVATION).codes.long() @ w.long().t()
    assert int(dot.abs().min()) > 2**30
    assert torch.equal(int8_gemm.linear(layer, x), expected_output(x, w, scale, None))
    assert int8_gemm.MAX_K == declaration.MAX_K == int8_gemm.native().max_k()


def test_the_isa_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert int8_gemm.isa() in int8_gemm.ISA_CHOICES
    with pytest.raises(UsageError, match="avx9"):
        int8_gemm.set_isa("avx9")
    monkeypatch.setenv(int8_gemm.ISA_VARIABLE, "scalar")
    assert int8_gemm.isa() == "scalar"
    monkeypatch.setenv(int8_gemm.ISA_VARIABLE, "nonsense")
    with pytest.raises(UsageError, match=int8_gemm.ISA_VARIABLE):
        int8_gemm.isa()
    monkeypatch.delenv(int8_gemm.ISA_VARIABLE)
    int8_gemm.set_isa(int8_gemm.supported_isa())
    assert int8_gemm.isa() == int8_gemm.supported_isa()


def test_refusals_are_typed() -> None:
    w = torch.randint(-128, 128, (8, 32), dtype=torch.int8)
    with pytest.raises(UsageError, match="int8 codes"):
        int8_gemm.layer_of(w.to(torch.int16), torch.ones(8))
    with pytest.raises(UsageError, match="one scale per row"):
        int8_gemm.layer_of(w, torch.ones(4))
    with pytest.raises(UsageError, match=f"K <= {int8_gemm.MAX_K}"):
        int8_gemm.layer_of(torch.zeros(1, int8_gemm.MAX_K + 1, dtype=torch.int8), torch.ones(1))
    layer = int8_gemm.layer_of(w, torch.ones(8))
    with pytest.raises(UsageError, match=r"bfloat16 or float32 x of shape \[M, 32\]"):
        int8_gemm.linear(layer, torch.randn(2, 32).half())
    with pytest.raises(UsageError, match=r"shape \[M, 32\]"):
        int8_gemm.linear(layer, torch.randn(2, 16))
    with pytest.raises(UsageError, match="bias has shape"):
        int8_gemm.linear(layer, torch.randn(2, 32), torch.randn(4))


def test_the_op_has_a_fake_implementation() -> None:
    layer = int8_gemm.layer_of(torch.randint(-128, 128, (64, 96), dtype=torch.int8), torch.rand(64))
    x = torch.randn(3, 96).to(BF16)
    torch.library.opcheck(
        torch.ops.qscheme.int8_linear.default,
        (x, layer.codes, layer.sums, layer.scale, torch.randn(64), 1),
        test_utils=("test_schema", "test_faketensor"),
    )
    compiled = torch.compile(lambda v: int8_gemm.linear(layer, v), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), int8_gemm.linear(layer, x))
