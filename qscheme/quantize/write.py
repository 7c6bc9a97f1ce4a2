"""Checkpoint tensors from element codes and scales: packing, stored dtypes, shapes, conventions.

Everything here follows the scheme's descriptor: the tensor names, the packing of the weight
and of zero points, the declared dtypes and shapes (evaluated for N and K) and whether a scale
is stored as a multiplier or as its reciprocal.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from qscheme.canonical import stored_zero_points
from qscheme.descriptor import Scheme, TensorSpec
from qscheme.errors import QuantizeError
from qscheme.formats import get_element_format, pack_fp4_k, pack_int4_n, pack_int32_k, pack_int32_n
from qscheme.quantize.rules import WeightParameters, WeightPlan

_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The descriptor's name of a torch dtype (``float8_e4m3fn``, ...), else torch's own without ``torch.``."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def allowed_dtype(spec: TensorSpec, preferred: torch.dtype) -> torch.dtype:
    """``preferred`` when the descriptor allows it, else the first dtype it lists."""
    if _DTYPE_NAMES.get(preferred) in spec.dtypes:
        return preferred
    return _DTYPES[spec.dtypes[0]]


def stored_shape(spec: TensorSpec, n: int, k: int, numel: int, scheme: Scheme) -> tuple[int, ...]:
    """The first declared shape of ``spec`` for N x K that holds ``numel`` values."""
    for shape in spec.expected_shapes(n, k):
        if _numel(shape) == numel:
            return shape
    raise QuantizeError(
        f"scheme {scheme.name}: tensor {spec.name!r} is declared {spec.describe_shapes()}, which for "
        f"N={n}, K={k} does not hold the {numel} values computed for it; check the descriptor's shapes"
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _finish(tensor: Tensor, spec: TensorSpec, plan: WeightPlan) -> Tensor:
    shape = stored_shape(spec, plan.n, plan.k, tensor.numel(), plan.scheme)
    if spec.transposed:  # computed in the canonical orientation, stored as its transpose
        return tensor.reshape(shape[::-1]).T.contiguous()
    return tensor.reshape(shape).contiguous()


# --- the weight ------------------------------------------------------------------------------


def pack_codes(plan: WeightPlan, codes: Tensor) -> Tensor:
    """Pack uint8 element codes of some rows [rows, K] as the descriptor's packing stores them."""
    element, packing = plan.element, plan.scheme.weight.packing
    if element.kind == "int" and element.signed:
        values = codes.view(torch.int8)
    else:
        values = codes
    if packing == "nibbles_k":
        return pack_fp4_k(codes & 0x0F if element.kind == "int" else codes)
    if packing in ("int32_k", "int32_n"):
        if not element.signed:
            # unsigned values are stored as they are: pack_int32_k adds back the offset it expects
            values = values.to(torch.int16) - (1 << (element.bits - 1))
        pack = pack_int32_k if packing == "int32_k" else pack_int32_n
        return pack(values, element.bits, plan.scheme.weight.pack_order)
    if packing == "int4_n":
        return pack_int4_n(values)
    if element.kind == "float":
        return codes.view(element.storage_dtype)
    return values


