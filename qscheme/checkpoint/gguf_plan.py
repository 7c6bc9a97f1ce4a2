"""A GGUF file planned like a checkpoint folder: files, producer config and detection.

``plan_checkpoint`` hands a ``.gguf`` path here (``is_gguf_file``); what comes back is what a
folder gives it (a ``CheckpointFiles``, a producer config, a ``Detection``), so that the layout
checks, loading, ``inspect`` and ``resolve`` run unchanged. Placing each GGUF tensor:

- its transformers name comes from transformers' GGUF name map (``gguf_names``); a tensor the
  map cannot place is an error, except those transformers derives from the config (the rotary
  ``rope_freqs``), which are noted and not read;
- a quantized 2-D weight becomes the layer ``<module>`` of the scheme its ggml type names
  (``producers.gguf.detect``), its rows in transformers' order;
- stacked experts ``blk.N.ffn_{gate,up,down}_exps`` [E, N, K] become one layer per expert,
  ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` (the per-expert names
  ``QuantExperts`` and ``apply_to_model`` take), each reading its own rows: nothing is
  dequantized; unquantized experts become per-expert plain weights, which ``apply_to_model``
  stacks into the model's fused parameters;
- float tensors (F32, F16, BF16) are plain tensors, under the parameter's name, except the bias
  of a quantized layer (qwen2's q/k/v), which is the layer's;
- every shape is checked against the model transformers builds from the file's config.

Tensor parallelism is not offered for GGUF files (``load_checkpoint_tp`` refuses them).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from qscheme.checkpoint.detect import Detection, ModuleAssignment
from qscheme.checkpoint.gguf_files import GGUFFiles, Placed
from qscheme.checkpoint.gguf_names import GGUFNames, gguf_names
from qscheme.descriptor import Scheme
from qscheme.errors import CheckpointError
from qscheme.producers.base import natural_key
from qscheme.producers.gguf.config import GGUFConfig, is_gguf_file, read_gguf_config
from qscheme.producers.gguf.detect import PLAIN_TYPES, QuantizedTensor, assign_schemes, is_plain_type
from qscheme.storage import GGUFHeader, GGUFTensorInfo, read_gguf_header
from qscheme.tensor_checks import BIAS
from qscheme.text import listing, shown, shown_file

__all__ = ["is_gguf_file", "read_gguf_checkpoint"]

# llama.cpp's expert tensor kinds (gguf-py's MODEL_TENSOR) -> the per-expert projection.
_EXPERT_KINDS = (("FFN_GATE_EXP", "gate_proj"), ("FFN_UP_EXP", "up_proj"), ("FFN_DOWN_EXP", "down_proj"))
_FROM_CONFIG = ("ROPE_FREQS",)  # tensors transformers computes from the config instead of reading


def _tensor_kinds() -> tuple[dict[str, str], tuple[str, ...]]:
    """(GGUF name ending -> expert projection, names of tensors derived from the config), from
    gguf-py's tables (``blk.{bid}.ffn_gate_exps`` -> ``.ffn_gate_exps``)."""
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    experts = {TENSOR_NAMES[MODEL_TENSOR[kind]].rpartition("}")[2]: proj for kind, proj in _EXPERT_KINDS}
    derived = tuple(TENSOR_NAMES[MODEL_TENSOR[kind]] for kind in _FROM_CONFIG)
    return experts, derived


