"""The CPU GEMV over packed blocks (``packing: blocks``: GGUF's types) as a torch custom op.

``qscheme._cpu_gemv.gemv_blocks`` (``qscheme/csrc/cpu_gemv_gguf*.cpp``) computes ``y = x W^T (+
bias)`` for a few rows of x (float32 or bfloat16) straight from the raw blocks the canonical
weight holds, decoding each block in registers and never storing the weight. Nothing in it knows
a type by name: the scheme's block declaration (``qscheme.descriptor.blocks``) is compiled here
into a small int32 "program" (the element integer's pieces, as ``qscheme.formats.blocks``
compiles them for its decoder; each scale and minimum factor: a float field or an integer with
its pieces), plus the element's value for every raw code and a 256-entry table per one-byte float
field (e8m0, e4m3, ue4m3), each built by the reference decoder's own functions.

Arithmetic: per block, the sub-block scale products ``s_g`` (and minimum products ``m_g``) are
the float32 products the reference decoder forms (factors multiplied left to right); the kernel
sums ``x_k * value(code_k)`` over each sub-block in float32 (fused multiply-adds) and adds
``s_g`` times that sum, minus (or plus) ``m_g`` times the sub-block's sum of x. The reference
rounds each weight ``s_g * value - m_g`` to float32 first; the two differ by float32 rounding
only (the bound is in ``qscheme_plugins.cpu_gemv_blocks``).

Loops: with bfloat16 inputs on a CPU with AVX512-BF16 and VBMI, 4-bit codes in sub-blocks of 32
read as nibble pairs (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS, MXFP4) take the AVX512-BF16 loop: x as it is
times the code values with VDPBF16PS (products exact, summed in float32), 64 weights a step, the
factors formed in the loop from each block (``dot_loop`` says where it runs). Otherwise AVX-512 (16
weights at a time) or AVX2 (8), each 16- or 8-weight chunk of a block read
from one 16-byte window of the block with per-lane shifts and masks, and the portable scalar
loop where a layout does not fit (sub-blocks not a multiple of the width, a chunk's bytes further
apart than 16, a table code of more than 4 bits); ``qscheme.cpu_gemv.set_isa`` /
``QSCHEME_CPU_GEMV_ISA`` choose narrower loops for these too. Where the integer products are on
(``QSCHEME_CPU_GEMV_GGUF_INT16``; by default on AMX CPUs), one or two bfloat16 rows of x take them
instead: on the 4-bit types whose code values are integers, in the AVX512-BF16 loop, and on blocks of
signed byte codes scaled by one fp16 field (Q8_0) in a loop of their own (x rounded to 16-bit integers
per block of 256, VPMADDWD).

For many rows of bfloat16 x (prefill: the ``cpu_gemm_blocks`` kernel, from M = 4 or 5), ``gemm``
multiplies the blocks as a GEMM instead: tasks of 32 weight rows, each decoded chunk by chunk of K (about
4096 columns, whole blocks) into a bfloat16 panel that stays in the core's cache (each weight the
reference decoder's float32 value rounded once to nearest even; a float32 subnormal becomes zero,
as the instruction reads a bfloat16 subnormal), then multiplied by every row of x: on the AMX tiles
(TDPBF16PS, x packed once per call into the tiles' pair layout) where the CPU has AMX-BF16 and Linux
grants the tile state, else with VDPBF16PS dot products (``gemm_loops`` says which;
``QSCHEME_CPU_GEMM_BLOCKS_AMX=0``, read at each call, keeps VDPBF16PS). Either way products of
bfloat16 values are exact and summed in float32, the output rounded once to bfloat16, a float32 bias
added first. It runs where the CPU has AVX512-BF16 and VBMI, the AVX-512 loops are in use and the
layout fits their decoder (``gemm_runs``). A thread holds one panel; the weight is never stored whole.

Ops (namespace ``qscheme``, with fake implementations for torch.compile):
``cpu_gemv_blocks(x, codes, program, values, byte_tables, bias, meta, threads)``: ``x`` [M, K]
float32 or bfloat16, contiguous; returns [M, N] in x's dtype. ``cpu_gemm_blocks(x, codes, program,
values, byte_tables, bias, meta, start, stop, threads)``: ``x`` [M, K] bfloat16; returns columns
[start, stop) of the product, [M, stop - start] bfloat16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight
from qscheme.cpu_gemv import _require_native, native
from qscheme.descriptor.blocks import BlockField, BlockLayout
from qscheme.errors import UsageError
from qscheme.formats.blocks import compile_layout, float_field_values

FIELD_FORMATS: dict[str, int] = {"fp16": 0, "bf16": 1, "fp32": 2}  # any other (one byte): through a table
FIELD_TABLE = 3
MAX_GROUPS = 64  # sub-blocks per block (the extension's limit)
MAX_DEPTH = 4  # pieces of one integer value
MAX_ELEMENT_BITS = 8
LUT_ENTRIES = 16  # the vector loops load 16 element values
GEMM_CHUNK = 4096
"""Columns of K a ``gemm`` panel takes at a time (rounded down to whole blocks): as the canonical
tensors' fused GEMM on AVX-512 BF16 (``qscheme.tile_gemm.blocking``), where chunks of 4096 beat
512-2048 (each chunk ends with a sum across the lanes of every accumulator)."""


@dataclass(frozen=True)
class BlockProgram:
    """A block declaration compiled for the extension (shared by every layer of the scheme)."""

    program: Tensor  # int32
    values: Tensor  # float32 [max(16, 2**bits)]
    byte_tables: Tensor  # float32 [tables * 256] (one zero where there are none)
    tables: int


@dataclass(frozen=True)
class BlockGemvLayout:
    """A layer as ``gemv_blocks`` reads it: the canonical raw blocks (a view) and its program."""

    codes: Tensor
    compiled: BlockProgram
    meta: tuple[int, int, int, int]  # N, K, bytes per row, byte tables

    @property
    def n(self) -> int:
        return self.meta[0]

    @property
    def k(self) -> int:
        return self.meta[1]

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the layout holds, by name."""
        return {
            "codes": self.codes,
            "program": self.compiled.program,
            "values": self.compiled.values,
            "byte_tables": self.compiled.byte_tables,
        }


