"""Golden `qscheme resolve` traces: which kernel every built-in scheme gets on each device, and
why every other kernel was rejected (tests/snapshots/golden/resolve_<device>.txt).

One file per device (cpu, and simulated sm80, sm89, sm90, sm100, sm103, sm120, which assume a
CUDA build of the local torch release), each holding the CLI's own output for every built-in
scheme on a 4096x4096 layer with bf16 activations, built-in plugins only, no QSCHEME_ or
TRITON_ variables set, on a CPU that runs ``cpu_gemv_blocks``' AVX512-BF16 loop and
``cpu_int8_gemm``'s AVX512-VNNI loops and ``qscheme._tile_gemm``'s VDPBF16PS loops (their
checks' answers pinned, so that the text is the same on any machine). The device and note lines
(versions) are left out. A change to a declaration, a priority or the resolver shows here as a
diff to review; regenerate with
``QSCHEME_UPDATE_SNAPSHOTS=1 pytest tests/test_resolve_golden.py``.

A second set (tests/snapshots/golden/producers_vllm_<device>.txt, cpu, sm90 and sm100) holds the
schemes of the GPTQ, AWQ, DeepSeek FP8-block and gpt-oss MXFP4 producers (issue 27) as a GPU with
vLLM 0.33 installed sees them, so that Marlin is among the candidates; with a GPTQ act-order layer
(input channels permuted) and 16-bit-float MXFP4 besides. These are the resolver's own traces
(``render_resolution`` on simulated devices), the device line left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_fakes import AS_IF_IMPLEMENTED, builtin_scheme, fake_device, isolated_plugins

from qscheme import cpu_gemv_blocks, int8_gemm, tile_gemm
from qscheme.catalog import load_catalog
from qscheme.cli.main import main
from qscheme.kernels.problem import Problem
from qscheme.kernels.render import render_resolution
from qscheme.kernels.resolver import resolve

GOLDEN = Path(__file__).parent / "snapshots" / "golden"
UPDATE = os.environ.get("QSCHEME_UPDATE_SNAPSHOTS") == "1"
DEVICES = ("cpu", "sm80", "sm89", "sm90", "sm100", "sm103", "sm120")
SCHEMES = tuple(sorted(s.name for s in load_catalog(include_plugins=False)))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(("QSCHEME_", "TRITON_")):
            monkeypatch.delenv(name)
    # the cpu traces assume a CPU that runs cpu_gemv_blocks' AVX512-BF16 loop and the blocks' fused GEMM
    # (AVX512-BF16 and VBMI), as the sm traces assume their GPU: the same text on any CI machine
    monkeypatch.setattr(cpu_gemv_blocks, "bf16_loop_available", lambda: True)
    monkeypatch.setattr(cpu_gemv_blocks, "gemm_available", lambda: True)
    # multiplying its panels with VDPBF16PS (on the AMX tiles it takes every type from M = 4)
    monkeypatch.setattr(cpu_gemv_blocks, "gemm_loops", lambda: "avx512")
    # and cpu_int8_gemm's AVX512-VNNI loops
    monkeypatch.setattr(int8_gemm, "available", lambda: True)
    monkeypatch.setattr(int8_gemm, "supported_isa", lambda: "vnni")
    # and the tile GEMM's VDPBF16PS loops (AVX512-BF16 without AMX), under which the GEMVs' ranges stop at M = 4
    monkeypatch.setattr(tile_gemm, "isa", lambda: "avx512")
    with isolated_plugins():
        yield


def trace(scheme: str, device: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["resolve", scheme, "--device", device])
    captured = capsys.readouterr()
    kept = [line.rstrip() for line in captured.out.splitlines() if not line.startswith(("device:", "note:"))]
    text = "\n".join(kept).strip()
    if code != 0:
        text += f"\n(exit {code})\n" + captured.err.strip()
    return f"=== {scheme} on {device}\n{text}\n"


@pytest.mark.parametrize("device", DEVICES)
def test_golden_trace(device: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = "\n".join(trace(scheme, device, capsys) for scheme in SCHEMES)
    path = GOLDEN / f"resolve_{device}.txt"
    if UPDATE or not path.exists():
        if not UPDATE and os.environ.get("CI"):
            pytest.fail(f"golden trace {path} is missing; generate it with QSCHEME_UPDATE_SNAPSHOTS=1")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; review, then regenerate with QSCHEME_UPDATE_SNAPSHOTS=1"


def test_every_device_names_a_kernel_for_every_scheme() -> None:
    """The traces are complete: one section per built-in scheme on each device, each naming a kernel."""
    for device in DEVICES:
        text = (GOLDEN / f"resolve_{device}.txt").read_text()
        sections = [s for s in text.split("=== ") if s.strip()]
        assert [s.split(" on ", 1)[0] for s in sections] == list(SCHEMES)
        for section in sections:
            assert "\nkernel: " in section or "(exit 1)" in section, section


def chosen_kernels(device: str) -> dict[str, str]:
    """Scheme -> chosen kernel (or "none") as the golden trace of the device records it."""
    chosen = {}
    for section in (GOLDEN / f"resolve_{device}.txt").read_text().split("=== ")[1:]:
        scheme = section.split(" on ", 1)[0]
        first = section.splitlines()[1]
        chosen[scheme] = first.split()[1] if first.startswith("kernel: ") and "none" not in first.split()[1] else "none"
    return chosen


def test_the_kernels_doc_table_is_the_golden_traces() -> None:
    """docs/kernels.md's "what runs where" table says what the traces say, cell for cell."""
    text = (Path(__file__).parents[1] / "docs" / "kernels.md").read_text()
    table = text.split("<!-- choice-table")[1].split("\n\n")[0].splitlines()[1:]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["scheme", *DEVICES]
    rows = {}
    for line in table[2:]:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(DEVICES, cells[1:], strict=True))
    assert sorted(rows) == list(SCHEMES)
    for device in DEVICES:
        assert {scheme: rows[scheme][device] for scheme in SCHEMES} == chosen_kernels(device), device


