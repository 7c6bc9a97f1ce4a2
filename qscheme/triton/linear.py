"""Host side of the Triton kernels: canonical tensors -> kernel layout, and the launches.

``prepare_weight`` turns a ``CanonicalWeight`` into a ``PreparedWeight``: 4-bit codes as int32
words laid out for their decoder (``qscheme.triton.layout``), fp8 codes and e4m3 / e8m0 scales
viewed as their uint8 bits, group and block scales (and their zero points) in their stored
layout (widened where a tile's would be too narrow to stream), channel and tensor scales
folded with the per-partition global scales (and static activation scales) into one float32
multiplier per output row. ``linear`` runs the activation pre-pass when the scheme quantizes
its inputs and then the GEMM.

A fused layer whose partitions carry different static activation scales quantizes its input
once per run of partitions sharing a scale and runs the GEMM on those output rows only.

The kernels index with 32-bit integers. Where a row index times a row stride would pass 2**31
(M x K or M x N of a long prefill, a strided input, 8-bit codes of a layer of 2**31 weights),
the host launches ranges of input rows or output rows, each with its pointers advanced to its
first row, and lowers split-K where the partial sums would pass it.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from qscheme.canonical import CanonicalWeight
from qscheme.errors import QuantizeError, UsageError
from qscheme.formats import decode, get_element_format
from qscheme.formats.table import is_float_scale
from qscheme.triton import configs
from qscheme.triton.act_quant import decoded_dtype, quantize_input
from qscheme.triton.gemm import DOT_BF16, DOT_FP16, DOT_FP32, quantized_gemm_kernel, split_k_epilogue_kernel
from qscheme.triton.gemv import quantized_gemv_kernel
from qscheme.triton.launch import Launch, cdiv, has_fp8_conversion
from qscheme.triton.layout import four_bit_words
from qscheme.triton.spec import (
    ACT_RULE_NVFP4,
    ACT_RULE_STATIC,
    CODEBOOK_ID,
    DECODE_BF16,
    DECODE_FP16,
    DECODE_FP32,
    ELEMENT_IDS,
    FOUR_BIT_ELEMENTS,
    SCALE_EXACT_IN,
    SCALE_FORMAT_IDS,
    ZERO_NONE,
    ZERO_TILED,
    Specialization,
    specialize,
)

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DOT_DTYPES = {torch.float16: DOT_FP16.value, torch.bfloat16: DOT_BF16.value, torch.float32: DOT_FP32.value}


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(quantized_gemm_kernel, InterpretedFunction)


@dataclass(frozen=True)
class Segment:
    """Output rows [start, end) whose input is quantized with one static scale (None: no scale)."""

    start: int
    end: int
    static_scale: Tensor | None


@dataclass(frozen=True)
class PreparedWeight:
    """A layer in the Triton kernels' layout (see the module docstring)."""

    scheme_name: str
    spec: Specialization
    n: int
    k: int
    codes: Tensor
    scale: Tensor | None  # tiled (group / block) scales [N / rows, ceil(K / cols)], see _tiled_layout
    scale_dtype: torch.dtype | None  # the checkpoint's dtype of float tiled scales (before widening)
    zero_point: Tensor | None  # tiled like the scale, or [N] per row; a codebook's float32 table (it has none)
    row_scale: Tensor | None  # float32 [N]
    pre_scale: Tensor | None  # float32 [K]
    segments: tuple[Segment, ...]
    divisor: bool  # NVFP4 activations: the static scale is compressed-tensors' divisor
    # what the host code works out once per weight and reuses on every call: config keys and
    # gemm_launches' templates, by what they depend on
    # (not an init field: dataclasses.replace gives the new weight an empty memo of its own)
    memo: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def weight_bits(self) -> int:
        return 4 if self.spec.W_FOUR_BIT else 8


