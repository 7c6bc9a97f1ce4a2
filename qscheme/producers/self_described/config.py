"""qscheme's own self-describing config, typed: config.json ``quantization_config`` with
``quant_method: qscheme``, written by ``qscheme quantize`` for a scheme no producer writes, with
the scheme's whole descriptor (YAML text) embedded."""

from __future__ import annotations

from dataclasses import dataclass

from qscheme.errors import CheckpointError
from qscheme.producers.base import ConfigFields


@dataclass(frozen=True)
class QschemeConfig:
    """config.json ``quantization_config`` with ``quant_method: qscheme``: the scheme's name and its
    whole descriptor (YAML text), so that the checkpoint loads where the YAML file is unknown."""

    file: str
    scheme: str
    descriptor: str
    ignore: tuple[str, ...]
    producer: str = "qscheme"
    producer_version: str | None = None
    producer_note: str | None = None
    has_kv_cache: bool = False


def _check_embedded_size(file: str, descriptor: str) -> None:
    """An embedded descriptor is at most MAX_EMBEDDED_DESCRIPTOR_BYTES of UTF-8 (the built-in
    descriptors are 1-3 KB): a larger one is refused before it is parsed."""
    from qscheme.descriptor.files import MAX_EMBEDDED_DESCRIPTOR_BYTES

    size = len(descriptor.encode("utf-8", "surrogatepass"))
    if size > MAX_EMBEDDED_DESCRIPTOR_BYTES:
        raise CheckpointError(
            f"{file}: quantization_config.descriptor is {size:,} bytes; an embedded scheme descriptor is at most "
            f"{MAX_EMBEDDED_DESCRIPTOR_BYTES:,} bytes (256 KiB; real ones are a few KB): this is not a config "
            "qscheme quantize wrote; re-write the checkpoint with `qscheme quantize`, or re-download it"
        )


def read_section(fields: ConfigFields) -> QschemeConfig:
    """A self-describing config: ``scheme`` and ``descriptor`` (the YAML text) are required."""
    scheme = fields.string("scheme", required=True)
    descriptor = fields.string("descriptor", required=True)
    assert scheme is not None and descriptor is not None  # required=True raised otherwise
    _check_embedded_size(fields.file, descriptor)
    producer = fields.child("producer")
    return QschemeConfig(
        file=fields.file,
        scheme=scheme,
        descriptor=descriptor,
        ignore=fields.strings("ignore"),
        producer=(producer.string("name") if producer else None) or "qscheme",
        producer_version=producer.string("version") if producer else None,
        producer_note=producer.string("note") if producer else None,
    )
