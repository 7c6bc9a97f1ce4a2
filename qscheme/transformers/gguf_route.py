"""``from_pretrained(..., gguf_file=..., quantization_config=QSchemeGgufConfig())``: qscheme's opt-in GGUF route.

transformers sends every GGUF file through its own GGUF quantizer (``quant_method: gguf``) and
refuses a ``quantization_config`` of any other method beside ``gguf_file=``. ``QSchemeGgufConfig``
is therefore a ``GgufConfig`` (the method transformers expects). Making one is the opt-in: it puts,
in place of transformers' GGUF quantizer, a subclass of it (``gguf_quantizer_class``) that behaves
exactly as transformers' own for every other config and takes qscheme's route for this one (until
then, and in a process that never makes one, transformers' registry is untouched):

- before the weights load (the model on the meta device), ``plan_swap`` plans the file with
  qscheme's GGUF planner and puts a placeholder where each quantized ``nn.Linear`` and experts
  module is, so transformers allocates no float weight for them;
- the state dict transformers loads is the file's plain tensors under their transformers names
  (norms, float weights) and a quantized embedding dequantized exactly (the one float copy);
- after, ``Swap.load`` reads every quantized layer into a ``QuantLinear`` / ``QuantExperts`` of
  scheme ``gguf/<TYPE>``: the weights stay quantized.

The model's config comes from transformers' own GGUF config mapping (``from_pretrained`` reads it
before any quantizer runs); where that mapping misses a value (a Qwen MoE's expert widths),
shapes disagree and the load is refused naming the tensor: ``qscheme.transformers.from_gguf`` uses
qscheme's corrected config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import GgufConfig

from qscheme.canonical import dequantize
from qscheme.checkpoint.load import check_module_values
from qscheme.checkpoint.plan import format_problems
from qscheme.dtype_fallback import warn_dtype_fallbacks
from qscheme.errors import CheckpointError, UsageError
from qscheme.transformers._swap import Swap, plan_swap

__all__ = ["QSchemeGgufConfig", "enable_route", "gguf_quantizer_class"]


class QSchemeGgufConfig(GgufConfig):
    """Load a GGUF file through qscheme, its quantized weights kept quantized (see the module docstring).

    ``kernel`` forces one kernel for every quantized layer (a name from ``qscheme kernels``)
    instead of the resolver's choice.
    """

    def __init__(self, gguf_file: str | None = None, kernel: str | None = None, **kwargs: Any) -> None:
        kwargs.pop("dequantize", None)
        super().__init__(gguf_file=gguf_file, dequantize=False, **kwargs)
        if kernel is not None and (not isinstance(kernel, str) or not kernel):
            raise UsageError(f"QSchemeGgufConfig: kernel must be a kernel name such as 'reference', not {kernel!r}")
        self.kernel = kernel
        self.loader = "qscheme"
        enable_route()


def enable_route() -> type[HfQuantizer]:
    """Put qscheme's subclass of transformers' GGUF quantizer in transformers' registry (idempotent);
    UsageError when something other than transformers' own GGUF quantizer holds the name."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    current = AUTO_QUANTIZER_MAPPING.get("gguf")
    if current is not None and getattr(current, "qscheme_route", False):
        return current  # type: ignore[no-any-return, return-value]
    if current is not GgufHfQuantizer:
        owner = f"{getattr(current, '__module__', '?')}.{getattr(current, '__name__', current)}"
        raise UsageError(
            f"QSchemeGgufConfig: transformers' GGUF quantizer has been replaced by {owner}; qscheme adds its route "
            "to transformers' own only. Use qscheme.transformers.from_gguf(path) instead"
        )
    route = gguf_quantizer_class(GgufHfQuantizer)
    AUTO_QUANTIZER_MAPPING["gguf"] = route
    return route


def _device(device_map: object) -> torch.device:
    from qscheme.transformers._quantizer import _device as one_device

    return one_device(device_map)


