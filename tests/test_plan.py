"""Kernel plans over batch sizes (qscheme.kernels.plan): construction, forcing, the override,
the resolver's trace, and `qscheme resolve --m`. Declarations here are built in the test (their
ranges are what each test says), except where the built-in ones are named."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from kernel_fakes import isolated_plugins

from qscheme.catalog import load_scheme
from qscheme.cli.main import main
from qscheme.errors import QSchemeError, UsageError
from qscheme.kernels import registry
from qscheme.kernels.declaration import (
    ANY_DEVICE,
    ANY_WEIGHT_ONLY,
    BLOCKS_WEIGHT_ONLY,
    ActivationDtypes,
    BatchRange,
    CheckResult,
    DeviceSupport,
    KernelDeclaration,
    PreparedState,
    WeightBits,
    WeightFormats,
)
from qscheme.kernels.devices import simulated_device
from qscheme.kernels.plan import MSplit, build_plan, parse_m_split
from qscheme.kernels.problem import Problem
from qscheme.kernels.resolver import resolve

CANONICAL = PreparedState("canonical")


def kernel(
    name: str,
    priority: int,
    ranges: tuple[BatchRange, ...] = (),
    state: PreparedState = CANONICAL,
) -> KernelDeclaration:
    return KernelDeclaration(
        name=name,
        provider="test",
        priority=priority,
        supports=(ANY_WEIGHT_ONLY,),
        devices=(DeviceSupport(ANY_DEVICE),),
        implementation="qscheme_plugins.reference_kernel:ReferenceKernel",
        batch_ranges=ranges,
        prepared_state=state,
    )


GEMV = kernel("gemv", 50, (BatchRange("cpu", 0, 15, source="test"),))
TILES = kernel("tiles", 10, (BatchRange("cpu", 16, None, source="test"),))
ANY_M = kernel("any_m", 0)


def described(plan: object) -> list[tuple[int, int | None, str]]:
    return [(e.m_min, e.m_max, e.kernel.name) for e in plan.entries]  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):  # the Triton interpreter would put the Triton kernel in CPU plans
        if name.startswith(("QSCHEME_", "TRITON_")):
            monkeypatch.delenv(name)
    with isolated_plugins():
        yield


# -- construction ----------------------------------------------------------------------------


def test_without_ranges_the_plan_is_the_first_accepted_kernel_for_every_m() -> None:
    plan = build_plan([kernel("a", 5), kernel("b", 1)], "cpu")
    assert described(plan) == [(0, None, "a")]
    assert not plan.split


def test_ranges_split_the_m_axis_by_priority() -> None:
    plan = build_plan([GEMV, TILES, ANY_M], "cpu")
    assert described(plan) == [(0, 15, "gemv"), (16, None, "tiles")]
    assert [plan.kernel_for(m).name for m in (0, 1, 15, 16, 10**6)] == ["gemv", "gemv", "gemv", "tiles", "tiles"]


def test_a_gap_between_ranges_goes_to_the_next_kernel_that_covers_it() -> None:
    small = kernel("small", 50, (BatchRange("cpu", 0, 7),))
    plan = build_plan([small, TILES, ANY_M], "cpu")
    assert described(plan) == [(0, 7, "small"), (8, 15, "any_m"), (16, None, "tiles")]


def test_an_m_no_range_covers_runs_on_the_best_kernel_outside_its_range() -> None:
    plan = build_plan([GEMV, kernel("big", 5, (BatchRange("cpu", 64, None),))], "cpu")
    assert described(plan) == [(0, 15, "gemv"), (16, 63, "gemv"), (64, None, "big")]
    assert "outside its range" in plan.entry_for(20).reason


def test_ranges_are_per_device_type() -> None:
    cuda_only = kernel("cuda_small", 50, (BatchRange("cuda", 0, 3),))
    assert described(build_plan([cuda_only, ANY_M], "cpu")) == [(0, None, "cuda_small")]
    assert described(build_plan([cuda_only, ANY_M], "cuda")) == [(0, 3, "cuda_small"), (4, None, "any_m")]
    anywhere = kernel("anywhere", 50, (BatchRange(ANY_DEVICE, 0, 3),))
    assert described(build_plan([anywhere, ANY_M], "cpu")) == [(0, 3, "anywhere"), (4, None, "any_m")]


def test_a_plan_holds_at_most_one_repacking_kernel() -> None:
    repack_small = kernel("repack_small", 50, (BatchRange("cpu", 0, 15),), PreparedState("repack", 1.0))
    repack_large = kernel("repack_large", 40, (BatchRange("cpu", 16, None),), PreparedState("repack", 0.2))
    plan = build_plan([repack_small, repack_large, ANY_M], "cpu")
    assert described(plan) == [(0, 15, "repack_small"), (16, None, "any_m")]
    assert [name for name, _ in plan.skipped] == ["repack_large"]
    assert "repack_small already holds a repacked copy" in plan.skipped[0][1]
    # with a repacking kernel for large M and a canonical one for small M, both run
    plan = build_plan([GEMV, repack_large, ANY_M], "cpu")
    assert described(plan) == [(0, 15, "gemv"), (16, None, "repack_large")]


def test_a_forced_kernel_runs_every_m() -> None:
    plan = build_plan([GEMV, TILES, ANY_M], "cpu", forced="tiles")
    assert described(plan) == [(0, None, "tiles")]


def test_a_boundary_override_moves_every_declared_boundary() -> None:
    split = parse_m_split("32")
    assert described(build_plan([GEMV, TILES, ANY_M], "cpu", m_split=split)) == [(0, 31, "gemv"), (32, None, "tiles")]


def test_off_ignores_the_declared_ranges() -> None:
    split = parse_m_split("off")
    assert described(build_plan([GEMV, TILES, ANY_M], "cpu", m_split=split)) == [(0, None, "gemv")]
    # the kernel for M = 1, not the highest priority: a large-M kernel ranked above it stays out
    assert described(build_plan([TILES, ANY_M], "cpu", m_split=split)) == [(0, None, "any_m")]


def test_kernel_ranges_override_the_declared_ones() -> None:
    split = parse_m_split("tiles=4-,gemv=-3", kernels=("gemv", "tiles", "any_m"))
    plan = build_plan([GEMV, TILES, ANY_M], "cpu", m_split=split)
    assert described(plan) == [(0, 3, "gemv"), (4, None, "tiles")]
    assert "set by 'tiles=4-,gemv=-3'" in plan.entry_for(4).reason
    # a range narrows a kernel to it; where a higher-priority kernel's range overlaps, that one runs
    one = parse_m_split("tiles=8")
    assert described(build_plan([GEMV, TILES, ANY_M], "cpu", m_split=one)) == [(0, 15, "gemv"), (16, None, "any_m")]
    one = parse_m_split("tiles=8,gemv=-7")
    assert described(build_plan([GEMV, TILES, ANY_M], "cpu", m_split=one)) == [
        (0, 7, "gemv"),
        (8, 8, "tiles"),
        (9, None, "any_m"),
    ]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("bogus", "'bogus' is neither a boundary nor kernel=RANGE"),
        ("0", "the boundary must lie in 1.."),
        ("tiles=9-3", "'tiles=9-3' is empty (3 < 9)"),
        ("tiles=", "'tiles=' is not a range"),
        ("tiles=1-,tiles=4-", "kernel 'tiles' is given twice"),
        ("tilez=4-", "'tilez' names no declared kernel (did you mean 'tiles'?)"),
        (",", "it names no kernel"),
    ],
)
def test_bad_overrides_are_typed_errors_naming_the_value_and_the_forms(text: str, words: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_m_split(text, "QSCHEME_M_SPLIT", kernels=("gemv", "tiles"))
    message = str(caught.value)
    assert isinstance(caught.value, QSchemeError)
    assert f"QSCHEME_M_SPLIT={text!r}" in message
    assert words in message
    assert "unset it" in message


def test_an_override_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(UsageError, match=r"m_split=1.5: takes a str or an int, not a float"):
        parse_m_split(1.5, "m_split")
    assert parse_m_split("") is None and parse_m_split(None) is None
    assert parse_m_split(16) == MSplit("16", boundary=16)


def test_declarations_check_their_ranges_and_states() -> None:
    with pytest.raises(ValueError, match="m_max must be None or an int >= m_min"):
        BatchRange("cpu", 16, 4)
    with pytest.raises(ValueError, match="device 'tpu'"):
        BatchRange("tpu")
    with pytest.raises(ValueError, match="keeps the canonical tensors declares no extra"):
        PreparedState("canonical", 0.5)
    with pytest.raises(ValueError, match="batch_ranges must be a tuple of BatchRange"):
        replace(GEMV, batch_ranges=((0, 15),))  # type: ignore[arg-type]
    assert GEMV.batch_ranges[0].describe() == "M <= 15 on cpu"
    assert GEMV.as_json()["batch_ranges"] == [{"device": "cpu", "m_min": 0, "m_max": 15, "source": "test", "when": []}]
    with pytest.raises(ValueError, match="when must be a tuple of objects with check"):
        BatchRange("cpu", 0, 4, when=(ActivationDtypes(("bfloat16",)), "bfloat16"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Raises:
    """A plugin's check with a bug."""

    def check(self, problem: Problem) -> CheckResult:
        raise RuntimeError("a bug")

    def describe(self) -> str:
        return "a buggy check"


