"""The CPU GEMV over canonical quantized weights (``qscheme._cpu_gemv``) as torch custom ops.

The C++ extension (``qscheme/csrc/cpu_gemv*.cpp``, built by setup.py, optional) computes
``y = x W^T (+ bias)`` for a few rows of x (float32 or bfloat16), decoding the weight chunk by
chunk in registers and never storing it. Each weight is formed as the reference dequantization
forms it, ``fp32((value - zero) * effective_scale)``; the products are summed in float32 with
fused multiply-adds in another order than the reference's matmul, and the output is rounded once
to x's dtype (the bias added in float32 before that rounding). It keeps no state of its own: a
``GemvLayout`` is the canonical tensors themselves (views, no copy) plus a float32 value per row
where a scale depends on the fused partition (its global scale, or a tensor-wide scale), a
16-entry value table of the 4-bit codes and a 256-entry one of byte scales (e4m3, e8m0).

What it takes (``layout_of`` raises UsageError for anything else, naming what is missing):
codes e2m1, int4 and uint4 (two per byte), 4-bit codes into a 16-value codebook (NF4), e4m3,
int8 and uint8; scales per group (any size),
channel, 128x128-style block or tensor, stored as float32, bfloat16, float16, e4m3 or e8m0;
zero points as the scale; one global scale per fused partition, multiplied or (for a stored
divisor) divided as ``qscheme.canonical.effective_scale`` does.

Ops (namespace ``qscheme``, each with a fake implementation for torch.compile):

- ``cpu_gemv(x, codes, scale, zero_point, row_scale, bias, lut, scale_table, meta, threads)``:
  ``x`` [M, K] float32 or bfloat16, contiguous; returns [M, N] in x's dtype.
- ``cpu_gemv_dequantize(codes, scale, zero_point, row_scale, lut, scale_table, meta, start, stop,
  dtype, threads)``: rows [start, stop) of the weight as float32 (the reference's values, bit for
  bit) or bfloat16 (those rounded once), [stop - start, K].

One to four bfloat16 rows of x on 4-bit codes whose values times a power of two (up to 16) are integers
(e2m1, int4, uint4, with or without zero points: NVFP4, MXFP4, W4A16, W4A16_ASYM, GPTQ, AWQ; zero
points times that power of two within 2047), on a CPU with AVX512-VNNI, takes
an integer loop instead of the float32 one (``int16_applies``; ``QSCHEME_CPU_GEMV_INT16=0`` turns
it off): x is rounded per block of 256 elements to 16-bit integers over a power-of-two step (the
smallest that holds the block's largest magnitude; every element within 2**7 of it is exact, any
other off by at most half a step, 2**-16 of that magnitude), the products are summed exactly in
32-bit integers (VPDPWSSD), a zero point times its group's sum of x subtracted there, and each
group's sum is multiplied by its effective scale in float32. On a CPU with AVX512-BF16, layers
without zero points whose code values are exact in bfloat16 take a bfloat16 loop instead in groups
of 16 or 32 (NVFP4, MXFP4, int4 in groups of 32) and, from two rows of x, in any group
(``dot_loop``; ``QSCHEME_CPU_GEMV_BF16DOT=0`` / ``1`` turns it off / on; by default it is off on
CPUs with AMX-BF16, Intel's, where VDPBF16PS issues at half the FMA's rate and the integer loop is
faster): x as it is, each product exact and
summed in float32 (VDPBF16PS), each group's sums multiplied by its effective scale in float32,
where every element of x is zero or of a magnitude in [2**-100, 2**64] (else the integer loop runs).

``gemv`` and ``dequantize_rows`` call them (eagerly straight into the extension, skipping the
dispatcher's cost). ``isa()`` says which loops run ('avx512', 'avx2', 'scalar');
``QSCHEME_CPU_GEMV_ISA`` (or ``set_isa``) chooses narrower ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, effective_scale
from qscheme.errors import UsageError
from qscheme.formats import decode
from qscheme.native_isa import IsaExtension

ISA_CHOICES: tuple[str, ...] = ("scalar", "avx2", "avx512")
ISA_VARIABLE = "QSCHEME_CPU_GEMV_ISA"

CODE_NIBBLE, CODE_E4M3, CODE_INT8, CODE_UINT8 = 0, 1, 2, 3
SCALE_NONE, SCALE_F32, SCALE_BF16, SCALE_F16, SCALE_BYTE = 0, 1, 2, 3, 4
CHANNEL_GROUP = 1 << 40  # the group size given for a channel scale: one group spans any row

CODE_FORMATS: tuple[str, ...] = ("e2m1", "int4", "uint4", "e4m3", "int8", "uint8")
SCALE_DTYPES: dict[torch.dtype, int] = {
    torch.float32: SCALE_F32,
    torch.bfloat16: SCALE_BF16,
    torch.float16: SCALE_F16,
    torch.float8_e4m3fn: SCALE_BYTE,
    torch.uint8: SCALE_BYTE,  # e8m0 bytes
}


_EXTENSION = IsaExtension("qscheme._cpu_gemv", ISA_CHOICES, ISA_VARIABLE, "cpu_gemv")


def native() -> Any:
    """The extension, with ``QSCHEME_CPU_GEMV_ISA`` applied, or None where it was not built."""
    return _EXTENSION.native()


def available() -> bool:
    """Whether the extension was built (and imports) here."""
    return native() is not None


def isa() -> str:
    """The loops in use: 'avx512', 'avx2' or 'scalar' (UsageError where the extension is missing)."""
    module = _require_native()
    return str(module.isa())


def supported_isa() -> str:
    """The widest loops this CPU runs ('scalar' where the extension is missing: none run)."""
    return _EXTENSION.widest()


def set_isa(name: str) -> None:
    """Use the ``name`` loops from now on (at most what the CPU runs), as the variable does."""
    _EXTENSION.set_isa(name)


def _require_native() -> Any:
    return _EXTENSION.require()


_ARGS = "_layer_args_cache"  # GemvLayout.layer_args' entry in the instance's __dict__


@dataclass(frozen=True)
class GemvLayout:
    """A layer as the extension reads it: canonical tensors (contiguous CPU views) and sizes."""

    codes: Tensor
    scale: Tensor | None
    zero_point: Tensor | None
    row_scale: Tensor | None
    lut: Tensor
    scale_table: Tensor | None
    # code kind, scale kind, scale columns, group rows, group columns, divide, N, K, largest |zero point|
    meta: tuple[int, ...]

    @property
    def n(self) -> int:
        return self.meta[6]

    @property
    def k(self) -> int:
        return self.meta[7]

    @property
    def layer_args(self) -> tuple[int, ...]:
        """The extension's layer arguments (addresses and sizes), built once per layout: about
        4 us of every call at M = 1. Copies and pickles leave them behind (``__getstate__``), as
        their tensors live at other addresses."""
        found: tuple[int, ...] | None = self.__dict__.get(_ARGS)
        if found is None:
            found = self.__dict__[_ARGS] = _layer_args(
                self.codes, self.scale, self.zero_point, self.row_scale, self.lut, self.scale_table, self.meta
            )
        return found

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != _ARGS}

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the layout holds, by name."""
        named = {
            "codes": self.codes,
            "scale": self.scale,
            "zero_point": self.zero_point,
            "row_scale": self.row_scale,
            "lut": self.lut,
            "scale_table": self.scale_table,
        }
        return {name: value for name, value in named.items() if value is not None}