def _byte_table(field: BlockField) -> Tensor:
    """float32 [256]: the value of every byte of a one-byte float field, by the reference decoder."""
    every = torch.arange(256, dtype=torch.uint8).view(256, 1)
    one = BlockField(field.name, 0, 1, field.format, 1)
    return float_field_values(every, one).reshape(256).to(torch.float32)


def _refuse(layout: BlockLayout, what: str) -> UsageError:
    return UsageError(f"cpu_gemv_blocks cannot run blocks {layout.describe()}: {what}")


@functools.cache
def block_program(layout: BlockLayout) -> BlockProgram:
    """The extension's program for a block declaration (see the module docstring); UsageError
    naming what it cannot take."""
    element = layout.element
    if element is None:
        raise _refuse(layout, "plain float blocks (no element code) run on the other kernels")
    spec = layout.integer(element.integer)
    assert spec is not None
    if spec.bits > MAX_ELEMENT_BITS:
        raise _refuse(layout, f"element codes of {spec.bits} bits (at most {MAX_ELEMENT_BITS})")
    sub = layout.sub_block
    groups = layout.elements // sub
    if groups > MAX_GROUPS or layout.elements % sub:
        raise _refuse(layout, f"{groups} sub-blocks per block (at most {MAX_GROUPS})")
    compiled = compile_layout(layout, "cpu")
    tables: list[Tensor] = []
    ints: list[int] = []

    def slots_of(name: str) -> Tensor:
        slots = compiled.native[name][0]
        if slots.shape[0] > MAX_DEPTH:
            raise _refuse(layout, f"integer {name} of {slots.shape[0]} pieces (at most {MAX_DEPTH})")
        return slots

    for name in (*layout.scale, *layout.minimum):
        field = layout.field(name)
        if field is not None:
            assert field.format is not None
            form = FIELD_FORMATS.get(field.format, FIELD_TABLE)
            table = len(tables) if form == FIELD_TABLE else 0
            if form == FIELD_TABLE:
                tables.append(_byte_table(field))
            ints += [1, field.count, field.offset, form, table, 0, 0, 0, 0]
            continue
        factor = layout.integer(name)
        assert factor is not None
        slots = slots_of(name)
        ints += [0, factor.count, 0, 0, 0, factor.bits, int(factor.signed), factor.offset, slots.shape[0]]
        ints += slots.reshape(-1).tolist()
    element_slots = slots_of(element.integer)
    table_coded = element.table is not None or element.format is not None
    sign = {"subtract": -1, "add": 1}[layout.minimum_sign] if layout.minimum else 0
    header = [
        layout.bytes, layout.elements, groups, len(layout.scale), len(layout.minimum), sign, spec.bits,
        element_slots.shape[0], int(table_coded), int(spec.signed), spec.offset, len(tables),
    ]  # fmt: skip
    program = torch.tensor(header + element_slots.reshape(-1).tolist() + ints, dtype=torch.int32)
    assert compiled.native_table is not None
    values = torch.zeros(max(LUT_ENTRIES, 1 << spec.bits), dtype=torch.float32)
    values[: compiled.native_table.numel()] = compiled.native_table
    byte_tables = torch.cat(tables) if tables else torch.zeros(1)
    return BlockProgram(program, values, byte_tables.contiguous(), len(tables))


