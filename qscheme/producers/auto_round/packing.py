"""Which layout an AutoRound ``packing_format`` names, as the producer's own exporter writes it.

AutoRound packs integer weights with one of three layouts, each an existing producer's:

- ``auto_round:auto_gptq`` (what AutoRound writes for symmetric weights, and the default): GPTQ's
  v1 layout, zero points stored minus one (``checkpoint_format: gptq``);
- ``auto_round`` (asymmetric weights) and ``auto_round:gptqmodel``: GPTQ's layout with the zero
  points themselves (``checkpoint_format: gptq_v2``);
- ``auto_round:auto_awq``: AutoAWQ's GEMM layout (``version: gemm``).

AutoRound's own loader reads ``auto``, ``auto_round:gptq`` and ``auto_round:awq`` as two of these,
and so does this module. Every other format (``auto_round:fp8_static``, ``auto_round:llm_compressor``,
the NVFP4/MXFP4 ones, ``mlx``, ``auto_round:fake``) stores other tensors and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIASES: dict[str, str] = {
    "auto": "auto_round:auto_gptq",
    "auto_round:gptq": "auto_round:auto_gptq",
    "auto_round:awq": "auto_round:auto_awq",
}


@dataclass(frozen=True)
class Layout:
    """The producer rule whose schemes hold this packing (``gptq`` or ``awq``) and the storage
    format that rule names (GPTQ's ``checkpoint_format``, AWQ's ``version``)."""

    rule: str
    storage_format: str


LAYOUTS: dict[str, Layout] = {
    "auto_round:auto_gptq": Layout("gptq", "gptq"),
    "auto_round": Layout("gptq", "gptq_v2"),
    "auto_round:gptqmodel": Layout("gptq", "gptq_v2"),
    "auto_round:auto_awq": Layout("awq", "gemm"),
}


def layout_of(packing_format: str) -> Layout | None:
    """The layout of a ``packing_format`` (aliases accepted), or None where qscheme reads none."""
    return LAYOUTS.get(ALIASES.get(packing_format, packing_format))


def known() -> str:
    """The accepted formats, for messages."""
    return ", ".join(sorted({*LAYOUTS, *ALIASES}))
