"""Fused modules (q/k/v -> qkv_proj, gate/up -> gate_up_proj) whose members' scales differ.

The members come from checkpoints written by compressed-tensors (one global scale per module,
so q/k/v differ) and by ModelOpt. For each policy the fused module is compared with the
concatenation of the separately loaded members.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    FUSE,
    copy_checkpoint,
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file, save_file

from qscheme.checkpoint import load_checkpoint
from qscheme.checkpoint.fuse import effective_block_scales, partition_scalars
from qscheme.checkpoint.load import choose_fuse_policy
from qscheme.checkpoint.plan import FuseGroup, plan_checkpoint
from qscheme.errors import CheckpointError, UsageError

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
QKV = (f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj")


def _input(k: int, rows: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, rows, k, generator=torch.Generator().manual_seed(seed))


def _members_output(separate: dict[str, torch.nn.Module], names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([separate[name](x) for name in names], dim=-1)


@pytest.fixture(scope="module")
def nvfp4a16() -> tuple[dict[str, torch.nn.Module], object]:
    folder = ct_checkpoint("NVFP4A16")
    separate = load_checkpoint(folder, kernel="reference", activation_dtype="float32")
    return dict(separate.items()), folder


def test_members_really_have_different_global_scales(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    separate, _ = nvfp4a16
    scales = [float(partition_scalars(separate[name].weight_canonical)[0]) for name in QKV]
    assert len(set(scales)) == 3


def test_per_partition_is_exact(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    separate, folder = nvfp4a16
    fused = load_checkpoint(
        folder, fuse=FUSE, fuse_policy="per_partition", kernel="reference", activation_dtype="float32"
    )
    layer = fused[f"{ATTN}.qkv_proj"]
    assert layer.weight_canonical.partitions == (128, 64, 64)
    assert layer.weight_canonical.global_scale.shape == (3,)
    expected = torch.cat([separate[name].dequantize() for name in QKV])
    assert torch.equal(layer.dequantize(), expected)
    x = _input(128)
    assert torch.equal(layer(x), _members_output(separate, QKV, x))
    report = {r.name: r for r in fused.report.layers}[f"{ATTN}.qkv_proj"]
    assert report.fuse is not None and report.fuse.policy == "per_partition" and report.fuse.scales_differ
    assert report.members == QKV


def test_default_policy_is_per_partition_when_the_kernel_takes_it(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    _, folder = nvfp4a16
    fused = load_checkpoint(folder, fuse=FUSE, kernel="reference")
    report = {r.name: r for r in fused.report.layers}[f"{ATTN}.qkv_proj"]
    assert report.fuse is not None and report.fuse.policy == "per_partition"
    assert report.fuse_reason == "kernel reference takes one scale per partition"
    assert "fused model.layers.0.self_attn.qkv_proj = " in fused.report.render()


def test_rescale_is_exact_up_to_e4m3_rounding_and_reports_the_change(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    separate, folder = nvfp4a16
    fused = load_checkpoint(folder, fuse=FUSE, fuse_policy="rescale", kernel="reference", activation_dtype="float32")
    layer = fused[f"{ATTN}.qkv_proj"]
    weight = layer.weight_canonical
    assert bool((weight.global_scale == weight.global_scale[0]).all())  # one shared global scale
    report = {r.name: r for r in fused.report.layers}[f"{ATTN}.qkv_proj"]
    assert report.fuse is not None and report.fuse.policy == "rescale"
    change = report.fuse.max_relative_change
    assert change is not None and 0 < change <= 2**-4  # e4m3: 3 mantissa bits
    before = torch.cat([effective_block_scales(separate[name].weight_canonical) for name in QKV])
    after = effective_block_scales(weight)
    nonzero = before != 0
    relative = ((after - before).abs() / before.abs())[nonzero]
    assert float(relative.max()) <= 2**-4 + 1e-6
    # the partition whose global scale is the shared one is unchanged, bit for bit
    top = int(torch.argmax(torch.stack([partition_scalars(separate[n].weight_canonical)[0] for n in QKV])))
    rows = [0, 128, 192, 256]
    assert torch.equal(layer.dequantize()[rows[top] : rows[top + 1]], separate[QKV[top]].dequantize())
    x = _input(128)
    expected = _members_output(separate, QKV, x)
    error = float((layer(x) - expected).abs().max() / expected.abs().max())
    assert error < 2**-4


def test_refuse_raises_naming_members_and_scales(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    _, folder = nvfp4a16
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder, fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, fuse_policy="refuse")
    message = str(caught.value)
    assert f"cannot fuse {ATTN}.qkv_proj: the members' scales differ ({ATTN}.q_proj=" in message
    assert "the policy is 'refuse'" in message


def test_requantize_does_not_apply_to_nvfp4(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    _, folder = nvfp4a16
    with pytest.raises(CheckpointError, match="'requantize' re-encodes FP8 weights with per-tensor scales"):
        load_checkpoint(folder, fuse=FUSE, fuse_policy="requantize", kernel="reference")


def test_policy_per_fused_module(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    _, folder = nvfp4a16
    fused = load_checkpoint(
        folder, fuse=FUSE, fuse_policy={"qkv_proj": "rescale", "gate_up_proj": "per_partition"}, kernel="reference"
    )
    policies = {r.name: r.fuse.policy for r in fused.report.layers if r.fuse is not None}
    assert policies == {f"{ATTN}.qkv_proj": "rescale", f"{MLP}.gate_up_proj": "per_partition"}


def test_fallback_when_no_kernel_takes_per_partition_scales(nvfp4a16, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    separate, _ = nvfp4a16
    members = [separate[name].weight_canonical for name in QKV]
    scheme = members[0].scheme
    policy, reason = choose_fuse_policy("qkv", scheme, members, torch.device("cpu"), None, "bfloat16", None)
    assert policy == "per_partition"
    from qscheme.kernels.registry import declarations

    per_partition = [d.name for d in declarations() if any(s.per_partition_scales for s in d.supports)]
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", ",".join(per_partition))
    policy, reason = choose_fuse_policy("qkv", scheme, members, torch.device("cpu"), None, "bfloat16", None)
    assert (policy, reason) == (
        "rescale",
        "no kernel on cpu takes per-partition scales; scheme compressed-tensors/NVFP4A16 falls back to rescale",
    )


def test_activation_quantized_nvfp4_per_partition_equals_concatenation() -> None:
    folder = ct_checkpoint("NVFP4")
    separate = load_checkpoint(folder, kernel="reference", activation_dtype="float32")
    fused = load_checkpoint(folder, fuse=FUSE, kernel="reference", activation_dtype="float32")
    x = _input(128) * 0.5
    for name, members in ((f"{ATTN}.qkv_proj", QKV), (f"{MLP}.gate_up_proj", (f"{MLP}.gate_proj", f"{MLP}.up_proj"))):
        assert torch.equal(fused[name](x), _members_output(dict(separate.items()), members, x))


def test_fp8_per_tensor_scales_per_partition_and_requantize() -> None:
    folder = modelopt_fixture("fp8")  # ModelOpt's FP8 export does not unify q/k/v weight scales
    separate = load_checkpoint(folder, kernel="reference", activation_dtype="float32")
    exact = load_checkpoint(
        folder, fuse=FUSE, fuse_policy="per_partition", kernel="reference", activation_dtype="float32"
    )
    lossy = load_checkpoint(folder, fuse=FUSE, fuse_policy="requantize", kernel="reference", activation_dtype="float32")
    x = _input(128)
    members = _members_output(dict(separate.items()), QKV, x)
    assert torch.equal(exact[f"{ATTN}.qkv_proj"](x), members)
    layer = lossy[f"{ATTN}.qkv_proj"]
    assert bool((layer.weight_canonical.scale == layer.weight_canonical.scale[0]).all())
    report = {r.name: r for r in lossy.report.layers}[f"{ATTN}.qkv_proj"]
    assert report.fuse is not None and report.fuse.policy == "requantize"
    assert report.fuse.max_relative_change is not None and 0 < report.fuse.max_relative_change < 2**-3
    error = float((layer(x) - members).abs().max() / members.abs().max())
    assert 0 < error < 2**-4


def test_equal_scales_fuse_as_shared() -> None:
    fused = load_checkpoint(
        modelopt_fixture("nvfp4"), fuse=FUSE, kernel="reference"
    )  # ModelOpt unifies NVFP4 scales at export
    policies = {r.name: r.fuse.policy for r in fused.report.layers if r.fuse is not None}
    assert set(policies.values()) == {"shared"}


def test_block_scales_that_straddle_partitions_are_refused() -> None:
    with pytest.raises(CheckpointError, match=r"k_proj has N=64, not a multiple of the 128-row scale blocks"):
        load_checkpoint(
            ct_checkpoint("FP8_BLOCK"), fuse={"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, kernel="reference"
        )


def test_fuse_members_must_all_be_quantized() -> None:
    with pytest.raises(CheckpointError, match="lm_head is not a quantized module"):
        load_checkpoint(ct_checkpoint("NVFP4A16"), fuse={"odd": ["q_proj", "lm_head"]}, kernel="reference")


def test_a_fused_name_that_is_already_a_module_is_refused() -> None:
    folder = ct_checkpoint("NVFP4A16")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder, fuse={"o_proj": ["q_proj", "k_proj", "v_proj"]}, kernel="reference")
    assert str(caught.value) == (
        f"cannot fuse {', '.join(QKV)} as {ATTN}.o_proj: the checkpoint already has {ATTN}.o_proj, a quantized "
        "module that is not one of the members; choose another fused name than 'o_proj' in fuse="
    )
    with pytest.raises(CheckpointError, match=rf"already has {MLP}\.down_proj, an unquantized \(ignored\) module"):
        load_checkpoint(modelopt_fixture("nvfp4_exclude"), fuse={"down_proj": ["gate_proj", "up_proj"]})
    # a fused module may take the name of one of its own members
    fused = load_checkpoint(folder, fuse={"q_proj": ["q_proj", "k_proj", "v_proj"]}, kernel="reference")
    assert fused[f"{ATTN}.q_proj"].out_features == 256 and f"{ATTN}.k_proj" not in fused


def test_plan_layer_names_are_unique() -> None:
    plan = plan_checkpoint(ct_checkpoint("NVFP4A16"))
    clashing = replace(plan, fuse_groups=(FuseGroup(name=f"{ATTN}.o_proj", members=QKV),))
    with pytest.raises(CheckpointError, match=rf"two layers would be named {ATTN}\.o_proj"):
        clashing.layers()


@pytest.mark.parametrize(
    ("fuse", "error"),
    [
        (["q_proj", "k_proj"], "fuse must map each fused module name to its member module names"),
        ({"": ["q_proj", "k_proj"]}, "fused name '' must be a non-empty module name without dots"),
        ({"attn.qkv": ["q_proj", "k_proj"]}, "fused name 'attn.qkv' must be a non-empty module name without dots"),
        ({"qkv_proj": "q_proj"}, r"fuse\['qkv_proj'\] must list the member module names"),
        ({"qkv_proj": []}, r"fuse\['qkv_proj'\] must list the member module names"),
        ({"qkv_proj": [1, 2]}, r"fuse\['qkv_proj'\]: member 1 must be a module's own name under its parent"),
        ({"qkv_proj": ["self_attn.q_proj"]}, "member 'self_attn.q_proj' must be a module's own name"),
        ({"qkv_proj": ["q_proj", "k_proj", "q_proj"]}, r"fuse\['qkv_proj'\] lists 'q_proj' more than once"),
    ],
)
def test_a_malformed_fuse_is_a_usage_error_before_anything_is_read(fuse: object, error: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=error):
        load_checkpoint(tmp_path / "missing", fuse=fuse)  # type: ignore[arg-type]


@pytest.mark.parametrize("members", [["qq_proj", "k_proj", "v_proj"], ["q_proj", "kk_proj", "v_proj"]])
def test_a_member_that_names_no_module_is_an_error_wherever_it_is(members: list[str]) -> None:
    typo = next(member for member in members if member[0] == member[1])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(ct_checkpoint("NVFP4A16"), fuse={"qkv_proj": members}, kernel="reference")
    message = str(caught.value)
    assert message.startswith(
        f"cannot fuse 'qkv_proj' = {members}: member {typo!r} matches no quantized or ignored module of the "
        "checkpoint; close module names: "
    )
    assert typo[1:] in message and message.endswith("Fix the member's name in fuse=")


@pytest.mark.parametrize(
    ("fuse", "policy", "error"),
    [
        (None, "rescale", "fuse_policy='rescale' applies to fused modules, but fuse= fuses none; pass fuse= too"),
        (None, "bogus", "fuse_policy='bogus' applies to fused modules, but fuse= fuses none"),
        ({}, {"qkv_proj": "rescale"}, "applies to fused modules, but fuse= fuses none"),
        (FUSE, "max", "fuse_policy: 'max' is not one of per_partition, rescale, requantize, refuse"),
        (FUSE, {"qkv_proj": "max"}, r"fuse_policy\['qkv_proj'\]: 'max' is not one of per_partition, rescale"),
        (
            FUSE,
            {"qkv_projj": "refuse"},
            r"fuse_policy\['qkv_projj'\]: 'qkv_projj' is not a fused name of fuse=.*"
            r"did you mean 'qkv_proj'\?",
        ),
        (FUSE, ["rescale"], "fuse_policy must be one of per_partition, rescale, requantize, refuse or a mapping"),
    ],
)
def test_a_fuse_policy_that_applies_to_nothing_is_a_usage_error(
    fuse: object, policy: object, error: str, tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match=error):
        load_checkpoint(tmp_path / "missing", fuse=fuse, fuse_policy=policy)  # type: ignore[arg-type]


def test_a_fuse_policy_for_a_full_module_name(nvfp4a16) -> None:  # type: ignore[no-untyped-def]
    _, folder = nvfp4a16
    with pytest.raises(
        UsageError, match=r"fuse_policy\['model\.layers\.7\.self_attn\.qkv_proj'\] names no fused module"
    ):
        load_checkpoint(folder, fuse=FUSE, fuse_policy={"model.layers.7.self_attn.qkv_proj": "rescale"})
    fused = load_checkpoint(folder, fuse=FUSE, fuse_policy={f"{ATTN}.qkv_proj": "rescale"}, kernel="reference")
    policies = {r.name: r.fuse.policy for r in fused.report.layers if r.fuse is not None}
    assert policies == {f"{ATTN}.qkv_proj": "rescale", f"{MLP}.gate_up_proj": "per_partition"}


def _far_member(tmp_path: Path, zero_flushed_blocks: bool) -> tuple[Path, int, int]:
    """NVFP4A16 whose k_proj divisor is 1e6 times larger (its multiplier far below q's and v's):
    rescaled to the shared multiplier, most of k_proj's block scales round to zero in e4m3.
    Returns the folder, how many of k_proj's nonzero block scales flush, and how many are nonzero."""
    folder = copy_checkpoint(ct_checkpoint("NVFP4A16"), tmp_path / "checkpoint")
    path = folder / "model.safetensors"
    tensors = {name: value.clone() for name, value in load_file(str(path)).items()}
    tensors[f"{ATTN}.k_proj.weight_global_scale"] *= 1e6
    divisors = [float(tensors[f"{name}.weight_global_scale"]) for name in QKV]
    ratio = min(divisors) / divisors[1]  # the shared multiplier is the largest: the smallest divisor
    scale = tensors[f"{ATTN}.k_proj.weight_scale"].to(torch.float64)
    flushes = (scale != 0) & ((scale * ratio).to(torch.float8_e4m3fn).to(torch.float64) == 0)
    if zero_flushed_blocks:  # the elements under every flushing scale zero: nothing is lost
        packed = tensors[f"{ATTN}.k_proj.weight_packed"]
        packed[flushes.repeat_interleave(8, dim=1)] = 0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder, int(flushes.sum()), int((scale != 0).sum())


