"""What a kernel that misbehaves is told as: typed errors naming who failed where, and the route warning.

A kernel's code comes from a plugin and may raise anything or return anything. ``QuantLinear``
turns either into a KernelExecutionError that names the layer, the kernel, its plugin, the
scheme and the stage (prepare or apply), with the fix (disable the kernel, force another) and
whom to report it to. A kernel's own typed error (QuantizeError, ...) stays catchable as
itself: the error raised is of both classes.
"""

from __future__ import annotations

from typing import Any

from qscheme.errors import QSchemeError
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.interface import KernelExecutionError


class KernelRouteWarning(UserWarning):
    """An input dtype runs on another kernel than the one ``QuantLinear.kernel`` reports."""


def plugin_text(kernel: KernelDeclaration) -> str:
    """`` (plugin NAME)`` for a kernel a plugin declares, else nothing."""
    return f" (plugin {kernel.plugin})" if kernel.plugin else ""


def route_message(
    layer: str, activation_dtype: str, routed: KernelDeclaration, usual: KernelDeclaration, default_dtype: str, why: str
) -> str:
    """The KernelRouteWarning text: ``activation_dtype`` inputs of ``layer`` run on ``routed``, not ``usual``."""
    return (
        f"{layer}: {activation_dtype} inputs run on kernel {routed.name!r}{plugin_text(routed)}, not "
        f"{usual.name!r}, which the layer reports for its {default_dtype} inputs{why}. "
        f"layer.kernel_for({activation_dtype!r}) and layer.resolution_for({activation_dtype!r}) show the choice; "
        f"cast the input to {default_dtype}, or build the layer with activation_dtype={activation_dtype!r}"
    )


def kernel_error(
    kernel: KernelDeclaration, stage: str, error: BaseException, layer: str, scheme: str, where: str
) -> KernelExecutionError:
    """The typed error for a kernel whose ``stage`` (prepare or apply) raised ``error`` for
    ``layer`` of ``scheme``; ``where`` says for which inputs and device."""
    cls = KernelExecutionError
    if isinstance(error, QSchemeError) and not isinstance(error, KernelExecutionError):
        cls = _combined_error(type(error))  # ``except QuantizeError`` and its exit code still apply
    return cls(
        f"kernel {kernel.name!r}{plugin_text(kernel)} failed in {stage}() for layer {layer}: "
        f"{type(error).__name__}: {error} (scheme {scheme}, {where}). Disable the kernel "
        f"(QSCHEME_DISABLED_KERNELS={kernel.name}) or force another (kernel=...) to run the layer, and report "
        f"the failure to {kernel.provider}",
        **_failure_fields(kernel, stage, layer, scheme),
    )


def bad_output_error(
    kernel: KernelDeclaration, found: str, expected: str, layer: str, scheme: str
) -> KernelExecutionError:
    """The typed error for a kernel whose apply() returned ``found`` where ``expected`` was due."""
    return KernelExecutionError(
        f"kernel {kernel.name!r}{plugin_text(kernel)} returned {found} from apply() for layer {layer}; "
        f"expected {expected} ([..., N] in the input's dtype; scheme {scheme}). The "
        f"kernel's code is wrong: disable it (QSCHEME_DISABLED_KERNELS={kernel.name}) or force another "
        f"(kernel=...), and report it to {kernel.provider}",
        **_failure_fields(kernel, "apply", layer, scheme),
    )


def _failure_fields(kernel: KernelDeclaration, stage: str, layer: str, scheme: str) -> dict[str, Any]:
    """The attributes of a KernelExecutionError: who failed, where."""
    return {"layer": layer, "kernel": kernel.name, "plugin": kernel.plugin, "scheme": scheme, "stage": stage}


_COMBINED_ERRORS: dict[type, type[KernelExecutionError]] = {}


def _combined_error(original: type[QSchemeError]) -> type[KernelExecutionError]:
    """KernelExecutionError that is also the kernel's own typed error class (made once per class)."""
    found = _COMBINED_ERRORS.get(original)
    if found is None:
        found = type(f"KernelExecutionError[{original.__name__}]", (KernelExecutionError, original), {})
        _COMBINED_ERRORS[original] = found
    return found