def _nibble_values(element: str) -> Tensor:
    nibbles = torch.arange(16, dtype=torch.uint8)
    if element == "int4":
        return ((nibbles.to(torch.int16) ^ 8) - 8).to(torch.float32)
    if element == "uint4":
        return nibbles.to(torch.float32)
    return decode(nibbles, element).contiguous()


def _byte_scale_table(scale: Tensor, scale_format: str) -> Tensor:
    every = torch.arange(256, dtype=torch.uint8)
    if scale.dtype == torch.float8_e4m3fn:
        return every.view(torch.float8_e4m3fn).to(torch.float32)
    return decode(every, scale_format).to(torch.float32).contiguous()


def _contiguous(value: Tensor) -> Tensor:
    return value if value.is_contiguous() else value.contiguous()


def _per_row(weight: CanonicalWeight, per_partition: Tensor) -> Tensor:
    sizes = torch.tensor(weight.partitions or (weight.n,))
    values = per_partition.reshape(-1).to(torch.float32)
    if values.numel() == 1:
        return values.expand(weight.n).contiguous()
    return values.repeat_interleave(sizes).contiguous()


def layout_of(weight: CanonicalWeight) -> GemvLayout:
    """The extension's view of a canonical CPU weight; UsageError naming what it cannot take."""
    scheme = weight.scheme
    spec = scheme.weight
    where = f"scheme {scheme.name}"
    if spec.blocks is not None:
        raise UsageError(f"cpu_gemv takes scale-and-code layouts, not packed blocks ({where})")
    if spec.format not in CODE_FORMATS:
        raise UsageError(f"cpu_gemv takes {', '.join(CODE_FORMATS)} codes; {where} has {spec.format}")
    if weight.input_permutation is not None:
        raise UsageError(f"cpu_gemv takes weights in the input's column order; {where} permutes them (act-order)")
    codes = weight.codes
    if codes.device.type != "cpu":
        raise UsageError(f"cpu_gemv runs on the CPU; {where}'s codes are on {codes.device}")
    code_kind = {"e4m3": CODE_E4M3, "int8": CODE_INT8, "uint8": CODE_UINT8}.get(spec.format, CODE_NIBBLE)
    table = getattr(spec, "table", None)
    if table is not None and (code_kind != CODE_NIBBLE or len(table) != 16):
        raise UsageError(
            f"cpu_gemv takes codebooks of 16 values indexed by 4-bit codes; {where} has {len(table)} values "
            f"indexed by {spec.format} codes"
        )
    if table is not None:  # a codebook (NF4, bitsandbytes FP4): code i is worth table[i] in float32
        lut = torch.tensor(table, dtype=torch.float32)
    else:
        lut = _nibble_values(spec.format) if code_kind == CODE_NIBBLE else torch.zeros(16)
    codes = _contiguous(codes).view(torch.uint8)
    granularity = spec.scale.granularity
    scale: Tensor | None = weight.scale
    row_scale: Tensor | None = None
    divide = 0
    scale_cols, group_n, group_k = 1, 1, CHANNEL_GROUP
    if granularity == "tensor":
        if weight.zero_point is not None:
            raise UsageError(f"cpu_gemv takes zero points with group, channel or block scales; {where}")
        row_scale = _contiguous(effective_scale(weight).reshape(-1).expand(weight.n).to(torch.float32))
        scale, scale_kind = None, SCALE_NONE
    else:
        assert scale is not None
        if scale.dtype not in SCALE_DTYPES:
            raise UsageError(f"cpu_gemv takes scales of {', '.join(map(str, SCALE_DTYPES))}; {where} has {scale.dtype}")
        scale_kind = SCALE_DTYPES[scale.dtype]
        scale = _contiguous(scale)
        if granularity == "group":
            assert spec.scale.group_size is not None
            scale_cols, group_k = scale.shape[1], spec.scale.group_size
        elif granularity == "block":
            assert spec.scale.block is not None
            scale_cols, (group_n, group_k) = scale.shape[1], spec.scale.block
        if weight.global_scale is not None:
            if granularity == "block" and len(weight.partitions) != 1:
                raise UsageError(f"cpu_gemv: per-partition global scales need group or channel scales ({where})")
            divisor = weight.global_scale_divisor
            divide = int(divisor is not None)
            row_scale = _per_row(weight, divisor if divisor is not None else weight.global_scale)
    scale_table = None
    if scale is not None and scale_kind == SCALE_BYTE:
        scale_table = _byte_scale_table(scale, spec.scale.format)
        scale = scale.view(torch.uint8)
    elif scale is not None and scale_kind in (SCALE_BF16, SCALE_F16):
        scale = scale.view(torch.int16)
    zero_point = None
    zero_max = 0
    if weight.zero_point is not None:
        zero_max = int(weight.zero_point.abs().max()) if weight.zero_point.numel() else 0
        if zero_max > 32767:
            raise UsageError(f"cpu_gemv takes zero points within int16; {where} has one of magnitude {zero_max}")
        zero_point = _contiguous(weight.zero_point.to(torch.int16))
    meta = (code_kind, scale_kind, scale_cols, group_n, group_k, divide, weight.n, weight.k, zero_max)
    return GemvLayout(codes, scale, zero_point, row_scale, lut, scale_table, meta)


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
    code_kind, scale_kind, scale_cols, group_n, group_k, divide, n, k, zero_max = meta
    stride = codes.shape[1] if codes.ndim == 2 else 0
    return (
        _address(codes), stride, code_kind, _address(lut), _address(scale), scale_kind, _address(scale_table),
        scale_cols, group_n, group_k, _address(zero_point), _address(row_scale), divide, n, k, zero_max,
    )  # fmt: skip


