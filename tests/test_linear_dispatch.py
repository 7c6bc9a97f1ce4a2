"""QuantLinear runs the kernel it reports: per-dtype routing is visible, a kernel's failures and
wrong outputs are typed errors naming the layer, kernel, plugin and scheme, and ``kernel=`` is
checked before any tensor is read."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_fakes import builtin_scheme, isolated_plugins, layer_tensors
from qscheme_plugins.reference import REFERENCE

from qscheme.canonical import CanonicalWeight, dequantize
from qscheme.errors import QSchemeError, QuantizeError, UsageError
from qscheme.kernels.declaration import ActivationDtypes, KernelDeclaration
from qscheme.kernels.interface import KernelExecutionError
from qscheme.modules import KernelRouteWarning, QuantLinear
from qscheme.plugins import hookimpl, register_plugin

SCHEME = "compressed-tensors/W4A16"


class Dense:
    """A correct kernel: the float32 weight, a matmul in float32, the input's dtype out."""

    def prepare(self, weight: CanonicalWeight, device: torch.device) -> torch.Tensor:
        return dequantize(weight).to(device)

    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return (x.to(torch.float32) @ state.t()).to(x.dtype)


class RaisingPrepare(Dense):
    def prepare(self, weight: CanonicalWeight, device: torch.device) -> torch.Tensor:
        raise ValueError("prepare exploded")


class RaisingApply(Dense):
    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("apply exploded")


class ExitingPrepare(Dense):
    def prepare(self, weight: CanonicalWeight, device: torch.device) -> torch.Tensor:
        raise SystemExit(3)  # a plugin that calls sys.exit must not end the process silently


class TypedRaising(Dense):
    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise QuantizeError("this kernel refuses the input")


class Narrow(Dense):
    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super().apply(state, x, bias)[..., :3]


class Float32Out(Dense):
    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.to(torch.float32) @ state.t()


class ListOut(Dense):
    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return [0.0]


def _kernel(cls: type, name: str | None = None, **changes: Any) -> KernelDeclaration:
    reference = f"{__name__}:{cls.__name__}"
    changes.setdefault("priority", -5)  # below the reference kernel: used when forced (or by bf16_only)
    return replace(REFERENCE, name=name or cls.__name__.lower(), implementation=reference, **changes)


KERNELS = [
    _kernel(c) for c in (RaisingPrepare, ExitingPrepare, RaisingApply, TypedRaising, Narrow, Float32Out, ListOut, Dense)
] + [_kernel(Dense, name="bf16_only", priority=200, checks=(ActivationDtypes(("bfloat16",)),))]


class _Plugin:
    @hookimpl
    def qscheme_kernels(self) -> list[KernelDeclaration]:
        return KERNELS


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "triton,cpu_gemv")  # the reference kernel: quick on a CPU
    with isolated_plugins():
        register_plugin(_Plugin(), "dispatch-test")
        yield


def _layer(kernel: str | None = None) -> QuantLinear:
    return QuantLinear.from_tensors(SCHEME, layer_tensors(builtin_scheme(SCHEME)), kernel=kernel, layer_name="mlp.up")


def test_an_input_dtype_routed_to_another_kernel_is_visible_and_warned_once(plugin: None) -> None:
    layer = _layer()
    assert layer.kernel.name == "bf16_only" and layer.activation_dtype == "bfloat16"
    assert layer.kernel_for("bf16").name == "bf16_only" and layer.kernel_for(torch.float32).name == "reference"
    trace = layer.resolution_for("fp32").candidate("bf16_only")
    assert trace.stage == "problem" and "float32" in trace.reason
    x = torch.randn(4, layer.in_features)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x.to(torch.bfloat16))  # the reported kernel: no warning
    with pytest.warns(KernelRouteWarning) as caught:
        y = layer(x)
    message = str(caught[0].message)
    assert message.startswith(
        "mlp.up: float32 inputs run on kernel 'reference' (plugin reference), not 'bf16_only', which the layer "
        "reports for its bfloat16 inputs (bf16_only: "
    )
    assert "layer.kernel_for('float32')" in message
    torch.testing.assert_close(y, x @ layer.dequantize().t())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)  # the first time only
    with pytest.raises(UsageError, match=r"mlp\.up: activation dtype 'int8' is not supported"):
        layer.kernel_for("int8")


