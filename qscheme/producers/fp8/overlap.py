"""fp8 detect rules that claim the same config (for ``qscheme validate``): two schemes whose
rules share a ``scale_fmt`` and an ``activation_scheme`` and whose weight blocks are equal."""

from __future__ import annotations

from qscheme.descriptor import Scheme
from qscheme.producers.fp8.rule import rule_of

FIX = "give the rules different scale_fmt values, or the schemes different weight.scale.block sizes"


def witness(a: Scheme, b: Scheme) -> tuple[str, None] | None:
    """The config (scale_fmt, activation_scheme, weight_block_size) both rules match; None when none."""
    rule, other = rule_of(a), rule_of(b)
    if rule is None or other is None or a.weight.scale.block != b.weight.scale.block:
        return None
    for scale_fmt in rule.scale_fmts:
        for activation in rule.activation_schemes:
            if scale_fmt in other.scale_fmts and activation in other.activation_schemes:
                block = list(a.weight.scale.block) if a.weight.scale.block is not None else None
                return (
                    f"scale_fmt {scale_fmt!r}, activation_scheme {activation!r}, weight_block_size {block}",
                    None,
                )
    return None
