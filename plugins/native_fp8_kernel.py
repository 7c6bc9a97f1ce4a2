"""The native FP8 kernels' code: activation quantization, prepared operands and torch's scaled GEMMs.

Declared in ``qscheme_plugins.native_fp8`` (see its docstring for what each kernel claims).

Activations are quantized here with the arithmetic of ``qscheme.emulation`` (float32 on the
exactly upcast input; ``x / s`` rounded to e4m3 nearest-even with saturation), so every code
and scale equals the reference emulation's:

- static per tensor: ``q = e4m3(x / input_scale)``;
- dynamic per token: ``s = amax / 448`` (float32 eps where zero), ``q = e4m3(x / s)``;
- dynamic per group of 128: as per token, per group along K, a ragged last group zero-padded.

``prepare`` pads and lays out the weight once: codes as float8_e4m3fn ``[N_padded, K_padded]``
row-major (handed to the GEMM transposed, i.e. column-major, as torch requires on CUDA; the CPU
kernel keeps ``[K, N]`` row-major instead), per-row or per-
block float32 multipliers (``qscheme.canonical.effective_scale``, the reference's own), and the
fused partitions split into runs that share their static input scale (and, for tensor-wise
scaling, their weight scale). ``apply`` pads the input's K with zeros (zero codes, unchanged
scales), quantizes it once per distinct input scale, runs one GEMM per run, slices the padding
off, adds the bias in float32 and returns the input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional

from qscheme.canonical import CanonicalWeight, effective_scale
from qscheme.errors import UsageError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FLOAT32_EPS = float(torch.finfo(torch.float32).eps)
GROUP = 128  # activation groups and weight blocks of FP8_BLOCK
CUDA_MULTIPLE = 16  # torch._scaled_mm on CUDA: K and N multiples of 16
BLOCK_M_MULTIPLE = 16  # rows of the 1x128-scaled input, padded (its scales' leading dimension)
BLOCK_CUDA_VERSION = (12, 9)  # cuBLASLt block scaling

ActivationKind = Literal["static", "token", "group"]


# --- activation quantization (the emulation's arithmetic) ---------------------------------------


def encode_e4m3(values: Tensor) -> Tensor:
    """float32 -> float8_e4m3fn, nearest-even with saturation (``qscheme.formats.encode``)."""
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_static(values: Tensor, input_scale: Tensor) -> Tensor:
    """e4m3 codes of float32 ``values`` under a static per-tensor multiplier (a 0-dim tensor)."""
    return encode_e4m3(values / input_scale)


def dynamic_scales(blocks: Tensor) -> Tensor:
    """``amax / 448`` over the last dim (float32 eps where it is zero), keeping that dim.

    448 is divided by as a tensor on the values' device. CUDA divides by a Python number through
    its reciprocal: on an H200 (2026-12-04) some rows' scales came out a last bit off the CPU's,
    and 79 of 64,000 bf16 inputs' codes moved to a neighbour (x / s landing just below a tie).
    By a tensor it divides exactly, as the CPU and the emulation do."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = amax / torch.full((), E4M3_MAX, dtype=amax.dtype, device=amax.device)
    return torch.where(scale == 0, FLOAT32_EPS, scale)


