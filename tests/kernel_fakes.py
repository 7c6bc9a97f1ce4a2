"""Fake device facts and declarations for tests of the pure resolver (no GPU, no plugins)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from qscheme_plugins.cpu_gemv import CPU_GEMV
from qscheme_plugins.cpu_gemv_blocks import CPU_GEMM_BLOCKS, CPU_GEMV_BLOCKS, CPU_GEMV_BLOCKS_BF16
from qscheme_plugins.cpu_int8_gemm import CPU_INT8_GEMM
from qscheme_plugins.dequant_gemm import DEQUANT_GEMM
from qscheme_plugins.marlin import MARLIN, MARLIN_MXFP4
from qscheme_plugins.native_fp4 import NATIVE_FP4, NATIVE_MXFP4
from qscheme_plugins.native_fp8 import NATIVE_FP8, NATIVE_FP8_BLOCK, NATIVE_FP8_CPU, NATIVE_FP8_ROWWISE
from qscheme_plugins.reference import REFERENCE
from qscheme_plugins.tinygemm import TINYGEMM, TINYGEMM_CPU
from qscheme_plugins.triton_declaration import TRITON

if TYPE_CHECKING:
    from torch import Tensor

from qscheme.catalog import load_catalog
from qscheme.descriptor import Scheme
from qscheme.kernels.declaration import ActivationDtypes, KernelDeclaration, ShapeAlignment
from qscheme.kernels.devices import SIMULATED_DEVICES, DeviceFacts

FAKE_IMPLEMENTATION_MODULE = "fake_kernels"
# The vLLM release fake devices have installed when the "vllm" module is importable on them.
FAKE_VLLM_VERSION = "0.33.0"


def implemented(declaration: KernelDeclaration) -> KernelDeclaration:
    """The declaration as if its code were installed (declared-only kernels get a fake one)."""
    reference = declaration.implementation or f"{FAKE_IMPLEMENTATION_MODULE}:{declaration.name}"
    return replace(declaration, implementation=reference, plugin=declaration.name)


# Every kernel the built-in plugins declare (tests/test_plugins.py checks this against the plugins).
BUILTIN_DECLARATIONS: tuple[KernelDeclaration, ...] = (
    REFERENCE,
    TRITON,
    MARLIN,
    MARLIN_MXFP4,
    NATIVE_FP4,
    NATIVE_MXFP4,
    NATIVE_FP8,
    NATIVE_FP8_ROWWISE,
    NATIVE_FP8_BLOCK,
    NATIVE_FP8_CPU,
    TINYGEMM,
    TINYGEMM_CPU,
    DEQUANT_GEMM,
    CPU_GEMV,
    CPU_GEMV_BLOCKS,
    CPU_GEMV_BLOCKS_BF16,
    CPU_GEMM_BLOCKS,
    CPU_INT8_GEMM,
)
# The built-in kernels in the resolver's order: highest priority first, then by name (written
# out, so that a priority change shows in the tests that compare a trace's order with it).
BUILTIN_KERNELS_BY_PRIORITY: list[str] = [
    "native_fp4",
    "native_mxfp4",
    "native_fp8",
    "native_fp8_block",
    "native_fp8_rowwise",
    "marlin",
    "marlin_mxfp4",
    "tinygemm",
    "cpu_int8_gemm",
    "cpu_gemm_blocks",
    "cpu_gemv_blocks_bf16",
    "tinygemm_cpu",
    "cpu_gemv_blocks",
    "dequant_gemm",
    "triton",
    "cpu_gemv",
    "reference",
    "native_fp8_cpu",
]
AS_IF_IMPLEMENTED: tuple[KernelDeclaration, ...] = tuple(implemented(d) for d in BUILTIN_DECLARATIONS)
# A test-local, stricter Marlin (provider "test"), with the checks Marlin had before its
# implementation: tile-aligned shapes only, one global scale per layer, no AWQ pre-scale. The real
# declaration pads any shape, runs partitions with different scales one GEMM each and multiplies
# the pre-scale in, so those problem-stage checks are exercised on this one (it replaces
# ``marlin`` in ``STRICT_MARLIN_SET``).
STRICT_MARLIN = implemented(
    replace(
        MARLIN,
        name="strict_marlin",
        provider="test",
        supports=tuple(replace(s, per_partition_scales=False, input_pre_scale=False) for s in MARLIN.supports),
        checks=(ShapeAlignment(((64, 128), (128, 64))), ActivationDtypes(("bfloat16", "float16"))),
        implementation=None,
        requires_modules=(),
        requires_versions=(),
    )
)
STRICT_MARLIN_SET = (*(d for d in AS_IF_IMPLEMENTED if d.name != "marlin"), STRICT_MARLIN)
# A torch with everything any built-in kernel needs (fake devices have it unless told otherwise).
ALL_FEATURES = frozenset({"float4_e2m1fn_x2", "float8_e4m3fn", "_scaled_mm"}) | {
    feature for declaration in BUILTIN_DECLARATIONS for feature in declaration.torch_features
}


def all_modules(declarations: tuple[KernelDeclaration, ...] = AS_IF_IMPLEMENTED) -> frozenset[str]:
    """Every module the declarations need, and the fake module test-local kernels are "implemented" in."""
    modules = {m for d in declarations for m in d.requires_modules}
    modules |= {d.implementation_module for d in declarations if d.implementation_module}
    return frozenset(modules | {FAKE_IMPLEMENTATION_MODULE})


def fake_device(
    name: str,
    modules: frozenset[str] | None = None,
    environment: tuple[tuple[str, str], ...] = (),
    features: frozenset[str] = ALL_FEATURES,
) -> DeviceFacts:
    """Facts for "cpu", "rocm" or a simulated "smXY", with fixed versions (stable snapshots).

    When "vllm" is among the modules, its distribution is installed too, at the release
    Marlin's declaration supports (``FAKE_VLLM_VERSION``)."""
    present = all_modules() if modules is None else modules
    distributions = (("vllm", FAKE_VLLM_VERSION),) if "vllm" in present else ()
    if name in ("cpu", "rocm"):
        return DeviceFacts(
            name, name, None, "2.13.0", "3.9.0", False, features, present, environment, distributions=distributions
        )
    capability, family = SIMULATED_DEVICES[name]
    return DeviceFacts(
        "cuda",
        f"simulated {name}, {family}",
        capability,
        "2.13.0",
        "3.9.0",
        True,
        features,
        present,
        environment,
        distributions=distributions,
    )


