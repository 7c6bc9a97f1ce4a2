"""api_checks: misuse of the public API is a typed error naming the argument, before any tensor is read."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from qscheme.canonical import canonicalize
from qscheme.catalog import load_scheme, require_scheme_argument
from qscheme.dequantize import dequantize_weight
from qscheme.errors import QuantizeError, UsageError
from qscheme.modules import QuantLinear
from qscheme.quantize import quantize_weight

# torch warns that sparse CSR, nested and quantized tensors are beta, prototype or deprecated
pytestmark = pytest.mark.filterwarnings(r"ignore:.*(beta state|prototype stage|are deprecated):UserWarning")

SCHEME = "compressed-tensors/NVFP4A16"
SOURCE = f"scheme {SCHEME}"


@functools.cache
def _tensors() -> dict[str, Tensor]:
    return quantize_weight(torch.randn(8, 64), SCHEME)


def _with(name: object, value: object) -> dict[Any, Any]:
    tensors: dict[Any, Any] = dict(_tensors())
    tensors[name] = value
    return tensors


def _dequantize(tensors: object) -> object:
    return dequantize_weight(tensors, SCHEME)  # type: ignore[arg-type]


def _from_tensors(tensors: object) -> object:
    return QuantLinear.from_tensors(SCHEME, tensors)  # type: ignore[arg-type]


def _canonicalize(tensors: object) -> object:
    return canonicalize(load_scheme(SCHEME), tensors)  # type: ignore[arg-type]


ENTRIES: list[Callable[[object], object]] = [_dequantize, _from_tensors, _canonicalize]
ENTRY_IDS = ["dequantize_weight", "from_tensors", "canonicalize"]


def _scale() -> Tensor:
    return _tensors()["weight_scale"]


def _quantized_scale() -> Tensor:
    return torch.quantize_per_tensor(torch.ones(8, 4), 0.1, 0, torch.qint8)


def _nested_scale() -> Tensor:
    return torch.nested.nested_tensor([torch.ones(4), torch.ones(4)])


# (case id, tensors to pass, the message after "scheme ...: ")
MAPPING_CASES: list[tuple[str, Callable[[], object], str]] = [
    (
        "not a mapping",
        lambda: list(_tensors().items()),
        "tensors must be a mapping of checkpoint names to tensors (e.g. {'weight_packed': ...}), not list",
    ),
    (
        "int key",
        lambda: _with(3, _scale()),
        "tensor names must be the checkpoint names the scheme declares (str, e.g. 'weight_packed'), found 3 (int); "
        "key the tensors by name",
    ),
    (
        "list value",
        lambda: _with("weight_scale", [1.0]),
        "'weight_scale' must be a torch.Tensor, not list; pass the layer's checkpoint tensors keyed by name",
    ),
    (
        "numpy value",
        lambda: _with("weight_scale", np.ones((8, 4), dtype=np.float32)),
        "'weight_scale' must be a torch.Tensor, not ndarray; pass the layer's checkpoint tensors keyed by name",
    ),
    (
        "sparse coo",
        lambda: _with("weight_packed", _tensors()["weight_packed"].to_sparse()),
        "'weight_packed' is a sparse tensor (sparse_coo); checkpoint tensors are dense: pass value.to_dense()",
    ),
    (
        "sparse csr",
        lambda: _with("weight_global_scale", torch.ones(1, 1).to_sparse_csr()),
        "'weight_global_scale' is a sparse tensor (sparse_csr); checkpoint tensors are dense: pass value.to_dense()",
    ),
    (
        "meta scale",
        lambda: _with("weight_scale", _scale().to("meta")),
        "'weight_scale' is a meta tensor, which has a shape but no values; materialise it first (load the real "
        "weights, e.g. module.to_empty(device='cpu') then load_state_dict)",
    ),
    (
        "meta global scale",
        lambda: _with("weight_global_scale", torch.empty(1, device="meta")),
        "'weight_global_scale' is a meta tensor, which has a shape but no values",
    ),
    (
        "nested",
        lambda: _with("weight_scale", _nested_scale()),
        "'weight_scale' is a nested tensor, which has no single [rows, columns] shape; pass the checkpoint's dense "
        "tensor",
    ),
    (
        "quantized",
        lambda: _with("weight_scale", _quantized_scale()),
        "'weight_scale' is a torch quantized tensor (qint8); pass the tensor as the checkpoint stores it",
    ),
]


@pytest.mark.parametrize("entry", ENTRIES, ids=ENTRY_IDS)
@pytest.mark.parametrize(("make", "expected"), [case[1:] for case in MAPPING_CASES], ids=[c[0] for c in MAPPING_CASES])
def test_a_tensors_mapping_that_is_not_plain_named_tensors_is_refused(
    entry: Callable[[object], object], make: Callable[[], object], expected: str
) -> None:
    with pytest.raises(QuantizeError) as info:
        entry(make())
    assert str(info.value).startswith(f"{SOURCE}: {expected}")


@pytest.mark.parametrize("entry", ENTRIES, ids=ENTRY_IDS)
@pytest.mark.parametrize("shape", [(), (2, 16, 32)], ids=["0-d", "3-d"])
def test_a_weight_of_the_wrong_rank_is_refused(entry: Callable[[object], object], shape: tuple[int, ...]) -> None:
    with pytest.raises(QuantizeError, match=rf"(?s){SOURCE}: .*'weight_packed'.*2-D.*\[N, K/2\], found shape") as info:
        entry(_with("weight_packed", torch.zeros(shape, dtype=torch.uint8)))
    assert str(list(shape)).replace(" ", "") in str(info.value).replace(" ", "")


# --- quantize_weight ------------------------------------------------------------------------------

WEIGHT = torch.randn(8, 64)
QUANTIZE_META = (
    "is a meta tensor, which has a shape but no values; meta tensors cannot be quantized: materialise it first"
)
WEIGHT_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("list", lambda: [[1.0]], "the weight must be a torch.Tensor, not list; pass the layer's [N, K] float weight"),
    ("sparse coo", lambda: WEIGHT.to_sparse(), "the weight is a sparse tensor (sparse_coo)"),
    ("sparse csr", lambda: WEIGHT.to_sparse_csr(), "the weight is a sparse tensor (sparse_csr)"),
    ("nested", lambda: torch.nested.nested_tensor([WEIGHT[0], WEIGHT[1]]), "the weight is a nested tensor"),
    ("meta", lambda: WEIGHT.to("meta"), f"the weight {QUANTIZE_META}"),
    (
        "quantized",
        lambda: torch.quantize_per_tensor(WEIGHT, 0.1, 0, torch.qint8),
        "the weight is a torch quantized tensor (qint8)",
    ),
]


@pytest.mark.parametrize(("make", "expected"), [case[1:] for case in WEIGHT_CASES], ids=[c[0] for c in WEIGHT_CASES])
def test_a_weight_that_is_not_a_plain_tensor_is_refused(make: Callable[[], object], expected: str) -> None:
    with pytest.raises(QuantizeError) as info:
        quantize_weight(make(), SCHEME)  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{SOURCE}: {expected}")


GIVEN_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("list", lambda: [100.0], "the given weight_global_scale must be a torch.Tensor, not list"),
    ("sparse", lambda: torch.tensor([100.0]).to_sparse(), "the given weight_global_scale is a sparse tensor"),
    ("meta", lambda: torch.empty(1, device="meta"), f"the given weight_global_scale {QUANTIZE_META}"),
    ("nested", lambda: torch.nested.nested_tensor([torch.ones(1)]), "the given weight_global_scale is a nested"),
]


@pytest.mark.parametrize(("make", "expected"), [case[1:] for case in GIVEN_CASES], ids=[c[0] for c in GIVEN_CASES])
def test_a_given_scale_that_is_not_a_plain_tensor_is_refused(make: Callable[[], object], expected: str) -> None:
    with pytest.raises(QuantizeError) as info:
        quantize_weight(WEIGHT, SCHEME, weight_global_scale=make())  # type: ignore[arg-type]
    assert str(info.value).startswith(f"{SOURCE}: {expected}")


# --- the scheme argument ------------------------------------------------------------------------

BAD_SCHEMES = [3, None, 2.5, b"compressed-tensors/NVFP4", ["compressed-tensors/NVFP4"], {"name": "x"}]


@pytest.mark.parametrize("scheme", BAD_SCHEMES, ids=lambda value: type(value).__name__)
@pytest.mark.parametrize(
    ("caller", "call"),
    [
        ("dequantize_weight", lambda scheme: dequantize_weight(_tensors(), scheme)),
        ("quantize_weight", lambda scheme: quantize_weight(WEIGHT, scheme)),
        ("load_scheme", load_scheme),
        ("QuantLinear.from_tensors", lambda scheme: QuantLinear.from_tensors(scheme, _tensors())),
    ],
    ids=["dequantize_weight", "quantize_weight", "load_scheme", "from_tensors"],
)
def test_a_scheme_argument_of_the_wrong_type_is_a_usage_error(
    scheme: object, caller: str, call: Callable[[object], object]
) -> None:
    with pytest.raises(UsageError) as info:
        call(scheme)
    assert str(info.value) == (
        f"{caller}: scheme must be a Scheme, a catalog name (str) or a descriptor file path, not "
        f"{type(scheme).__name__} ({scheme!r}); e.g. 'compressed-tensors/NVFP4' (`qscheme schemes` lists them)"
    )
    assert info.value.exit_code == 2


@pytest.mark.parametrize("path", [123, None, ["a.yaml"]], ids=lambda value: type(value).__name__)
def test_parse_scheme_file_takes_a_path_only(path: object) -> None:
    from qscheme.descriptor import parse_scheme_file

    with pytest.raises(
        UsageError, match=rf"parse_scheme_file: path must be a str or os.PathLike .*not {type(path).__name__}"
    ):
        parse_scheme_file(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("extra_dirs", [123, "my-schemes", b"my-schemes"], ids=lambda value: type(value).__name__)
def test_load_catalog_takes_a_list_of_folders(extra_dirs: object) -> None:
    from qscheme.catalog import load_catalog

    with pytest.raises(
        UsageError, match=rf"load_catalog: extra_dirs must be a list of folders, not {type(extra_dirs).__name__}"
    ):
        load_catalog(extra_dirs)  # type: ignore[arg-type]


def test_a_long_scheme_argument_is_shortened_in_the_message() -> None:
    with pytest.raises(UsageError, match=r"not list \(\[0, 1, 2, .{30,50}\.\.\.\); e\.g\. "):
        require_scheme_argument(list(range(100)), "dequantize_weight")


def test_schemes_names_and_paths_pass() -> None:
    from pathlib import Path

    from qscheme.catalog import builtin_scheme_dir

    for scheme in (SCHEME, load_scheme(SCHEME), builtin_scheme_dir() / "compressed-tensors" / "NVFP4A16.yaml"):
        require_scheme_argument(scheme, "dequantize_weight")
        assert torch.equal(dequantize_weight(_tensors(), scheme), dequantize_weight(_tensors(), SCHEME))
    assert isinstance(builtin_scheme_dir(), Path)


# --- QuantLinear's own arguments and inputs -------------------------------------------------------


@pytest.mark.parametrize("weight", [None, {"weight": 1}, "x"], ids=lambda value: type(value).__name__)
def test_quantlinear_takes_a_canonical_weight(weight: object) -> None:
    for build in (QuantLinear, QuantLinear.from_canonical):
        with pytest.raises(UsageError, match=rf"QuantLinear takes a CanonicalWeight, not {type(weight).__name__}; "):
            build(weight)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: torch.ones(8, device="meta"), "bias is a meta tensor"),
        (lambda: torch.ones(8).to_sparse(), "bias is a sparse tensor (sparse_coo)"),
        (lambda: torch.ones(8, dtype=torch.int32), "bias has dtype torch.int32; pass a floating-point bias"),
    ],
    ids=["meta", "sparse", "int"],
)
def test_a_bias_that_is_not_a_dense_float_tensor_is_refused(make: Callable[[], Tensor], expected: str) -> None:
    with pytest.raises((QuantizeError, UsageError)) as info:
        QuantLinear.from_tensors(SCHEME, _tensors(), bias=make(), layer_name="mlp.up")
    assert expected in str(info.value)


def test_tensors_that_require_grad_give_a_frozen_layer() -> None:
    """A scale or bias handed over as a Parameter: the layer keeps detached values and computes
    the same as with plain tensors (the kernel's in-place ops must not meet autograd)."""
    tensors = {
        name: torch.nn.Parameter(value.clone(), requires_grad=value.is_floating_point())
        for name, value in _tensors().items()
    }
    bias = torch.nn.Parameter(torch.randn(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor does any check convert a grad-requiring tensor to a number
        layer = QuantLinear.from_tensors(SCHEME, tensors, bias=bias)
    plain = QuantLinear.from_tensors(SCHEME, _tensors(), bias=bias.detach())
    assert not any(buffer.requires_grad for buffer in layer.buffers())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), plain(x))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: torch.nested.nested_tensor([torch.randn(2, 64), torch.randn(3, 64)]), "the input is a nested tensor"),
        (lambda: torch.randn(2, 64).to_sparse(), "the input is a sparse_coo tensor"),
    ],
    ids=["nested", "sparse"],
)
def test_an_input_that_is_not_dense_is_a_usage_error(make: Callable[[], Tensor], expected: str) -> None:
    layer = QuantLinear.from_tensors(SCHEME, _tensors(), layer_name="mlp.up")
    with pytest.raises(UsageError, match=rf"mlp\.up: {expected}; the layer takes a dense \[\.\.\., 64\] tensor"):
        layer(make())


