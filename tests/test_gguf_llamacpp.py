"""GGUF files written by llama.cpp itself: qscheme's logits against a dense model and against llama.cpp.

A tiny random transformers model (tests/llamacpp_oracle.py's ``tiny_model``) is converted by
llama.cpp's ``convert_hf_to_gguf.py`` and quantized by ``llama_model_quantize`` (its own per-tensor
mix: Q4_0 keeps ``output.weight`` at Q6_K, Q4_K_M mixes Q4_K and Q6_K). For each file, qscheme's
float32 model (``from_gguf`` and ``apply_to_model``) must give

- the logits of a dense model holding the weights transformers' own GGUF loader dequantizes
  (gguf-py's dequantizer, transformers' name map and q/k row order), within 1e-4: the weights
  are the same numbers, only the order of float operations may differ;
- llama.cpp's own logits (token by token) within what llama.cpp's activation quantization
  explains: its quantized dot products quantize the activations to 8 bits (Q8_0 / Q8_K), a
  relative error of 1.6% to 3.3% here (see ``LLAMACPP_RELATIVE_TOLERANCE``), and strictly enough
  that a wrong weight shows: the correlation of the logits and their argmax per position.
  ``test_the_llamacpp_check_catches_a_wrong_weight`` shows that the same check refuses a dense
  model with llama's q/k rows left in llama.cpp's order or one projection scaled by 10%.

The tiny models' projections are scaled by ``LAYER_GAIN`` before conversion: with transformers'
default initialisation (std 0.02) the layers barely change the residual stream and attention is
almost uniform, so that a permuted q/k would hide in llama.cpp's noise.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llamacpp_oracle as oracle
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import qscheme  # noqa: E402
import qscheme.errors  # noqa: E402
from qscheme.modules import QuantExperts, QuantLinear  # noqa: E402

pytestmark = [pytest.mark.oracle, pytest.mark.filterwarnings("ignore::UserWarning")]

LAYER_GAIN = 4.0
TOKENS = [0, 17, 200, 5, 99, 42, 250, 3, 64, 128, 11, 300, 7, 7, 7, 19]
DENSE_TOLERANCE = 1e-4
# Against llama.cpp, measured on these files: max |qscheme - llama.cpp| / max |llama.cpp| 1.6% ..
# 3.3%, correlation 0.99954 .. 0.99991, argmax agreement 14/16 .. 16/16; one projection of one
# layer scaled by 1.1 gives 6.9% / 0.99838 and 7.2% / 0.99794, llama's q/k rows in the file's
# order 102% / 0.762 (test_the_llamacpp_check_catches_a_wrong_weight).
LLAMACPP_RELATIVE_TOLERANCE = 0.05
LLAMACPP_MIN_CORRELATION = 0.999
LLAMACPP_MIN_ARGMAX_AGREEMENT = 0.75
# A routing decision closer than this (gap / spread of the router logits) could flip in llama.cpp.
MIN_ROUTING_MARGIN = 0.025
# The tiny models: name -> (tests/llamacpp_oracle.py family, seed, config changes). The MoE's seed
# was picked for routing margins above MIN_ROUTING_MARGIN in its three files (0.033 .. 0.042; seed
# 7's Q4_K_M file has a gap of 0.005 where llama.cpp chose the other expert). "qwen3" has Qwen3's
# usual head_dim of 128; "qwen3-head64" the oracle's 64 (transformers' qwen3 table reads no
# attention.key_length: checkpoint.gguf_names sets head_dim from it).
MODELS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "llama": ("llama", 7, {}),
    "mistral": ("mistral", 7, {}),
    "qwen2": ("qwen2", 7, {}),
    "qwen3": ("qwen3", 7, {"head_dim": 128}),
    "qwen3-head64": ("qwen3", 7, {}),
    "qwen3_moe": ("qwen3_moe", 24, {}),
}

# (family, llama.cpp ftype, ggml types llama.cpp's mix gives the 2-D weights of the layers)
CASES = [
    ("llama", "Q4_0", {"Q4_0"}),
    ("llama", "Q8_0", {"Q8_0"}),
    ("llama", "Q4_K_M", {"Q4_K", "Q6_K"}),
    ("qwen3_moe", "Q4_0", {"Q4_0"}),
    ("qwen3_moe", "Q8_0", {"Q8_0"}),
    ("qwen3_moe", "Q4_K_M", {"Q4_K", "Q6_K"}),
    ("mistral", "Q8_0", {"Q8_0"}),
    ("qwen2", "Q4_0", {"Q4_0"}),
    ("qwen3", "Q8_0", {"Q8_0"}),
    ("qwen3-head64", "Q8_0", {"Q8_0"}),
]
CASE_PARAMS = [pytest.param(*case, id=f"{case[0]}-{case[1]}") for case in CASES]


@dataclass
class Files:
    """llama.cpp's files, made once per module: one conversion per family, one quantization per case."""

    root: Path
    converted: dict[str, Path] = field(default_factory=dict)
    quantized: dict[tuple[str, str], Path] = field(default_factory=dict)
    llamacpp: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)

    def source(self, family: str) -> Path:
        """The transformers model folder the family's files were converted from."""
        return self.root / family

    def f32(self, family: str) -> Path:
        if family not in self.converted:
            oracle_family, seed, changes = MODELS[family]
            model_dir = oracle.tiny_model(oracle_family, self.source(family), seed=seed)
            _amplify(model_dir, seed, changes)
            self.converted[family] = oracle.convert_hf_to_gguf(model_dir, self.root / f"{family}-f32.gguf", "f32")
        return self.converted[family]

    def file(self, family: str, ftype: str) -> Path:
        key = (family, ftype)
        if key not in self.quantized:
            self.quantized[key] = oracle.quantize_gguf(self.f32(family), self.root / f"{family}-{ftype}.gguf", ftype)
        return self.quantized[key]

    def llamacpp_logits(self, family: str, ftype: str) -> np.ndarray:
        """llama.cpp's logits of TOKENS for the file of (family, ftype)."""
        key = (family, ftype)
        if key not in self.llamacpp:
            self.llamacpp[key] = oracle.llamacpp_logits(self.file(family, ftype), TOKENS)
        return self.llamacpp[key]


