// The vector GEMV loop of qscheme._cpu_gemv, written once over a vector type V and included by
// one translation unit per instruction set (cpu_gemv_avx512.cpp, cpu_gemv_avx2.cpp), each
// compiled for its ISA by a target pragma and in its own namespace.
//
// V provides: W (float lanes), vec, zero(), load(const float *), set1(float), fma(a, b, c),
// mul, sub, pair(values) (lanes [0, W/2) values[0], the rest values[1]), hsum(vec), decode_nibbles(bytes,
// table, even, odd) (W bytes -> the W low-nibble values and the W high-nibble values, through
// the table), decode_bytes(bytes, kind) (W bytes -> W values), and Table, table(const float *).
//
// Rows are taken R at a time so that each load of x serves R rows; per chunk of each row the
// codes are decoded, the zero point subtracted and the effective scale multiplied in (the
// reference's fp32 weight), then multiplied into every row of x. With one row of x and no zero
// points, the effective scale multiplies each scale group's partial sum instead (one multiply
// per group instead of one per weight; the same products, rounded in another place).
#pragma once

#include <vector>

#include "cpu_gemv.h"

namespace QS_ISA_NAMESPACE {

using namespace qscheme_gemv;

template <class V, int M, int R, bool NIBBLE, bool ZERO>
static inline void rows_block(const Params &p, const float *x, int64_t ldx, int64_t n, float *acc, int64_t ldy,
                              const typename V::Table &table) {
    using vec = typename V::vec;
    constexpr int W = V::W;
    constexpr int64_t CE = NIBBLE ? 2 * W : W;  // elements per chunk
    const int64_t chunks = p.k / CE;
    const bool split = NIBBLE && p.group_k == W;  // two scale groups per chunk (NVFP4 on 16 lanes)
    const int64_t per_group = split ? 1 : p.group_k / CE;  // chunks per scale group (>= 1)
    // one row of x without zero points: scales multiply each group's partial sums, not each weight
    constexpr bool LATE = M == 1 && !ZERO;
    vec sum[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = V::zero();
    const uint8_t *codes[R];
    const float *scales[R], *zeros[R];
    // each row's effective scales (and zero points) as float32, decoded once per call and row
    thread_local std::vector<float> buffer;
    const int64_t cols = p.scale_cols;
    if (buffer.size() < static_cast<size_t>(2 * R * cols)) buffer.resize(static_cast<size_t>(2 * R * cols));
    for (int r = 0; r < R; r++) {
        codes[r] = p.codes + (n + r) * p.code_stride;
        float *sr = buffer.data() + r * cols, *zr = buffer.data() + (R + r) * cols;
        fill_scales(p, n + r, sr);
        scales[r] = sr;
        zeros[r] = zr;
        if (ZERO) {
            const int16_t *z = p.zero + scale_row_base(p, n + r);
            for (int64_t g = 0; g < cols; g++) zr[g] = static_cast<float>(z[g]);
        }
    }
    for (int64_t c = 0; c < chunks;) {
        const int64_t group = split ? 2 * c : c / per_group;
        const int64_t stop = split ? c + 1 : (c + per_group < chunks ? c + per_group : chunks);
        vec scale[R], zero[R];
        for (int r = 0; r < R; r++) {
            if (split) {
                scale[r] = V::pair(scales[r] + group);
                if (ZERO) zero[r] = V::pair(zeros[r] + group);
            } else {
                scale[r] = V::set1(scales[r][group]);
                if (ZERO) zero[r] = V::set1(zeros[r][group]);
            }
        }
        if (LATE) {  // one row of x: a scale group's products summed first, then scaled once
            vec part[R];
            for (int r = 0; r < R; r++) part[r] = V::zero();
            for (; c < stop; c++) {
                if ((c & 3) == 0)
                    for (int r = 0; r < R; r++) __builtin_prefetch(codes[r] + c * W + 1024, 0, 0);
                if (NIBBLE) {
                    const vec xe = V::load(x + c * CE), xo = V::load(x + c * CE + W);
                    for (int r = 0; r < R; r++) {
                        vec even, odd;
                        V::decode_nibbles(codes[r] + c * W, table, even, odd);
                        part[r] = V::fma(xe, even, part[r]);
                        part[r] = V::fma(xo, odd, part[r]);
                    }
                } else {
                    const vec xv = V::load(x + c * CE);
                    for (int r = 0; r < R; r++) part[r] = V::fma(xv, V::decode_bytes(codes[r] + c * W, p.code_kind), part[r]);
                }
            }
            for (int r = 0; r < R; r++) sum[r][0] = V::fma(part[r], scale[r], sum[r][0]);
            continue;
        }
        for (; c < stop; c++) {
            if ((c & 3) == 0)
                for (int r = 0; r < R; r++) __builtin_prefetch(codes[r] + c * W + 1024, 0, 0);
            if (NIBBLE) {
                vec xe[M], xo[M];
                for (int m = 0; m < M; m++) {
                    xe[m] = V::load(x + m * ldx + c * CE);
                    xo[m] = V::load(x + m * ldx + c * CE + W);
                }
                for (int r = 0; r < R; r++) {
                    vec even, odd;
                    V::decode_nibbles(codes[r] + c * W, table, even, odd);
                    if (ZERO) {
                        even = V::sub(even, zero[r]);
                        odd = V::sub(odd, zero[r]);
                    }
                    even = V::mul(even, scale[r]);
                    odd = V::mul(odd, scale[r]);
                    for (int m = 0; m < M; m++) {
                        sum[r][m] = V::fma(xe[m], even, sum[r][m]);
                        sum[r][m] = V::fma(xo[m], odd, sum[r][m]);
                    }
                }
            } else {
                vec xv[M];
                for (int m = 0; m < M; m++) xv[m] = V::load(x + m * ldx + c * CE);
                for (int r = 0; r < R; r++) {
                    vec w = V::decode_bytes(codes[r] + c * W, p.code_kind);
                    if (ZERO) w = V::sub(w, zero[r]);
                    w = V::mul(w, scale[r]);
                    for (int m = 0; m < M; m++) sum[r][m] = V::fma(xv[m], w, sum[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[m * ldy + n + r] = V::hsum(sum[r][m]);
}

template <class V, int M, bool NIBBLE, bool ZERO>
static void rows_m(const Params &p, const float *x, int64_t ldx, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
    const typename V::Table table = V::table(p.lut);
    int64_t n = n0;
    for (; n + R <= n1; n += R) rows_block<V, M, R, NIBBLE, ZERO>(p, x, ldx, n, acc, ldy, table);
    for (; n < n1; n++) rows_block<V, M, 1, NIBBLE, ZERO>(p, x, ldx, n, acc, ldy, table);
}

template <class V, bool NIBBLE, bool ZERO>
static void rows_any(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                     int64_t ldy) {
    switch (m) {
        case 1: return rows_m<V, 1, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 2: return rows_m<V, 2, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 3: return rows_m<V, 3, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 4: return rows_m<V, 4, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 5: return rows_m<V, 5, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 6: return rows_m<V, 6, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 7: return rows_m<V, 7, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        default: return rows_m<V, 8, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
    }
}

// M rows of x in blocks of at most 8 (each block reads the weight once).
template <class V>
static void gemv_vector(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                        int64_t ldy) {
    const bool nibble = p.code_kind == CODE_NIBBLE, zero = p.zero != nullptr;
    for (int m0 = 0; m0 < m; m0 += 8) {
        const int count = m - m0 < 8 ? m - m0 : 8;
        const float *xs = x + m0 * ldx;
        float *ys = acc + m0 * ldy;
        if (nibble)
            zero ? rows_any<V, true, true>(p, xs, ldx, count, n0, n1, ys, ldy)
                 : rows_any<V, true, false>(p, xs, ldx, count, n0, n1, ys, ldy);
        else
            zero ? rows_any<V, false, true>(p, xs, ldx, count, n0, n1, ys, ldy)
                 : rows_any<V, false, false>(p, xs, ldx, count, n0, n1, ys, ldy);
    }
}

}  // namespace QS_ISA_NAMESPACE