# --- load_checkpoint(schemes=...) -----------------------------------------------------------------

FIXTURE = "tests/fixtures/modelopt/nvfp4"


@pytest.mark.parametrize("schemes", ["modelopt/NVFP4", ["modelopt/NVFP4"], ("modelopt/NVFP4",)], ids=repr)
def test_load_checkpoint_takes_one_scheme_or_several_by_name(schemes: object) -> None:
    from pathlib import Path

    from qscheme.checkpoint import load_checkpoint

    folder = Path(__file__).resolve().parents[1] / FIXTURE
    checkpoint = load_checkpoint(folder, schemes=schemes)  # type: ignore[arg-type]
    assert {layer.scheme.name for layer in checkpoint.modules.values()} == {"modelopt/NVFP4"}


@pytest.mark.parametrize(
    ("schemes", "expected"),
    [
        (3, r"pass scheme names, descriptor paths or Scheme objects \(a list, or one\), not int"),
        (b"modelopt/NVFP4", "not bytes"),
        ({"modelopt/NVFP4": 1}, "not dict"),
        ([None], r"load_checkpoint\(schemes=\.\.\.\): scheme must be a Scheme, a catalog name \(str\) .* not NoneType"),
        ([], r"load_checkpoint\(schemes=\[\]\): no scheme to detect with"),
    ],
    ids=["int", "bytes", "dict", "None-inside", "empty"],
)
def test_load_checkpoint_refuses_schemes_of_the_wrong_type(schemes: object, expected: str) -> None:
    from qscheme.checkpoint import load_checkpoint

    with pytest.raises(UsageError, match=expected):
        load_checkpoint("/nonexistent-folder-checked-later", schemes=schemes)  # type: ignore[arg-type]


