// The 4-bit GEMV loop for one to four bfloat16 rows of x on 16-bit dot products (cpu_gemv.h:
// Int16Input), written once over a product policy D and included by one translation unit per
// instruction set, each compiled by its own target pragma in its own namespace:
//
// - cpu_gemv_int16.cpp (AVX512-VNNI): x as 16-bit integers over a power-of-two step per block of
//   256 elements, the codes looked up as 16-bit integers (the code values times a power of two),
//   products summed exactly in 32-bit lanes (VPDPWSSD); with zero points, each lane also sums its
//   elements of x (VPDPWSSD with ones) and, before the conversion, the zero point (times the
//   table's factor) times that sum is subtracted: sum x * (value - zero), exact in 32 bits (|x| <
//   2**15, at most 16 elements per lane between two flushes, |value|, |zero| <= 2047);
// - cpu_gemv_bf16dot.cpp (AVX512-BF16): x as its bfloat16 values, the codes looked up as bfloat16
//   values (each exact in bfloat16), products exact and summed in float32 lanes (VDPBF16PS); no
//   zero points.
//
// A chunk of 128 weights is one 64-byte load: its 32 words hold elements 4i..4i+3 in their four
// nibbles, looked up by four VPERMWs (the word itself, then shifted by 4, 8 and 12: the index's fifth
// bit, another nibble, finds the table twice over), and x comes in the same order (bf16_words.h:
// dot_loop_order), so that lane j of a chunk holds elements 8j..8j+7. Where k_main is an odd multiple
// of 64, its last 64 are a chunk of their own (32 bytes widened to words, the low then the high
// nibbles; lane j: elements 4j..4j+3). With groups of 16, 32 or 64 a lane never mixes two groups:
// after each chunk (groups of 16-64) or at the end of each group and block (groups of a multiple of
// 128, or one for the row) the lane sums are multiplied by their group's scale in float32, and
// (integers) each block's sum by its step (a power of two: exact).
//
// D provides: INTEGER, acc (the lane sums' type), zero(), dot(acc, weights, x), widen(acc) (float32).
#pragma once

#include "cpu_gemv_kernel.h"
#include "row_streams.h"

namespace QS_ISA_NAMESPACE {
constexpr int64_t BLOCK = 256, PREFETCH_BYTES = 1024;

// 16 e4m3 or e8m0 scale bytes as float32, bit for bit their table values (ByteFormat).
static inline __m512 decode_bytes(__m128i raw, int format) {
    if (format == BYTE_E4M3) {
        // s eeee mmm -> float16 s 0 eeee mmm 0000000 (exact, subnormals included), scaled by 2**8
        // (the bias difference); 0x7F and 0xFF are NaN
        __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
        h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(static_cast<short>(0xBF80)));
        const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
        const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(raw, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(__builtin_nanf("")));
    }
    // e8m0: 2**(e - 127) is the exponent field; e = 0 the subnormal 2**-127, e = 255 NaN
    const __m512i e = _mm512_cvtepu8_epi32(raw);
    __m512i bits = _mm512_slli_epi32(e, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(bits);
}

// e4m3 and e8m0 scale bytes decoded by arithmetic (late_factor), not through the row's table: the
// row's factor is then left out of the groups' scales and applied to the row's sum at its end (one
// division a row, not one every 16 groups: the division was a quarter of NVFP4's time on the AMX
// Xeon; the sums change by at most one rounding a term, within the float32 bound).
static inline bool late_factor(const Params &p) {
    return p.scale_kind == SCALE_BYTE && p.byte_format != BYTE_TABLE && p.row_scale;
}

// The scales of row n's groups [g0, g0 + count) (count <= 16) as one vector: e4m3 and e8m0 bytes
// decoded by arithmetic, without the row's factor (late_factor; a gather of the table is slow on
// some CPUs: 40% of NVFP4's time on Zen 4), other bytes looked up in the row's table (the factor
// in it, as byte_scales makes it), float scales as fill_scales gave them.
static inline __m512 group_scales(const Params &p, const uint8_t *bytes, const float *table, const float *scales,
                                  int64_t g0, int64_t count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    if (!bytes) return _mm512_maskz_loadu_ps(mask, scales + g0);
    const __m128i raw = _mm_maskz_loadu_epi8(mask, bytes + g0);
    if (p.byte_format != BYTE_TABLE) return _mm512_maskz_mov_ps(mask, decode_bytes(raw, p.byte_format));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, _mm512_cvtepu8_epi32(raw), table, 4);
}