def gguf_quantizer_class(base: type[HfQuantizer]) -> type[HfQuantizer]:
    """A subclass of transformers' GGUF quantizer ``base``: ``base``'s behaviour for every config
    but ``QSchemeGgufConfig``, qscheme's route for that one."""

    class GgufQuantizerWithQSchemeRoute(base):  # type: ignore[misc, valid-type]
        """transformers' GGUF quantizer, with qscheme's route for ``QSchemeGgufConfig``."""

        qscheme_route = True

        def __init__(self, quantization_config: Any, **kwargs: Any) -> None:
            super().__init__(quantization_config, **kwargs)
            self.swap: Swap | None = None
            self.gguf_path: Path | None = None

        def _ours(self) -> bool:
            return isinstance(self.quantization_config, QSchemeGgufConfig)

        def validate_environment(self, *args: Any, **kwargs: Any) -> None:
            if not self._ours():
                return super().validate_environment(*args, **kwargs)
            _device(kwargs.get("device_map"))
            return None

        def update_device_map(self, device_map: Any) -> Any:
            return device_map if self._ours() else super().update_device_map(device_map)

        def update_attn_implementation(self, config: Any) -> Any:
            return config if self._ours() else super().update_attn_implementation(config)

        def read_header(self, gguf_file: str) -> None:
            if not self._ours():
                super().read_header(gguf_file)
                return
            self.gguf_path = Path(gguf_file)

        def update_dtype(self, dtype: Any) -> Any:
            if not self._ours():
                return super().update_dtype(dtype)
            self.dtype = dtype if dtype is not None else torch.bfloat16
            return self.dtype

        def get_new_dtype(self, converter: Any, param: Any, dtype: Any) -> Any:
            if not self._ours():
                return super().get_new_dtype(converter, param, dtype)
            return HfQuantizer.get_new_dtype(self, converter, param, dtype)

        def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            if not self._ours():
                return super()._process_model_before_weight_loading(model, **kwargs)
            if self.gguf_path is None:
                raise UsageError("QSchemeGgufConfig loads a GGUF file: pass from_pretrained(..., gguf_file=NAME)")
            self.swap = plan_swap(
                model,
                self.gguf_path,
                device=_device(kwargs.get("device_map")),
                activation_dtype=kwargs.get("dtype") or self.dtype,
                kernel=self.quantization_config.kernel,
                dequantize_non_linear=True,
            )
            return model

        def get_state_dict(self, checkpoint_file: str, model: Any) -> dict[str, torch.Tensor]:
            if not self._ours():
                return super().get_state_dict(checkpoint_file, model)  # type: ignore[no-any-return, return-value]
            assert self.swap is not None
            return _plain_state(self.swap, self.dtype)

        def update_weight_conversions(self, weight_conversions: Any, model: Any) -> Any:
            if not self._ours():
                return super().update_weight_conversions(weight_conversions, model)
            return []  # the state dict is in the model's own names already

        def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            if not self._ours():
                return super()._process_model_after_weight_loading(model, **kwargs)
            assert self.swap is not None
            self.swap.load(model)
            warn_dtype_fallbacks(model, "from_pretrained")
            return model

        def is_serializable(self, safe_serialization: Any = None) -> bool:
            return False if self._ours() else bool(super().is_serializable(safe_serialization))

    GgufQuantizerWithQSchemeRoute.__name__ = GgufQuantizerWithQSchemeRoute.__qualname__ = (
        f"{base.__name__}WithQSchemeRoute"
    )
    return GgufQuantizerWithQSchemeRoute


def _plain_state(swap: Swap, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's tensors transformers loads: every plain one, and each dequantized module's weight."""
    plan = swap.plan
    taken = tuple(f"{name}." for name in (*swap.linears, *swap.experts))
    state: dict[str, torch.Tensor] = {}
    for name in plan.files.tensors:
        if name.startswith(taken) or any(name.startswith(f"{layer}.") for layer in plan.layouts):
            continue
        state[name] = plan.files.get(name)
    for name in swap.dequantized:
        weight, problems = check_module_values(plan, plan.layouts[name], {})
        if weight is None:
            raise CheckpointError(f"{plan.path}: {name}: nothing was loaded:\n{format_problems(problems)}")
        state[f"{name}.weight"] = dequantize(weight).to(dtype)
    return state
