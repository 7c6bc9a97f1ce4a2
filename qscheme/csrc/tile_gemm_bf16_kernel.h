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

}  // namespace
}  // namespace qscheme_panel