def _amplify(model_dir: Path, seed: int, changes: dict[str, Any]) -> None:
    """Scale every projection of the layers by LAYER_GAIN (not the MoE router) and save in place;
    with config CHANGES, a new random model of the changed config first."""
    if changes:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        for key, value in changes.items():
            setattr(config, key, value)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".layers." in name and parameter.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                parameter.mul_(LAYER_GAIN)
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Files]:
    oracle.oracle_python()  # skip before building anything when the oracle is missing
    yield Files(tmp_path_factory.mktemp("llamacpp_gguf"))


def _logits(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        logits: np.ndarray = model(torch.tensor([TOKENS])).logits[0].numpy()
    return logits


def dense_model(path: Path, source: Path) -> Any:
    """A float32 model of the source model's config holding transformers' own dequantized tensors
    of the file (its GGUF loader). The config is the source's: transformers' GGUF config table
    leaves out the experts' width (moe_intermediate_size)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    if meta.config.model_type == "mistral":
        meta.config.model_type = "llama"  # llama.cpp writes Mistral as llama; transformers maps names by model type
    with contextlib.redirect_stderr(io.StringIO()):
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict({name: value.float() for name, value in tensors.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def layer_types(path: Path) -> set[str]:
    """The ggml types of the file's 2-D/3-D weights inside the blocks (not the router)."""
    return {
        tensor.tensor_type.name
        for tensor in gguf.GGUFReader(path).tensors
        if tensor.name.startswith("blk.") and len(tensor.shape) >= 2 and ".ffn_gate_inp." not in tensor.name
    }


@dataclass(frozen=True)
class Agreement:
    relative: float  # max |got - expected| / max |expected|
    correlation: float
    argmax: float  # share of positions with the same argmax

    def __str__(self) -> str:
        return f"relative {self.relative:.4f}, correlation {self.correlation:.6f}, argmax {self.argmax:.3f}"

    @property
    def explained_by_activation_quantization(self) -> bool:
        return (
            self.relative <= LLAMACPP_RELATIVE_TOLERANCE
            and self.correlation >= LLAMACPP_MIN_CORRELATION
            and self.argmax >= LLAMACPP_MIN_ARGMAX_AGREEMENT
        )


def agreement(got: np.ndarray, expected: np.ndarray) -> Agreement:
    assert got.shape == expected.shape and np.isfinite(got).all() and np.isfinite(expected).all()
    return Agreement(
        relative=float(np.abs(got - expected).max() / np.abs(expected).max()),
        correlation=float(np.corrcoef(got.ravel(), expected.ravel())[0, 1]),
        argmax=float((got.argmax(-1) == expected.argmax(-1)).mean()),
    )


def routing_margin(model: Any) -> float:
    """The smallest gap, over positions and MoE layers, between the router logits of the last
    chosen expert and the first unchosen one, relative to the router logits' spread (inf: no MoE)."""
    margins: list[float] = []

    def measure(router: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
        logits = hidden @ router.weight.T
        ranked = logits.sort(dim=-1, descending=True).values
        chosen = model.config.num_experts_per_tok
        margins.append(float((ranked[:, chosen - 1] - ranked[:, chosen]).min() / logits.std()))

    routers = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [router.register_forward_hook(measure) for router in routers]
    try:
        _logits(model)
    finally:
        for hook in hooks:
            hook.remove()
    return min(margins, default=float("inf"))


@pytest.mark.parametrize(("family", "ftype", "types"), CASE_PARAMS)
def test_apply_to_model_logits_equal_the_dense_model_and_match_llamacpp(
    files: Files, family: str, ftype: str, types: set[str]
) -> None:
    path = files.file(family, ftype)
    assert layer_types(path) == types  # llama.cpp's mix is the one this case is about
    expected = _logits(dense_model(path, files.source(family)))

    torch.manual_seed(2)  # a model of the source's config, as its user holds it, with other random weights
    config = transformers.AutoConfig.from_pretrained(files.source(family))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    before = _logits(model)
    qscheme.apply_to_model(model, path)
    got = _logits(model)
    assert np.abs(before - expected).max() > 1e-2  # the random model differs: the load did the work
    np.testing.assert_allclose(got, expected, rtol=0, atol=DENSE_TOLERANCE)
    assert isinstance(dict(model.named_modules())["model.layers.0.self_attn.q_proj"], QuantLinear)

    # An expert choice closer than llama.cpp's noise could go either way there and change every
    # later position: the MoE seed was picked for routing margins well above it (measured 0.06+).
    assert routing_margin(model) > MIN_ROUTING_MARGIN
    measured = agreement(got, files.llamacpp_logits(family, ftype))
    print(f"\n{family} {ftype}: vs dense max abs {np.abs(got - expected).max():.2e}; vs llama.cpp {measured}")
    assert measured.explained_by_activation_quantization, f"{family} {ftype} against llama.cpp: {measured}"


@pytest.mark.parametrize(("family", "ftype", "types"), CASE_PARAMS)
def test_from_gguf_logits_equal_the_dense_model(files: Files, family: str, ftype: str, types: set[str]) -> None:
    from qscheme.transformers import from_gguf

    path = files.file(family, ftype)
    expected = _logits(dense_model(path, files.source(family)))
    loaded = from_gguf(path, dtype=torch.float32)
    np.testing.assert_allclose(_logits(loaded), expected, rtol=0, atol=DENSE_TOLERANCE)

    # the quantized layers stay quantized, in the file's types
    modules = dict(loaded.named_modules())
    assert isinstance(modules["model.layers.0.self_attn.q_proj"], QuantLinear)
    schemes = {row.scheme for row in loaded.qscheme_checkpoint.report.layers if row.name.startswith("model.layers.")}
    assert schemes == {f"gguf/{kind}" for kind in types}
    if family == "qwen3_moe":
        assert isinstance(modules["model.layers.1.mlp.experts"], QuantExperts)


def _llamacpp_order(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (rows of each head interleaved in pairs)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weights.shape)


@pytest.mark.parametrize("wrong", ["q/k rows in llama.cpp's order", "v_proj scaled by 1.1", "down_proj scaled by 1.1"])
def test_the_llamacpp_check_catches_a_wrong_weight(files: Files, wrong: str) -> None:
    path = files.file("llama", "Q8_0")
    expected = files.llamacpp_logits("llama", "Q8_0")
    model = dense_model(path, files.source("llama"))
    assert agreement(_logits(model), expected).explained_by_activation_quantization  # right weights pass
    config, layer = model.config, model.model.layers[0]  # one weight of the first layer wrong
    attention = layer.self_attn
    with torch.no_grad():
        if wrong.startswith("q/k"):
            attention.q_proj.weight.copy_(_llamacpp_order(attention.q_proj.weight, config.num_attention_heads))
            attention.k_proj.weight.copy_(_llamacpp_order(attention.k_proj.weight, config.num_key_value_heads))
        elif wrong.startswith("v_proj"):
            attention.v_proj.weight.mul_(1.1)
        else:
            layer.mlp.down_proj.weight.mul_(1.1)
    measured = agreement(_logits(model), expected)
    print(f"\nllama Q8_0 with {wrong}: vs llama.cpp {measured}")
    assert not measured.explained_by_activation_quantization, f"{wrong} passed: {measured}"
