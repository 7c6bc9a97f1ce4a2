"""Peak RSS of ``from_pretrained`` and one forward on a generated ~1 GB ModelOpt NVFP4 checkpoint.

    python benchmarks/from_pretrained_rss.py [--folder DIR] [--layers 22] [--tokens 8]

Writes (once) a Llama-shaped ModelOpt NVFP4 export with random codes and valid scales (hidden
2048, intermediate 8192, vocab 32000, bf16 embeddings and lm_head, untied), then, in a fresh
process, loads it with ``AutoModelForCausalLM.from_pretrained`` through qscheme's ``modelopt``
quantizer and runs one forward of ``--tokens`` tokens on the CPU. It reports the RSS after
imports, after loading and after the forward, and the peak RSS (``VmHWM``) after loading and
after the forward, and checks the bound: the peak growth over the RSS after imports, forward
included, is at most 1.2 x (checkpoint bytes + one bf16 copy of the largest quantized layer).
The forward runs on the reference kernel (no CPU kernel takes NVFP4), which dequantizes a chunk
of rows at a time and keeps no copy, so the forward adds about one chunk, not a float copy of
the model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS = 2048, 8192, 32000, 16, 8


def _config(layers: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "producer": {"name": "modelopt", "version": "0.47.0"},
            "ignore": ["lm_head", "model.embed_tokens"],
        },
    }


def generate(folder: Path, layers: int) -> tuple[int, int]:
    """Write the checkpoint; returns (total tensor bytes, unquantized tensor bytes)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    shapes = _projection_shapes()
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16) * 0.02,
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16) * 0.02,
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        state[f"{prefix}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        state[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for name, (n, k) in shapes.items():
            module = f"{prefix}.{name}"
            state[f"{module}.weight"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
            block_scales = torch.rand(n, k // 16, generator=generator) * 400 + 8
            state[f"{module}.weight_scale"] = block_scales.to(torch.float8_e4m3fn)
            state[f"{module}.weight_scale_2"] = torch.tensor(1e-4)
            state[f"{module}.input_scale"] = torch.tensor(2e-3)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(_config(layers), indent=2))
    quant = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "model.embed_tokens"]},
    }
    (folder / "hf_quant_config.json").write_text(json.dumps(quant, indent=2))
    total = sum(t.numel() * t.element_size() for t in state.values())
    plain = sum(t.numel() * t.element_size() for key, t in state.items() if ".mlp." not in key and "_proj" not in key)
    return total, plain


def largest_layer_bf16_bytes(layers: int) -> int:
    """One bf16 copy of the largest quantized layer (gate/up/down: 8192 x 2048)."""
    return max(n * k for n, k in _projection_shapes().values()) * 2 if layers else 0


def _projection_shapes() -> dict[str, tuple[int, int]]:
    head_dim = HIDDEN // HEADS
    return {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }


def measure(folder: Path, tokens: int) -> dict[str, float]:
    """In this process: RSS after imports, after from_pretrained and after one forward, and the
    peak RSS after each (bytes)."""
    import torch
    from transformers import AutoModelForCausalLM

    import qscheme.transformers  # noqa: F401

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def rss() -> int:
        return status("VmRSS")

    def peak() -> int:
        # VmHWM: this process's own peak. ru_maxrss would also count the parent's peak before
        # exec (Linux keeps it), which is the checkpoint generation's on a first run.
        return status("VmHWM")

    before = rss()
    peak_before = peak()
    model = AutoModelForCausalLM.from_pretrained(folder)
    loaded, peak_loaded, anon_loaded = rss(), peak(), status("RssAnon")
    layers = [m for m in model.modules() if type(m).__name__ == "QuantLinear"]
    started = time.perf_counter()
    with torch.no_grad():
        logits = model(torch.arange(1, tokens + 1).reshape(1, tokens)).logits
    seconds = time.perf_counter() - started
    return {
        "rss_after_imports": before,
        "peak_before": peak_before,
        "after_load": loaded,
        "peak_after_load": peak_loaded,
        "after_forward": rss(),
        "anon_after_load": anon_loaded,
        "anon_after_forward": status("RssAnon"),
        "peak": peak(),
        "layers": len(layers),
        "kernels": sorted({layer.kernel.name for layer in layers}),
        "forward_seconds": seconds,
        "finite": bool(torch.isfinite(logits).all()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "qscheme-rss-nvfp4")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--tokens", type=int, default=8, help="tokens in the one forward (default 8)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.folder, args.tokens)))
        return 0
    sizes = args.folder / "sizes.json"
    if not sizes.exists():
        total, plain = generate(args.folder, args.layers)
        sizes.write_text(json.dumps({"total": total, "plain": plain, "layers": args.layers}))
    known = json.loads(sizes.read_text())
    done = subprocess.run(
        [sys.executable, __file__, "--folder", str(args.folder), "--tokens", str(args.tokens), "--measure"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    base = result["rss_after_imports"]
    layer_copy = largest_layer_bf16_bytes(known.get("layers", args.layers))
    bound = 1.2 * (known["total"] + layer_copy)
    growth = result["peak"] - base
    mib = 1 << 20
    print(f"checkpoint tensors: {known['total'] / mib:.0f} MiB, of which unquantized {known['plain'] / mib:.0f} MiB")
    print(f"quantized layers loaded: {result['layers']} (kernels: {', '.join(result['kernels'])})")
    print(
        f"RSS after imports: {base / mib:.0f} MiB; after from_pretrained: {result['after_load'] / mib:.0f} MiB "
        f"(peak {result['peak_after_load'] / mib:.0f}); after one forward of {args.tokens} tokens "
        f"({result['forward_seconds']:.1f} s, logits finite: {result['finite']}): {result['after_forward'] / mib:.0f} "
        f"MiB (peak {result['peak'] / mib:.0f})"
    )
    anonymous = result["anon_after_forward"] - result["anon_after_load"]
    print(
        f"the forward added {(result['after_forward'] - result['after_load']) / mib:.0f} MiB resident "
        f"({anonymous / mib:.0f} MiB anonymous memory, the rest pages of the memory-mapped plain tensors it read), "
        f"{(result['peak'] - result['peak_after_load']) / mib:.0f} MiB to the peak; one bf16 copy of the largest "
        f"layer: {layer_copy / mib:.0f} MiB"
    )
    print(
        f"peak growth over imports, forward included: {growth / mib:.0f} MiB; bound 1.2 x (checkpoint + one bf16 "
        f"layer): {bound / mib:.0f} MiB -> {'within' if growth <= bound else 'OVER'}"
    )
    return 0 if growth <= bound and result["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
