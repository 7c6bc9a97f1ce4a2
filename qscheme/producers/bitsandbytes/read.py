"""A bitsandbytes 4-bit checkpoint folder read strictly, layer by layer, and dequantized exactly.

``read_layers(folder)`` reads config.json's ``quantization_config`` (``config``), every safetensors
header, finds each quantized layer (a module storing ``weight.*`` tensors or a uint8 ``weight``),
parses its quant state (``quant_state``) and checks its tensors (``layout``) before any weight data
is read. ``BitsAndBytesLayer.dequantize()`` then reads its tensors and returns the float32 weight
bitsandbytes computes (``dequantize``). Everything else in the folder is a plain tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qscheme.errors import CheckpointError
from qscheme.producers.base import CONFIG_FILE, ConfigFields, natural_key
from qscheme.producers.bitsandbytes import dequantize as exact
from qscheme.producers.bitsandbytes.config import QUANT_METHOD, BitsAndBytesConfig, read_section
from qscheme.producers.bitsandbytes.detect import skipped_by
from qscheme.producers.bitsandbytes.layout import (
    ABSMAX,
    NESTED_ABSMAX,
    NESTED_QUANT_MAP,
    QUANT_MAP,
    WEIGHT,
    check_layer,
    state_name,
)
from qscheme.producers.bitsandbytes.quant_state import MAX_STATE_BYTES, QuantState, parse_state
from qscheme.storage import CheckpointFiles, TensorInfo
from qscheme.storage.json_files import read_json


@dataclass(frozen=True)
class BitsAndBytesLayer:
    """One quantized layer: its module name, its checked state and tensors, and the folder's files."""

    module: str
    state: QuantState
    tensors: dict[str, TensorInfo]
    files: CheckpointFiles

    def read(self, short: str) -> Tensor:
        return self.files.get(self.tensors[short].name)

    def absmax(self) -> Tensor:
        """The float32 absmax (restored from their codes when double-quantized)."""
        stored = self.read(ABSMAX)
        if not self.state.nested:
            return stored
        return exact.restore_absmax(self.state, stored, self.read(NESTED_QUANT_MAP), self.read(NESTED_ABSMAX))

    def dequantize(self) -> Tensor:
        """The float32 [N, K] weight, bit-identical to bitsandbytes' float32 dequantization."""
        exact.check_quant_map(self.tensors[QUANT_MAP].name, self.read(QUANT_MAP), self.state.quant_type)
        absmax = self.absmax()
        if not bool(torch.isfinite(absmax).all()):
            raise CheckpointError(
                f"{self.tensors[ABSMAX].file}: tensor {self.tensors[ABSMAX].name}: an absmax is not finite; the file "
                "is corrupt: re-download or re-export it"
            )
        return exact.dequantize(self.state, self.read(WEIGHT), absmax)


def read_config(folder: Path) -> BitsAndBytesConfig:
    path = folder / CONFIG_FILE
    document = read_json(path)
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    quant = ConfigFields(str(path), "", document).child("quantization_config")
    if quant is None or quant.string("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{path}: quantization_config.quant_method is not {QUANT_METHOD!r}")
    return read_section(quant)


def _modules(tensors: dict[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """Module -> its tensors by short name, for every module storing ``weight.*`` or a uint8 ``weight``."""
    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        head, found, rest = name.rpartition(".weight.")
        if found and not head.endswith(".weight"):
            modules.setdefault(head, {})[f"weight.{rest}"] = info
        elif name.endswith(".weight") and info.dtype == "uint8":
            modules.setdefault(name.removesuffix(".weight"), {})
    for module, members in modules.items():
        for short in (WEIGHT, "bias"):
            found_info = tensors.get(f"{module}.{short}")
            if found_info is not None:
                members[short] = found_info
    return modules


def read_layers(folder: str | Path) -> dict[str, BitsAndBytesLayer]:
    """Every quantized layer of a bitsandbytes 4-bit folder, checked from the headers and the quant
    states alone (CheckpointError naming the tensor and the rule otherwise)."""
    folder = Path(folder)
    config = read_config(folder)
    files = CheckpointFiles(folder)
    layers: dict[str, BitsAndBytesLayer] = {}
    for module, members in sorted(_modules(files.tensors).items(), key=lambda item: natural_key(item[0])):
        skipped = skipped_by(module, config.skip_modules)
        if skipped is not None:
            raise CheckpointError(
                f"{config.file}: module {module} is in llm_int8_skip_modules ({skipped!r}) but stores quantized "
                f"tensors ({', '.join(sorted(members))}); the config does not describe these weights"
            )
        short = state_name(members, module)
        info = members[short]
        if info.dtype != "uint8" or len(info.shape) != 1:
            raise CheckpointError(
                f"{info.file}: tensor {info.name} is {info.dtype} {list(info.shape)}; a quant state is uint8 [bytes] "
                "holding JSON"
            )
        data = files.get(info.name).numpy().tobytes() if info.numel <= MAX_STATE_BYTES else b" " * info.numel
        state = parse_state(info.name, data)
        check_layer(config, module, members, state)
        layers[module] = BitsAndBytesLayer(module, state, dict(members), files)
    return layers