BF16 = (ActivationDtypes(("bfloat16",)),)
CONDITIONAL_GEMV = kernel("gemv", 50, (BatchRange("cpu", 0, 4, "bf16", BF16), BatchRange("cpu", 0, 15, "test")))
CONDITIONAL_TILES = kernel("tiles", 10, (BatchRange("cpu", 5, None, "bf16", BF16), BatchRange("cpu", 16, None, "test")))


def test_a_range_under_conditions_holds_only_for_the_layers_that_pass_them() -> None:
    """The first entry that applies is the range: the bfloat16 one for bfloat16 layers, the
    unconditional one for float32 layers and where no layer is given."""
    bf16, f32 = Problem(64, 64, "bfloat16"), Problem(64, 64, "float32")
    assert CONDITIONAL_GEMV.batch_range("cpu", bf16) == (0, 4)
    assert CONDITIONAL_GEMV.batch_range("cpu", f32) == (0, 15)
    assert CONDITIONAL_GEMV.batch_range("cpu") == (0, 15)
    entry = CONDITIONAL_TILES.batch_entry("cpu", bf16)
    assert entry is not None and entry.source == "bf16"
    assert entry.describe() == "M >= 5 on cpu for bfloat16 activations"
    assert CONDITIONAL_TILES.as_json()["batch_ranges"][0]["when"] == ["bfloat16 activations"]  # type: ignore[index]
    assert described(build_plan([CONDITIONAL_GEMV, CONDITIONAL_TILES], "cpu", problem=bf16)) == [
        (0, 4, "gemv"),
        (5, None, "tiles"),
    ]
    assert described(build_plan([CONDITIONAL_GEMV, CONDITIONAL_TILES], "cpu", problem=f32)) == [
        (0, 15, "gemv"),
        (16, None, "tiles"),
    ]
    # an override's boundary moves the range that applies
    split = parse_m_split("8", origin="QSCHEME_M_SPLIT")
    assert described(build_plan([CONDITIONAL_GEMV, CONDITIONAL_TILES], "cpu", m_split=split, problem=bf16)) == [
        (0, 7, "gemv"),
        (8, None, "tiles"),
    ]
    # a check that raises: the entry does not hold (the next one does), and nothing propagates
    buggy = kernel("gemv", 50, (BatchRange("cpu", 0, 4, "bug", (Raises(),)), BatchRange("cpu", 0, 15, "test")))
    assert buggy.batch_range("cpu", bf16) == (0, 15)


