"""QuantLinear: the torch module a user holds for one quantized linear layer.

It is built from a scheme and its checkpoint tensors (``from_tensors``) or from canonical
tensors (``from_canonical``, which the checkpoint loader uses for fused layers), resolves its
kernel once per activation dtype, and runs ``kernel.apply`` in ``forward``. ``dequantize()``
gives the exact float32 weight it encodes, whatever kernel runs it.

The layer never runs another kernel than the one it reports: ``kernel`` is the one for the
default activation dtype, ``kernel_for(dtype)`` the one for any other; an input dtype that
routes to a different kernel also warns (KernelRouteWarning) the first time. A kernel's code
that raises, or returns anything but ``[..., N]`` in the input's dtype, raises
KernelExecutionError naming the layer, the kernel, its plugin and the scheme.

As an nn.Module: the canonical tensors are buffers (``canonical_codes``, ``canonical_scale``,
...: qscheme's canonical form, not a producer's checkpoint names or conventions), so
``state_dict`` holds them and ``load_state_dict`` fills them (same dtypes and shapes: the same
scheme and layer shape). They stay in host memory: the layer's device, which
``module.to(device)`` sets, holds the kernel's prepared form, built on first use there, so a
GPU holds one copy of the weight, not two. ``load_checkpoint`` gives them memory of their own,
never a memory map of the checkpoint's files (which may change once loading returns).
``from_tensors`` does not copy: it keeps the tensors it is given (or views of them) as they are,
so tensors the caller memory-mapped (``safetensors.torch.load_file``) keep reading their file,
and a file truncated under them kills the process (SIGBUS) as any memory map does: clone them
first, or use ``load_checkpoint``, which copies. Dtype
casts (``.half()``, ``.to(torch.bfloat16)``) never touch them, only the bias. The weight is
frozen: gradients flow to the input (``grad_x = grad_y @ effective_weight()``, straight
through any activation quantization), never to the weight.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qscheme.api_checks import require_optional_name, require_tensor
from qscheme.canonical import TENSOR_FIELDS, CanonicalWeight, canonicalize, dequantize
from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.descriptor import Scheme
from qscheme.errors import UsageError
from qscheme.input_checks import poison_non_finite_rows, refuse_non_finite
from qscheme.kernels.declaration import KernelDeclaration
from qscheme.kernels.devices import DeviceFacts
from qscheme.kernels.interface import KernelExecutionError
from qscheme.kernels.plan import KernelPlan
from qscheme.kernels.problem import normalize_dtype
from qscheme.kernels.registry import checked_kernel, device_for, load_implementation, m_split_override, select_kernel
from qscheme.kernels.resolver import Resolution
from qscheme.modules.device import checked_device
from qscheme.modules.failures import KernelRouteWarning, bad_output_error, kernel_error, route_message
from qscheme.modules.ops import handle_for
from qscheme.modules.problem import problem_for
from qscheme.modules.weight import QuantizedWeight, QuantizedWeightError
from qscheme.tensor_checks import require_valid_tensors


class QuantLinear(torch.nn.Module):
    """y = x @ W^T + bias for a quantized W, computed by the kernel the resolver chose; for a
    scheme with an input pre-scale p (AWQ), y = (x * p) @ W^T + bias (``effective_weight``).

    The canonical tensors are buffers named ``canonical_<field>`` in host memory (see the module
    docstring); ``torch_device`` is where the layer computes. The weight is frozen; an input
    that requires grad gets its gradient through the dequantized weight.
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
        m_split: str | int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(weight, CanonicalWeight):
            raise UsageError(
                f"QuantLinear takes a CanonicalWeight, not {type(weight).__name__}; build a layer with "
                "QuantLinear.from_tensors(scheme, tensors) or load one with qscheme.load_checkpoint(folder)"
            )
        torch_device = checked_device(device, "QuantLinear")
        kernel = checked_kernel(kernel, "QuantLinear")
        # the batch-range override (None: QSCHEME_M_SPLIT, read when the layer resolves)
        split = m_split_override(m_split, origin="QuantLinear(m_split=...)") if m_split is not None else None
        self.m_split: str | None = None if split is None else split.text
        # what describes the tensors; the tensors themselves are buffers (weight_canonical),
        # left where they are given (host memory, copies of their own for a loaded checkpoint);
        # detached: the weight is frozen, so scales given as Parameters carry no autograd history
        self._layout = _Layout(weight.scheme, weight.n, weight.k, weight.partitions)
        for name, value in weight.tensors().items():
            self.register_buffer(BUFFER_PREFIX + name, value.detach())
        # The layer's device: an empty buffer that module moves (and torch.load's map_location)
        # carry along; not in the state dict.
        self.register_buffer("_device_anchor", torch.empty(0, device=torch_device), persistent=False)
        self.forced_kernel = kernel
        self.layer_name = require_optional_name(layer_name, "layer_name", "QuantLinear")
        self.in_features = weight.k
        self.out_features = weight.n
        self._facts = device_facts
        self.bias: Tensor | None
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise UsageError(f"bias must be a torch.Tensor of shape [{weight.n}], not {type(bias).__name__}")
            require_tensor(bias, layer_name or "QuantLinear", "bias", fix=f"pass a dense tensor of shape [{weight.n}]")
            if tuple(bias.shape) != (weight.n,):
                raise UsageError(f"bias has shape {list(bias.shape)}; the layer has N={weight.n} outputs")
            if not bias.is_floating_point():
                raise UsageError(f"bias has dtype {bias.dtype}; pass a floating-point bias (e.g. bias.float())")
            self.register_buffer("bias", bias.detach().to(torch_device))
        else:
            self.bias = None
        # Resolution happens now (a layer that cannot run fails at load time); the kernel's
        # prepare (a repack; the reference kernel keeps the canonical tensors) waits for the first forward
        # or an explicit prepare(), so that loading a checkpoint stays close to its file size.
        self._resolved: dict[str, tuple[Resolution, KernelDeclaration, Any, tuple[_Route, ...]]] = {}
        self._states: dict[tuple[str, str], Any] = {}  # (activation dtype, kernel name) -> prepared state
        self._routes_told: set[str] = set()  # input dtypes whose kernel was checked against ``kernel``
        self._output_shapes: dict[torch.Size, torch.Size] = {}  # input shape -> the output shape apply must give
        self._kernel_device = self.torch_device  # the device _facts, _resolved and _states are for
        self._lock = threading.RLock()
        self._default_dtype = normalize_dtype(activation_dtype)
        self._op_handle = handle_for(self)  # how torch.compile's custom op finds this layer (qscheme.modules.ops)
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
        m_split: str | int | None = None,
    ) -> QuantLinear:
        """A layer from canonical tensors (several ``partitions`` for a fused layer)."""
        return cls(weight, device, kernel, bias, layer_name, activation_dtype, m_split=m_split)

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
        m_split: str | int | None = None,
    ) -> QuantLinear:
        """A layer from a scheme (object, catalog name or descriptor file) and its checkpoint
        tensors, keyed by the names the scheme declares (``weight_packed``, ``weight_scale``...).

        The tensors get the checkpoint loader's checks: a missing or undeclared name (tolerated
        ones pass), a wrong dtype or shape, or a zero, negative or non-finite scale raises
        QuantizeError. A ``bias`` among them is the layer's bias (or pass ``bias=``, not both).
        A ``kernel`` that is not a declared kernel's name raises UsageError before any tensor is read.

        The tensors are kept as they are (or as views), not copied: the layer shares memory with
        them. Tensors memory-mapped from a file (``safetensors.torch.load_file``) are read from
        that file for as long as the layer lives, and a file truncated or rewritten under them
        kills the process (SIGBUS) or changes the weights, as with any memory map. Pass
        ``{name: t.clone() for name, t in tensors.items()}``, or use ``load_checkpoint``, which
        copies what it reads.
        """
        checked_kernel(kernel, "QuantLinear.from_tensors")
        require_scheme_argument(scheme, "QuantLinear.from_tensors")
        if not isinstance(scheme, Scheme):
            scheme = load_scheme(scheme)
        n, k = require_valid_tensors(scheme, tensors, layer_name)
        if "bias" in tensors:
            if bias is not None:
                raise UsageError(f"{layer_name or 'QuantLinear'}: bias given twice: in tensors and as bias=; pass one")
            bias = tensors["bias"]
        return cls(
            canonicalize(scheme, tensors, n, k, layer=layer_name),
            device,
            kernel,
            bias,
            layer_name,
            activation_dtype,
            m_split=m_split,
        )

    # -- the canonical tensors as buffers ------------------------------------------------------

    @property
    def weight_canonical(self) -> CanonicalWeight:
        """The canonical weight: the layer's scheme and shape with its current buffers."""
        tensors: dict[str, Any] = {name: self._buffers.get(BUFFER_PREFIX + name) for name in TENSOR_FIELDS}
        layout = self._layout
        return CanonicalWeight(layout.scheme, layout.n, layout.k, partitions=layout.partitions, **tensors)

    def _canonical_buffers(self) -> dict[str, Tensor]:
        return {
            name: value for name, value in self._buffers.items() if name.startswith(BUFFER_PREFIX) and value is not None
        }

    @property
    def torch_device(self) -> torch.device:
        """The device the layer computes on (its input's device; the kernel state's)."""
        return self._device_anchor.device

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantLinear:
        """Device moves set the layer's device and leave the canonical buffers in host memory
        (they follow a move to the CPU or the meta device, and ``to_empty`` makes them anew
        there); dtype casts leave them as they are. The bias follows both, as an nn.Linear's."""
        before = self._canonical_buffers()
        super()._apply(fn, recurse)
        changed = False
        for name, old in before.items():
            new = self._buffers[name]
            if new is None:
                continue
            if new.device.type not in HOST_DEVICES:
                new = torch.empty_like(old, device="cpu") if old.is_meta else old
            elif new.dtype != old.dtype:
                new = old.to(device=new.device)
            self._buffers[name] = new
            changed = changed or new is not old
        if changed:
            self._states.clear()
        return self

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """The canonical buffers take only tensors of their own dtype and shape (a cast would
        change what they encode), and all of them or none, strict or not: when one is refused or
        missing, nothing of this layer is loaded (half of one layer's tensors and half of
        another's encode nothing). The kernel state is rebuilt from what was loaded."""
        mine = self._canonical_buffers()
        given_names = [name for name in mine if prefix + name in state_dict]
        refused = 0 < len(given_names) < len(mine)
        if refused:
            absent = [prefix + name for name in mine if name not in given_names]
            error_msgs.append(
                f"{', '.join(absent)}: missing beside {', '.join(prefix + n for n in given_names)}; the canonical "
                f"tensors of {self.layer_name or 'a QuantLinear'} load together or not at all"
            )
        for name, current in mine.items():
            given = state_dict.get(prefix + name)
            if isinstance(given, Tensor) and (given.dtype != current.dtype or given.shape != current.shape):
                error_msgs.append(
                    f"{prefix + name}: {_tensor_text(given)} cannot be loaded into {_tensor_text(current)} of "
                    f"{self.layer_name or 'this QuantLinear'} (canonical tensors of scheme {self.scheme.name}, "
                    f"N={self.out_features}, K={self.in_features}); load a state dict of the same scheme and layer "
                    "shape, or build the layer from its checkpoint"
                )
                refused = True
        if refused:  # every key of this layer that is there maps to its own tensor: nothing is copied
            own = {prefix + name: value for name, value in self._buffers.items() if value is not None}
            state_dict = {**state_dict, **{key: value for key, value in own.items() if key in state_dict}}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        codes = self._buffers[BUFFER_PREFIX + "codes"]
        if self.torch_device.type == "meta" and codes is not None and not codes.is_meta:
            # load_state_dict(..., assign=True) into a layer on the meta device: it computes
            # where the tensors were given
            self._device_anchor = torch.empty(0, device=codes.device)
        self._states.clear()
        self._resolved.clear()  # the resolver reads values (whether partition scales differ)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # the property has no setter; say so instead of nn.Module's KeyError
            raise QuantizedWeightError(
                f"{self.layer_name or 'QuantLinear'}: .weight of a quantized layer cannot be replaced (tying or "
                "resizing it needs the unquantized weight): keep this layer out of the tying, or load the module "
                "unquantized (ignore it when quantizing)"
            )
        super().__setattr__(name, value)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (torch.save, deepcopy) without kernel choice or state: both are rebuilt on
        first use, for the device the layer lands on."""
        state = self.__dict__.copy()
        state.update(_states={}, _resolved={}, _routes_told=set(), _facts=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.RLock()
        # layers pickled by an earlier qscheme lack the newer bookkeeping
        self.__dict__.setdefault("_routes_told", set())
        self.__dict__.setdefault("_output_shapes", {})
        self.__dict__.setdefault("m_split", None)
        self._op_handle = handle_for(self)  # a copy is a layer of its own for the custom ops

    # -- kernel selection ----------------------------------------------------------------------

    def _device_facts(self) -> DeviceFacts:
        if self._facts is None:
            # cuda: the probed GPU (the first one; mixed-GPU machines are not told apart yet), or
            # UsageError where none is visible; another torch device type: whatever is probed.
            kind = self.torch_device.type
            self._facts = device_for(kind if kind in ("cpu", "cuda") else None)
        return self._facts

    def _follow_device(self, device: torch.device | None = None) -> None:
        """Drop the kernel choice and state made for another device (after a move, or a load
        with map_location / assign=True); ``device``: the layer's, where the caller read it."""
        device = self.torch_device if device is None else device
        if device != self._kernel_device:
            self._kernel_device = device
            self._facts = None
            self._resolved.clear()
            self._states.clear()
            self._routes_told.clear()

    def _resolve(self, activation_dtype: str) -> tuple[Resolution, KernelDeclaration, Any, tuple[_Route, ...]]:
        self._follow_device()
        found = self._resolved.get(activation_dtype)
        if found is None:
            problem = problem_for(self.weight_canonical, activation_dtype, self.layer_name)
            resolution, kernel, implementation = select_kernel(
                self.scheme, problem, self._device_facts(), self.forced_kernel, m_split=self.m_split
            )
            # the plan's kernels were imported by the resolution: loading them is a lookup
            routes = tuple(
                _Route(entry.m_min, entry.m_max, entry.kernel, load_implementation(entry.kernel))
                for entry in resolution.plan.entries
            )
            found = (resolution, kernel, implementation, routes)
            self._resolved[activation_dtype] = found
        return found

    @torch.compiler.disable
    def _prepare(self, activation_dtype: str, m: int = 1) -> tuple[_Route, Any]:
        """The kernel for ``activation_dtype`` and batch size ``m`` (the plan's) and its state,
        prepared once per kernel from the same canonical weight (threads that ask together wait
        for the first: one prepared copy, not one per thread). Not traced by torch.compile: a
        compiled model prepares eagerly on its first call."""
        with self._lock:
            route = _route_for(self._resolve(activation_dtype)[3], m)
            key = (activation_dtype, route.kernel.name)
            if key not in self._states:
                try:
                    state = route.implementation.prepare(self.weight_canonical, self.torch_device)
                except (Exception, SystemExit) as exc:  # a plugin's code may raise anything: name who failed, where
                    raise self._kernel_error(route.kernel, activation_dtype, "prepare", exc) from exc
                self._states[key] = state
            return route, self._states[key]

    def _prepared(self, activation_dtype: str, m: int = 1, device: torch.device | None = None) -> tuple[_Route, Any]:
        """``_prepare`` with a lookup first (the forward's host time); ``device``: the layer's,
        where the caller read it."""
        self._follow_device(device)
        found = self._resolved.get(activation_dtype)
        if found is not None:
            routes = found[3]
            route = routes[0] if len(routes) == 1 else _route_for(routes, m)
            state = self._states.get((activation_dtype, route.kernel.name))
            if state is not None:
                return route, state
        return self._prepare(activation_dtype, m)

    def prepare(self, activation_dtype: str | torch.dtype | None = None, m: int | None = None) -> QuantLinear:
        """Run the kernels' prepare now (it otherwise runs on the first forward at each kernel's
        batch sizes, compiled or not: ``qscheme.modules.ops``): every kernel of the plan, or the
        one for batch size ``m``; returns self."""
        dtype = normalize_dtype(activation_dtype) if activation_dtype is not None else self._default_dtype
        routes = self._resolve(dtype)[3]
        for first in [m] if m is not None else [route.m_min for route in routes]:
            self._prepare(dtype, first)
        return self

    @property
    def prepared(self) -> bool:
        """Whether the state of the kernel for the default activation dtype (at M = 1) has been
        built (for the layer's current device)."""
        self._follow_device()
        return (self._default_dtype, self.kernel.name) in self._states

    @property
    def plan(self) -> KernelPlan:
        """Which kernel runs which batch size M (= x.numel() // K) for the default activation
        dtype: the plan ``qscheme resolve --m`` shows."""
        return self.resolution.plan

    def set_m_split(self, m_split: str | int | None) -> QuantLinear:
        """Override the kernels' declared batch ranges for this layer (``qscheme.kernels.plan``:
        a boundary M, ``"off"``, or ``kernel=RANGE`` pairs; None: QSCHEME_M_SPLIT again). The plan
        is resolved anew at the next call, and its kernels prepared on first use. Returns self."""
        split = m_split_override(m_split, origin="set_m_split(m_split=...)") if m_split is not None else None
        with self._lock:
            self.m_split = None if split is None else split.text
            self._resolved.clear()
            self._states.clear()
            self._routes_told.clear()
        return self

    def kernel_for_batch(self, m: int, activation_dtype: str | torch.dtype | None = None) -> KernelDeclaration:
        """The kernel ``forward`` runs for inputs of ``m`` rows (x.numel() // K) of ``activation_dtype``
        (default: the layer's)."""
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise UsageError(f"{self._name()}: kernel_for_batch takes a batch size M >= 0 (an int), not {m!r}")
        dtype = self._default_dtype if activation_dtype is None else self._dtype_name(activation_dtype)
        return _route_for(self._resolve(dtype)[3], m).kernel

    @property
    def kernel(self) -> KernelDeclaration:
        """The declaration of the kernel that runs this layer (for the default activation dtype)."""
        return self._resolve(self._default_dtype)[1]

    @property
    def resolution(self) -> Resolution:
        """The resolution (with its trace) behind ``kernel``."""
        return self._resolve(self._default_dtype)[0]

    @property
    def activation_dtype(self) -> str:
        """The default activation dtype: the one ``kernel`` and ``resolution`` are for."""
        return self._default_dtype

    def kernel_for(self, activation_dtype: str | torch.dtype) -> KernelDeclaration:
        """The kernel that runs inputs of ``activation_dtype`` ("bf16", torch.float32, ...) on this
        layer's device: the one ``forward`` calls for them, which may differ from ``kernel``."""
        return self._resolve(self._dtype_name(activation_dtype))[1]

    def resolution_for(self, activation_dtype: str | torch.dtype) -> Resolution:
        """The resolution (with its trace) behind ``kernel_for(activation_dtype)``."""
        return self._resolve(self._dtype_name(activation_dtype))[0]

    def _dtype_name(self, activation_dtype: object) -> str:
        try:
            return normalize_dtype(activation_dtype)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{self._name()}: {exc}") from None

    def _name(self) -> str:
        return self.layer_name or f"QuantLinear(N={self.out_features}, K={self.in_features})"

    def _tell_route(self, activation_dtype: str) -> None:
        """Warn once per input dtype that runs on another kernel than ``kernel`` reports."""
        self._routes_told.add(activation_dtype)
        usual = self.kernel
        routed = self.kernel_for(activation_dtype)
        if routed.name == usual.name:
            return
        why = ""
        with contextlib.suppress(KeyError):
            candidate = self.resolution_for(activation_dtype).candidate(usual.name)
            why = f" ({usual.name}: {candidate.reason})" if candidate.reason else ""
        message = route_message(self._name(), activation_dtype, routed, usual, self._default_dtype, why)
        warnings.warn(message, KernelRouteWarning, stacklevel=3)

    def _kernel_error(
        self, kernel: KernelDeclaration, activation_dtype: str, stage: str, error: BaseException
    ) -> KernelExecutionError:
        """The typed error for a kernel whose ``stage`` (prepare or apply) raised ``error``."""
        where = f"{activation_dtype} inputs, device {self.torch_device}"
        return kernel_error(kernel, stage, error, self._name(), self.scheme.name, where)

    def _run(self, route: _Route, state: Any, x: Tensor, activation_dtype: str) -> Tensor:
        """``implementation.apply`` with its failures and its output checked; a non-finite input to
        a layer that quantizes activations is refused on a CPU, NaN-propagated elsewhere
        (``qscheme.input_checks``)."""
        quantizes = self.scheme.activation is not None
        if quantizes and x.device.type == "cpu":
            refuse_non_finite(x, self._name(), self.scheme.name)
        try:
            y = route.implementation.apply(state, x, self.bias)
        except (Exception, SystemExit) as exc:  # a plugin's code may raise anything: name who failed, where
            raise self._kernel_error(route.kernel, activation_dtype, "apply", exc) from exc
        if not isinstance(y, Tensor) or y.dtype != x.dtype or y.shape != self._output_shape(x):
            raise self._bad_output(route.kernel, y, x)
        return poison_non_finite_rows(y, x) if quantizes and x.device.type != "cpu" else y

    def _output_shape(self, x: Tensor) -> torch.Size:
        """[..., N] for x of shape [..., K], memoised: slicing a torch.Size costs more than the lookup."""
        shape = self._output_shapes.get(x.shape)
        if shape is None:
            if len(self._output_shapes) >= _OUTPUT_SHAPES_LIMIT:
                self._output_shapes.clear()  # many sequence lengths must not grow the table forever
            shape = self._output_shapes[x.shape] = torch.Size((*x.shape[:-1], self.out_features))
        return shape

    def _bad_output(self, kernel: KernelDeclaration, y: object, x: Tensor) -> KernelExecutionError:
        found = f"{list(y.shape)} {y.dtype}" if isinstance(y, Tensor) else f"a {type(y).__name__}"
        expected = f"{[*x.shape[:-1], self.out_features]} {x.dtype}"
        return bad_output_error(kernel, found, expected, self._name(), self.scheme.name)

    @property
    def scheme(self) -> Scheme:
        return self._layout.scheme

    # -- computation ---------------------------------------------------------------------------

    def dequantize(self) -> Tensor:
        """The float32 [N, K] weight this layer encodes (exact; independent of the kernel), as
        the producer's own dequantization gives it: without an input pre-scale (see
        ``effective_weight``)."""
        return dequantize(self.weight_canonical)

    def effective_weight(self) -> Tensor:
        """The float32 [N, K] weight the layer applies: ``dequantize()`` with the input pre-scale
        (AWQ) multiplied into its columns, so that y = x @ effective_weight()^T + bias (for
        weight-only schemes; activation quantization rounds x first)."""
        return _effective_weight(self.weight_canonical)

    def forward(self, x: Tensor) -> Tensor:
        name = self.layer_name or "QuantLinear"
        if not isinstance(x, Tensor):
            raise UsageError(f"{name}: the input must be a torch.Tensor, not {type(x).__name__}")
        if x.is_nested or x.layout is not torch.strided:
            kind = "a nested tensor" if x.is_nested else f"a {str(x.layout).removeprefix('torch.')} tensor"
            raise UsageError(
                f"{name}: the input is {kind}; the layer takes a dense [..., {self.in_features}] tensor: pad the "
                "sequences into one (torch.nested.to_padded_tensor) or call x.to_dense()"
            )
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise UsageError(
                f"{name}: input of shape {list(x.shape)} has {x.shape[-1] if x.dim() else 'no'} features in "
                f"its last dim, the layer takes K={self.in_features}"
            )
        device = x.device  # read once: each read builds a torch.device (host time per call)
        device_type = device.type
        cast = _autocast_dtype(x, device_type)
        if cast is not None:  # as nn.Linear under autocast
            x = x.to(cast)
        dtype = _INPUT_DTYPE_NAMES.get(x.dtype)
        if dtype is None:
            raise UsageError(f"{name}: input dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
        wanted = self.torch_device
        if device_type != wanted.type or (wanted.index is not None and device.index != wanted.index):
            raise UsageError(
                f"{name}: the input is on {device}, the layer on {wanted}; move the input, or move the "
                f"layer (module.to(...)) or load it on the input's device (load_checkpoint(..., device=...))"
            )
        if device_type == "meta":
            raise UsageError(
                f"{name}: the layer is on the meta device, which holds no values to compute with; move it to a real "
                "device and load its tensors (load_state_dict), or load it from its checkpoint"
            )
        if torch.compiler.is_compiling():
            # one opaque operator for the graph: prepare and the kernel's code run outside it
            y: Tensor = torch.ops.qscheme.quant_linear(x, self._op_handle, self.out_features)
            return y
        route, state = self._prepared(dtype, x.numel() // self.in_features, wanted)
        if dtype != self._default_dtype and dtype not in self._routes_told:
            self._tell_route(dtype)
        # the kernel computes as it does for this dtype outside autocast (its own float ops uncast)
        with torch.autocast(device_type, enabled=False) if cast is not None else contextlib.nullcontext():
            if not torch.is_grad_enabled():  # inference: no context to enter (host time per call)
                return self._run(route, state, x, dtype)
            if x.requires_grad:
                y = _ThroughDequantized.apply(x, self, route, state, dtype)
                return y
            with torch.no_grad():
                return self._run(route, state, x, dtype)

    def _kernel_forward(self, x: Tensor) -> Tensor:
        """The kernel's output for a checked input, without gradient: what the custom op
        ``qscheme::quant_linear`` runs (``forward`` checked x and cast it for autocast)."""
        dtype = _INPUT_DTYPE_NAMES[x.dtype]
        route, state = self._prepared(dtype, x.numel() // self.in_features)
        if dtype != self._default_dtype and dtype not in self._routes_told:
            self._tell_route(dtype)
        with torch.autocast(x.device.type, enabled=False), torch.no_grad():
            return self._run(route, state, x, dtype)

    def _input_grad(self, grad_y: Tensor) -> Tensor:
        """grad_x = grad_y @ effective_weight(), in grad_y's dtype (straight through activation
        quantization); dequantized where the gradient is."""
        weight = _effective_weight(self.weight_canonical.to(grad_y.device))
        return (grad_y.to(torch.float32) @ weight).to(grad_y.dtype)

    @property
    def weight(self) -> QuantizedWeight:
        """A stand-in for ``nn.Linear.weight`` that model code can read: ``shape`` [N, K],
        ``dtype`` (the layer's activation dtype), ``device``, ``requires_grad`` (False) and
        ``size()``/``dim()``/``numel()``. It holds no values: computing with it, training it
        (``requires_grad_``, an optimizer) or writing it raises QuantizedWeightError. Use
        ``layer(x)``, ``dequantize()`` or ``effective_weight()`` instead."""
        return QuantizedWeight.of(self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"kernel={self.kernel.name}, bias={self.bias is not None}"
        )


_INPUT_DTYPE_NAMES = {dtype: normalize_dtype(dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
_OUTPUT_SHAPES_LIMIT = 256


BUFFER_PREFIX = "canonical_"
HOST_DEVICES = ("cpu", "meta")  # where the canonical buffers live


def _effective_weight(weight: CanonicalWeight) -> Tensor:
    """``dequantize(weight)`` times the input pre-scale, on the weight's device."""
    dense = dequantize(weight)
    pre_scale = weight.input_pre_scale
    return dense if pre_scale is None else dense * pre_scale.to(torch.float32)[None, :]


@dataclass(frozen=True)
class _Route:
    """One entry of the layer's plan with the kernel's code: inputs of m_min..m_max rows."""

    m_min: int
    m_max: int | None
    kernel: KernelDeclaration
    implementation: Any


def set_m_split(model: torch.nn.Module, m_split: str | int | None) -> int:
    """``QuantLinear.set_m_split`` on every QuantLinear of ``model`` (a model from
    ``apply_to_model``, the transformers integration or ``load_checkpoint``); the value is checked
    once, before any layer changes. Returns how many layers it set."""
    if m_split is not None:
        m_split_override(m_split, origin="set_m_split(m_split=...)")
    layers = [module for module in model.modules() if isinstance(module, QuantLinear)]
    for layer in layers:
        layer.set_m_split(m_split)
    return len(layers)


def _route_for(routes: tuple[_Route, ...], m: int) -> _Route:
    """The plan's route for batch size ``m`` (the plan covers every M >= 0)."""
    for route in routes:
        if m >= route.m_min and (route.m_max is None or m <= route.m_max):
            return route
    raise AssertionError(f"the plan covers no M = {m}")  # never: a plan covers every M >= 0


@dataclass(frozen=True)
class _Layout:
    """A CanonicalWeight without its tensors."""

    scheme: Scheme
    n: int
    k: int
    partitions: tuple[int, ...]


def _autocast_dtype(x: Tensor, device_type: str) -> torch.dtype | None:
    """The 16-bit dtype autocast asks for on x's device (of type ``device_type``; None when off,
    or for a non-float x)."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    if not x.is_floating_point() or x.dtype == torch.float64:
        return None  # autocast leaves float64 alone
    cast = torch.get_autocast_dtype(device_type)
    return cast if cast in (torch.bfloat16, torch.float16) else None


def _tensor_text(value: Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"


class _ThroughDequantized(torch.autograd.Function):
    """The kernel's output forward; backward, the input's gradient through the effective
    weight (straight through activation quantization). The weight and bias get none."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: QuantLinear, route: _Route, state: Any, dtype: str) -> Tensor:
        ctx.layer = layer
        with torch.no_grad():
            return layer._run(route, state, x, dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        layer: QuantLinear = ctx.layer
        # dequantized where the gradient is (a transient copy of the compact tensors moves there)
        return layer._input_grad(grad_y), None, None, None, None