def block_layout_of(weight: CanonicalWeight) -> BlockGemvLayout:
    """The extension's view of a canonical weight of packed blocks; UsageError naming what it
    cannot take."""
    scheme = weight.scheme
    layout = scheme.weight.blocks
    if layout is None:
        raise UsageError(f"cpu_gemv_blocks takes packed blocks; scheme {scheme.name} has scale-and-code tensors")
    if weight.input_permutation is not None or weight.input_pre_scale is not None:
        raise UsageError(f"cpu_gemv_blocks takes no input permutation or pre-scale (scheme {scheme.name})")
    codes = weight.codes
    if codes.device.type != "cpu":
        raise UsageError(f"cpu_gemv_blocks runs on the CPU; scheme {scheme.name}'s blocks are on {codes.device}")
    compiled = block_program(layout)
    codes = codes if codes.is_contiguous() else codes.contiguous()
    row_bytes = weight.k // layout.elements * layout.bytes
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (weight.n, row_bytes):
        raise UsageError(
            f"cpu_gemv_blocks: scheme {scheme.name}'s blocks must be uint8 [{weight.n}, {row_bytes}], "
            f"not {codes.dtype} {list(codes.shape)}"
        )
    return BlockGemvLayout(codes, compiled, (weight.n, weight.k, row_bytes, compiled.tables))


def _address(value: Tensor | None) -> int:
    return 0 if value is None else int(value.data_ptr())


def _run(
    x: Tensor,
    codes: Tensor,
    program: Tensor,
    values: Tensor,
    byte_tables: Tensor,
    bias: Tensor | None,
    meta: list[int] | tuple[int, ...],
    threads: int,
) -> Tensor:
    module = _require_native()
    n, k, row_bytes, tables = meta
    threads = threads or torch.get_num_threads()
    if x.dtype not in (torch.float32, torch.bfloat16) or x.ndim != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise UsageError(
            f"qscheme::cpu_gemv_blocks takes a CPU float32 or bfloat16 x of shape [M, {k}], not {x.dtype} "
            f"{list(x.shape)} on {x.device}"
        )
    x = x if x.is_contiguous() else x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    bf16 = int(x.dtype == torch.bfloat16)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()  # alive through the call
    module.gemv_blocks(
        x.data_ptr(), bf16, m, out.data_ptr(), bf16, _address(bias32), threads,
        codes.data_ptr(), n, k, row_bytes, program.data_ptr(), program.numel(), values.data_ptr(),
        byte_tables.data_ptr(), tables,
    )  # fmt: skip
    return out


