"""One bitsandbytes 4-bit layer's stored tensors, checked against its quant state and the config
from the headers alone.

transformers' ``save_pretrained`` of a ``Linear4bit`` writes, after the module name (bitsandbytes
0.50, ``Params4bit`` / ``QuantState.as_dict(packed=True)``):

| tensor | dtype | shape |
|---|---|---|
| ``weight`` | uint8 | [ceil(N*K/2), 1]: the row-major [N, K] codes, two per byte, element 2j in the HIGH nibble |
| ``weight.absmax`` | float32 (uint8 with double quantization) | [ceil(N*K/blocksize)]: one per block of codes |
| ``weight.quant_map`` | float32 | [16]: the code table (bitsandbytes decodes with its built-in table, not this copy) |
| ``weight.nested_absmax`` | float32 | [ceil(absmax/nested_blocksize)] (double quantization only) |
| ``weight.nested_quant_map`` | float32 | [256]: the absmax codes' table (double quantization only) |
| ``weight.quant_state.bitsandbytes__<type>`` | uint8 | [bytes]: JSON (``quant_state``) |
| ``bias`` | float | [N] (optional) |

Any other tensor under the module, a missing one, or a dtype or shape that disagrees with the
state or the config is a CheckpointError naming the tensor and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qscheme.errors import CheckpointError
from qscheme.producers.bitsandbytes.config import BitsAndBytesConfig
from qscheme.producers.bitsandbytes.quant_state import STATE_NAMES, QuantState
from qscheme.storage import TensorInfo

WEIGHT = "weight"
ABSMAX = "weight.absmax"
QUANT_MAP = "weight.quant_map"
NESTED_ABSMAX = "weight.nested_absmax"
NESTED_QUANT_MAP = "weight.nested_quant_map"
BIAS = "bias"
NESTED_NAMES: tuple[str, ...] = (NESTED_ABSMAX, NESTED_QUANT_MAP)


@dataclass(frozen=True)
class Expected:
    """What one stored tensor must be."""

    dtype: str
    shape: tuple[int, ...]
    why: str


def state_name(members: Mapping[str, TensorInfo], module: str) -> str:
    """The short name of the module's one quant state entry (CheckpointError when none or several)."""
    found = [name for name in STATE_NAMES if name in members]
    if len(found) == 1:
        return found[0]
    file = next(iter(members.values())).file if members else "?"
    if not found:
        raise CheckpointError(
            f"{file}: module {module!r} stores bitsandbytes 4-bit tensors ({', '.join(sorted(members))}) but no "
            f"quant state entry ({' or '.join(STATE_NAMES)}): without it the layer's shape and block size are "
            "unknown; re-export the checkpoint with transformers' save_pretrained"
        )
    raise CheckpointError(
        f"{file}: module {module!r} stores two quant state entries ({', '.join(found)}); a layer has one quant type"
    )


def expected_tensors(state: QuantState) -> dict[str, Expected]:
    """Every tensor a layer with ``state`` stores (the bias aside)."""
    n, k = state.shape
    elements = n * k
    blocks = -(-elements // state.blocksize)
    out = {
        WEIGHT: Expected("uint8", (-(-elements // 2), 1), f"{elements} codes of [{n}, {k}], two per byte"),
        ABSMAX: Expected(
            "uint8" if state.nested else "float32",
            (blocks,),
            f"one per block of {state.blocksize} codes"
            + (" (double quantization: uint8 codes)" if state.nested else " (float32: no double quantization)"),
        ),
        QUANT_MAP: Expected("float32", (16,), "the 16 values of the 4-bit codes"),
    }
    if state.nested:
        assert state.nested_blocksize is not None
        out[NESTED_ABSMAX] = Expected(
            "float32", (-(-blocks // state.nested_blocksize),), f"one per {state.nested_blocksize} absmax"
        )
        out[NESTED_QUANT_MAP] = Expected("float32", (256,), "the 256 values of the absmax codes")
    return out


def check_layer(config: BitsAndBytesConfig, module: str, members: Mapping[str, TensorInfo], state: QuantState) -> None:
    """CheckpointError for the first tensor of ``module`` that its state and the config do not declare
    (see the module docstring): names, dtypes, shapes, the quant type and double quantization."""
    file = next(iter(members.values())).file
    if state.quant_type != config.quant_type:
        raise CheckpointError(
            f"{file}: tensor {state.tensor!r} holds quant_type {state.quant_type!r} "
            f"but {config.file} says bnb_4bit_quant_type {config.quant_type!r}: the config does not describe these "
            "weights; re-export the checkpoint"
        )
    if state.nested != config.double_quant:
        found = "double-quantized absmax (nested_* keys)" if state.nested else "plain float32 absmax"
        raise CheckpointError(
            f"{file}: tensor {state.tensor!r} describes {found} but {config.file} says bnb_4bit_use_double_quant "
            f"{str(config.double_quant).lower()}: the config does not describe these weights; re-export the checkpoint"
        )
    n, k = state.shape
    if k % state.blocksize:
        raise CheckpointError(
            f"{file}: tensor {state.tensor!r}: shape [{n}, {k}] with blocksize {state.blocksize}: K is not a multiple "
            "of the block size, so blocks of the flattened weight straddle rows; qscheme's kernels scale groups "
            "within a row (and bitsandbytes' own CPU dequantization of such layers disagrees with its quantizer), "
            "so this layer is refused; re-quantize it with a block size dividing K, or leave it unquantized"
        )
    expected = expected_tensors(state)
    for name, rule in expected.items():
        info = members.get(name)
        if info is None:
            raise CheckpointError(
                f"{file}: tensor {module}.{name} is missing: a bitsandbytes {state.quant_type} layer "
                f"{'with' if state.nested else 'without'} double quantization stores it as {rule.dtype} "
                f"{list(rule.shape)} ({rule.why}); found only {', '.join(sorted(members))}"
            )
        if info.dtype != rule.dtype:
            raise CheckpointError(
                f"{info.file}: tensor {info.name} is {info.dtype}, expected {rule.dtype} ({rule.why}, as "
                f"{state.tensor.rpartition('.')[2]} and {config.file} say)"
            )
        if tuple(info.shape) != rule.shape:
            raise CheckpointError(
                f"{info.file}: tensor {info.name} has shape {list(info.shape)}, expected {list(rule.shape)} ({rule.why}"
                f"; shape [{n}, {k}] from {state.tensor.rpartition('.')[2]}): the state and the tensor disagree"
            )
    for name, info in sorted(members.items()):
        if name in expected or name == state.tensor.removeprefix(module + ".") or name in STATE_NAMES:
            continue
        if name == BIAS and len(info.shape) == 1 and info.shape[0] == n:
            continue
        why = (
            "double quantization's tensor, but the layer's state has no nested keys (an orphan)"
            if name in NESTED_NAMES
            else "not a tensor of a bitsandbytes 4-bit layer (unconsumed)"
        )
        raise CheckpointError(
            f"{info.file}: tensor {info.name} ({info.dtype} {list(info.shape)}) is {why}; remove it, or re-export "
            "the checkpoint"
        )