def test_rescale_refuses_to_flush_nonzero_block_scales_to_zero(tmp_path: Path) -> None:
    folder, flushed, nonzero = _far_member(tmp_path, zero_flushed_blocks=False)
    assert flushed > nonzero // 2
    per_partition = load_checkpoint(folder, fuse=FUSE, fuse_policy="per_partition", kernel="reference")
    assert bool((per_partition[f"{ATTN}.qkv_proj"].dequantize()[128:192] != 0).any())
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder, fuse=FUSE, fuse_policy="rescale", kernel="reference")
    message = str(caught.value)
    assert message.startswith(
        f"cannot fuse {ATTN}.qkv_proj with fuse_policy 'rescale': under the shared global multiplier ("
    )
    assert f"{ATTN}.k_proj: {flushed} of {nonzero} nonzero block scales (global multiplier " in message
    assert f"{ATTN}.q_proj: " not in message and f"{ATTN}.v_proj: " not in message
    assert message.endswith(
        "choose fuse_policy='per_partition' (a kernel taking one scale per partition), or load the members unfused "
        "(drop this module from fuse=)"
    )


def test_rescale_may_flush_a_block_scale_over_all_zero_elements(tmp_path: Path) -> None:
    folder, flushed, _ = _far_member(tmp_path, zero_flushed_blocks=True)
    assert flushed > 0
    fused = load_checkpoint(folder, fuse=FUSE, fuse_policy="rescale", kernel="reference")
    separate = load_checkpoint(folder, kernel="reference")
    expected = separate[f"{ATTN}.k_proj"].dequantize()
    rescaled = fused[f"{ATTN}.qkv_proj"].dequantize()[128:192]
    assert bool(torch.isfinite(rescaled).all())
    assert bool(((rescaled == 0) == (expected == 0)).all())
