"""`qscheme inspect`, `qscheme resolve CHECKPOINT`, `qscheme run`, and the README's example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_cache import (
    copy_checkpoint,
    ct_checkpoint,
    modelopt_fixture,
    single_threaded_torch,  # noqa: F401  (autouse)
)
from safetensors.torch import load_file, save_file

from qscheme.cli.main import main
from qscheme.examples.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("example") / "tiny-nvfp4", layers=1)


def test_inspect_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(modelopt_fixture("nvfp4_exclude"))]) == 0
    out = capsys.readouterr().out
    assert "producer: modelopt 0.47.0 (hf_quant_config.json)" in out
    assert "quantized modules: 6 (modelopt/NVFP4: 6)" in out
    assert "model.layers.*.self_attn.q_proj  modelopt/NVFP4  128x128  1" in out
    assert "ignored modules (10): lm_head ('lm_head')" in out
    assert "problems: none" in out


def test_inspect_json_lists_every_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(ct_checkpoint("W4A16")), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["producer"]["name"] == "compressed-tensors" and data["ok"] is True
    assert data["schemes"] == {"compressed-tensors/W4A16": 7}
    row = next(m for m in data["modules"] if m["module"] == "model.layers.0.mlp.down_proj")
    assert (row["n"], row["k"], row["scheme"]) == (128, 256, "compressed-tensors/W4A16")


def test_inspect_lists_problems_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "broken")
    tensors = {k: v.clone() for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors["model.layers.0.mlp.up_proj.weight_global_scale"] = torch.tensor([0.0])
    del tensors["model.layers.0.self_attn.o_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    assert main(["inspect", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "problems (2):" in out
    assert "tensor 'model.layers.0.self_attn.o_proj.weight_scale': missing" in out
    assert "tensor 'model.layers.0.mlp.up_proj.weight_global_scale': expected a finite scale > 0, found 0.0" in out


def test_inspect_of_an_unreadable_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "broken")
    (folder / "config.json").write_text("{")
    assert main(["inspect", str(folder)]) == 1
    assert "config.json:1:2: invalid JSON" in capsys.readouterr().out


def test_resolve_checkpoint_groups_identical_decisions(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", str(example), "--device", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "device: cuda (simulated sm100" in out
    assert "model.layers.*.self_attn.q_proj  compressed-tensors/NVFP4  256x256  1" in out
    assert "7 of 7 layers have a kernel" in out and "NONE" not in out


def test_resolve_checkpoint_without_kernel_explains(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qscheme.kernels.registry import declarations

    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", ",".join(d.name for d in declarations()))
    assert main(["resolve", str(modelopt_fixture("w4a8_nvfp4_fp8")), "--device", "sm90"]) == 1
    out = capsys.readouterr().out
    assert "0 of 7 layers have a kernel" in out
    assert out.count("no kernel can run layer") == 1  # one explanation for the whole scheme
    assert "(the same kernels reject the other 6 layer(s) of this scheme at the same stages)" in out


def test_resolve_checkpoint_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["resolve", str(ct_checkpoint("W4A16")), "--device", "sm90", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["layers"]) == 7 and None not in {layer["kernel"] for layer in data["layers"]}
    assert data["groups"][0]["problem"]["n"] == 128 and data["groups"][0]["count"] == 1


def test_run_example_with_reference_kernel(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(example), "--kernel", "reference"]) == 0
    out = capsys.readouterr().out
    assert "7 of 7 layers within tolerance 0.02 (bfloat16 inputs, 8 rows, device cpu)" in out
    assert "model.layers.0.self_attn.q_proj  compressed-tensors/NVFP4  reference  256x256" in out


def test_run_json_and_failure_beyond_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(ct_checkpoint("FP8_DYNAMIC"))
    assert main(["run", folder, "--kernel", "reference", "--dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["failed"] == 0 and all(layer["max_relative_error"] == 0.0 for layer in data["layers"])
    # bf16 outputs are rounded: a tiny tolerance fails every layer
    assert main(["run", folder, "--kernel", "reference", "--tolerance", "1e-30"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_run_refuses_a_simulated_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(ct_checkpoint("FP8")), "--device", "sm90"]) == 2
    assert "needs a real device" in capsys.readouterr().err


def test_example_generator_writes_a_deterministic_compressed_tensors_checkpoint(example: Path, tmp_path: Path) -> None:
    again = make_checkpoint(tmp_path / "again", layers=1)
    assert (again / "model.safetensors").read_bytes() == (example / "model.safetensors").read_bytes()
    config = json.loads((example / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["producer"]["name"] == "qscheme.examples.make_checkpoint"


@pytest.mark.parametrize(
    ("extra", "flags"),
    [(["--shape", "5,5"], "--shape"), (["--partitions", "3", "--scales-differ"], "--partitions and --scales-differ")],
)
def test_resolve_checkpoint_refuses_layer_options(
    example: Path, extra: list[str], flags: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["resolve", str(example), *extra]) == 2
    assert f"{flags}: not for a checkpoint folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["resolve", "{folder}", "--dtype", "int8"], "activation dtype 'int8' is not supported"),
        (["run", "{folder}", "--dtype", "int8"], "activation dtype 'int8' is not supported"),
    ],
)
def test_checkpoint_commands_report_bad_dtypes_without_a_traceback(
    example: Path, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.format(folder=example) for a in arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_run_on_cuda_without_a_gpu_is_a_usage_error(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(example), "--device", "cuda"]) == 2
    assert "no CUDA device is visible here" in capsys.readouterr().err


def test_example_generator_reports_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qscheme.examples.make_checkpoint import main as generate

    assert generate([str(tmp_path / "x"), "--scheme", "no/such"]) == 2  # an input that cannot be found
    assert "unknown scheme 'no/such'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_example_generator_never_overwrites(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qscheme.examples.make_checkpoint import main as generate

    before = {p.name: p.read_bytes() for p in example.iterdir()}
    assert generate([str(example), "--layers", "2"]) == 2
    err = capsys.readouterr().err
    assert "the folder exists and is not empty; choose a new folder" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in example.iterdir()} == before
    assert generate([str(example / "config.json")]) == 2
    assert "exists and is not a folder; choose a new folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generate([str(empty), "--layers", "1"]) == 0  # an empty folder is fine
    assert (empty / "config.json").is_file()


def test_run_treats_cpu_n_as_cpu(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(example), "--kernel", "reference", "--device", "cpu:0"]) == 0
    assert "7 of 7 layers within tolerance 0.02 (bfloat16 inputs, 8 rows, device cpu)" in capsys.readouterr().out


class _RaisingKernel:
    def prepare(self, weight: object, device: object) -> None:
        raise ValueError("prepare exploded")

    def apply(self, state: object, x: torch.Tensor, bias: object) -> torch.Tensor:
        return x


class _NarrowKernel:
    def prepare(self, weight: object, device: object) -> None:
        return None

    def apply(self, state: object, x: torch.Tensor, bias: object) -> torch.Tensor:
        return x[..., :3]


def _kernel_plugin(name: str, implementation: str) -> object:
    from dataclasses import replace

    from qscheme_plugins.reference import REFERENCE

    from qscheme.plugins import hookimpl

    class Plugin:
        @hookimpl
        def qscheme_kernels(self) -> list[object]:
            return [replace(REFERENCE, name=name, implementation=f"{__name__}:{implementation}")]

    return Plugin()


@pytest.mark.parametrize(
    ("implementation", "reason"),
    [
        ("_RaisingKernel", "failed in prepare() for layer {layer}: ValueError: prepare exploded"),
        ("_NarrowKernel", "returned [8, 3] torch.bfloat16 from apply() for layer {layer}; expected [8, 256]"),
    ],
)
def test_run_reports_a_failing_kernel_per_layer(
    example: Path, implementation: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernel_fakes import isolated_plugins

    with isolated_plugins() as plugins:
        plugins.register(_kernel_plugin("broken", implementation), "broken_plugin")  # type: ignore[attr-defined]
        assert main(["run", str(example), "--kernel", "broken"]) == 1
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        layer = "model.layers.0.mlp.down_proj"
        expected = "kernel 'broken' (plugin broken_plugin) " + reason.format(layer=layer)
        assert expected in captured.out
        assert captured.out.count("FAIL") == 7 and "0 of 7 layers within tolerance" in captured.out
        assert main(["run", str(example), "--kernel", "broken", "--json"]) == 1
        data = json.loads(capsys.readouterr().out)
    assert data["failed"] == 7
    row = data["layers"][0]
    assert row["ok"] is False and row["max_relative_error"] is None and expected in row["failure"]


def test_run_on_a_checkpoint_without_quantized_layers_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(8, 16)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 of 0 layers within tolerance" in out
    assert (
        "note: no quantized layers: the checkpoint's config declares no quantization, or every layer is ignored "
        f"(see `qscheme inspect {tmp_path}`); nothing was run"
    ) in out


# ---------------------------------------------------------------- names that try to forge output lines


def _forged(text: str) -> list[str]:
    """Lines a checkpoint's file name managed to start: each forged name starts one with FAKE."""
    return [line for line in text.splitlines() if line.lstrip(" -").startswith("FAKE")]


