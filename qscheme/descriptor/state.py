"""A layer's JSON state tensor (``weight.state``: bitsandbytes' ``quant_state``) read and checked
against its ``StateSpec``, torch-free: bytes in, the checked values or the problem out.

The tensor holds one UTF-8 JSON object. Every key the spec names is required (the shape key, the
keys of ``values`` and ``numbers``), no other key is allowed, the shape key holds two
positive integers [N, K], each key of ``values`` one of its listed values, and each of ``numbers``
a finite number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor.model import StateSpec

MAX_STATE_BYTES = 4096
"""A state is a short JSON object (bitsandbytes': ~170 bytes); a larger tensor is not read as one."""


@dataclass(frozen=True)
class StateValues:
    """A checked state: the layer's [N, K] and its numbers by key."""

    shape: tuple[int, int]
    numbers: dict[str, float]


def read_state(spec: StateSpec, data: bytes) -> StateValues | str:
    """The checked values of a state tensor holding ``data``, or the problem (a sentence naming the
    key, the value found and what is allowed)."""
    if len(data) > MAX_STATE_BYTES:
        return f"holds {len(data):,} bytes; a state is a JSON object of at most {MAX_STATE_BYTES:,} bytes"
    try:
        items = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"its bytes are not UTF-8 JSON ({error}); the file is corrupt: re-export it"
    if not isinstance(items, dict):
        return f"holds JSON {type(items).__name__}, expected an object"
    allowed = spec.keys
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        return f"key {unknown[0]!r} is not one this scheme reads (allowed: {', '.join(allowed)})"
    missing = [key for key in allowed if key not in items]
    if missing:
        return f"key {missing[0]!r} is missing (the scheme reads {', '.join(allowed)})"
    for key, choices in spec.values.items():
        if items[key] not in choices or isinstance(items[key], bool):
            return f"key {key!r} is {_shown(items[key])}; this scheme reads {' or '.join(map(_shown, choices))}"
    shape = items[spec.shape]
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in shape)
    ):
        return f"key {spec.shape!r} is {_shown(shape)}; expected the layer's [N, K]: two positive integers"
    numbers: dict[str, float] = {}
    for key in spec.numbers:
        value = items[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"key {key!r} is {_shown(value)}; expected a finite number"
        numbers[key] = float(value)
    return StateValues((int(shape[0]), int(shape[1])), numbers)


def _shown(value: Any) -> str:
    return json.dumps(value)[:80]