@torch.library.custom_op("qscheme::cpu_gemv_blocks", mutates_args=())
def cpu_gemv_blocks_op(
    x: Tensor,
    codes: Tensor,
    program: Tensor,
    values: Tensor,
    byte_tables: Tensor,
    bias: Tensor | None,
    meta: list[int],
    threads: int,
) -> Tensor:
    """y = x W^T (+ bias) over a BlockGemvLayout's tensors (see the module docstring)."""
    return _run(x, codes, program, values, byte_tables, bias, meta, threads)


@cpu_gemv_blocks_op.register_fake
def _cpu_gemv_blocks_fake(
    x: Tensor,
    codes: Tensor,
    program: Tensor,
    values: Tensor,
    byte_tables: Tensor,
    bias: Tensor | None,
    meta: list[int],
    threads: int,
) -> Tensor:
    return x.new_empty((x.shape[0], meta[0]))


def bf16_loop_available() -> bool:
    """Whether this CPU runs the AVX512-BF16 loop: AVX512-BF16 and VBMI, the AVX-512 loops in use
    (``qscheme.cpu_gemv.set_isa`` / ``QSCHEME_CPU_GEMV_ISA``) and ``QSCHEME_CPU_GEMV_BF16DOT`` not 0."""
    module = native()
    return module is not None and hasattr(module, "blocks_bf16") and bool(module.blocks_bf16())


def dot_loop(layout: BlockGemvLayout) -> str | None:
    """Which loop bfloat16 rows of x run on this layer here: "bf16" (the AVX512-BF16 loop, on a CPU
    with AVX512-BF16 and VBMI running the AVX-512 loops, where every element of x is zero or of a
    magnitude in [2**-100, 2**64]; ``QSCHEME_CPU_GEMV_BF16DOT=0`` turns it off) or None (the float32
    loops, or the extension not built)."""
    module = native()
    if module is None or not hasattr(module, "blocks_loop"):
        return None
    return "bf16" if _loop_code(module, layout) else None


def _loop_code(module: Any, layout: BlockGemvLayout) -> int:
    c = layout.compiled
    return int(
        module.blocks_loop(
            layout.k, _address(c.program), c.program.numel(), _address(c.values), _address(c.byte_tables), c.tables
        )
    )


def plane_step(layout: BlockGemvLayout) -> int | None:
    """Elements per step of the AVX512-BF16 loop on a layer of integer codes (Q2_K, Q3_K, Q5_0, Q5_1,
    Q5_K, Q6_K): 64 where the pieces of each code lie in runs of 32 bytes (the K-quants), else 32, or
    32 with ``QSCHEME_CPU_GEMV_PLANES64=0``; None where the loop does not run such a layer here (4-bit
    nibble pairs, the float32 loops, the extension not built)."""
    module = native()
    if module is None or not hasattr(module, "blocks_loop"):
        return None
    return {2: 32, 3: 64}.get(_loop_code(module, layout))


def gemv_blocks(layout: BlockGemvLayout, x: Tensor, bias: Tensor | None = None, threads: int | None = None) -> Tensor:
    """y = x W^T (+ bias) for x [M, K] float32 or bfloat16 on the CPU; [M, N] in x's dtype.
    ``threads``: worker threads over N (default ``torch.get_num_threads()`` when it runs)."""
    count = 0 if threads is None else max(1, threads)
    c = layout.compiled
    if torch.compiler.is_compiling():
        out: Tensor = torch.ops.qscheme.cpu_gemv_blocks(
            x, layout.codes, c.program, c.values, c.byte_tables, bias, list(layout.meta), count
        )
        return out
    return _run(x, layout.codes, c.program, c.values, c.byte_tables, bias, layout.meta, count)


