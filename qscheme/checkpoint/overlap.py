"""Detect rules that claim the same producer config: loading such a config would be ambiguous.

Detection has no precedence between schemes: a compressed-tensors config group or a ModelOpt
quant_algo that two schemes' rules match is refused at load ("matches several schemes"). This
module finds such pairs ahead of time, for ``qscheme validate``, by building a witness: the
config the two rules would both match, run through the loader's own matchers, so the answer is
the loader's. Each producer finds its witnesses (``producers/<producer>/overlap.py``, its
``Producer.overlap``); this module asks every producer in turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qscheme.descriptor import Scheme
from qscheme.producers import PRODUCERS


@dataclass(frozen=True)
class Overlap:
    """Two schemes whose rules for one producer both match ``witness``."""

    producer: str  # the ``detect`` key: "compressed-tensors" or "modelopt"
    first: str
    second: str
    witness: str  # the config both match, as a producer writes it
    group: Any = None  # that config group, for a compressed-tensors overlap (a ConfigGroup)
    fix: str = ""  # how to tell the rules apart (the producer's advice)


def overlaps(scheme: Scheme, others: Iterable[Scheme]) -> list[Overlap]:
    """Every rule of ``scheme`` that also matches what a rule of one of ``others`` matches
    (schemes named like ``scheme`` are skipped: the name check reports those)."""
    found: list[Overlap] = []
    for other in others:
        if other.name == scheme.name:
            continue
        for producer in PRODUCERS:
            if producer.overlap is None:
                continue
            witness = producer.overlap(scheme, other)
            if witness is not None:
                text, group = witness
                found.append(Overlap(producer.name, scheme.name, other.name, text, group, producer.overlap_fix))
    return found
