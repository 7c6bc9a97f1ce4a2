"""qscheme.load_checkpoint: the Checkpoint object, plain tensors, bias, kernels, the report."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
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

import qscheme
import qscheme.checkpoint.load
from qscheme.checkpoint import Checkpoint, load_checkpoint
from qscheme.checkpoint.load import UnknownModuleError
from qscheme.errors import CheckpointError, UsageError
from qscheme.modules import QuantLinear
from qscheme.storage import Progress


def test_public_entry_points() -> None:
    from qscheme.checkpoint import apply_to_model as checkpoint_apply_to_model

    assert callable(checkpoint_apply_to_model)
    if hasattr(qscheme, "load_checkpoint"):  # exported from the package root by qscheme/__init__.py
        assert qscheme.load_checkpoint is load_checkpoint


def test_checkpoint_maps_module_names_to_quant_linear() -> None:
    folder = ct_checkpoint("NVFP4")
    checkpoint = load_checkpoint(folder, kernel="reference")
    assert isinstance(checkpoint, Checkpoint)
    assert list(checkpoint) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    layer = checkpoint["model.layers.0.self_attn.k_proj"]
    assert isinstance(layer, QuantLinear)
    assert (layer.out_features, layer.in_features) == (64, 128)
    assert layer.kernel.name == "reference"
    plain = load_file(str(folder / "model.safetensors"))
    assert set(checkpoint.tensors) == {
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    }
    for name, value in checkpoint.tensors.items():
        assert torch.equal(value, plain[name])
    assert repr(checkpoint).endswith("7 quantized modules, 5 plain tensors)")


def test_report_says_what_was_done() -> None:
    checkpoint = load_checkpoint(modelopt_fixture("nvfp4_exclude"), kernel="reference", fuse=FUSE)
    report = checkpoint.report
    assert (report.producer, report.producer_version) == ("modelopt", "0.47.0")
    assert report.scheme_counts == {"modelopt/NVFP4": 6}
    assert report.ignored["model.layers.0.mlp.down_proj"] == "model.layers.0.mlp.down_proj"
    fused = {layer.name: layer.fuse.policy for layer in report.fused if layer.fuse is not None}
    assert fused == {"model.layers.0.mlp.gate_up_proj": "shared", "model.layers.0.self_attn.qkv_proj": "shared"}
    assert any("model.layers.1.self_attn.qkv_proj" in note and "left unfused" in note for note in report.notes)
    data = report.as_json()
    json.dumps(data)
    assert data["schemes"] == {"modelopt/NVFP4": 6}
    text = report.render()
    assert "producer: modelopt 0.47.0" in text and "kernels: reference: 3" in text


def test_bias_is_loaded_and_concatenated_for_fused_modules() -> None:
    folder = ct_checkpoint("FP8_DYNAMIC", attention_bias=True)
    state = load_file(str(folder / "model.safetensors"))
    separate = load_checkpoint(folder, kernel="reference", activation_dtype="float32")
    assert torch.equal(separate["model.layers.0.self_attn.q_proj"].bias, state["model.layers.0.self_attn.q_proj.bias"])
    fused = load_checkpoint(folder, kernel="reference", fuse=FUSE, activation_dtype="float32")
    qkv = fused["model.layers.0.self_attn.qkv_proj"]
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert torch.equal(qkv.bias, torch.cat([state[f"{n}.bias"] for n in names]))
    x = torch.randn(1, 3, 128, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qkv(x), torch.cat([separate[n](x) for n in names], dim=-1))
    reference = load_file(str(folder / "reference.safetensors"))
    name = "model.layers.0.self_attn.o_proj"
    expected = reference[f"{name}.output"]
    error = (separate[name](reference[f"{name}.input"]) - expected).abs().max()
    assert float(error) <= 1e-6 * float(expected.abs().max())


def test_unquantized_checkpoint_returns_only_plain_tensors(tmp_path: Path) -> None:
    save_file(
        {"model.embed.weight": torch.zeros(4, 2), "model.proj.weight": torch.ones(2, 2)},
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 2}))
    checkpoint = load_checkpoint(tmp_path)
    assert len(checkpoint) == 0 and set(checkpoint.tensors) == {"model.embed.weight", "model.proj.weight"}
    assert checkpoint.report.producer == "none"


def test_unknown_forced_kernel_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown kernel 'nope' was forced"):
        load_checkpoint(ct_checkpoint("NVFP4A16"), kernel="nope")


def test_unknown_fuse_policy_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as caught:
        load_checkpoint(tmp_path / "missing", kernel="reference", fuse=FUSE, fuse_policy="max")  # nothing is read
    assert str(caught.value) == "fuse_policy: 'max' is not one of per_partition, rescale, requantize, refuse"


def test_an_unknown_module_name_is_a_checkpoint_error_and_a_key_error() -> None:
    folder = ct_checkpoint("NVFP4A16")
    checkpoint = load_checkpoint(folder, kernel="reference")
    with pytest.raises(UnknownModuleError) as caught:
        checkpoint["model.layers.0.self_attn.q_projj"]
    assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, KeyError)
    assert str(caught.value) == (
        f"{folder}: no quantized module 'model.layers.0.self_attn.q_projj' among the checkpoint's 7. Did you mean "
        "'model.layers.0.self_attn.q_proj' or 'model.layers.0.self_attn.v_proj' or 'model.layers.0.self_attn.o_proj'? "
        "Module names carry no trailing '.weight' (e.g. 'model.layers.0.self_attn.q_proj'). Plain tensors "
        "(embeddings, norms, ignored layers) are in checkpoint.tensors, by their full names."
    )
    with pytest.raises(KeyError, match=r"no trailing '\.weight': use checkpoint\['model\.layers\.0\.mlp\.up_proj'\]"):
        checkpoint["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(
        CheckpointError, match=r"plain \(unquantized\) tensor: use checkpoint\.tensors\['lm_head\.weight'\]"
    ):
        checkpoint["lm_head.weight"]
    with pytest.raises(UnknownModuleError, match=r"Did you mean 'model\.layers\.0\.self_attn\.q_proj'\?"):
        checkpoint.canonical("q_proj")
    assert "q_proj" not in checkpoint and checkpoint.get("q_proj") is None
    assert checkpoint.get("model.layers.0.self_attn.q_proj") is checkpoint["model.layers.0.self_attn.q_proj"]
    fused = load_checkpoint(folder, kernel="reference", fuse=FUSE)
    with pytest.raises(UnknownModuleError, match=r"fused into 'model\.layers\.0\.self_attn\.qkv_proj' \(fuse=\)"):
        fused["model.layers.0.self_attn.k_proj"]


@pytest.mark.parametrize(
    ("device", "error"),
    [
        ("bogus", "load_checkpoint(device='bogus'): not a device; pass 'cpu', 'cuda', 'cuda:N' or a torch.device"),
        ("gpu", "load_checkpoint(device='gpu'): not a device; pass 'cpu', 'cuda', 'cuda:N' or a torch.device"),
        (
            None,
            "load_checkpoint(device=None): a device is 'cpu', 'cuda', 'cuda:N' or a torch.device, not of type "
            "NoneType; e.g. device='cpu'",
        ),
        (
            5,
            "load_checkpoint(device=5): a device is 'cpu', 'cuda', 'cuda:N' or a torch.device, not of type int; "
            "e.g. device='cuda:5'",
        ),
        ("meta", "load_checkpoint(device='meta'): nothing can be loaded onto the meta device; pass 'cpu' or 'cuda'"),
    ],
)
def test_a_bad_device_is_a_usage_error_before_anything_is_read(device: object, error: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError) as caught:
        load_checkpoint(tmp_path / "missing", device=device)  # type: ignore[arg-type]
    assert str(caught.value) == error


def test_cuda_without_a_visible_gpu_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        UsageError,
        match=r"load_checkpoint\(device='cuda'\): no CUDA device is visible here .*"
        r"pass device='cpu'",
    ):
        load_checkpoint(tmp_path / "missing", device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match=r"no CUDA device 7 here; 2 visible: pass one of cuda:0, cuda:1"):
        load_checkpoint(tmp_path / "missing", device=torch.device("cuda:7"))


def test_progress_bar_draws_only_when_enabled() -> None:
    stream = io.StringIO()
    with Progress(3, "loading", enabled=True, stream=stream) as bar:
        for name in ("a", "b", "c"):
            bar.advance(item=name)
    assert "loading [" in stream.getvalue() and "3/3" in stream.getvalue()
    quiet = io.StringIO()
    with Progress(3, "loading", enabled=False, stream=quiet) as bar:
        bar.advance()
    assert quiet.getvalue() == ""


def test_a_path_that_is_not_a_path_and_an_empty_scheme_list_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="path must be a folder path \\(str or Path\\), not NoneType"):
        load_checkpoint(None)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"schemes=\[\]\): no scheme to detect with"):
        load_checkpoint(modelopt_fixture("nvfp4"), schemes=[])


# ---------------------------------------------------------------------------- the files after loading

_AFTER_LOAD = """
import sys, torch
from pathlib import Path
from qscheme.checkpoint import load_checkpoint

