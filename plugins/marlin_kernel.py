"""The ``marlin`` kernel: vLLM's Marlin GEMM on weights repacked by vLLM's repack op.

Binding to vLLM happens when the registry instantiates ``MarlinKernel`` (the first time a layer
resolves to ``marlin``): a vLLM outside ``VLLM_VERSIONS``, one whose ``_custom_ops`` fails to
import, or a build without the compiled Marlin ops (a CPU build) raises ImportError with the
reason, which the registry records so that the resolver rejects ``marlin`` with it and the other
kernels are unaffected.

prepare (for bfloat16 and float16 activations at once, from the canonical tensors in host
memory; only the repacked weight and the small per-dtype scales go to the device):
``qscheme_plugins.marlin_layout.marlin_operands`` pads, packs and re-encodes the canonical
tensors as vLLM's prepare helpers do; the packed weight is repacked into Marlin tiles by vLLM's
``gptq_marlin_repack`` on the device. Fused NVFP4 partitions whose global scales differ get one
GEMM each (Marlin takes one global scale per GEMM). A workspace of ``4 * SM count`` int32 zeros
per device and CUDA stream is shared by every layer, as vLLM's ``marlin_make_workspace_new(device,
4)`` sizes it (Marlin resets its locks after each call, so calls in order on one stream may share it).

apply: the AWQ pre-scale (in the activation dtype), the input zero-padded to the padded K,
``marlin_gemm`` with the scheme's scalar type, the bias (padded and permuted to Marlin's column
order), float32 reduction as vLLM's default, and the output sliced to N.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from qscheme_plugins.marlin import VLLM_VERSIONS
from qscheme_plugins.marlin_layout import MarlinOperands, marlin_operands, marlin_permute_bias
from torch import Tensor
from torch.nn import functional

from qscheme.canonical import CanonicalWeight
from qscheme.errors import UsageError
from qscheme.kernels.versions import satisfies

# The compiled ops (torch.ops._C) the kernel calls through vllm._custom_ops.
MARLIN_OPS: tuple[str, ...] = ("gptq_marlin_repack", "marlin_gemm")
# Thread blocks per SM the workspace is sized for (vLLM's MARLIN_MAX_BLOCKS_PER_SM).
BLOCKS_PER_SM = 4
# The activation dtypes Marlin takes; both are prepared at once (their scales differ, the
# repacked weight is shared), so no call prepares anything.
ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


def compiled_op_names(custom_ops: Any) -> set[str]:
    """The Marlin ops this vLLM build has compiled (the registry of ``torch.ops._C``)."""
    namespace = torch.ops._C
    return {name for name in MARLIN_OPS if hasattr(namespace, name)}


def bind_vllm() -> tuple[Any, Any, str]:
    """(vllm._custom_ops, vllm.scalar_type.scalar_types, vLLM's version); ImportError naming the cause."""
    try:
        vllm = importlib.import_module("vllm")
    except Exception as error:
        raise ImportError(f"vllm does not import: {type(error).__name__}: {error}") from error
    version = str(getattr(vllm, "__version__", "unknown"))
    if not satisfies(version, VLLM_VERSIONS):
        raise ImportError(
            f"needs vllm {VLLM_VERSIONS}; vllm {version} is installed (Marlin's ops change signature across "
            "vLLM releases; install a supported vLLM)"
        )
    try:
        custom_ops = importlib.import_module("vllm._custom_ops")
        scalar_types = importlib.import_module("vllm.scalar_type").scalar_types
    except Exception as error:
        raise ImportError(
            f"vllm {version}: vllm._custom_ops does not import: {type(error).__name__}: {error}"
        ) from error
    missing = [name for name in MARLIN_OPS if name not in compiled_op_names(custom_ops)]
    missing += [name for name in MARLIN_OPS if not callable(getattr(custom_ops, name, None)) and name not in missing]
    if missing:
        raise ImportError(
            f"vllm {version}'s compiled Marlin ops are not loaded ({', '.join(missing)}): a CPU build, or its "
            "compiled library failed to load; install a CUDA build of vLLM to run Marlin"
        )
    return custom_ops, scalar_types, version


def _multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 1  # only a stub vLLM runs "Marlin" off a CUDA device (tests)


@dataclass
class MarlinGemm:
    """One Marlin GEMM: a fused layer's partitions that share a global scale (all of them, unless
    fused NVFP4 partitions' global scales differ). ``weight`` is the repacked tile layout (the
    same for every activation dtype); ``operands`` holds the scales, zero points and global scale
    per activation dtype (the packed input weight is not kept)."""

    start: int
    n: int
    weight: Tensor
    operands: dict[torch.dtype, MarlinOperands] = field(default_factory=dict)


@dataclass
class MarlinState:
    """A prepared layer: its GEMMs (in output order), pre-scale, workspace and sizes."""

    gemms: list[MarlinGemm]
    pre_scale: Tensor | None
    workspace: Tensor
    device: torch.device
    n: int
    k: int


def _global_scales_differ(weight: CanonicalWeight) -> bool:
    scale = weight.global_scale
    if scale is None or scale.numel() <= 1:
        return False
    flat = scale.reshape(-1)
    return not bool(torch.all(flat == flat[0]))


def _partition(weight: CanonicalWeight, index: int, start: int, size: int) -> CanonicalWeight:
    """One fused partition of a layer with group or channel scales, as a layer of its own."""
    rows = slice(start, start + size)
    global_scale = weight.global_scale
    assert global_scale is not None
    return replace(
        weight,
        n=size,
        codes=weight.codes[rows],
        scale=weight.scale[rows],
        global_scale=global_scale.reshape(-1)[index : index + 1],
        global_scale_divisor=None,
        zero_point=None if weight.zero_point is None else weight.zero_point[rows],
        partitions=(size,),
        input_scale=None,
        input_global_scale=None,
        input_global_scale_divisor=None,
    )


def gemm_parts(weight: CanonicalWeight) -> list[tuple[int, CanonicalWeight]]:
    """(first output column, layer) of each GEMM: one per partition where the global scales of
    fused partitions differ, else the whole layer."""
    if not _global_scales_differ(weight):
        return [(0, weight)]
    granularity = weight.scheme.weight.scale.granularity
    if granularity not in ("group", "channel"):
        raise UsageError(
            f"scheme {weight.scheme.name}: Marlin splits fused partitions with different global scales only "
            f"for group or channel scales, not {granularity} ones"
        )
    parts = []
    start = 0
    for index, size in enumerate(weight.partitions):
        parts.append((start, _partition(weight, index, start, size)))
        start += size
    return parts


def _with_zero_points(weight: CanonicalWeight) -> CanonicalWeight:
    """uint4 codes without zero points run as Marlin's ``uint4`` with zero points 0."""
    if weight.scheme.weight.format != "uint4" or weight.zero_point is not None:
        return weight
    rows = weight.scale.shape[0] if weight.scale.ndim == 2 else 1
    columns = weight.scale.shape[1] if weight.scale.ndim == 2 else 1
    zeros = torch.zeros(rows, columns, dtype=torch.int16, device=weight.scale.device)
    return replace(weight, zero_point=zeros)


class MarlinKernel:
    """KernelImplementation of ``marlin`` on vLLM's ops (instantiating it binds vLLM)."""

    def __init__(self) -> None:
        self.ops, self.scalar_types, self.vllm_version = bind_vllm()
        self._workspaces: dict[tuple[torch.device, int], Tensor] = {}
        self._lock = threading.Lock()

    def workspace(self, device: torch.device) -> Tensor:
        """The Marlin workspace (lock counters) of the device's current CUDA stream, made once and
        shared by every layer on that stream (as vLLM keys it: two streams never share locks)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device, stream)
        with self._lock:
            found = self._workspaces.get(key)
            if found is None:
                size = _multiprocessor_count(device) * BLOCKS_PER_SM
                found = torch.zeros(size, dtype=torch.int32, device=device)
                self._workspaces[key] = found
            return found

    def _gemm_for(self, part: CanonicalWeight, start: int, device: torch.device) -> MarlinGemm:
        """The GEMM of one part: its operands for both activation dtypes (computed from the
        canonical tensors in host memory), the weight repacked once on the device."""
        gemm = MarlinGemm(start, part.n, torch.empty(0, dtype=torch.int32, device=device))
        for dtype in ACTIVATION_DTYPES:
            operands = marlin_operands(part, dtype)
            if gemm.weight.numel() == 0:
                gemm.weight = self.ops.gptq_marlin_repack(
                    b_q_weight=operands.packed_weight.to(device),
                    size_k=operands.padded_k,
                    size_n=operands.padded_n,
                    num_bits=operands.bits,
                    is_a_8bit=False,
                )
            gemm.operands[dtype] = replace(
                operands,
                packed_weight=operands.packed_weight[:0],  # the repacked tiles are gemm.weight
                scales=operands.scales.to(device),
                zero_points=None if operands.zero_points is None else operands.zero_points.to(device),
                global_scale=None if operands.global_scale is None else operands.global_scale.to(device),
            )
        return gemm

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> MarlinState:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        weight = _with_zero_points(weight)
        gemms = [self._gemm_for(part, start, device) for start, part in gemm_parts(weight)]
        pre_scale = weight.input_pre_scale
        return MarlinState(
            gemms=gemms,
            pre_scale=None if pre_scale is None else pre_scale.to(device=device, dtype=torch.float32),
            workspace=self.workspace(device),
            device=device,
            n=weight.n,
            k=weight.k,
        )

    def apply(self, state: MarlinState, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[-1] != state.k:
            raise UsageError(f"input has {x.shape[-1]} features in its last dim; the layer takes K={state.k}")
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise UsageError(f"Marlin takes bfloat16 or float16 activations, not {x.dtype}")
        rows = x.reshape(-1, state.k)
        if state.pre_scale is not None:
            rows = rows * state.pre_scale.to(x.dtype)
        if rows.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], state.n)
        pieces = [self._gemm(state, gemm, gemm.operands[x.dtype], rows, bias) for gemm in state.gemms]
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return y.reshape(*x.shape[:-1], state.n)

    def _gemm(
        self, state: MarlinState, gemm: MarlinGemm, operands: MarlinOperands, rows: Tensor, bias: Tensor | None
    ) -> Tensor:
        padded = rows if operands.padded_k == operands.k else functional.pad(rows, (0, operands.padded_k - operands.k))
        marlin_bias = None
        if bias is not None:
            part = bias[gemm.start : gemm.start + gemm.n].to(rows.dtype)
            marlin_bias = marlin_permute_bias(functional.pad(part, (0, operands.padded_n - operands.n)))
        y = self.ops.marlin_gemm(
            a=padded.contiguous(),
            c=None,
            b_q_weight=gemm.weight,
            b_bias=marlin_bias,
            b_scales=operands.scales,
            a_scales=None,
            global_scale=operands.global_scale,
            b_zeros=operands.zero_points,
            workspace=self.workspace(state.device),
            b_q_type=getattr(self.scalar_types, operands.scalar_type),
            size_m=padded.shape[0],
            size_n=operands.padded_n,
            size_k=operands.padded_k,
            use_atomic_add=False,
            use_fp32_reduce=True,
            is_zp_float=False,
        )
        return y if operands.padded_n == operands.n else y[:, : operands.n].contiguous()