class _Placement:
    """Every GGUF tensor placed (``place``), and what is wrong, collected for one error."""

    def __init__(self, header: GGUFHeader, names: GGUFNames) -> None:
        self.header = header
        self.names = names
        self.file = shown_file(header.path)
        self.placed: dict[str, Placed] = {}
        self.layers: list[QuantizedTensor] = []
        self.notes: list[str] = []
        self.unplaced: list[str] = []
        self.problems: list[str] = []
        self.expert_kinds, self.derived = _tensor_kinds()

    def _describe(self, info: GGUFTensorInfo) -> str:
        return f"{shown(info.name)!r} ({info.type.name} {list(info.shape)})"

    def _mismatch(self, info: GGUFTensorInfo, target: str, wanted: object) -> None:
        model = self.names.parameter_shapes.get(target)
        self.problems.append(
            f"tensor {self._describe(info)} is {shown(target)!r} in transformers, which the model built from the "
            f"file's config holds as {list(model) if model else '?'}{wanted}"
        )

    def place(self, info: GGUFTensorInfo) -> None:
        target = self.names.target(info.name)
        if target is None or target not in self.names.parameter_shapes:
            if info.name.removesuffix(".weight") in self.derived:
                self.notes.append(
                    f"{shown(info.name)} is not read: transformers computes it from the config (rope parameters)"
                )
            else:
                self.unplaced.append(info.name)
            return
        model_shape = self.names.parameter_shapes[target]
        projection = next(
            (proj for end, proj in self.expert_kinds.items() if info.name.removesuffix(".weight").endswith(end)), None
        )
        if projection is not None and len(info.shape) == 3:
            self._experts(info, target, projection, model_shape)
        elif is_plain_type(info.type.name):
            if _numel(info.shape) != _numel(model_shape):
                self._mismatch(info, target, "")
                return
            self.placed[target] = Placed(
                target,
                info.name,
                info.type.name,
                model_shape,
                info.offset,
                dtype=PLAIN_TYPES[info.type.name],
                processed=True,
            )
        elif len(info.shape) != 2 or not target.endswith(".weight"):
            self.problems.append(
                f"tensor {self._describe(info)} is quantized but is not a layer's 2-D weight ({shown(target)!r}); "
                "qscheme keeps quantized only 2-D weights and stacked experts"
            )
        elif info.shape != model_shape:
            self._mismatch(info, target, "")
        else:
            module = target.removesuffix(".weight")
            order = self.names.row_order(info.name, info.shape[0])
            self.placed[target] = Placed(
                target, info.name, info.type.name, (info.shape[0], info.row_bytes), info.offset, row_order=order
            )
            self.layers.append(QuantizedTensor(module, info.type.name, info.name))

    def _experts(self, info: GGUFTensorInfo, target: str, projection: str, model_shape: tuple[int, ...]) -> None:
        """One layer (or plain weight) per expert of a stacked [E, N, K] tensor."""
        experts, rows, columns = info.shape
        fused_gate_up = projection != "down_proj"
        wanted = (
            (model_shape[0], model_shape[1] // 2, model_shape[2])
            if fused_gate_up and len(model_shape) == 3
            else model_shape
        )
        if len(model_shape) != 3 or info.shape != wanted:
            half = " (its gate or up half)" if fused_gate_up else ""
            self._mismatch(info, target, f"{half}: each expert's {projection} should be {list(wanted[1:])}")
            return
        module = target.rpartition(".")[0]
        plain = is_plain_type(info.type.name)
        for expert in range(experts):
            name = f"{module}.{expert}.{projection}.weight"
            rows_of = slice(expert * rows, (expert + 1) * rows)
            offset = info.offset + expert * rows * info.row_bytes
            if plain:
                shape = (rows, columns)
                self.placed[name] = Placed(
                    name, info.name, info.type.name, shape, offset, rows=rows_of, dtype=PLAIN_TYPES[info.type.name]
                )
            else:
                shape = (rows, info.row_bytes)
                self.placed[name] = Placed(name, info.name, info.type.name, shape, offset, rows=rows_of)
                self.layers.append(
                    QuantizedTensor(name.removesuffix(".weight"), info.type.name, info.name, expert=expert)
                )

    def refuse(self) -> None:
        """One CheckpointError naming every tensor that could not be placed."""
        parts = []
        if self.unplaced:
            model = type(self.names.config).__name__.removesuffix("Config")
            parts.append(
                f"{len(self.unplaced)} tensor(s) the {self.names.architecture} name map cannot place: "
                f"{listing(self.unplaced, 6, sentence=True)}; transformers' {model} model has no parameter for "
                "them (a file converted from another model family, or by a newer llama.cpp): load it with "
                "transformers' own GGUF loader"
            )
        if self.problems:
            parts.append(
                f"{len(self.problems)} tensor(s) that disagree with the model: "
                + "; ".join(self.problems[:6])
                + (f"; and {len(self.problems) - 6} more" if len(self.problems) > 6 else "")
                + ". The header's hyper-parameters do not describe these tensors: re-convert the model"
            )
        if parts:
            raise CheckpointError(f"{self.file}: " + ". ".join(parts))


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def read_gguf_checkpoint(path: str | Path, schemes: Iterable[Scheme]) -> tuple[GGUFFiles, GGUFConfig, Detection]:
    """The files, config and detection of a GGUF file (see the module docstring); CheckpointError
    naming the file and the tensors for anything that cannot be placed or read."""
    path = Path(path)
    header = read_gguf_header(path)
    config = read_gguf_config(shown_file(path), header.metadata, header.version)
    names = gguf_names(path, config.architecture)
    placement = _Placement(header, names)
    for info in header.tensors.values():
        placement.place(info)
    placement.refuse()
    assigned = assign_schemes(placement.file, placement.layers, schemes)
    files = GGUFFiles(header, placement.placed, names, placement.notes)
    modules: dict[str, ModuleAssignment] = {}
    biases: set[str] = set()
    for module, (scheme, origin) in sorted(assigned.items(), key=lambda item: natural_key(item[0])):
        tensors = {"weight": files.tensors[f"{module}.weight"]}
        bias = files.tensors.get(f"{module}.bias")  # a quantized layer's bias (qwen2's q/k/v) is the layer's
        if bias is not None:
            tensors[BIAS] = bias
            biases.add(bias.name)
        modules[module] = ModuleAssignment(module, scheme, origin, tensors)
    plain = tuple(
        sorted(
            (name for name, place in files.placed.items() if place.dtype is not None and name not in biases),
            key=natural_key,
        )
    )
    return files, config, Detection(producer=config, modules=modules, ignored={}, plain=plain)
