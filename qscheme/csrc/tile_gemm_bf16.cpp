// The fused tile GEMM on AVX-512 BF16 (VDPBF16PS), for CPUs without AMX tiles (tile_gemm.h).
//
// The same panels as the AMX loop: 32 weight rows decoded chunk by chunk into bfloat16 (each the
// reference's float32 weight rounded once), then multiplied by every input row with VDPBF16PS dot
// products along K, 4 weight rows by 4 input rows at a time (tile_gemm_bf16_kernel.h, which the
// packed blocks' GEMM shares). The sums are float32 (in another order than AMX's); like AMX,
// VDPBF16PS reads bfloat16 subnormals as zero and flushes float32 subnormal results to zero.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "tile_gemm.h"
#include "tile_gemm_bf16_kernel.h"

namespace qscheme_tile {

void gemm_rows_bf16(const Layer &p, const uint16_t *x, int64_t m, int64_t kp, const uint16_t *xv, int64_t mp,
                    const float *bias, uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int64_t q0, int64_t q1,
                    int64_t kc, uint16_t *panel, float *acc, float *s, float *z) {
    // x: m rows of kp bfloat16 (zeros past K); its first mp rows (a multiple of 16) also packed as
    // pairs in xv (blocks of 16 rows, kp * 16 words apart), multiplied by the pairs' loop into acc's
    // first (q1 - q0) * mp float32 partial sums; the other m - mp rows by the dot blocks into the rest
    const int64_t rows = q1 - q0, cols = p.scale_cols;
    const int64_t live = std::min(rows, r1 - q0);  // rows past r1 are not decoded, multiplied or written
    for (int64_t r = 0; r < live; r++) row_scales_avx512(p, q0 + r, 0, cols, s + r * cols, z + r * cols);
    for (int64_t k0 = 0; k0 < kp; k0 += kc) {
        const int64_t width = std::min(kc, kp - k0), steps = width / 32, pitch = width + PANEL_PAD;
        const bool first = k0 == 0;
        for (int64_t r = 0; r < live; r++) decode_chunk(p, q0 + r, k0, k0 + width, panel + r * pitch, s + r * cols, z + r * cols);
        for (int64_t r = live; r < (live + 3) / 4 * 4; r++) std::memset(panel + r * pitch, 0, static_cast<size_t>(width) * 2);
        qscheme_panel::multiply_panel_all(panel, pitch, live, x, xv, kp, m, mp, k0, steps, acc, rows, first);
    }
    qscheme_panel::store_panel_all(acc, rows, live, m, mp, bias ? bias + q0 : nullptr, out + (q0 - r0), ldy);
}

void pack_pairs_bf16(const uint16_t *x, int64_t ldx, int64_t kp, uint16_t *xv) {
    qscheme_panel::pack_pairs(x, ldx, kp, xv);
}

int64_t pair_rows_bf16(int64_t m) { return qscheme_panel::pair_rows(m); }

}  // namespace qscheme_tile

#else  // no x86, or a compiler without AVX-512 BF16 intrinsics: never called (isa() is not 'avx512')

#include "tile_gemm.h"

namespace qscheme_tile {
void gemm_rows_bf16(const Layer &, const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, const float *,
                    uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t *, float *, float *,
                    float *) {}
void pack_pairs_bf16(const uint16_t *, int64_t, int64_t, uint16_t *) {}
int64_t pair_rows_bf16(int64_t) { return 0; }
}  // namespace qscheme_tile

#endif