// The zero points of row n's groups [g0, g0 + count) (count <= 16) times the table's factor, as 32-bit lanes.
static inline __m512i group_zeros(const int32_t *zeros, int64_t g0, int64_t count) {
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << count) - 1u), zeros + g0);
}

// Lane j's group within a chunk whose lanes hold `width` elements each (8, or 4 in a last chunk of 64),
// for groups of G (16, 32 or 64).
template <int G>
static inline __m512i lane_groups(int width) {
    alignas(64) int32_t group[16];
    for (int j = 0; j < 16; j++) group[j] = G ? j * width / G : 0;
    return _mm512_load_si512(group);
}

// R weight rows n, n + step, ... (one from each of R streams: row_streams.h) times M rows of x; G:
// the scale group (16, 32 or 64: one or more per chunk; 0: a multiple of 128, or one for the row);
// Z: with zero points (integer products only). acc[m * ldy + n]: row m's sums.
template <class D, int R, int M, int G, bool Z>
static void rows_dot(const Params &p, const Int16Input &in, int64_t n, int64_t step, float *acc, int64_t ldy,
                     Scratch &work) {
    const int64_t g = p.group_k, k_main = in.k_main, cols = p.scale_cols, stride = p.code_stride;
    const __m512i table = _mm512_loadu_si512(in.table);
    const __m512i lanes128 = lane_groups<G>(8), lanes64 = lane_groups<G>(4);
    const __m512i next_chunk = _mm512_set1_epi32(G ? 128 / G : 0);
    const bool byte_scale = p.scale_kind == SCALE_BYTE, late = G && late_factor(p);
    const uint8_t *scale_bytes[R];
    const float *scale_table[R], *scales[R];
    std::vector<float> &buffer = work.buffer;
    if (buffer.size() < static_cast<size_t>(R * cols)) buffer.resize(static_cast<size_t>(R * cols));
    const int32_t *zeros[R];  // Z: each row's zero points times the table's factor
    if (Z) {
        std::vector<int32_t> &held = work.zeros;
        if (held.size() < static_cast<size_t>(R * cols)) held.resize(static_cast<size_t>(R * cols));
        const int32_t factor = static_cast<int32_t>(in.factor);
        for (int r = 0; r < R; r++) {
            const int16_t *z = p.zero + scale_row_base(p, n + r * step);
            int32_t *row = held.data() + r * cols;
            for (int64_t c = 0; c < cols; c++) row[c] = static_cast<int32_t>(z[c]) * factor;
            zeros[r] = row;
        }
    }
    const __m512i ones = _mm512_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        scale_bytes[r] = nullptr;
        scale_table[r] = nullptr;
        scales[r] = buffer.data() + r * cols;
        if (byte_scale) {
            scale_bytes[r] = static_cast<const uint8_t *>(p.scale) + scale_row_base(p, n + r * step);
            scale_table[r] = late ? p.scale_table : byte_scales(p, n + r * step, work);
        } else {
            fill_scales(p, n + r * step, buffer.data() + r * cols);
        }
    }
    const uint8_t *codes = p.codes + n * stride;
    const int64_t gap = step * stride;       // from one stream's row to the next stream's
    const int64_t later = qscheme_rows::stream_next<R>(step);  // rows to this row's stream's next
    if (byte_scale && n + (R - 1) * step + later < p.n)  // each stream's next row's scales
        for (int r = 0; r < R; r++) {
            const uint8_t *next = static_cast<const uint8_t *>(p.scale) + scale_row_base(p, n + r * step + later);
            for (int64_t b = 0; b < cols; b += 64) _mm_prefetch(reinterpret_cast<const char *>(next + b), _MM_HINT_T0);
        }
    // part: the scaled sums of the current block of 256 (integer products: times the block's step
    // into total at its end) or of the whole row (bfloat16 products: x as it is, no step)
    __m512 total[R][M], part[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) total[r][m] = part[r][m] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < k_main; b0 += BLOCK) {
        const int64_t b1 = std::min(k_main, b0 + BLOCK);
        int64_t group = b0 / g, group_end = (group + 1) * g;  // G = 0: the current group and where it ends
        __m512 s16[R];
        typename D::acc sum[R][M];
        __m512i z16[R], xsum[M];
        for (int m = 0; m < M; m++) xsum[m] = _mm512_setzero_si512();
        for (int r = 0; r < R; r++) {
            for (int m = 0; m < M; m++) {
                if (D::INTEGER) part[r][m] = _mm512_setzero_ps();
                sum[r][m] = D::zero();
            }
            if (G) s16[r] = group_scales(p, scale_bytes[r], scale_table[r], scales[r], b0 / G, (b1 - b0) / G);
            if (G && Z) z16[r] = group_zeros(zeros[r], b0 / G, (b1 - b0) / G);
        }
        // row r's sums since the last flush (less zero times the sums of x) times scale, into part
        auto flush = [&](int r, __m512 scale, [[maybe_unused]] __m512i zero) {
            for (int m = 0; m < M; m++) {
                if constexpr (Z) sum[r][m] = _mm512_sub_epi32(sum[r][m], _mm512_mullo_epi32(zero, xsum[m]));
                part[r][m] = _mm512_fmadd_ps(D::widen(sum[r][m]), scale, part[r][m]);
                sum[r][m] = D::zero();
            }
        };
        // after the chunk [k, k + width): the sums' scales (index: each lane's group in the block)
        auto scale_chunk = [&](int64_t k, int64_t width, __m512i index) {
            if (G) {
                for (int r = 0; r < R; r++)
                    flush(r, _mm512_permutexvar_ps(index, s16[r]),
                          Z ? _mm512_permutexvar_epi32(index, z16[r]) : _mm512_setzero_si512());
            } else if (k + width == group_end || k + width == b1) {  // since the last flush: one group
                for (int r = 0; r < R; r++)
                    flush(r, _mm512_set1_ps(byte_scale ? scale_table[r][scale_bytes[r][group]] : scales[r][group]),
                          Z ? _mm512_set1_epi32(zeros[r][group]) : _mm512_setzero_si512());
                if (k + width == group_end) {
                    group++;
                    group_end += g;
                }
            } else {
                return;
            }
            if (Z)
                for (int m = 0; m < M; m++) xsum[m] = _mm512_setzero_si512();
        };
        __m512i index = lanes128;
        int64_t k = b0;
        for (; k + 128 <= b1; k += 128) {
            const uint8_t *chunk = codes + k / 2;
            {  // 1 KiB ahead in each row; past its end, in its stream's next row
                const int64_t ahead = k / 2 + PREFETCH_BYTES;
                const uint8_t *target = ahead < stride ? codes + ahead : codes + later * stride + (ahead - stride);
                for (int r = 0; r < R; r++) _mm_prefetch(reinterpret_cast<const char *>(target + r * gap), _MM_HINT_T0);
            }
            __m512i xv[M][4];
            for (int m = 0; m < M; m++) {
                for (int t = 0; t < 4; t++) xv[m][t] = _mm512_loadu_si512(in.x + m * k_main + k + 32 * t);
                if constexpr (Z)
                    for (int t = 0; t < 4; t++) xsum[m] = _mm512_dpwssd_epi32(xsum[m], ones, xv[m][t]);
            }
            for (int r = 0; r < R; r++) {
                const __m512i w = _mm512_loadu_si512(chunk + r * gap);
                const __m512i q0 = _mm512_permutexvar_epi16(w, table);
                const __m512i q1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
                const __m512i q2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table);
                const __m512i q3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table);
                for (int m = 0; m < M; m++) {
                    sum[r][m] = D::dot(sum[r][m], q0, xv[m][0]);
                    sum[r][m] = D::dot(sum[r][m], q1, xv[m][1]);
                    sum[r][m] = D::dot(sum[r][m], q2, xv[m][2]);
                    sum[r][m] = D::dot(sum[r][m], q3, xv[m][3]);
                }
            }
            scale_chunk(k, 128, index);
            index = _mm512_add_epi32(index, next_chunk);
        }
        if (k < b1) {  // the last 64 of an odd multiple of 64: its low nibbles, then its high ones
            const uint8_t *chunk = codes + k / 2;
            __m512i xa[M], xb[M];
            for (int m = 0; m < M; m++) {
                xa[m] = _mm512_loadu_si512(in.x + m * k_main + k);
                xb[m] = _mm512_loadu_si512(in.x + m * k_main + k + 32);
                if constexpr (Z) xsum[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(xsum[m], ones, xa[m]), ones, xb[m]);
            }
            for (int r = 0; r < R; r++) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(chunk + r * gap)));
                const __m512i even = _mm512_permutexvar_epi16(w, table);  // the fifth bit: the high nibble's
                const __m512i odd = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
                for (int m = 0; m < M; m++) {
                    sum[r][m] = D::dot(sum[r][m], even, xa[m]);
                    sum[r][m] = D::dot(sum[r][m], odd, xb[m]);
                }
            }
            scale_chunk(k, 64, _mm512_add_epi32(lanes64, _mm512_set1_epi32(G ? static_cast<int>((k - b0) / G) : 0)));
        }
        if (D::INTEGER)
            for (int m = 0; m < M; m++) {
                const __m512 unit = _mm512_set1_ps(in.unit[m * in.blocks + b0 / BLOCK]);
                for (int r = 0; r < R; r++) total[r][m] = _mm512_fmadd_ps(part[r][m], unit, total[r][m]);
            }
    }
    for (int r = 0; r < R; r++) {
        const float f = late ? p.row_scale[n + r * step] : 1.0f;
        for (int m = 0; m < M; m++) {
            const float sum = _mm512_reduce_add_ps(D::INTEGER ? total[r][m] : part[r][m]);
            acc[m * ldy + n + r * step] = !late ? sum : p.row_divide ? sum / f : sum * f;
        }
    }
}

