"""llama.cpp (llama-cpp-python) as an oracle for GGUF, and tiny models to convert with it.

The main venv never imports llama_cpp: each call runs scripts/oracles/llamacpp/oracle_side.py
under the Python of ``QSCHEME_LLAMACPP_PYTHON`` (the venv of ``bash scripts/oracle-venv.sh
llamacpp``, which builds llama.cpp for a baseline CPU without FMA contraction so that its
quantizer's results do not depend on the machine), passing arrays as .npy files. Without that
variable the calling test skips.

- ``ggml_quantize`` / ``ggml_dequantize``: ggml's own C quantizer (no importance matrix) and
  dequantizer on given rows.
- ``convert_hf_to_gguf``, ``quantize_gguf``, ``llamacpp_logits``: llama.cpp's converter, its
  whole-model quantizer and its forward pass.
- ``tiny_model``: a tiny random transformers model with a locally trained byte-level BPE
  tokenizer, built in this venv (no downloads).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ENV = "QSCHEME_LLAMACPP_PYTHON"
BUILD_COMMAND = "bash scripts/oracle-venv.sh llamacpp"
SIDE_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "oracles" / "llamacpp" / "oracle_side.py"

# Types ggml_quantize_chunk quantizes without an importance matrix, with gguf.quants.dequantize
# support (ggml's newer Q1_0/Q2_0 are left out: gguf 0.19 cannot dequantize them).
QUANTIZE_TYPES = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_XXS",
    "IQ3_S",
    "IQ2_S",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
    "NVFP4",
)
CONVERT_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def oracle_python() -> str:
    """The llama.cpp venv's Python, or skip the calling test (scripts/test.sh always sets it)."""
    python = os.environ.get(ENV)
    if not python:
        import pytest

        pytest.skip(f"{ENV} is not set: run `{BUILD_COMMAND}` and export {ENV}=<its venv>/bin/python")
    return python


def _run_side(command: str, spec: dict[str, Any], *, timeout: float) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        completed = subprocess.run(
            [oracle_python(), str(SIDE_SCRIPT), command, handle.name],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"},
        )
    finally:
        os.unlink(handle.name)
    if completed.returncode != 0:
        raise RuntimeError(f"llama.cpp oracle `{command}` failed ({completed.returncode}):\n{completed.stderr[-4000:]}")


def _as_numpy(array: Any) -> np.ndarray:
    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().numpy()
    return np.asarray(array)


def _block_size(type_name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return int(GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0])


def _check_type(type_name: str) -> None:
    if type_name not in QUANTIZE_TYPES:
        raise ValueError(
            f"ggml type {type_name!r} is not one this oracle handles; allowed: {', '.join(QUANTIZE_TYPES)}"
        )