folder, mode, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
checkpoint = load_checkpoint(folder)
path = folder / "model.safetensors"
size = path.stat().st_size
with path.open("r+b") as handle:  # in place (same inode), as a crashed copy or a re-download would leave it
    if mode == "truncate":
        handle.truncate(size // 3)
    else:
        handle.write(bytes(range(256)) * (size // 256))
results = {}
for name, layer in checkpoint.items():  # the first forward prepares the kernel: after the change
    x = torch.linspace(-2, 2, 3 * layer.in_features).reshape(3, layer.in_features)
    results[name + ".forward"] = layer(x)
    results[name + ".dequantize"] = layer.dequantize()
results.update(checkpoint.tensors)
torch.save(results, out)
"""


@pytest.mark.parametrize("mode", ["truncate", "rewrite"])
@pytest.mark.subprocess
def test_changing_the_files_after_load_neither_crashes_nor_changes_the_modules(tmp_path: Path, mode: str) -> None:
    # A memory-mapped module would die of SIGBUS here (truncate) or compute with other weights (rewrite):
    # loading copies what the modules keep, so the files may change or go once load returns.
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "checkpoint")
    out = tmp_path / "results.pt"
    run = subprocess.run(
        [sys.executable, "-c", _AFTER_LOAD, str(folder), mode, str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"exit {run.returncode} (-{int(signal.SIGBUS)} is SIGBUS): {run.stderr[-2000:]}"
    results = torch.load(out)
    checkpoint = load_checkpoint(ct_checkpoint("NVFP4"))
    for name, layer in checkpoint.items():
        x = torch.linspace(-2, 2, 3 * layer.in_features).reshape(3, layer.in_features)
        assert torch.equal(results[name + ".forward"], layer(x)), name
        assert torch.equal(results[name + ".dequantize"], layer.dequantize()), name
    for name, value in checkpoint.tensors.items():
        assert torch.equal(results[name], value), name


def test_a_file_truncated_while_loading_is_an_error_with_nothing_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = copy_checkpoint(ct_checkpoint("NVFP4"), tmp_path / "checkpoint")
    path = folder / "model.safetensors"
    planned = qscheme.checkpoint.load.plan_checkpoint

    def plan_then_truncate(*args: object, **kwargs: object) -> object:
        plan = planned(*args, **kwargs)  # type: ignore[arg-type]
        with path.open("r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
        return plan

    built: list[object] = []
    monkeypatch.setattr(qscheme.checkpoint.load, "plan_checkpoint", plan_then_truncate)
    monkeypatch.setattr(QuantLinear, "from_canonical", classmethod(lambda cls, *a, **k: built.append(a)))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(folder)
    assert f"{path}: tensor '" in str(caught.value)
    assert "cannot be read: its size changed from" in str(caught.value)
    assert built == []
