"""The ``cpu_gemv`` kernel: ``qscheme.cpu_gemv``'s C++ GEMV behind the kernel interface.

``prepare`` keeps the canonical tensors as they are (``qscheme.cpu_gemv.layout_of``: views,
plus a float32 value per row where a global or per-tensor scale is folded per row). ``apply``
flattens the input to [M, K] and:

- weight-only with bfloat16 or float32 inputs and no pre-scale: one call of the extension, which
  converts a bfloat16 input itself and rounds the output once to the input's dtype;
- weight-only with an AWQ pre-scale and bfloat16 inputs: the input times the pre-scale in float32,
  rounded once to bfloat16 (as ``tinygemm_cpu`` and ``dequant_gemm`` take it), then one call of
  the extension as above, so that its bfloat16 loops (VNNI, AMX tiles) run AWQ layers too;
- quantized activations whose dequantized input is integer or e4m3 code values times one float32
  scale per row (per-tensor or per-token FP8 and int8: FP8, FP8_DYNAMIC, W8A8), quantized as the
  reference kernel quantizes them (``qscheme.emulation.quantize_activation``, after any AWQ
  pre-scale): the code values (exact in bfloat16, so the extension's AMX tile path takes them) go
  through the extension for each run of fused partitions sharing static input scales, and each
  output row is multiplied by its scale afterwards, the bias added in float32 (one rounding where
  the reference rounds each code times the scale: within the declared bound);
- otherwise (float16 inputs, float32 inputs with an AWQ pre-scale, other quantized activations)
  the float32 input the
  reference kernel multiplies (``ReferenceKernel.quantize_input``: pre-scaled, then quantized and
  dequantized exactly as the scheme says, once per run of fused partitions sharing their static
  input scales) goes through the extension for those partitions' rows, and the float32 result is
  rounded once to the input's dtype.

A layer whose canonical columns are the input channels permuted (GPTQ act-order,
``CanonicalWeight.input_permutation``) keeps its codes as stored: the input (after any pre-scale
and activation emulation, which take it in the input's order) is permuted the same way.

Rows of the weight are split over ``torch.get_num_threads()`` worker threads of the extension.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from qscheme_plugins.reference_kernel import ReferenceKernel, ReferenceState, input_scalings
from torch import Tensor

from qscheme import cpu_gemv
from qscheme.canonical import CanonicalWeight
from qscheme.cpu_gemv import GemvLayout
from qscheme.emulation import activation_codes, apply_pre_scale, prepare_input, quantize_activation
from qscheme.errors import UsageError
from qscheme.formats import decode

DIRECT_DTYPES = (torch.bfloat16, torch.float32)  # the extension reads these inputs itself


@dataclass(frozen=True)
class CpuGemvState:
    """The extension's view of the layer, and what the input needs before it (None: nothing).
    ``permutation``: the canonical columns' input channels (GPTQ act-order), or None."""

    layout: GemvLayout
    emulation: ReferenceState | None
    permutation: Tensor | None = None

    @property
    def k(self) -> int:
        return self.layout.k


def _rows(layout: GemvLayout, start: int, stop: int) -> GemvLayout | None:
    """The layout of weight rows [start, stop) (views), or None where a block of scale rows
    straddles ``start`` (then the whole layer is multiplied and the rows sliced)."""
    code_kind, scale_kind, scale_cols, group_n, group_k, divide, n, k, zero_max = layout.meta
    if start == 0 and stop == n:
        return layout
    if start % group_n:
        return None
    first, last = start // group_n, -(-stop // group_n)
    per_scale_row = scale_kind != cpu_gemv.SCALE_NONE
    return GemvLayout(
        codes=layout.codes[start:stop],
        scale=layout.scale[first:last] if layout.scale is not None and per_scale_row else layout.scale,
        zero_point=None if layout.zero_point is None else layout.zero_point[first:last],
        row_scale=None if layout.row_scale is None else layout.row_scale[start:stop],
        lut=layout.lut,
        scale_table=layout.scale_table,
        meta=(code_kind, scale_kind, scale_cols, group_n, group_k, divide, stop - start, k, zero_max),
    )