@pytest.mark.parametrize(
    ("kernel", "stage", "cause"),
    [
        ("raisingprepare", "prepare", ValueError("prepare exploded")),
        ("exitingprepare", "prepare", SystemExit(3)),
        ("raisingapply", "apply", RuntimeError("apply exploded")),
        ("typedraising", "apply", QuantizeError("this kernel refuses the input")),
    ],
)
@pytest.mark.parametrize("grad", [False, True])
def test_a_kernel_that_raises_is_a_typed_error_naming_layer_kernel_plugin_and_scheme(
    plugin: None, kernel: str, stage: str, cause: Exception, grad: bool
) -> None:
    layer = _layer(kernel)
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16, requires_grad=grad)
    with pytest.raises(KernelExecutionError) as caught:
        layer(x)
    error = caught.value
    assert str(error).startswith(
        f"kernel {kernel!r} (plugin dispatch-test) failed in {stage}() for layer mlp.up: "
        f"{type(cause).__name__}: {cause} (scheme {SCHEME}, bfloat16 inputs, device cpu). "
        f"Disable the kernel (QSCHEME_DISABLED_KERNELS={kernel})"
    )
    assert (error.layer, error.kernel, error.plugin, error.scheme, error.stage) == (
        "mlp.up",
        kernel,
        "dispatch-test",
        SCHEME,
        stage,
    )
    assert type(error.__cause__) is type(cause) and str(error.__cause__) == str(cause)
    # a typed error the kernel raised is still caught as one (and keeps its exit code)
    assert isinstance(error, type(cause)) is isinstance(cause, QSchemeError | RuntimeError)
    assert error.exit_code == 1


@pytest.mark.parametrize(
    ("kernel", "found"),
    [
        ("narrow", "[2, 5, 3] torch.bfloat16"),
        ("float32out", "[2, 5, 64] torch.float32"),
        ("listout", "a list"),
    ],
)
def test_a_kernel_output_of_the_wrong_shape_or_dtype_is_refused(plugin: None, kernel: str, found: str) -> None:
    layer = _layer(kernel)
    with pytest.raises(KernelExecutionError) as caught:
        layer(torch.randn(2, 5, layer.in_features, dtype=torch.bfloat16))
    assert str(caught.value).startswith(
        f"kernel {kernel!r} (plugin dispatch-test) returned {found} from apply() for layer mlp.up; expected "
        f"[2, 5, 64] torch.bfloat16 ([..., N] in the input's dtype; scheme {SCHEME})"
    )
    assert caught.value.stage == "apply" and caught.value.__cause__ is None


def test_a_correct_plugin_kernel_passes_the_output_check(plugin: None) -> None:
    layer = _layer("dense")
    x = torch.randn(3, 2, layer.in_features)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().t())


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (REFERENCE, r"kernel= takes a kernel's name \(str\), not a KernelDeclaration; e\.g\. kernel='reference'"),
        (RaisingApply(), r"kernel= takes a kernel's name \(str\), not a RaisingApply"),
        ("", "an empty kernel name"),
        ("refernce", r"unknown kernel 'refernce' was forced\. Did you mean 'reference'\?"),
    ],
)
def test_a_bad_kernel_argument_is_refused_before_any_tensor_is_read(
    kernel: object, message: str, tmp_path: Path
) -> None:
    from qscheme.checkpoint.load import load_checkpoint

    with isolated_plugins():
        # the tensors (none) and the folder (missing) would fail too: the kernel is checked first
        with pytest.raises(UsageError, match=rf"^QuantLinear\.from_tensors\(kernel=.*\): {message}"):
            QuantLinear.from_tensors(SCHEME, {}, kernel=kernel)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=rf"^load_checkpoint\(kernel=.*\): {message}"):
            load_checkpoint(tmp_path / "missing", kernel=kernel)  # type: ignore[arg-type]
        weight = _layer().weight_canonical
        with pytest.raises(UsageError, match=rf"^QuantLinear\(kernel=.*\): {message}"):
            QuantLinear(weight, kernel=kernel)  # type: ignore[arg-type]
