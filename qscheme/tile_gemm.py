"""The ``dequant_gemm`` kernel's C++ tile decoder and fused tile GEMM (``qscheme._tile_gemm``).

The extension (``qscheme/csrc/tile_gemm*.cpp``, built by setup.py, optional) reads a layer as
``qscheme.cpu_gemv.layout_of`` describes it (the canonical tensors themselves, no copy) and:

- ``dequantize_rows``: rows of the weight in bfloat16, each the reference's float32 value
  (``qscheme.canonical.dequantize_rows``) rounded once to nearest even, bit for bit
  ``dequantize(weight).to(torch.bfloat16)`` (the AVX-512 loops write 0 for a weight below
  2**-126 in magnitude, a float32 subnormal; the portable loop keeps the bfloat16 subnormal);
- ``gemm``: ``y = x W^T (+ bias)`` for bfloat16 ``x``: panels of 32 weight rows decoded as above
  into a cache-resident buffer and multiplied by every row of x, products summed in float32 and
  the output rounded once to bfloat16 (a float32 bias added before that rounding). On AMX (Intel
  AMX-BF16) with TDPBF16PS on tiles, the input packed once per call into the tiles' pair layout;
  on CPUs with AVX-512 BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake) with VDPBF16PS, the
  input padded once per call to whole chunks of 32 columns: below 32 input rows as dot products
  along K, 4 weight rows by 4 input rows at a time (lane sums at the end); from 32 rows, whole
  blocks of 16 input rows packed once per call as pairs of k and each weight pair broadcast, 16
  input rows a register with no lane sums (the rest of the rows as dot products). Both read
  bfloat16 subnormals as zero. A thread holds one panel
  (32 x K bfloat16 at most) and its float32 accumulators; nothing else.

Ops (namespace ``qscheme``, with fake implementations for torch.compile): ``tile_gemm(x, codes,
scale, zero_point, row_scale, bias, lut, scale_table, meta, start, stop, threads)`` (rows
[start, stop) of the output) and ``tile_dequantize(codes, ..., start, stop, threads)``.

``isa()`` says which loops run ('amx', 'avx512', 'scalar': AMX tiles and AVX-512 BF16 decoding,
the AVX-512 BF16 decoder and dot products, or the portable decoder only: no ``gemm``);
``QSCHEME_TILE_GEMM_ISA`` (or ``set_isa``) chooses narrower ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qscheme.cpu_gemv import GemvLayout
from qscheme.emulation_native import InputPass
from qscheme.errors import UsageError
from qscheme.native_isa import IsaExtension

ISA_CHOICES: tuple[str, ...] = ("scalar", "avx512", "amx")
ISA_VARIABLE = "QSCHEME_TILE_GEMM_ISA"
FUSED_ISAS: tuple[str, ...] = ("avx512", "amx")
"""The loops ``gemm`` runs on: AMX tiles, or VDPBF16PS dot products on CPUs without AMX."""


_EXTENSION = IsaExtension("qscheme._tile_gemm", ISA_CHOICES, ISA_VARIABLE, "tile_gemm")


def native() -> Any:
    """The extension, with ``QSCHEME_TILE_GEMM_ISA`` applied, or None where it was not built."""
    return _EXTENSION.native()


def available() -> bool:
    """Whether the extension was built (and imports) here."""
    return native() is not None


def isa() -> str:
    """The loops in use: 'amx', 'avx512' or 'scalar' ('scalar' where the extension is missing)."""
    return _EXTENSION.loops()


def fused() -> bool:
    """Whether ``gemm`` runs here (the extension is built and runs its AMX or AVX-512 BF16 loops)."""
    return isa() in FUSED_ISAS


def set_isa(name: str) -> None:
    """Use the ``name`` loops from now on (at most what the CPU runs), as the variable does."""
    _EXTENSION.set_isa(name)


def _require_native() -> Any:
    return _EXTENSION.require()


def _address(value: Tensor | None) -> int:
    return 0 if value is None else int(value.data_ptr())


def _layer_args(
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int] | tuple[int, ...],
) -> tuple[int, ...]:
    code_kind, scale_kind, scale_cols, group_n, group_k, divide, n, k = meta[:8]
    stride = codes.shape[1] if codes.ndim == 2 else 0
    return (
        _address(codes), stride, code_kind, _address(lut), _address(scale), scale_kind, _address(scale_table),
        scale_cols, group_n, group_k, _address(zero_point), _address(row_scale), divide, n, k,
    )  # fmt: skip


def blocking(m: int, loops: str = "amx") -> tuple[int, int]:
    """(weight rows per task, K columns decoded at a time) for M input rows on the ``loops`` GEMM.

    AMX, measured on a 2-core AMX Xeon, 4096x4096, int8 / FP8 blocks / NVFP4, same-run A/B: up to
    M = 256 whole rows of 32 at a time (each row's codes prefetched while the one before is decoded)
    were 1.0-1.5x faster than 64 rows by 512 columns (M = 64, 128) and as fast as 256 by 256
    (M = 256); from M = 512 on, the input no longer stays in the cache while a panel multiplies it,
    and 256 x 256 chunks win.

    AVX-512 BF16 (dot products of 4 input rows, which stay in L1, by every 4 rows of a panel, which
    stays in L2): panels of 32 rows, K in chunks of 4096, measured on a 2-core AMD EPYC (Zen 4),
    NVFP4 4096x4096, one thread: 1.1-1.3x faster than chunks of 512-2048 at M = 16-256 (each chunk
    ends with a sum across the lanes of every accumulator). From 32 input rows, the packed pairs'
    loop (up to 96 input rows, in L2, against every 4 rows of the panel): chunks of 4096 against
    2048, W4A16 4096x4096, 2 threads, M = 64-256: 1.00-1.04x; 64-row tasks against 32: 0.99-1.02x."""
    if loops != "amx":
        return 32, 4096
    if m <= 256:
        return 32, 4096
    return 256, 256


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if not threads else max(1, threads)


def _run_gemm(
    x: Tensor,
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    bias: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int] | tuple[int, ...],
    start: int,
    stop: int,
    threads: int,
    out: Tensor | None = None,
    input_pass: InputPass | None = None,
) -> Tensor:
    module = _require_native()
    n, k = meta[6], meta[7]
    if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise UsageError(
            f"qscheme::tile_gemm takes a CPU bfloat16 x of shape [M, {k}], not {x.dtype} {list(x.shape)} on {x.device}"
        )
    if not 0 <= start <= stop <= n:
        raise UsageError(f"qscheme::tile_gemm: rows [{start}, {stop}) are not within N={n}")
    loops = str(module.isa())
    if loops not in FUSED_ISAS:
        raise UsageError(f"qscheme::tile_gemm runs on AMX or AVX-512 BF16; this CPU (or {ISA_VARIABLE}) gives {loops}")
    x = x if x.is_contiguous() else x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], stop - start, dtype=torch.bfloat16)
    if x.shape[0] == 0 or stop == start:
        return out
    if out.dtype != torch.bfloat16 or out.shape[0] != x.shape[0] or out.shape[1] != stop - start or out.stride(1) != 1:
        raise UsageError(f"qscheme::tile_gemm: out must be bfloat16 [{x.shape[0]}, {stop - start}] with unit columns")
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    if bias32 is not None and bias32.shape != (n,):
        raise UsageError(f"qscheme::tile_gemm: bias has shape {list(bias32.shape)}; the layer has N={n}")
    rows, chunk = blocking(x.shape[0], loops)
    passing = _no_pass if input_pass is None else _pass_args(input_pass, k)
    module.gemm(
        _address(x), x.shape[0], _address(out), out.stride(0), _address(bias32), start, stop, _threads(threads),
        rows, chunk, *passing, *_layer_args(codes, scale, zero_point, row_scale, lut, scale_table, meta),
    )  # fmt: skip
    return out


_no_pass = (-1, 0, 0, 0)  # the extension's (mode, group, pre-scale address, scale bits) for no input pass


def _pass_args(input_pass: InputPass, k: int) -> tuple[int, int, int, int]:
    pre_scale = input_pass.pre_scale
    if pre_scale is not None and (
        pre_scale.dtype != torch.float32 or pre_scale.shape != (k,) or not pre_scale.is_contiguous()
    ):
        raise UsageError(f"qscheme::tile_gemm: the input pass's pre-scale must be a contiguous float32 [{k}] tensor")
    return input_pass.mode, input_pass.group, _address(pre_scale), input_pass.scale_bits


@torch.library.custom_op("qscheme::tile_gemm", mutates_args=())
def tile_gemm_op(
    x: Tensor,
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    bias: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    threads: int,
    input_mode: int = -1,
    input_group: int = 0,
    input_scale: float = 0.0,
    pre_scale: Tensor | None = None,
) -> Tensor:
    """Columns [start, stop) of y = x' W^T (+ bias) over a GemvLayout's tensors (bfloat16 x, AMX or AVX-512
    BF16), x' being x with the input pass (``qscheme.emulation_native.InputPass``'s fields; mode -1: none)."""
    passing = None if input_mode == -1 else InputPass(input_mode, input_group, input_scale, pre_scale)
    return _run_gemm(
        x, codes, scale, zero_point, row_scale, bias, lut, scale_table, meta, start, stop, threads, None, passing
    )


@tile_gemm_op.register_fake
def _tile_gemm_fake(
    x: Tensor,
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    bias: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    threads: int,
    input_mode: int = -1,
    input_group: int = 0,
    input_scale: float = 0.0,
    pre_scale: Tensor | None = None,
) -> Tensor:
    return x.new_empty((x.shape[0], stop - start))


def _run_dequantize(
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int] | tuple[int, ...],
    start: int,
    stop: int,
    threads: int,
) -> Tensor:
    module = _require_native()
    n, k = meta[6], meta[7]
    if not 0 <= start <= stop <= n:
        raise UsageError(f"qscheme::tile_dequantize: rows [{start}, {stop}) are not within N={n}")
    out = torch.empty(stop - start, k, dtype=torch.bfloat16)
    if stop > start and k:
        module.dequantize(
            _address(out), start, stop, _threads(threads),
            *_layer_args(codes, scale, zero_point, row_scale, lut, scale_table, meta),
        )  # fmt: skip
    return out


@torch.library.custom_op("qscheme::tile_dequantize", mutates_args=())
def tile_dequantize_op(
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    threads: int,
) -> Tensor:
    """Rows [start, stop) of a GemvLayout's weight in bfloat16."""
    return _run_dequantize(codes, scale, zero_point, row_scale, lut, scale_table, meta, start, stop, threads)


