"""`qscheme resolve`, `qscheme kernels` and `qscheme plugins`, run in-process on the built-in plugins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_fakes import BUILTIN_KERNELS_BY_PRIORITY, isolated_plugins
from qscheme_plugins.native_fp8 import NATIVE_FP8_BLOCK

from qscheme.cli.main import main
from qscheme.kernels.devices import module_available

W4A8 = "modelopt/W4A8_NVFP4_FP8"


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("QSCHEME_KERNEL", "QSCHEME_DISABLED_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    with isolated_plugins():
        yield


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_resolve_json_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["resolve", "compressed-tensors/NVFP4", "--device", "sm100", "--shape", "4096,11008", "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert data["kernel"] == "native_fp4"  # NVFP4 x NVFP4 on compute capability 10.0
    assert data["problem"] == {
        "layer": None,
        "n": 4096,
        "k": 11008,
        "activation_dtype": "bfloat16",
        "partitions": 1,
        "partition_scales_differ": False,
        "input_pre_scale": None,
    }
    assert data["device"]["capability"] == "10.0" and data["device"]["simulated"] is True
    assert [t["kernel"] for t in data["trace"]] == BUILTIN_KERNELS_BY_PRIORITY
    for entry in data["trace"]:
        assert {"kernel", "accepted", "stage", "reason"} <= set(entry)
    native = data["trace"][0]
    assert (native["accepted"], native["chosen"], native["stage"]) == (True, True, None)
    marlin = next(entry for entry in data["trace"] if entry["kernel"] == "marlin")
    assert (marlin["accepted"], marlin["stage"]) == (False, "scheme")  # it takes 16-bit activations only
    assert marlin["reason"].startswith(
        "takes nvfp4 weights with none (16-bit) activations; scheme has nvfp4 dynamic per group of 16 activations"
    )
    assert ("needs module vllm, not importable here" in marlin["reason"]) is not module_available("vllm")
    assert "declared only" not in marlin["reason"]  # marlin has its code (vLLM's ops)


def test_resolve_text_shows_decision_device_problem_and_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["resolve", "compressed-tensors/NVFP4", "--device", "sm90", "--dtype", "fp16"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("kernel: ")
    assert lines[1].startswith("device: cuda (simulated sm90") and "compute capability 9.0" in lines[1]
    assert lines[2] == "problem: N=4096, K=4096, float16 activations"
    header = next(line for line in lines if line.startswith("kernel "))
    assert header.split() == ["kernel", "provider", "priority", "verdict", "stage", "reason"]
    assert any("needs compute capability 10.0-10.3 or 12.0-12.1; device is 9.0" in line for line in lines)


def test_resolve_nvfp4_weights_with_fp8_inputs_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["resolve", W4A8, "--device", "sm100"], capsys)
    assert code == 1
    assert out.startswith(f"kernel: none can run scheme {W4A8}")
    assert "No kernel implements nvfp4 weights with fp8 static per tensor activations." in out
    assert "Activation formats that kernels accept with nvfp4 weights:" in out
    assert "hint: scheme modelopt/" in out
    code, out, _ = run(["resolve", W4A8, "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["kernel"] is None
    assert {p["activations"] for p in data["pairings"]} == {"none (16-bit)", "nvfp4 dynamic per group of 16"}
    assert all(not t["accepted"] and t["stage"] == "scheme" for t in data["trace"])


def test_resolve_a_descriptor_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = Path(__file__).resolve().parents[1] / "schemes" / "compressed-tensors" / "W4A16.yaml"
    file = tmp_path / "mine.yaml"
    file.write_text(source.read_text().replace("compressed-tensors/W4A16", "mine/W4A16"))
    code, out, _ = run(["resolve", str(file), "--device", "sm80", "--json"], capsys)
    assert code == 0 and json.loads(out)["scheme"] == "mine/W4A16"


def test_forced_kernels(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--device", "sm90", "--kernel", "marlin"], capsys)
    assert code == 1
    assert out.startswith("kernel: none: forced kernel 'marlin' cannot run scheme compressed-tensors/W4A16")
    assert "hint: kernel tinygemm can run this layer here: stop forcing 'marlin'" in out
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--device", "sm90", "--kernel", "reference"], capsys)
    assert code == 0 and out.startswith("kernel: reference (forced)")
    code, _, err = run(["resolve", "compressed-tensors/W4A16", "--kernel", "marlinn"], capsys)
    assert code == 2 and "unknown kernel 'marlinn' was forced. Did you mean 'marlin'?" in err
    monkeypatch.setenv("QSCHEME_KERNEL", "marlin")
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--device", "sm90", "--json"], capsys)
    assert code == 1 and json.loads(out)["forced"] == "marlin"
    monkeypatch.delenv("QSCHEME_KERNEL")
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "reference,triton,tinygemm_cpu,dequant_gemm,cpu_gemv")
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--device", "cpu", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["disabled"] == ["cpu_gemv", "dequant_gemm", "reference", "tinygemm_cpu", "triton"]


def test_fused_partitions_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(
        [
            "resolve",
            "compressed-tensors/NVFP4A16",
            "--device",
            "sm90",
            "--partitions",
            "3",
            "--scales-differ",
            "--json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert data["problem"]["partitions"] == 3 and data["problem"]["partition_scales_differ"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["resolve", "compressed-tensors/W4A16", "--shape", "4096"], "--shape '4096': expected N,K"),
        (["resolve", "compressed-tensors/W4A16", "--dtype", "int8"], "activation dtype 'int8'"),
        (["resolve", "compressed-tensors/W4A16", "--shape", "0,64"], "N and K must lie in 1..16777216"),
        (["resolve", "compressed-tensors/W4A16", "--shape", "99999999999,64"], "N and K must lie in 1..16777216"),
        (["resolve", "compressed-tensors/W4A16", "--shape", "4_096,64"], "expected N,K (or NxK)"),
        (["resolve", "compressed-tensors/W4A16", "--scales-differ"], "--scales-differ needs --partitions 2 or more"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err


def test_unknown_scheme_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["resolve", "compressed-tensors/NVFP5"], capsys)
    assert code == 2 and "unknown scheme 'compressed-tensors/NVFP5'" in err
    code, _, err = run(["resolve", "no/such/file.yaml"], capsys)
    assert code == 2 and "descriptor file 'no/such/file.yaml' does not exist" in err


def test_kernels_lists_every_kernel_and_why_not(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["kernels", "--device", "sm90", "--json"], capsys)
    assert code == 0
    records = {r["name"]: r for r in json.loads(out)}
    assert list(records) == BUILTIN_KERNELS_BY_PRIORITY
    for record in records.values():
        assert {"name", "provider", "priority", "available", "reason"} <= set(record)
    assert records["reference"]["available"] is True and records["reference"]["reason"] is None
    assert "needs compute capability 10.0-10.3 or 12.0-12.1; device is 9.0" in records["native_fp4"]["reason"]
    assert records["marlin"]["provider"] == "vllm" and records["marlin"]["priority"] == 80
    # on sm90: tensor-, row- and block-wise FP8 and CUDA tinygemm run; the CPU kernels do not
    available = {name for name, record in records.items() if record["available"]}
    assert available == {"native_fp8", "native_fp8_rowwise", "native_fp8_block", "tinygemm", "triton", "reference"}
    assert records["tinygemm_cpu"]["reason"] == "runs on cpu; device is cuda"
    assert records["native_mxfp4"]["reason"] == "needs compute capability 10.0-10.3; device is 9.0"
    assert records["native_fp8_block"]["notes"] == list(NATIVE_FP8_BLOCK.notes) and NATIVE_FP8_BLOCK.notes
    code, out, _ = run(["kernels", "--device", "sm120"], capsys)
    assert code == 0
    assert "runs on:    cuda (compute capability 10.0-10.3 or 12.0-12.1)" in out
    marlin = out.split("\nmarlin (vllm, priority 80, plugin marlin)\n")[1].split("\n\n")[0]
    assert "  runs on:    cuda (compute capability 8.0 or newer)\n" in marlin
    assert "  needs:      module vllm; vllm >=0.33,<0.34; bfloat16 or float16 activations\n" in marlin
    assert "  code:       qscheme_plugins.marlin_kernel:MarlinKernel\n" in marlin
    assert "runs on:    cuda (compute capability 8.9 or 9.0-9.9 or 10.0-10.3)" in out  # native_fp8_rowwise
    assert "needs:      torch.ops.aten._convert_weight_to_int4pack; torch.ops.aten._weight_int4pack_mm;" in out
    assert "  notes:      " in out  # the declarations' notes are shown
    assert out.rstrip().endswith(f"{len(BUILTIN_KERNELS_BY_PRIORITY)} kernels")


def test_plugins_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plugins", "--json"], capsys)
    assert code == 0
    plugins = {p["name"]: p for p in json.loads(out)}
    assert {"reference", "triton", "marlin", "native_fp4", "native_fp8", "tinygemm"} <= set(plugins)
    assert plugins["native_fp4"]["kernels"] == ["native_fp4", "native_mxfp4"]
    assert plugins["tinygemm"]["kernels"] == ["tinygemm", "tinygemm_cpu"]
    assert plugins["reference"]["builtin"] is True and plugins["reference"]["kernels"] == ["reference"]
    assert plugins["reference"]["distribution"] == "qscheme"
    code, out, _ = run(["plugins"], capsys)
    assert code == 0 and "0 error(s)" in out


def _rows(out: str, kernel: str) -> list[str]:
    """The trace rows of one kernel: its own row and the continuation rows under it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{kernel} "))
    rows = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" ") or not line.strip():
            break
        rows.append(line)
    return rows


