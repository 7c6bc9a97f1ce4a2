"""The seven linear layers of a Llama-shaped decoder block, for the benchmarks' model layouts."""

from __future__ import annotations


def block_linears(hidden: int, kv: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """Module name (under ``model.layers.<i>.``) -> (N, K) of its weight."""
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
