"""bitsandbytes' serialized quant state: the ``<module>.weight.quant_state.bitsandbytes__<type>``
entry, a uint8 tensor holding UTF-8 JSON, read strictly.

bitsandbytes (``QuantState.as_dict(packed=True)``, 0.50) packs the state's non-tensor items into
that one tensor with ``json.dumps``: ``quant_type`` (``nf4`` / ``fp4``, also the key's suffix),
``blocksize`` (weights per absmax, 64 from transformers), ``dtype`` (the weight's dtype before
quantization, the dtype bitsandbytes dequantizes to), ``shape`` (the weight's [N, K]) and, with
double quantization, ``nested_blocksize`` (absmax values per nested absmax, 256),
``nested_dtype`` (``float32``) and ``nested_offset`` (the mean subtracted from the absmax before
they were quantized, added back after; a float32 value written as a JSON number). Its reader
(``QuantState.from_dict``) accepts no other key.

Every problem is a CheckpointError naming the tensor, the key, the value found and what is allowed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers.bitsandbytes.config import QUANT_TYPES

STATE_PREFIX = "weight.quant_state.bitsandbytes__"
STATE_NAMES: tuple[str, ...] = tuple(STATE_PREFIX + quant_type for quant_type in QUANT_TYPES)
"""The quant state entries' names after the module name."""
STATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
MAX_STATE_BYTES = 4096
"""A state is ~170 bytes; anything much larger is not one (and is not read)."""

_PLAIN_KEYS: tuple[str, ...] = ("quant_type", "blocksize", "dtype", "shape")
_NESTED_KEYS: tuple[str, ...] = ("nested_blocksize", "nested_dtype", "nested_offset")


@dataclass(frozen=True)
class QuantState:
    """One layer's bitsandbytes quant state (its JSON entry, checked)."""

    tensor: str
    quant_type: str
    blocksize: int
    dtype: str
    shape: tuple[int, int]
    nested_blocksize: int | None = None
    nested_dtype: str | None = None
    nested_offset: float | None = None

    @property
    def nested(self) -> bool:
        """Whether the absmax are double-quantized."""
        return self.nested_blocksize is not None


def _fail(tensor: str, key: str | None, value: Any, why: str) -> CheckpointError:
    where = f"key {key!r} is {json.dumps(value)[:80]}" if key is not None else why
    rest = f"; {why}" if key is not None else ""
    return CheckpointError(f"tensor {tensor!r}: bitsandbytes quant state: {where}{rest}")


def _integer(tensor: str, items: Mapping[str, Any], key: str, allowed: tuple[int, ...]) -> int:
    value = items[key]
    if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
        raise _fail(tensor, key, value, f"expected one of {', '.join(map(str, allowed))}")
    return value


def _choice(tensor: str, items: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = items[key]
    if value not in allowed:
        raise _fail(tensor, key, value, f"expected one of {', '.join(map(repr, allowed))}")
    return str(value)


def _shape(tensor: str, items: Mapping[str, Any]) -> tuple[int, int]:
    value = items["shape"]
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in value)
    ):
        raise _fail(tensor, "shape", value, "expected a linear weight's [N, K]: two positive integers")
    return int(value[0]), int(value[1])


def _offset(tensor: str, items: Mapping[str, Any]) -> float:
    value = items["nested_offset"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(tensor, "nested_offset", value, "expected a finite number (the absmax mean, added back)")
    return float(value)


def decode_state_json(tensor: str, data: bytes) -> dict[str, Any]:
    """The JSON object a state tensor holds (CheckpointError when it is not one)."""
    if len(data) > MAX_STATE_BYTES:
        raise _fail(tensor, None, None, f"holds {len(data):,} bytes; a quant state is a short JSON object")
    try:
        items = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(
            tensor, None, None, f"its bytes are not UTF-8 JSON ({error}); the file is corrupt: re-export it"
        ) from None
    if not isinstance(items, dict):
        raise _fail(tensor, None, None, f"holds {type(items).__name__} JSON, expected an object")
    return items


def parse_state(tensor: str, data: bytes) -> QuantState:
    """The state entry ``tensor`` (its full name) holding ``data``, checked: the keys bitsandbytes
    writes, each of the type and in the range it writes, nested keys all or none, and the quant
    type the entry's name ends in."""
    items = decode_state_json(tensor, data)
    allowed = (*_PLAIN_KEYS, *_NESTED_KEYS)
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        raise _fail(
            tensor, unknown[0], items[unknown[0]], f"not a key bitsandbytes writes (allowed: {', '.join(allowed)})"
        )
    missing = [key for key in _PLAIN_KEYS if key not in items]
    nested = [key for key in _NESTED_KEYS if key in items]
    if nested and len(nested) != len(_NESTED_KEYS):
        missing += [key for key in _NESTED_KEYS if key not in items]
    if missing:
        raise _fail(
            tensor, None, None, f"key {missing[0]!r} is missing (a state holds {', '.join(_PLAIN_KEYS)}, and with "
            f"double quantization {', '.join(_NESTED_KEYS)})",
        )  # fmt: skip
    quant_type = _choice(tensor, items, "quant_type", QUANT_TYPES)
    if not tensor.endswith("bitsandbytes__" + quant_type):
        raise _fail(tensor, "quant_type", quant_type, "the entry's name names another quant type: re-export it")
    blocksize = _integer(tensor, items, "blocksize", (32, 64, 128, 256, 512, 1024, 2048, 4096))
    dtype = _choice(tensor, items, "dtype", STATE_DTYPES)
    shape = _shape(tensor, items)
    if not nested:
        return QuantState(tensor, quant_type, blocksize, dtype, shape)
    nested_blocksize = _integer(tensor, items, "nested_blocksize", (64, 128, 256, 512, 1024, 2048, 4096))
    nested_dtype = _choice(tensor, items, "nested_dtype", ("float32",))
    return QuantState(
        tensor, quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype, _offset(tensor, items)
    )