# --- odd API paths: flags, names, degrees, devices, fuse= (issue 24) ----------------------------

FIXTURE_FOLDER = Path(__file__).resolve().parents[1] / FIXTURE


def _tiny_model() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(FIXTURE_FOLDER))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _snapshot(model: torch.nn.Module) -> dict[str, object]:
    return {name: type(module).__name__ for name, module in model.named_modules()}


@pytest.mark.parametrize("strict", ["no", "False", 0, 1, None])
@pytest.mark.parametrize("parallel", [False, True], ids=["apply_to_model", "apply_to_model_tp"])
def test_strict_takes_a_bool_only(strict: object, parallel: bool) -> None:
    """strict="no" used to count as true; any non-bool is now refused before the model changes."""
    from qscheme.checkpoint import apply_to_model
    from qscheme.parallel import apply_to_model_tp

    model = _tiny_model()
    before = _snapshot(model)
    pattern = rf"apply_to_model: strict must be True or False, not {re.escape(repr(strict))}"
    with pytest.raises(UsageError, match=pattern):
        if parallel:
            apply_to_model_tp(model, FIXTURE_FOLDER, 0, 1, strict=strict)  # type: ignore[arg-type]
        else:
            apply_to_model(model, FIXTURE_FOLDER, strict=strict)  # type: ignore[arg-type]
    assert _snapshot(model) == before


