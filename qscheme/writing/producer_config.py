"""The quantization config a written checkpoint carries, as its producer writes it.

The producers (``qscheme.producers.PRODUCERS``) are asked in turn which writes the scheme (from
its descriptor's ``detect`` block): compressed-tensors for a scheme with a
``detect.compressed-tensors`` rule, ModelOpt for one with a ``detect.modelopt`` rule, else
qscheme's self-describing config (the descriptor embedded). Each producer's folder writes its
config (``write_config``) from the descriptor, the ignore list and the modules left unquantized;
there is no per-scheme code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers import PRODUCERS, Producer
from qscheme.producers.base import CONFIG_FILE, WriteRequest

__all__ = ["config_files", "producer_of"]


def _writer(scheme: Scheme) -> Producer:
    return next(producer for producer in PRODUCERS if producer.writes(scheme))


def producer_of(scheme: Scheme) -> str:
    """``compressed-tensors``, ``modelopt`` (the producer whose config recognises the scheme) or ``qscheme``."""
    return _writer(scheme).name


def config_files(
    scheme: Scheme,
    source_config: Mapping[str, Any],
    *,
    ignore: Sequence[str],
    unquantized_modules: Sequence[str],
    descriptor_text: str | None = None,
    note: str | None = None,
) -> dict[str, dict[str, Any]]:
    """{file name: JSON object} for the quantization configs of a checkpoint in ``scheme``.

    ``source_config`` is the source's config.json (copied with its ``quantization_config``
    replaced); ``ignore`` the user's ignore entries (written as given for compressed-tensors and
    qscheme configs); ``unquantized_modules`` the 2-D weights' modules left in 16 bits (ModelOpt's
    ``exclude_modules`` lists them by name). ``descriptor_text`` is required for a scheme no
    producer recognises.
    """
    request = WriteRequest(scheme, ignore, unquantized_modules, descriptor_text, note)
    section, files = _writer(scheme).write_config(request)
    config = {key: value for key, value in source_config.items() if key != "quantization_config"}
    config["quantization_config"] = section
    files = {**files, CONFIG_FILE: config}
    return dict(sorted(files.items()))