def _bits(tensor: Tensor) -> Tensor:
    """fp8 tensors as their uint8 bits; other tensors unchanged."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor.view(torch.uint8)
    return tensor


def _kernel_codes(codes: Tensor, element: str) -> Tensor:
    """Codes as the GEMM reads them: 4-bit codes as int32 words (``qscheme.triton.layout``)."""
    codes = _bits(codes)
    if element in FOUR_BIT_ELEMENTS:
        return four_bit_words(codes, element)
    return codes.contiguous()


# The K tile the heuristic picks for layers of K >= 128 when the GEMM streams scales (narrower
# tiles, for small K or FP8 decoded in software, may wait on a scale load: see _tiled_layout).
_MIN_TILE_K = 128


def _tiled_layout(values: Tensor, spec: Specialization, integers: bool = False) -> Tensor:
    """Group scales or zero points [N, ceil(K / cols)] as the GEMM loads them: row-major, and
    widened to 4-byte elements (float32, int32; exact) when a 128-wide K tile would hold under
    4 bytes of a row's values (int4 group-128 with 16-bit scales: one 2-byte scale per row and
    tile). The pipeliner copies a load asynchronously only in runs of 4 bytes or more; a
    narrower load would be waited on in every K step. e4m3 and e8m0 bits stay bytes (their
    decoders read 8-bit values); block scales (rows > 1) are a value or two per tile anyway.
    ``integers``: the values are integers (zero points), uint8 ones included, widened alike.
    """
    per_tile = max(1, _MIN_TILE_K // spec.W_SCALE_COLS) * values.element_size()
    if spec.W_SCALE_ROWS == 1 and per_tile < 4:
        if values.is_floating_point():
            values = values.float()
        elif values.dtype in (torch.int8, torch.int16) or (integers and values.dtype == torch.uint8):
            values = values.int()
    return values.contiguous()


def _per_row(values: Tensor, partitions: tuple[int, ...], what: str, scheme: str) -> Tensor:
    """A [1] or [P] float tensor -> float32 [N], each partition's value over its rows."""
    flat = values.reshape(-1).to(torch.float32)
    if flat.numel() == 1:
        return flat.expand(sum(partitions)).contiguous()
    if flat.numel() != len(partitions):
        raise QuantizeError(
            f"scheme {scheme}: {what} has {flat.numel()} values for {len(partitions)} fused partitions "
            f"{partitions}; give one per partition"
        )
    sizes = torch.tensor(partitions, device=flat.device)
    return flat.repeat_interleave(sizes)


def _row_multiplier(weight: CanonicalWeight, spec: Specialization) -> Tensor | None:
    """float32 [N]: channel or tensor scale x global scale x static activation scales."""
    scheme = weight.scheme
    partitions = weight.partitions or (weight.n,)
    factors: list[Tensor] = []
    if not spec.W_SCALE_TILED:
        scale_format = scheme.weight.scale.format
        scale = weight.scale.float() if is_float_scale(scale_format) else decode(weight.scale, scale_format)
        if scheme.weight.scale.granularity == "channel":
            factors.append(scale.reshape(-1))
        else:
            factors.append(_per_row(scale, partitions, "the tensor scale", scheme.name))
    if weight.global_scale is not None:
        factors.append(_per_row(weight.global_scale, partitions, "global_scale", scheme.name))
    if spec.A_QUANTIZED and spec.A_RULE == ACT_RULE_STATIC:
        factors.append(_per_row(_required(weight, "input_scale"), partitions, "input_scale", scheme.name))
    if spec.A_QUANTIZED and spec.A_RULE == ACT_RULE_NVFP4:
        divisor = _input_divisor(weight, spec)
        global_scale = weight.input_global_scale
        if global_scale is None and divisor is not None:
            global_scale = torch.reciprocal(divisor.float())
        if global_scale is None:
            global_scale = _required(weight, "input_global_scale")
        factors.append(_per_row(global_scale, partitions, "input_global_scale", scheme.name))
    if not factors:
        return None
    product = factors[0]
    for factor in factors[1:]:
        product = product * factor  # float32, in the reference's order (scale * global first)
    return product.contiguous()


def _required(weight: CanonicalWeight, name: str) -> Tensor:
    value = getattr(weight, name)
    if value is None:
        raise QuantizeError(
            f"scheme {weight.scheme.name}: activation quantization needs {name}, but the layer has none; "
            "the checkpoint is missing the calibrated activation scale"
        )
    return value


def _segments(weight: CanonicalWeight, spec: Specialization, device: torch.device) -> tuple[Segment, ...]:
    """Runs of partitions sharing one static activation scale (one segment when there is none)."""
    if not spec.A_QUANTIZED or spec.A_RULE not in (ACT_RULE_STATIC, ACT_RULE_NVFP4):
        return (Segment(0, weight.n, None),)
    name = "input_scale" if spec.A_RULE == ACT_RULE_STATIC else "input_global_scale"
    if _input_divisor(weight, spec) is not None:
        name = "input_global_scale_divisor"
    values = _required(weight, name).reshape(-1).to(device=device, dtype=torch.float32)
    partitions = weight.partitions or (weight.n,)
    if values.numel() == 1 or bool((values == values[0]).all()):
        return (Segment(0, weight.n, values[:1].clone()),)
    segments: list[Segment] = []
    start = 0
    for index, size in enumerate(partitions):
        value = values[index : index + 1].clone()
        previous = segments[-1] if segments else None
        if previous is not None and previous.static_scale is not None and torch.equal(previous.static_scale, value):
            segments[-1] = Segment(previous.start, start + size, previous.static_scale)
        else:
            segments.append(Segment(start, start + size, value))
        start += size
    rows = spec.W_SCALE_ROWS
    misaligned = [s.start for s in segments if s.start % rows]
    if spec.W_SCALE_TILED and misaligned:
        raise QuantizeError(
            f"scheme {weight.scheme.name}: partitions with different {name} start at row {misaligned[0]}, "
            f"inside a {rows}-row scale block; give the partitions one {name}"
        )
    return tuple(segments)


