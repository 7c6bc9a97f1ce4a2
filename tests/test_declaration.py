"""Kernel declarations as data: capability ranges, problem checks, validation, the built-ins."""

from __future__ import annotations

import pytest
from kernel_fakes import BUILTIN_DECLARATIONS, BUILTIN_KERNELS_BY_PRIORITY
from qscheme_plugins.native_fp4 import BLACKWELL

from qscheme.kernels.declaration import (
    ANY_DEVICE,
    ActivationDtypes,
    ActivationSupport,
    CapabilityRange,
    DeviceSupport,
    KernelDeclaration,
    ProblemCheck,
    ShapeAlignment,
    Supports,
    describe_capabilities,
)
from qscheme.kernels.problem import Problem, normalize_dtype


def test_capability_ranges_express_families() -> None:
    datacenter, consumer = BLACKWELL
    assert [datacenter.contains(c) for c in [(9, 0), (10, 0), (10, 3), (11, 0), (12, 0)]] == [
        False,
        True,
        True,
        False,
        False,
    ]
    assert consumer.contains((12, 1)) and not consumer.contains((12, 2))
    assert describe_capabilities(BLACKWELL) == "compute capability 10.0-10.3 or 12.0-12.1"
    assert str(CapabilityRange((7, 5))) == "7.5 or newer" and str(CapabilityRange((8, 9), (8, 9))) == "8.9"
    with pytest.raises(ValueError, match="is empty"):
        CapabilityRange((10, 3), (10, 0))
    with pytest.raises(ValueError, match=r"\(major, minor\)"):
        CapabilityRange((8,))  # type: ignore[arg-type]


def test_no_builtin_reason_or_description_reads_like_a_toolkit_version() -> None:
    for declaration in BUILTIN_DECLARATIONS:
        assert "CUDA>=" not in declaration.describe_devices() and ">=" not in declaration.describe_devices()


def test_shape_alignment_returns_reason_and_hint() -> None:
    marlin = ShapeAlignment(((64, 128), (128, 64)))
    assert marlin.check(Problem(4096, 4096)).ok
    assert marlin.check(Problem(128, 64)).ok
    result = marlin.check(Problem(4096, 4000))
    assert not result.ok
    assert (
        result.reason == "needs N % 64 == 0 and K % 128 == 0, or N % 128 == 0 and K % 64 == 0; layer has N=4096, K=4000"
    )
    assert result.hint == "pad the layer to N=4096, K=4096"
    assert isinstance(marlin, ProblemCheck)
    with pytest.raises(ValueError):
        ShapeAlignment(((0, 128),))


def test_activation_dtype_check() -> None:
    check = ActivationDtypes(("bfloat16", "float16"))
    assert check.check(Problem(64, 64, "fp16")).ok
    result = check.check(Problem(64, 64, "fp32"))
    assert (result.ok, result.reason, result.hint) == (
        False,
        "takes bfloat16 or float16 activations; layer has float32",
        "cast the inputs to bfloat16",
    )


def test_problem_normalizes_dtypes_and_rejects_nonsense() -> None:
    assert Problem(8, 8, "bf16").activation_dtype == "bfloat16"
    assert normalize_dtype("torch.float16") == "float16"
    with pytest.raises(ValueError, match="activation dtype 'int8'"):
        Problem(8, 8, "int8")
    with pytest.raises(ValueError, match="N >= 1"):
        Problem(0, 8)
    assert Problem(8, 8, layer="a") == Problem(8, 8, layer="b")  # the layer name is only for messages


def _declaration(**changes: object) -> KernelDeclaration:
    fields: dict[str, object] = {
        "name": "ok",
        "provider": "test",
        "priority": 1,
        "supports": (Supports(("int4",)),),
        "devices": (DeviceSupport(ANY_DEVICE),),
        "implementation": "package.module:Kernel",
    }
    fields.update(changes)
    return KernelDeclaration(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "has space"}, "kernel name 'has space' is invalid"),
        ({"priority": "high"}, "priority must be an int"),
        ({"supports": ()}, "supports is empty"),
        ({"devices": (DeviceSupport("cuda"), "cpu")}, "devices must be a tuple of DeviceSupport"),
        ({"implementation": "no_colon"}, "implementation must be 'module:attribute'"),
        ({"checks": (object(),)}, "checks must be a tuple of objects with check"),
    ],
)
def test_malformed_declarations_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _declaration(**changes)


def test_supports_validate_their_vocabulary() -> None:
    with pytest.raises(ValueError, match="weight families \\['int5'\\]"):
        Supports(("int5",))
    with pytest.raises(ValueError, match="activation family 'fp6'"):
        ActivationSupport("fp6")
    with pytest.raises(ValueError, match="device type 'tpu'"):
        DeviceSupport("tpu")
    assert ActivationSupport("fp8", "group", 128, dynamic=True).describe() == "fp8 dynamic per group of 128"
    assert ActivationSupport("fp8", "tensor", dynamic=False).describe() == "fp8 static per tensor"


