"""One actionable hint for a failed resolution: another kernel, device or scheme that would work.

Pure: the caller passes the alternatives to try (devices to simulate, schemes from the
catalog); each is judged with the same resolver.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from qscheme.kernels.declaration import KernelDeclaration, format_capability
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.features import SchemeFeatures, formats_differ
from qscheme.kernels.resolver import Resolution, resolve

if TYPE_CHECKING:
    from qscheme.descriptor import Scheme


def suggest(
    resolution: Resolution,
    declarations: Sequence[KernelDeclaration],
    devices: Iterable[DeviceFacts] = (),
    schemes: Iterable[Scheme] = (),
    unavailable: Mapping[str, str] | None = None,
) -> str:
    """The first of: store the layer in the scheme's layout; drop the forced kernel; re-enable a
    disabled one; another device; fix the layer; another scheme with the same weights; write a
    plugin."""
    scheme, problem, device = resolution.scheme, resolution.problem, resolution.device
    if resolution.kernel is not None:
        return ""
    if resolution.layout is not None:
        return resolution.layout.hint
    if resolution.forced:
        # the kernel the layer would get unforced (the plan's for M = 1), not merely the
        # highest-priority accepted one, which may be meant for large batches only
        unforced = resolve(scheme, problem, device, declarations, None, resolution.disabled, unavailable)
        if unforced.kernel is not None:
            return (
                f"kernel {unforced.kernel.name} can run this layer here: stop forcing {resolution.forced!r} "
                "(--kernel / QSCHEME_KERNEL)"
            )
    if resolution.disabled:
        enabled = resolve(scheme, problem, device, declarations, resolution.forced, (), unavailable)
        if enabled.kernel is not None:
            return f"kernel {enabled.kernel.name} is disabled: remove it from QSCHEME_DISABLED_KERNELS"
    for other in devices:
        if other.label == device.label:
            continue
        elsewhere = resolve(scheme, problem, other, declarations, resolution.forced, resolution.disabled, unavailable)
        if elsewhere.kernel is not None:
            where = (
                other.type if other.capability is None else f"compute capability {format_capability(other.capability)}"
            )
            option = other.type if other.capability is None else f"sm{other.capability[0]}{other.capability[1]}"
            return (
                f"kernel {elsewhere.kernel.name} would run it on {where} "
                f"(`qscheme resolve {scheme.name} --device {option}` shows the trace there)"
            )
    for candidate in resolution.trace:
        # Only a kernel that fails nothing but the layer's own facts is worth reshaping it for.
        if candidate.failures and all(f.stage == "problem" for f in candidate.failures) and candidate.hint:
            return f"{candidate.hint} for kernel {candidate.kernel}"
    features = SchemeFeatures.of(scheme)
    same_weights = [
        s for s in schemes if s.name != scheme.name and SchemeFeatures.of(s).weight_family == features.weight_family
    ]
    same_weights.sort(key=lambda s: (s.producer != scheme.producer, s.name))
    for other_scheme in same_weights:
        alternative = resolve(other_scheme, problem, device, declarations, None, resolution.disabled, unavailable)
        if alternative.kernel is not None:
            activation = SchemeFeatures.of(other_scheme).activation.describe()
            return (
                f"scheme {other_scheme.name} ({features.weight_family} weights with {activation} activations) "
                f"resolves to {alternative.kernel.name} here"
            )
    supports = [support for declaration in declarations for support in declaration.supports]
    named = formats_differ(features.weight_family, features.activation, supports)
    return (
        f"install or write a plugin that declares a kernel for {features.weight_family} weights with "
        f"{features.activation.describe(named)} activations (docs/plugins.md)"
    )
