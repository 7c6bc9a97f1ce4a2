"""qscheme.modules: the torch modules a user holds sit below the loader; their old paths still work."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from import_walk import chains
from import_walk import closure as _closure
from import_walk import imports as _imports
from import_walk import module_file as _module_file
from kernel_fakes import builtin_scheme, isolated_plugins, layer_tensors

import qscheme
import qscheme.experts
import qscheme.linear
import qscheme.modules
import qscheme.modules.ops
import qscheme.ops
from qscheme.modules import ExpertsSpec, QuantLinear

# What the modules a user holds must never import, directly or through another module, at module
# level or inside a function: the loader and everything built on it.
ABOVE = ("qscheme.checkpoint", "qscheme.parallel", "qscheme.writing", "qscheme.transformers")
# Below the loader too: the modules, and the two functions of the public API that build on them.
BELOW = ("qscheme.modules", "qscheme.tensor_checks", "qscheme.dequantize")


def _below_modules() -> list[str]:
    names = []
    for top in BELOW:
        path = _module_file(top)
        assert path is not None, top
        names.append(top)
        if path.name == "__init__.py":
            names += [f"{top}.{child.stem}" for child in sorted(path.parent.glob("*.py")) if child.stem != "__init__"]
    return names


def test_the_modules_package_imports_nothing_of_the_loader() -> None:
    start = _below_modules()
    assert {"qscheme.modules.linear", "qscheme.modules.experts", "qscheme.modules.ops"} <= set(start)
    reached = _closure(start)
    above = sorted(name for name in reached if name.startswith(ABOVE))
    assert not above, "the modules a user holds reach the loader:\n" + chains(reached, above)


def test_the_closure_sees_function_level_imports(tmp_path: Path) -> None:
    """The walker finds an import inside a function (what the test above relies on)."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from qscheme.checkpoint.load import load_checkpoint\n")
    assert "qscheme.checkpoint.load" in _imports(source)


def test_old_paths_are_the_same_objects() -> None:
    assert qscheme.linear.QuantLinear is qscheme.modules.QuantLinear is qscheme.QuantLinear
    assert qscheme.linear.QuantizedWeightError is qscheme.modules.QuantizedWeightError
    assert qscheme.linear.KernelRouteWarning is qscheme.modules.KernelRouteWarning
    assert qscheme.linear.checked_device is qscheme.modules.checked_device
    assert qscheme.linear.problem_for is qscheme.modules.problem_for
    assert qscheme.experts.QuantExperts is qscheme.modules.QuantExperts
    assert qscheme.experts.find_expert_modules is qscheme.modules.find_expert_modules
    assert qscheme.ops.layer_for is qscheme.modules.layer_for
    assert qscheme.QuantLinear.__module__ == "qscheme.modules.linear"


def test_the_custom_ops_are_registered_once_under_their_names() -> None:
    assert qscheme.ops.quant_linear is qscheme.modules.ops.quant_linear
    assert qscheme.ops.quant_linear_input_grad is qscheme.modules.ops.quant_linear_input_grad
    assert torch.ops.qscheme.quant_linear.default.name() == "qscheme::quant_linear"
    assert torch.ops.qscheme.quant_linear_input_grad.default.name() == "qscheme::quant_linear_input_grad"


@pytest.fixture
def builtin_kernels() -> Iterator[None]:
    with isolated_plugins():
        yield


def test_a_layer_pickled_under_the_old_module_path_loads(
    builtin_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pickles written before the move name ``qscheme.linear.QuantLinear`` and ``qscheme.linear._Layout``."""
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "triton,tinygemm_cpu")
    scheme = builtin_scheme("compressed-tensors/W4A16")
    layer = QuantLinear.from_tensors(scheme, layer_tensors(scheme, n=32, k=128), layer_name="layers.0.up_proj")
    data = pickle.dumps(layer, protocol=2)  # protocol 2 names classes as text: "module\nname\n"
    assert b"qscheme.modules.linear\n_Layout\n" in data
    old = data.replace(b"qscheme.modules.linear\n", b"qscheme.linear\n")
    assert b"qscheme.modules.linear" not in old
    loaded = pickle.loads(old)
    assert type(loaded) is QuantLinear and loaded.layer_name == "layers.0.up_proj"
    x = torch.randn(3, 128)
    torch.testing.assert_close(loaded(x), layer(x), rtol=0, atol=0)


def test_an_experts_spec_pickled_under_the_old_module_path_loads() -> None:
    spec = ExpertsSpec("model.layers.0.mlp.experts", "Qwen3MoeExperts", 4, 64, 32)
    old = pickle.dumps(spec, protocol=2).replace(b"qscheme.modules.experts\n", b"qscheme.experts\n")
    assert pickle.loads(old) == spec