class CpuGemvKernel:
    """KernelImplementation of ``cpu_gemv`` (CPU)."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> CpuGemvState:
        device = torch.device(device)
        if device.type != "cpu":
            raise UsageError(f"cpu_gemv runs on the CPU, not {device}")
        if not cpu_gemv.available():
            raise UsageError(
                "cpu_gemv: the C++ extension qscheme._cpu_gemv is not built; reinstall qscheme with a C++17 "
                "compiler (pip install --no-build-isolation -e .)"
            )
        weight = weight.to(device)
        permutation = weight.input_permutation
        if permutation is not None and weight.scheme.activation is not None:
            raise UsageError(
                f"cpu_gemv permutes the input channels of weight-only layers only; scheme {weight.scheme.name} "
                "quantizes its activations (run the layer on the reference kernel)"
            )
        # the codes as stored (column j holds input channel permutation[j]); apply() permutes x to match
        layout = cpu_gemv.layout_of(
            weight if permutation is None else dataclasses.replace(weight, input_permutation=None)
        )
        emulation = None
        if weight.scheme.activation is not None or weight.input_pre_scale is not None:
            pre_scale = weight.input_pre_scale
            emulation = ReferenceState(
                canonical=weight,
                k=weight.k,
                activation=weight.scheme.activation,
                scalings=input_scalings(weight, device) if weight.scheme.activation is not None else (),
                pre_scale=None if pre_scale is None else pre_scale.to(dtype=torch.float32),
            )
        return CpuGemvState(layout=layout, emulation=emulation, permutation=permutation)

    def apply(self, state: CpuGemvState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        rows = x.reshape(-1, state.k)
        layout = state.layout
        if state.emulation is None and x.dtype in DIRECT_DTYPES:
            y = cpu_gemv.gemv(layout, _in_code_order(state, rows), bias)
            return y.reshape(*x.shape[:-1], layout.n)
        emulation = state.emulation
        if emulation is not None and emulation.activation is None and x.dtype == torch.bfloat16:
            assert emulation.pre_scale is not None  # weight-only with an emulation state: an AWQ pre-scale
            # the pre-scaled input rounded once to bfloat16, so that the bfloat16 loops (VNNI, AMX) take it
            scaled = prepare_input(rows, None, pre_scale=emulation.pre_scale, dtype=torch.bfloat16)
            return cpu_gemv.gemv(layout, _in_code_order(state, scaled), bias).reshape(*x.shape[:-1], layout.n)
        factored = None if state.emulation is None else scaled_codes(state.emulation, rows)
        if factored is not None:  # the codes times the weight, then each row's activation scale
            outputs = []
            for start, stop, codes, factor in factored:
                part = _rows(layout, start, stop)
                y = cpu_gemv.gemv(layout, codes)[:, start:stop] if part is None else cpu_gemv.gemv(part, codes)
                y = y * factor
                outputs.append(y if bias is None else y + bias[start:stop].to(torch.float32))
            y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
            return y.to(x.dtype).reshape(*x.shape[:-1], layout.n)
        if state.emulation is None:
            pieces = [(0, layout.n, _in_code_order(state, rows.to(torch.float32)))]
        else:
            inputs = ReferenceKernel().quantize_input(state.emulation, rows)
            pieces = [
                (0, layout.n, _in_code_order(state, values))
                if scaling is None
                else (scaling.start, scaling.stop, _in_code_order(state, values))
                for scaling, values in inputs
            ]
        outputs = []
        for start, stop, values in pieces:
            part = _rows(layout, start, stop)
            part_bias = None if bias is None else bias[start:stop]
            if part is None:
                outputs.append(cpu_gemv.gemv(layout, values.contiguous())[:, start:stop])
                if part_bias is not None:
                    outputs[-1] = outputs[-1] + part_bias.to(torch.float32)
            else:
                outputs.append(cpu_gemv.gemv(part, values.contiguous(), part_bias))
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return y.to(x.dtype).reshape(*x.shape[:-1], layout.n)


def _in_code_order(state: CpuGemvState, rows: Tensor) -> Tensor:
    """The input's columns in the order of the codes' columns (act-order layers), else as given."""
    return rows if state.permutation is None else rows.index_select(1, state.permutation)


# Activation formats whose code values are exact in bfloat16 (the GEMV's tile path takes them).
FACTORED_FORMATS = ("e4m3", "int8")


def scaled_codes(state: ReferenceState, rows: Tensor) -> list[tuple[int, int, Tensor, Tensor]] | None:
    """The quantized input as (start, stop, code values, per-row scale) for each run of output
    rows sharing static input scales, where each row's dequantized input is its code values times
    one float32 scale (per tensor or per token, no group or global scale): the product is then
    taken as scale * (codes . w), one rounding where the reference kernel rounds each code times
    the scale (within the declared bound); None otherwise (the reference's float32 input is used)."""
    activation = state.activation
    if activation is None:
        return None
    values = rows if state.pre_scale is None else apply_pre_scale(rows, state.pre_scale)
    found = []
    for scaling in state.scalings:
        divisor = scaling.input_global_scale_divisor
        if divisor is None and scaling.input_global_scale is None:
            native = activation_codes(values, activation, input_scale=scaling.input_scale)
            if native is not None:  # the same codes and scales in one pass over x
                found.append((scaling.start, scaling.stop, *native))
                continue
        quantized = quantize_activation(
            values,
            activation,
            input_scale=scaling.input_scale,
            input_global_scale=None if divisor is not None else scaling.input_global_scale,
            input_global_scale_divisor=divisor,
        )
        if quantized.format not in FACTORED_FORMATS or quantized.group_size is not None:
            return None
        if quantized.global_scale is not None or quantized.global_scale_divisor is not None:
            return None
        factor = quantized.block_scale()  # [M, 1] per token, [1] per tensor
        codes = decode(quantized.codes, quantized.format).contiguous()
        found.append((scaling.start, scaling.stop, codes, factor))
    return found or None
