"""The native FP4 kernels' code: NVFP4 x NVFP4 and MXFP4 x MXFP4 through ``torch.nn.functional.scaled_mm``.

Declared in ``qscheme_plugins.native_fp4`` (``native_fp4`` for NVFP4, ``native_mxfp4`` for
MXFP4; see its docstring for what each claims). ``apply`` is three steps, each testable alone:

(a) **activation quantization** (``quantize_input``): e2m1 codes, one per element, and block
    scales (e4m3 per 16, or e8m0 per 32) bit-identical to ``qscheme.emulation.quantize_activation``,
    the reference kernel's emulation. On a GPU the Triton pre-pass (``qscheme.triton.act_quant``)
    computes them; elsewhere the emulation itself does. An AWQ pre-scale multiplies the input first.
(b) **operand building** (``activation_operand``, ``weight_operand``): codes packed two per byte
    along K, element 2j in the LOW nibble (the canonical order, and the order of
    ``torch.float4_e2m1fn_x2``: torch's own test helper packs ``x[1::2] << 4 | x[::2]``), viewed as
    ``float4_e2m1fn_x2``; K padded with zero codes to a multiple of four scale groups (64 for
    NVFP4, 128 for MXFP4); block scales padded to 128 rows and a multiple of 4 columns and
    swizzled into cuBLAS's 128x4 tile layout (``SwizzleType.SWIZZLE_32_4_4``): element (r, c) of
    the scale matrix lands at ``512 * ((r // 128) * column_tiles + c // 4) + (r % 32) * 16 +
    ((r % 128) // 32) * 4 + c % 4``. Weight rows are padded to 128 (zero codes) at ``prepare``;
    the activation's rows are not padded, only its scales (M = 1 needs a 128-row scale tile).
(c) **the GEMM** (``scaled_mm_arguments``): ``scaled_mm(a, w.t(), ...)``, the weight passed
    transposed (column-major). NVFP4 takes scale lists ``[block_scales, global_scale]`` with
    recipes ``[BlockWise1x16, TensorWise]`` and swizzles ``[SWIZZLE_32_4_4, NO_SWIZZLE]``; torch
    multiplies the block-scaled product by ``alpha = global_a * global_b`` (both float32 dequant
    multipliers; ``_scaled_nvfp4_nvfp4`` in ``aten/src/ATen/native/cuda/ScaledBlas.cpp``). MXFP4
    takes one e8m0 scale per operand, ``BlockWise1x32``, no global scale.

The output is sliced back to N, the bias added in float32 (never passed to the GEMM: torch's
MXFP4 path ignores it) and the sum rounded to the input's dtype. A fused layer runs one GEMM per
run of adjacent partitions sharing their weight and input global scales; the input is quantized
once per distinct input global scale, so partitions with different scales are exact, never a
shared maximum. The GEMM function is injectable (``NativeFp4Kernel(scaled_mm=...)``): tests
replace it with an exact CPU emulation of its documented semantics, since torch runs it only
on compute capability 10.x / 12.x ("CPU does not support swizzle").
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional

from qscheme.canonical import CanonicalWeight
from qscheme.descriptor import ActivationSpec
from qscheme.emulation import apply_pre_scale, quantize_activation
from qscheme.errors import QuantizeError, UsageError

SCALE_TILE_ROWS = 128  # rows of one swizzled block-scale tile
SCALE_TILE_COLUMNS = 4  # block-scale columns of one tile
WEIGHT_ROW_MULTIPLE = 128  # weight rows padded to whole scale tiles (torch checks N % 16)

ScaledMm = Callable[..., Tensor]


@dataclass(frozen=True)
class Fp4Format:
    """One block-scaled FP4 format as torch's GEMM takes it."""

    name: str
    group_size: int
    scale_dtype: torch.dtype
    has_global_scale: bool

    @property
    def k_multiple(self) -> int:
        """K is padded to whole tiles of 4 scale columns."""
        return SCALE_TILE_COLUMNS * self.group_size


NVFP4 = Fp4Format("nvfp4", 16, torch.float8_e4m3fn, True)
MXFP4 = Fp4Format("mxfp4", 32, torch.float8_e8m0fnu, False)
_FORMATS = {"e4m3": NVFP4, "e8m0": MXFP4}