def _input_divisor(weight: CanonicalWeight, spec: Specialization) -> Tensor | None:
    """compressed-tensors' stored NVFP4 input global scale (a divisor), where the layer keeps it.

    With it the pre-pass reproduces compressed-tensors' rounding, as the reference kernel does.
    """
    if not spec.A_QUANTIZED or spec.A_RULE != ACT_RULE_NVFP4:
        return None
    return getattr(weight, "input_global_scale_divisor", None)


# The kernels index tensors with 32-bit integers: a row index times a row stride must stay
# below this in every tensor a launch reads or writes by rows.
MAX_OFFSET = 2**31 - 1


def _within_offsets(segments: tuple[Segment, ...], n: int, row_elements: int, scale_rows: int) -> tuple[Segment, ...]:
    """``segments`` cut into runs of output rows whose weight tensors (``row_elements`` per row
    in the widest) a launch can index with 32-bit offsets: each run is its own launch, with its
    pointers advanced to its first row. Runs start on ``scale_rows`` boundaries (block scales).
    Only layers of over 2**31 elements in one tensor (8-bit codes of a 2**31-weight layer) are
    cut at all."""
    if n * row_elements <= MAX_OFFSET:
        return segments
    rows = MAX_OFFSET // max(row_elements, 1)
    if rows < scale_rows:  # K past 2**31 / rows-per-block: no row range can start on a block
        raise QuantizeError(
            f"weight rows of {row_elements} elements are too wide for the Triton kernel's 32-bit offsets "
            f"in blocks of {scale_rows} rows; use the reference kernel (kernel='reference')"
        )
    rows -= rows % scale_rows
    bounded: list[Segment] = []
    for segment in segments:
        for start in range(segment.start, segment.end, rows):
            bounded.append(Segment(start, min(start + rows, segment.end), segment.static_scale))
    return tuple(bounded)