def packed_layout(plan: WeightPlan) -> tuple[tuple[int, int], torch.dtype]:
    """Shape and dtype of ``pack_codes`` over all N rows."""
    element, packing, n, k = plan.element, plan.scheme.weight.packing, plan.n, plan.k
    if packing == "nibbles_k":
        return (n, -(-k // 2)), torch.uint8
    if packing == "int32_k":
        return (n, -(-k * element.bits // 32)), torch.int32
    if packing == "int32_n":
        return (-(-n * element.bits // 32), k), torch.int32
    if packing == "int4_n":
        return (-(-n // 2), k), torch.uint8
    return (n, k), element.storage_dtype


def packed_rows(plan: WeightPlan, rows: slice) -> slice:
    """The rows of the packed weight holding weight rows ``rows``."""
    per_packed_row = packed_row_unit(plan)
    return slice(rows.start // per_packed_row, -(-rows.stop // per_packed_row))


def packed_row_unit(plan: WeightPlan) -> int:
    """Weight rows per packed row: the multiple a slab of rows is packed in."""
    packing = plan.scheme.weight.packing
    if packing == "int4_n":
        return 2
    if packing == "int32_n":
        return 32 // plan.element.bits
    return 1


def weight_tensor(plan: WeightPlan, packed: Tensor) -> Tensor:
    spec = plan.scheme.weight.tensor
    if _DTYPE_NAMES.get(packed.dtype) not in spec.dtypes:
        raise QuantizeError(
            f"scheme {plan.scheme.name}: the packed weight is {packed.dtype}, but {spec.name!r} is declared "
            f"{', '.join(spec.dtypes)}; check the weight's format and packing"
        )
    return _finish(packed, spec, plan)


# --- scales, zero points and the rest ---------------------------------------------------------


def _stored_convention(value: Tensor, convention: str, wanted: str) -> Tensor:
    return value if convention == wanted else torch.reciprocal(value.to(torch.float32))


def write_tensors(
    plan: WeightPlan,
    parameters: WeightParameters,
    weight: Tensor,
    given_inputs: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """Every tensor of the layer, keyed by its checkpoint name, in the scheme's declaration order."""
    scheme = plan.scheme
    spec = scheme.weight
    tensors: dict[str, Tensor] = {spec.tensor.name: weight_tensor(plan, weight)}

    scale = parameters.stored_scale
    if spec.scale.stored == "reciprocal":
        scale = torch.reciprocal(scale.to(torch.float32)).to(scale.dtype)
    tensors[spec.scale.tensor.name] = _finish(scale, spec.scale.tensor, plan)

    if spec.global_scale is not None:
        if parameters.global_scale is None or parameters.global_convention is None:
            raise QuantizeError(f"scheme {scheme.name}: the rules computed no global scale")
        value = _stored_convention(parameters.global_scale, parameters.global_convention, spec.global_scale.stored)
        value = value.to(allowed_dtype(spec.global_scale.tensor, torch.float32))
        tensors[spec.global_scale.tensor.name] = _finish(value, spec.global_scale.tensor, plan)

    if spec.zero_point is not None:
        if parameters.zero_point is None:
            raise QuantizeError(f"scheme {scheme.name}: the rules computed no zero point")
        tensors[spec.zero_point.tensor.name] = _zero_point_tensor(plan, parameters.zero_point)

    if spec.symmetric_zero_point is not None:
        assert spec.symmetric_zero_point.equals is not None  # the parser sets it for this role
        rows = parameters.stored_scale.reshape(plan.n, -1) if spec.scale.granularity != "tensor" else None
        like = rows if rows is not None else parameters.stored_scale
        values = torch.full_like(like, spec.symmetric_zero_point.equals)
        stored = stored_zero_points(plan.scheme, values.to(torch.int16), spec.symmetric_zero_point)
        tensors[spec.symmetric_zero_point.tensor.name] = _finish(stored, spec.symmetric_zero_point.tensor, plan)

    if spec.scale.group_index is not None:
        group = spec.scale.group_size or plan.k
        index = torch.arange(plan.k, device=weight.device) // group
        tensors[spec.scale.group_index.name] = _finish(
            index.to(dtype_of(spec.scale.group_index.dtypes[0])), spec.scale.group_index, plan
        )

    if spec.shape_tensor is not None:
        shape = torch.tensor([plan.n, plan.k], dtype=dtype_of(spec.shape_tensor.dtypes[0]), device=weight.device)
        tensors[spec.shape_tensor.name] = _finish(shape, spec.shape_tensor, plan)

    for name, value in given_inputs.items():
        tensors[name] = value
    return tensors


def _zero_point_tensor(plan: WeightPlan, zero_point: Tensor) -> Tensor:
    """Zero points (int16 values in the weight element's range) as the descriptor stores them.

    They must fit the zero-point format: a uint4 weight's zero points lie in [0, 15], which an
    int4 zero point cannot hold, so that is a QuantizeError naming both ranges. Unpacked 8-bit
    zero points in the 8-bit dtype of the other signedness keep their bits (uint8 200 in an int8
    tensor is the byte 0xC8), as ``qscheme.canonical.canonical_zero_point`` reads them.
    """
    spec = plan.scheme.weight.zero_point
    assert spec is not None
    fmt = get_element_format(spec.format)
    values = zero_point.to(torch.int16)
    found = (int(values.min()), int(values.max())) if values.numel() else (0, 0)
    low, high = int(fmt.min_value), int(fmt.max_value)
    if found[0] < low or found[1] > high:
        raise QuantizeError(
            f"scheme {plan.scheme.name}: zero_point format {spec.format!r} holds [{low}, {high}], but the "
            f"zero points computed for the {plan.element.name} weight lie in [{found[0]}, {found[1]}]; "
            f"declare the zero point format {plan.element.name!r} (the weight's)"
        )
    dtype = dtype_of(spec.tensor.dtypes[0])
    reinterpreted = fmt.bits == 8 and dtype == (torch.uint8 if fmt.signed else torch.int8)  # kept by their bits
    if spec.packing != "int32_n" and not dtype.is_floating_point and not reinterpreted:
        info = torch.iinfo(dtype)
        if found[0] < info.min or found[1] > info.max:
            raise QuantizeError(
                f"scheme {plan.scheme.name}: tensor {spec.tensor.name!r} is declared {_DTYPE_NAMES[dtype]}, "
                f"which cannot hold the {spec.format} zero points found in [{found[0]}, {found[1]}]; "
                "declare a dtype that holds the zero-point format"
            )
    return _finish(stored_zero_points(plan.scheme, values), spec.tensor, plan)