def _run_gemv(
    x: Tensor,
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    bias: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int] | tuple[int, ...],
    threads: int,
    layer_args: tuple[int, ...] | None = None,
) -> Tensor:
    module = _require_native()
    n, k = meta[6], meta[7]
    threads = threads or torch.get_num_threads()
    if x.dtype not in (torch.float32, torch.bfloat16) or x.ndim != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise UsageError(
            f"qscheme::cpu_gemv takes a CPU float32 or bfloat16 x of shape [M, {k}], not {x.dtype} {list(x.shape)} "
            f"on {x.device}"
        )
    x = _contiguous(x)
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    if x.shape[0] == 0 or n == 0:
        return out
    bias32 = None if bias is None else _contiguous(bias.to(torch.float32))
    module.gemv(
        _address(x), int(x.dtype == torch.bfloat16), x.shape[0], _address(out), int(out.dtype == torch.bfloat16),
        _address(bias32), threads,
        *(layer_args or _layer_args(codes, scale, zero_point, row_scale, lut, scale_table, meta)),
    )  # fmt: skip
    return out


@torch.library.custom_op("qscheme::cpu_gemv", mutates_args=())
def cpu_gemv_op(
    x: Tensor,
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    bias: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    threads: int,
) -> Tensor:
    """y = x W^T (+ bias) over a GemvLayout's tensors (see the module docstring)."""
    return _run_gemv(x, codes, scale, zero_point, row_scale, bias, lut, scale_table, meta, threads)


