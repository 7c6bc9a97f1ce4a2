"""Peak RSS of ``AutoModelForCausalLM.from_pretrained`` on a generated ~1 GB ModelOpt NVFP4 checkpoint.

    python benchmarks/from_pretrained_rss.py [--folder DIR] [--layers 22]

Writes (once) a Llama-shaped ModelOpt NVFP4 export with random codes and valid scales (hidden
2048, intermediate 8192, vocab 32000, bf16 embeddings and lm_head, untied), then loads it through
qscheme's ``modelopt`` quantizer in a fresh process and reports that process's peak RSS growth
over its RSS after imports, against the bound: 1.2 x (checkpoint bytes + unquantized tensor
bytes). No float copy of a quantized weight is ever made, so the growth stays near the
checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
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
    head_dim = HIDDEN // HEADS
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * head_dim, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
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


def measure(folder: Path) -> dict[str, float]:
    """In this process: RSS after imports, then peak RSS over from_pretrained (bytes)."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM

    import qscheme.transformers  # noqa: F401

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    before = rss()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = AutoModelForCausalLM.from_pretrained(folder)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    layers = sum(1 for m in model.modules() if type(m).__name__ == "QuantLinear")
    return {"rss_after_imports": before, "peak_before": peak_before, "peak": peak, "after": rss(), "layers": layers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "qscheme-rss-nvfp4")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.folder)))
        return 0
    sizes = args.folder / "sizes.json"
    if not sizes.exists():
        total, plain = generate(args.folder, args.layers)
        sizes.write_text(json.dumps({"total": total, "plain": plain}))
    known = json.loads(sizes.read_text())
    done = subprocess.run(
        [sys.executable, __file__, "--folder", str(args.folder), "--measure"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    growth = result["peak"] - result["rss_after_imports"]
    bound = 1.2 * (known["total"] + known["plain"])
    mib = 1 << 20
    print(f"checkpoint tensors: {known['total'] / mib:.0f} MiB, of which unquantized {known['plain'] / mib:.0f} MiB")
    print(f"quantized layers loaded: {result['layers']}")
    print(f"RSS after imports: {result['rss_after_imports'] / mib:.0f} MiB; peak: {result['peak'] / mib:.0f} MiB")
    print(
        f"peak growth over from_pretrained: {growth / mib:.0f} MiB; bound 1.2 x (checkpoint + unquantized): "
        f"{bound / mib:.0f} MiB -> {'within' if growth <= bound else 'OVER'}"
    )
    return 0 if growth <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
