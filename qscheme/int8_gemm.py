"""The ``cpu_int8_gemm`` kernel's C++ loops (``qscheme._int8_gemm``): int8 weights times int8
per-token activations, with exact integer sums.

The extension (``qscheme/csrc/int8_gemm*.cpp``, built by setup.py, optional) multiplies an int8
weight as the canonical weight holds it ([N, K] codes, no copy) by an input it quantizes itself:

- ``quantize_tokens``: each row of x (bfloat16 or float32) as compressed-tensors' int8 per-token
  codes, bit for bit ``qscheme.emulation.quantize_activation``'s (s = absmax / 127.5 in float32, a
  zero s made float32 eps, q = round-half-even(clamp(x / s, -128, 127))), stored as q + 128;
- ``linear``: ``y = x W^T (+ bias)``. Each output is ``float(dot) * s_x * s_w (+ bias)`` in float32,
  one rounding per operation, where ``dot = sum_k q_k w_k`` is exact (32-bit integers, K below
  2**17), rounded once to bfloat16 for bfloat16 inputs. On AVX512-VNNI CPUs VPDPBUSD multiplies the
  unsigned q + 128 by the signed weight bytes, and each row's sum of codes (kept per layer)
  removes the 128s; the portable loop gives the same bits.

``isa()`` says which loops run ('vnni' or 'scalar'); ``QSCHEME_INT8_GEMM_ISA`` (or ``set_isa``)
chooses narrower ones. The op ``qscheme::int8_linear`` has a fake implementation for
torch.compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qscheme.errors import UsageError
from qscheme.native_isa import IsaExtension

ISA_CHOICES: tuple[str, ...] = ("scalar", "vnni")
ISA_VARIABLE = "QSCHEME_INT8_GEMM_ISA"
MAX_K = (1 << 17) - 1
"""The largest K whose dot products stay exact in 32-bit integers (|q w| <= 2**14)."""

INPUT_DTYPES = (torch.bfloat16, torch.float32)

_EXTENSION = IsaExtension("qscheme._int8_gemm", ISA_CHOICES, ISA_VARIABLE, "int8_gemm")


def native() -> Any:
    """The extension, with ``QSCHEME_INT8_GEMM_ISA`` applied, or None where it was not built."""
    return _EXTENSION.native()


def available() -> bool:
    """Whether the extension was built (and imports) here."""
    return native() is not None


def isa() -> str:
    """The loops in use: 'vnni' or 'scalar' ('scalar' where the extension is missing)."""
    return _EXTENSION.loops()


def supported_isa() -> str:
    """The widest loops this CPU runs ('scalar' where the extension is missing)."""
    return _EXTENSION.widest()


def set_isa(name: str) -> None:
    """Use the ``name`` loops from now on (at most what the CPU runs), as the variable does."""
    _EXTENSION.set_isa(name)


@dataclass(frozen=True)
class Int8Layer:
    """An int8 weight as the loops read it: the codes [N, K] (the canonical tensor itself), each
    row's sum of codes (int32 [N]) and each row's effective scale (float32 [N])."""

    codes: Tensor
    sums: Tensor
    scale: Tensor

    @property
    def n(self) -> int:
        return int(self.codes.shape[0])

    @property
    def k(self) -> int:
        return int(self.codes.shape[1])


def layer_of(codes: Tensor, scale: Tensor) -> Int8Layer:
    """The layer of int8 ``codes`` [N, K] (CPU, rows contiguous) with one float32 scale per row
    ([N] or [N, 1]); the row sums are computed here, once."""
    if codes.dtype != torch.int8 or codes.ndim != 2 or codes.device.type != "cpu" or codes.stride(1) != 1:
        raise UsageError(
            f"int8_gemm takes CPU int8 codes [N, K] with contiguous rows, not {codes.dtype} {list(codes.shape)} "
            f"on {codes.device}"
        )
    n, k = codes.shape
    if not 1 <= k <= MAX_K or n < 1:
        raise UsageError(
            f"int8_gemm takes 1 <= K <= {MAX_K} and N >= 1 (exact 32-bit sums); the layer has N={n}, K={k}"
        )
    flat = scale.reshape(-1)
    if flat.numel() != n:
        raise UsageError(f"int8_gemm takes one scale per row ({n}); got {list(scale.shape)}")
    return Int8Layer(
        codes=codes,
        sums=codes.sum(dim=1, dtype=torch.int32).contiguous(),
        scale=flat.to(device="cpu", dtype=torch.float32).contiguous(),
    )


def _threads(threads: int) -> int:
    return torch.get_num_threads() if not threads else max(1, threads)


def _require_input(x: Tensor, k: int) -> Tensor:
    if x.dtype not in INPUT_DTYPES or x.ndim != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise UsageError(
            f"int8_gemm takes a CPU bfloat16 or float32 x of shape [M, {k}], not {x.dtype} {list(x.shape)} on "
            f"{x.device}"
        )
    return x if x.is_contiguous() else x.contiguous()


def _quantize(module: Any, x: Tensor, threads: int) -> tuple[Tensor, Tensor]:
    """Rows of a checked, contiguous x as (codes + 128 padded to rows of a multiple of 4 bytes, scales)."""
    m, k = x.shape
    padded = torch.empty(m, -(-k // 4) * 4, dtype=torch.uint8)
    scales = torch.empty(m, dtype=torch.float32)
    if m:
        module.quantize(
            x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, padded.data_ptr(), padded.stride(0),
            scales.data_ptr(), threads,
        )  # fmt: skip
    return padded, scales


def quantize_tokens(x: Tensor, threads: int = 0) -> tuple[Tensor, Tensor]:
    """x [M, K] (CPU, bfloat16 or float32) as (codes + 128: uint8 [M, K], a view of rows padded with
    zeros to a multiple of 4 bytes, as the loops read them; scales: float32 [M])."""
    module = _EXTENSION.require()
    x = _require_input(x, int(x.shape[-1]) if x.ndim == 2 else -1)
    padded, scales = _quantize(module, x, _threads(threads))
    return padded[:, : x.shape[1]], scales


def _run_linear(x: Tensor, codes: Tensor, sums: Tensor, scale: Tensor, bias: Tensor | None, threads: int) -> Tensor:
    module = _EXTENSION.require()
    n, k = codes.shape
    x = _require_input(x, k)
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return out
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    if bias32 is not None and bias32.shape != (n,):
        raise UsageError(f"int8_gemm: bias has shape {list(bias32.shape)}; the layer has N={n}")
    count = _threads(threads)
    x_codes, x_scales = _quantize(module, x, count)
    module.gemm(
        x_codes.data_ptr(), x_codes.stride(0), x_scales.data_ptr(), m, codes.data_ptr(), codes.stride(0),
        sums.data_ptr(), scale.data_ptr(), 0 if bias32 is None else bias32.data_ptr(), out.data_ptr(),
        int(x.dtype == torch.bfloat16), n, n, k, count,
    )  # fmt: skip
    return out


@torch.library.custom_op("qscheme::int8_linear", mutates_args=())
def int8_linear_op(x: Tensor, codes: Tensor, sums: Tensor, scale: Tensor, bias: Tensor | None, threads: int) -> Tensor:
    """y = x W^T (+ bias) with x quantized to int8 per token and exact integer sums (see the module)."""
    return _run_linear(x, codes, sums, scale, bias, threads)


@int8_linear_op.register_fake
def _int8_linear_fake(
    x: Tensor, codes: Tensor, sums: Tensor, scale: Tensor, bias: Tensor | None, threads: int
) -> Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]))


def linear(layer: Int8Layer, x: Tensor, bias: Tensor | None = None, threads: int | None = None) -> Tensor:
    """``y = x W^T (+ bias)`` for x [M, K] (bfloat16 or float32; y in x's dtype), x quantized to int8
    per token here. ``threads``: default torch's count."""
    count = 0 if not threads else max(1, threads)  # 0: torch's count, read when the op runs
    if torch.compiler.is_compiling():
        result: Tensor = torch.ops.qscheme.int8_linear(x, layer.codes, layer.sums, layer.scale, bias, count)
        return result
    return _run_linear(x, layer.codes, layer.sums, layer.scale, bias, count)