@cpu_gemv_op.register_fake
def _cpu_gemv_fake(
    x: Tensor,
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    bias: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    threads: int,
) -> Tensor:
    return x.new_empty((x.shape[0], meta[6]))


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
    dtype: torch.dtype,
    threads: int,
    out: Tensor | None = None,
) -> Tensor:
    module = _require_native()
    n, k = meta[6], meta[7]
    threads = threads or torch.get_num_threads()
    if not 0 <= start <= stop <= n:
        raise UsageError(f"qscheme::cpu_gemv_dequantize: rows [{start}, {stop}) are not within N={n}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise UsageError(f"qscheme::cpu_gemv_dequantize writes float32 or bfloat16, not {dtype}")
    if out is None:
        out = torch.empty(stop - start, k, dtype=dtype)
    if stop > start and k:
        module.dequantize(
            _address(out), int(dtype == torch.bfloat16), start, stop, threads,
            *_layer_args(codes, scale, zero_point, row_scale, lut, scale_table, meta),
        )  # fmt: skip
    return out


@torch.library.custom_op("qscheme::cpu_gemv_dequantize", mutates_args=())
def cpu_gemv_dequantize_op(
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    dtype: torch.dtype,
    threads: int,
) -> Tensor:
    """Rows [start, stop) of a GemvLayout's weight in ``dtype`` (float32 or bfloat16)."""
    return _run_dequantize(codes, scale, zero_point, row_scale, lut, scale_table, meta, start, stop, dtype, threads)


@cpu_gemv_dequantize_op.register_fake
def _cpu_gemv_dequantize_fake(
    codes: Tensor,
    scale: Tensor | None,
    zero_point: Tensor | None,
    row_scale: Tensor | None,
    lut: Tensor,
    scale_table: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    dtype: torch.dtype,
    threads: int,
) -> Tensor:
    return codes.new_empty((stop - start, meta[7]), dtype=dtype)


def _threads(threads: int | None) -> int:
    """The worker count: 0 (or None) means torch's thread count, read when the op runs."""
    return 0 if threads is None else max(1, threads)


def gemv(layout: GemvLayout, x: Tensor, bias: Tensor | None = None, threads: int | None = None) -> Tensor:
    """y = x W^T (+ bias) for x [M, K] float32 or bfloat16 on the CPU; [M, N] in x's dtype.
    ``threads``: worker threads over N (default ``torch.get_num_threads()`` when it runs)."""
    args = (layout.codes, layout.scale, layout.zero_point, layout.row_scale)
    tables = (layout.lut, layout.scale_table)
    if torch.compiler.is_compiling():
        out: Tensor = torch.ops.qscheme.cpu_gemv(x, *args, bias, *tables, list(layout.meta), _threads(threads))
        return out
    return _run_gemv(x, *args, bias, *tables, layout.meta, _threads(threads), layout.layer_args)


def dot_loop(layout: GemvLayout, rows: int = 1) -> str | None:
    """Which 16-bit dot-product loop ``rows`` (1 to 4) bfloat16 rows of x run on this layer here
    (see the module docstring): "vnni" (integer products), "bf16" (bfloat16 products, where every
    element of x is zero or of a magnitude in [2**-100, 2**64]), or None (the float32 loops, the tiles, or the
    extension not built)."""
    module = native()
    if module is None:
        return None
    return {0: None, 1: "vnni", 2: "bf16"}[int(module.int16_layer(rows, *layout.layer_args))]


def int16_applies(layout: GemvLayout, rows: int = 1) -> bool:
    """Whether ``rows`` bfloat16 rows of x run the VNNI integer loop on this layer here."""
    return dot_loop(layout, rows) == "vnni"


def dequantize_rows(
    layout: GemvLayout,
    start: int,
    stop: int,
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Rows [start, stop) of the weight, [stop - start, K] in float32 (bit for bit
    ``qscheme.canonical.dequantize_rows``) or bfloat16 (those values rounded once). ``out``: a
    contiguous CPU tensor of that shape to write into (its dtype is the one written); returned."""
    args = (layout.codes, layout.scale, layout.zero_point, layout.row_scale, layout.lut, layout.scale_table)
    if out is not None:
        shape = (stop - start, layout.k)
        if tuple(out.shape) != shape or not out.is_contiguous() or out.device.type != "cpu":
            raise UsageError(
                f"cpu_gemv dequantize_rows: out must be a contiguous CPU tensor of shape {list(shape)}, not "
                f"{list(out.shape)} on {out.device}"
            )
        _run_dequantize(*args, layout.meta, start, stop, out.dtype, _threads(threads), out)
        return out
    if torch.compiler.is_compiling():
        result: Tensor = torch.ops.qscheme.cpu_gemv_dequantize(
            *args, list(layout.meta), start, stop, dtype, _threads(threads)
        )
        return result
    return _run_dequantize(*args, layout.meta, start, stop, dtype, _threads(threads))