def fp4_format(weight: CanonicalWeight) -> Fp4Format:
    """The format of an e2m1 layer with e4m3 or e8m0 group scales; QuantizeError otherwise."""
    spec = weight.scheme.weight
    fmt = _FORMATS.get(spec.scale.format)
    activation = weight.scheme.activation
    if (
        spec.format != "e2m1"
        or fmt is None
        or spec.scale.granularity != "group"
        or spec.scale.group_size != fmt.group_size
        or activation is None
        or activation.format != "e2m1"
        or activation.scale_format != spec.scale.format
        or activation.group_size != fmt.group_size
    ):
        raise QuantizeError(
            f"scheme {weight.scheme.name}: the native FP4 GEMM takes e2m1 weights and activations in groups "
            "of 16 with e4m3 scales (NVFP4) or of 32 with e8m0 scales (MXFP4)"
        )
    return fmt


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


# --- (b) operands ----------------------------------------------------------------------------------


def scale_bits(scale: Tensor) -> Tensor:
    """Block scales as their bytes (uint8): e4m3 viewed, e8m0 bytes as they are."""
    return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale


def swizzle_block_scales(bits: Tensor) -> Tensor:
    """uint8 block scales [rows, columns] -> flat uint8 in cuBLAS's 128x4 tile layout.

    Rows are padded to 128 and columns to 4 with zero bytes; element (r, c) lands at
    ``512 * ((r // 128) * column_tiles + c // 4) + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``.
    """
    rows, columns = bits.shape
    padded_rows, padded_columns = round_up(rows, SCALE_TILE_ROWS), round_up(columns, SCALE_TILE_COLUMNS)
    if (padded_rows, padded_columns) != (rows, columns):
        bits = functional.pad(bits, (0, padded_columns - columns, 0, padded_rows - rows))
    tiles = bits.reshape(padded_rows // SCALE_TILE_ROWS, SCALE_TILE_ROWS, padded_columns // SCALE_TILE_COLUMNS, 4)
    # [row tile, column tile, 128 rows, 4] -> per tile [4 row groups of 32, 32, 4] -> [32, 4 groups, 4]
    per_tile = tiles.permute(0, 2, 1, 3).reshape(-1, 4, 32, SCALE_TILE_COLUMNS).transpose(1, 2)
    return per_tile.reshape(-1)


def pack_codes(codes: Tensor, k_padded: int) -> Tensor:
    """e2m1 codes uint8 [rows, K] (one per element, 0..15) -> float4_e2m1fn_x2 [rows, k_padded / 2]:
    element 2j in the low nibble, K zero-padded."""
    if codes.shape[-1] != k_padded:
        codes = functional.pad(codes, (0, k_padded - codes.shape[-1]))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


@dataclass(frozen=True)
class Operand:
    """One GEMM operand: codes float4_e2m1fn_x2 [rows, K_padded / 2] row-major, block scales
    swizzled (flat, e4m3 or e8m0), and NVFP4's float32 [1] global dequant multiplier."""

    codes: Tensor
    block_scale: Tensor
    global_scale: Tensor | None

    def to(self, device: torch.device | str) -> Operand:
        """The same operand on ``device`` (tests move it to the meta device)."""
        moved = None if self.global_scale is None else self.global_scale.to(device)
        return Operand(self.codes.to(device), self.block_scale.to(device), moved)


def _operand_scales(scale: Tensor, fmt: Fp4Format, k_padded: int) -> Tensor:
    bits = scale_bits(scale)
    columns = k_padded // fmt.group_size
    if bits.shape[1] != columns:
        bits = functional.pad(bits, (0, columns - bits.shape[1]))
    return swizzle_block_scales(bits).view(fmt.scale_dtype)


def activation_operand(
    codes: Tensor, scale: Tensor, global_scale: Tensor | None, fmt: Fp4Format, k_padded: int
) -> Operand:
    """The quantized input as operand a: ``codes`` uint8 [M, K] one per element, ``scale`` [M,
    ceil(K / group)] (e4m3, or e8m0 bytes as uint8). M is not padded; its scales are."""
    return Operand(pack_codes(codes, k_padded), _operand_scales(scale, fmt, k_padded), global_scale)


def weight_operand(
    packed: Tensor, scale: Tensor, global_scale: Tensor | None, fmt: Fp4Format, k_padded: int
) -> Operand:
    """Canonical weight rows as operand b: ``packed`` uint8 [n, ceil(K / 2)] (element 2j low),
    ``scale`` [n, ceil(K / group)]. Rows are padded to 128 and K to ``k_padded`` with zero codes."""
    rows = packed.shape[0]
    padded = functional.pad(packed, (0, k_padded // 2 - packed.shape[1], 0, round_up(rows, WEIGHT_ROW_MULTIPLE) - rows))
    codes = padded.contiguous().view(torch.float4_e2m1fn_x2)
    return Operand(codes, _operand_scales(scale, fmt, k_padded), global_scale)


# --- (c) the GEMM ------------------------------------------------------------------------------------


def scaled_mm_arguments(a: Operand, b: Operand, fmt: Fp4Format, output_dtype: torch.dtype) -> dict[str, Any]:
    """The keyword arguments of ``torch.nn.functional.scaled_mm`` for ``a @ b^T`` [M, rows of b]."""
    scaling, swizzle = functional.ScalingType, functional.SwizzleType
    arguments: dict[str, Any] = {"mat_a": a.codes, "mat_b": b.codes.t(), "output_dtype": output_dtype}
    if fmt.has_global_scale:
        if a.global_scale is None or b.global_scale is None:
            raise QuantizeError("NVFP4 operands need both global scales (float32 [1] multipliers)")
        recipe = [scaling.BlockWise1x16, scaling.TensorWise]
        swizzles = [swizzle.SWIZZLE_32_4_4, swizzle.NO_SWIZZLE]
        arguments.update(
            scale_a=[a.block_scale, a.global_scale],
            scale_recipe_a=recipe,
            scale_b=[b.block_scale, b.global_scale],
            scale_recipe_b=list(recipe),
            swizzle_a=swizzles,
            swizzle_b=list(swizzles),
        )
    else:
        arguments.update(
            scale_a=a.block_scale,
            scale_recipe_a=scaling.BlockWise1x32,
            scale_b=b.block_scale,
            scale_recipe_b=scaling.BlockWise1x32,
            swizzle_a=swizzle.SWIZZLE_32_4_4,
            swizzle_b=swizzle.SWIZZLE_32_4_4,
        )
    return arguments


# --- (a) activation quantization ----------------------------------------------------------------------


@dataclass(frozen=True)
class InputScaling:
    """The static NVFP4 input global scale of some partitions: the float32 [1] multiplier (the
    GEMM's alpha takes it) and, for compressed-tensors, the stored divisor (the quantization
    rounds with it, as the reference does). Both None for MXFP4."""

    global_scale: Tensor | None = None
    divisor: Tensor | None = None


def _triton_quantizer() -> Callable[..., object] | None:
    try:
        from qscheme.triton.act_quant import quantize_input as triton_quantize_input
    except Exception:  # no usable Triton: the emulation computes the same bits
        return None
    return triton_quantize_input


def triton_specialization(weight: CanonicalWeight) -> object | None:
    """The Triton pre-pass's specialisation of the layer's scheme (pure: imports no triton), or
    None where the pre-pass cannot quantize its activations."""
    from qscheme.triton.spec import specialize, unsupported_reason

    return None if unsupported_reason(weight.scheme) else specialize(weight.scheme)


def quantize_input(
    x: Tensor,
    activation: ActivationSpec,
    scaling: InputScaling,
    pre_scale: Tensor | None = None,
    triton_spec: object | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` [M, K]: e2m1 codes uint8 [M, K] and block scale bytes uint8 [M, ceil(K / G)],
    exactly ``qscheme.emulation.quantize_activation`` of ``x * pre_scale`` in float32.

    With ``triton_spec`` (``triton_specialization``) the Triton pre-pass computes them, where
    Triton imports; otherwise the emulation does (the same bits).
    """
    quantizer = _triton_quantizer() if triton_spec is not None else None
    if quantizer is not None:
        static = scaling.divisor if scaling.divisor is not None else scaling.global_scale
        result = quantizer(
            x if x.stride(-1) == 1 else x.contiguous(),
            triton_spec,
            static_scale=None if static is None else static.to(device=x.device, dtype=torch.float32),
            divisor=scaling.divisor is not None,
            pre_scale=pre_scale,
        )
        return result.codes, result.scale  # type: ignore[attr-defined]
    values = x if pre_scale is None else apply_pre_scale(x, pre_scale)
    quantized = quantize_activation(
        values,
        activation,
        input_global_scale=scaling.global_scale if scaling.divisor is None else None,
        input_global_scale_divisor=scaling.divisor,
    )
    return quantized.codes, scale_bits(quantized.scale)


# --- prepared layer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Output rows [start, stop) computed by one GEMM with one weight operand; ``input_index``
    names the state's InputScaling that quantizes its input."""

    start: int
    stop: int
    weight: Operand
    input_index: int


@dataclass(frozen=True)
class NativeFp4State:
    """What ``prepare`` computes once for a layer."""

    scheme_name: str
    format: Fp4Format
    activation: ActivationSpec
    n: int
    k: int
    k_padded: int
    inputs: tuple[InputScaling, ...]
    segments: tuple[Segment, ...]
    pre_scale: Tensor | None = None
    triton_spec: object | None = None

    def to(self, device: torch.device | str) -> NativeFp4State:
        """The same state with its weight operands on ``device`` (tests move them to meta)."""
        return replace(self, segments=tuple(replace(s, weight=s.weight.to(device)) for s in self.segments))


def _per_partition(values: Tensor | None, count: int, what: str, scheme: str) -> list[float | None]:
    if values is None:
        return [None] * count
    flat = values.reshape(-1).to(torch.float32).tolist()
    if len(flat) == 1:
        return flat * count
    if len(flat) != count:
        raise QuantizeError(f"scheme {scheme}: {what} holds {len(flat)} values for {count} fused partitions")
    return flat


def _one(value: float | None, device: torch.device) -> Tensor | None:
    return None if value is None else torch.tensor([value], dtype=torch.float32, device=device)


def _input_scaling(multiplier: float | None, divisor: float | None, device: torch.device) -> InputScaling:
    """An InputScaling from per-partition values; a divisor alone gives its float32 reciprocal
    as the multiplier (``qscheme.canonical``'s own rule)."""
    divisor_tensor = _one(divisor, device)
    multiplier_tensor = _one(multiplier, device)
    if multiplier_tensor is None and divisor_tensor is not None:
        multiplier_tensor = torch.reciprocal(divisor_tensor)
    return InputScaling(multiplier_tensor, divisor_tensor)


class NativeFp4Kernel:
    """KernelImplementation of ``native_fp4`` (and, through ``NativeMxfp4Kernel``, ``native_mxfp4``).

    ``scaled_mm`` replaces ``torch.nn.functional.scaled_mm`` (tests pass an exact CPU emulation);
    ``use_triton`` forces the activation quantizer (default: the Triton pre-pass on a GPU).
    """

    def __init__(self, scaled_mm: ScaledMm | None = None, use_triton: bool | None = None) -> None:
        self.scaled_mm = scaled_mm
        self.use_triton = use_triton

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> NativeFp4State:
        device = torch.device(device)
        fmt = fp4_format(weight)
        activation = weight.scheme.activation
        assert activation is not None  # fp4_format checked it
        name = weight.scheme.name
        partitions = weight.partitions or (weight.n,)
        count = len(partitions)
        weight_globals = _per_partition(weight.global_scale, count, "global_scale", name)
        input_globals = _per_partition(weight.input_global_scale, count, "input_global_scale", name)
        divisors = _per_partition(weight.input_global_scale_divisor, count, "input_global_scale_divisor", name)
        if fmt.has_global_scale and input_globals[0] is None and divisors[0] is None:
            raise QuantizeError(
                f"scheme {name}: NVFP4 activations need the calibrated input global scale, but the layer has none"
            )
        k_padded = round_up(weight.k, fmt.k_multiple)
        codes = weight.codes.to(device)
        scale = weight.scale.to(device)
        inputs: list[tuple[float | None, float | None]] = []
        runs: list[tuple[int, int, float | None, int]] = []  # start, stop, weight global, input index
        start = 0
        for index, size in enumerate(partitions):
            key = (input_globals[index], divisors[index]) if fmt.has_global_scale else (None, None)
            if key not in inputs:
                inputs.append(key)
            input_index = inputs.index(key)
            if runs and runs[-1][2] == weight_globals[index] and runs[-1][3] == input_index:
                runs[-1] = (runs[-1][0], start + size, weight_globals[index], input_index)
            else:
                runs.append((start, start + size, weight_globals[index], input_index))
            start += size
        scalings = tuple(_input_scaling(value, divisor, device) for value, divisor in inputs)
        segments = []
        for begin, stop, weight_global, input_index in runs:
            global_scale = None
            if fmt.has_global_scale:
                global_scale = _one(1.0 if weight_global is None else weight_global, device)
            elif weight_global is not None:  # an MX scheme with a global scale: applied after the GEMM
                global_scale = _one(weight_global, device)
            operand = weight_operand(codes[begin:stop], scale[begin:stop], global_scale, fmt, k_padded)
            segments.append(Segment(begin, stop, operand, input_index))
        pre_scale = weight.input_pre_scale
        return NativeFp4State(
            scheme_name=name,
            format=fmt,
            activation=activation,
            n=weight.n,
            k=weight.k,
            k_padded=k_padded,
            inputs=scalings,
            segments=tuple(segments),
            pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32).contiguous(),
            triton_spec=triton_specialization(weight),
        )

    def quantized_operand(self, state: NativeFp4State, x: Tensor, scaling: InputScaling) -> Operand:
        """Steps (a) and (b) for ``x`` [M, K]."""
        use_triton = x.is_cuda if self.use_triton is None else self.use_triton
        triton_spec = state.triton_spec if use_triton else None
        codes, scale = quantize_input(x, state.activation, scaling, state.pre_scale, triton_spec)
        global_scale = scaling.global_scale if state.format.has_global_scale else None
        return activation_operand(codes, scale, global_scale, state.format, state.k_padded)

    def matmul(self, state: NativeFp4State, x: Tensor, output_dtype: torch.dtype) -> Tensor:
        """``x`` [M, K] times the weight: [M, N] in ``output_dtype`` as the GEMM wrote it (no bias)."""
        scaled_mm: ScaledMm = self.scaled_mm or functional.scaled_mm
        operands: dict[int, Operand] = {}
        pieces = []
        for segment in state.segments:
            if segment.input_index not in operands:
                operands[segment.input_index] = self.quantized_operand(state, x, state.inputs[segment.input_index])
            a = operands[segment.input_index]
            y = scaled_mm(**scaled_mm_arguments(a, segment.weight, state.format, output_dtype))
            y = y[:, : segment.stop - segment.start]
            if not state.format.has_global_scale and segment.weight.global_scale is not None:
                y = (y.float() * segment.weight.global_scale).to(output_dtype)
            pieces.append(y)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def output_dtype(self, state: NativeFp4State, input_dtype: torch.dtype) -> torch.dtype:
        """What the GEMM writes: the input's 16-bit dtype (NVFP4), bfloat16 (MXFP4: torch's
        MXFP4 GEMM writes bf16)."""
        if input_dtype not in (torch.bfloat16, torch.float16):
            raise UsageError(
                f"scheme {state.scheme_name}: the native FP4 GEMM takes bfloat16 or float16 inputs, not {input_dtype}"
            )
        return input_dtype if state.format.has_global_scale else torch.bfloat16

    def apply(self, state: NativeFp4State, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        output_dtype = self.output_dtype(state, x.dtype)
        leading = x.shape[:-1]
        rows = x.reshape(-1, state.k)
        if rows.shape[0] == 0:
            y = torch.zeros((0, state.n), dtype=torch.float32, device=x.device)
        else:
            y = self.matmul(state, rows, output_dtype)
        if bias is not None:
            y = y.float() + bias.to(device=y.device, dtype=torch.float32)
        return y.to(x.dtype).reshape(*leading, state.n)


def mxfp4_unavailable_reason(cuda_version: str | None, build_settings: str, platform: str) -> str | None:
    """Why this torch cannot run an MXFP4 x MXFP4 GEMM on CUDA, or None.

    torch 2.13 runs it through MSLK's f4f4bf16 only (``_scaled_mxfp4_mxfp4``: "MXFP4 scaling
    supported on ROCM and CUDA+FBGEMM_GENAI only"), never on Windows. A CPU-only build is left to
    the resolver, which rejects every CUDA kernel there.
    """
    if cuda_version is None:
        return None
    if platform == "win32":
        return "torch's MXFP4 GEMM is not built on Windows"
    if "USE_MSLK" not in build_settings:
        return (
            f"this torch (CUDA {cuda_version}) was built without MSLK (USE_MSLK), which torch's MXFP4 x MXFP4 "
            "GEMM needs on CUDA; use a build with it, or the triton kernel"
        )
    return None


class NativeMxfp4Kernel(NativeFp4Kernel):
    """KernelImplementation of ``native_mxfp4``: refuses to load under a torch that cannot run
    the MXFP4 GEMM (the resolver then moves on to the next kernel)."""

    def __init__(self, scaled_mm: ScaledMm | None = None, use_triton: bool | None = None) -> None:
        if scaled_mm is None:
            reason = mxfp4_unavailable_reason(torch.version.cuda, torch.__config__.show(), sys.platform)
            if reason is not None:
                raise RuntimeError(reason)
        super().__init__(scaled_mm, use_triton)