def test_the_resolver_plans_with_the_layers_conditions() -> None:
    scheme = load_scheme("compressed-tensors/W4A16")
    device = registry.device_for("cpu")
    for dtype, boundary in (("bfloat16", 5), ("float32", 16)):
        resolution = resolve(scheme, Problem(256, 512, dtype), device, [CONDITIONAL_GEMV, CONDITIONAL_TILES])
        assert described(resolution.plan) == [(0, boundary - 1, "gemv"), (boundary, None, "tiles")]


# -- the resolver, with the built-in declarations ------------------------------------------------

# GGUF Q8_0 blocks: on a CPU only the reference kernel and dequant_gemm take them (a GEMV kernel
# of the checkout would otherwise take every M of a scheme it runs, until it declares a range)
BLOCKS = "gguf/Q8_0"


@pytest.fixture
def no_blocks_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without the blocks' fused GEMM (no AVX512-BF16): dequant_gemm takes the large M of blocks
    (tests/test_cpu_gemm_blocks.py covers the CPUs with it)."""
    from qscheme import cpu_gemv_blocks

    monkeypatch.setattr(cpu_gemv_blocks, "gemm_available", lambda: False)


def cpu_resolution(force: str | None = None, m_split: MSplit | None = None, disabled: tuple[str, ...] = ()) -> object:
    scheme = load_scheme(BLOCKS)
    device = registry.device_for("cpu")
    return resolve(scheme, Problem(4096, 4096), device, registry.declarations(), force, disabled, m_split=m_split)


def builtin_range(name: str) -> tuple[int, int | None] | None:
    return registry.get_declaration(name).batch_range("cpu")


def test_the_builtin_tile_gemm_takes_large_m_of_blocks_on_the_cpu(no_blocks_gemm: None) -> None:
    boundary = builtin_range("dequant_gemm")
    assert boundary is not None and boundary[1] is None
    resolution = cpu_resolution()
    plan = resolution.plan  # type: ignore[attr-defined]
    assert plan.kernel_for(boundary[0]).name == "dequant_gemm"
    assert plan.kernel_for(boundary[0] - 1).name != "dequant_gemm"
    # the kernel reported as chosen is the plan's at M = 1, and the trace says what the other runs
    assert resolution.kernel.name == plan.kernel_for(1).name  # type: ignore[attr-defined]
    candidate = resolution.candidate("dequant_gemm")  # type: ignore[attr-defined]
    assert candidate.accepted and not candidate.chosen
    assert candidate.reason.startswith(f"runs M >= {boundary[0]}")


def test_forcing_and_disabling_give_one_kernel_plans() -> None:
    forced = cpu_resolution(force="dequant_gemm").plan  # type: ignore[attr-defined]
    assert described(forced) == [(0, None, "dequant_gemm")]
    disabled = cpu_resolution(disabled=("dequant_gemm",)).plan  # type: ignore[attr-defined]
    assert "dequant_gemm" not in [k.name for k in disabled.kernels]


def test_a_plan_on_a_gpu_is_unchanged_by_cpu_ranges() -> None:
    scheme = load_scheme(BLOCKS)
    device = registry.complete_facts(simulated_device("sm90"))
    resolution = resolve(scheme, Problem(4096, 4096), device, registry.declarations())
    assert described(resolution.plan) == [(0, None, resolution.kernel.name)]  # type: ignore[union-attr]


# -- the command line --------------------------------------------------------------------------


def test_resolve_shows_the_plan_for_the_batch_sizes_asked(
    capsys: pytest.CaptureFixture[str], no_blocks_gemm: None
) -> None:
    boundary = builtin_range("dequant_gemm")
    assert boundary is not None
    large = boundary[0]
    assert main(["resolve", BLOCKS, "--device", "cpu", "--m", f"1,{large},256"]) == 0
    out = capsys.readouterr().out
    small = registry.resolve_layer(load_scheme(BLOCKS), Problem(4096, 4096), "cpu").plan.kernel_for(1).name
    assert f"plan: M <= {large - 1}: {small}; M >= {large}: dequant_gemm" in out
    assert f"  M=1: {small}\n  M={large}: dequant_gemm\n  M=256: dequant_gemm\n" in out
    assert main(["resolve", BLOCKS, "--device", "cpu", "--m", "1,256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_sizes"] == [{"m": 1, "kernel": small}, {"m": 256, "kernel": "dequant_gemm"}]
    assert [(e["m_min"], e["m_max"], e["kernel"]) for e in data["plan"]] == [
        (0, large - 1, small),
        (large, None, "dequant_gemm"),
    ]


def test_resolve_forced_and_overridden(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["resolve", BLOCKS, "--device", "cpu", "--kernel", "reference", "--m", "1,256"]) == 0
    out = capsys.readouterr().out
    assert "plan: every M: reference\n  M=1: reference\n  M=256: reference\n" in out
    assert main(["resolve", BLOCKS, "--device", "cpu", "--m-split", "off", "--m", "256"]) == 0
    out = capsys.readouterr().out
    assert "plan override: off" in out and "M=256: dequant_gemm" not in out
    monkeypatch.setenv("QSCHEME_M_SPLIT", "cpu_gemv_blocks=0-1,dequant_gemm=2-")  # two ranges moved
    assert main(["resolve", BLOCKS, "--device", "cpu", "--m", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "  M=2: dequant_gemm\n" in out and "plan override: cpu_gemv_blocks=0-1,dequant_gemm=2-" in out


def test_a_single_kernel_plan_leaves_the_default_output_as_it_was(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", BLOCKS, "--device", "sm90"]) == 0
    assert "plan:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--m", "1,x"], "--m '1,x': expected batch sizes M >= 0 separated by commas"),
        (["--m", "-1"], "--m '-1': expected batch sizes"),
        (["--m-split", "nope"], "--m-split='nope': 'nope' is neither a boundary nor kernel=RANGE"),
        (["--m-split", "dequant_gem=1-"], "did you mean 'dequant_gemm'?"),
    ],
)
def test_resolve_refuses_bad_batch_options(
    arguments: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["resolve", BLOCKS, "--device", "cpu", *arguments]) == 2
    assert words in capsys.readouterr().err


def test_resolve_checks_batch_options_for_a_checkpoint(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint takes --m and --m-split (per-layer plans: tests/test_resolve_engine_vllm.py); bad
    values are refused before the folder is read."""
    assert main(["resolve", str(tmp_path), "--m", "one"]) == 2
    assert "--m 'one': expected batch sizes M >= 0" in capsys.readouterr().err
    assert main(["resolve", str(tmp_path), "--m-split", "sometimes"]) == 2
    assert "--m-split='sometimes'" in capsys.readouterr().err


