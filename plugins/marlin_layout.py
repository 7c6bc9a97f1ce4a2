"""Marlin's operand layouts, computed with torch alone from qscheme's canonical tensors.

vLLM's Marlin GEMM (``torch.ops._C.marlin_gemm``) reads weights repacked into its own tiles by
``gptq_marlin_repack``, and scales, zero points and global scales re-encoded as its dequantizer
expects them. This module produces, bit for bit, what vLLM's prepare steps produce (vLLM 0.33.0:
``prepare_fp4_layer_for_marlin``, ``prepare_fp8_layer_for_marlin`` and
``MarlinLinearKernel.process_weights_after_loading``); the kernel (``qscheme_plugins.marlin_kernel``)
runs the repack op on the device. Nothing here imports vLLM: ``tests/test_marlin_layout.py``
checks every function against vLLM's own Python code, run in a side venv.

The steps, per weight family (N output features, K input features, G groups along K):

- **weight** (``marlin_pack_input``): the GPTQ layout the repack op takes, int32 [K/pack, N]
  with ``pack = 32 / bits`` consecutive K elements per word, element i in bits
  ``[bits*i, bits*(i+1))``. Codes are the scalar type's unsigned storage: int4 (two's
  complement) + 8 for ``uint4b8`` and for ``uint4`` with zero points, int8 + 128 for
  ``uint8b128``; e2m1 and e4m3 codes as they are. For FP4 and FP8 this is the canonical bytes
  viewed as int32 and transposed, as vLLM does.
- **tiles** (``marlin_tiles``): what ``gptq_marlin_repack`` returns, in Python (the CUDA op
  cannot run here): [K/16, N*16/pack] int32, 16x16 tiles laid out row after row, permuted
  within each group of 1024 elements (``marlin_weight_perm``) and packed ``pack`` per word.
- **padding** (``marlin_padded_nk``): N and K are zero-padded to the cheaper of (N % 64,
  K % 128) and (N % 128, K % 64), K kept a multiple of the group size. Zero codes in padded
  columns meet zero scales; zero codes in padded rows meet zero inputs (the kernel pads x).
- **scales** (``marlin_permute_scales``): [G, N] in the activation dtype, permuted within
  blocks of 64 columns for grouped scales, within blocks of 32 for one group (channel scales,
  or a group as long as K). Then, per format:
  NVFP4 (``nvfp4_marlin_scales``): e4m3 scales re-encoded as vLLM's "S0E5M3" bytes, optionally
  multiplied by a power of two (bfloat16 only) that the global scale then divides;
  global scale (``nvfp4_marlin_global_scale``) times 2**119 (bfloat16) or 2**7 (float16);
  MXFP4 (``mxfp4_marlin_scales``): e8m0 scales through the activation dtype back to e8m0;
  FP8 (``fp8_marlin_scales``): times 2**120 (bfloat16) or 2**8 (float16).
- **zero points** (``marlin_zero_points``): unsigned [G, N] (``uint4``: zero point + 8 for int4
  ones, as compressed-tensors' offset-binary packing already holds them), permuted like
  grouped scales, interleaved like the weight, packed 8 per int32 along N.
- **bias** (``marlin_permute_bias``): permuted within blocks of 32 like channel scales.

``marlin_operands`` runs every step for a ``CanonicalWeight`` except the repack itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

from qscheme.canonical import CanonicalWeight
from qscheme.errors import UsageError
from qscheme.formats.table import FORMAT_FACTS

TILE = 16  # Marlin tiles are 16 x 16 elements
PERM_BLOCK = 1024  # the weight permutation acts on blocks of 4 tiles
MIN_THREAD_N = 64
MIN_THREAD_K = 128
CHANNEL = -1  # vLLM's group size for one scale per output channel

# vLLM's scalar type, by (canonical weight format, has zero points): names in
# ``vllm.scalar_type.scalar_types``; the kernel looks the type (and its ``id``) up there.
SCALAR_TYPES: dict[tuple[str, bool], str] = {
    ("int4", False): "uint4b8",
    ("int4", True): "uint4",
    ("uint4", True): "uint4",
    ("int8", False): "uint8b128",
    ("e4m3", False): "float8_e4m3fn",
    ("e2m1", False): "float4_e2m1f",
}

# Offset turning a canonical code into the scalar type's unsigned storage.
_CODE_OFFSETS: dict[str, int] = {"int4": 8, "int8": 128}
_BITS: dict[str, int] = {name: FORMAT_FACTS[name].bits for name in ("int4", "uint4", "e2m1", "int8", "e4m3")}
# Within 8 (4-bit) or 4 (8-bit) consecutive values, the order Marlin's dequantizer reads them in.
_INTERLEAVE: dict[int, tuple[int, ...]] = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}
# Exponent bias Marlin's dequantizer leaves out of FP4 and FP8 values, per activation dtype.
_FP4_GLOBAL_SCALE_EXPONENT = {torch.bfloat16: 2**7 - 2 - 7, torch.float16: 2**4 - 2 - 7}
_FP8_SCALE_EXPONENT = {torch.bfloat16: 2**7 - 2**3, torch.float16: 2**4 - 2**3}


def marlin_scalar_type(weight_format: str, zero_points: bool) -> str:
    """The name of vLLM's scalar type for a canonical weight format; UsageError if Marlin has none."""
    name = SCALAR_TYPES.get((weight_format, zero_points))
    if name is None:
        supported = ", ".join(f"{fmt}{' with zero points' if zp else ''}" for fmt, zp in SCALAR_TYPES)
        raise UsageError(
            f"Marlin has no scalar type for {weight_format} weights{' with zero points' if zero_points else ''}; "
            f"it runs {supported}"
        )
    return name


