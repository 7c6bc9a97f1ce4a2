"""How fast the Triton GEMM's tiles can stream its bytes, with nothing else to do: a diagnostic.

    python benchmarks/triton_stream.py [--scheme NAME] [--markdown FILE]   # on a CUDA GPU
    python benchmarks/triton_stream.py --smoke                             # CPU, interpreter

A copy of the GEMM's memory traffic without its work: the same grid (output tiles x K splits),
the same loads per K step (the [BLOCK_N, BLOCK_K] tile of codes as the GEMM reads them, 4-bit
codes as int32 words of eight; the tile's scales; the [BLOCK_M, BLOCK_K] input tile) through
the same software pipeline (``num_stages``), but each loaded register is only XORed into an
accumulator, reduced and stored once per program. Its time is what the tile configuration
costs in memory traffic alone; the GEMM's time at the same config over it says how much the
decode and the tensor-core work add. For each config it prints both times, the weight
bandwidth (codes and scales over the time, as ``triton_sweep.py``) and its fraction of the
roofline. Timing as ``gpu_gemm.py``: CUDA graphs, weights cycled to defeat L2, median of 20.

Reading it: a stream time near the roofline with a GEMM far above means the loop's work is
the limit (decode, MMA, layout moves: ``triton_sass.py``); a stream time as slow as the GEMM
means the tiles and grid keep too few bytes in flight, and tile choice is the lever.

``--smoke`` runs small shapes under ``TRITON_INTERPRET=1`` and checks the stored XORs against
the same XORs computed by torch, so the kernel reads exactly the bytes the GEMM reads.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import replace

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton decorates the kernels
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch
import triton
import triton.language as tl

from qscheme.triton.configs import TileConfig
from qscheme.triton.launch import Launch

SHAPES = ((8192, 8192), (4096, 4096))
SMOKE_SHAPES = ((64, 256), (96, 384))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def stream_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ws,
    scale_cols,
    WORD_K: tl.constexpr,  # codes per loaded element: 8 (int32 words of 4-bit codes) or 1
    SCALE_ROWS: tl.constexpr,
    SCALE_K: tl.constexpr,  # weights per scale along K (the tiled scale's column width)
    SCALES_PER_STEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    split = tl.program_id(1)
    k_begin = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)
    acc_w = tl.zeros((BLOCK_N, BLOCK_K // WORD_K), dtype=tl.int32)
    acc_s = tl.zeros((BLOCK_N, SCALES_PER_STEP), dtype=tl.int32)
    acc_x = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    # tl.range's num_stages: Triton pipelines a loop's loads without a dot only when asked
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        offs_word = k0 // WORD_K + tl.arange(0, BLOCK_K // WORD_K)
        words = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_word[None, :],
            mask=n_mask[:, None] & (offs_word[None, :] < stride_wn),
            other=0,
        )
        acc_w ^= words.to(tl.int32)
        offs_s = k0 // SCALE_K + tl.arange(0, SCALES_PER_STEP)
        if SCALE_ROWS == 1:
            scale_rows = offs_n
        else:
            scale_rows = offs_n // SCALE_ROWS
        scales = tl.load(
            s_ptr + scale_rows[:, None] * stride_ws + offs_s[None, :],
            mask=n_mask[:, None] & (offs_s[None, :] < scale_cols),
            other=0,
        )
        acc_s ^= scales.to(tl.int32)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
            other=0,
        )
        acc_x ^= x.to(tl.int32)
    row = tl.reduce(acc_w, 1, _xor) ^ tl.reduce(acc_s, 1, _xor)
    inputs = tl.reduce(tl.reduce(acc_x, 1, _xor), 0, _xor)
    tl.store(out_ptr + (split * tl.cdiv(M, BLOCK_M) + pid_m) * N + offs_n, row ^ inputs, mask=n_mask)


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as a signed integer dtype of the element's size (loads widen them exactly)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


@functools.cache
def _zero_scales(device: str) -> torch.Tensor:
    return torch.zeros(1, 1, dtype=torch.uint8, device=device)


def stream_launch(prepared: object, x: torch.Tensor, config: TileConfig, out: torch.Tensor) -> Launch:
    """The launch ``stream`` runs (also built from CPU tensors by ``--compile-check``)."""
    codes = _as_integers(prepared.codes)  # type: ignore[attr-defined]
    spec = prepared.spec  # type: ignore[attr-defined]
    n, k = prepared.n, prepared.k  # type: ignore[attr-defined]
    scale = prepared.scale  # type: ignore[attr-defined]
    if scale is None or not spec.W_SCALE_TILED:
        scale, scale_rows, scale_k = _zero_scales(str(codes.device)), n, k
    else:
        scale_rows, scale_k = spec.W_SCALE_ROWS, spec.W_SCALE_COLS
    scale = _as_integers(scale)
    m = x.shape[0]
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k)
    arguments = {
        "x_ptr": _as_integers(x),
        "w_ptr": codes,
        "s_ptr": scale,
        "out_ptr": out,
        "M": m,
        "N": n,
        "K": k,
        "stride_xm": x.stride(0),
        "stride_wn": codes.stride(0),
        "stride_ws": scale.stride(0),
        "scale_cols": scale.shape[1],
    }
    constexprs = {
        "WORD_K": 8 if spec.W_FOUR_BIT else 1,
        "SCALE_ROWS": scale_rows,
        "SCALE_K": scale_k,
        "SCALES_PER_STEP": max(1, config.block_k // scale_k),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "SPLIT_K": config.split_k,
        "STAGES": config.num_stages,
    }
    return Launch(stream_kernel, grid, arguments, constexprs, config.num_warps, config.num_stages, config.describe())


def stream(prepared: object, x: torch.Tensor, config: TileConfig) -> torch.Tensor:
    """XOR of the bytes each program of ``config``'s grid loads, per (split, row tile, column)."""
    out = torch.empty(
        config.split_k, triton.cdiv(x.shape[0], config.block_m), prepared.n, dtype=torch.int32, device=x.device
    )  # type: ignore[attr-defined]
    stream_launch(prepared, x, config, out).run()
    return out


