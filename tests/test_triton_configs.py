"""Tile configurations: the heuristic (pure), the cache and autotuning (with fake timings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qscheme.triton import configs
from qscheme.triton.configs import ConfigCache, DeviceFacts, TileConfig, heuristic_config

H100 = DeviceFacts("H100-like", 132, 227 * 1024)
SMALL = DeviceFacts("small shared memory", 60, 99 * 1024)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n, k", [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)])
def test_decode_shapes_get_one_row_tile_and_enough_programs_with_little_extra_traffic(m: int, n: int, k: int) -> None:
    config = heuristic_config(m, n, k, weight_bits=4, input_bytes=2, device=H100)
    assert config.block_m == 16
    programs = -(-n // config.block_n) * config.split_k
    assert programs >= H100.multiprocessors
    partial_sums = 2 * config.split_k * m * n * 4 if config.split_k > 1 else 0
    assert partial_sums <= n * k // 2 // 8  # at most an eighth of the 4-bit weight's bytes
    assert -(-k // config.block_k) // config.split_k >= 4  # each split keeps 4 K steps


def test_large_m_uses_large_tiles_and_fits_shared_memory() -> None:
    config = heuristic_config(256, 8192, 8192, weight_bits=4, input_bytes=2, device=H100)
    assert (config.block_m, config.block_n, config.split_k) == (128, 128, 1)
    small = heuristic_config(256, 8192, 8192, weight_bits=8, input_bytes=4, device=SMALL)
    assert configs._shared_memory_bytes(small, 8, 4) <= SMALL.shared_memory


@pytest.mark.parametrize(
    "capability, expected",
    [((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False), (None, False)],
)
def test_weights_first_only_for_the_hopper_decode_tile(capability: tuple[int, int] | None, expected: bool) -> None:
    device = DeviceFacts("gpu", 132, 227 * 1024, capability)
    decode = heuristic_config(1, 8192, 8192, weight_bits=4, input_bytes=2, device=device, wide_decode=True)
    assert (decode.block_n, decode.num_warps) == (64, 4)  # one warpgroup MMA spans the 64 weight rows
    assert decode.weights_first is expected
    assert ("weights-first" in decode.describe()) is expected
    # Not for the other decode tile (8-bit or float32-decoded weights), nor for prefill.
    assert not heuristic_config(1, 8192, 8192, weight_bits=8, input_bytes=2, device=device).weights_first
    assert not heuristic_config(256, 8192, 8192, 4, 2, device, wide_decode=True).weights_first


def test_autotuning_tries_the_other_operand_order() -> None:
    base = TileConfig(16, 64, 128, split_k=4, num_stages=4, weights_first=True)
    assert TileConfig(16, 64, 128, split_k=4, num_stages=4) in configs.candidate_configs(base, 8192)


def test_interpreted_config_covers_small_problems_in_one_program() -> None:
    config = configs.interpreted_config(33, 200, 301)
    assert (config.block_m, config.block_n, config.block_k) == (64, 256, 512)


def test_the_cache_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "configs.json"
    ConfigCache(path).put("key", TileConfig(16, 32, 128, split_k=2))
    ConfigCache(path).put("first", TileConfig(16, 64, 128, split_k=4, weights_first=True))
    assert ConfigCache(path).get("key") == TileConfig(16, 32, 128, split_k=2)
    assert ConfigCache(path).get("first") == TileConfig(16, 64, 128, split_k=4, weights_first=True)
    assert not list(tmp_path.glob(".*partial"))  # written beside it, then renamed


@pytest.mark.parametrize("content", ["not json", '{"precious": "not a cache"}', "[1, 2]"])
def test_a_file_that_is_not_a_cache_is_never_overwritten(tmp_path: Path, content: str) -> None:
    path = tmp_path / "notes.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="not a qscheme Triton config cache"):
        cache = ConfigCache(path)
    assert cache.get("key") is None  # ignored, not fatal
    cache.put("key", TileConfig(16, 32, 128))
    assert cache.get("key") == TileConfig(16, 32, 128)  # kept in memory
    assert path.read_text() == content


def test_autotuning_keeps_the_fastest_candidate_and_caches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(configs, "_cache", ConfigCache(None))
    monkeypatch.setenv(configs.AUTOTUNE_VARIABLE, "1")
    timed: list[TileConfig] = []

    def time_config(config: TileConfig) -> float:
        timed.append(config)
        if config.num_warps == 8:
            raise RuntimeError("out of resources")  # skipped, not fatal
        return 1.0 / config.block_n  # wider is faster here

    chosen = configs.choose_config("k1", 4096, lambda: heuristic_config(1, 4096, 4096, 4, 2, H100), time_config)
    assert len(timed) > 1 and chosen.block_n == max(c.block_n for c in timed if c.num_warps != 8)
    assert configs.choose_config("k1", 4096, lambda: heuristic_config(1, 4096, 4096, 4, 2, H100), time_config) == chosen
    assert len(timed) == len(set(timed))  # the second call came from the cache


def test_without_autotuning_the_heuristic_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(configs, "_cache", ConfigCache(None))
    monkeypatch.delenv(configs.AUTOTUNE_VARIABLE, raising=False)

    def never(config: TileConfig) -> float:
        raise AssertionError("timed without QSCHEME_TRITON_AUTOTUNE")

    chosen = configs.choose_config("k2", 4096, lambda: heuristic_config(1, 4096, 4096, 4, 2, H100), never)
    assert chosen == heuristic_config(1, 4096, 4096, 4, 2, H100)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n, k", [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)])
def test_wide_decode_keeps_64_columns_and_splits_k(m: int, n: int, k: int) -> None:
    config = heuristic_config(m, n, k, weight_bits=4, input_bytes=2, device=H100, wide_decode=True)
    assert (config.block_m, config.block_n) == (16, 64)
    assert config == heuristic_config(16, n, k, weight_bits=4, input_bytes=2, device=H100, wide_decode=True)
    assert -(-n // config.block_n) * config.split_k >= H100.multiprocessors
    assert 2 * config.split_k * 16 * n * 4 <= n * k // 2 // 4  # a quarter of the weight's bytes
    assert -(-k // config.block_k) // config.split_k >= 4
    if (n, k) == (8192, 8192):
        assert config.split_k == 4  # the config measured fastest on an H200


def test_scale_tiles_count_what_each_layout_pipelines() -> None:
    scales = configs.ScaleTiles(group_k=16, value_bytes=4)
    assert scales.bytes_per_stage(64, 128) == 64 * 8 * 4  # 8 groups a row per tile
    assert configs.ScaleTiles(256, 4).bytes_per_stage(64, 128) == 64 * 4  # one group spans the tile
    assert configs.ScaleTiles(48, 5).bytes_per_stage(64, 128) == 64 * 128 * 5  # gathered per weight


@pytest.mark.parametrize("m", [16, 256])
def test_gathered_scales_shrink_the_tile_to_fit_shared_memory(m: int) -> None:
    # A uint4 group-48 scheme with zero points (tests/data/triton_schemes) needed 139264 bytes
    # on sm120 (101376) at the decode tile, counted without its gathered scales.
    sm120 = DeviceFacts("sm120-like", 84, 101376, (12, 0))
    gathered = configs.ScaleTiles(group_k=48, value_bytes=5)
    plain = heuristic_config(m, 8192, 8192, 4, 2, sm120, wide_decode=True)
    fitted = heuristic_config(m, 8192, 8192, 4, 2, sm120, wide_decode=True, scales=gathered)
    assert configs._shared_memory_bytes(plain, 4, 2, gathered) > sm120.shared_memory
    assert configs._shared_memory_bytes(fitted, 4, 2, gathered) <= sm120.shared_memory
    assert fitted.num_stages * fitted.block_k < plain.num_stages * plain.block_k  # fewer or narrower stages
    aligned = configs.ScaleTiles(group_k=16, value_bytes=4)  # NVFP4-like: nothing changes
    assert heuristic_config(m, 8192, 8192, 4, 2, sm120, wide_decode=True, scales=aligned) == plain


@pytest.mark.parametrize("m", [1, 40, 300])
def test_the_k_tile_is_never_wider_than_k_needs(m: int) -> None:
    for k, widest in ((16, 32), (48, 64), (100, 128), (4096, 128)):
        for bits, input_bytes in ((4, 2), (8, 2), (4, 4)):
            config = heuristic_config(m, 4096, k, bits, input_bytes, H100)
            assert 32 <= config.block_k <= widest, (k, config)


def test_split_k_leaves_no_split_without_k_tiles() -> None:
    for k in range(128, 20000, 64):
        for n in (96, 1000, 4096):
            for m, bits, input_bytes in ((1, 8, 2), (1, 4, 2), (40, 8, 2), (1, 4, 4)):
                config = heuristic_config(m, n, k, bits, input_bytes, H100)
                k_tiles = -(-k // config.block_k)
                per_split = -(-k_tiles // config.split_k)
                assert (config.split_k - 1) * per_split < k_tiles, (m, n, k, config)


def test_fp8_codes_decoded_in_software_on_both_operands_take_narrower_k_tiles() -> None:
    """FP8 per-group activations stay codes; before compute capability 8.9 the K loop decodes
    them and the fp8 weights with integer operations, and 64 x 64 x 128 spilled (sm80)."""
    from qscheme.catalog import load_scheme
    from qscheme.triton.linear import heuristic_for, prepare_weight
    from qscheme.triton.samples import random_weight

    sm80 = DeviceFacts("A100-like", 108, 163 * 1024, (8, 0))
    sm90 = DeviceFacts("H100-like", 132, 227 * 1024, (9, 0))
    rocm = DeviceFacts("MI300-like", 304, 64 * 1024, None)
    block = prepare_weight(random_weight(load_scheme("compressed-tensors/FP8_BLOCK"), 256, 512), "cpu")
    dynamic = prepare_weight(random_weight(load_scheme("compressed-tensors/FP8_DYNAMIC"), 256, 512), "cpu")
    bf16 = torch.bfloat16
    assert heuristic_for(block, 64, 128256, 4096, bf16, sm80).block_k == 64
    assert heuristic_for(block, 64, 128256, 4096, bf16, rocm).block_k == 64
    assert heuristic_for(block, 64, 128256, 4096, bf16, sm90).block_k == 128  # hardware conversion
    assert heuristic_for(block, 1, 128256, 4096, bf16, sm80).block_k == 128  # the 16-row tile did not spill
    assert heuristic_for(dynamic, 64, 128256, 4096, bf16, sm80).block_k == 128  # per-token: decoded in the pre-pass


@pytest.mark.parametrize("m", [1, 32])
def test_gathered_scales_take_k_tiles_of_64(m: int) -> None:
    """A group that neither divides nor spans a 128-wide K tile (48) loads a scale per weight;
    at 128 the 4-bit decode tiles spilled registers on sm80, sm90 and sm100, at 64 they did not."""
    sm90 = DeviceFacts("H100-like", 132, 227 * 1024, (9, 0))
    assert configs.ScaleTiles(48, 5).gathered(128) and configs.ScaleTiles(48, 5).gathered(64)
    assert not configs.ScaleTiles(192, 5).gathered(64) and not configs.ScaleTiles(16, 4).gathered(128)
    gathered = heuristic_config(m, 8192, 8192, 4, 2, sm90, wide_decode=True, scales=configs.ScaleTiles(48, 5))
    assert gathered.block_k == 64
    aligned = heuristic_config(m, 8192, 8192, 4, 2, sm90, wide_decode=True, scales=configs.ScaleTiles(16, 4))
    assert aligned.block_k == 128
    # 192 is gathered at 128 but spans 64: one scale per row and tile there
    assert heuristic_config(m, 8192, 8192, 4, 2, sm90, scales=configs.ScaleTiles(192, 5)).block_k == 64
