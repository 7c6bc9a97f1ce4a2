"""Which scheme each module of a bitsandbytes 4-bit checkpoint uses: every module storing quantized
tensors takes the scheme whose ``detect.bitsandbytes`` rule matches the config's quant type and
double quantization; a module named by ``llm_int8_skip_modules`` must store none. Each layer's own
quant state (its quant type, block size, shape) is checked against the scheme on load (the
scheme's ``weight.state``)."""

from __future__ import annotations

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import Detected, Modules, looks_linear, looks_quantized
from qscheme.producers.bitsandbytes.config import BitsAndBytesConfig
from qscheme.producers.bitsandbytes.rule import NAME
from qscheme.producers.gptq.keyed import match_scheme


def skipped_by(module: str, skip: tuple[str, ...]) -> str | None:
    """transformers skips a module when a skip entry is one of its dotted name's components' runs."""
    return next((entry for entry in skip if entry == module or f".{entry}." in f".{module}."), None)


def detect(
    config: BitsAndBytesConfig, modules: Modules, schemes: list[Scheme], quantized_names: frozenset[str]
) -> Detected:
    assigned: dict[str, tuple[Scheme, str]] = {}
    ignored: dict[str, str] = {}
    scheme: Scheme | None = None
    origin = f"bitsandbytes {config.quant_type}" + (", double quantization" if config.double_quant else "")
    for module, members in sorted(modules.items()):
        if not module:
            continue
        quantized = looks_quantized(members, quantized_names)
        entry = skipped_by(module, config.skip_modules)
        if entry is not None:
            if quantized:
                raise CheckpointError(
                    f"{config.file}: module {module} is in llm_int8_skip_modules ({entry!r}) but stores quantized "
                    f"tensors ({', '.join(sorted(members))}); the config does not describe these weights"
                )
            if looks_linear(members, quantized_names):
                ignored[module] = f"llm_int8_skip_modules {entry!r}"
            continue
        if not quantized:
            continue
        if scheme is None:
            values = {"double_quant": config.double_quant}
            scheme = match_scheme(NAME, config.quant_type, values, schemes, config.file, "")
        assigned[module] = (scheme, origin)
    return Detected(assigned, ignored)
