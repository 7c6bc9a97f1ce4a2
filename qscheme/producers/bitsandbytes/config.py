"""The ``bitsandbytes`` producer's config, typed: config.json ``quantization_config`` with
``quant_method: bitsandbytes``, as transformers' ``BitsAndBytesConfig.to_dict()`` writes it when
a model loaded with ``load_in_4bit=True`` is saved (``save_pretrained``).

What qscheme reads, and what it refuses (each a CheckpointError naming the key and the value):

- ``load_in_4bit`` (or transformers' private copy ``_load_in_4bit``) true: 4-bit NF4/FP4 weights;
  ``load_in_8bit`` (LLM.int8: an int8 ``weight`` with its ``SCB`` row scales) is refused, as is a
  config that sets neither or both;
- ``bnb_4bit_quant_type``: ``nf4`` or ``fp4`` (transformers' default is ``fp4``);
- ``bnb_4bit_use_double_quant``: whether the block scales (``weight.absmax``) are themselves
  quantized to uint8 (``weight.nested_absmax``, ``weight.nested_quant_map`` and the state's
  ``nested_offset``); a boolean, default false;
- ``bnb_4bit_quant_storage``: ``uint8`` only (the packed codes' dtype; another dtype stores the same
  bytes under another element size, which no bitsandbytes scheme declares);
- ``bnb_4bit_compute_dtype``: the dtype bitsandbytes computes in; read, and kept for ``inspect``;
- ``llm_int8_skip_modules``: modules left unquantized (a name matches a module or a module above
  it, as transformers matches them); null or a list of strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields

QUANT_METHOD = "bitsandbytes"
QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BitsAndBytesConfig:
    """config.json's ``quantization_config`` with ``quant_method: bitsandbytes`` (4-bit)."""

    file: str
    quant_type: str
    double_quant: bool
    compute_dtype: str | None
    skip_modules: tuple[str, ...]
    producer: str = "bitsandbytes"
    producer_version: str | None = None
    producer_note: str | None = None
    has_kv_cache: bool = False


def _fail(fields: ConfigFields, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{fields.file}: quantization_config.{key} is {json.dumps(value)[:80]}; {why}")


def _flag(fields: ConfigFields, *keys: str) -> bool:
    """The first of ``keys`` present, as a boolean (absent: false)."""
    for key in keys:
        if key in fields.items and fields.items[key] is not None:
            value = fields.items[key]
            if not isinstance(value, bool):
                raise _fail(fields, key, value, "expected true or false")
            return value
    return False


def _compute_dtype(fields: ConfigFields) -> str | None:
    value = fields.items.get("bnb_4bit_compute_dtype")
    if value is None:
        return None
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    if name not in COMPUTE_DTYPES:
        raise _fail(fields, "bnb_4bit_compute_dtype", value, f"expected one of {', '.join(COMPUTE_DTYPES)}")
    return name


def read_section(fields: ConfigFields) -> BitsAndBytesConfig:
    """config.json's ``quantization_config`` (``quant_method: bitsandbytes``); see the module docstring."""
    four_bit = _flag(fields, "load_in_4bit", "_load_in_4bit")
    eight_bit = _flag(fields, "load_in_8bit", "_load_in_8bit")
    if eight_bit:
        raise _fail(
            fields,
            "load_in_8bit",
            True,
            "LLM.int8 checkpoints (an int8 weight with its SCB row scales) are not read by qscheme; it reads "
            "bitsandbytes' 4-bit NF4/FP4 checkpoints (load_in_4bit)",
        )
    if not four_bit:
        raise _fail(
            fields,
            "load_in_4bit",
            fields.items.get("load_in_4bit"),
            "a bitsandbytes config that quantizes nothing in 4 bits; qscheme reads load_in_4bit checkpoints",
        )
    quant_type = fields.string("bnb_4bit_quant_type") or "fp4"
    if quant_type not in QUANT_TYPES:
        raise _fail(fields, "bnb_4bit_quant_type", quant_type, "expected 'nf4' or 'fp4'")
    storage = fields.items.get("bnb_4bit_quant_storage", "uint8")
    if storage not in ("uint8", "torch.uint8", None):
        raise _fail(
            fields,
            "bnb_4bit_quant_storage",
            storage,
            "qscheme reads the packed codes stored as uint8 (the default); re-export with bnb_4bit_quant_storage uint8",
        )
    return BitsAndBytesConfig(
        file=fields.file,
        quant_type=quant_type,
        double_quant=_flag(fields, "bnb_4bit_use_double_quant"),
        compute_dtype=_compute_dtype(fields),
        skip_modules=fields.strings("llm_int8_skip_modules"),
    )