def test_a_range_per_weight_format_sees_the_schemes_format() -> None:
    """The resolver fills Problem.weight_format from the scheme ("blocks" for packed blocks), so a
    range may hold for some formats only; the field takes no part in comparisons."""
    not_blocks = (WeightFormats(("blocks",), exclude=True),)
    gemv = kernel("gemv", 50, (BatchRange("cpu", 0, 47, "f", not_blocks), BatchRange("cpu", 0, 15, "test")))
    tiles = kernel("tiles", 10, (BatchRange("cpu", 48, None, "f", not_blocks), BatchRange("cpu", 16, None, "test")))
    gemv = replace(gemv, supports=(ANY_WEIGHT_ONLY, BLOCKS_WEIGHT_ONLY))
    tiles = replace(tiles, supports=(ANY_WEIGHT_ONLY, BLOCKS_WEIGHT_ONLY))
    device = registry.device_for("cpu")
    for name, boundary in (("compressed-tensors/W4A16", 48), (BLOCKS, 16)):
        resolution = resolve(load_scheme(name), Problem(256, 512), device, [gemv, tiles])
        assert described(resolution.plan) == [(0, boundary - 1, "gemv"), (boundary, None, "tiles")], name
        assert resolution.problem.weight_format == load_scheme(name).weight.format  # type: ignore[union-attr]
    assert Problem(8, 8, weight_format="blocks") == Problem(8, 8)
    assert not WeightFormats(("blocks",)).check(Problem(8, 8)).ok  # unknown: the entry does not hold
    assert WeightFormats(("blocks",), exclude=True).describe() == "weights other than blocks"
    with pytest.raises(UsageError, match="weight_format must be a str or None"):
        Problem(8, 8, weight_format=4)  # type: ignore[arg-type]