def weight_bits(weight_format: str) -> int:
    """Bits per weight element of a format Marlin runs (4 or 8)."""
    if weight_format not in _BITS:
        raise UsageError(f"Marlin runs 4-bit and 8-bit weights (int4, uint4, e2m1, int8, e4m3), not {weight_format}")
    return _BITS[weight_format]


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def marlin_padded_nk(n: int, k: int, group_size: int = CHANNEL) -> tuple[int, int]:
    """The smallest (padded N, padded K) of Marlin's two thread-tile families, (N % 64, K % 128)
    and (N % 128, K % 64), K kept a multiple of the group size; ties go to the smaller sum."""
    group = group_size if group_size > 0 else 1
    candidates = (
        (_round_up(n, MIN_THREAD_N), _round_up(k, math.lcm(MIN_THREAD_K, group))),
        (_round_up(n, MIN_THREAD_K), _round_up(k, math.lcm(MIN_THREAD_N, group))),
    )
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def _pack_rows(values: Tensor, bits: int) -> Tensor:
    """Unsigned values [..., L] (L a multiple of 32 / bits) -> int32 [..., L * bits / 32], value i
    of each word in bits [bits*i, bits*(i+1))."""
    per_word = 32 // bits
    lanes = values.to(torch.int64).unflatten(-1, (-1, per_word))
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (lanes << shifts).sum(-1)  # the lanes' bits never overlap
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _unpack_rows(words: Tensor, bits: int) -> Tensor:
    """Inverse of ``_pack_rows``: int32 [..., W] -> unsigned int64 values [..., W * 32 / bits]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=words.device) * bits
    values = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)


def unsigned_codes(codes: Tensor, weight_format: str, k: int) -> Tensor:
    """Canonical codes -> the scalar type's unsigned storage values, int64 [N, K]."""
    bits = weight_bits(weight_format)
    if bits == 4:
        raw = codes.view(torch.uint8).to(torch.int64)
        values = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)[:, :k]
    else:
        values = codes.view(torch.uint8).to(torch.int64)
    offset = _CODE_OFFSETS.get(weight_format, 0)
    return (values + offset) & ((1 << bits) - 1)  # signed + offset, mod 2**bits: the sign bit flips


def marlin_pack_input(
    codes: Tensor, weight_format: str, k: int, padded_n: int | None = None, padded_k: int | None = None
) -> Tensor:
    """Canonical codes [N, ceil(K/2)] (4-bit) or [N, K] (8-bit) -> the GPTQ-layout int32
    [padded_K / pack, padded_N] that ``gptq_marlin_repack`` takes, zero-padded (no padding when
    the padded sizes are not given; K is then rounded up to whole words)."""
    bits = weight_bits(weight_format)
    per_word = 32 // bits
    n = codes.shape[0]
    padded_n = n if padded_n is None else padded_n
    padded_k = _round_up(k, per_word) if padded_k is None else padded_k
    if padded_k % per_word or padded_n < n or padded_k < k:
        raise UsageError(f"cannot pad a {n}x{k} weight to {padded_n}x{padded_k} ({per_word} elements per word)")
    values = functional.pad(unsigned_codes(codes, weight_format, k), (0, padded_k - k, 0, padded_n - n))
    return _pack_rows(values, bits).T.contiguous()