def dequantize_rows(
    layout: BlockGemvLayout, start: int, stop: int, dtype: torch.dtype = torch.float32, threads: int | None = None
) -> Tensor | None:
    """Rows [start, stop) of the weight, [stop - start, K] in float32 (bit for bit
    ``qscheme.formats.blocks.decode_blocks``) or bfloat16 (those values rounded once to nearest even,
    as ``Tensor.to`` rounds), decoded by the extension's AVX-512 loop over ``threads`` workers (default
    ``torch.get_num_threads()``). None where that loop does not run here (the AVX-512 loops not in use,
    a layout they do not read, the extension not built): decode with ``decode_blocks`` then."""
    n, k, row_bytes, tables = layout.meta
    if not 0 <= start <= stop <= n:
        raise UsageError(f"cpu_gemv_blocks dequantize_rows: rows [{start}, {stop}) are not within N={n}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise UsageError(f"cpu_gemv_blocks dequantize_rows writes float32 or bfloat16, not {dtype}")
    module = native()
    if module is None or not hasattr(module, "dequantize_blocks"):
        return None
    out = torch.empty(stop - start, k, dtype=dtype)
    if stop == start or k == 0:
        return out
    c = layout.compiled
    count = torch.get_num_threads() if threads is None else max(1, threads)
    ran = module.dequantize_blocks(
        out.data_ptr(), int(dtype == torch.bfloat16), start, stop, count, layout.codes.data_ptr(), n, k, row_bytes,
        c.program.data_ptr(), c.program.numel(), c.values.data_ptr(), c.byte_tables.data_ptr(), tables,
    )  # fmt: skip
    return out if ran else None


def _gemm_args(layout: BlockGemvLayout) -> tuple[int, ...]:
    n, k, row_bytes, tables = layout.meta
    c = layout.compiled
    return (
        layout.codes.data_ptr(), n, k, row_bytes, c.program.data_ptr(), c.program.numel(), c.values.data_ptr(),
        c.byte_tables.data_ptr(), tables,
    )  # fmt: skip


def gemm_available() -> bool:
    """Whether ``gemm`` runs here on the layouts it takes: the extension built, a CPU with
    AVX512-BF16 and VBMI, and the AVX-512 loops in use (``qscheme.cpu_gemv.set_isa`` /
    ``QSCHEME_CPU_GEMV_ISA``)."""
    module = native()
    return module is not None and hasattr(module, "blocks_gemm") and bool(module.blocks_gemm())


def gemm_loops() -> str | None:
    """How ``gemm`` multiplies its panels here: "amx" (the AMX tiles), "avx512" (VDPBF16PS dot
    products), or None where it does not run (``gemm_available``)."""
    module = native()
    if module is None or not hasattr(module, "blocks_gemm"):
        return None
    return {0: None, 1: "avx512", 2: "amx"}[int(module.blocks_gemm())]


GEMM_DECODERS = {1: "words", 2: "runs64", 3: "runs", 4: "elements"}


def gemm_decoder(layout: BlockGemvLayout) -> str | None:
    """Which decoder fills ``gemm``'s bfloat16 panels on this layer here: "words" (codes of at most 4
    bits from one piece, looked up 32 at a time), "runs64" (integer codes of two or three pieces, each
    a run of 64 or 32 bytes: Q3_K, Q5_K, Q6_K; 64 elements a step, ``QSCHEME_CPU_GEMM_BLOCKS_RUN64=0``
    turns it off), "runs" (two or three pieces, 32 a step), "elements" (any other layout); None where
    ``gemm`` does not run on it here (``gemm_runs``)."""
    module = native()
    if module is None or not hasattr(module, "gemm_blocks_decoder"):
        return None
    return GEMM_DECODERS.get(int(module.gemm_blocks_decoder(*_gemm_args(layout))))


def gemm_runs(layout: BlockGemvLayout) -> bool:
    """Whether ``gemm`` runs on this layer here: the extension built, a CPU with AVX512-BF16 and VBMI, the
    AVX-512 loops in use (``qscheme.cpu_gemv.set_isa`` / ``QSCHEME_CPU_GEMV_ISA``) and a layout their
    block decoder reads (16 elements a chunk, blocks of a multiple of 32 elements)."""
    module = native()
    if module is None or not hasattr(module, "gemm_blocks"):
        return False
    return bool(module.gemm_blocks(0, 0, 0, layout.n, 0, 0, 0, 1, GEMM_CHUNK, *_gemm_args(layout)))


def _run_gemm(
    x: Tensor,
    codes: Tensor,
    program: Tensor,
    values: Tensor,
    byte_tables: Tensor,
    bias: Tensor | None,
    meta: list[int] | tuple[int, ...],
    start: int,
    stop: int,
    threads: int,
    out: Tensor | None = None,
) -> Tensor:
    module = _require_native()
    n, k, row_bytes, tables = meta
    if x.dtype != torch.bfloat16 or x.ndim != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise UsageError(
            f"qscheme::cpu_gemm_blocks takes a CPU bfloat16 x of shape [M, {k}], not {x.dtype} {list(x.shape)} "
            f"on {x.device}"
        )
    if not 0 <= start <= stop <= n:
        raise UsageError(f"qscheme::cpu_gemm_blocks: rows [{start}, {stop}) are not within N={n}")
    x = x if x.is_contiguous() else x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, stop - start, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (m, stop - start) or (m and out.stride(1) != 1):
        raise UsageError(f"qscheme::cpu_gemm_blocks: out must be bfloat16 [{m}, {stop - start}] with unit columns")
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()  # alive through the call
    if bias32 is not None and tuple(bias32.shape) != (n,):
        raise UsageError(f"qscheme::cpu_gemm_blocks: bias has shape {list(bias32.shape)}; the layer has N={n}")
    if m == 0 or stop == start:
        return out
    threads = threads or torch.get_num_threads()
    ran = module.gemm_blocks(
        x.data_ptr(), m, out.data_ptr(), out.stride(0), _address(bias32), start, stop, threads, GEMM_CHUNK,
        codes.data_ptr(), n, k, row_bytes, program.data_ptr(), program.numel(), values.data_ptr(),
        byte_tables.data_ptr(), tables,
    )  # fmt: skip
    if not ran:
        raise UsageError(
            "qscheme::cpu_gemm_blocks does not run here: it needs a CPU with AVX512-BF16 and VBMI, the AVX-512 loops "
            "in use (qscheme.cpu_gemv.set_isa) and a layout their decoder reads; check cpu_gemv_blocks.gemm_runs first"
        )
    return out


@torch.library.custom_op("qscheme::cpu_gemm_blocks", mutates_args=())
def cpu_gemm_blocks_op(
    x: Tensor,
    codes: Tensor,
    program: Tensor,
    values: Tensor,
    byte_tables: Tensor,
    bias: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    threads: int,
) -> Tensor:
    """Columns [start, stop) of y = x W^T (+ bias) over a BlockGemvLayout's tensors (bfloat16 x, AVX-512 BF16)."""
    return _run_gemm(x, codes, program, values, byte_tables, bias, meta, start, stop, threads)


@cpu_gemm_blocks_op.register_fake
def _cpu_gemm_blocks_fake(
    x: Tensor,
    codes: Tensor,
    program: Tensor,
    values: Tensor,
    byte_tables: Tensor,
    bias: Tensor | None,
    meta: list[int],
    start: int,
    stop: int,
    threads: int,
) -> Tensor:
    return x.new_empty((x.shape[0], stop - start))


def gemm(
    layout: BlockGemvLayout,
    x: Tensor,
    bias: Tensor | None = None,
    start: int = 0,
    stop: int | None = None,
    threads: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Columns [start, stop) (default: all) of ``y = x W^T (+ bias)`` for bfloat16 ``x`` [M, K] on the
    CPU (see the module docstring): [M, stop - start] bfloat16, into ``out`` where given (a view with
    unit column stride). ``bias``: [N] (all of it). ``threads``: default ``torch.get_num_threads()``.
    UsageError where it does not run here (``gemm_runs``)."""
    stop = layout.n if stop is None else stop
    count = 0 if threads is None else max(1, threads)
    c = layout.compiled
    if torch.compiler.is_compiling():
        result: Tensor = torch.ops.qscheme.cpu_gemm_blocks(
            x, layout.codes, c.program, c.values, c.byte_tables, bias, list(layout.meta), start, stop, count
        )
        return result if out is None else out.copy_(result)
    return _run_gemm(x, layout.codes, c.program, c.values, c.byte_tables, bias, layout.meta, start, stop, count, out)
