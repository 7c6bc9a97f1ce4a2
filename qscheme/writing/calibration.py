"""The calibration file: per-module input amax values, for schemes with static activation scales.

Round-to-nearest needs only the weights, except where a scheme stores a scale for the layer's
*input* computed at export time (compressed-tensors FP8 ``input_scale``, NVFP4
``input_global_scale``, ModelOpt ``input_scale``). Those come from the largest absolute input
value each module saw on calibration data, given in a JSON file::

    {"format": "qscheme-calibration/1",
     "input_amax": {"model.layers.0.self_attn.q_proj": 3.25, ...}}

Keys are module names as stored in the checkpoint (no ``.weight``); values are numbers > 0 that
are normal float32 values (no NaN, infinity, string, list, boolean), and whose activation
scales are themselves finite normal float32 values (an amax of 1e-37 would give an infinite
``448 / amax``). Anything else is a CalibrationError naming the file and the key.

From an amax the stored scales follow the descriptor, computed as the producers compute
them (in float32): a static per-tensor scale is ``amax / element max`` as a multiplier
(``element max / amax`` as a divisor); an activation global scale (a two-level format such as
NVFP4) is ``amax / (element max * block scale max)`` as a multiplier, the inverse product as a
divisor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError, InputError, QuantizeError
from qscheme.formats import get_element_format
from qscheme.storage import read_json

CALIBRATION_FORMAT = "qscheme-calibration/1"
_EXAMPLE = '{"format": "qscheme-calibration/1", "input_amax": {"model.layers.0.self_attn.q_proj": 3.25}}'


class CalibrationError(QuantizeError, InputError):
    """The calibration file is missing, malformed, or lacks a module the scheme needs (exit code 2)."""


@dataclass(frozen=True)
class Calibration:
    """Input amax per module name, and the file it came from (checked when built)."""

    file: str
    input_amax: Mapping[str, float]

    def __post_init__(self) -> None:
        if not isinstance(self.input_amax, Mapping):
            raise CalibrationError(f"{self.file}: input_amax must be a mapping of module name -> amax; {_EXAMPLE}")
        for module, value in self.input_amax.items():
            _check_entry(self.file, module, value)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read and check a calibration file; CalibrationError naming the file and the entry."""
        path = Path(path)
        if not path.exists():
            raise CalibrationError(f"{path}: calibration file does not exist; write one like {_EXAMPLE}")
        try:
            data = read_json(path)
        except CheckpointError as exc:
            raise CalibrationError(str(exc)) from None
        return cls.from_mapping(data, str(path))

    @classmethod
    def from_mapping(cls, data: object, file: str = "<calibration>") -> Calibration:
        if not isinstance(data, Mapping) or data.get("format") != CALIBRATION_FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise CalibrationError(
                f'{file}: expected an object with "format": "{CALIBRATION_FORMAT}", found {json.dumps(found)}; '
                f"write it like {_EXAMPLE}"
            )
        unknown = sorted(set(data) - {"format", "input_amax"})
        if unknown:
            raise CalibrationError(
                f"{file}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: format, input_amax"
            )
        values = data.get("input_amax")
        if not isinstance(values, Mapping):
            raise CalibrationError(f"{file}: input_amax must be an object of module name -> amax; {_EXAMPLE}")
        checked: dict[str, float] = {}
        for module, value in values.items():
            _check_entry(file, module, value)
            checked[module] = float(value)
        return cls(file, checked)

    def check_scales(self, scheme: Scheme, modules: list[str]) -> None:
        """CalibrationError naming the file and key when an amax gives activation scales that are
        not finite normal float32 values for ``scheme``."""
        for module in modules:
            for name, value in activation_tensors(scheme, self.input_amax[module]).items():
                number = float(value.reshape(-1)[0])
                if not (math.isfinite(number) and number >= _FLOAT32_TINY):
                    raise CalibrationError(
                        f"{self.file}: input_amax[{module!r}] = {self.input_amax[module]!r} gives {name} = {number!r} "
                        f"for scheme {scheme.name}, which is not a finite normal float32 value; an amax must lie "
                        "within about 1e-30 .. 1e30 (the largest absolute input value the module saw)"
                    )

    def require(self, modules: list[str]) -> None:
        """Every module listed must have an entry; CalibrationError listing those that do not."""
        missing = [module for module in modules if module not in self.input_amax]
        if missing:
            shown = ", ".join(repr(module) for module in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise CalibrationError(
                f"{self.file}: no input_amax for {len(missing)} module(s) to quantize: {shown}; add an entry for each "
                "quantized module (or ignore those modules)"
            )


_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _check_entry(file: str, module: object, value: object) -> None:
    """CalibrationError naming the file and key for an entry that is not ``module name -> amax``."""
    if not isinstance(module, str) or not module:
        raise CalibrationError(
            f"{file}: input_amax key {module!r} is not a module name (a non-empty string such as "
            "'model.layers.0.self_attn.q_proj')"
        )
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or not _FLOAT32_TINY <= abs(number) <= _FLOAT32_MAX or number < 0:
        raise CalibrationError(
            f"{file}: input_amax[{module!r}] is {_shown(value)}; it must be a number > 0 that float32 holds as a "
            "normal value (the largest absolute input value the module saw, e.g. 3.25)"
        )
    if module.endswith(".weight"):
        raise CalibrationError(
            f"{file}: input_amax key {module!r} names a tensor; use the module name {module.removesuffix('.weight')!r}"
        )


def _shown(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def needs_calibration(scheme: Scheme) -> bool:
    """Whether the scheme stores activation scales computed at export (static, or a global scale)."""
    activation = scheme.activation
    return activation is not None and (activation.scale is not None or activation.global_scale is not None)


def activation_tensors(scheme: Scheme, amax: float) -> dict[str, Tensor]:
    """The activation scales to give ``quantize_weight`` for one module, by checkpoint name (float32)."""
    activation = scheme.activation
    if activation is None:
        return {}
    element_max = float(get_element_format(activation.format).max_value)
    value = torch.tensor([amax], dtype=torch.float32)
    out: dict[str, Tensor] = {}
    # Python-number bounds, as the producers write them: ``amax / 448`` divides, while
    # compressed-tensors' ``2688 / amax`` is torch's reversed division (reciprocal, then multiply).
    if activation.scale is not None:
        bound = element_max
        out[activation.scale.tensor.name] = value / bound if activation.scale.stored == "multiplier" else bound / value
    if activation.global_scale is not None:
        bound = element_max * float(get_element_format(activation.scale_format).max_value)
        stored = activation.global_scale.stored
        out[activation.global_scale.tensor.name] = value / bound if stored == "multiplier" else bound / value
    return out
