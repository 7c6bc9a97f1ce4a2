"""The self-describing config a scheme no producer writes gets: ``{"quant_method": "qscheme",
"scheme": NAME, "descriptor": <the YAML text>, "ignore": [...]}``. ``load_checkpoint`` and
``qscheme inspect`` parse the embedded descriptor, so the checkpoint loads where the YAML file is
unknown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers.base import WriteRequest
from qscheme.version import __version__

QSCHEME_METHOD = "qscheme"
QSCHEME_CONFIG_VERSION = 1


def writes(scheme: Scheme) -> bool:
    """Any scheme: this is the producer of last resort."""
    return True


def write_config(request: WriteRequest) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(config.json's ``quantization_config``, no other file); needs the descriptor text."""
    if request.descriptor_text is None:
        raise ValueError("a self-describing config needs the descriptor text")
    return self_describing_config(request.scheme, request.descriptor_text, request.ignore, request.note), {}


def self_describing_config(
    scheme: Scheme, descriptor_text: str, ignore: Sequence[str], note: str | None = None
) -> dict[str, Any]:
    """``quant_method: qscheme``: the scheme's name and its whole descriptor, embedded."""
    producer = {"name": "qscheme", "version": __version__}
    if note:
        producer["note"] = note
    return {
        "quant_method": QSCHEME_METHOD,
        "version": QSCHEME_CONFIG_VERSION,
        "scheme": scheme.name,
        "descriptor": descriptor_text,
        "ignore": list(ignore),
        "producer": producer,
    }
