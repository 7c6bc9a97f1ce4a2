"""Write a tiny NVFP4 checkpoint in compressed-tensors format, with qscheme's own quantizer.

    python -m qscheme.examples.make_checkpoint OUT [--layers 2] [--scheme compressed-tensors/NVFP4]

The model is a small Llama-shaped stack of random weights (seeded, so every run writes the
same bytes): embeddings, ``--layers`` decoder layers (q/k/v/o and gate/up/down projections,
RMSNorm weights), a final norm and an unquantized lm_head. Every projection is quantized with
``qscheme.quantize.weight.quantize_weight``; k_proj weights are 3x larger, so q/k/v carry
different global scales, as checkpoints from some producers do. config.json says who wrote
it: the quantization_config is in compressed-tensors form, with ``producer`` naming this
generator, not the compressed-tensors library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from qscheme import __version__
from qscheme.catalog import load_scheme
from qscheme.descriptor import Scheme
from qscheme.errors import QSchemeError, UsageError

HIDDEN = 256
INTERMEDIATE = 512
HEADS = 4
KV_HEADS = 2
VOCAB = 512
SEED = 2024
INPUT_ABSMAX = 4.0  # nominal calibrated input range, for the static input global scales
PROJECTIONS = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN * KV_HEADS // HEADS, HIDDEN),
    "self_attn.v_proj": (HIDDEN * KV_HEADS // HEADS, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}
WEIGHT_MULTIPLIERS = {"self_attn.k_proj": 3.0}


def _llama_config(layers: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def _quantization_config(scheme: Scheme) -> dict[str, object]:
    """The scheme's own compressed-tensors detection rule, written as a config group."""
    rule = scheme.detect.compressed_tensors
    if rule is None:
        raise UsageError(
            f"scheme {scheme.name} has no compressed-tensors detection rule; pick a compressed-tensors scheme"
        )
    return {
        "quant_method": "compressed-tensors",
        "format": rule.formats[0],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": rule.formats[0],
                "weights": dict(rule.weights),
                "input_activations": None if rule.input_activations is None else dict(rule.input_activations),
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "producer": {
            "name": "qscheme.examples.make_checkpoint",
            "version": __version__,
            "note": "written by qscheme's example generator in compressed-tensors format (random weights)",
        },
    }


def _static_inputs(scheme: Scheme) -> dict[str, torch.Tensor]:
    """Static activation scales for the nominal input range, in the scheme's stored convention."""
    activation = scheme.activation
    given: dict[str, torch.Tensor] = {}
    if activation is None:
        return given
    if activation.global_scale is not None:
        multiplier = INPUT_ABSMAX / (6.0 * 448.0)
        stored = multiplier if activation.global_scale.stored == "multiplier" else 1.0 / multiplier
        given[activation.global_scale.tensor.name] = torch.tensor([stored], dtype=torch.float32)
    if activation.scale is not None:
        multiplier = INPUT_ABSMAX / 448.0
        stored = multiplier if activation.scale.stored == "multiplier" else 1.0 / multiplier
        given[activation.scale.tensor.name] = torch.tensor([stored], dtype=torch.float32)
    return given


def _check_new_folder(folder: Path) -> None:
    """Refuse an ``out`` that is a file or a folder with anything in it: never overwrite a checkpoint."""
    if folder.is_dir():
        if any(folder.iterdir()):
            raise UsageError(
                f"{folder}: the folder exists and is not empty; choose a new folder (this generator never "
                "overwrites files), or remove this one first"
            )
    elif folder.exists() or folder.is_symlink():
        raise UsageError(f"{folder}: exists and is not a folder; choose a new folder to write the checkpoint into")


def make_checkpoint(out: str | Path, layers: int = 2, scheme: str = "compressed-tensors/NVFP4") -> Path:
    """Write config.json and model.safetensors into ``out``, a new or empty folder; returns the folder.

    UsageError, before anything is written, when ``out`` is a file or a folder that is not empty.
    """
    from qscheme.quantize.weight import quantize_weight

    folder = Path(out)
    _check_new_folder(folder)
    resolved = load_scheme(scheme)
    quantization_config = _quantization_config(resolved)  # a scheme without a rule: before any work
    generator = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).to(torch.bfloat16),
    }
    given = _static_inputs(resolved)
    for index in range(layers):
        prefix = f"model.layers.{index}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for name, (n, k) in PROJECTIONS.items():
            weight = torch.randn(n, k, generator=generator) * (0.02 * WEIGHT_MULTIPLIERS.get(name, 1.0))
            for short, value in quantize_weight(weight.to(torch.bfloat16), resolved, **given).items():
                tensors[f"{prefix}.{name}.{short}"] = value.clone().contiguous()
    config = _llama_config(layers)
    config["quantization_config"] = quantization_config
    _check_new_folder(folder)  # again: quantizing took a while
    folder.mkdir(parents=True, exist_ok=True)
    # Each file appears whole or not at all: written beside its final name, then renamed.
    weights, settings = folder / "model.safetensors", folder / "config.json"
    partial = [folder / f".{weights.name}.partial", folder / f".{settings.name}.partial"]
    try:
        save_file(tensors, str(partial[0]), metadata={"format": "pt"})
        partial[1].write_text(json.dumps(config, indent=2) + "\n")
        os.replace(partial[0], weights)
        os.replace(partial[1], settings)
    finally:
        for path in partial:
            path.unlink(missing_ok=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qscheme.examples.make_checkpoint", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", help="a new folder to write (created; an existing one must be empty)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument(
        "--scheme", default="compressed-tensors/NVFP4", help="a compressed-tensors scheme (default NVFP4)"
    )
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, not {args.layers}")
    try:
        folder = make_checkpoint(args.out, layers=args.layers, scheme=args.scheme)
    except QSchemeError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"wrote {folder} ({size / 1024:.0f} KB): {args.layers} layers of {args.scheme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