def test_resolve_lists_every_failing_check_of_the_forced_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    """Float32 inputs fail Marlin's problem check (the 100x100 shape does not: Marlin pads it)."""
    argv = ["resolve", "compressed-tensors/NVFP4A16", "--kernel", "marlin", "--shape", "100,100", "--dtype", "fp32"]
    code, out, _ = run(argv, capsys)  # on whatever device this machine has
    assert code == 1
    assert out.startswith(
        "kernel: none: scheme compressed-tensors/NVFP4A16 cannot store a layer of N=100, K=100 (see layout)"
    )
    assert (
        "layout: scheme compressed-tensors/NVFP4A16 stores layers with K % 16 == 0, not N=100, K=100 "
        "(weight_scale [N, K/16] needs K % 16 == 0)"
    ) in out
    rows = [" ".join(row.split()) for row in _rows(out, "marlin")]
    assert rows[0].startswith("marlin vllm 80 rejected ")
    assert "problem takes bfloat16 or float16 activations; layer has float32" in rows
    assert "hint: cast the inputs to bfloat16" in rows  # the check's own hint, in text
    assert not any("N % 64" in row for row in rows)
    assert out.rstrip().splitlines()[-1].startswith("hint: pad the layer to N=100, K=112 for scheme")

    code, out, _ = run([*argv, "--device", "cpu"], capsys)
    rows = [" ".join(row.split()) for row in _rows(out, "marlin")]
    assert code == 1
    assert rows[0] == "marlin vllm 80 rejected device runs on cuda; device is cpu"
    assert ("device needs module vllm, not importable here" in rows) is not module_available("vllm")
    assert "problem takes bfloat16 or float16 activations; layer has float32" in rows

    code, out, _ = run([*argv, "--device", "cpu", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["kernel"] is None
    assert data["layout"]["stage"] == "layout" and "not N=100, K=100" in data["layout"]["reason"]
    marlin = next(entry for entry in data["trace"] if entry["kernel"] == "marlin")
    failures = [(f["stage"], f["reason"]) for f in marlin["failures"]]
    assert failures[0] == ("device", "runs on cuda; device is cpu")
    assert failures[-1][0] == "problem" and marlin["stage"] == "device"
    assert marlin["reason"] == "; ".join(reason for _, reason in failures)


def test_resolve_lists_scheme_device_and_problem_failures_together(capsys: pytest.CaptureFixture[str]) -> None:
    """NVFP4 W4A4 on Marlin: wrong activations, vLLM missing (where it is), float32 inputs: a row each."""
    argv = ["resolve", "compressed-tensors/NVFP4", "--kernel", "marlin", "--shape", "96,96", "--device", "sm90"]
    code, out, _ = run([*argv, "--dtype", "fp32"], capsys)
    assert code == 1 and "layout:" not in out
    rows = [" ".join(row.split()) for row in _rows(out, "marlin")]
    assert rows[0] == (
        "marlin vllm 80 rejected scheme takes nvfp4 weights with none (16-bit) activations; "
        "scheme has nvfp4 dynamic per group of 16 activations"
    )
    vllm_missing = (
        "device needs module vllm, not importable here (optional kernel libraries are checked in the local environment)"
    )
    assert (vllm_missing in rows) is not module_available("vllm")
    assert "problem takes bfloat16 or float16 activations; layer has float32" in rows
    assert "hint: cast the inputs to bfloat16" in rows
    # The 96x96 shape, off Marlin's tiles, is no failure: Marlin pads it.
    code, out, _ = run(argv, capsys)
    assert code == 1 and not any(row.split()[0] == "problem" for row in _rows(out, "marlin")[1:])


def test_resolve_says_a_declared_only_kernel_has_no_code(capsys: pytest.CaptureFixture[str]) -> None:
    """No built-in is declared only; a plugin's kernel declared ahead of its code is rejected so."""
    from dataclasses import replace

    from qscheme_plugins.marlin import MARLIN

    from qscheme.kernels import registry
    from qscheme.kernels.declaration import KernelDeclaration
    from qscheme.plugins import hookimpl, register_plugin

    class DeclaredOnly:
        @hookimpl
        def qscheme_kernels(self) -> list[KernelDeclaration]:
            return [
                replace(MARLIN, name="declared_marlin", implementation=None, requires_modules=(), requires_versions=())
            ]

    register_plugin(DeclaredOnly(), "declared-only")
    registry.reset()
    argv = ["resolve", "compressed-tensors/W4A16", "--kernel", "declared_marlin", "--device", "sm90"]
    code, out, _ = run(argv, capsys)
    assert code == 1
    rows = [" ".join(row.split()) for row in _rows(out, "declared_marlin")]
    assert rows == ["declared_marlin vllm 80 rejected device declared only: no implementation is installed"]
    code, out, _ = run(["kernels", "--device", "sm90", "--json"], capsys)
    records = {r["name"]: r for r in json.loads(out)}
    assert records["declared_marlin"]["available"] is False
    assert records["declared_marlin"]["reason"] == "declared only: no implementation is installed"
    assert all(records[name]["implementation"] for name in BUILTIN_KERNELS_BY_PRIORITY)
    code, out, _ = run(["kernels", "--device", "sm90"], capsys)
    assert "code:       declared only (no implementation yet)" in out


def test_resolve_a_shape_the_scheme_cannot_store(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["resolve", "compressed-tensors/NVFP4A16", "--shape", "4096,4097", "--device", "sm90"], capsys)
    assert code == 1
    assert out.startswith("kernel: none: scheme compressed-tensors/NVFP4A16 cannot store a layer of N=4096, K=4097")
    assert (
        "layout: scheme compressed-tensors/NVFP4A16 stores layers with K % 16 == 0, not N=4096, K=4097 "
        "(weight_packed [N, K/2] needs K % 2 == 0; weight_scale [N, K/16] needs K % 16 == 0)"
    ) in out
    assert "hint: pad the layer to N=4096, K=4112 for scheme compressed-tensors/NVFP4A16" in out
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--shape", "4096,4097", "--device", "sm90"], capsys)
    assert code == 0 and "layout:" not in out  # its ceil(K/8) and ceil(K/128) shapes pad


def test_resolve_on_a_simulated_turing_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["resolve", "compressed-tensors/W4A16", "--device", "sm75", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["device"]["capability"] == "7.5" and data["device"]["simulated"] is True
    assert data["device"]["name"] == "simulated sm75, Turing (T4-class)"
    trace = {entry["kernel"]: entry for entry in data["trace"]}
    assert {"stage": "device", "reason": "needs compute capability 8.0 or newer; device is 7.5", "hint": ""} in (
        trace["triton"]["failures"]
    )
    # Marlin needs 8.0 (vLLM 0.33's Turing build takes float16 activations only, not declared)
    assert {"stage": "device", "reason": "needs compute capability 8.0 or newer; device is 7.5", "hint": ""} in (
        trace["marlin"]["failures"]
    )
