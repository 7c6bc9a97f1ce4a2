// The fused tile GEMM's multiply on AVX-512 BF16 (VDPBF16PS), shared by the canonical tensors'
// panels (tile_gemm_bf16.cpp) and the packed blocks' (cpu_gemv_gguf_gemm.cpp). Include after
// <immintrin.h> in a translation unit compiled for AVX-512 BF16 (a target pragma); everything here
// has internal linkage, one copy per such unit.
//
// A panel is up to 32 weight rows of bfloat16, `pitch` words apart, decoded for one chunk of K (a
// multiple of 32 columns). Each product is a dot product along K: one 512-bit register holds 32
// consecutive k of a weight row, another the same k of an input row, and VDPBF16PS adds the 16
// pairs' products to 16 float32 lanes. A block of 4 weight rows by 4 input rows keeps 16 such
// accumulators; at the end of a chunk each is summed across its lanes (a tree of shuffles and adds
// over the 16 at once) into the output's float32 partial sum. Products of two bfloat16 values are
// exact in float32; VDPBF16PS reads bfloat16 subnormals as zero and flushes float32 subnormal
// results to zero.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace qscheme_panel {
namespace {

inline __m512bh load_pairs(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

// acc[i][j] += the dot products of weight rows w[i] and input rows x[j] over `steps` chunks of 32 k;
// then the lane sums into sums[j * ldj + i] (added to them unless first).
template <int MB>
inline void dot_block(const uint16_t *w, int64_t pitch, const uint16_t *x, int64_t ldx, int64_t steps, float *sums,
                      int64_t ldj, bool first) {
    __m512 acc[4][MB];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < MB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < steps; t++) {
        __m512bh xs[MB];
        for (int j = 0; j < MB; j++) xs[j] = load_pairs(x + j * ldx + 32 * t);
        for (int i = 0; i < 4; i++) {
            const __m512bh ws = load_pairs(w + i * pitch + 32 * t);
            for (int j = 0; j < MB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], ws, xs[j]);
        }
    }
    // the 16 accumulators' lane sums by a tree of shuffles and adds: quarter j of the result holds
    // the sums of acc[0..3][j]
    __m512 a[16];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[i * 4 + j] = j < MB ? acc[i][j] : _mm512_setzero_ps();
    __m512 b[8], c[4], d[2];
    for (int q = 0; q < 8; q++)  // quarters: a[2q] (q0 + q2, q1 + q3), a[2q + 1] (the same)
        b[q] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * q], a[2 * q + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * q], a[2 * q + 1], 0xEE));
    for (int q = 0; q < 4; q++)  // quarter r: four lanes summing to a[4q + r]
        c[q] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * q], b[2 * q + 1], 0xDD));
    for (int q = 0; q < 2; q++)
        d[q] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * q], c[2 * q + 1]), _mm512_unpackhi_ps(c[2 * q], c[2 * q + 1]));
    const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1])));
    const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1])));
    alignas(64) float total[16];  // total[4 j + i]: the sum of acc[i][j]
    _mm512_store_ps(total, _mm512_add_ps(lo, hi));
    for (int j = 0; j < MB; j++) {
        __m128 v = _mm_load_ps(total + 4 * j);
        if (!first) v = _mm_add_ps(v, _mm_loadu_ps(sums + j * ldj));
        _mm_storeu_ps(sums + j * ldj, v);
    }
}

// The panel's rows [0, live) (rows up to the next multiple of 4 zero) times m input rows of `steps`
// chunks of 32 k (x: row j at x + j * ldx, at the panel's first column): acc[j * rows + i] receives
// (first) or adds the sums. 4 input rows (in L1) against every 4 rows of the panel (in L2) in turn.
inline void multiply_panel(const uint16_t *panel, int64_t pitch, int64_t live, const uint16_t *x, int64_t ldx,
                           int64_t m, int64_t steps, float *acc, int64_t rows, bool first) {
    for (int64_t j = 0; j < m; j += 4) {
        const uint16_t *xs = x + j * ldx;
        for (int64_t i = 0; i < live; i += 4) {
            const uint16_t *w = panel + i * pitch;
            float *sums = acc + j * rows + i;
            switch (std::min<int64_t>(4, m - j)) {
                case 4: dot_block<4>(w, pitch, xs, ldx, steps, sums, rows, first); break;
                case 3: dot_block<3>(w, pitch, xs, ldx, steps, sums, rows, first); break;
                case 2: dot_block<2>(w, pitch, xs, ldx, steps, sums, rows, first); break;
                default: dot_block<1>(w, pitch, xs, ldx, steps, sums, rows, first); break;
            }
        }
    }
}

