"""bitsandbytes 4-bit checkpoints written by transformers' own bitsandbytes integration (the oracle
venv, tests/bitsandbytes_oracle.py): their layout pinned, every layer dequantized bit-identical to
bitsandbytes' own CPU dequantization, both by the producer's own reader (``read_layers``) and by the
loader through the schemes/bitsandbytes/*.yaml descriptors (``load_checkpoint``), a dense model of
those weights and the tiny Llama loaded through ``apply_to_model`` and ``from_pretrained(...,
config=via_qscheme(path))`` equal to transformers' own bitsandbytes loader, and the strict refusals
(missing, orphan and unconsumed tensors, a state or a dtype that disagrees with the config or the
tensors) through both readers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from bitsandbytes_oracle import build_checkpoints, oracle_python
from safetensors.torch import load_file, save_file

from qscheme.checkpoint import apply_to_model, load_checkpoint
from qscheme.checkpoint.resolve import resolve_checkpoint
from qscheme.errors import CheckpointError, QSchemeError
from qscheme.kernels import registry
from qscheme.modules import QuantLinear
from qscheme.producers.bitsandbytes.dequantize import dequantize, unpack_codes
from qscheme.producers.bitsandbytes.read import read_layers

pytestmark = pytest.mark.oracle  # every test here reads what a side venv's process produced

MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
# (N, K) of every quantized Linear of the tiny Llama, from MODEL (head_dim 16: k/v are 2 * 16 rows)
LINEARS = {
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (32, 64),
    "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (128, 64),
    "mlp.up_proj": (128, 64),
    "mlp.down_proj": (64, 128),
}
JOBS = {
    "nf4": {"quant_type": "nf4", "double_quant": False},
    "nf4-dq": {"quant_type": "nf4", "double_quant": True},
    "fp4": {"quant_type": "fp4", "double_quant": False},
    "fp4-dq": {"quant_type": "fp4", "double_quant": True},
    "nf4-dq-bf16": {"quant_type": "nf4", "double_quant": True, "dtype": "bfloat16"},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    python = oracle_python()
    root = tmp_path_factory.mktemp("bitsandbytes")
    jobs = [
        {"dst": str(root / name), "model": MODEL, "seed": index, **job}
        for index, (name, job) in enumerate(JOBS.items())
    ]
    build_checkpoints(jobs, python=python)
    return {name: root / name for name in JOBS}


def _module(linear: str) -> str:
    return f"model.layers.0.{linear}"


# ----------------------------------------------------------------------------- the layout, pinned


@pytest.mark.parametrize("name", list(JOBS))
def test_layout_is_the_documented_one(folders: dict[str, Path], name: str) -> None:
    job = JOBS[name]
    quantized = folders[name] / "quantized"
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config["load_in_4bit"] is True
    assert config["bnb_4bit_quant_type"] == job["quant_type"]
    assert config["bnb_4bit_use_double_quant"] is job["double_quant"]
    tensors = load_file(quantized / "model.safetensors")
    nested = bool(job["double_quant"])
    state_key = f"weight.quant_state.bitsandbytes__{job['quant_type']}"
    for linear, (n, k) in LINEARS.items():
        module = _module(linear)
        own = {key.removeprefix(module + "."): value for key, value in tensors.items() if key.startswith(module + ".")}
        expected = {"weight", "weight.absmax", "weight.quant_map", state_key}
        if nested:
            expected |= {"weight.nested_absmax", "weight.nested_quant_map"}
        assert set(own) == expected, linear
        assert own["weight"].dtype == torch.uint8 and tuple(own["weight"].shape) == (n * k // 2, 1)
        assert tuple(own["weight.absmax"].shape) == (n * k // 64,)
        assert own["weight.absmax"].dtype == (torch.uint8 if nested else torch.float32)
        assert own["weight.quant_map"].dtype == torch.float32 and tuple(own["weight.quant_map"].shape) == (16,)
        state = json.loads(own[state_key].numpy().tobytes().decode())
        assert state["quant_type"] == job["quant_type"] and state["blocksize"] == 64
        assert state["shape"] == [n, k] and state["dtype"] == job.get("dtype", "float32")
        if nested:
            assert state["nested_blocksize"] == 256 and state["nested_dtype"] == "float32"
            assert isinstance(state["nested_offset"], float)
            assert tuple(own["weight.nested_absmax"].shape) == (-(-(n * k // 64) // 256),)
            assert tuple(own["weight.nested_quant_map"].shape) == (256,)
        else:
            assert not any(key.startswith("nested") for key in state)


def test_codes_are_high_nibble_first(folders: dict[str, Path]) -> None:
    """The first element of each byte is its high nibble: decoding low-first disagrees with bitsandbytes."""
    layers = read_layers(folders["nf4"] / "quantized")
    reference = load_file(folders["nf4"] / "reference.safetensors")
    layer = layers[_module("self_attn.q_proj")]
    packed = layer.read("weight")
    swapped = ((packed & 15) << 4) | (packed >> 4)
    expected = reference[f"{layer.module}.dequantized_float32"]
    assert torch.equal(dequantize(layer.state, packed, layer.absmax()), expected)
    assert not torch.equal(dequantize(layer.state, swapped, layer.absmax()), expected)
    assert unpack_codes(torch.tensor([[0x1F]], dtype=torch.uint8), 2).tolist() == [1, 15]


# ----------------------------------------------------------------------------- exact dequantization


@pytest.mark.parametrize("name", list(JOBS))
def test_dequantization_is_bit_identical_to_bitsandbytes(folders: dict[str, Path], name: str) -> None:
    layers = read_layers(folders[name] / "quantized")
    reference = load_file(folders[name] / "reference.safetensors")
    assert sorted(layers) == sorted(_module(linear) for linear in LINEARS)
    dtype = getattr(torch, JOBS[name].get("dtype", "float32"))
    for module, layer in layers.items():
        weight = layer.dequantize()
        assert weight.dtype == torch.float32 and tuple(weight.shape) == LINEARS[module.removeprefix("model.layers.0.")]
        assert _bits(weight) == _bits(reference[f"{module}.dequantized_float32"]), module
        assert torch.equal(weight.to(dtype), reference[f"{module}.dequantized"]), module


def _bits(weight: torch.Tensor) -> bytes:
    """The bytes of a tensor: equal exactly when every value is bit-identical (+0.0 is not -0.0)."""
    return weight.contiguous().view(torch.uint8).numpy().tobytes()


SCHEMES = {"nf4": "NF4", "nf4-dq": "NF4_DQ", "fp4": "FP4", "fp4-dq": "FP4_DQ", "nf4-dq-bf16": "NF4_DQ"}


@pytest.mark.parametrize("name", list(JOBS))
def test_loaded_layers_are_bit_identical_to_bitsandbytes(folders: dict[str, Path], name: str) -> None:
    """load_checkpoint reads the folder through the bitsandbytes/* descriptors (no bitsandbytes code in
    the loader): each QuantLinear dequantizes to bitsandbytes' own CPU float32 dequantization, bit for bit."""
    checkpoint = load_checkpoint(folders[name] / "quantized", kernel="reference")
    reference = load_file(folders[name] / "reference.safetensors")
    assert sorted(checkpoint.modules) == sorted(_module(linear) for linear in LINEARS)
    assert checkpoint.producer == "bitsandbytes"
    for module, layer in checkpoint.modules.items():
        assert isinstance(layer, QuantLinear) and layer.scheme.name == f"bitsandbytes/{SCHEMES[name]}"
        assert (layer.out_features, layer.in_features) == LINEARS[module.removeprefix("model.layers.0.")]
        assert layer.kernel.name == "reference"
        assert _bits(layer.dequantize()) == _bits(reference[f"{module}.dequantized_float32"]), module
    assert not any(".weight." in tensor for tensor in checkpoint.tensors)  # every layer tensor consumed


def test_bitsandbytes_dequantizes_what_qscheme_quantizes(tmp_path: Path) -> None:
    """quantize_weight's tensors for every bitsandbytes scheme, read by bitsandbytes itself (its
    QuantState.from_dict and CPU dequantize_4bit, in the oracle venv): bit-identical to qscheme's own
    dequantization of them, so the layout qscheme writes is the one bitsandbytes reads."""
    from qscheme.canonical import canonicalize, dequantize
    from qscheme.catalog import load_scheme
    from qscheme.quantize import quantize_weight

    python = oracle_python()
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(3)
    for name in ("NF4", "NF4_DQ", "FP4", "FP4_DQ"):
        scheme = load_scheme(f"bitsandbytes/{name}")
        weight = torch.randn(96, 320, generator=generator) * 0.05  # 480 blocks: two nested blocks, one partial
        written = quantize_weight(weight, scheme)
        expected[name] = dequantize(canonicalize(scheme, written))
        tensors.update({f"{name}.{short}": value for short, value in written.items()})
    save_file(tensors, tmp_path / "written.safetensors")
    job = {"kind": "dequantize", "tensors": str(tmp_path / "written.safetensors"), "layers": list(expected)}
    build_checkpoints([{**job, "dst": str(tmp_path / "read.safetensors")}], python=python)
    read = load_file(tmp_path / "read.safetensors")
    for name, weight in expected.items():
        assert _bits(read[name]) == _bits(weight), name


def test_qscheme_quantize_writes_a_checkpoint_that_loads_back(folders: dict[str, Path], tmp_path: Path) -> None:
    """qscheme quantize --scheme bitsandbytes/NF4_DQ of the dense tiny Llama writes a self-described
    checkpoint (bitsandbytes' tensors, qscheme's config) that loads back as those schemes."""
    from qscheme.writing.quantize import quantize_checkpoint

    quantize_checkpoint(folders["nf4-dq"] / "dense", tmp_path / "out", scheme="bitsandbytes/NF4_DQ")
    checkpoint = load_checkpoint(tmp_path / "out", kernel="reference")
    dense = load_file(folders["nf4-dq"] / "dense" / "model.safetensors")
    assert sorted(checkpoint.modules) == sorted(_module(linear) for linear in LINEARS)
    for module, layer in checkpoint.modules.items():
        assert layer.scheme.name == "bitsandbytes/NF4_DQ"
        weight = dense[f"{module}.weight"]
        assert float((layer.dequantize() - weight).abs().max()) <= 0.2 * float(weight.abs().max()), module


def test_resolve_shows_the_codebook_route(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """NF4/FP4 codes index a table: the reference kernel takes them, and on a CPU the cpu_gemv GEMV (where
    its extension is built) for small batches and dequant_gemm for large ones (Triton on a GPU); the int4
    kernels decline, saying why."""
    from qscheme import cpu_gemv

    # as on a fresh install, where Triton does not run on a CPU (unsetting TRITON_INTERPRET instead would
    # leave Triton's driver state broken for the interpreter tests that follow in this process)
    monkeypatch.setenv("QSCHEME_DISABLED_KERNELS", "triton")
    _, decisions = resolve_checkpoint(folders["nf4-dq"] / "quantized", device="cpu")
    for decision in decisions:
        resolution = decision.resolution
        assert resolution is not None and resolution.candidate("reference").accepted
        declined = resolution.candidate("tinygemm_cpu")
        assert not declined.accepted and "scheme has codebook weights" in declined.reason
        plan = [(entry.m_min, entry.kernel.name) for entry in resolution.plan.entries]
        small = "cpu_gemv" if cpu_gemv.available() else "reference"
        # from M = 16, or 5 with bf16 inputs where the tiles run VDPBF16PS dot products (its declaration)
        declared = registry.get_declaration("dequant_gemm").batch_range("cpu", resolution.problem)
        assert declared is not None and declared[0] in (5, 16)
        assert plan == [(0, small), (declared[0], "dequant_gemm")]
    monkeypatch.delenv("QSCHEME_DISABLED_KERNELS")
    _, on_gpu = resolve_checkpoint(folders["nf4-dq"] / "quantized", device="sm90")
    assert {decision.resolution.kernel.name for decision in on_gpu} == {"triton"}  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["nf4", "fp4-dq"])
def test_triton_runs_the_layers_within_its_bound_of_the_reference(
    folders: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton kernel decodes the codes through the table in float32 (TRITON_INTERPRET=1 on a CPU):
    each layer's output matches the reference kernel's within the bound its other weight-only schemes
    meet (tests/triton_samples.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on the CPU only under TRITON_INTERPRET=1")
    from triton_samples import assert_matches

    folder = folders[name] / "quantized"
    reference, triton = load_checkpoint(folder, kernel="reference"), load_checkpoint(folder, kernel="triton")
    inputs = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for module, layer in triton.modules.items():
        assert layer.kernel.name == "triton"
        x = inputs[:, : layer.in_features]
        with torch.no_grad():
            expected, got = reference.modules[module](x), layer(x)
        assert_matches(got, expected.double(), torch.float32, f"{name} {module}")


def _dense(folder: Path) -> Any:
    import transformers

    dense = transformers.AutoModelForCausalLM.from_pretrained(folder / "dense", dtype=torch.float32).eval()
    state = dense.state_dict()
    for module, layer in read_layers(folder / "quantized").items():
        state[f"{module}.weight"] = layer.dequantize()
    dense.load_state_dict(state)
    return dense


@pytest.mark.parametrize("name", ["nf4", "fp4-dq"])
def test_tiny_llama_through_apply_to_model_and_from_pretrained(folders: dict[str, Path], name: str) -> None:
    """Logits through apply_to_model and through from_pretrained(..., config=via_qscheme(path)) equal the
    dense model holding the dequantized weights within 1e-5, and transformers' own bitsandbytes loader
    (its dequantize-then-matmul CPU path, run in the oracle venv)."""
    import transformers

    from qscheme.transformers import via_qscheme

    folder = folders[name] / "quantized"
    reference = load_file(folders[name] / "reference.safetensors")
    tokens = reference["input_ids"]
    with torch.no_grad():
        expected = _dense(folders[name])(tokens).logits
    config = transformers.AutoConfig.from_pretrained(folder)
    del config.quantization_config
    applied = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    apply_to_model(applied, folder, kernel="reference")
    routed = transformers.AutoModelForCausalLM.from_pretrained(folder, config=via_qscheme(folder, kernel="reference"))
    routed.eval()
    for model in (applied, routed):
        assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
        with torch.no_grad():
            logits = model(tokens).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- strictness


def _copy(folders: dict[str, Path], name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(folders[name] / "quantized", target)
    return target


def _edit_tensors(folder: Path, edit: Any) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _state_bytes(state: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


Q_PROJ = _module("self_attn.q_proj")


def _refused_on_load(folder: Path, message: str) -> None:
    """load_checkpoint refuses the folder with a CheckpointError naming the tensor and the rule, and
    loads nothing."""
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(folder)


def test_missing_absmax_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "nf4-dq", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors.pop(f"{Q_PROJ}.weight.absmax"))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight\.absmax is missing.*uint8 \[64\]"):
        read_layers(folder)
    _refused_on_load(folder, r"tensor '[^']*q_proj\.weight\.absmax': missing: scheme bitsandbytes/NF4_DQ declares")


def test_orphan_nested_absmax_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "nf4", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors.update({f"{Q_PROJ}.weight.nested_absmax": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight\.nested_absmax .*orphan"):
        read_layers(folder)
    _refused_on_load(folder, r"tensor '[^']*q_proj\.weight\.nested_absmax': unexpected for scheme bitsandbytes/NF4 ")


def test_unconsumed_tensor_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "fp4", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors.update({f"{Q_PROJ}.weight.SCB": torch.ones(64)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight\.SCB .*unconsumed"):
        read_layers(folder)
    _refused_on_load(folder, r"tensor '[^']*q_proj\.weight\.SCB': unexpected for scheme bitsandbytes/FP4 ")


def test_state_shape_disagreeing_with_the_weight_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "nf4", tmp_path)
    key = f"{Q_PROJ}.weight.quant_state.bitsandbytes__nf4"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        state = json.loads(tensors[key].numpy().tobytes())
        state["shape"] = [64, 128]  # the weight holds [64, 64]
        tensors[key] = _state_bytes(state)

    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has shape \[2048, 1\], expected \[4096, 1\]"):
        read_layers(folder)
    _refused_on_load(
        folder, r"tensor '[^']*q_proj\.weight': expected shape .*\[4096, 1\] for N=64, K=128.*found \[2048, 1\]"
    )


def test_absmax_dtype_disagreeing_with_the_config_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "nf4", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors.update({f"{Q_PROJ}.weight.absmax": torch.ones(64).half()}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight\.absmax is float16, expected float32"):
        read_layers(folder)
    _refused_on_load(folder, r"tensor '[^']*q_proj\.weight\.absmax': expected dtype float32, found float16")


def test_double_quant_disagreeing_with_the_config_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "nf4-dq", tmp_path)
    _edit_config(folder, bnb_4bit_use_double_quant=False)
    with pytest.raises(CheckpointError, match=r"double-quantized absmax .*bnb_4bit_use_double_quant false"):
        read_layers(folder)
    _refused_on_load(folder, r"(?s)weight\.absmax': expected dtype float32, found uint8.*nested_absmax': unexpected")


def test_quant_type_disagreeing_with_the_config_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "fp4", tmp_path)
    _edit_config(folder, bnb_4bit_quant_type="nf4")
    with pytest.raises(CheckpointError, match=r"quant_type 'fp4' but .*bnb_4bit_quant_type 'nf4'"):
        read_layers(folder)
    _refused_on_load(
        folder, r"(?s)bitsandbytes__nf4': missing: scheme bitsandbytes/NF4 .*bitsandbytes__fp4': unexpected"
    )


@pytest.mark.parametrize(
    ("change", "message", "loaded"),
    [
        (
            {"blocksize": 48},
            r"key 'blocksize' is 48; expected one of 32, 64",
            r"key 'blocksize' is 48; this scheme reads 64",
        ),
        (
            {"dtype": "int8"},
            r"key 'dtype' is \"int8\"; expected one of 'float32'",
            r"key 'dtype' is \"int8\"; this scheme reads \"float32\"",
        ),
        (
            {"nested_offset": "x"},
            r"key 'nested_offset' is \"x\"; expected a finite number",
            r"key 'nested_offset' is \"x\"; expected a finite number",
        ),
        (
            {"extra": 1},
            r"key 'extra' is 1; not a key bitsandbytes writes",
            r"key 'extra' is not one this scheme reads \(allowed: shape, quant_type",
        ),
        (
            {"nested_blocksize": None},
            r"key 'nested_blocksize' is null",
            r"key 'nested_blocksize' is null; this scheme reads 256",
        ),
    ],
)
def test_quant_state_is_parsed_strictly(
    folders: dict[str, Path], tmp_path: Path, change: dict[str, Any], message: str, loaded: str
) -> None:
    folder = _copy(folders, "nf4-dq", tmp_path)
    key = f"{Q_PROJ}.weight.quant_state.bitsandbytes__nf4"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        state = json.loads(tensors[key].numpy().tobytes())
        state.update(change)
        tensors[key] = _state_bytes(state)

    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': bitsandbytes quant state: {message}"):
        read_layers(folder)
    _refused_on_load(folder, rf"tensor '{key}': {loaded}")


def test_tampered_quant_map_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(folders, "nf4", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors[f"{Q_PROJ}.weight.quant_map"].mul_(2))
    layer = read_layers(folder)[Q_PROJ]
    with pytest.raises(CheckpointError, match=r"q_proj\.weight\.quant_map' is not bitsandbytes' nf4 table"):
        layer.dequantize()
    _refused_on_load(folder, r"q_proj .*tensor 'weight\.quant_map' is not the scheme's table")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"load_in_8bit": True, "load_in_4bit": False, "_load_in_4bit": False}, r"LLM\.int8 checkpoints"),
        ({"bnb_4bit_quant_type": "int4"}, r"bnb_4bit_quant_type is \"int4\"; expected 'nf4' or 'fp4'"),
        ({"bnb_4bit_quant_storage": "bfloat16"}, r"bnb_4bit_quant_storage is \"bfloat16\""),
    ],
)
def test_config_is_read_strictly(
    folders: dict[str, Path], tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    folder = _copy(folders, "nf4", tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(QSchemeError, match=message):
        read_layers(folder)
    with pytest.raises(QSchemeError, match=message):
        load_checkpoint(folder)


def test_missing_or_corrupt_state_is_refused_on_load(folders: dict[str, Path], tmp_path: Path) -> None:
    key = f"{Q_PROJ}.weight.quant_state.bitsandbytes__nf4"
    folder = _copy(folders, "nf4", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors.pop(key))
    _refused_on_load(folder, rf"tensor '{key}': missing: scheme bitsandbytes/NF4 declares .*\[bytes\] holding JSON")
    _edit_tensors(folder, lambda tensors: tensors.update({key: torch.tensor([1, 2, 3], dtype=torch.uint8)}))
    _refused_on_load(folder, rf"tensor '{key}': its bytes are not UTF-8 JSON")


def test_packed_weight_of_another_shape_is_refused_on_load(folders: dict[str, Path], tmp_path: Path) -> None:
    """The flat [N*K/2, 1] codes stored as a row [1, N*K/2] (transposed) are refused, naming the shape."""
    folder = _copy(folders, "nf4", tmp_path)
    _edit_tensors(folder, lambda tensors: tensors.update({f"{Q_PROJ}.weight": tensors[f"{Q_PROJ}.weight"].T.clone()}))
    _refused_on_load(folder, r"q_proj\.weight': expected shape .*= \[2048\] or \[2048, 1\] .*found \[1, 2048\]")


def test_blocks_straddling_rows_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    """K = 96 is not a multiple of the 64-code blocks: a block would span two rows (and bitsandbytes'
    own CPU kernel decodes such layers unlike its quantizer), so the layer is refused."""
    folder = _copy(folders, "nf4", tmp_path)
    key = f"{Q_PROJ}.weight.quant_state.bitsandbytes__nf4"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        state = json.loads(tensors[key].numpy().tobytes())
        state["shape"] = [32, 96]
        tensors[key] = _state_bytes(state)

    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError, match=r"shape \[32, 96\] with blocksize 64: K is not a multiple"):
        read_layers(folder)
    _refused_on_load(folder, r"weight\.absmax': shape \[N, K/64\] .*does not divide for N=32, K=96")