@tile_dequantize_op.register_fake
def _tile_dequantize_fake(
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    threads: int,
) -> Tensor:
    return codes.new_empty((stop - start, meta[7]), dtype=torch.bfloat16)


def _tensors(layout: GemvLayout) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    return layout.codes, layout.scale, layout.zero_point, layout.row_scale


def gemm(
    layout: GemvLayout,
    x: Tensor,
    bias: Tensor | None = None,
    start: int = 0,
    stop: int | None = None,
    threads: int | None = None,
    out: Tensor | None = None,
    input_pass: InputPass | None = None,
) -> Tensor:
    """Columns [start, stop) (default: all) of ``y = x' W^T (+ bias)`` for bfloat16 ``x`` [M, K]:
    [M, stop - start] bfloat16 (into ``out`` where given: a view with unit column stride). ``bias``:
    [N] (all of it; its rows [start, stop) are added). ``threads``: default torch's count. ``x'`` is
    ``x``, or with ``input_pass`` (``qscheme.emulation.native_input_pass``) each row as
    ``qscheme.emulation.prepare_input`` gives it in bfloat16, bit for bit, computed as the GEMM pads
    it: the pre-scaled, quantized input needs no pass or buffer of its own."""
    stop = layout.n if stop is None else stop
    meta = list(layout.meta[:8])
    count = 0 if not threads else max(1, threads)  # 0: torch's count, read when the op runs
    if torch.compiler.is_compiling():
        extra = (
            () if input_pass is None else (input_pass.mode, input_pass.group, input_pass.scale, input_pass.pre_scale)
        )
        result: Tensor = torch.ops.qscheme.tile_gemm(
            x, *_tensors(layout), bias, layout.lut, layout.scale_table, meta, start, stop, count, *extra
        )
        return result if out is None else out.copy_(result)
    return _run_gemm(
        x, *_tensors(layout), bias, layout.lut, layout.scale_table, meta, start, stop, count, out, input_pass
    )


def dequantize_rows(layout: GemvLayout, start: int, stop: int, threads: int | None = None) -> Tensor:
    """Rows [start, stop) of the weight as bfloat16 [stop - start, K] (see the module docstring)."""
    meta = list(layout.meta[:8])
    args = (*_tensors(layout), layout.lut, layout.scale_table)
    count = 0 if not threads else max(1, threads)  # 0: torch's count, read when the op runs
    if torch.compiler.is_compiling():
        result: Tensor = torch.ops.qscheme.tile_dequantize(*args, meta, start, stop, count)
        return result
    return _run_dequantize(*args, meta, start, stop, count)
