// The fused tile GEMM on AVX-512 BF16 (VDPBF16PS), for CPUs without AMX tiles (tile_gemm.h).
//
// The same panels as the AMX loop: 32 weight rows decoded chunk by chunk into bfloat16 (each the
// reference's float32 weight rounded once), then multiplied by every input row. Here each product
// is a dot product along K: one 512-bit register holds 32 consecutive k of a weight row, another
// the same k of an input row, and VDPBF16PS adds the 16 pairs' products to 16 float32 lanes. A
// block of 4 weight rows by 4 input rows keeps 16 such accumulators; at the end of a chunk each is
// summed across its lanes (a tree of shuffles and adds over the 16 at once) into the output's
// float32 partial sum. Products of two bfloat16 values
// are exact in float32; the sums are float32 (in another order than AMX's); like AMX, VDPBF16PS
// reads bfloat16 subnormals as zero and flushes float32 subnormal results to zero.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "tile_gemm.h"

namespace qscheme_tile {

namespace {

inline __m512bh load_pairs(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

// acc[i][j] += the dot products of weight rows w[i] and input rows x[j] over `steps` chunks of 32 k;
// then the lane sums into sums[j * ldj + i] (added to them unless first).
template <int MB>
inline void block(const uint16_t *w, int64_t pitch, const uint16_t *x, int64_t ldx, int64_t steps, float *sums,
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

}  // namespace

void gemm_rows_bf16(const Layer &p, const uint16_t *x, int64_t m, int64_t kp, const float *bias, uint16_t *out,
                    int64_t ldy, int64_t r0, int64_t r1, int64_t q0, int64_t q1, int64_t kc, uint16_t *panel,
                    float *acc, float *s, float *z) {
    // x: m rows of kp bfloat16 (zeros past K); acc: m rows of (q1 - q0) float32 partial sums
    const int64_t rows = q1 - q0, cols = p.scale_cols;
    const int64_t live = std::min(rows, r1 - q0);  // rows past r1 are not decoded, multiplied or written
    for (int64_t r = 0; r < live; r++) row_scales_avx512(p, q0 + r, 0, cols, s + r * cols, z + r * cols);
    for (int64_t k0 = 0; k0 < kp; k0 += kc) {
        const int64_t width = std::min(kc, kp - k0), steps = width / 32, pitch = width + PANEL_PAD;
        const bool first = k0 == 0;
        for (int64_t r = 0; r < live; r++) decode_chunk(p, q0 + r, k0, k0 + width, panel + r * pitch, s + r * cols, z + r * cols);
        for (int64_t r = live; r < (live + 3) / 4 * 4; r++) std::memset(panel + r * pitch, 0, static_cast<size_t>(width) * 2);
        // 4 input rows (in L1) against every 4 rows of the panel (in L2) in turn
        for (int64_t j = 0; j < m; j += 4) {
            const uint16_t *xs = x + j * kp + k0;
            for (int64_t i = 0; i < live; i += 4) {
                const uint16_t *w = panel + i * pitch;
                float *sums = acc + j * rows + i;
                switch (std::min<int64_t>(4, m - j)) {
                    case 4: block<4>(w, pitch, xs, kp, steps, sums, rows, first); break;
                    case 3: block<3>(w, pitch, xs, kp, steps, sums, rows, first); break;
                    case 2: block<2>(w, pitch, xs, kp, steps, sums, rows, first); break;
                    default: block<1>(w, pitch, xs, kp, steps, sums, rows, first); break;
                }
            }
        }
    }
    const __mmask16 all = 0xFFFF;
    for (int64_t j = 0; j < m; j++) {
        const float *sums = acc + j * rows;
        uint16_t *dst = out + j * ldy + (q0 - r0);
        for (int64_t i = 0; i < live; i += 16) {
            const int64_t count = std::min<int64_t>(16, live - i);
            const __mmask16 mask = count == 16 ? all : static_cast<__mmask16>((1u << count) - 1u);
            __m512 v = _mm512_maskz_loadu_ps(mask, sums + i);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + q0 + i));
            _mm256_mask_storeu_epi16(dst + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

}  // namespace qscheme_tile

#else  // no x86, or a compiler without AVX-512 BF16 intrinsics: never called (isa() is not 'avx512')

#include "tile_gemm.h"

namespace qscheme_tile {
void gemm_rows_bf16(const Layer &, const uint16_t *, int64_t, int64_t, const float *, uint16_t *, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int64_t, uint16_t *, float *, float *, float *) {}
}  // namespace qscheme_tile

#endif
