"""qscheme's own self-describing checkpoints: config.json ``quant_method: qscheme``.

``qscheme quantize`` writes one for a scheme no producer writes, with the scheme's descriptor
embedded; it has no arithmetic of its own (a scheme's ``rules`` name another producer's).

- ``config``: the ``quantization_config`` read into ``QschemeConfig``;
- ``detect``: the embedded descriptor parsed, and every module storing its tensors assigned it;
- ``write_config``: the ``quantization_config`` with the descriptor embedded.
"""

from __future__ import annotations

from qscheme.producers.base import Producer
from qscheme.producers.self_described import config, detect, write_config
from qscheme.producers.self_described.config import QschemeConfig

PRODUCER = Producer(
    name="qscheme",
    quant_method="qscheme",
    config_type=QschemeConfig,
    read_section=config.read_section,
    detect=detect.detect,
    writes=write_config.writes,
    write_config=write_config.write_config,
    label="qscheme",
    listed_as="its own self-describing 'qscheme'",
)

__all__ = ["PRODUCER", "QschemeConfig"]