@pytest.mark.parametrize("progress", ["no", "yes", 0, 2.0])
def test_progress_takes_a_bool_or_none(progress: object) -> None:
    from qscheme.checkpoint import load_checkpoint
    from qscheme.parallel import load_checkpoint_tp

    expected = rf"progress must be True, False or None \(automatic\), not {re.escape(repr(progress))}"
    with pytest.raises(UsageError, match=expected):
        load_checkpoint(FIXTURE_FOLDER, progress=progress)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=expected):
        load_checkpoint_tp(FIXTURE_FOLDER, 0, 2, progress=progress)  # type: ignore[arg-type]


@pytest.mark.parametrize("layer_name", [5, b"up", ["up"]], ids=repr)
def test_layer_name_takes_a_str_or_none(layer_name: object) -> None:
    with pytest.raises(UsageError, match=r"QuantLinear: layer_name must be a str .* or None, not"):
        QuantLinear.from_tensors(SCHEME, _tensors(), layer_name=layer_name)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"tp_rank": -1, "tp_size": 2}, r"tp_rank must be in 0\.\.1 for tp_size=2, not -1"),
        ({"tp_rank": 2, "tp_size": 2}, r"tp_rank must be in 0\.\.1 for tp_size=2, not 2"),
        ({"tp_rank": "0", "tp_size": 2}, r"tp_rank must be an int, not '0' \(str\)"),
        ({"tp_rank": 0, "tp_size": 0}, r"tp_size must be >= 1, not 0"),
        ({"tp_rank": 0, "tp_size": 2.0}, r"tp_size must be an int, not 2\.0 \(float\)"),
        ({"tp_rank": 0, "tp_size": True}, r"tp_size must be an int, not True \(bool\)"),
        ({"device": "cpux"}, r"load_checkpoint\(device='cpux'\): not a device"),
        ({"device": "cuda:abc"}, r"load_checkpoint\(device='cuda:abc'\): not a device"),
        ({"device": ""}, r"load_checkpoint\(device=''\): not a device"),
        ({"device": -1}, r"load_checkpoint\(device=-1\): a device is 'cpu', 'cuda', 'cuda:N' or a torch\.device"),
        ({"fuse": "qkv_proj"}, r"fuse must map each fused module name to its member module names"),
        ({"fuse": {"qkv_proj": "q_proj,k_proj"}}, r"fuse\['qkv_proj'\] must list the member module names"),
        ({"fuse": {"qkv_proj": [1, 2]}}, r"fuse\['qkv_proj'\]: member 1 must be a module's own name"),
        ({"fuse": {1: ["q_proj", "k_proj"]}}, r"fuse: fused name 1 must be a non-empty module name"),
        ({"fuse_policy": 1}, r"fuse_policy must be one of per_partition, rescale, requantize, refuse"),
        ({"tp_rank": 0, "tp_size": 2, "tp_plan": ["q_proj"]}, r"tp_plan must map module-name patterns"),
        ({"tp_rank": 0, "tp_size": 2, "tp_plan": {"q_proj": "diagonal"}}, r"'diagonal' is not a parallel style"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_load_checkpoint_odd_arguments_are_usage_errors(options: dict[str, object], expected: str) -> None:
    from qscheme.checkpoint import load_checkpoint

    with pytest.raises(UsageError, match=expected):
        load_checkpoint(FIXTURE_FOLDER, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"tp_rank": -1, "tp_size": 2}, r"tp_rank must be in 0\.\.1 for tp_size=2, not -1"),
        ({"tp_rank": 5, "tp_size": 2}, r"tp_rank must be in 0\.\.1 for tp_size=2, not 5"),
        ({"tp_rank": 0, "tp_size": "2"}, r"tp_size must be an int, not '2' \(str\)"),
        ({"tp_size": 2}, r"apply_to_model: pass tp_rank and tp_size together"),
        ({"device": "gpu"}, r"apply_to_model\(device='gpu'\): not a device"),
        ({"fuse": {"qkv_proj": "q_proj"}}, r"fuse\['qkv_proj'\] must list the member module names"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_apply_to_model_odd_arguments_are_usage_errors(options: dict[str, object], expected: str) -> None:
    from qscheme.checkpoint import apply_to_model

    model = _tiny_model()
    before = _snapshot(model)
    with pytest.raises(UsageError, match=expected):
        apply_to_model(model, FIXTURE_FOLDER, **options)  # type: ignore[arg-type]
    assert _snapshot(model) == before


# --- the custom ops called directly (torch.ops.qscheme.*) ------------------------------------------


def test_the_custom_ops_check_their_arguments_against_the_layer() -> None:
    layer = QuantLinear.from_tensors(SCHEME, _tensors(), layer_name="mlp.up", activation_dtype="float32")
    handle = layer._op_handle
    ops = torch.ops.qscheme
    cases = [
        (lambda: ops.quant_linear(torch.ones(2, 64, dtype=torch.int64), handle, 8), "a torch.int64 tensor"),
        (lambda: ops.quant_linear(torch.randn(2, 60), handle, 8), r"shape \[2, 60\]; its last dim must be .* K = 64"),
        (lambda: ops.quant_linear(torch.randn(2, 64), handle, 7), "out_features=7, but the layer's is 8"),
        (lambda: ops.quant_linear_input_grad(torch.randn(2, 7), handle, 64), r"last dim must be the layer's N = 8"),
        (lambda: ops.quant_linear_input_grad(torch.ones(2, 8, dtype=torch.int32), handle, 64), "torch.int32"),
        (lambda: ops.quant_linear_input_grad(torch.randn(2, 8), handle, 63), "in_features=63, but the layer's is 64"),
        (lambda: ops.quant_linear(torch.randn(2, 64), 10**9, 8), "names no live QuantLinear"),
    ]
    for call, expected in cases:
        with pytest.raises(UsageError, match=expected):
            call()
    x = torch.randn(2, 64)
    assert torch.equal(ops.quant_linear(x, handle, 8), layer(x))  # the checked call still computes


def test_a_kernel_raising_a_torch_error_under_compile_is_a_kernel_execution_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qscheme.kernels.interface import KernelExecutionError

    layer = QuantLinear.from_tensors(
        SCHEME, _tensors(), layer_name="mlp.up", activation_dtype="float32", kernel="reference"
    )
    route, _ = layer._prepared("float32")  # the plan's route for M = 1: its kernel and code
    implementation = route.implementation

    def broken(state: object, x: Tensor, bias: Tensor | None) -> Tensor:
        return torch.mm(x, torch.ones(3, 3))  # a torch RuntimeError from inside the kernel's code

    monkeypatch.setattr(implementation, "apply", broken)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with pytest.raises(KernelExecutionError, match=r"kernel 'reference' .* failed in apply\(\) for layer mlp\.up"):
        compiled(torch.randn(2, 64))
