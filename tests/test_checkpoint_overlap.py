"""Detect rules that claim the same producer config (qscheme.checkpoint.overlap), checked
against what the loader's matchers do with the witness config."""

from __future__ import annotations

from pathlib import Path

import pytest

from qscheme.catalog import load_catalog
from qscheme.checkpoint.overlap import overlaps
from qscheme.descriptor import Scheme, parse_scheme_text
from qscheme.errors import CheckpointError
from qscheme.producers.compressed_tensors.config import CompressedTensorsConfig, ConfigGroup
from qscheme.producers.compressed_tensors.detect import match_config_group
from qscheme.producers.modelopt.detect import match_modelopt_algo

BUILTIN = Path(__file__).resolve().parents[1] / "schemes"
TRITON_SCHEMES = Path(__file__).resolve().parent / "data" / "triton_schemes"


def variant(path: Path, name: str, *changes: tuple[str, str]) -> Scheme:
    text = path.read_text(encoding="utf-8")
    original = text.split("\n", 1)[0]
    assert original.startswith("name: ")
    text = text.replace(original, f"name: {name}", 1)
    for old, new in changes:
        assert old in text, old
        text = text.replace(old, new, 1)
    return parse_scheme_text(text, f"{name}.yaml")


def config_for(group: ConfigGroup) -> CompressedTensorsConfig:
    return CompressedTensorsConfig(
        file="config.json",
        groups=(group,),
        ignore=(),
        format=group.format,
        version=None,
        quantization_status=None,
        kv_cache_scheme=None,
    )


def test_no_two_builtin_or_test_schemes_overlap() -> None:
    schemes = list(load_catalog(include_plugins=False).schemes.values())
    schemes += [parse_scheme_text(p.read_text(encoding="utf-8"), str(p)) for p in sorted(TRITON_SCHEMES.glob("*.yaml"))]
    assert len(schemes) >= 22
    for scheme in schemes:
        assert overlaps(scheme, schemes) == [], scheme.name


def test_a_copy_of_a_compressed_tensors_rule_overlaps_and_the_loader_refuses_its_witness() -> None:
    builtin = load_catalog(include_plugins=False).schemes["compressed-tensors/NVFP4"]
    copy = variant(BUILTIN / "compressed-tensors" / "NVFP4.yaml", "mine/NVFP4")
    found = overlaps(copy, [builtin])
    assert [(o.producer, o.first, o.second) for o in found] == [
        ("compressed-tensors", "mine/NVFP4", "compressed-tensors/NVFP4")
    ]
    assert "format 'nvfp4-pack-quantized'" in found[0].witness and '"strategy": "tensor_group"' in found[0].witness
    group = found[0].group
    assert group is not None
    assert match_config_group(group, config_for(group), [builtin], "m") is builtin
    assert match_config_group(group, config_for(group), [copy], "m") is copy
    with pytest.raises(CheckpointError, match="matches several schemes"):
        match_config_group(group, config_for(group), [builtin, copy], "m")


def test_a_less_specific_rule_overlaps_a_more_specific_one() -> None:
    builtin = load_catalog(include_plugins=False).schemes["compressed-tensors/W4A16"]
    # drop an argument: the rule now also matches what the built-in matches
    loose = variant(BUILTIN / "compressed-tensors" / "W4A16.yaml", "mine/loose", (", symmetric: true}", "}"))
    assert "symmetric" not in loose.detect.compressed_tensors.weights  # type: ignore[union-attr]
    found = overlaps(loose, [builtin])
    assert [o.second for o in found] == ["compressed-tensors/W4A16"]
    assert [o.second for o in overlaps(builtin, [loose])] == ["mine/loose"]
    group = found[0].group
    assert group is not None
    with pytest.raises(CheckpointError, match="matches several schemes"):
        match_config_group(group, config_for(group), [builtin, loose], "m")


@pytest.mark.parametrize(
    "change",
    [
        ("format: nvfp4-pack-quantized", "format: mine-quantized"),  # no format in common
        ("group_size: 16, symmetric: true}", "group_size: 16, symmetric: false}"),  # a listed argument differs
        ("dynamic: local", "dynamic: false"),  # static inputs
    ],
)
def test_rules_that_differ_somewhere_do_not_overlap(change: tuple[str, str]) -> None:
    builtin = load_catalog(include_plugins=False).schemes["compressed-tensors/NVFP4"]
    other = variant(BUILTIN / "compressed-tensors" / "NVFP4.yaml", "mine/NVFP4", change)
    assert overlaps(other, [builtin]) == [] and overlaps(builtin, [other]) == []


def test_weight_only_and_activation_rules_do_not_overlap() -> None:
    catalog = load_catalog(include_plugins=False).schemes
    w4a4, w4a16 = catalog["compressed-tensors/NVFP4"], catalog["compressed-tensors/NVFP4A16"]
    assert w4a4.detect.compressed_tensors.weights == w4a16.detect.compressed_tensors.weights  # type: ignore[union-attr]
    assert overlaps(w4a4, [w4a16]) == [] and overlaps(w4a16, [w4a4]) == []


@pytest.mark.parametrize(
    ("builtin_size", "copy_size", "ambiguous"),
    [(None, None, True), (16, 16, True), (16, 32, True), (16, None, False), (None, 16, False)],
)
def test_modelopt_rules_overlap_as_the_loader_decides(
    builtin_size: int | None, copy_size: int | None, ambiguous: bool
) -> None:
    def nvfp4(name: str, size: int | None) -> Scheme:
        extra = f"\n    group_size: {size}" if size is not None else ""
        return variant(BUILTIN / "modelopt" / "NVFP4.yaml", name, ("quant_algo: NVFP4", f"quant_algo: NVFP4{extra}"))

    first, second = nvfp4("one/NVFP4", builtin_size), nvfp4("two/NVFP4", copy_size)
    found = overlaps(first, [second])
    assert bool(found) is ambiguous
    if found:
        assert found[0].producer == "modelopt" and found[0].witness.startswith("quant_algo 'NVFP4'")
    # the loader refuses some config as ambiguous exactly when the overlap is reported
    refused = []
    for config_size in (None, 16, 32):
        try:
            match_modelopt_algo("nvfp4", config_size, [first, second], "f", "")
        except CheckpointError as exc:
            if "matches several schemes" in str(exc):
                refused.append(config_size)
    assert bool(refused) is ambiguous, refused