def ggml_quantize(weights: Any, type_name: str, *, timeout: float = 300) -> np.ndarray:
    """llama.cpp's quantizer on these exact float32 rows [rows, K]: uint8 [rows, row_bytes]."""
    _check_type(type_name)
    values = np.ascontiguousarray(_as_numpy(weights), dtype=np.float32)
    if values.ndim != 2 or values.shape[1] % _block_size(type_name):
        raise ValueError(
            f"weights of shape {values.shape}: need [rows, K] with K a multiple of {_block_size(type_name)}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        source, result = Path(scratch) / "weights.npy", Path(scratch) / "quantized.npy"
        np.save(source, values)
        _run_side("quantize", {"input": str(source), "type": type_name, "output": str(result)}, timeout=timeout)
        quantized: np.ndarray = np.load(result)
    return quantized


def ggml_dequantize(raw: Any, type_name: str, k: int, *, timeout: float = 300) -> np.ndarray:
    """ggml's C dequantizer (the type traits' to_float) on uint8 rows [rows, row_bytes]: float32 [rows, k]."""
    _check_type(type_name)
    data = np.ascontiguousarray(_as_numpy(raw), dtype=np.uint8)
    if data.ndim != 2:
        raise ValueError(f"raw rows of shape {data.shape}: need [rows, row_bytes]")
    with tempfile.TemporaryDirectory() as scratch:
        source, result = Path(scratch) / "raw.npy", Path(scratch) / "values.npy"
        np.save(source, data)
        spec = {"input": str(source), "type": type_name, "k": int(k), "output": str(result)}
        _run_side("dequantize", spec, timeout=timeout)
        values: np.ndarray = np.load(result)
    return values


def convert_hf_to_gguf(
    model_dir: Path | str,
    out_path: Path | str,
    outtype: str = "f32",
    *,
    pre_tokenizer: str | None = "default",
    timeout: float = 600,
) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a local transformers model folder; returns OUT_PATH.

    ``pre_tokenizer`` replaces its BPE pre-tokenizer hash check (a tiny test tokenizer has no
    known hash); None keeps the check, for a real model's tokenizer.
    """
    if outtype not in CONVERT_OUTTYPES:
        raise ValueError(f"outtype {outtype!r}; allowed: {', '.join(CONVERT_OUTTYPES)}")
    spec = {"model_dir": str(model_dir), "out": str(out_path), "outtype": outtype, "pre_tokenizer": pre_tokenizer}
    _run_side("convert", spec, timeout=timeout)
    return Path(out_path)


def quantize_gguf(src: Path | str, dst: Path | str, ftype: str, *, pure: bool = False, timeout: float = 600) -> Path:
    """llama_model_quantize(SRC, DST) with LLAMA_FTYPE_MOSTLY_<ftype> ("Q4_0", "Q4_K_M", ...); returns DST.

    ``pure`` quantizes every tensor to the ftype's base type instead of llama.cpp's per-tensor mix.
    """
    _run_side("quantize_gguf", {"src": str(src), "dst": str(dst), "ftype": ftype, "pure": pure}, timeout=timeout)
    return Path(dst)


def quantize_gguf_seconds(src: Path | str, dst: Path | str, ftype: str, *, pure: bool = True) -> float:
    """``quantize_gguf`` timed inside the side process: the seconds llama_model_quantize took (one thread)."""
    with tempfile.TemporaryDirectory() as scratch:
        timing = Path(scratch) / "timing.json"
        spec = {"src": str(src), "dst": str(dst), "ftype": ftype, "pure": pure, "timing": str(timing)}
        _run_side("quantize_gguf", spec, timeout=3600)
        return float(json.loads(timing.read_text())["seconds"])


def llamacpp_logits(gguf_path: Path | str, token_ids: Any, *, timeout: float = 600) -> np.ndarray:
    """llama.cpp's logits for TOKEN_IDS, evaluated one token at a time: float32 [len, vocab]."""
    tokens = [int(token) for token in _as_numpy(token_ids).reshape(-1)]
    if not tokens:
        raise ValueError("token_ids is empty")
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "logits.npy"
        _run_side("logits", {"gguf": str(gguf_path), "tokens": tokens, "output": str(result)}, timeout=timeout)
        logits: np.ndarray = np.load(result)
    return logits


# ----------------------------------------------------------------------------- tiny models

TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "How vexingly quick daft zebras jump; 0123456789.",
    "Sphinx of black quartz, judge my vow? Yes: (42) + [7] = {49}.",
)
TOKENIZER_VOCAB = 320  # 256 byte symbols, 3 special tokens and learned merges


def tiny_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer trained here on a fixed corpus, saved to DIRECTORY; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS * 8, trainer)
    # Qwen's tokenizer class (AutoTokenizer picks it for qwen configs) adds <|endoftext|> unless present
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(directory)
    return len(fast)


def _tiny_config(family: str, vocab_size: int) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=64)
    if family == "qwen3_moe":
        moe: dict[str, Any] = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
        }
        return transformers.Qwen3MoeConfig(**common, **moe)  # head_dim 256 / 4
    raise ValueError(f"tiny model family {family!r}; allowed: {', '.join(TINY_FAMILIES)}")


def tiny_model(family: str, directory: Path | str, seed: int = 0) -> Path:
    """A tiny random model of FAMILY (hidden 256, intermediate 512, 2 layers) saved in float32
    with a local tokenizer to DIRECTORY, ready for convert_hf_to_gguf; returns DIRECTORY.

    Every weight's K is 256 or 512, a multiple of the K-quants' 256. ``qwen3_moe`` has 4 experts
    (top 2), which llama.cpp stacks into ``ffn_*_exps``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny model family {family!r}; allowed: {', '.join(TINY_FAMILIES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = tiny_tokenizer(directory)
    config = _tiny_config(family, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory
