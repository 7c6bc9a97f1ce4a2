"""Tile configurations: a heuristic per problem size, optional autotuning on a GPU, and a cache.

The heuristic is a pure function of the problem (M, N, K), the weight's bit width and the
device's multiprocessor count and shared memory. Small M (decode) is memory bound: one 16-row
tile of x, narrow column tiles, deep pipelining, and K split (partial sums in float32, a second
small kernel adds them) until there are two programs per multiprocessor, as long as the extra
traffic stays small; on Hopper the 4-bit decode tile puts the weights first (y^T = W x^T, see
``WEIGHTS_FIRST_MAJORS``). Larger M uses square-ish tiles.

Interpreted (``TRITON_INTERPRET=1``) runs cost about 10 ms per program and K step whatever the
tile size, so they get the largest tiles that cover the problem.

With ``QSCHEME_TRITON_AUTOTUNE=1`` the first call for a key times a few candidates around the
heuristic and keeps the fastest; choices are cached in memory per (device, specialisation,
dtype, M bucket, N, K) and, when ``QSCHEME_TRITON_CACHE`` names a JSON file, on disk.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from qscheme.triton.launch import cdiv, next_power_of_2

AUTOTUNE_VARIABLE = "QSCHEME_TRITON_AUTOTUNE"
CACHE_FILE_VARIABLE = "QSCHEME_TRITON_CACHE"


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one GEMM call."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    weights_first: bool = False  # the dot computes y^T = W x^T (see gemm.mma_k_order)
    gemv: bool = False  # the CUDA-core GEMV kernel (qscheme.triton.gemv) instead of the GEMM

    def describe(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.block_k}"
        if self.split_k > 1:
            text += f" split-k {self.split_k}"
        text += f" warps {self.num_warps} stages {self.num_stages}"
        if self.gemv:
            text += " gemv"
        return text + " weights-first" if self.weights_first else text


@dataclass(frozen=True)
class DeviceFacts:
    """What the heuristic needs to know about the GPU."""

    name: str
    multiprocessors: int
    shared_memory: int  # bytes one program may use
    capability: tuple[int, int] | None = None  # CUDA compute capability; None on ROCm


# CUDA compute capability majors whose decode tile computes y^T = W x^T (``weights_first``):
# Hopper, whose warpgroup MMA then takes the decoded weights from registers and the inputs
# from shared memory. Static counts (benchmarks/triton_sass.py; NVFP4, int4 and AWQ
# weight-only, triton 3.6 and 3.9): 9-40% fewer instructions per weight on sm90. sm80 gains
# less and not for every scheme, sm120 nothing; on sm100 Triton sends the decoded weights
# through tensor memory instead, unmeasured: they keep x W^T.
WEIGHTS_FIRST_MAJORS = (9,)


@dataclass(frozen=True)
class ScaleTiles:
    """A weight's tiled scales as the tile heuristic sizes shared memory for them: the group
    along K, and the bytes each scale (plus its zero point) takes as the kernel loads it."""

    group_k: int
    value_bytes: int

    def bytes_per_stage(self, block_n: int, block_k: int) -> int:
        """Per pipeline stage: a few columns per row when groups tile BLOCK_K (one when a group
        spans it), else one gathered value per weight (``gemm.apply_tiled_scale``)."""
        if block_k % self.group_k == 0:
            return block_n * (block_k // self.group_k) * self.value_bytes
        if self.group_k % block_k == 0:
            return block_n * self.value_bytes
        return block_n * block_k * self.value_bytes

    def gathered(self, block_k: int) -> bool:
        """Whether a group neither divides nor spans ``block_k``: a scale per weight."""
        return block_k % self.group_k != 0 and self.group_k % block_k != 0


def _clamp_power_of_two(value: int, low: int, high: int) -> int:
    return max(low, min(high, next_power_of_2(value)))


def interpreted_config(m: int, n: int, k: int) -> TileConfig:
    """The largest tiles that cover the problem (the interpreter's cost is per program and step)."""
    return TileConfig(
        block_m=_clamp_power_of_two(m, 16, 64),
        block_n=_clamp_power_of_two(n, 16, 256),
        block_k=_clamp_power_of_two(k, 32, 512),
        num_warps=4,
        num_stages=1,
    )


# The largest M the CUDA-core GEMV runs (``gemv_config``): up to 4 input rows the weight is
# decoded once and multiplied with each row in float32 FMAs; beyond, the tensor cores win.
GEMV_MAX_M = 4


def m_bucket(m: int) -> int:
    """The M a config is chosen for: 1, 2 and 4 (the GEMV's rows, ``GEMV_MAX_M``), then powers
    of two from 16 to 512 (M 5..16 share one)."""
    if m <= GEMV_MAX_M:
        return next_power_of_2(m)
    return _clamp_power_of_two(m, 16, 512)


def gemv_config(
    m: int, n: int, k: int, weight_bits: int, device: DeviceFacts, scales: ScaleTiles | None = None
) -> TileConfig:
    """The GEMV's tile for M <= ``GEMV_MAX_M`` (``qscheme.triton.gemv``).

    Each program streams 32 weight rows, 128 bytes of each per K step (256 4-bit codes or 128
    8-bit ones: one cache line per row, 128-bit loads), with all M rows of x (BLOCK_M = M's
    next power of two). K is split until there are four programs per multiprocessor (a GEMV
    hides memory latency with programs in flight, not with MMA pipelining), keeping at least
    four K steps per split; the float32 partial sums are M x N x 4 bytes per split, nothing
    next to the weight. Gathered scale groups (neither dividing nor spanning the K step) take
    K steps of 64, as in the GEMM.
    """
    block_k = 256 if weight_bits == 4 else 128
    if scales is not None and scales.gathered(block_k):
        block_k = 64
    block_k = min(block_k, max(32, next_power_of_2(k)))
    config = TileConfig(next_power_of_2(min(m, GEMV_MAX_M)), 32, block_k, num_warps=4, num_stages=3, gemv=True)
    k_tiles = cdiv(k, block_k)
    target = 4 * device.multiprocessors
    split_k = 1
    while _tiles(config, m, n) * split_k < target and k_tiles // (split_k * 2) >= 4 and split_k < 16:
        split_k *= 2
    return replace(config, split_k=split_k)


def _shared_memory_bytes(
    config: TileConfig, weight_bits: int, input_bytes: int, scales: ScaleTiles | None = None
) -> int:
    """A rough upper bound: pipelined input, code and scale tiles, plus the decoded tile and x
    tile staged for the dot."""
    per_stage = config.block_m * config.block_k * input_bytes
    per_stage += config.block_n * config.block_k * weight_bits // 8
    if scales is not None:
        per_stage += scales.bytes_per_stage(config.block_n, config.block_k)
    staged = (config.block_n + config.block_m) * config.block_k * input_bytes
    return per_stage * config.num_stages + staged


def _tiles(config: TileConfig, m: int, n: int) -> int:
    return cdiv(m, config.block_m) * cdiv(n, config.block_n)


def heuristic_config(
    m: int,
    n: int,
    k: int,
    weight_bits: int,
    input_bytes: int,
    device: DeviceFacts,
    wide_decode: bool = False,
    scales: ScaleTiles | None = None,
    software_decodes_both: bool = False,
    gemv: bool = False,
) -> TileConfig:
    """A sensible config without timing anything (see the module docstring).

    ``gemv``: the weight can run on the CUDA-core GEMV (weight-only, 16-bit inputs); at
    M <= ``GEMV_MAX_M`` it does (``gemv_config``).

    ``wide_decode``: the caller's kernel variant was measured faster at M <= 16 with 64-wide
    column tiles and more K splits (see below); the linear layer asks for it for e2m1 weights
    with e4m3 group scales and bf16 inputs (NVFP4 weight-only). ``scales``: the weight's tiled
    scales, whose pipelined tiles count against shared memory (a group that neither divides
    nor spans BLOCK_K, e.g. 48, is gathered per weight: as large as the codes' tile or more).
    ``software_decodes_both``: the K loop decodes e4m3 codes of both operands with integer
    operations (FP8 per-group activations, kept as codes, before compute capability 8.9); a
    64 x 64 x 128 tile then spilled about 4 KB of registers on sm80, a K tile of 64 none.
    Gathered scales (one per weight) take K tiles of 64 too: at 128 the 4-bit decode tiles
    spilled 88-536 bytes at 255 registers on sm80, sm90 and sm100; at 64, none, and fewer
    instructions per weight.

    BLOCK_K is at most K's next power of two (at least 32), and split-K leaves no split
    without K tiles.
    """
    if gemv and m <= GEMV_MAX_M:
        return gemv_config(m, n, k, weight_bits, device, scales)
    if input_bytes == 4:  # float32 activations: an FMA dot, large in registers and shared memory
        config = TileConfig(_clamp_power_of_two(m, 16, 32), 64, 32, num_warps=4, num_stages=2)
    elif m <= 16:
        config = TileConfig(16, 64, 128, num_warps=4, num_stages=4)
    elif m <= 64:
        config = TileConfig(_clamp_power_of_two(m, 32, 64), 64, 128, num_warps=4, num_stages=4)
    else:
        config = TileConfig(128, 128, 64, num_warps=8, num_stages=3)
    if software_decodes_both and config.block_m > 16:
        config = replace(config, block_k=min(config.block_k, 64))
    if scales is not None and scales.gathered(config.block_k) and config.block_k > 64:
        config = replace(config, block_k=64)
    config = replace(config, block_k=min(config.block_k, max(32, next_power_of_2(k))))
    target = 2 * device.multiprocessors
    # Wide decode (M <= 16, 16-bit inputs) keeps 64-wide column tiles and splits K instead: on
    # an H200 (NVFP4 weight-only, 8192x8192 and 4096x4096) 16x64x128 split-k 4 ran 15-20% faster
    # than 16x32x128 split-k 2, the kernel being far from bandwidth bound, so partial sums may
    # take a quarter of the weight's bytes. Otherwise narrower column tiles come first.
    decode = wide_decode and m <= 16 and input_bytes != 4
    if m <= 64 and not decode:
        while _tiles(config, m, n) < target and config.block_n > 32:
            config = replace(config, block_n=config.block_n // 2)
    # Then split K, while each split keeps >= 4 K steps and the float32 partial sums (written
    # and read once more) stay under an eighth of the weight's bytes (a quarter for decode).
    k_tiles = cdiv(k, config.block_k)
    weight_bytes = n * k * weight_bits // 8
    traffic_share = 4 if decode else 8
    rows = 16 if decode else m  # M 1..16 share a cached config (one bucket): size it for 16
    split_k = 1
    while (
        _tiles(config, m, n) * split_k < target
        and k_tiles // (split_k * 2) >= 4
        and split_k < 8
        and 2 * (split_k * 2) * rows * n * 4 <= weight_bytes // traffic_share
    ):
        split_k *= 2
    while split_k > 1 and (split_k - 1) * cdiv(k_tiles, split_k) >= k_tiles:  # the last split would be empty
        split_k //= 2
    config = replace(config, split_k=split_k)
    if (
        decode
        and device.capability is not None
        and device.capability[0] in WEIGHTS_FIRST_MAJORS
        and config.block_n >= 64  # one warpgroup MMA spans 64 weight rows
        and config.num_warps == 4
    ):
        config = replace(config, weights_first=True)

    def too_large(option: TileConfig) -> bool:
        return _shared_memory_bytes(option, weight_bits, input_bytes, scales) > device.shared_memory

    while config.num_stages > 2 and too_large(config):
        config = replace(config, num_stages=config.num_stages - 1)
    while config.block_k > 32 and too_large(config):
        config = replace(config, block_k=config.block_k // 2)
    return config


def candidate_configs(base: TileConfig, k: int) -> list[TileConfig]:
    """A few configs around ``base`` for autotuning (base first)."""
    options = [base]
    for change in (
        {"block_n": max(16, base.block_n // 2)},
        {"block_n": base.block_n * 2},
        {"block_k": base.block_k * 2},
        {"block_k": max(32, base.block_k // 2)},
        {"split_k": base.split_k * 2},
        {"split_k": max(1, base.split_k // 2)},
        {"num_stages": base.num_stages + 1},
        {"num_warps": 8 if base.num_warps == 4 else 4},
        {"weights_first": not base.weights_first and not base.gemv},
    ):
        option = replace(base, **change)  # type: ignore[arg-type]
        if option not in options and option.block_k <= max(32, next_power_of_2(k)):
            options.append(option)
    return options


class ConfigCache:
    """Chosen configs by key, in memory and optionally in a JSON file; thread-safe.

    The file is only ever replaced whole (written beside it, then renamed), and only when it is
    absent, empty or already a cache: a file that holds anything else (QSCHEME_TRITON_CACHE
    pointed at the wrong file) is left alone, with a warning, and the cache stays in memory.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._path = path
        self._entries: dict[str, TileConfig] = {}
        if path is not None and path.exists():
            try:
                text = path.read_text(encoding="utf-8")
                raw = json.loads(text) if text.strip() else {}
                if not isinstance(raw, dict):
                    raise TypeError("not a JSON object")
                self._entries = {key: TileConfig(**value) for key, value in raw.items()}
            except (OSError, ValueError, TypeError) as exc:
                warnings.warn(
                    f"{CACHE_FILE_VARIABLE}={path}: not a qscheme Triton config cache ({exc}); it is left "
                    "untouched and choices are kept in memory only: point the variable at a new file",
                    stacklevel=2,
                )
                self._path = None

    def get(self, key: str) -> TileConfig | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, config: TileConfig) -> None:
        with self._lock:
            self._entries[key] = config
            if self._path is not None:
                partial = self._path.with_name(f".{self._path.name}.{os.getpid()}.partial")
                try:
                    self._path.parent.mkdir(parents=True, exist_ok=True)
                    data = {name: asdict(value) for name, value in self._entries.items()}
                    partial.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
                    os.replace(partial, self._path)
                except OSError:
                    partial.unlink(missing_ok=True)  # the disk cache is an optimisation only


_cache: ConfigCache | None = None


def config_cache() -> ConfigCache:
    """The process-wide cache (file from QSCHEME_TRITON_CACHE, read once)."""
    global _cache
    if _cache is None:
        path = os.environ.get(CACHE_FILE_VARIABLE)
        _cache = ConfigCache(Path(path) if path else None)
    return _cache


def autotune_enabled() -> bool:
    from qscheme.environment import env_flag

    return env_flag(AUTOTUNE_VARIABLE)


def choose_config(
    key: str,
    k: int,
    heuristic: Callable[[], TileConfig],
    time_config: Callable[[TileConfig], float] | None = None,
) -> TileConfig:
    """The cached config for ``key``, else ``heuristic()``'s (timed against neighbours if asked).

    ``heuristic`` is called only on a cache miss (``heuristic_config`` for the layer); ``k``
    bounds the candidates' K tiles. ``time_config`` runs the GEMM with a config and returns its
    time (seconds or any unit); a config that fails to compile or launch is skipped.
    """
    cache = config_cache()
    cached = cache.get(key)
    if cached is not None:
        return cached
    base = heuristic()
    chosen = base
    if time_config is not None and autotune_enabled():
        best = float("inf")
        for option in candidate_configs(base, k):
            try:
                elapsed = time_config(option)
            except Exception:  # e.g. out of shared memory: not a candidate
                continue
            if elapsed < best:
                best, chosen = elapsed, option
    cache.put(key, chosen)
    return chosen