template <class D, int M, int G, bool Z>
static void rows_group(const Params &p, const Int16Input &in, int64_t n0, int64_t n1, float *acc, int64_t ldy,
                       Scratch &work) {
    constexpr int R = M == 1 ? 4 : 2;  // the accumulators of R x M within the registers
    qscheme_rows::streams<R>(n0, n1, [&](auto rows, int64_t n, int64_t step) {
        rows_dot<D, decltype(rows)::value, M, G, Z>(p, in, n, step, acc, ldy, work);
    });
}

template <class D, int M, bool Z>
static void rows_zero(const Params &p, const Int16Input &in, int64_t n0, int64_t n1, float *acc, int64_t ldy,
                      Scratch &work) {
    if (p.group_k == 16)
        rows_group<D, M, 16, Z>(p, in, n0, n1, acc, ldy, work);
    else if (p.group_k == 32)
        rows_group<D, M, 32, Z>(p, in, n0, n1, acc, ldy, work);
    else if (p.group_k == 64)
        rows_group<D, M, 64, Z>(p, in, n0, n1, acc, ldy, work);
    else
        rows_group<D, M, 0, Z>(p, in, n0, n1, acc, ldy, work);
}

template <class D, int M>
static void rows_m(const Params &p, const Int16Input &in, int64_t n0, int64_t n1, float *acc, int64_t ldy,
                   Scratch &work) {
    if constexpr (D::INTEGER) {
        if (p.zero) return rows_zero<D, M, true>(p, in, n0, n1, acc, ldy, work);
    }
    rows_zero<D, M, false>(p, in, n0, n1, acc, ldy, work);
}

// Rows [n0, n1) times m (<= INT16_ROWS) rows of x with the products of D.
template <class D>
static void gemv_dot(const Params &p, const Int16Input &in, int m, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    Scratch &work = scratch();
    switch (m) {
        case 1: return rows_m<D, 1>(p, in, n0, n1, acc, ldy, work);
        case 2: return rows_m<D, 2>(p, in, n0, n1, acc, ldy, work);
        case 3: return rows_m<D, 3>(p, in, n0, n1, acc, ldy, work);
        default: return rows_m<D, 4>(p, in, n0, n1, acc, ldy, work);
    }
}

}  // namespace QS_ISA_NAMESPACE