@pytest.mark.parametrize(
    ("weight_formats", "message"),
    [
        (("e3m3",), r"weight_formats \['e3m3'\] are not among e2m1, e4m3, e5m2, int2, int3, int4, uint4, int8, uint8"),
        (("e4m3", "float8"), r"weight_formats \['float8'\] are not among"),
        ("e4m3", "weight_formats must be a tuple of str, not 'e4m3'"),
        ((8,), "weight_formats must be a tuple of str"),
    ],
)
def test_supports_refuse_unknown_weight_element_formats(weight_formats: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Supports(("fp8",), weight_formats=weight_formats)  # type: ignore[arg-type]


def test_supports_weight_formats_are_optional_and_described() -> None:
    assert Supports(("fp8",)).weight_formats == ()  # any element format of the family
    e4m3 = Supports(("fp8",), weight_formats=("e4m3",), granularities=("tensor",))
    assert e4m3.describe() == "fp8 weights (e4m3, tensor) x none (16-bit)"
    assert (
        Supports(("int4",), weight_formats=("int4", "uint4")).describe() == "int4 weights (int4/uint4) x none (16-bit)"
    )


def test_supports_refuse_family_names_and_foreign_weight_element_formats() -> None:
    with pytest.raises(ValueError, match=r"weight_formats \['fp8'\] are not among e2m1, e4m3"):
        Supports(("fp8",), weight_formats=("fp8",))
    with pytest.raises(ValueError, match=r"weight_formats \['int4'\] are not element formats of the families fp8"):
        Supports(("fp8",), weight_formats=("int4",))
    assert Supports(("nvfp4", "fp4"), weight_formats=("e2m1",)).weight_formats == ("e2m1",)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"formats": "e4m3"}, "activation formats must be a tuple of str, not 'e4m3'"),
        ({"formats": (4,)}, "activation formats must be a tuple of str"),
        ({"formats": ("e4m3fn",)}, r"activation formats \['e4m3fn'\] are not fp8 element formats \(e4m3, e5m2\)"),
        ({"formats": ("int8",)}, r"activation formats \['int8'\] are not fp8 element formats"),
        ({"scale_formats": ["fp32"]}, "activation scale_formats must be a tuple of str"),
        ({"scale_formats": ("float32",)}, r"activation scale_formats \['float32'\] are not among e4m3, e8m0, fp32"),
    ],
)
def test_activation_formats_are_validated(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ActivationSupport("fp8", "token", dynamic=True, **changes)  # type: ignore[arg-type]


def test_activation_formats_are_optional_and_described_on_request() -> None:
    with pytest.raises(ValueError, match=r"family 'none' \(16-bit inputs\) takes no formats or scale_formats"):
        ActivationSupport("none", formats=("e4m3",))
    with pytest.raises(ValueError, match=r"activation formats \['e4m3'\] are not nvfp4 element formats \(e2m1\)"):
        ActivationSupport("nvfp4", formats=("e4m3",))
    support = ActivationSupport("fp8", "token", dynamic=True, formats=("e4m3",), scale_formats=("fp32", "float"))
    assert support.describe() == "fp8 dynamic per token"  # unchanged where formats are not the point
    assert support.describe(formats=True) == "fp8 dynamic per token (e4m3, fp32/float scales)"
    assert ActivationSupport("int8", formats=("int8", "uint8")).describe(formats=True) == "int8 (int8/uint8)"
    assert ActivationSupport("fp8", scale_formats=("bf16",)).describe(formats=True) == "fp8 (bf16 scales)"
    assert ActivationSupport("fp8", "tensor").describe(formats=True) == "fp8 per tensor"
    assert ActivationSupport("none").describe(formats=True) == "none (16-bit)"


def test_activation_vocabulary_matches_the_descriptor_parser() -> None:
    from qscheme.descriptor import parse
    from qscheme.descriptor.model import weight_family
    from qscheme.kernels.declaration import ACTIVATION_FORMATS, ACTIVATION_SCALE_FORMATS, FAMILY_FORMATS

    assert ACTIVATION_FORMATS == parse.ACTIVATION_FORMATS
    assert ACTIVATION_SCALE_FORMATS == parse.SCALE_FORMATS
    # Every (element, scale format) pair a descriptor can declare falls in a family whose formats list the element.
    for element in ACTIVATION_FORMATS:
        for scale_format in ACTIVATION_SCALE_FORMATS:
            assert element in FAMILY_FORMATS[weight_family(element, scale_format)]


def test_builtin_declarations_serialize() -> None:
    for declaration in BUILTIN_DECLARATIONS:
        data = declaration.as_json()
        assert {"name", "provider", "priority", "supports", "devices"} <= set(data)
    # priority first (highest first), then the name
    assert [d.name for d in sorted(BUILTIN_DECLARATIONS, key=KernelDeclaration.sort_key)] == BUILTIN_KERNELS_BY_PRIORITY