# --- issue 27's producers on a GPU with vLLM 0.33 ------------------------------------------------

PRODUCER_DEVICES = ("cpu", "sm90", "sm100")
# The producers' schemes issue 27 delivered (written out: a scheme added later joins the main traces
# above, and this set when it matters to a route)
PRODUCER_SCHEMES = (
    "awq/W4A16_ASYM",
    "fp8/FP8_BLOCK",
    "fp8/FP8_BLOCK_UE8M0",
    *(
        f"gptq/{n}"
        for n in ("W2A16_ASYM", "W4A16", "W4A16_ASYM", "W4A16_ASYM_G32", "W4A16_G32", "W8A16", "W8A16_CHANNEL")
    ),
    *(f"gptq_v2/{n}" for n in ("W2A16_ASYM", "W4A16", "W4A16_ASYM", "W4A16_ASYM_G32", "W4A16_G32")),
    "mxfp4/MXFP4",
)
# (scheme, problem, label): every producer scheme on a 4096x4096 bf16 layer, plus the two cases
# whose route differs from their scheme's
PRODUCER_CASES = (
    *((name, Problem(4096, 4096), "bfloat16") for name in PRODUCER_SCHEMES),
    ("gptq/W4A16", Problem(4096, 4096, input_permutation=True), "bfloat16, act-order"),
    ("mxfp4/MXFP4", Problem(4096, 4096, activation_dtype="float16"), "float16"),
    # the checkpoints' own shapes, off the 4096 grid (K = 2880 is no multiple of Marlin's 128)
    ("mxfp4/MXFP4", Problem(5760, 2880), "bfloat16, gpt-oss-20b expert gate_up_proj"),
    ("mxfp4/MXFP4", Problem(2880, 2880), "bfloat16, gpt-oss-20b expert down_proj"),
    ("fp8/FP8_BLOCK", Problem(576, 7168), "bfloat16, DeepSeek-V3 kv_a_proj_with_mqa"),
)


def producer_trace(name: str, problem: Problem, label: str, device: str) -> str:
    text = render_resolution(resolve(builtin_scheme(name), problem, fake_device(device), AS_IF_IMPLEMENTED))
    kept = [line.rstrip() for line in text.splitlines() if not line.startswith(("device:", "note:"))]
    return f"=== {name} ({label}) on {device}\n" + "\n".join(kept).strip() + "\n"


