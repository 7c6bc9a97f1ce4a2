"""Which scheme reads each quantized GGUF tensor: its ggml type against the descriptors' rules.

A GGUF names no scheme: every tensor carries its ggml type (``Q4_K``, ``Q8_0``, ...), and the
scheme of the catalog whose ``detect.gguf`` rule names that type reads it (``schemes/gguf/``).
Float and integer types (``F32``, ``F16``, ``BF16``, ``I8`` ...) hold values as they are: those
tensors load as plain tensors (norms, biases, and any weight llama.cpp left unquantized).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.gguf.rule import rule_of
from qscheme.text import listing, shown

# ggml types whose bytes are the values themselves -> the torch dtype that holds them.
PLAIN_TYPES: Mapping[str, str] = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantized layer of the file: its ggml type and the GGUF tensor (and expert) it reads."""

    module: str
    ggml_type: str
    tensor: str
    expert: int | None = None

    @property
    def origin(self) -> str:
        expert = f", expert {self.expert}" if self.expert is not None else ""
        return f"GGUF {self.ggml_type} tensor {self.tensor}{expert}"


def is_plain_type(ggml_type: str) -> bool:
    return ggml_type in PLAIN_TYPES


def schemes_by_type(schemes: Iterable[Scheme]) -> dict[str, list[Scheme]]:
    """ggml type name -> the schemes whose ``detect.gguf`` rule names it."""
    found: dict[str, list[Scheme]] = {}
    for scheme in schemes:
        rule = rule_of(scheme)
        if rule is not None:
            for ggml_type in rule.types:
                found.setdefault(ggml_type, []).append(scheme)
    return found


def assign_schemes(
    file: str, layers: Iterable[QuantizedTensor], schemes: Iterable[Scheme]
) -> dict[str, tuple[Scheme, str]]:
    """module -> (scheme, origin) for every quantized layer; CheckpointError naming every tensor
    whose type no scheme reads (with the types that are read), or that two schemes claim."""
    by_type = schemes_by_type(schemes)
    assigned: dict[str, tuple[Scheme, str]] = {}
    unread: dict[str, list[str]] = {}
    for layer in layers:
        candidates = by_type.get(layer.ggml_type.upper(), [])
        if len(candidates) > 1:
            names = ", ".join(scheme.name for scheme in candidates)
            raise CheckpointError(
                f"{file}: tensor {shown(layer.tensor)!r} is ggml type {layer.ggml_type}, which several schemes read "
                f"({names}); keep one scheme per GGUF type (check QSCHEME_SCHEME_PATH and the schemes= argument)"
            )
        if not candidates:
            unread.setdefault(layer.ggml_type, []).append(layer.tensor)
            continue
        assigned[layer.module] = (candidates[0], layer.origin)
    if unread:
        kinds = "; ".join(
            f"{ggml_type}: {listing(sorted(set(tensors)), 3, sentence=True)}" for ggml_type, tensors in unread.items()
        )
        readable = ", ".join(sorted(by_type)) or "none (no scheme with a detect.gguf rule is in the catalog)"
        raise CheckpointError(
            f"{file}: tensors of ggml types no scheme reads ({kinds}); qscheme reads GGUF types {readable}. "
            "Requantize the model to one of them with llama.cpp's llama-quantize (e.g. Q4_K_M), or add a scheme "
            "whose detect: gguf: type: names the type"
        )
    return assigned