_catalog = None


def builtin_scheme(name: str) -> Scheme:
    global _catalog
    if _catalog is None:
        _catalog = load_catalog(include_plugins=False)
    return _catalog.get(name)


def builtin_schemes() -> list[Scheme]:
    builtin_scheme("compressed-tensors/W4A16")
    assert _catalog is not None
    return [s for s in _catalog if s.source == "builtin"]


@contextmanager
def isolated_plugins(environ: dict[str, str] | None = None) -> Iterator[object]:
    """Fresh process-wide plugins (built-ins only unless ``environ`` says otherwise)."""
    from qscheme.kernels import registry
    from qscheme.plugins import load_plugins, reset_plugins

    env = {"QSCHEME_DISABLE_PLUGIN_AUTOLOAD": "1"} if environ is None else environ
    plugins = load_plugins(environ=env)
    reset_plugins(plugins)
    registry.reset()
    try:
        yield plugins
    finally:
        reset_plugins(None)
        registry.reset()


def input_scales(scheme: Scheme, input_amax: float) -> dict[str, Tensor]:
    """Static activation scales (and an AWQ pre-scale) for ``quantize_weight``, by stored name."""
    import torch

    given: dict[str, Tensor] = {}
    activation = scheme.activation
    if activation is not None and activation.scale is not None:
        multiplier = input_amax / 448.0
        value = multiplier if activation.scale.stored == "multiplier" else 1.0 / multiplier
        given[activation.scale.tensor.name] = torch.tensor([value], dtype=torch.float32)
    if activation is not None and activation.global_scale is not None:
        multiplier = input_amax / 2688.0
        value = multiplier if activation.global_scale.stored == "multiplier" else 2688.0 / input_amax
        given[activation.global_scale.tensor.name] = torch.tensor([value], dtype=torch.float32)
    return given


def layer_tensors(
    scheme: Scheme, n: int = 64, k: int = 256, seed: int = 0, input_amax: float = 4.0, pre_scale: bool = True
) -> dict[str, Tensor]:
    """A random layer quantized into ``scheme``'s checkpoint tensors (with static input scales)."""
    import torch

    from qscheme.quantize import quantize_weight

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    given = input_scales(scheme, input_amax)
    if pre_scale and scheme.input_pre_scale is not None:
        given[scheme.input_pre_scale.name] = torch.rand(k, generator=generator) + 0.5
    return dict(quantize_weight(weight, scheme, **given))


# A YAML-only scheme whose activations (e5m2, per token, bf16 scales) no built-in kernel takes.
E5M2_PER_TOKEN = """
name: test/fp8-e5m2-per-token
weight:
  format: e4m3
  tensor: {name: weight, dtype: float8_e4m3fn, shape: [N, K]}
  scale:
    granularity: channel
    format: fp32
    stored: multiplier
    tensor: {name: weight_scale, dtype: float32, shape: [N, 1]}
activation:
  format: e5m2
  granularity: token
  dynamic: true
  scale_format: bf16
"""