def expected_stream(prepared: object, x: torch.Tensor, config: TileConfig) -> torch.Tensor:
    """``stream``'s result computed step by step by torch from the same tensors (for --smoke)."""
    codes = _as_integers(prepared.codes).to(torch.int32).cpu()  # type: ignore[attr-defined]
    spec = prepared.spec  # type: ignore[attr-defined]
    n, k = prepared.n, prepared.k  # type: ignore[attr-defined]
    word_k = 8 if spec.W_FOUR_BIT else 1
    inputs = _as_integers(x).to(torch.int32).cpu()
    scale = prepared.scale  # type: ignore[attr-defined]
    values = _as_integers(scale).to(torch.int32).cpu() if scale is not None and spec.W_SCALE_TILED else None
    per_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k)
    row_tiles = triton.cdiv(x.shape[0], config.block_m)
    out = torch.zeros(config.split_k, row_tiles, n, dtype=torch.int32)
    for split in range(config.split_k):
        begin = split * per_split * config.block_k
        row = torch.zeros(n, dtype=torch.int32)
        inputs_xor = torch.zeros(x.shape[0], dtype=torch.int32)
        for k0 in range(begin, min(begin + per_split * config.block_k, k), config.block_k):
            for word in range(k0 // word_k, min((k0 + config.block_k) // word_k, codes.shape[1])):
                row ^= codes[:, word]
            if values is not None:
                first = k0 // spec.W_SCALE_COLS
                for column in range(first, min(first + max(1, config.block_k // spec.W_SCALE_COLS), values.shape[1])):
                    row ^= values[:, column].repeat_interleave(spec.W_SCALE_ROWS)[:n]
            for column in range(k0, min(k0 + config.block_k, k)):
                inputs_xor ^= inputs[:, column]
        for tile in range(row_tiles):
            block = inputs_xor[tile * config.block_m : (tile + 1) * config.block_m]
            value = 0
            for item in block.tolist():
                value ^= item
            out[split, tile] = row ^ value
    return out


def _configs(prepared: object, base: TileConfig) -> list[TileConfig]:
    """``base`` (the heuristic's tile), the same tile the other way round, and wider tiles that
    keep more bytes in flight."""
    options = [base, replace(base, weights_first=not base.weights_first)]
    for block_n, block_k, warps, stages in ((128, 128, 8, 4), (64, 256, 4, 4), (128, 256, 8, 3), (64, 128, 4, 6)):
        options.append(replace(base, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages))
    return list(dict.fromkeys(options))


def smoke() -> int:
    from qscheme.catalog import load_scheme
    from qscheme.triton.linear import prepare_weight
    from qscheme.triton.samples import random_weight

    checks = 0
    for name in (
        "compressed-tensors/NVFP4A16",
        "compressed-tensors/W4A16",
        "compressed-tensors/FP8_DYNAMIC",
        "modelopt/fp8_pb_wo",
    ):
        scheme = load_scheme(name)
        for n, k in SMOKE_SHAPES:
            prepared = prepare_weight(random_weight(scheme, n, k, seed=n + k), "cpu")
            for m in (1, 5) if n == SMOKE_SHAPES[0][0] else (3,):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                for config in (
                    TileConfig(16, 32, 64, split_k=2, num_stages=1),
                    TileConfig(16, 64, 128, split_k=3, num_stages=1),
                    TileConfig(16, 64, 32, split_k=1, num_stages=1),
                ):
                    actual, expected = stream(prepared, x, config), expected_stream(prepared, x, config)
                    if not torch.equal(actual, expected):
                        print(f"MISMATCH {name} {n}x{k} M={m} {config.describe()}", file=sys.stderr)
                        return 1
                    checks += 1
    print(f"stream smoke: {checks} checks, every stored XOR equals torch's")
    return 0


def compile_check(targets: list[str]) -> int:
    """Compile the stream kernel of the GPU run's configs (sized for an H100-class device) for
    ``targets`` without a GPU (``qscheme.triton.compile_check``); 1 if one fails."""
    from qscheme.catalog import load_scheme
    from qscheme.triton import compile_check as cc
    from qscheme.triton import configs
    from qscheme.triton.linear import heuristic_for, prepare_weight
    from qscheme.triton.samples import random_weight

    device = configs.DeviceFacts("H100-like", 132, cc.SHARED_MEMORY["sm90"], (9, 0))
    failed = 0
    for name in ("compressed-tensors/NVFP4A16", "compressed-tensors/W4A16"):
        prepared = prepare_weight(random_weight(load_scheme(name), 256, 512), "cpu")
        x = torch.randn(16, 512, dtype=torch.bfloat16)
        base = heuristic_for(prepared, 16, 8192, 8192, torch.bfloat16, device)
        for config in _configs(prepared, base):
            out = torch.empty(config.split_k, 1, 256, dtype=torch.int32)
            variant = cc.Variant(f"{name} stream {config.describe()}", stream_launch(prepared, x, config, out))
            for target in targets:
                result = cc.compile_variant(variant, target)
                failed += not result.ok
                status = "ok" if result.ok else "FAILED"
                print(
                    f"{status:6s} {target:6s} shared {result.shared_bytes:6d} {variant.name} {result.error}", flush=True
                )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scheme", default="compressed-tensors/NVFP4A16")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--smoke", action="store_true", help="CPU check of the kernel under the interpreter")
    parser.add_argument("--compile-check", metavar="TARGETS", help="compile for these targets (e.g. sm80,sm90), no GPU")
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if args.compile_check:
        return compile_check(args.compile_check.split(","))
    if not torch.cuda.is_available():
        print("no CUDA GPU is visible: run with --smoke for the CPU check", file=sys.stderr)
        return 2

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_gemm import copies_for, graph_time, peak_bandwidth, prepared_bytes

    from qscheme.catalog import load_scheme
    from qscheme.triton import linear as lin
    from qscheme.triton.samples import model_scale_dtype, random_weight

    scheme = load_scheme(args.scheme)
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name)
    lines = [
        f"Scheme {scheme.name}, bf16 inputs, on {name}: stream = the GEMM's loads alone (same grid, tiles "
        "and pipeline), GB/s = weight codes and scales over the time.",
        "",
        "| N x K | M | tile | stream us | stream GB/s | stream roofline | GEMM us | GEMM GB/s | GEMM / stream |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for n, k in SHAPES:
        weight = random_weight(scheme, n, k, scale_dtype=model_scale_dtype(scheme, torch.bfloat16))
        first = lin.prepare_weight(weight, "cuda")
        nbytes = prepared_bytes(first)
        prepared = [first] + [lin.prepare_weight(weight, "cuda") for _ in range(copies_for(nbytes) - 1)]
        m = 16  # M = 1 runs the same grid (one 16-row tile); only the input mask differs
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base = lin.heuristic_for(first, m, n, k, torch.bfloat16, lin._device_facts(torch.cuda.current_device()))
        streamed: dict[TileConfig, float] = {}  # the stream ignores weights_first
        for config in _configs(first, base):
            try:
                plain = replace(config, weights_first=False)
                if plain not in streamed:
                    streamed[plain] = graph_time([functools.partial(stream, p, x, config) for p in prepared])
                stream_s = streamed[plain]
                gemm_s = graph_time([functools.partial(lin.linear, p, x, config=config) for p in prepared])
            except Exception as exc:  # e.g. out of shared memory: report and go on
                line = f"| {n}x{k} | {m} | {config.describe()} | failed: {type(exc).__name__} | | | | | |"
            else:
                stream_gbs, gemm_gbs = nbytes / stream_s / 1e9, nbytes / gemm_s / 1e9
                roofline = f"{stream_gbs / peak:.0%}" if peak else "-"
                line = (
                    f"| {n}x{k} | {m} | {config.describe()} | {stream_s * 1e6:.1f} | {stream_gbs:.0f} | {roofline} "
                    f"| {gemm_s * 1e6:.1f} | {gemm_gbs:.0f} | {gemm_s / stream_s:.2f}x |"
                )
            lines.append(line)
            print(line, flush=True)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