def _row_chunk(x: Tensor, prepared: PreparedWeight) -> int:
    """Input rows per launch such that every tensor indexed by input row (x, the pre-pass's
    codes and scales, the output) stays within 32-bit offsets: all of them unless M x K or
    M x N reaches 2**31 (long prefills)."""
    return max(1, MAX_OFFSET // max(x.stride(0), prepared.k, prepared.n, 1))


def _fit_split_k(tile: configs.TileConfig, m: int, rows: int) -> configs.TileConfig:
    """``tile`` with split-K lowered (halved) until the float32 partial sums [split_k, M, rows]
    are within 32-bit offsets; split-K is meant for small M, where it never is."""
    split_k = tile.split_k
    while split_k > 1 and split_k * m * rows > MAX_OFFSET:
        split_k //= 2
    return tile if split_k == tile.split_k else replace(tile, split_k=split_k)


def _zero_point_bytes(weight: CanonicalWeight) -> Tensor:
    """Tiled zero points as the GEMM loads them: uint8 for unsigned zero-point formats (uint8
    holds 0..255), int8 for signed ones; exact, as canonical zero points lie in their format's
    range (``qscheme.canonical.canonical_zero_point``)."""
    spec = weight.scheme.weight.zero_point
    assert weight.zero_point is not None and spec is not None
    return weight.zero_point.to(torch.int8 if get_element_format(spec.format).signed else torch.uint8)


def prepare_weight(weight: CanonicalWeight, device: torch.device | str) -> PreparedWeight:
    """Canonical tensors -> the Triton kernels' layout on ``device`` (see the module docstring)."""
    device = torch.device(device)
    spec = specialize(weight.scheme)
    weight = weight.to(device)
    scale = zero_point = None
    scale_dtype = None
    if spec.W_SCALE_TILED:
        scale_dtype = weight.scale.dtype
        scale = _tiled_layout(_bits(weight.scale), spec)
        if weight.zero_point is not None:
            zero_point = _tiled_layout(_zero_point_bytes(weight).reshape(weight.scale.shape), spec, integers=True)
    elif weight.zero_point is not None:  # channel or tensor zero points: one per output row
        zero_point = weight.zero_point.reshape(-1).to(torch.float32)
        if zero_point.numel() != weight.n:
            zero_point = _per_row(zero_point, weight.partitions or (weight.n,), "zero_point", weight.scheme.name)
    pre_scale = None
    if weight.input_pre_scale is not None:
        pre_scale = weight.input_pre_scale.reshape(-1).to(torch.float32).contiguous()
    codes = _kernel_codes(weight.codes, weight.scheme.weight.format)
    table = weight.scheme.weight.table
    if table is not None:  # a codebook has no zero points: the kernels read its table where they would
        zero_point = torch.tensor(table, dtype=torch.float32, device=device)
    tiled = [t.stride(0) for t in (scale, zero_point) if t is not None and t.dim() == 2]
    row_elements = max([codes.stride(0), *tiled])  # the widest row of the weight's tensors
    return PreparedWeight(
        scheme_name=weight.scheme.name,
        spec=spec,
        n=weight.n,
        k=weight.k,
        codes=codes,
        scale=scale,
        scale_dtype=scale_dtype,
        zero_point=zero_point,
        row_scale=_row_multiplier(weight, spec),
        pre_scale=pre_scale,
        segments=_within_offsets(_segments(weight, spec, device), weight.n, row_elements, spec.W_SCALE_ROWS),
        divisor=_input_divisor(weight, spec) is not None,
    )


def _native_fp8(backend: str, device: torch.device) -> bool:
    """Whether e4m3 can be decoded by a hardware conversion: CUDA compute capability 8.9 or
    newer, and the interpreter (exact there for every code but NaN, which checkpoints lack)."""
    if backend == "interpreter":
        return True
    if backend != "cuda":
        return False
    return has_fp8_conversion(_capability(_device_index(device)))


def _device_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


@functools.cache
def _device_facts(index: int) -> configs.DeviceFacts:
    properties = torch.cuda.get_device_properties(index)
    shared = int(getattr(properties, "shared_memory_per_block_optin", 0) or 48 * 1024)
    # ROCm reports its gfx version as a capability: not a CUDA one
    capability = None if torch.version.hip else _capability(index)
    return configs.DeviceFacts(properties.name, int(properties.multi_processor_count), shared, capability)


def _config(
    prepared: PreparedWeight, x: Tensor, rows: int, launch: Callable[[configs.TileConfig], None]
) -> configs.TileConfig:
    """The tile config for x [M, K] (the layer input, before any quantization) on ``rows`` rows."""
    m, k = x.shape
    if interpreted():
        return configs.interpreted_config(m, rows, k)
    index = _device_index(x.device)
    bucket = configs.m_bucket(m)
    gemv = runs_gemv(prepared.spec, x.dtype) and m <= configs.GEMV_MAX_M
    memo = ("config key", index, x.dtype, bucket, rows, gemv)
    key = prepared.memo.get(memo)
    if key is None:  # the cache key, as text (it is also the config file's key)
        parts = (_device_facts(index).name, prepared.spec, x.dtype, bucket, rows, k) + (("gemv",) if gemv else ())
        key = prepared.memo.setdefault(memo, "|".join(str(part) for part in parts))

    def time_config(config: configs.TileConfig) -> float:
        from triton.testing import do_bench

        return float(do_bench(lambda: launch(config), warmup=5, rep=20))

    def heuristic() -> configs.TileConfig:
        return heuristic_for(prepared, m, rows, k, x.dtype, _device_facts(index))

    return configs.choose_config(key, k, heuristic, time_config)


def heuristic_for(
    prepared: PreparedWeight, m: int, rows: int, k: int, input_dtype: torch.dtype, device: configs.DeviceFacts
) -> configs.TileConfig:
    """``configs.heuristic_config`` for this weight: its code width, decode variant and tiled
    scales. The dot runs in x's dtype whether or not x is quantized first: tiles are sized for it."""
    spec = prepared.spec
    return configs.heuristic_config(
        m,
        rows,
        k,
        prepared.weight_bits,
        input_dtype.itemsize,
        device,
        wide_decode(spec, input_dtype, prepared.scale_dtype),
        scale_tiles(prepared),
        software_decodes_both=_software_decodes_both(spec, input_dtype, device),
        gemv=runs_gemv(spec, input_dtype),
    )


ASM_DECODE_VARIABLE = "QSCHEME_TRITON_ASM_DECODE"
# Element formats whose CUDA launches take the inline-PTX decoders by default: those whose
# static count per weight goes down with them (int4 and uint4, 4-12% fewer loop instructions on
# sm80-sm120; e2m1 compiles to the same SASS either way). docs/notes/triton-decode.md.
ASM_DECODE_DEFAULT_FORMATS = (ELEMENT_IDS["int4"], ELEMENT_IDS["uint4"])


def asm_decode_enabled(spec: Specialization) -> bool:
    """Whether CUDA launches decode this weight's 4-bit words with the inline-PTX decoders
    (``qscheme.triton.asm_decode``: bit for bit the pure decoders' results, proven on the host
    by emulating the PTX program over every byte value). ``QSCHEME_TRITON_ASM_DECODE=1`` takes
    them for every format they cover, ``=0`` for none; unset, ``ASM_DECODE_DEFAULT_FORMATS``."""
    value = os.environ.get(ASM_DECODE_VARIABLE, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise UsageError(f"{ASM_DECODE_VARIABLE}={value!r}: expected 0 or 1 (or unset for the default)")
    return spec.W_FOUR_BIT and spec.W_FORMAT in ASM_DECODE_DEFAULT_FORMATS


GEMV_VARIABLE = "QSCHEME_TRITON_GEMV"


def runs_gemv(spec: Specialization, input_dtype: torch.dtype) -> bool:
    """Whether the tile heuristic may choose the CUDA-core GEMV (``qscheme.triton.gemv``) at
    M <= ``configs.GEMV_MAX_M``: weight-only schemes with 16-bit inputs (the GEMV multiplies
    the inputs as given; quantized activations take the GEMM and its pre-pass), and only with
    ``QSCHEME_TRITON_GEMV=1``. The GEMV has not been timed on a GPU and its static count per
    weight (docs/notes/triton-decode.md) is above the GEMM tile's, so the GEMM's tiles stay the
    default at every M until a GPU run (benchmarks/gpu_gemm.py times both) shows it faster."""
    from qscheme.environment import env_flag

    if not env_flag(GEMV_VARIABLE):
        return False
    return not spec.A_QUANTIZED and input_dtype in (torch.bfloat16, torch.float16)


def _software_decodes_both(spec: Specialization, input_dtype: torch.dtype, device: configs.DeviceFacts) -> bool:
    """Whether the K loop decodes e4m3 codes of both operands with integer operations: fp8
    weights and fp8 activations kept as codes (``act_quant.decoded_dtype``), on a GPU without
    the hardware conversion (``_native_fp8``: compute capability before 8.9, or ROCm)."""
    e4m3 = ELEMENT_IDS["e4m3"]
    codes_kept = spec.A_QUANTIZED and decoded_dtype(spec, input_dtype) is None
    return spec.W_FORMAT == e4m3 and codes_kept and spec.A_FORMAT == e4m3 and not has_fp8_conversion(device.capability)


def scale_tiles(prepared: PreparedWeight) -> configs.ScaleTiles | None:
    """The weight's tiled scales (and zero points) as the tile heuristic sizes shared memory."""
    if not prepared.spec.W_SCALE_TILED or prepared.scale is None:
        return None
    value_bytes = prepared.scale.element_size()
    if prepared.spec.W_ZERO == ZERO_TILED and prepared.zero_point is not None:
        value_bytes += prepared.zero_point.element_size()
    return configs.ScaleTiles(prepared.spec.W_SCALE_COLS, value_bytes)


def wide_decode(spec: Specialization, input_dtype: torch.dtype, scale_dtype: torch.dtype | None = None) -> bool:
    """Whether the tile heuristic uses its wide decode tiles (``configs.heuristic_config``):
    4-bit weights decoded in the 16-bit dot dtype on a GPU, with 16-bit inputs or inputs the
    pre-pass hands over decoded (``act_quant.decoded_dtype``). Measured faster on an
    H200 for NVFP4 with bf16 inputs; int4 and uint4 run the same decode structure, and their
    static loop cost per weight drops from 165 to 125 warp instructions per 1K weights at the
    64-wide tile (benchmarks/triton_sass.py). ``scale_dtype``: the checkpoint's dtype of float
    tiled scales (``PreparedWeight.scale_dtype``)."""
    if not spec.W_FOUR_BIT or (spec.A_QUANTIZED and decoded_dtype(spec, input_dtype) is None):
        return False
    return decode_dtype(spec, input_dtype, scale_dtype, True) != DECODE_FP32


def linear(
    prepared: PreparedWeight, x: Tensor, bias: Tensor | None = None, config: configs.TileConfig | None = None
) -> Tensor:
    """y = x @ W^T (+ bias) for x [..., K] in float16, bfloat16 or float32; y has x's dtype.

    ``config`` forces a tile configuration (tests); by default one is chosen per problem size.
    The result carries no gradient: ``QuantLinear`` is the autograd-aware entry point.
    """
    if x.dtype not in _INPUT_DTYPES:
        raise QuantizeError(f"the Triton kernel takes float16, bfloat16 or float32 inputs, not {x.dtype}")
    if x.shape[-1] != prepared.k:
        raise QuantizeError(
            f"scheme {prepared.scheme_name}: input has {x.shape[-1]} features, the layer takes K={prepared.k}"
        )
    if bias is not None:
        if bias.shape != (prepared.n,):
            raise QuantizeError(f"bias has shape {tuple(bias.shape)}, expected [{prepared.n}]")
        if bias.stride(0) != 1:  # the epilogue reads it as contiguous (a strided or expanded view)
            bias = bias.contiguous()
    leading = x.shape[:-1]
    x2 = x.reshape(-1, prepared.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    # The interpreter stores float32 -> bfloat16 by truncation: keep float32 and round in torch.
    out_dtype = torch.float32 if interpreted() and x.dtype == torch.bfloat16 else x.dtype
    out = torch.empty((m, prepared.n), dtype=out_dtype, device=x.device)
    chunk = _row_chunk(x2, prepared)  # 32-bit offsets: long inputs run as row ranges of x and out
    rows = [(x2, out)] if m <= chunk else [(x2[b : b + chunk], out[b : b + chunk]) for b in range(0, m, chunk)]
    for segment in prepared.segments if m > 0 else ():
        for x_rows, out_rows in rows:
            _run_segment(prepared, segment, x_rows, bias, out_rows, config)
    return out.to(x.dtype).reshape(*leading, prepared.n)


def _run_segment(
    prepared: PreparedWeight,
    segment: Segment,
    x: Tensor,
    bias: Tensor | None,
    out: Tensor,
    config: configs.TileConfig | None,
) -> None:
    spec = prepared.spec
    x_scale: Tensor | None = None
    inputs = x
    decoded = False
    if spec.A_QUANTIZED:
        quantized = quantize_input(
            x,
            spec,
            static_scale=segment.static_scale,
            divisor=prepared.divisor,
            pre_scale=prepared.pre_scale,
            decoded=decoded_dtype(spec, torch.float32 if interpreted() else x.dtype),
        )
        inputs, x_scale, decoded = quantized.codes, quantized.scale, quantized.decoded
    rows = segment.end - segment.start

    def launch(tile: configs.TileConfig) -> None:
        for step in gemm_launches(prepared, segment, inputs, x_scale, bias, out, tile, x.dtype, decoded_input=decoded):
            step.run()

    launch(config or _config(prepared, x, rows, launch))


def _fold_scale(spec: Specialization, input_dtype: torch.dtype, on_gpu: bool) -> bool:
    """Whether the e2m1 decoder's power of two goes into the e4m3 group scale (the 16-bit dot
    paths; ``gemm._scale_as``)."""
    return (
        on_gpu
        and input_dtype in (torch.bfloat16, torch.float16)
        and spec.W_FORMAT == ELEMENT_IDS["e2m1"]
        and spec.W_SCALE_TILED
        and spec.W_ZERO == ZERO_NONE
        and spec.W_SCALE_FORMAT == SCALE_FORMAT_IDS["e4m3"]
    )


_HALF_DECODE = {torch.bfloat16: DECODE_BF16, torch.float16: DECODE_FP16}

SPLIT_K_VARIABLE = "QSCHEME_TRITON_SPLIT_K"
SPLIT_K_MODES = ("two-pass", "fused")


def split_k_mode() -> str:
    """How split-K partial sums are reduced, from ``QSCHEME_TRITON_SPLIT_K``: ``two-pass`` (the
    default: a second small kernel adds them) or ``fused`` (the last program of each output
    tile adds them in the GEMM launch: one launch fewer per call; not yet timed or tested on a
    GPU, hence opt-in). Both sum in split order: the outputs are bit for bit the same."""
    value = os.environ.get(SPLIT_K_VARIABLE, "").strip().lower() or SPLIT_K_MODES[0]
    if value not in SPLIT_K_MODES:
        raise QuantizeError(
            f"{SPLIT_K_VARIABLE}={value!r} is not one of {', '.join(SPLIT_K_MODES)}; unset it for the default"
        )
    return value


# Per (device, stream): int32 arrival counters of the fused split-K reduction, zero between
# launches (each tile's last program resets its own). Launches on one stream run in order, so
# they can share one buffer; another stream gets its own.
_COUNTERS: dict[tuple[str, int], Tensor] = {}


def _split_k_counters(device: torch.device, tiles: int) -> Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), int(stream))
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def decode_dtype(spec: Specialization, input_dtype: torch.dtype, scale_dtype: torch.dtype | None, on_gpu: bool) -> int:
    """The dtype 4-bit weights are decoded in (a ``DECODE_*`` id): the 16-bit dot dtype where
    every decoded weight, times its tiled scale, is rounded once as it is in float32, else
    float32 (8-bit codes and the interpreter always).

    4-bit values are exact in either 16-bit dtype. A tiled scale must be exact in the dtype
    too: stored in it (``scale_dtype``, the checkpoint's), or e4m3, or e8m0 (bfloat16 only);
    the kernel then casts it to the decode dtype.
    """
    half = _HALF_DECODE.get(input_dtype)
    if not on_gpu or not spec.W_FOUR_BIT or half is None or spec.W_FORMAT == CODEBOOK_ID:
        return DECODE_FP32  # a codebook's values (NF4's quantiles) are exact in float32 only
    if not spec.W_SCALE_TILED:
        return half
    exact_in = SCALE_EXACT_IN.get(spec.W_SCALE_FORMAT)
    if exact_in is not None:  # e4m3, e8m0
        return half if input_dtype in exact_in else DECODE_FP32
    return half if scale_dtype == input_dtype else DECODE_FP32


def gemm_launches(
    prepared: PreparedWeight,
    segment: Segment,
    inputs: Tensor,
    x_scale: Tensor | None,
    bias: Tensor | None,
    out: Tensor,
    tile: configs.TileConfig,
    input_dtype: torch.dtype,
    backend: str | None = None,
    native_fp8: bool | None = None,
    decoded_input: bool = False,
    fused_split_k: bool | None = None,
    asm_decode: bool | None = None,
) -> list[Launch]:
    """The GEMM (and split-K epilogue) launches for one segment of output rows.

    ``inputs`` is x [M, K], its quantized codes, or (``decoded_input``) the pre-pass's decoded
    values in the dot's dtype, read like x; ``input_dtype`` is the dtype of x (it picks the
    dot's dtype), ``out`` the whole [M, N] output. ``fused_split_k`` (default: the
    ``QSCHEME_TRITON_SPLIT_K`` setting, see ``split_k_mode``) reduces split-K partial sums in
    the GEMM launch itself instead of a second one. ``backend`` ("cuda", "hip" or "interpreter")
    defaults to the one this process runs; ``native_fp8`` (decode e4m3 with the hardware
    conversion) to whether ``inputs``' device has it. ``asm_decode`` (default: the
    ``QSCHEME_TRITON_ASM_DECODE`` setting, see ``asm_decode_enabled``) decodes 4-bit words with
    the inline-PTX decoders; it applies to CUDA launches only.

    What depends on the weight and the tile alone (weight pointers, constexprs, labels) is
    built once per weight and kept (``_gemm_template``); a call adds its own tensors and M.
    """
    if backend is None:
        backend = "interpreter" if interpreted() else ("hip" if torch.version.hip else "cuda")
    if native_fp8 is None:
        native_fp8 = _native_fp8(backend, inputs.device)
    if fused_split_k is None:
        fused_split_k = split_k_mode() == "fused"
    tile = _fit_split_k(tile, inputs.shape[0], segment.end - segment.start)
    fused = fused_split_k and tile.split_k > 1
    has_bias = bias is not None
    if asm_decode is None:
        asm_decode = asm_decode_enabled(prepared.spec)
    asm_decode = asm_decode and backend == "cuda"
    key = (segment, tile, input_dtype, backend, native_fp8, decoded_input, fused, has_bias, asm_decode)
    template = prepared.memo.get(key)
    if template is None:
        template = _gemm_template(
            prepared, segment, tile, input_dtype, backend, native_fp8, decoded_input, fused, has_bias, asm_decode
        )
        prepared.memo[key] = template
    return template.launches(inputs, x_scale, bias, out)


@dataclass(frozen=True)
class _GemmTemplate:
    """The launches of one (weight, segment, tile, dtype, ...) with the per-call arguments left
    out: ``launches`` fills them in (see ``gemm_launches``)."""

    tile: configs.TileConfig
    fused: bool
    kernel: Any  # quantized_gemm_kernel, or quantized_gemv_kernel for a GEMV tile
    start: int  # the segment's output rows [start, end)
    end: int
    whole: bool  # the segment is every row: the call's out and bias are passed as they are
    placeholder: Tensor  # any pointer, for arguments a specialisation does not read
    gemm_args: dict[str, Any]  # the weight's pointers, strides and sizes
    gemm_constexprs: Mapping[str, Any]  # read-only: every launch from the template shares it
    gemm_label: str
    epilogue_args: dict[str, Any]  # the epilogue's pointers that do not change per call
    epilogue_constexprs: Mapping[str, Any]
    epilogue_label: str

    def launches(self, inputs: Tensor, x_scale: Tensor | None, bias: Tensor | None, out: Tensor) -> list[Launch]:
        tile, start, end, placeholder = self.tile, self.start, self.end, self.placeholder
        rows = end - start
        m = inputs.shape[0]
        out_rows = out if self.whole else out[:, start:end]
        bias_rows = bias if bias is None or self.whole else bias[start:end]
        tiles = cdiv(m, tile.block_m) * cdiv(rows, tile.block_n)
        partial, stride_split, counters = out_rows, 0, placeholder
        if tile.split_k > 1:
            partial = torch.empty((tile.split_k, m, rows), dtype=torch.float32, device=inputs.device)
            stride_split = partial.stride(0)
            if self.fused:
                counters = _split_k_counters(inputs.device, tiles)
        # What the epilogue reads, in the GEMM or in the split-K epilogue kernel.
        epilogue_args = {
            **self.epilogue_args,
            "x_scale_ptr": placeholder if x_scale is None else x_scale,
            "bias_ptr": placeholder if bias_rows is None else bias_rows,
        }
        gemm = Launch(
            kernel=self.kernel,
            grid=(tiles, tile.split_k),
            args={
                **self.gemm_args,
                **epilogue_args,
                "x_ptr": inputs,
                "out_ptr": partial,
                "final_ptr": out_rows,
                "counter_ptr": counters,
                "M": m,
                "stride_xm": inputs.stride(0),
                "stride_xs": 0 if x_scale is None else x_scale.stride(0),
                "stride_om": out_rows.stride(0),
                "stride_split": stride_split,
                "x_scale_cols": 0 if x_scale is None or x_scale.dim() < 2 else x_scale.shape[1],
            },
            constexprs=self.gemm_constexprs,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
            label=self.gemm_label,
        )
        if tile.split_k == 1 or self.fused:
            return [gemm]
        block_m, block_n = self.epilogue_constexprs["BLOCK_M"], self.epilogue_constexprs["BLOCK_N"]
        epilogue = Launch(
            kernel=split_k_epilogue_kernel,
            grid=(cdiv(m, block_m), cdiv(rows, block_n)),
            args={
                **epilogue_args,
                "partial_ptr": partial,
                "out_ptr": out_rows,
                "M": m,
                "N": rows,
                "stride_split": stride_split,
                "stride_om": out_rows.stride(0),
            },
            constexprs=self.epilogue_constexprs,
            num_warps=4,
            num_stages=1,
            label=self.epilogue_label,
        )
        return [gemm, epilogue]


def mask_k(spec: Specialization, k: int, block_k: int) -> bool:
    """Whether the GEMM zeroes decoded weights past K (``gemm.load_weight_tile``): where a K
    tile runs past K and a tiled zero point makes padding codes decode to non-zero values."""
    return spec.W_ZERO == ZERO_TILED and k % block_k != 0


def _gemm_template(
    prepared: PreparedWeight,
    segment: Segment,
    tile: configs.TileConfig,
    input_dtype: torch.dtype,
    backend: str,
    native_fp8: bool,
    decoded_input: bool,
    fused: bool,
    has_bias: bool,
    asm_decode: bool,
) -> _GemmTemplate:
    spec = prepared.spec
    start, end = segment.start, segment.end
    scale_start = start // spec.W_SCALE_ROWS
    w_scale = None if prepared.scale is None else prepared.scale[scale_start:]
    if prepared.zero_point is None:
        w_zero = None
    elif spec.W_FORMAT == CODEBOOK_ID:  # the whole table (see prepare_weight)
        w_zero = prepared.zero_point
    elif spec.W_SCALE_TILED:
        w_zero = prepared.zero_point[scale_start:]
    else:
        w_zero = prepared.zero_point[start:end]
    row_scale = None if prepared.row_scale is None else prepared.row_scale[start:end]
    pre_scale = prepared.pre_scale if not spec.A_QUANTIZED else None
    on_gpu = backend != "interpreter"
    placeholder = prepared.codes  # any pointer, for arguments a specialisation does not read
    if tile.gemv and spec.A_QUANTIZED and not decoded_input:
        raise QuantizeError(
            f"scheme {prepared.scheme_name}: the GEMV tile {tile.describe()} takes 16- or 32-bit inputs, but the "
            "scheme quantizes its activations to codes; use a GEMM tile (gemv=False)"
        )
    return _GemmTemplate(
        tile=tile,
        fused=fused,
        kernel=quantized_gemv_kernel if tile.gemv else quantized_gemm_kernel,
        start=start,
        end=end,
        whole=start == 0 and end == prepared.n,
        placeholder=placeholder,
        gemm_args={
            "pre_scale_ptr": placeholder if pre_scale is None else pre_scale,
            "w_ptr": prepared.codes[start:end],
            "w_scale_ptr": placeholder if w_scale is None else w_scale,
            "w_zero_ptr": placeholder if w_zero is None else w_zero,
            "N": end - start,
            "K": prepared.k,
            "stride_wn": prepared.codes.stride(0),
            "stride_ws": 0 if w_scale is None else w_scale.stride(0),
            "w_scale_cols": 0 if w_scale is None else w_scale.shape[1],
        },
        gemm_constexprs=types.MappingProxyType(
            {
                **spec.gemm_constexprs(),
                "A_QUANTIZED": spec.A_QUANTIZED and not decoded_input,
                "FUSED_SPLIT_K": fused,
                "HAS_PRE_SCALE": pre_scale is not None,
                "HAS_ROW_SCALE": row_scale is not None,
                "HAS_BIAS": has_bias,
                "DOT_DTYPE": _DOT_DTYPES[input_dtype] if on_gpu else DOT_FP32.value,
                "USE_PTX": backend == "cuda",
                "ASM_DECODE": asm_decode,
                "W_DECODE": decode_dtype(spec, input_dtype, prepared.scale_dtype, on_gpu),
                "W_FOLD_SCALE": _fold_scale(spec, input_dtype, on_gpu),
                "NATIVE_FP8": native_fp8,
                "BLOCK_M": tile.block_m,
                "BLOCK_N": tile.block_n,
                "BLOCK_K": tile.block_k,
                "SPLIT_K": tile.split_k,
                "GROUP_M": tile.group_m,
                "WEIGHTS_FIRST": tile.weights_first,
                "W_MASK_K": mask_k(spec, prepared.k, tile.block_k),
            }
        ),
        gemm_label=f"{'gemv' if tile.gemv else 'gemm'} {prepared.scheme_name} {tile.describe()}",
        epilogue_args={"row_scale_ptr": placeholder if row_scale is None else row_scale},
        epilogue_constexprs=types.MappingProxyType(
            {
                "A_SCALE": spec.A_SCALE,
                "HAS_ROW_SCALE": row_scale is not None,
                "HAS_BIAS": has_bias,
                "SPLIT_K": tile.split_k,
                "BLOCK_M": min(tile.block_m, 32),
                "BLOCK_N": 128,
            }
        ),
        epilogue_label=f"split-k epilogue {prepared.scheme_name}",
    )


__all__ = [
    "PreparedWeight",
    "Segment",
    "gemm_launches",
    "heuristic_for",
    "interpreted",
    "linear",
    "prepare_weight",
    "runs_gemv",
    "scale_tiles",
    "wide_decode",
]
