"""``QschemeConfig``: vLLM's quantization config for the ``qscheme`` method (registered on import).

vLLM builds it from the checkpoint's ``quantization_config`` (``from_config``) in its front end,
gives it the model folder (``maybe_update_config``) and pickles it to the engine process, where
``get_quant_method`` is asked for every layer. The class is module-level so that it pickles; it
holds only the config dict and the folder, and plans the checkpoint (``plan_checkpoint``: config and
headers, qscheme's detection and layout checks) once per process, on first use.

Selection: a checkpoint whose config says ``quant_method: qscheme`` selects the method by itself
(``override_quantization_method``); any other checkpoint qscheme reads (compressed-tensors,
ModelOpt, ...) runs through it with ``quantization="qscheme"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from qscheme.checkpoint.plan import Plan, format_problems, plan_checkpoint
from qscheme.engines.vllm_layers import fused_members
from qscheme.vllm.linear_method import MemberFacts, QschemeLinearMethod
from qscheme.vllm.moe_method import experts_method
from qscheme.vllm.params import VllmLayerError, checkpoint_renames
from qscheme.vllm.plugin import METHOD


class VllmGgufError(VllmLayerError):
    """A GGUF file given to the qscheme vLLM method, which does not serve GGUF: names the file and
    how to serve it (``gguf_refusal``)."""


def gguf_refusal(file: Path) -> VllmGgufError:
    return VllmGgufError(
        f"{file}: a GGUF file; the qscheme vLLM method does not serve GGUF yet (vLLM 0.32 has no GGUF "
        "loader or method of its own, and the plugin's weights come through vLLM's safetensors loader). "
        "Run it with qscheme's own loader (qscheme.transformers.from_gguf), or convert it into a folder "
        f"and serve that: `qscheme convert {file} OUT --to SCHEME` (a compressed-tensors or ModelOpt "
        "scheme; docs/gguf.md says which GGUF types convert exactly, the others need --allow-requantize), "
        'then LLM(model="OUT", quantization="qscheme")'
    )


def gguf_files(path: str | None) -> list[Path]:
    """The GGUF file ``path`` is, or those of a folder that holds no safetensors (nothing else to serve)."""
    if path is None:
        return []
    where = Path(path)
    if where.is_file():
        return [where] if where.suffix.lower() == ".gguf" else []
    if where.is_dir() and not any(where.glob("*.safetensors")):
        return sorted(where.glob("*.gguf"))
    return []


@register_quantization_config(METHOD)
class QschemeConfig(QuantizationConfig):  # type: ignore[misc]
    """The ``qscheme`` quantization method: each linear layer gets its scheme from qscheme's
    detection of the checkpoint, and runs on the kernel qscheme's resolver picks."""

    def __init__(self, quantization_config: dict[str, Any] | None = None) -> None:
        super().__init__()  # vLLM builds it without a config for a checkpoint whose config.json has none
        self.quantization_config = dict(quantization_config or {})
        self.model_path: str | None = None
        self._plan: Plan | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_plan"] = None  # planned again in the process that uses it
        return state

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the resolver decides what runs on a device; a CPU or any GPU has a kernel

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QschemeConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        if user_quant == METHOD or (user_quant is None and hf_quant_cfg.get("quant_method") == METHOD):
            return METHOD
        return None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        self.model_path = model_name

    def get_checkpoint_weight_mapper(self) -> Any:
        """Nothing is dropped (vLLM's default drops ``g_idx``, which qscheme's schemes read); tensor names
        with dots get the names of the parameters that hold them (``params.checkpoint_renames``)."""
        from vllm.model_executor.models.utils import WeightsMapper

        names = {name for layout in self.plan().layouts.values() for name in layout.declared}
        return WeightsMapper(orig_to_new_suffix=checkpoint_renames(names))

    # -- the checkpoint's plan ----------------------------------------------------------------

    def plan(self) -> Plan:
        if self._plan is None:
            gguf = gguf_files(self.model_path)
            if gguf:
                raise gguf_refusal(gguf[0])
            if self.model_path is None or not Path(self.model_path).is_dir():
                raise VllmLayerError(
                    f"the qscheme vLLM method reads the checkpoint's folder, and {self.model_path!r} is none; "
                    "download the model first (huggingface-cli download NAME --local-dir DIR) and serve DIR"
                )
            plan = plan_checkpoint(self.model_path)
            if plan.problems:
                raise VllmLayerError(f"{self.model_path}: {format_problems(plan.problems)}")
            self._plan = plan
        return self._plan

    def _members(self, prefix: str) -> list[str]:
        """The checkpoint modules behind vLLM's layer (``qscheme resolve --engine vllm`` groups alike)."""
        return fused_members(prefix, getattr(self, "packed_modules_mapping", None))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):  # a fused-MoE layer: its experts (qscheme.vllm.moe_method)
            return experts_method(self.plan(), layer, prefix, self.model_path)
        if not isinstance(layer, LinearBase):
            return None
        plan = self.plan()
        members = self._members(prefix)
        layouts = [plan.layouts.get(member) for member in members]
        if all(layout is None for layout in layouts):
            return UnquantizedLinearMethod()
        absent = [member for member, layout in zip(members, layouts, strict=True) if layout is None]
        present = [layout for layout in layouts if layout is not None]
        if absent:
            raise VllmLayerError(
                f"{prefix}: vLLM fuses {', '.join(members)}, and {', '.join(absent)} is not quantized in "
                f"{self.model_path} while the others are; quantize all of them or none"
            )
        schemes = {layout.scheme.name for layout in present}
        if len(schemes) > 1:
            raise VllmLayerError(
                f"{prefix}: vLLM fuses {', '.join(members)}, which use different schemes "
                f"({', '.join(sorted(schemes))}); one fused layer runs one scheme: quantize them alike"
            )
        return QschemeLinearMethod(prefix, present[0].scheme, [MemberFacts.of(layout) for layout in present])
