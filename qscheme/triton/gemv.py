"""The CUDA-core GEMV for the smallest M (decode with 1-4 tokens): y = x @ W^T without tensor cores.

At M <= 4 a tensor-core tile is mostly padding (a Hopper warpgroup MMA has M = 64 rows; even
weights-first, N = 8 columns hold 1-4 tokens) and the GEMM is bound by how fast every SM streams
the weight. This kernel does only that: each program takes a slab of ``BLOCK_N`` weight rows,
streams them along K in steps of ``BLOCK_K`` (4-bit rows: ``BLOCK_K / 8`` int32 words, 128-bit
loads along each row, whole cache lines), decodes them in registers with the GEMM's own decoder
(``gemm.load_weight_tile``: same formats, zero points, tiled scales, folded powers of two), and
multiplies them with each of the ``BLOCK_M`` input rows in float32 FMAs, reducing along K per
step. K is split (``SPLIT_K``) until every SM has programs streaming; partial sums go through the
GEMM's split-K paths (two-pass epilogue kernel or the fused last-program reduction).

The kernel takes exactly the GEMM kernel's arguments (``gemm.quantized_gemm_kernel``), so the
host code launches either from one template; the tensor-core constexprs (``DOT_DTYPE``,
``WEIGHTS_FIRST``, activation quantization) are accepted and ignored: the GEMV runs weight-only
schemes (16- or 32-bit inputs, optional AWQ pre-scale), chosen by the tile heuristic
(``configs.gemv_config``).

Numerics equal the GEMM's 16-bit dot path: each decoded weight (times its tiled scale) is rounded
once to the decode dtype, the inputs are exact in float32, and the products are exact in float32
before they are summed, so the two differ only in the order of float32 additions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qscheme.triton.gemm import load_weight_tile, tile_finish, tile_start


@triton.jit
def load_input_row(x_ptr, pre_scale, m, offs_k, M, K, stride_xm, HAS_PRE_SCALE: tl.constexpr):
    """Input row ``m`` over the K step ``offs_k`` as float32 (zeros past M or K), pre-scaled."""
    rows = m + tl.zeros_like(offs_k)  # the row as a vector: a scalar mask term breaks the interpreter
    loaded = tl.load(x_ptr + rows * stride_xm + offs_k, mask=(offs_k < K) & (rows < M), other=0.0).to(tl.float32)
    if HAS_PRE_SCALE:
        loaded = loaded * pre_scale
    return loaded


@triton.jit
def quantized_gemv_kernel(
    x_ptr,
    x_scale_ptr,
    pre_scale_ptr,
    w_ptr,
    w_scale_ptr,
    w_zero_ptr,
    row_scale_ptr,
    bias_ptr,
    out_ptr,
    final_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xs,
    stride_wn,
    stride_ws,
    stride_om,
    stride_split,
    w_scale_cols,
    x_scale_cols,
    FUSED_SPLIT_K: tl.constexpr,
    W_FORMAT: tl.constexpr,
    W_FOUR_BIT: tl.constexpr,
    W_SCALE_TILED: tl.constexpr,
    W_SCALE_FORMAT: tl.constexpr,
    W_SCALE_ROWS: tl.constexpr,
    W_SCALE_COLS: tl.constexpr,
    W_ZERO: tl.constexpr,
    W_DECODE: tl.constexpr,
    W_FOLD_SCALE: tl.constexpr,
    A_QUANTIZED: tl.constexpr,
    A_FORMAT: tl.constexpr,
    A_SCALE: tl.constexpr,
    A_SCALE_FORMAT: tl.constexpr,
    A_GROUP: tl.constexpr,
    HAS_PRE_SCALE: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    USE_PTX: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
    W_MASK_K: tl.constexpr,
    ASM_DECODE: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over one K split; see the module docstring."""
    tl.static_assert(not A_QUANTIZED, "the GEMV takes 16- or 32-bit inputs (weight-only schemes)")
    pid, pid_m, offs_m, offs_n, zero_per_row, split, k_begin, k_end = tile_start(
        w_zero_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GROUP_M, W_ZERO
    )

    columns = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T: one column per input row
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        pre_scale = tl.zeros((BLOCK_K,), dtype=tl.float32)
        if HAS_PRE_SCALE:
            pre_scale = tl.load(pre_scale_ptr + offs_k, mask=offs_k < K, other=0).to(tl.float32)
        w = load_weight_tile(
            w_ptr,
            w_scale_ptr,
            w_zero_ptr,
            offs_n,
            k0,
            N,
            K,
            stride_wn,
            stride_ws,
            w_scale_cols,
            zero_per_row,
            BLOCK_N,
            BLOCK_K,
            W_FORMAT,
            W_FOUR_BIT,
            W_SCALE_TILED,
            W_SCALE_FORMAT,
            W_SCALE_ROWS,
            W_SCALE_COLS,
            W_ZERO,
            W_DECODE,
            USE_PTX,
            NATIVE_FP8,
            W_FOLD_SCALE,
            W_MASK_K,
            ASM_DECODE,
        ).to(tl.float32)  # exact: the decode dtype's values are float32 values
        for row in tl.static_range(BLOCK_M):
            x_row = load_input_row(x_ptr, pre_scale, pid_m * BLOCK_M + row, offs_k, M, K, stride_xm, HAS_PRE_SCALE)
            partial = tl.sum(w * x_row[None, :], axis=1)
            acc = tl.where(columns[None, :] == row, acc + partial[:, None], acc)
    acc = tl.trans(acc)
    tile_finish(
        acc,
        pid,
        split,
        offs_m,
        offs_n,
        M,
        N,
        x_scale_ptr,
        row_scale_ptr,
        bias_ptr,
        out_ptr,
        final_ptr,
        counter_ptr,
        stride_om,
        stride_split,
        A_SCALE,
        HAS_ROW_SCALE,
        HAS_BIAS,
        SPLIT_K,
        FUSED_SPLIT_K,
        W_FOLD_SCALE,
        W_DECODE,
    )