// out[j * ldy + i] = bfloat16(acc[j * rows + i] (+ bias[i])) for i in [0, live), j in [0, m): the
// sums rounded once to nearest even, the float32 bias added first.
inline void store_rows(const float *acc, int64_t rows, int64_t live, int64_t m, const float *bias, uint16_t *out,
                       int64_t ldy) {
    const __mmask16 all = 0xFFFF;
    for (int64_t j = 0; j < m; j++) {
        const float *sums = acc + j * rows;
        uint16_t *dst = out + j * ldy;
        for (int64_t i = 0; i < live; i += 16) {
            const int64_t count = std::min<int64_t>(16, live - i);
            const __mmask16 mask = count == 16 ? all : static_cast<__mmask16>((1u << count) - 1u);
            __m512 v = _mm512_maskz_loadu_ps(mask, sums + i);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + i));
            _mm256_mask_storeu_epi16(dst + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

// From 32 input rows on, whole blocks of 16 input rows take another loop: the input packed once
// per call as pairs of k ([K / 2][16][2] per block: one vector holds the same two k of 16 rows),
// each weight's pair of k broadcast from the panel, and VDPBF16PS accumulating 16 input rows per
// register along K. No sums across lanes, and two operands per dot product from L1 and L2 at most
// one vector a product: on Zen 4 it runs at the instruction's rate (117-118 GMAC/s a core against
// the 4 x 4 dot blocks' 106-111), as torch's oneDNN bf16 GEMM does.

// How many of m input rows the pairs' loop takes: whole blocks of 16 from 32 rows on. Below, its
// blocks would hold too few accumulators to hide VDPBF16PS's latency (at M = 16: 1.03-1.07x bf16
// `F.linear` against the dot blocks' 1.30-1.34x; at M = 32: 1.24-1.31x against 1.17-1.20x; Zen 4,
// 4096x4096 int4, 2 threads).
inline int64_t pair_rows(int64_t m) { return m >= 32 ? m / 16 * 16 : 0; }

// 16 vectors of 16 32-bit lanes transposed: r[i] lane c becomes r[c] lane i.
inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i e = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE), f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(a, b, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(a, b, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(e, f, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(e, f, 0xDD);
    }
}

// 16 input rows (x: row j at x + j * ldx, kp columns, a multiple of 32) as pairs of k:
// xv[32 t + 2 j + e] = x[j][2 t + e].
inline void pack_pairs(const uint16_t *x, int64_t ldx, int64_t kp, uint16_t *xv) {
    for (int64_t k = 0; k < kp; k += 32) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(x + j * ldx + k);
        transpose16(r);
        for (int c = 0; c < 16; c++) _mm512_storeu_si512(xv + 16 * k + 32 * c, r[c]);
    }
}

// acc[i * mp + 16 v + l] (= or +=) the dot products of weight rows w[i] (i < 4) and input row l of
// the packed blocks xv + v * stride (v < NV), over `pairs` pairs of k.
template <int NV>
inline void pair_block(const uint16_t *w, int64_t pitch, const uint16_t *xv, int64_t stride, int64_t pairs, float *acc,
                       int64_t mp, bool first) {
    __m512 a[4][NV];
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < NV; v++) a[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * mp + 16 * v);
    for (int64_t t = 0; t < pairs; t++) {
        __m512bh xs[NV];
        for (int v = 0; v < NV; v++) xs[v] = load_pairs(xv + v * stride + 32 * t);
        for (int i = 0; i < 4; i++) {
            int32_t pair;
            std::memcpy(&pair, w + i * pitch + 2 * t, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NV; v++) a[i][v] = _mm512_dpbf16_ps(a[i][v], xs[v], b);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc + i * mp + 16 * v, a[i][v]);
}

// The panel's rows [0, live) (rows up to the next multiple of 4 zero) times `blocks` packed blocks
// of 16 input rows (xv at the chunk's first pair, `stride` words from block to block) over `steps`
// chunks of 32 k: acc[i * mp + j] receives (first) or adds the sums. Up to six blocks (96 input
// rows, in L2) against every 4 rows of the panel in turn.
inline void multiply_panel_pairs(const uint16_t *panel, int64_t pitch, int64_t live, const uint16_t *xv, int64_t stride,
                                 int64_t blocks, int64_t steps, float *acc, int64_t mp, bool first) {
    const int64_t groups = (blocks + 5) / 6;
    for (int64_t g = 0, b = 0; g < groups; g++) {
        const int64_t count = (blocks - b) / (groups - g);  // the blocks spread evenly: no group of one
        const uint16_t *x = xv + b * stride;
        for (int64_t i = 0; i < live; i += 4) {
            const uint16_t *w = panel + i * pitch;
            float *sums = acc + i * mp + 16 * b;
            switch (count) {
                case 6: pair_block<6>(w, pitch, x, stride, 16 * steps, sums, mp, first); break;
                case 5: pair_block<5>(w, pitch, x, stride, 16 * steps, sums, mp, first); break;
                case 4: pair_block<4>(w, pitch, x, stride, 16 * steps, sums, mp, first); break;
                case 3: pair_block<3>(w, pitch, x, stride, 16 * steps, sums, mp, first); break;
                case 2: pair_block<2>(w, pitch, x, stride, 16 * steps, sums, mp, first); break;
                default: pair_block<1>(w, pitch, x, stride, 16 * steps, sums, mp, first); break;
            }
        }
        b += count;
    }
}

// out[j * ldy + i] = bfloat16(acc[i * mp + j] (+ bias[i])) for i in [0, live), j in [0, mp) (mp a
// multiple of 16): 16 x 16 blocks transposed, the sums rounded once to nearest even.
inline void store_rows_pairs(const float *acc, int64_t mp, int64_t live, const float *bias, uint16_t *out,
                             int64_t ldy) {
    for (int64_t i = 0; i < live; i += 16) {
        const int64_t count = std::min<int64_t>(16, live - i);
        const __mmask16 mask = count == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + i) : _mm512_setzero_ps();
        for (int64_t j = 0; j < mp; j += 16) {
            __m512i r[16];
            for (int c = 0; c < 16; c++)
                r[c] = c < count ? _mm512_loadu_si512(acc + (i + c) * mp + j) : _mm512_setzero_si512();
            transpose16(r);
            for (int c = 0; c < 16; c++) {
                __m512 v = _mm512_castsi512_ps(r[c]);
                if (bias) v = _mm512_add_ps(v, b);
                _mm256_mask_storeu_epi16(out + (j + c) * ldy + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}

// The panel times all m input rows (x: row-major, ldx apart; its first mp rows also packed as pairs in
// xv, block b at xv + 16 * b * ldx) over `steps` chunks of 32 k from column c0: the packed rows by the
// pairs' loop into acc[i * mp + j], the other m - mp rows by the dot blocks into acc + rows * mp
// ([j][rows]); `first`: the chunk's sums replace acc's instead of adding to them.
inline void multiply_panel_all(const uint16_t *panel, int64_t pitch, int64_t live, const uint16_t *x, const uint16_t *xv,
                               int64_t ldx, int64_t m, int64_t mp, int64_t c0, int64_t steps, float *acc, int64_t rows,
                               bool first) {
    if (mp > 0) multiply_panel_pairs(panel, pitch, live, xv + 16 * c0, 16 * ldx, mp / 16, steps, acc, mp, first);
    if (m > mp) multiply_panel(panel, pitch, live, x + mp * ldx + c0, ldx, m - mp, steps, acc + rows * mp, rows, first);
}

// The outputs of multiply_panel_all's sums: out[j * ldy + i] for the panel's rows [0, live).
inline void store_panel_all(const float *acc, int64_t rows, int64_t live, int64_t m, int64_t mp, const float *bias,
                            uint16_t *out, int64_t ldy) {
    if (mp > 0) store_rows_pairs(acc, mp, live, bias, out, ldy);
    if (m > mp) store_rows(acc + rows * mp, rows, live, m - mp, bias, out + mp * ldy, ldy);
}

}  // namespace
}  // namespace qscheme_panel
