"""torch's tinygemm int4 GEMM for the ``tinygemm`` (CUDA) and ``tinygemm_cpu`` kernels.

tinygemm dequantizes a 4-bit value u in [0, 15] as ``(u - 8) * scale + zero``, with one scale and
one zero per group of K and output row, given as ``scales_and_zeros`` [K/g, N, 2] in the
activation dtype (bfloat16 here; see ``qscheme_plugins.tinygemm``). The canonical weight is
``w = (q - z) * s`` (z = 0 without zero points), so:

- int4 codes (two's-complement nibbles): ``u = q + 8`` (the nibble with its top bit flipped),
  ``zero = -z * s``;
- uint4 codes: ``u = q``, ``zero = (8 - z) * s``.

``s`` is ``qscheme.canonical.effective_scale`` (a global scale folded in as the producer does),
rounded once to bfloat16; the zero is computed exactly in float64 and rounded once to bfloat16.
Channel scales are repeated over groups of the size that pads K least (the same scale in every
group is exact).

Packed blocks (GGUF's Q4_0, Q4_1, Q4_K) whose code is an unsigned integer of at most 4 bits used
as a number take the same form: ``w = scale * u + shift`` per sub-block (``affine_codes`` and
``affine_scales`` of ``qscheme.formats.blocks``), so ``zero = 8 * scale + shift``, computed in
float64 and rounded once to bfloat16, with ``scale`` (the block's float32 scale product) rounded too.

Padding: N to the op's multiple (16 on the CPU, 8 on CUDA) with zero scales and zeros, K to the
group size with zero-valued codes (u = 8) and zero inputs; the output is sliced back to N. The
state keeps the packed weight, the scale-and-zero pairs and the pre-scale (float32, shared with
the canonical tensor when it already is one): nothing else.

Packing: the CPU op packs int32 [N, K] values; it is fed slabs of rows (the packed layout is
local to blocks of 64 rows) so that the int32 copy never exceeds one slab. The CUDA op packs
uint8 [N, K/2] bytes with element 2j in the high nibble: the canonical bytes with their nibbles
swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from qscheme_plugins.tinygemm import TINYGEMM_BLOCK_CODES, TINYGEMM_GROUP_SIZES
from torch import Tensor

from qscheme.canonical import CanonicalWeight, effective_scale
from qscheme.errors import QuantizeError, UsageError
from qscheme.formats.blocks import affine_codes, affine_scales

GROUP_SIZES: tuple[int, ...] = TINYGEMM_GROUP_SIZES  # the declaration's: the group sizes both ops take
BLOCK_CODES: tuple[str, ...] = TINYGEMM_BLOCK_CODES  # the packed-block codes both ops take
OP_DTYPE = torch.bfloat16
# Rows of the int32 copy the CPU packing op is fed at a time: a multiple of the 64-row blocks
# its layout is local to (AVX512 packs 64 rows together, AVX2 32).
CPU_PACKING_SLAB_ROWS = 1024
# Padding code: (u - 8) * s is 0; padded columns also meet zero inputs, padded rows zero scales and zeros.
ZERO_VALUE_CODE = 8


@dataclass(frozen=True)
class TinygemmState:
    """The op's operands for one layer (padded to ``padded_n`` x ``padded_k``) and the pre-scale."""

    packed: Tensor
    scales_and_zeros: Tensor
    group_size: int
    n: int
    k: int
    padded_n: int
    padded_k: int
    pre_scale: Tensor | None


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def tinygemm_group_size(weight: CanonicalWeight) -> int:
    """The op's group size for the weight: its own for group scales (32, 64, 128 or 256); for
    channel scales the one that pads K least (the largest of those). UsageError otherwise."""
    scheme = weight.scheme
    spec = scheme.weight.scale
    layout = scheme.weight.blocks
    if layout is not None:
        if layout.code_kind not in BLOCK_CODES or scheme.activation is not None:
            raise UsageError(
                f"tinygemm runs packed blocks with {'/'.join(BLOCK_CODES)} codes and 16-bit inputs; scheme "
                f"{scheme.name} has {layout.code_kind} codes"
            )
        if layout.sub_block not in GROUP_SIZES:
            raise UsageError(
                f"tinygemm takes groups of {'/'.join(map(str, GROUP_SIZES))}; scheme {scheme.name} has sub-blocks "
                f"of {layout.sub_block}"
            )
        return layout.sub_block
    if scheme.weight.format not in ("int4", "uint4"):
        raise UsageError(f"tinygemm runs int4 and uint4 weights; scheme {scheme.name} has {scheme.weight.format}")
    if scheme.activation is not None:
        raise UsageError(f"tinygemm runs weight-only schemes; scheme {scheme.name} quantizes its activations")
    if spec.granularity == "group" and spec.group_size in GROUP_SIZES:
        return spec.group_size
    if spec.granularity == "channel":
        return min(GROUP_SIZES, key=lambda g: (_round_up(weight.k, g), -g))
    grouping = f"groups of {spec.group_size}" if spec.granularity == "group" else f"{spec.granularity} scales"
    raise UsageError(
        f"tinygemm takes group scales of {'/'.join(map(str, GROUP_SIZES))} or channel scales; "
        f"scheme {scheme.name} has {grouping}"
    )