def quantize_per_token(values: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 codes [M, K] and float32 scales [M, 1] of float32 ``values`` [M, K]."""
    scale = dynamic_scales(values)
    return encode_e4m3(values / scale), scale


def quantize_per_group(values: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 codes [M, K] and float32 scales [M, K / 128] of float32 ``values`` [M, K] (K a
    multiple of 128: a ragged last group is zero-padded by the caller, as the emulation does)."""
    blocks = values.unflatten(-1, (-1, GROUP))
    scale = dynamic_scales(blocks)
    return encode_e4m3(blocks / scale).flatten(-2), scale.squeeze(-1)


# --- prepared weights ----------------------------------------------------------------------------


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


@dataclass(frozen=True)
class Run:
    """Output rows [start, stop) computed by one GEMM.

    ``weight``: float8_e4m3fn codes of the rows (padded), laid out as the kernel stores them;
    ``weight_scale``: a 0-dim float32 multiplier (tensor-wise) or float32 [1, padded rows]
    (row-wise); ``input_index``: which of the state's static input scales quantizes its input
    (None for dynamic inputs).
    """

    start: int
    stop: int
    weight: Tensor
    weight_scale: Tensor
    input_index: int | None


@dataclass(frozen=True)
class Fp8State:
    """What ``prepare`` computes once for a layer."""

    n: int
    k: int
    padded_k: int
    activation: ActivationKind
    runs: tuple[Run, ...]
    input_scales: tuple[Tensor, ...] = ()
    block_scale: Tensor | None = None  # block kernel: [padded N / 128, round_up(K blocks, 4)], contiguous

    def to(self, device: torch.device | str) -> Fp8State:
        """The same state with every tensor on ``device`` (tests move it to the meta device)."""
        runs = tuple(replace(r, weight=r.weight.to(device), weight_scale=r.weight_scale.to(device)) for r in self.runs)
        return replace(
            self,
            runs=runs,
            input_scales=tuple(s.to(device) for s in self.input_scales),
            block_scale=None if self.block_scale is None else self.block_scale.to(device),
        )

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the state by a descriptive name (for tests and memory accounting)."""
        found: dict[str, Tensor] = {}
        for index, run in enumerate(self.runs):
            for field in fields(run):
                value = getattr(run, field.name)
                if isinstance(value, Tensor):
                    found[f"runs[{index}].{field.name}"] = value
        for index, scale in enumerate(self.input_scales):
            found[f"input_scales[{index}]"] = scale
        if self.block_scale is not None:
            found["block_scale"] = self.block_scale
        return found


def activation_kind(weight: CanonicalWeight) -> ActivationKind:
    activation = weight.scheme.activation
    if activation is None:
        raise UsageError(f"scheme {weight.scheme.name} has 16-bit activations; the native FP8 kernels are W8A8")
    if not activation.dynamic:
        return "static"
    return "group" if activation.granularity == "group" else "token"


def check_weight(weight: CanonicalWeight, kernel: str) -> None:
    """What the declarations cannot say: e4m3 weight codes, no AWQ pre-scale."""
    if weight.codes.dtype != E4M3:
        raise UsageError(
            f"kernel {kernel} multiplies float8_e4m3fn weights; scheme {weight.scheme.name} stores "
            f"{weight.codes.dtype} codes (use the triton or reference kernel)"
        )
    if weight.input_pre_scale is not None:
        raise UsageError(f"kernel {kernel} applies no input pre-scale; scheme {weight.scheme.name} has one")


def row_scales(weight: CanonicalWeight) -> Tensor:
    """The reference's float32 multiplier of every weight row, [N] (tensor and channel scales)."""
    return effective_scale(weight).to(torch.float32).reshape(-1, 1).expand(weight.n, 1).reshape(-1)


def partition_bounds(weight: CanonicalWeight) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in weight.partitions or (weight.n,):
        bounds.append((start, start + size))
        start += size
    return bounds


def static_input_scales(weight: CanonicalWeight) -> list[float] | None:
    """One static input multiplier per partition (None for dynamic activations)."""
    if activation_kind(weight) != "static":
        return None
    if weight.input_scale is None:
        raise UsageError(f"scheme {weight.scheme.name} quantizes inputs with a static scale; the layer has none")
    values = [float(v) for v in weight.input_scale.reshape(-1).tolist()]
    count = len(partition_bounds(weight))
    if len(values) not in (1, count):
        raise UsageError(f"the layer has {len(values)} input scales for {count} fused partitions")
    return values if len(values) == count else values * count


# (start, stop, input scale index, per-tensor weight multiplier) of one run of partitions.
RunSpan = tuple[int, int, int | None, float | None]


def split_runs(weight: CanonicalWeight, by_weight_scale: bool) -> tuple[list[RunSpan], list[float]]:
    """Adjacent partitions merged while they share their static input scale (and, when
    ``by_weight_scale``, their per-tensor weight scale): (start, stop, input index, weight scale)
    runs and the distinct input scales in order of first use."""
    inputs = static_input_scales(weight)
    scales = row_scales(weight) if by_weight_scale else None
    runs: list[tuple[int, int, int | None, float | None]] = []
    distinct: list[float] = []
    for index, (start, stop) in enumerate(partition_bounds(weight)):
        input_index = None
        if inputs is not None:
            if inputs[index] not in distinct:
                distinct.append(inputs[index])
            input_index = distinct.index(inputs[index])
        weight_scale = None if scales is None else float(scales[start])
        if runs and runs[-1][2] == input_index and runs[-1][3] == weight_scale:
            runs[-1] = (runs[-1][0], stop, input_index, weight_scale)
        else:
            runs.append((start, stop, input_index, weight_scale))
    return runs, distinct


def padded_codes(codes: Tensor, rows: int, columns: int) -> Tensor:
    """float8 codes [r, c] zero-padded to [rows, columns], contiguous (padded as bytes)."""
    raw = codes.contiguous().view(torch.uint8)
    raw = functional.pad(raw, (0, columns - raw.shape[1], 0, rows - raw.shape[0]))
    return raw.contiguous().view(codes.dtype)


def padded_rows(values: Tensor, rows: int, fill: float = 1.0) -> Tensor:
    """float32 [r] padded with ``fill`` to [1, rows], contiguous (a row-wise scale_b)."""
    return functional.pad(values, (0, rows - values.shape[0]), value=fill).reshape(1, rows).contiguous()


def scalar(value: float, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def row_input_scales(input_scale: Tensor, rows: int) -> Tensor:
    """A row-wise scale_a, float32 [M, 1] contiguous: per-token scales as they are, a static
    per-tensor scale (0-dim) repeated (torch refuses an expanded, stride-0 view)."""
    if input_scale.dim() == 2:
        return input_scale
    return input_scale.reshape(1, 1).expand(rows, 1).contiguous()


# --- shared apply ----------------------------------------------------------------------------------


def flat_input(state: Fp8State, x: Tensor) -> Tensor:
    """x [..., K] as float32 [M, padded K] (zero columns quantize to zero codes)."""
    if x.shape[-1] != state.k:
        raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
    values = x.reshape(-1, state.k).to(torch.float32)
    if state.padded_k != state.k:
        values = functional.pad(values, (0, state.padded_k - state.k))
    return values


def finish(pieces: list[Tensor], x: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """Concatenated GEMM outputs plus the bias in float32, in x's dtype and shape [..., N]."""
    y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    if bias is not None:
        y = y.to(torch.float32) + bias.to(device=y.device, dtype=torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


GemmCall = Callable[[Tensor, Tensor, Run], Tensor]


def run_gemms(state: Fp8State, values: Tensor, gemm: GemmCall) -> list[Tensor]:
    """One GEMM per run, the input quantized once per distinct static scale (or once per call for
    dynamic inputs); each output [M, run rows] with the padding sliced off."""
    if values.shape[0] == 0:  # no rows: nothing to quantize (an empty [0, 1] scale has strides _scaled_mm refuses)
        return [values.new_zeros((0, run.stop - run.start)) for run in state.runs]
    pieces: list[Tensor] = []
    quantized: dict[int | None, tuple[Tensor, Tensor]] = {}
    for run in state.runs:
        if run.input_index not in quantized:
            if run.input_index is None:
                quantized[None] = quantize_per_token(values)
            else:
                scale = state.input_scales[run.input_index]
                quantized[run.input_index] = (quantize_static(values, scale), scale)
        codes, scale = quantized[run.input_index]
        pieces.append(gemm(codes, scale, run)[:, : run.stop - run.start])
    return pieces


# --- the kernels ----------------------------------------------------------------------------------


class _ScaledMmKernel:
    """What the ``_scaled_mm`` kernels share: one GEMM per run of partitions, each run's weight
    rows padded to ``multiple`` (and K too), stored as ``weight_operand`` gives them, with the
    scale ``run_scales`` gives it. ``by_weight_scale``: runs also split where per-tensor weight
    scales differ (a tensor-wise GEMM takes one weight scale)."""

    name: str
    multiple: int = CUDA_MULTIPLE
    by_weight_scale: bool = False

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> Fp8State:
        device = torch.device(device)
        check_weight(weight, self.name)
        padded_k = round_up(weight.k, self.multiple)
        runs, inputs = split_runs(weight, by_weight_scale=self.by_weight_scale)
        scales = self.run_scales(weight, runs, device)
        return Fp8State(
            n=weight.n,
            k=weight.k,
            padded_k=padded_k,
            activation=activation_kind(weight),
            runs=tuple(
                Run(
                    start,
                    stop,
                    self.weight_operand(
                        padded_codes(weight.codes[start:stop], round_up(stop - start, self.multiple), padded_k)
                    ).to(device),
                    scale,
                    input_index,
                )
                for (start, stop, input_index, _), scale in zip(runs, scales, strict=True)
            ),
            input_scales=tuple(scalar(value, device) for value in inputs),
        )

    def run_scales(self, weight: CanonicalWeight, runs: list[RunSpan], device: torch.device) -> list[Tensor]:
        """Each run's weight scale: float32 [1, padded rows] of the reference's row multipliers."""
        scales = row_scales(weight)
        return [
            padded_rows(scales[start:stop], round_up(stop - start, self.multiple)).to(device)
            for start, stop, _, _ in runs
        ]

    def weight_operand(self, codes: Tensor) -> Tensor:
        """The stored weight: [rows, K] row-major, handed to the GEMM transposed (column-major)."""
        return codes


class NativeFp8Kernel(_ScaledMmKernel):
    """``native_fp8``: tensor-wise torch._scaled_mm (cuBLASLt) on CUDA, float32 output."""

    name = "native_fp8"
    by_weight_scale = True

    def run_scales(self, weight: CanonicalWeight, runs: list[RunSpan], device: torch.device) -> list[Tensor]:
        """Each run's one weight multiplier, 0-dim float32 (runs split where it changes)."""
        return [scalar(weight_scale if weight_scale is not None else 1.0, device) for _, _, _, weight_scale in runs]

    def apply(self, state: Fp8State, x: Tensor, bias: Tensor | None) -> Tensor:
        def gemm(codes: Tensor, input_scale: Tensor, run: Run) -> Tensor:
            return torch._scaled_mm(codes, run.weight.t(), input_scale, run.weight_scale, out_dtype=torch.float32)

        return finish(run_gemms(state, flat_input(state, x), gemm), x, bias, state.n)


class NativeFp8RowwiseKernel(_ScaledMmKernel):
    """``native_fp8_rowwise``: row-wise torch._scaled_mm on CUDA (per-token or expanded static
    input scales x per-row weight scales), bf16 output."""

    name = "native_fp8_rowwise"

    def apply(self, state: Fp8State, x: Tensor, bias: Tensor | None) -> Tensor:
        def gemm(codes: Tensor, input_scale: Tensor, run: Run) -> Tensor:
            scale_a = row_input_scales(input_scale, codes.shape[0])
            return torch._scaled_mm(codes, run.weight.t(), scale_a, run.weight_scale, out_dtype=torch.bfloat16)

        return finish(run_gemms(state, flat_input(state, x), gemm), x, bias, state.n)


class NativeFp8CpuKernel(NativeFp8RowwiseKernel):
    """``native_fp8_cpu``: torch 2.13's CPU _scaled_mm with row-wise scales (tensor weight scales
    expanded to rows), the output in the input's dtype and the bias added before its rounding.

    The weight is kept transposed ([K, N] row-major): torch's CPU kernel ran faster on that layout
    than on the column-major one the CUDA kernels need (10-50% at M <= 16 on a 4096x4096 layer).
    No padding (the CPU takes any N, K).
    """

    name = "native_fp8_cpu"
    multiple = 1

    def weight_operand(self, codes: Tensor) -> Tensor:
        """The stored weight: [K, rows] row-major, handed to the GEMM as it is."""
        return codes.t().contiguous()

    def apply(self, state: Fp8State, x: Tensor, bias: Tensor | None) -> Tensor:
        values = flat_input(state, x)
        # One GEMM: the bias goes in (added in float32 before the one rounding to x's dtype).
        # Several: float32 pieces, concatenated, then the bias and the rounding (``finish``).
        single = len(state.runs) == 1
        fused_bias = bias.to(device=values.device, dtype=torch.float32) if single and bias is not None else None
        out_dtype = x.dtype if single else torch.float32

        def gemm(codes: Tensor, input_scale: Tensor, run: Run) -> Tensor:
            scale_a = row_input_scales(input_scale, codes.shape[0])
            return torch._scaled_mm(codes, run.weight, scale_a, run.weight_scale, bias=fused_bias, out_dtype=out_dtype)

        return finish(run_gemms(state, values, gemm), x, None if single else bias, state.n)


class NativeFp8BlockKernel:
    """``native_fp8_block``: torch.nn.functional.scaled_mm with BlockWise1x128 input scales and
    BlockWise128x128 weight scales (sm90, cuBLASLt >= 12.9), bf16 output.

    Layouts the call requires (checked by torch's meta function and ScaledBlas.cpp): the input's
    scales [M, K/128] outer-dim-major (strides (1, M)); the weight's [round_up(K/128, 4), N/128]
    with strides (1, round_up(K/128, 4)), i.e. a contiguous [N/128, round_up(K/128, 4)] transposed.
    N and K are padded to multiples of 128 (weight blocks of zeros with scale 1), and M to a
    multiple of 16 (rows of zeros, whose eps scales multiply zero codes).
    """

    name = "native_fp8_block"

    def __init__(self) -> None:
        cuda = torch.version.cuda
        if cuda:
            version = tuple(int(part) for part in cuda.split(".")[:2])
            if version < BLOCK_CUDA_VERSION:
                raise ImportError(
                    f"torch {torch.__version__} is built with CUDA {cuda}; 1x128 / 128x128 block-scaled FP8 "
                    f"needs cuBLASLt from CUDA {'.'.join(map(str, BLOCK_CUDA_VERSION))} or newer"
                )
        self.scaling = functional.ScalingType

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> Fp8State:
        device = torch.device(device)
        check_weight(weight, self.name)
        padded_n, padded_k = round_up(weight.n, GROUP), round_up(weight.k, GROUP)
        scale = effective_scale(weight).to(torch.float32)  # [ceil(N/128), ceil(K/128)]
        k_blocks = round_up(padded_k // GROUP, 4)
        block_scale = functional.pad(
            scale, (0, k_blocks - scale.shape[1], 0, padded_n // GROUP - scale.shape[0]), value=1.0
        ).contiguous()
        codes = padded_codes(weight.codes, padded_n, padded_k)
        return Fp8State(
            n=weight.n,
            k=weight.k,
            padded_k=padded_k,
            activation="group",
            runs=(Run(0, weight.n, codes.to(device), scalar(1.0, device), None),),
            block_scale=block_scale.to(device),
        )

    def operands(self, state: Fp8State, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """(input codes [M', K'], their scales outer-dim-major, weight [K', N'] column-major,
        weight scales [round_up(K'/128, 4), N'/128], M): exactly what the GEMM is given."""
        values = flat_input(state, x)
        rows = values.shape[0]
        padded_m = round_up(max(rows, 1), BLOCK_M_MULTIPLE)
        if padded_m != rows:
            values = functional.pad(values, (0, 0, 0, padded_m - rows))
        codes, scales = quantize_per_group(values)
        assert state.block_scale is not None
        return codes, scales.t().contiguous().t(), state.runs[0].weight.t(), state.block_scale.t(), rows

    def apply(self, state: Fp8State, x: Tensor, bias: Tensor | None) -> Tensor:
        codes, scale_a, weight, scale_b, rows = self.operands(state, x)
        y = functional.scaled_mm(
            codes,
            weight,
            scale_a,
            self.scaling.BlockWise1x128,
            scale_b,
            self.scaling.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
        return finish([y[:rows, : state.n]], x, bias, state.n)