def marlin_weight_perm(bits: int) -> Tensor:
    """The order in which Marlin stores the 1024 elements of four consecutive 16x16 tiles
    (flattened tile by tile, each row-major), int64 [1024], for 16-bit activations."""
    thread = torch.arange(32).view(32, 1, 1, 1)  # one of the warp's 32 threads
    tile = torch.arange(4).view(1, 4, 1, 1)  # which of the 4 tiles
    half = torch.arange(2).view(1, 1, 2, 1)  # left or right 8 columns
    pair = thread % 4
    rows = torch.stack((2 * pair, 2 * pair + 1, 2 * pair + 8, 2 * pair + 9), dim=-1).view(32, 1, 1, 4)
    order = (TILE * rows + thread // 4 + 8 * half + 256 * tile).flatten()
    interleave = torch.tensor(_INTERLEAVE[bits])
    return order.view(-1, len(interleave))[:, interleave].flatten()


def marlin_tiles(packed: Tensor, size_k: int, size_n: int, bits: int) -> Tensor:
    """What ``gptq_marlin_repack(packed, size_k, size_n, bits)`` returns (16-bit activations, no
    act-order): GPTQ-layout int32 [K / pack, N] -> Marlin tiles, int32 [K / 16, N * 16 / pack]."""
    if size_k % TILE or size_n % TILE:
        raise UsageError(f"Marlin tiles need K and N multiples of {TILE}, got K={size_k}, N={size_n}")
    values = _unpack_rows(packed.T.contiguous(), bits).T  # [K, N]
    tiles = values.reshape(size_k // TILE, TILE, size_n // TILE, TILE).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, PERM_BLOCK)[:, marlin_weight_perm(bits).to(packed.device)]
    return _pack_rows(tiles.reshape(size_k // TILE, size_n * TILE), bits)


def _scale_perms() -> tuple[Tensor, Tensor]:
    """(grouped, single): the column orders of scales within blocks of 64 and of 32 columns."""
    grouped = torch.arange(64).view(8, 8).T.flatten()
    single = (2 * torch.arange(4).view(4, 1) + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])).flatten()
    return grouped, single


def marlin_pad_scales(scales: Tensor, n: int, k: int, padded_n: int, padded_k: int, group_size: int) -> Tensor:
    """Zero-pad scales (or unsigned zero points) [G, N] to [padded_K / group, padded_N]
    (channel scales keep their one row)."""
    if (padded_n, padded_k) == (n, k):
        return scales
    rows = padded_k // group_size - scales.shape[0] if group_size > 0 else 0
    return functional.pad(scales, (0, padded_n - n, 0, rows))


def marlin_permute_scales(scales: Tensor, size_k: int, size_n: int, group_size: int) -> Tensor:
    """Scales [G, N] (N a multiple of 64) in Marlin's column order, for 16-bit activations."""
    grouped, single = _scale_perms()
    perm = grouped if group_size != CHANNEL and group_size < size_k else single
    permuted = scales.reshape(-1, perm.numel())[:, perm.to(scales.device)]
    return permuted.reshape(-1, size_n).contiguous()


def marlin_permute_bias(bias: Tensor) -> Tensor:
    """A bias [N] (padded to the weight's N) in Marlin's output column order."""
    _, single = _scale_perms()
    return bias.reshape(-1, single.numel())[:, single.to(bias.device)].reshape(bias.shape).contiguous()


def marlin_zero_points(zero_points: Tensor, groups: int, size_n: int, bits: int) -> Tensor:
    """Unsigned zero points [G, N] (N a multiple of 64) -> int32 [G, N * bits / 32]: permuted
    like grouped scales, interleaved like the weight, packed along N."""
    grouped, _ = _scale_perms()
    values = zero_points.reshape(-1, grouped.numel())[:, grouped.to(zero_points.device)]
    interleave = torch.tensor(_INTERLEAVE[bits], device=zero_points.device)
    values = values.reshape(-1, interleave.numel())[:, interleave].reshape(groups, size_n)
    return _pack_rows(values, bits)


def _check_activation_dtype(activation_dtype: torch.dtype) -> None:
    if activation_dtype not in (torch.bfloat16, torch.float16):
        raise UsageError(f"Marlin runs bfloat16 and float16 activations, not {activation_dtype}")


def nvfp4_scale_factor(scales: Tensor, activation_dtype: torch.dtype) -> float:
    """The power of two (>= 1) that lifts the largest positive NVFP4 group scale as close to 448
    as it goes, so that every re-encoded scale keeps its leading bit; 1 for float16 activations."""
    if activation_dtype == torch.float16:
        return 1.0
    lifted = scales.float() * 2**7
    positive = lifted[lifted > 0]
    if positive.numel():
        largest = positive.max()
        if largest < 448 * 2**7:
            return float((448 * 2**7 / largest).log2().floor().exp2().item())
    return 1.0


def nvfp4_marlin_scales(
    permuted: Tensor, activation_dtype: torch.dtype, scale_factor: float | None = None
) -> tuple[Tensor, float]:
    """Permuted e4m3 group scales (any float dtype holding their values) -> (float8_e4m3fn bytes of
    Marlin's "S0E5M3" encoding, the scale factor the global scale must be divided by).

    Each scale goes through float16: times the scale factor, times 2**7, zeroed below 2, and the
    float16 bits shifted left by one, keeping the high byte (sign dropped, five exponent bits,
    three mantissa bits). Scales are taken in pairs of pairs, reordered (0, 2, 1, 3)."""
    _check_activation_dtype(activation_dtype)
    half = permuted.to(torch.float16)
    half = half.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(permuted.shape[0], -1)
    if scale_factor is None:
        scale_factor = nvfp4_scale_factor(half, activation_dtype)
    if scale_factor > 1.0:
        half = (half.float() * scale_factor).to(torch.float16)
    half = half * 2**7
    half = torch.where(half < 2, torch.zeros_like(half), half)
    shifted = half.view(torch.int16).to(torch.int32) << 1
    high_byte = ((shifted >> 8) & 0xFF).to(torch.uint8)
    return high_byte.view(torch.float8_e4m3fn).contiguous(), scale_factor


def nvfp4_marlin_global_scale(global_scale: Tensor, activation_dtype: torch.dtype, scale_factor: float = 1.0) -> Tensor:
    """The float32 global scale Marlin takes: times 2**119 (bfloat16) or 2**7 (float16), the
    exponent bias its FP4 dequantizer leaves out, divided by the group scales' scale factor."""
    _check_activation_dtype(activation_dtype)
    biased = global_scale.to(torch.float32) * (2.0 ** _FP4_GLOBAL_SCALE_EXPONENT[activation_dtype])
    return biased / scale_factor if scale_factor != 1.0 else biased


def mxfp4_marlin_scales(permuted: Tensor) -> Tensor:
    """Permuted e8m0 scales (in the activation dtype) -> float8_e8m0fnu, pairs of pairs
    reordered (0, 2, 1, 3) as Marlin's FP4 dequantizer reads them (16-bit activations)."""
    reordered = permuted.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(permuted.shape[0], -1)
    return reordered.to(torch.float8_e8m0fnu)


def fp8_marlin_scales(permuted: Tensor) -> Tensor:
    """Permuted FP8 weight scales (bfloat16 or float16) times 2**120 or 2**8, the exponent bias
    Marlin's FP8 dequantizer leaves out, in their own dtype."""
    _check_activation_dtype(permuted.dtype)
    return permuted * torch.tensor(2.0 ** _FP8_SCALE_EXPONENT[permuted.dtype], dtype=permuted.dtype)


@dataclass(frozen=True)
class MarlinOperands:
    """One layer's operands for vLLM's Marlin GEMM, all but the repack (run ``gptq_marlin_repack``
    on ``packed_weight`` with ``padded_k``, ``padded_n`` and ``bits``; ``marlin_tiles`` is its
    CPU equivalent)."""

    packed_weight: Tensor  # int32 [padded_K / pack, padded_N], GPTQ layout
    scales: Tensor  # [G, padded_N] (e4m3 or e8m0 bytes for FP4, the activation dtype otherwise)
    zero_points: Tensor | None  # int32 [G, padded_N * bits / 32]
    global_scale: Tensor | None  # float32 [1] (NVFP4)
    scalar_type: str  # a name in vllm.scalar_type.scalar_types
    bits: int
    group_size: int  # CHANNEL (-1) for one scale per output channel
    n: int
    k: int
    padded_n: int
    padded_k: int


def _scale_rows(weight: CanonicalWeight, activation_dtype: torch.dtype) -> tuple[Tensor, int]:
    """The weight scales as vLLM's Marlin prepare takes them, [G, N], and the group size."""
    spec = weight.scheme.weight.scale
    scale = weight.scale
    if spec.format == "e8m0":
        scale = scale.view(torch.uint8).view(torch.float8_e8m0fnu)
    scale = scale.to(activation_dtype)
    if spec.granularity == "group":
        assert spec.group_size is not None
        return scale.T.contiguous(), spec.group_size
    if spec.granularity == "channel":
        return scale.reshape(1, weight.n), CHANNEL
    if spec.granularity == "tensor":  # one scale per partition, repeated over its channels
        sizes = torch.tensor(weight.partitions or (weight.n,), device=scale.device)
        return scale.reshape(-1).repeat_interleave(sizes).reshape(1, weight.n), CHANNEL
    if spec.granularity == "block":  # [N/R, K/C] blocks -> groups of C along K, repeated along N
        assert spec.block is not None
        rows, columns = spec.block
        return scale.T.repeat_interleave(rows, dim=1)[:, : weight.n].contiguous(), columns
    raise UsageError(f"Marlin takes group, channel, tensor and block scales, not {spec.granularity} ones")


def _global_scale(weight: CanonicalWeight) -> Tensor:
    global_scale = weight.global_scale
    assert global_scale is not None
    if global_scale.numel() > 1 and not bool((global_scale == global_scale[0]).all()):
        raise UsageError(
            f"Marlin takes one global scale per layer; scheme {weight.scheme.name} has {global_scale.numel()} "
            f"partitions with different ones ({', '.join(f'{v:.6g}' for v in global_scale.tolist())})"
        )
    return global_scale.reshape(-1)[:1].to(torch.float32)


def _unsigned_zero_points(weight: CanonicalWeight) -> Tensor:
    """Canonical zero points [N, G] -> uint4 values [G, N] (int4 codes and zero points both + 8)."""
    assert weight.zero_point is not None
    offset = _CODE_OFFSETS.get(weight.scheme.weight.format, 0)
    values = weight.zero_point.to(torch.int32) + offset
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise UsageError(
            f"scheme {weight.scheme.name}: Marlin's uint4 zero points must lie in [0, 15] after the "
            f"codes' offset of {offset}; found [{int(values.min())}, {int(values.max())}]"
        )
    return values.T.contiguous()


def marlin_operands(weight: CanonicalWeight, activation_dtype: torch.dtype) -> MarlinOperands:
    """Every Marlin operand of a canonical weight but the repack, as vLLM prepares them.

    UsageError where Marlin has no layout for the weight (a format or scale it does not take,
    fused partitions with different global scales, activations other than bfloat16/float16)."""
    _check_activation_dtype(activation_dtype)
    scheme = weight.scheme
    weight_format = scheme.weight.format
    has_zero_points = weight.zero_point is not None
    scalar_type = marlin_scalar_type(weight_format, has_zero_points)
    bits = weight_bits(weight_format)
    scales, group_size = _scale_rows(weight, activation_dtype)
    n, k = weight.n, weight.k
    padded_n, padded_k = marlin_padded_nk(n, k, group_size)
    packed = marlin_pack_input(weight.codes, weight_format, k, padded_n, padded_k)
    scales = marlin_permute_scales(
        marlin_pad_scales(scales, n, k, padded_n, padded_k, group_size), padded_k, padded_n, group_size
    )
    global_scale = zero_points = None
    if scheme.weight.scale.format == "e4m3" and weight_format == "e2m1":
        scales, scale_factor = nvfp4_marlin_scales(scales, activation_dtype)
        if weight.global_scale is not None:
            global_scale = nvfp4_marlin_global_scale(_global_scale(weight), activation_dtype, scale_factor)
        else:
            global_scale = nvfp4_marlin_global_scale(
                torch.ones(1, device=scales.device), activation_dtype, scale_factor
            )
    elif scheme.weight.scale.format == "e8m0":
        scales = mxfp4_marlin_scales(scales)
    elif weight_format == "e4m3":
        scales = fp8_marlin_scales(scales)
    if has_zero_points:
        unsigned = marlin_pad_scales(_unsigned_zero_points(weight), n, k, padded_n, padded_k, group_size)
        zero_points = marlin_zero_points(unsigned, unsigned.shape[0], padded_n, bits)
    return MarlinOperands(
        packed_weight=packed,
        scales=scales,
        zero_points=zero_points,
        global_scale=global_scale,
        scalar_type=scalar_type,
        bits=bits,
        group_size=group_size,
        n=n,
        k=k,
        padded_n=padded_n,
        padded_k=padded_k,
    )
