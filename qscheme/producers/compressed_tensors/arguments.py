"""The values a ``detect.compressed-tensors`` argument may hold (as the library writes them).

A rule's arguments are compared with a checkpoint's ``config_groups`` after the same
normalization (see ``qscheme.producers.compressed_tensors.detect.normalize_arguments``), so a
value the library never writes would make the rule match nothing; it is refused here instead,
with what is allowed.
``null`` is allowed for every key (it means "not given").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from qscheme.descriptor.shapes import MAX_SIZE

STRATEGIES: tuple[str, ...] = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
TYPES: tuple[str, ...] = ("int", "float")
NUM_BITS: tuple[int, ...] = (4, 8)
ACTIVATION_ORDERINGS: tuple[str, ...] = ("group", "weight", "static", "dynamic")
_BLOCK_TEXT = re.compile(r"^([0-9]{1,7})x([0-9]{1,7})$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size(value: Any) -> bool:
    return _is_int(value) and 1 <= value <= MAX_SIZE


def _group_size(value: Any) -> bool:
    return (_is_int(value) and value == -1) or _size(value)


def _block(value: Any) -> bool:
    if isinstance(value, str):
        match = _BLOCK_TEXT.match(value)
        return match is not None and all(1 <= int(part) <= MAX_SIZE for part in match.groups())
    return isinstance(value, list) and len(value) == 2 and all(_size(part) for part in value)


def _lower_in(allowed: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value.lower() in allowed


def _quote(values: tuple[str, ...]) -> str:
    return ", ".join(repr(value) for value in values)


# key -> (accepts the value, what is allowed)
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_bits": (lambda v: _is_int(v) and v in NUM_BITS, "one of 4, 8"),
    "type": (_lower_in(TYPES), f"one of {_quote(TYPES)}"),
    "strategy": (_lower_in(STRATEGIES), f"one of {_quote(STRATEGIES)}"),
    "group_size": (_group_size, f"-1 (per channel) or an integer from 1 to {MAX_SIZE}"),
    "block_structure": (_block, "[rows, columns] of integers >= 1 (e.g. [128, 128]) or 'RxC' (e.g. '128x128')"),
    "symmetric": (lambda v: isinstance(v, bool), "one of true, false"),
    "dynamic": (lambda v: isinstance(v, bool) or v == "local", "one of true, false, 'local'"),
    "scale_dtype": (lambda v: isinstance(v, str) and bool(v.strip()), "a dtype name such as 'float32'"),
    "zp_dtype": (lambda v: isinstance(v, str) and bool(v.strip()), "a dtype name such as 'int8'"),
    "actorder": (
        lambda v: isinstance(v, bool) or _lower_in(ACTIVATION_ORDERINGS)(v),
        f"true, false or one of {_quote(ACTIVATION_ORDERINGS)}",
    ),
    "observer": (lambda v: isinstance(v, str) and bool(v.strip()), "an observer name such as 'minmax'"),
}


def argument_problem(key: str, value: Any) -> str | None:
    """What is wrong with one argument value, or None when it is allowed."""
    if value is None or key not in CHECKS:
        return None
    accepts, allowed = CHECKS[key]
    if accepts(value):
        return None
    return f"{value!r} is not {allowed}"