def test_a_range_per_block_width_sees_the_blocks_bits() -> None:
    """The resolver fills Problem.weight_bits from the scheme's blocks (bytes over weights), so a
    range may hold for the wider blocks only; weights that are not blocks never match."""
    wide = (WeightBits(6.0),)
    gemv = kernel("gemv", 50, (BatchRange("cpu", 0, 3, "w", wide), BatchRange("cpu", 0, 4, "test")))
    tiles = kernel("tiles", 10, (BatchRange("cpu", 4, None, "w", wide), BatchRange("cpu", 5, None, "test")))
    gemv = replace(gemv, supports=(ANY_WEIGHT_ONLY, BLOCKS_WEIGHT_ONLY))
    tiles = replace(tiles, supports=(ANY_WEIGHT_ONLY, BLOCKS_WEIGHT_ONLY))
    device = registry.device_for("cpu")
    for name, bits, boundary in (("gguf/Q6_K", 6.5625, 4), ("gguf/Q8_0", 8.5, 4), ("gguf/Q4_K", 4.5, 5)):
        resolution = resolve(load_scheme(name), Problem(256, 512), device, [gemv, tiles])
        assert described(resolution.plan) == [(0, boundary - 1, "gemv"), (boundary, None, "tiles")], name
        assert resolution.problem.weight_bits == bits
    assert resolve(load_scheme("gptq/W8A16"), Problem(256, 512), device, [gemv, tiles]).problem.weight_bits is None
    assert not WeightBits(6.0).check(Problem(8, 8)).ok  # unknown: the entry does not hold
    assert "blocks of 4.5 bits a weight" in WeightBits(6.0).check(Problem(8, 8, weight_bits=4.5)).reason
    assert Problem(8, 8, weight_bits=6.5) == Problem(8, 8)
    with pytest.raises(UsageError, match="weight_bits must be a positive number"):
        Problem(8, 8, weight_bits=0)
    with pytest.raises(ValueError, match="at_least must be a positive number"):
        WeightBits(-1.0)