def _indexed(folder: Path, shard: str) -> dict[str, str]:
    """The NVFP4 example's tensors, all in one shard named ``shard``, listed by an index."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").rename(folder / shard)
    weight_map = dict.fromkeys(tensors, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def missing_shard(folder: Path) -> None:
    weight_map = _indexed(folder, "model-00001-of-00001.safetensors")
    weight_map["lm_head.weight"] = "x\nFAKE problems: none\nFAKE.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def no_weights_but_a_newline_name(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "a\nFAKE LINE.safetensors")


def corrupt_shard_with_a_newline_name(folder: Path) -> None:
    _indexed(folder, "x\nFAKE.safetensors")
    with (folder / "x\nFAKE.safetensors").open("ab") as handle:
        handle.write(bytes(16))  # trailing bytes: the header check names the file


@pytest.mark.parametrize(
    ("corrupt", "said"),
    [
        (missing_shard, r"x\nFAKE problems: none\nFAKE.safetensors does not exist"),
        (no_weights_but_a_newline_name, r"found a\nFAKE LINE.safetensors"),
        (corrupt_shard_with_a_newline_name, r"x\nFAKE.safetensors: the last tensor"),
    ],
    ids=["missing shard", "no weights", "corrupt shard"],
)
def test_a_file_name_from_the_checkpoint_cannot_forge_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], corrupt: object, said: str
) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "checkpoint")
    corrupt(folder)  # type: ignore[operator]
    for command in ("inspect", "run"):
        assert main([command, str(folder)]) != 0
        captured = capsys.readouterr()
        output = captured.out + captured.err
        assert said in output, output
        assert _forged(output) == [], output


def test_a_stray_file_name_in_a_note_cannot_forge_a_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "checkpoint")
    _indexed(folder, "model-00001-of-00001.safetensors")
    (folder / "b\nFAKE NOTE.safetensors").write_bytes(b"")
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert r"note: b\nFAKE NOTE.safetensors is not mentioned by model.safetensors.index.json" in out
    assert _forged(out) == [], out


def test_inspect_counts_repeated_notes_instead_of_printing_each() -> None:
    """Thousands of re: targets that match nothing are a few note lines and a count."""
    from qscheme.checkpoint.inspect import inspect_checkpoint, render_inspection

    folder = Path(__file__).resolve().parent / "fixtures" / "modelopt" / "nvfp4"
    inspection = inspect_checkpoint(folder)
    inspection.unused_targets = [f"group_0 target 're:x{i}$'" for i in range(5000)]
    lines = render_inspection(inspection).splitlines()
    notes = [line for line in lines if line.startswith("note: ")]
    assert notes == [f"note: group_0 target 're:x{i}$' matches no module" for i in range(3)]
    assert "      ... and 4,997 more like this" in lines
    assert len(lines) < 40
