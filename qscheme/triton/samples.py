"""Random canonical layers of any scheme: inputs for the compile-only check, tests and benchmarks.

The codes cover every bit pattern of their format (NaN and infinity excepted) and the scales a
spread of magnitudes in their stored format (sized so that outputs fit in float16), so the
kernels' decoders see every case; fused partitions get distinct global and activation scales.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonical_zero_point, stored_zero_points, zero_point_range
from qscheme.descriptor import Scheme
from qscheme.formats import get_element_format
from qscheme.formats.table import FORMAT_FACTS

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _random_bytes(shape: tuple[int, ...], generator: torch.Generator, exclude: tuple[int, ...] = ()) -> Tensor:
    codes = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32)
    for byte in exclude:
        codes = torch.where(codes == byte, 0, codes)
    return codes.to(torch.uint8)


def _codes(element: str, n: int, k: int, generator: torch.Generator) -> Tensor:
    if FORMAT_FACTS[element].bits == 4:
        return _random_bytes((n, (k + 1) // 2), generator)
    if element == "e4m3":
        return _random_bytes((n, k), generator, exclude=(0x7F, 0xFF)).view(torch.float8_e4m3fn)
    if element == "e5m2":
        inf_nan = tuple(range(0x7C, 0x80)) + tuple(range(0xFC, 0x100))
        return _random_bytes((n, k), generator, exclude=inf_nan).view(torch.float8_e5m2)
    if element == "int8":
        return _random_bytes((n, k), generator).view(torch.int8)
    return _random_bytes((n, k), generator)


def _scale(fmt: str, element: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """Positive scales of magnitude about 1 / (the element format's largest value), times 2**[-4, 2),
    so that products stay in range for 16-bit outputs; e4m3 and e8m0 as their stored types."""
    largest = math.ceil(math.log2(get_element_format(element).max_value))
    exponent = torch.rand(shape, generator=generator) * 6 - 4 - largest
    if fmt == "e8m0":
        return (exponent.round() + 127).clamp(0, 254).to(torch.uint8)
    magnitude = torch.exp2(exponent)
    if fmt == "e4m3":
        return magnitude.clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    return magnitude.to(dtype)


def _scale_shape(scheme: Scheme, n: int, k: int, partitions: int) -> tuple[int, ...]:
    spec = scheme.weight.scale
    if spec.granularity == "group":
        assert spec.group_size is not None
        return (n, -(-k // spec.group_size))
    if spec.granularity == "block":
        assert spec.block is not None
        return (-(-n // spec.block[0]), -(-k // spec.block[1]))
    if spec.granularity == "channel":
        return (n, 1)
    return (partitions,)


def _zero_points(scheme: Scheme, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Zero points over the whole range of their format (both ends included), stored as the
    scheme stores them (its dtype, or ``int32_n`` words) and read back by the canonicalization."""
    spec = scheme.weight.zero_point
    assert spec is not None
    low, high = zero_point_range(spec)
    values = torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int16)
    flat = values.view(-1)
    flat[0], flat[-1] = low, high
    return canonical_zero_point(scheme, stored_zero_points(scheme, values), shape[0]).reshape(shape)


def random_weight(
    scheme: Scheme,
    n: int,
    k: int,
    partitions: tuple[int, ...] | None = None,
    seed: int = 0,
    scale_dtype: str | None = None,
) -> CanonicalWeight:
    """A random [n, k] layer of ``scheme`` in canonical form (on the CPU).

    ``scale_dtype`` (float32, bfloat16, float16) picks the dtype of float-format scales; by
    default the first the scheme allows.
    """
    generator = torch.Generator().manual_seed(seed)
    partitions = partitions or (n,)
    assert sum(partitions) == n
    count = len(partitions)
    weight = scheme.weight
    dtype_name = scale_dtype or weight.scale.tensor.dtypes[0]
    scale_dtype_ = _FLOAT_DTYPES.get(dtype_name, torch.float32)
    scale_shape = _scale_shape(scheme, n, k, count)
    scale = _scale(weight.scale.format, weight.format, scale_shape, scale_dtype_, generator)
    global_scale = None
    if weight.global_scale is not None:
        global_scale = torch.exp2(torch.rand(count, generator=generator) * 4 - 6)
    zero_point = None
    if weight.zero_point is not None:
        zero_shape = scale_shape if weight.scale.granularity in ("group", "block") else (n, 1)
        zero_point = _zero_points(scheme, zero_shape, generator)
    input_scale = input_global_scale = pre_scale = None
    activation = scheme.activation
    if activation is not None and activation.scale is not None:
        input_scale = torch.exp2(torch.rand(count, generator=generator) * 4 - 8)
    if activation is not None and activation.global_scale is not None:
        input_global_scale = torch.exp2(torch.rand(count, generator=generator) * 4 - 10)
    if scheme.input_pre_scale is not None:
        pre_scale = torch.exp2(torch.rand(k, generator=generator) * 2 - 1)
    return CanonicalWeight(
        scheme=scheme,
        n=n,
        k=k,
        codes=_codes(weight.format, n, k, generator),
        scale=scale,
        global_scale=global_scale,
        zero_point=zero_point,
        partitions=partitions,
        input_scale=input_scale,
        input_global_scale=input_global_scale,
        input_pre_scale=pre_scale,
    )


def model_scale_dtype(scheme: Scheme, input_dtype: torch.dtype) -> str | None:
    """The name of ``input_dtype`` when the scheme allows float scales stored in it (as
    checkpoints keep them in the model's dtype), else None (``random_weight``'s default)."""
    names = {dtype: name for name, dtype in _FLOAT_DTYPES.items()}
    name = names.get(input_dtype)
    return name if name in scheme.weight.scale.tensor.dtypes else None


__all__ = ["model_scale_dtype", "random_weight"]