def round_once(values: Tensor, dtype: torch.dtype) -> Tensor:
    """float64 ``values`` rounded once (to nearest, ties to even) to ``dtype``.

    torch rounds float64 to bfloat16 through float32, which can round twice: a value just off a
    bfloat16 midpoint lands on it in float32 and is then tied to even. Such values are moved one
    float32 step back toward their float64 value first (the midpoint is a float32 number, so no
    other value crosses it).
    """
    if dtype != torch.bfloat16:
        return values.to(dtype)
    single = values.to(torch.float32)
    midpoint = (single.view(torch.int32) & 0xFFFF) == 0x8000
    off = midpoint & (single.to(torch.float64) != values)
    if bool(off.any()):
        toward = torch.where(values > single.to(torch.float64), torch.inf, -torch.inf).to(torch.float32)
        single = torch.where(off, torch.nextafter(single, toward), single)
    return single.to(torch.bfloat16)


def scales_and_zeros(weight: CanonicalWeight, group_size: int, padded_n: int, padded_k: int) -> Tensor:
    """bfloat16 [padded_k / group_size, padded_n, 2] (scale, zero) pairs, in host memory."""
    n, groups = weight.n, padded_k // group_size
    layout = weight.scheme.weight.blocks
    if layout is not None:  # packed blocks: w = scale * u + shift (qscheme.formats.blocks.affine_parts)
        block_scale, shift = affine_scales(weight.codes, layout)
        pairs = torch.zeros(groups, padded_n, 2, dtype=OP_DTYPE)
        pairs[: block_scale.shape[1], :n, 0] = block_scale.t().to(OP_DTYPE)
        pairs[: block_scale.shape[1], :n, 1] = round_once(8 * block_scale.to(torch.float64) + shift, OP_DTYPE).t()
        return _finite(pairs, weight, block_scale)
    scale = effective_scale(weight)  # float32 [N, ceil(K/G)] or [N, 1]
    if scale.shape[1] != groups:  # channel scales
        scale = scale.expand(n, groups)
    offset = 8 if weight.scheme.weight.format == "int4" else 0
    shift = torch.full((n, 1), float(8 - offset), dtype=torch.float64)
    if weight.zero_point is not None:
        shift = shift - weight.zero_point.to(torch.float64).expand(n, groups)
    zero = round_once(shift * scale.to(torch.float64), OP_DTYPE)  # exact product, one rounding
    pairs = torch.zeros(groups, padded_n, 2, dtype=OP_DTYPE)
    pairs[:, :n, 0] = scale.t().to(OP_DTYPE)
    pairs[:, :n, 1] = zero.t()
    return _finite(pairs, weight, scale)


def _finite(pairs: Tensor, weight: CanonicalWeight, scale: Tensor) -> Tensor:
    if not bool(torch.isfinite(pairs).all()):
        raise QuantizeError(
            f"scheme {weight.scheme.name}: a scale or zero point overflows bfloat16 (largest scale "
            f"{float(scale.abs().max()):.3e}); tinygemm cannot run this layer"
        )
    return pairs


def unsigned_values(weight: CanonicalWeight, rows: slice, padded_k: int) -> Tensor:
    """uint8 [rows, padded_k]: the op's values u (int4 q + 8, uint4 q, a block's unsigned code),
    zero-valued past K."""
    part = weight.codes[rows]
    layout = weight.scheme.weight.blocks
    if layout is not None:
        values = affine_codes(part, layout)
    else:
        values = torch.stack((part & 0xF, part >> 4), dim=-1).reshape(part.shape[0], -1)
    if weight.scheme.weight.format == "int4":
        values = values ^ 8
    out = torch.full((part.shape[0], padded_k), ZERO_VALUE_CODE, dtype=torch.uint8, device=part.device)
    out[:, : weight.k] = values[:, : weight.k]
    return out


