"""Assertions shared by the tests that compare vLLM engine runs (test_vllm_plugin, test_vllm_moe)."""

from __future__ import annotations

from typing import Any


def assert_same_generation(ours: dict[str, Any], dense: dict[str, Any], max_tokens: int) -> None:
    """Greedy tokens identical, each request ``max_tokens`` long, prompt logprobs within 1e-3."""
    assert ours["tokens"] == dense["tokens"]
    assert all(len(tokens) == max_tokens for tokens in ours["tokens"])
    for got, want in zip(ours["prompt_logprobs"], dense["prompt_logprobs"], strict=True):
        assert len(got) == len(want) > 0
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-3