@pytest.mark.parametrize("device", PRODUCER_DEVICES)
def test_producer_golden_trace(device: str) -> None:
    text = "\n".join(producer_trace(name, problem, label, device) for name, problem, label in PRODUCER_CASES)
    path = GOLDEN / f"producers_vllm_{device}.txt"
    if UPDATE or not path.exists():
        if not UPDATE and os.environ.get("CI"):
            pytest.fail(f"golden trace {path} is missing; generate it with QSCHEME_UPDATE_SNAPSHOTS=1")
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; review, then regenerate with QSCHEME_UPDATE_SNAPSHOTS=1"


def producer_choices(device: str) -> dict[str, str]:
    """ "scheme (label)" -> the kernel the producer trace of the device chose."""
    chosen = {}
    for section in (GOLDEN / f"producers_vllm_{device}.txt").read_text().split("=== ")[1:]:
        head, first = section.splitlines()[:2]
        chosen[head.rsplit(" on ", 1)[0]] = first.split()[1]
    return chosen


def _route(device: str, name: str, label: str = "bfloat16") -> str:
    return producer_choices(device)[f"{name} ({label})"]


def test_issue_27_kernel_routes_hold() -> None:
    """GPTQ/AWQ int4 on cpu_gemv (CPU; groups of 32 with zero points on tinygemm_cpu) and Marlin (GPU with vLLM), int8
    on Marlin; FP8 blocks on native_fp8_block (sm90, the only device torch's block-scaled FP8 GEMM
    runs on); gpt-oss MXFP4 on Marlin MXFP4; act-order GPTQ on the reference kernel on GPUs, on
    cpu_gemv on the CPU."""
    int4 = [n for n in PRODUCER_SCHEMES if "/W4A16" in n]
    int8 = [n for n in PRODUCER_SCHEMES if "/W8A16" in n]
    assert len(int4) == 9 and len(int8) == 2
    # int4 in groups of 64 or more, and in groups of 32 without zero points: cpu_gemv ranks above
    # tinygemm_cpu (62 > 60); groups of 32 with zero points: below it
    assert {_route("cpu", n) for n in int4 + int8 if "ASYM_G32" not in n} == {"cpu_gemv"}
    assert {_route("cpu", n) for n in int4 if "ASYM_G32" in n} == {"tinygemm_cpu"}
    for gpu in ("sm90", "sm100"):
        assert {_route(gpu, n) for n in int4 + int8} == {"marlin"}, gpu
        assert {_route(gpu, n) for n in PRODUCER_SCHEMES if "/W2A16" in n} == {"triton"}  # Marlin has no 2-bit
        assert _route(gpu, "mxfp4/MXFP4") == "marlin_mxfp4"
        assert _route(gpu, "mxfp4/MXFP4", "float16") == "triton"  # vLLM 0.33's MXFP4 Marlin is bf16-only
        assert _route(gpu, "gptq/W4A16", "bfloat16, act-order") == "reference"
        for projection in ("gate_up_proj", "down_proj"):
            assert _route(gpu, "mxfp4/MXFP4", f"bfloat16, gpt-oss-20b expert {projection}") == "marlin_mxfp4"
    assert _route("cpu", "gptq/W4A16", "bfloat16, act-order") == "cpu_gemv"  # it permutes its input
    assert {_route("sm90", n) for n in ("fp8/FP8_BLOCK", "fp8/FP8_BLOCK_UE8M0")} == {"native_fp8_block"}
    assert _route("sm90", "fp8/FP8_BLOCK", "bfloat16, DeepSeek-V3 kv_a_proj_with_mqa") == "native_fp8_block"
    # torch's 128x128 block-scaled FP8 GEMM is sm90-only; on sm100 Triton runs the blocks
    assert {_route("sm100", n) for n in ("fp8/FP8_BLOCK", "fp8/FP8_BLOCK_UE8M0")} == {"triton"}


def test_native_mxfp4_is_refused_for_gpt_oss_16_bit_activations() -> None:
    """torch's MXFP4 GEMM (BlockWise1x32 on both operands, sm100) multiplies MXFP4 activations:
    running gpt-oss's bf16 activations through it would quantize them, which the checkpoint does
    not ask for. The trace says so on sm100, where the device itself would allow it."""
    text = (GOLDEN / "producers_vllm_sm100.txt").read_text().split("=== mxfp4/MXFP4 (bfloat16) on sm100")[1]
    (line,) = [row for row in text.split("=== ")[0].splitlines() if row.startswith("native_mxfp4")]
    assert "rejected" in line and "mxfp4 dynamic per group of 32 activations; scheme has none (16-bit)" in line
