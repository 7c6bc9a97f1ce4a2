"""The metadata of an exported GGUF: architecture, hyper-parameters and tokenizer.

- ``model_metadata``: ``general.*`` and the architecture's hyper-parameters from config.json,
  through transformers' GGUF config table (``integrations.ggml.GGUF_CONFIG_MAPPING``) read
  backwards, so that the keys are those transformers (and qscheme's GGUF loader) read; plus the
  widths llama.cpp needs that the table leaves out (``attention.key_length`` /
  ``value_length`` from ``head_dim``, the expert widths of ``gguf_names.EXPERT_WIDTHS``).
  Integers are written as UINT32 and reals as FLOAT32, as llama.cpp's converter writes these keys.
  A rope scaling other than the default is refused: llama.cpp needs keys (and for llama 3 a
  ``rope_freqs`` tensor) this export does not write.
- ``tokenizer_metadata``: the folder's tokenizer through gguf-py's own vocab readers
  (``gguf.vocab``: byte-level BPE, llama's byte-fallback BPE, SentencePiece) and
  ``SpecialVocab`` (merges, special token ids, add_bos/eos, chat template), collected through a
  ``GGUFWriter`` that never writes a file. No tokenizer is MissingTokenizerError.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qscheme.checkpoint.gguf_names import EXPERT_WIDTHS
from qscheme.errors import CheckpointError, InputError
from qscheme.storage import GGUFMetadataValue
from qscheme.text import shown, shown_file

__all__ = ["QUANTIZATION_VERSION", "MissingTokenizerError", "model_metadata", "tokenizer_metadata"]

QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION: the block layouts of the current types
_HEAD_DIM_KEYS = ("attention.key_length", "attention.value_length")


class MissingTokenizerError(CheckpointError, InputError):
    """The folder holds no tokenizer gguf-py can read (exit code 2)."""


def _rope_theta(config: Any) -> Any:
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = getattr(config, "rope_theta", None)
    return theta if theta is not None else parameters.get("rope_theta") if isinstance(parameters, dict) else None


def _check_rope(folder: Path, config: Any) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else "default"
        if kind != "default":
            raise CheckpointError(
                f"{shown_file(folder / 'config.json')}: {key}.rope_type is {shown(repr(kind), 40)}; the GGUF export "
                "writes only the default rotary embedding (llama.cpp needs scaling keys, and for llama3 a rope_freqs "
                "tensor, that it does not write). Convert this model with llama.cpp's convert_hf_to_gguf.py"
            )


def _typed(where: str, value: Any) -> GGUFMetadataValue:
    if isinstance(value, bool):
        return ("BOOL", value)
    if isinstance(value, int):
        return ("UINT32", value)
    if isinstance(value, float):
        return ("FLOAT32", value)
    if isinstance(value, str):
        return ("STRING", value)
    raise CheckpointError(f"config.json: {where} is {shown(repr(value), 60)}, which no GGUF key holds; fix config.json")


def model_metadata(
    folder: Path, config: Any, model_type: str, architecture: str, name: str, file_type: int | None
) -> dict[str, GGUFMetadataValue]:
    """``general.*`` and the hyper-parameters of transformers config ``config`` (see the module docstring)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    _check_rope(folder, config)
    out: dict[str, GGUFMetadataValue] = {
        "general.architecture": ("STRING", architecture),
        "general.name": ("STRING", name),
        "general.quantization_version": ("UINT32", QUANTIZATION_VERSION),
    }
    if file_type is not None:  # llama.cpp's llama_ftype; informative only (llama.cpp guesses it when absent)
        out["general.file_type"] = ("UINT32", file_type)
    table: dict[str, str | None] = dict(GGUF_CONFIG_MAPPING.get(model_type, {}))  # type: ignore[call-overload]
    for key, attribute in table.items():
        if attribute is None:
            continue
        value = _rope_theta(config) if attribute == "rope_theta" else getattr(config, attribute, None)
        if value is not None:
            out[f"{architecture}.{key}"] = _typed(attribute, value)
    head_dim = getattr(config, "head_dim", None)
    for key in _HEAD_DIM_KEYS:
        if isinstance(head_dim, int) and f"{architecture}.{key}" not in out:
            out[f"{architecture}.{key}"] = ("UINT32", head_dim)
    for key, attribute in EXPERT_WIDTHS.items():
        value = getattr(config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and getattr(config, "num_experts", None):
            out[f"{architecture}.{key}"] = ("UINT32", value)
    return out


# --- the tokenizer ------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """gguf-py logs every special token it sets; transformers may print while loading a tokenizer."""
    logger = logging.getLogger("gguf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _vocab(folder: Path) -> Any:
    """gguf-py's first vocab reader that accepts the folder's files, or None."""
    from gguf import vocab

    kinds: list[Any] = [vocab.BpeVocab, vocab.LlamaHfVocab]
    if (folder / "tokenizer.model").is_file():
        kinds.append(vocab.SentencePieceVocab)
    for kind in kinds:
        try:
            return kind(folder)
        except (FileNotFoundError, TypeError):
            continue
        except (ImportError, RuntimeError) as exc:  # SentencePiece's reader needs the sentencepiece package
            raise MissingTokenizerError(
                f"{shown_file(folder)}: its tokenizer.model cannot be read here ({shown(str(exc), 200)}): "
                "pip install sentencepiece"
            ) from None
        except (ValueError, KeyError, OSError) as exc:
            raise MissingTokenizerError(
                f"{shown_file(folder)}: gguf-py cannot read its tokenizer ({type(exc).__name__}: "
                f"{shown(str(exc), 200)}); fix the tokenizer files or pass without_tokenizer=True (--without-tokenizer)"
            ) from None
    return None


def _value(key: str, entry: Any) -> GGUFMetadataValue:
    """A gguf-py ``GGUFValue`` as write_gguf's (type name, value)."""
    kind = entry.type.name
    value = entry.value
    if kind != "ARRAY":
        return (kind, value.decode("utf-8") if isinstance(value, bytes) else value)
    items = list(value)
    if entry.sub_type is not None:
        element = entry.sub_type.name
    elif items and isinstance(items[0], (str, bytes, bytearray)):
        element = "STRING"
    elif items and isinstance(items[0], float):
        element = "FLOAT32"
    elif items and isinstance(items[0], bool):
        element = "BOOL"
    else:
        element = "INT32"
    if element == "STRING":
        items = [bytes(item).decode("utf-8") if isinstance(item, (bytes, bytearray)) else item for item in items]
    elif element == "INT32":
        items = [int(item) for item in items]
    elif element == "FLOAT32":
        items = [float(item) for item in items]
    return (f"ARRAY[{element}]", items)


def tokenizer_metadata(folder: Path, rows: int, architecture: str) -> tuple[dict[str, GGUFMetadataValue], list[str]]:
    """The ``tokenizer.ggml.*`` keys of the folder's tokenizer, padded to the embedding's ``rows``
    tokens as llama.cpp's converter pads them, and notes; MissingTokenizerError without one."""
    from gguf import GGUFWriter, TokenType
    from gguf.vocab import SpecialVocab

    with _quiet():
        vocab = _vocab(folder)
        if vocab is None:
            raise MissingTokenizerError(
                f"{shown_file(folder)}: no tokenizer gguf-py can read (tokenizer.json of a BPE model, or "
                "tokenizer.model of SentencePiece); llama.cpp needs one to run the model. Copy the model's tokenizer "
                "files into the folder, or pass without_tokenizer=True (--without-tokenizer) to write the weights "
                "without one"
            )
        tokens, scores, types = [], [], []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(float(score))
            types.append(int(kind))
        if len(tokens) > rows:
            raise CheckpointError(
                f"{shown_file(folder)}: the tokenizer has {len(tokens)} tokens but the embedding only {rows} rows; "
                "the tokenizer files belong to another model"
            )
        notes = []
        if len(tokens) < rows:
            notes.append(f"tokenizer padded from {len(tokens)} to {rows} tokens ([PAD<i>], unused)")
        for index in range(len(tokens), rows):
            tokens.append(f"[PAD{index}]")
            scores.append(-1000.0)
            types.append(int(TokenType.UNUSED))
        writer = GGUFWriter(None, architecture)
        writer.add_tokenizer_model(vocab.tokenizer_model)
        if vocab.tokenizer_model == "gpt2":
            # llama.cpp picks a pre-tokenizer by hashing how the tokenizer splits a test text, a table
            # this export does not reproduce; "default" is what llama.cpp falls back to.
            writer.add_tokenizer_pre("default")
            notes.append("tokenizer.ggml.pre written as 'default' (llama.cpp's pre-tokenizer detection not run)")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        special = SpecialVocab(folder, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=rows)
        special.add_to_gguf(writer, quiet=True)
    metadata = {key: _value(key, entry) for key, entry in writer.kv_data[0].items()}
    return metadata, notes