def cuda_bytes(weight: CanonicalWeight, padded_n: int, padded_k: int, device: torch.device) -> Tensor:
    """uint8 [padded_n, padded_k / 2] as the CUDA packing op reads them: values u, element 2j in
    the high nibble of byte j; zero-valued (u = 8) past N and K."""
    if weight.scheme.weight.blocks is not None:
        values = unsigned_values(weight, slice(0, weight.n), padded_k).to(device)
        raw = torch.full((padded_n, padded_k // 2), ZERO_VALUE_CODE * 0x11, dtype=torch.uint8, device=device)
        raw[: weight.n] = (values[:, 0::2] << 4) | values[:, 1::2]  # element 2j in the high nibble
        return raw
    codes = weight.codes.to(device)
    if weight.scheme.weight.format == "int4":
        codes = codes ^ 0x88  # u = q + 8 in both nibbles
    swapped = (codes << 4) | (codes >> 4)  # element 2j to the high nibble
    raw = torch.full((padded_n, padded_k // 2), ZERO_VALUE_CODE * 0x11, dtype=torch.uint8, device=device)
    raw[: weight.n, : swapped.shape[1]] = swapped
    if weight.k % 2:  # the canonical padding nibble (now the low one of the last byte): a zero value
        last = weight.k // 2
        raw[: weight.n, last] = (raw[: weight.n, last] & 0xF0) | ZERO_VALUE_CODE
    return raw


class _Tinygemm:
    """What both kernels share: group size, padding, scales and the call with its padding."""

    device_type: ClassVar[str]
    n_multiple: ClassVar[int]

    def pack(self, weight: CanonicalWeight, padded_n: int, padded_k: int, device: torch.device) -> Tensor:
        raise NotImplementedError

    def matmul(self, x: Tensor, packed: Tensor, group_size: int, pairs: Tensor) -> Tensor:
        raise NotImplementedError

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> TinygemmState:
        device = torch.device(device)
        if device.type != self.device_type:
            raise UsageError(f"{type(self).__name__} runs on {self.device_type}, not {device}")
        group_size = tinygemm_group_size(weight)
        padded_n = _round_up(weight.n, self.n_multiple)
        padded_k = _round_up(weight.k, group_size)  # a multiple of 32: of 2 CUDA k-tiles too
        pairs = scales_and_zeros(weight, group_size, padded_n, padded_k).to(device)
        packed = self.pack(weight, padded_n, padded_k, device)
        pre_scale = weight.input_pre_scale
        return TinygemmState(
            packed=packed,
            scales_and_zeros=pairs,
            group_size=group_size,
            n=weight.n,
            k=weight.k,
            padded_n=padded_n,
            padded_k=padded_k,
            pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32),
        )

    def apply(self, state: TinygemmState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        if x.dtype != OP_DTYPE:
            raise UsageError(f"tinygemm takes bfloat16 activations, not {x.dtype}; cast the input to bfloat16")
        rows = x.reshape(-1, state.k)
        if state.pre_scale is not None:
            rows = (rows.to(torch.float32) * state.pre_scale).to(OP_DTYPE)
        if state.padded_k != state.k:
            rows = F.pad(rows, (0, state.padded_k - state.k))
        if rows.shape[0] == 0:
            y = rows.new_empty((0, state.padded_n))
        else:
            y = self.matmul(rows.contiguous(), state.packed, state.group_size, state.scales_and_zeros)
        y = y[:, : state.n]
        if bias is not None:
            y = (y + bias.to(device=y.device)).to(x.dtype)  # one rounding of the sum
        return y.reshape(*x.shape[:-1], state.n)


class TinygemmCpuKernel(_Tinygemm):
    """KernelImplementation of ``tinygemm_cpu``: ``torch._weight_int4pack_mm_for_cpu``."""

    device_type = "cpu"
    n_multiple = 16

    def pack(self, weight: CanonicalWeight, padded_n: int, padded_k: int, device: torch.device) -> Tensor:
        packed = torch.empty(padded_n, padded_k // 2, dtype=torch.uint8)
        for start in range(0, padded_n, CPU_PACKING_SLAB_ROWS):
            stop = min(start + CPU_PACKING_SLAB_ROWS, padded_n)
            values = torch.full((stop - start, padded_k), ZERO_VALUE_CODE, dtype=torch.int32)
            real = slice(start, min(stop, weight.n))
            if real.start < real.stop:
                values[: real.stop - start] = unsigned_values(weight, real, padded_k)
            packed[start:stop] = torch._convert_weight_to_int4pack_for_cpu(values, 2)
        return packed

    def matmul(self, x: Tensor, packed: Tensor, group_size: int, pairs: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, pairs)


class TinygemmKernel(_Tinygemm):
    """KernelImplementation of ``tinygemm`` (CUDA, compute capability 8.0+): ``torch._weight_int4pack_mm``."""

    device_type = "cuda"
    n_multiple = 8

    @staticmethod
    def inner_k_tiles(padded_k: int) -> int:
        """8 (16-byte loads) where K allows, else 4 or 2: K must be a multiple of 16 of them."""
        return next(tiles for tiles in (8, 4, 2) if padded_k % (tiles * 16) == 0)

    def pack(self, weight: CanonicalWeight, padded_n: int, padded_k: int, device: torch.device) -> Tensor:
        raw = cuda_bytes(weight, padded_n, padded_k, device)
        return torch._convert_weight_to_int4pack(raw, self.inner_k_tiles(padded_k))

    def matmul(self, x: Tensor, packed: Tensor, group_size: int, pairs: Tensor) -> Tensor:
        return torch._weight_int4pack_mm(x, packed, group_size, pairs)
