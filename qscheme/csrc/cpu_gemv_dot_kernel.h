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
// 64 weights take two instructions. Lane j of a chunk of 64 holds elements 4j..4j+3, so that with
// groups of 16 or 32 a lane never mixes two groups: after each chunk (groups of 16 or 32) or at the
// end of each group and block (groups of a multiple of 64) the lane sums are multiplied by their
// group's effective scale in float32, and (integers) each block's sum by its step (a power of two:
// exact).
//
// D provides: INTEGER, acc (the lane sums' type), zero(), dot(acc, weights, x), widen(acc) (float32).
#pragma once

#include "cpu_gemv_kernel.h"
#include "row_streams.h"

namespace QS_ISA_NAMESPACE {
constexpr int64_t BLOCK = 256, CHUNK = 64, PREFETCH_BYTES = 1024;

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

// The effective scales of row n's groups [g0, g0 + count) (count <= 16) as one vector: e4m3 and
// e8m0 bytes decoded by arithmetic and multiplied (or divided) by the row's factor as byte_scales
// does (a gather of the table is slow on some CPUs: 40% of NVFP4's time on Zen 4), other bytes
// looked up in the row's table.
static inline __m512 group_scales(const Params &p, int64_t n, const uint8_t *bytes, const float *table,
                                  const float *scales, int64_t g0, int64_t count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
    if (!bytes) return _mm512_maskz_loadu_ps(mask, scales + g0);
    const __m128i raw = _mm_maskz_loadu_epi8(mask, bytes + g0);
    if (p.byte_format != BYTE_TABLE) {
        __m512 v = decode_bytes(raw, p.byte_format);
        if (p.row_scale) {
            const __m512 f = _mm512_set1_ps(p.row_scale[n]);
            v = p.row_divide ? _mm512_div_ps(v, f) : _mm512_mul_ps(v, f);
        }
        return _mm512_maskz_mov_ps(mask, v);
    }
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, _mm512_cvtepu8_epi32(raw), table, 4);
}

// The zero points of row n's groups [g0, g0 + count) (count <= 16) times the table's factor, as 32-bit lanes.
static inline __m512i group_zeros(const int32_t *zeros, int64_t g0, int64_t count) {
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << count) - 1u), zeros + g0);
}

// R weight rows n, n + step, ... (one from each of R streams: row_streams.h) times M rows of x; G:
// the scale group (16 or 32: several per chunk; 0: a multiple of 64); Z: with zero points (integer
// products only). acc[m * ldy + n]: row m's sums.
template <class D, int R, int M, int G, bool Z>
static void rows_dot(const Params &p, const Int16Input &in, int64_t n, int64_t step, float *acc, int64_t ldy,
                     Scratch &work) {
    const int64_t g = p.group_k, k_main = in.k_main, cols = p.scale_cols, stride = p.code_stride;
    const __m512i table = _mm512_loadu_si512(in.table), low = _mm512_set1_epi16(0x000F);
    // lane j of a chunk: elements 4j..4j+3, the chunk's group 4j / G
    const __m512i lane_group = G == 16 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                       : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i next_chunk = _mm512_set1_epi32(G ? CHUNK / G : 0);
    const bool byte_scale = p.scale_kind == SCALE_BYTE;
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
            scale_table[r] = byte_scales(p, n + r * step, work);
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
        __m512 s16[R];
        typename D::acc sum[R][M];
        __m512i z16[R], xsum[M];
        for (int m = 0; m < M; m++) xsum[m] = _mm512_setzero_si512();
        for (int r = 0; r < R; r++) {
            for (int m = 0; m < M; m++) {
                if (D::INTEGER) part[r][m] = _mm512_setzero_ps();
                sum[r][m] = D::zero();
            }
            if (G) s16[r] = group_scales(p, n + r * step, scale_bytes[r], scale_table[r], scales[r], b0 / G, (b1 - b0) / G);
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
        __m512i index = lane_group;
        int64_t group = b0 / g, group_end = (group + 1) * g;  // G = 0: the chunk's group and where it ends
        const uint8_t *chunk = codes + b0 / 2;
        for (int64_t k = b0; k < b1; k += CHUNK, chunk += CHUNK / 2) {
            if ((k & 127) == 0) {  // 1 KiB ahead in each row; past its end, in its stream's next row
                const int64_t ahead = k / 2 + PREFETCH_BYTES;
                const uint8_t *target = ahead < stride ? codes + ahead : codes + later * stride + (ahead - stride);
                for (int r = 0; r < R; r++) _mm_prefetch(reinterpret_cast<const char *>(target + r * gap), _MM_HINT_T0);
            }
            __m512i xa[M], xb[M];
            for (int m = 0; m < M; m++) {
                xa[m] = _mm512_loadu_si512(in.x + m * k_main + k);
                xb[m] = _mm512_loadu_si512(in.x + m * k_main + k + 32);
                if constexpr (Z) xsum[m] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(xsum[m], ones, xa[m]), ones, xb[m]);
            }
            for (int r = 0; r < R; r++) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(chunk + r * gap)));
                const __m512i even = _mm512_permutexvar_epi16(_mm512_and_si512(w, low), table);
                const __m512i odd = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
                for (int m = 0; m < M; m++) {
                    sum[r][m] = D::dot(sum[r][m], even, xa[m]);
                    sum[r][m] = D::dot(sum[r][m], odd, xb[m]);
                }
            }
            if (G) {  // every chunk: its groups' scales (and zero points), lane by lane
                for (int r = 0; r < R; r++)
                    flush(r, _mm512_permutexvar_ps(index, s16[r]),
                          Z ? _mm512_permutexvar_epi32(index, z16[r]) : _mm512_setzero_si512());
                if (Z)
                    for (int m = 0; m < M; m++) xsum[m] = _mm512_setzero_si512();
                index = _mm512_add_epi32(index, next_chunk);
            } else if (k + CHUNK == group_end || k + CHUNK == b1) {  // since the last flush: one group
                for (int r = 0; r < R; r++)
                    flush(r, _mm512_set1_ps(byte_scale ? scale_table[r][scale_bytes[r][group]] : scales[r][group]),
                          Z ? _mm512_set1_epi32(zeros[r][group]) : _mm512_setzero_si512());
                if (Z)
                    for (int m = 0; m < M; m++) xsum[m] = _mm512_setzero_si512();
                if (k + CHUNK == group_end) {
                    group++;
                    group_end += g;
                }
            }
        }
        if (D::INTEGER)
            for (int m = 0; m < M; m++) {
                const __m512 unit = _mm512_set1_ps(in.unit[m * in.blocks + b0 / BLOCK]);
                for (int r = 0; r < R; r++) total[r][m] = _mm512_fmadd_ps(part[r][m], unit, total[r][m]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[m * ldy + n + r * step] = _mm512_reduce_add_ps(D::INTEGER ? total[r][m] : part[r][m]);
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
