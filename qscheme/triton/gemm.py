"""The generic quantized GEMM: y = x @ W^T with W decoded in registers from its canonical form.

One kernel, specialised by the constexprs of ``qscheme.triton.spec.Specialization``:

- weight codes: 4-bit (e2m1, int4, uint4: int32 words of eight laid out by
  ``qscheme.triton.layout``, each pair of codes cut out of a word as one register of two
  16-bit floats) or 8-bit, any element format (e4m3 by the hardware conversion where there is
  one, ``NATIVE_FP8``). ``W_DECODE`` (chosen by the host) decodes 4-bit codes in the dot's
  16-bit dtype where every scaled weight is then rounded once, as in float32; else float32;
- weight scale decoded in the K loop when tiled (group or block, index
  ``[n // W_SCALE_ROWS, k // W_SCALE_COLS]``, stored as e4m3 bits, e8m0 bytes or a float
  dtype), with zero points laid out the same way (int8, uint8 for unsigned formats, or widened
  to int32) or one float32 per row;
- activations as given (16- or 32-bit floats), or quantized codes from the pre-pass with
  per-group scales decoded in the loop or per-token scales applied in the epilogue;
- epilogue: per-token multiplier, per-output-row float32 multiplier (channel or tensor scales
  times the global scale of each fused partition, times static activation scales), bias.

The dot runs in x's dtype for fp16 and bf16 on a GPU (decoded values rounded to it; e2m1
times an e4m3 scale is exact there) and in float32 ("ieee") otherwise, always in float32 when
interpreted (the interpreter computes bf16 wrongly). ``WEIGHTS_FIRST`` computes y^T = W x^T
instead, both operands in the K order of ``mma_k_order``: on Hopper the warpgroup MMA then takes
the decoded weights straight from registers (the tile heuristic's choice there for the 4-bit
decode tile). With ``SPLIT_K > 1`` programs write float32
partial sums and ``split_k_epilogue_kernel`` adds them and applies the epilogue, or, with
``FUSED_SPLIT_K``, the last program of each output tile does (one launch instead of two; a
per-tile arrival counter in ``counter_ptr``, zero between launches). ``USE_PTX``
(CUDA only) lets the 4-bit decoders split registers with one ``mov``; ``ASM_DECODE`` (CUDA
only) decodes 4-bit words with the inline-PTX decoders of ``qscheme.triton.asm_decode`` (same
bits) where they cover the format and decode dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qscheme.triton.asm_decode import asm_decode_e2m1_words, asm_decode_int4_words
from qscheme.triton.decode import (
    CODEBOOK,
    DECODE_BF16,
    DECODE_FP16,
    DECODE_FP32,
    E2M1,
    INT4,
    SCALE_FLOAT,
    decode_e2m1_words,
    decode_element,
    decode_int4_words,
    decode_scale,
)
from qscheme.triton.spec import ACT_SCALE_PER_TOKEN, ACT_SCALE_TILED, ZERO_PER_ROW, ZERO_TILED

_ZERO_TILED: tl.constexpr = tl.constexpr(ZERO_TILED)
_ZERO_PER_ROW: tl.constexpr = tl.constexpr(ZERO_PER_ROW)
_ACT_PER_TOKEN: tl.constexpr = tl.constexpr(ACT_SCALE_PER_TOKEN)
_ACT_TILED: tl.constexpr = tl.constexpr(ACT_SCALE_TILED)

# DOT_DTYPE values
DOT_FP32: tl.constexpr = tl.constexpr(0)
DOT_FP16: tl.constexpr = tl.constexpr(1)
DOT_BF16: tl.constexpr = tl.constexpr(2)

# W_FOLD_SCALE: the decoded e2m1 tile is 2**-7 (bfloat16) or 2**-14 (float16) times the
# weights; the accumulator is scaled back.
_TWO_POW_119: tl.constexpr = tl.constexpr(2.0**119)
_FOLD_RESTORE_BF16: tl.constexpr = tl.constexpr(128.0)
_FOLD_RESTORE_FP16: tl.constexpr = tl.constexpr(16384.0)


@triton.jit
def _scale_as(values, stored, FORMAT: tl.constexpr, FOLD: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """A loaded scale in the dtype ``values`` are multiplied in, so each product is rounded
    once, as it is when both are float32 and the result is cast to the dot's dtype.

    16-bit values (the GPU's 16-bit dot paths for 4-bit weights) come only with scales exact in
    their dtype (the host's ``decode_dtype``: stored in it, possibly widened to float32 for the
    load, or e4m3, or e8m0 with bfloat16), so the cast is exact and each product is exact before
    its one rounding. float32 values take the scale as float32. ``FOLD`` (e2m1 bit patterns
    worth 2**-126 (bfloat16) or 2**-14 (float16) times their values, e4m3 scales): in bfloat16
    the scale times 2**119 (below 2**128), so the products are the weights times 2**-7, exact
    and normal; in float16 the scale itself, the products the weights times 2**-14, exact too
    (multiples of 2**-24 with at most 6 significant bits, below 0.17).
    """
    if FOLD and values.dtype == tl.float16:
        return decode_scale(stored, FORMAT, NATIVE_FP8).to(tl.float16)
    elif FOLD:
        return (decode_scale(stored, FORMAT, NATIVE_FP8) * _TWO_POW_119).to(tl.bfloat16)
    elif values.dtype == tl.float32:
        return decode_scale(stored, FORMAT, NATIVE_FP8)
    elif FORMAT == SCALE_FLOAT:
        return stored.to(values.dtype)
    else:
        return decode_scale(stored, FORMAT, NATIVE_FP8).to(values.dtype)


@triton.jit
def apply_tiled_scale(
    values,
    scale_ptr,
    zero_ptr,
    scale_rows,
    row_mask,
    k0,
    stride_row,
    stride_col,
    scale_cols_total,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_K: tl.constexpr,
    FORMAT: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    FOLD: tl.constexpr = False,
    NATIVE_FP8: tl.constexpr = False,
):
    """(values - zero) * scale for a [ROWS, BLOCK_K] tile whose scales are [rows, ceil(K/GROUP_K)]
    (element [r, c] at ``r * stride_row + c * stride_col``; zero points laid out alike).

    ``scale_rows`` [ROWS] is each tile row's scale row; three layouts of groups along K: several
    per tile (broadcast through a reshape), one per tile, or neither (a gather per element).
    Weight scales too narrow for an asynchronous copy come widened to 4 bytes (see
    ``qscheme.triton.linear``).
    ``scale_cols_total`` is a kernel argument, not computed from K, so Triton knows when it is a
    multiple of 16: the mask is then constant over runs of columns, the load is vectorised and
    the pipeliner streams the scales through shared memory with the codes (a byte-wise load
    would stall every K step on global memory).
    """
    if BLOCK_K % GROUP_K == 0 and BLOCK_K > GROUP_K:
        GROUPS: tl.constexpr = BLOCK_K // GROUP_K
        columns = k0 // GROUP_K + tl.arange(0, GROUPS)
        offsets = scale_rows[:, None] * stride_row + columns[None, :] * stride_col
        mask = row_mask[:, None] & (columns[None, :] < scale_cols_total)
        scale = _scale_as(values, tl.load(scale_ptr + offsets, mask=mask, other=0), FORMAT, FOLD, NATIVE_FP8)
        grouped = tl.reshape(values, (ROWS, GROUPS, GROUP_K))
        if HAS_ZERO:
            zero = tl.load(zero_ptr + offsets, mask=mask, other=0).to(values.dtype)
            grouped = grouped - zero[:, :, None]
        return tl.reshape(grouped * scale[:, :, None], (ROWS, BLOCK_K))
    elif GROUP_K % BLOCK_K == 0:
        offsets = scale_rows * stride_row + (k0 // GROUP_K) * stride_col
        scale = _scale_as(values, tl.load(scale_ptr + offsets, mask=row_mask, other=0), FORMAT, FOLD, NATIVE_FP8)
        if HAS_ZERO:
            values = values - tl.load(zero_ptr + offsets, mask=row_mask, other=0).to(values.dtype)[:, None]
        return values * scale[:, None]
    else:
        columns = (k0 + tl.arange(0, BLOCK_K)) // GROUP_K
        offsets = scale_rows[:, None] * stride_row + columns[None, :] * stride_col
        mask = row_mask[:, None] & (columns[None, :] < scale_cols_total)
        scale = _scale_as(values, tl.load(scale_ptr + offsets, mask=mask, other=0), FORMAT, FOLD, NATIVE_FP8)
        if HAS_ZERO:
            values = values - tl.load(zero_ptr + offsets, mask=mask, other=0).to(values.dtype)
        return values * scale


@triton.jit
def dot_nt(first, second, acc, DOT_DTYPE: tl.constexpr):
    """acc + first @ second^T, both operands [rows, K], the products in the dot's dtype."""
    if DOT_DTYPE == DOT_FP16:
        return tl.dot(first.to(tl.float16), tl.trans(second.to(tl.float16)), acc)
    elif DOT_DTYPE == DOT_BF16:
        return tl.dot(first.to(tl.bfloat16), tl.trans(second.to(tl.bfloat16)), acc)
    else:
        return tl.dot(first, tl.trans(second), acc, input_precision="ieee")


@triton.jit
def mma_k_order(values, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A [ROWS, BLOCK_K] dot operand with its K order permuted within each 32 columns: column
    32c + 8t + 2p + e goes to 32c + 8p + 2t + e (t, p < 4; e < 2).

    Both operands take the same permutation, so the dot is unchanged. What it buys: a 16-bit
    operand in registers is laid out by the tensor cores so that thread t of each quad holds
    columns 2t, 2t + 1, 2t + 8 and 2t + 9 of every 16; after the permutation those are, over 32
    columns, the eight consecutive columns 8t .. 8t + 7 of the original order: one word of
    4-bit codes, inside one scale group of 16 or more. So a decoded word goes to the tensor
    cores from the registers it was decoded in (Hopper's warpgroup MMA takes the weights as its
    register operand) and each thread applies half the group scales it would otherwise.
    """
    chunks = tl.reshape(values, (ROWS, BLOCK_K // 32, 4, 4, 2))
    return tl.reshape(tl.permute(chunks, (0, 1, 3, 2, 4)), (ROWS, BLOCK_K))


@triton.jit
def load_weight_tile(
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FORMAT: tl.constexpr,
    W_FOUR_BIT: tl.constexpr,
    W_SCALE_TILED: tl.constexpr,
    W_SCALE_FORMAT: tl.constexpr,
    W_SCALE_ROWS: tl.constexpr,
    W_SCALE_COLS: tl.constexpr,
    W_ZERO: tl.constexpr,
    W_DECODE: tl.constexpr,
    USE_PTX: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    W_FOLD_SCALE: tl.constexpr,
    W_MASK_K: tl.constexpr,
    ASM_DECODE: tl.constexpr = False,
):
    """The [BLOCK_N, BLOCK_K] tile of decoded weights (zero points and tiled scales applied).

    4-bit codes come as int32 words of eight (``qscheme.triton.layout``) decoded in the dtype
    ``W_DECODE`` names (float32, or the 16-bit dot dtype when every product is rounded as in
    float32); 8-bit codes are decoded to float32. ``W_MASK_K``: columns past K are set to zero
    after decoding. Their codes are padding (0); with a tiled zero point z they decode to
    -z times the last group's scale, which can overflow to inf, and inf times the zero input
    there is NaN. The host asks for it only where that can happen (ragged K, tiled zero points).
    """
    n_mask = offs_n < N
    if W_FOUR_BIT:
        offs_word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        # Rows are whole words and contiguous, so the row stride bounds them: unlike a bound
        # computed in the kernel, Triton knows its divisibility and vectorises the load.
        mask = n_mask[:, None] & (offs_word[None, :] < stride_wn)
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_word[None, :], mask=mask, other=0)
        if W_FORMAT == CODEBOOK:  # the codes index a float32 table, passed as w_zero_ptr (no zero points)
            codes = decode_int4_words(words, BLOCK_N, BLOCK_K // 8, False, DECODE_FP32, USE_PTX).to(tl.int32)
            values = tl.load(w_zero_ptr + codes)
        elif W_FORMAT == E2M1 and ASM_DECODE and W_DECODE == DECODE_BF16:
            values = asm_decode_e2m1_words(words, BLOCK_N, BLOCK_K // 8, W_FOLD_SCALE)
        elif W_FORMAT == E2M1:
            values = decode_e2m1_words(words, BLOCK_N, BLOCK_K // 8, W_DECODE, USE_PTX, W_FOLD_SCALE)
        elif ASM_DECODE and W_DECODE != DECODE_FP32:
            values = asm_decode_int4_words(words, BLOCK_N, BLOCK_K // 8, W_FORMAT == INT4, W_DECODE)
        else:
            values = decode_int4_words(words, BLOCK_N, BLOCK_K // 8, W_FORMAT == INT4, W_DECODE, USE_PTX)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (offs_k[None, :] < K)
        codes = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
        values = decode_element(codes, W_FORMAT, NATIVE_FP8)
    if W_ZERO == _ZERO_PER_ROW:
        values = values - zero_per_row[:, None].to(values.dtype)
    if W_SCALE_TILED:
        if W_SCALE_ROWS == 1:
            scale_rows = offs_n  # not offs_n // 1: Triton's analysis would lose its contiguity
        else:
            scale_rows = offs_n // W_SCALE_ROWS
        values = apply_tiled_scale(
            values,
            w_scale_ptr,
            w_zero_ptr,
            scale_rows,
            n_mask,
            k0,
            stride_ws,
            1,
            w_scale_cols,
            BLOCK_N,
            BLOCK_K,
            W_SCALE_COLS,
            W_SCALE_FORMAT,
            W_ZERO == _ZERO_TILED,
            W_FOLD_SCALE,
            NATIVE_FP8,
        )
    if W_MASK_K:
        k_inside = (k0 + tl.arange(0, BLOCK_K)) < K
        values = tl.where(k_inside[None, :], values, tl.zeros_like(values))
    return values


@triton.jit
def load_input_tile(
    x_ptr,
    x_scale_ptr,
    pre_scale_ptr,
    offs_m,
    k0,
    M,
    K,
    stride_xm,
    stride_xs,
    x_scale_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_QUANTIZED: tl.constexpr,
    A_FORMAT: tl.constexpr,
    A_SCALE: tl.constexpr,
    A_SCALE_FORMAT: tl.constexpr,
    A_GROUP: tl.constexpr,
    HAS_PRE_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """The [BLOCK_M, BLOCK_K] input tile: x itself (upcast when asked) or decoded quantized codes."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    mask = m_mask[:, None] & (offs_k[None, :] < K)
    loaded = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0)
    if A_QUANTIZED:
        values = decode_element(loaded, A_FORMAT, NATIVE_FP8)
        if A_SCALE == _ACT_TILED:
            values = apply_tiled_scale(
                values,
                x_scale_ptr,
                x_scale_ptr,
                offs_m,
                m_mask,
                k0,
                stride_xs,
                1,
                x_scale_cols,
                BLOCK_M,
                BLOCK_K,
                A_GROUP,
                A_SCALE_FORMAT,
                False,
            )
        return values
    elif HAS_PRE_SCALE:
        pre_scale = tl.load(pre_scale_ptr + offs_k, mask=offs_k < K, other=0).to(tl.float32)
        return loaded.to(tl.float32) * pre_scale[None, :]
    elif UPCAST:
        return loaded.to(tl.float32)
    else:
        return loaded


@triton.jit
def epilogue(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    x_scale_ptr,
    row_scale_ptr,
    bias_ptr,
    out_ptr,
    stride_om,
    A_SCALE: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Per-token and per-row multipliers, bias, cast to the output dtype, masked store."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    if A_SCALE == _ACT_PER_TOKEN:
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    if HAS_ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def tile_start(
    w_zero_ptr,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    W_ZERO: tl.constexpr,
):
    """Where a program's output tile and K split lie (the GEMM's and the GEMV's): program id,
    row-tile id, row and column offsets, per-row zero points, split index and its K range."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles share each weight tile while it is in L2.
    group_width = GROUP_M * num_pid_n
    first_m = (pid // group_width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_rows
    pid_n = (pid % group_width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    zero_per_row = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if W_ZERO == _ZERO_PER_ROW:
        zero_per_row = tl.load(w_zero_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)

    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    split = tl.program_id(1)
    k_begin = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)
    return pid, pid_m, offs_m, offs_n, zero_per_row, split, k_begin, k_end


@triton.jit
def tile_finish(
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
    A_SCALE: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FUSED_SPLIT_K: tl.constexpr,
    W_FOLD_SCALE: tl.constexpr,
    W_DECODE: tl.constexpr,
):
    """A program's [BLOCK_M, BLOCK_N] float32 result: the folded power of two restored, then
    through the epilogue into the output, or, split over K, stored as a partial sum (reduced by
    the tile's last program with FUSED_SPLIT_K)."""
    if W_FOLD_SCALE and W_DECODE == DECODE_FP16:
        acc = acc * _FOLD_RESTORE_FP16
    elif W_FOLD_SCALE:
        acc = acc * _FOLD_RESTORE_BF16

    if SPLIT_K == 1:
        epilogue(
            acc,
            offs_m,
            offs_n,
            M,
            N,
            x_scale_ptr,
            row_scale_ptr,
            bias_ptr,
            out_ptr,
            stride_om,
            A_SCALE,
            HAS_ROW_SCALE,
            HAS_BIAS,
        )
    else:
        tile_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        offsets = offs_m[:, None] * N + offs_n[None, :]
        tl.store(out_ptr + split * stride_split + offsets, acc, mask=tile_mask)
        if FUSED_SPLIT_K:
            # The last of the tile's SPLIT_K programs to finish adds the partial sums in split
            # order (as split_k_epilogue_kernel does: same bits, deterministic), applies the
            # epilogue and resets the tile's counter to zero for the next launch. The barrier
            # orders every thread's partial store before the counter's release; the acquire
            # (broadcast to the program by the scalar atomic) orders the reads after it.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                reduce_partials(
                    out_ptr,
                    offs_m,
                    offs_n,
                    M,
                    N,
                    stride_split,
                    x_scale_ptr,
                    row_scale_ptr,
                    bias_ptr,
                    final_ptr,
                    stride_om,
                    A_SCALE,
                    HAS_ROW_SCALE,
                    HAS_BIAS,
                    SPLIT_K,
                    ".cg",  # past the L1 cache: other programs wrote the partials
                )
                tl.atomic_xchg(counter_ptr + pid, 0)


@triton.jit
def quantized_gemm_kernel(
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
    """One [BLOCK_M, BLOCK_N] output tile (over one K split); see the module docstring."""
    pid, _pid_m, offs_m, offs_n, zero_per_row, split, k_begin, k_end = tile_start(
        w_zero_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GROUP_M, W_ZERO
    )

    if WEIGHTS_FIRST:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        a = load_input_tile(
            x_ptr,
            x_scale_ptr,
            pre_scale_ptr,
            offs_m,
            k0,
            M,
            K,
            stride_xm,
            stride_xs,
            x_scale_cols,
            BLOCK_M,
            BLOCK_K,
            A_QUANTIZED,
            A_FORMAT,
            A_SCALE,
            A_SCALE_FORMAT,
            A_GROUP,
            HAS_PRE_SCALE,
            DOT_DTYPE == DOT_FP32,
            NATIVE_FP8,
        )
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
        )
        if WEIGHTS_FIRST:  # acc is y^T: W x^T
            acc = dot_nt(mma_k_order(w, BLOCK_N, BLOCK_K), mma_k_order(a, BLOCK_M, BLOCK_K), acc, DOT_DTYPE)
        else:
            acc = dot_nt(a, w, acc, DOT_DTYPE)
    if WEIGHTS_FIRST:
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


@triton.jit
def reduce_partials(
    partial_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_split,
    x_scale_ptr,
    row_scale_ptr,
    bias_ptr,
    out_ptr,
    stride_om,
    A_SCALE: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    CACHE_MODIFIER: tl.constexpr,
):
    """Sum a tile's SPLIT_K float32 partials ([split, M, N]) in split order, then the epilogue."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offsets = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(
            partial_ptr + split * stride_split + offsets, mask=mask, other=0.0, cache_modifier=CACHE_MODIFIER
        )
    epilogue(
        acc,
        offs_m,
        offs_n,
        M,
        N,
        x_scale_ptr,
        row_scale_ptr,
        bias_ptr,
        out_ptr,
        stride_om,
        A_SCALE,
        HAS_ROW_SCALE,
        HAS_BIAS,
    )


@triton.jit
def split_k_epilogue_kernel(
    partial_ptr,
    x_scale_ptr,
    row_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_split,
    stride_om,
    A_SCALE: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sum the SPLIT_K float32 partial tiles in a fixed order, then the epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    reduce_partials(
        partial_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_split,
        x_scale_ptr,
        row_scale_ptr,
        bias_ptr,
        out_ptr,
        stride_om,
        A_SCALE,
        HAS_ROW_SCALE,
        HAS_BIAS,
        SPLIT_K,
        "",
    )
