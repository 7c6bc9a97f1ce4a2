"""Quantize a weight into the tensors a checkpoint of a scheme holds, with a producer's arithmetic.

The rule set named by a scheme's ``rules`` (``compressed-tensors`` or ``modelopt``) decides the
arithmetic; the descriptor decides everything stored. Modules, by concern:

- ``rules``: what a producer's rule set decides, and their registry;
- ``qscheme.producers.<producer>.arithmetic``: each producer's scale and element arithmetic, in
  its folder (``compressed_tensors``, ``modelopt``), imported by ``weight``;
- ``observe``: where scales apply (tensor, channel, group, block) and each region's statistics;
- ``rounding``: exact table-driven rounding of scaled values to element codes;
- ``write``: packing, stored dtypes, shapes and conventions of the checkpoint tensors;
- ``given``: scales the caller gives, checked and put in the form the rules take;
- ``checks``: no scale that is zero, negative, NaN or infinite reaches the result;
- ``weight``: ``quantize_weight``, which ties them together.
"""

from __future__ import annotations

from qscheme.quantize.rules import QuantizationRules, get_rules, register_rules
from qscheme.quantize.weight import quantize_weight

__all__ = ["QuantizationRules", "get_rules", "quantize_weight", "register_rules"]
