"""QuantLinear: the torch module a user holds for one quantized linear layer.

It is built from a scheme and its checkpoint tensors (``from_tensors``) or from canonical
tensors (``from_canonical``, which the checkpoint loader uses for fused layers), resolves its
kernel once per activation dtype, and runs ``kernel.apply`` in ``forward``. ``dequantize()``
gives the exact float32 weight it encodes, whatever kernel runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qscheme.canonical import CanonicalWeight, canonicalize, dequantize
from qscheme.checkpoint.validate import require_valid_tensors
from qscheme.descriptor import Scheme
from qscheme.errors import UsageError
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.problem import Problem, normalize_dtype
from qscheme.kernels.registry import device_for, select_kernel
from qscheme.kernels.resolver import Resolution


def _differ(values: Tensor | None) -> bool:
    if values is None or values.numel() <= 1:
        return False
    flat = values.reshape(-1)
    return not bool(torch.all(flat == flat[0]))


def problem_for(
    weight: CanonicalWeight, activation_dtype: str | torch.dtype = "bfloat16", layer: str | None = None
) -> Problem:
    """The resolver's view of a canonical layer: shape, partitions and whether their scales differ."""
    scale_spec = weight.scheme.weight.scale
    per_tensor_scale = weight.scale if scale_spec.granularity == "tensor" else None
    differ = any(
        _differ(v) for v in (weight.global_scale, per_tensor_scale, weight.input_scale, weight.input_global_scale)
    )
    return Problem(
        n=weight.n,
        k=weight.k,
        activation_dtype=normalize_dtype(activation_dtype),
        partitions=max(1, len(weight.partitions)),
        partition_scales_differ=differ,
        input_pre_scale=weight.input_pre_scale is not None,
        layer=layer,
    )


DEVICE_FORMS = "'cpu', 'cuda', 'cuda:N' or a torch.device"


def checked_device(device: object, caller: str = "load_checkpoint") -> torch.device:
    """``device=`` as a torch.device; a UsageError naming the value and the allowed forms otherwise.

    Checked before anything is read: the value must parse, must not be the meta device, and a
    CUDA device must be visible.
    """
    if isinstance(device, torch.device):
        torch_device = device
    elif isinstance(device, str):
        try:
            torch_device = torch.device(device)
        except (RuntimeError, ValueError):
            raise UsageError(f"{caller}(device={device!r}): not a device; pass {DEVICE_FORMS}") from None
    else:
        example = f"'cuda:{device}'" if isinstance(device, int) and not isinstance(device, bool) else "'cpu'"
        raise UsageError(
            f"{caller}(device={device!r}): a device is {DEVICE_FORMS}, not of type {type(device).__name__}; "
            f"e.g. device={example}"
        )
    if torch_device.type == "cpu":
        return torch.device("cpu")  # "cpu:0" is the one CPU device too
    if torch_device.type == "meta":
        raise UsageError(
            f"{caller}(device={device!r}): nothing can be loaded onto the meta device; pass 'cpu' or 'cuda'"
        )
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"{caller}(device={device!r}): no CUDA device is visible here (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); pass device='cpu', or run where a GPU is visible"
            )
        count = torch.cuda.device_count()
        if torch_device.index is not None and torch_device.index >= count:
            raise UsageError(
                f"{caller}(device={device!r}): there is no CUDA device {torch_device.index} here; "
                f"{count} visible: pass one of {', '.join(f'cuda:{i}' for i in range(count))}"
            )
    return torch_device


