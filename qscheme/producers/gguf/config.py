"""A GGUF file's "producer config": what its header says about the model, read into typed values.

A GGUF has no config.json: llama.cpp writes the architecture and its hyper-parameters as header
metadata (``general.architecture``, ``<arch>.block_count``, ...) and each tensor's ggml type in
the tensor's entry. ``read_gguf_config`` checks the architecture against the families qscheme
loads (``ARCHITECTURES``) and keeps what the report and the messages show. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qscheme.errors import CheckpointError
from qscheme.text import shown

ARCHITECTURE_KEY = "general.architecture"
GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"

# The GGUF architectures (llama.cpp's general.architecture) qscheme loads, each into the
# transformers family its GGUF loader builds. llama.cpp writes Mistral models as "llama" (and
# transformers tells them apart by general.name); every one of these is tested end to end.
ARCHITECTURES: Mapping[str, str] = {
    "llama": "llama (and mistral)",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}


def is_gguf_file(path: str | Path) -> bool:
    """Whether the loader reads ``path`` as one GGUF file: a path ending in ``.gguf`` (whether or
    not it exists: its reader then says what is wrong), or a regular file starting with the GGUF
    magic."""
    path = Path(path)
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    try:
        if not path.is_file():
            return False
        with path.open("rb") as handle:
            return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFConfig:
    """What qscheme reads from a GGUF header besides its tensors."""

    file: str | None
    architecture: str
    model_name: str | None = None
    version: int = 3
    producer: str = "gguf"
    has_kv_cache: bool = False

    @property
    def producer_version(self) -> str | None:
        return f"v{self.version}"

    @property
    def producer_note(self) -> str | None:
        named = f" {self.model_name!r}" if self.model_name else ""
        return f"a GGUF file (llama.cpp), architecture {self.architecture}{named}"


def read_gguf_config(file: str, metadata: Mapping[str, Any], version: int) -> GGUFConfig:
    """The header's architecture and name, checked; CheckpointError naming the file, the key and
    the value for a missing or unsupported architecture."""
    architecture = metadata.get(ARCHITECTURE_KEY)
    supported = ", ".join(f"{name} ({family})" for name, family in ARCHITECTURES.items())
    if not isinstance(architecture, str):
        found = "is missing" if architecture is None else f"is {type(architecture).__name__} {architecture!r}"
        raise CheckpointError(
            f"{file}: metadata key {ARCHITECTURE_KEY!r} {found}; a GGUF names its architecture there as a string "
            f"(qscheme loads {supported}): re-convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{file}: metadata key {ARCHITECTURE_KEY!r} is {shown(architecture)!r}, an architecture qscheme does not "
            f"load; it loads {supported}. Load other architectures with transformers' own GGUF loader "
            "(from_pretrained(..., gguf_file=...), which dequantizes them)"
        )
    name = metadata.get("general.name")
    return GGUFConfig(
        file=file,
        architecture=architecture,
        model_name=name if isinstance(name, str) else None,
        version=version,
    )
