"""What of a scheme kernels declare support for, and whether an activation declaration takes it.

``SchemeFeatures.of(scheme)`` reduces a scheme to the facts kernel declarations speak of (weight
family and format, scale granularity and format, zero points, activation format and timing).
The resolver judges declarations against them and the renderer describes what kernels accept in
the same terms, so both import them from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qscheme.descriptor import Scheme
from qscheme.kernels.declaration import ActivationSupport, Supports


@dataclass(frozen=True)
class SchemeFeatures:
    """The features of a scheme that kernels declare support for."""

    weight_family: str
    activation: ActivationSupport
    weight_format: str
    granularity: str
    group_size: int | None
    block: tuple[int, int] | None
    scale_format: str
    zero_point: bool
    input_pre_scale_required: bool
    block_code: str | None = None

    @classmethod
    def of(cls, scheme: Scheme) -> SchemeFeatures:
        act = scheme.activation
        activation = (
            ActivationSupport("none")
            if act is None
            else ActivationSupport(
                scheme.activation_family,
                act.granularity,
                act.group_size if act.granularity == "group" else None,
                act.dynamic,
                formats=(act.format,),
                scale_formats=_activation_scale_formats(act.scale_format, act.scale.format if act.scale else None),
            )
        )
        scale = scheme.weight.scale
        return cls(
            weight_family=scheme.weight_family,
            activation=activation,
            weight_format=scheme.weight.format,
            granularity=scale.granularity,
            group_size=scale.group_size,
            block=scale.block,
            scale_format=scale.format,
            zero_point=scheme.weight.zero_point is not None,
            input_pre_scale_required=scheme.input_pre_scale is not None and not scheme.input_pre_scale.optional,
            block_code=None if scheme.weight.blocks is None else scheme.weight.blocks.code_kind,
        )


def _activation_scale_formats(scale_format: str, static_format: str | None) -> tuple[str, ...]:
    """The scale formats an activation declares: its ``scale_format``, and a static scale's
    ``scale.format`` first (the Triton pre-pass reads that one, the emulation ``scale_format``)."""
    if static_format is None or static_format == scale_format:
        return (scale_format,)
    return (static_format, scale_format)


def activation_matches(support: ActivationSupport, wanted: ActivationSupport, formats: bool = True) -> bool:
    """Whether a declared activation format covers the scheme's (None fields and empty format
    tuples match anything; every element and scale format of ``wanted`` must be taken).
    ``formats=False`` compares family, granularity, group size and timing only."""
    return (
        support.family == wanted.family
        and (support.granularity is None or support.granularity == wanted.granularity)
        and (support.group_size is None or support.group_size == wanted.group_size)
        and (support.dynamic is None or support.dynamic == wanted.dynamic)
        and (not formats or _formats_match(support, wanted))
    )


def _formats_match(support: ActivationSupport, wanted: ActivationSupport) -> bool:
    return (not support.formats or all(f in support.formats for f in wanted.formats)) and (
        not support.scale_formats or all(f in support.scale_formats for f in wanted.scale_formats)
    )


def formats_differ(weight_family: str, wanted: ActivationSupport, supports: Iterable[Supports]) -> bool:
    """Whether some entry for the weight family takes the scheme's activation but for its element
    or scale formats: rejections then name the formats, which otherwise go unsaid."""
    return any(
        weight_family in s.weights and activation_matches(a, wanted, formats=False) and not _formats_match(a, wanted)
        for s in supports
        for a in s.activations
    )