class QuantLinear(torch.nn.Module):
    """y = x @ W^T + bias for a quantized W, computed by the kernel the resolver chose.

    For inference: the output carries no gradient, whatever kernel runs it. The quantized
    weight lives outside ``state_dict`` (``weight_canonical``; a checkpoint is the way to save
    it), and the layer stays on the device it was built for: ``module.to(...)`` does not move
    it, and an input on another device is refused.
    """

    def __init__(
        self,
        weight: CanonicalWeight,
        device: torch.device | str = "cpu",
        kernel: str | None = None,
        bias: Tensor | None = None,
        layer_name: str | None = None,
        activation_dtype: str | torch.dtype = "bfloat16",
        device_facts: DeviceFacts | None = None,
    ) -> None:
        super().__init__()
        self.weight_canonical = weight
        self.torch_device = checked_device(device, "QuantLinear")
        self.forced_kernel = kernel
        self.layer_name = layer_name
        self.in_features = weight.k
        self.out_features = weight.n
        self._facts = device_facts
        self.bias: Tensor | None
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise UsageError(f"bias must be a torch.Tensor of shape [{weight.n}], not {type(bias).__name__}")
            if tuple(bias.shape) != (weight.n,):
                raise UsageError(f"bias has shape {list(bias.shape)}; the layer has N={weight.n} outputs")
            self.register_buffer("bias", bias.to(self.torch_device))
        else:
            self.bias = None
        # Resolution happens now (a layer that cannot run fails at load time); the kernel's
        # prepare (repack, or the reference kernel's float32 weight) waits for the first forward
        # or an explicit prepare(), so that loading a checkpoint stays close to its file size.
        self._resolved: dict[str, tuple[Resolution, KernelDeclaration, Any]] = {}
        self._states: dict[str, Any] = {}
        self._default_dtype = normalize_dtype(activation_dtype)
        self._resolve(self._default_dtype)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_canonical(
        cls,
        weight: CanonicalWeight,
        device: torch.device | str = "cpu",
        kernel: str | None = None,
        bias: Tensor | None = None,
        layer_name: str | None = None,
        activation_dtype: str | torch.dtype = "bfloat16",
    ) -> QuantLinear:
        """A layer from canonical tensors (several ``partitions`` for a fused layer)."""
        return cls(weight, device, kernel, bias, layer_name, activation_dtype)

    @classmethod
    def from_tensors(
        cls,
        scheme: Scheme | str | Path,
        tensors: Mapping[str, Tensor],
        device: torch.device | str = "cpu",
        kernel: str | None = None,
        bias: Tensor | None = None,
        layer_name: str | None = None,
        activation_dtype: str | torch.dtype = "bfloat16",
    ) -> QuantLinear:
        """A layer from a scheme (object, catalog name or descriptor file) and its checkpoint
        tensors, keyed by the names the scheme declares (``weight_packed``, ``weight_scale``...).

        The tensors get the checkpoint loader's checks: a missing or undeclared name (tolerated
        ones pass), a wrong dtype or shape, or a zero, negative or non-finite scale raises
        QuantizeError. A ``bias`` among them is the layer's bias (or pass ``bias=``, not both).
        """
        if not isinstance(scheme, Scheme):
            from qscheme.catalog import load_scheme

            scheme = load_scheme(scheme)
        n, k = require_valid_tensors(scheme, tensors, layer_name)
        if "bias" in tensors:
            if bias is not None:
                raise UsageError(f"{layer_name or 'QuantLinear'}: bias given twice: in tensors and as bias=; pass one")
            bias = tensors["bias"]
        return cls(canonicalize(scheme, tensors, n, k), device, kernel, bias, layer_name, activation_dtype)

    # -- kernel selection ----------------------------------------------------------------------

    def _device_facts(self) -> DeviceFacts:
        if self._facts is None:
            # cuda: the probed GPU (the first one; mixed-GPU machines are not told apart yet), or
            # UsageError where none is visible; another torch device type: whatever is probed.
            kind = self.torch_device.type
            self._facts = device_for(kind if kind in ("cpu", "cuda") else None)
        return self._facts

    def _resolve(self, activation_dtype: str) -> tuple[Resolution, KernelDeclaration, Any]:
        found = self._resolved.get(activation_dtype)
        if found is None:
            problem = problem_for(self.weight_canonical, activation_dtype, self.layer_name)
            found = select_kernel(self.weight_canonical.scheme, problem, self._device_facts(), self.forced_kernel)
            self._resolved[activation_dtype] = found
        return found

    def _prepare(self, activation_dtype: str) -> tuple[Any, Any]:
        _, _, implementation = self._resolve(activation_dtype)
        if activation_dtype not in self._states:
            self._states[activation_dtype] = implementation.prepare(self.weight_canonical, self.torch_device)
        return implementation, self._states[activation_dtype]

    def prepare(self, activation_dtype: str | torch.dtype | None = None) -> QuantLinear:
        """Run the kernel's prepare now (it otherwise runs on the first forward); returns self."""
        self._prepare(normalize_dtype(activation_dtype) if activation_dtype is not None else self._default_dtype)
        return self

    @property
    def prepared(self) -> bool:
        """Whether the kernel state for the default activation dtype has been built."""
        return self._default_dtype in self._states

    @property
    def kernel(self) -> KernelDeclaration:
        """The declaration of the kernel that runs this layer (for the default activation dtype)."""
        return self._resolved[self._default_dtype][1]

    @property
    def resolution(self) -> Resolution:
        """The resolution (with its trace) behind ``kernel``."""
        return self._resolved[self._default_dtype][0]

    @property
    def scheme(self) -> Scheme:
        return self.weight_canonical.scheme

    # -- computation ---------------------------------------------------------------------------

    def dequantize(self) -> Tensor:
        """The float32 [N, K] weight this layer encodes (exact; independent of the kernel)."""
        return dequantize(self.weight_canonical)

    def forward(self, x: Tensor) -> Tensor:
        name = self.layer_name or "QuantLinear"
        if not isinstance(x, Tensor):
            raise UsageError(f"{name}: the input must be a torch.Tensor, not {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise UsageError(
                f"{name}: input of shape {list(x.shape)} has {x.shape[-1] if x.dim() else 'no'} features in "
                f"its last dim, the layer takes K={self.in_features}"
            )
        dtype = normalize_dtype(x.dtype) if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else None
        if dtype is None:
            raise UsageError(f"{name}: input dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
        wanted = self.torch_device
        if x.device.type != wanted.type or (wanted.index is not None and x.device.index != wanted.index):
            raise UsageError(
                f"{name}: the input is on {x.device}, the layer on {wanted}; move the input, or load the "
                f"layer on the input's device (load_checkpoint(..., device=...)): module.to() does not move it"
            )
        implementation, state = self._prepare(dtype)
        with torch.no_grad():
            y: Tensor = implementation.apply(state, x, self.bias)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"kernel={self.kernel.name}, bias={self.bias is not None}"
        )
