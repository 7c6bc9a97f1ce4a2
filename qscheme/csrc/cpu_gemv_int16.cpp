// The 4-bit GEMV loop for one bfloat16 row of x on AVX512-VNNI (cpu_gemv.h: Int16Input).
//
// x arrives as 16-bit integers over a power-of-two step per block of 256 elements; the codes are
// looked up as 16-bit integers (the code values times a power of two) and multiplied into x with
// VPDPWSSD, 64 weights per two instructions, the products summed exactly in 32-bit lanes. Lane j
// of a chunk of 64 holds elements 4j..4j+3, so that with groups of 16 or 32 a lane never mixes
// two groups: after each chunk (groups of 16 or 32) or at the end of each group and block (groups
// of a multiple of 64) the integer sums are converted to float32 and multiplied by their group's
// effective scale, and each block's sum by its step (a power of two: exact).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#define QS_ISA_NAMESPACE qscheme_gemv_int16
#include "cpu_gemv_kernel.h"

namespace qscheme_gemv_int16 {

constexpr int64_t BLOCK = 256, CHUNK = 64;

template <int R>
static void rows_int16(const Params &p, const Int16Input &in, int64_t n, float *acc, Scratch &work) {
    const int64_t g = p.group_k, k_main = in.k_main, cols = p.scale_cols;
    const bool small = g < CHUNK;  // 16 or 32: a chunk holds 4 or 2 groups
    const __m512i table = _mm512_loadu_si512(in.table), low = _mm512_set1_epi16(0x000F);
    // lane j of a chunk: elements 4j..4j+3, group (4j) / g of the chunk's groups
    const __m512i lane_group = g == 16 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                       : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const bool byte_scale = p.scale_kind == SCALE_BYTE;
    const uint8_t *codes[R], *scale_bytes[R];
    const float *scale_table[R], *scales[R];
    std::vector<float> &buffer = work.buffer;
    if (buffer.size() < static_cast<size_t>(R * cols)) buffer.resize(static_cast<size_t>(R * cols));
    for (int r = 0; r < R; r++) {
        codes[r] = p.codes + (n + r) * p.code_stride;
        scale_bytes[r] = nullptr;
        scale_table[r] = nullptr;
        scales[r] = buffer.data() + r * cols;
        if (byte_scale) {
            scale_bytes[r] = static_cast<const uint8_t *>(p.scale) + scale_row_base(p, n + r);
            scale_table[r] = byte_scales(p, n + r, work);
        } else {
            fill_scales(p, n + r, buffer.data() + r * cols);
        }
    }
    __m512 total[R];
    for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < k_main; b0 += BLOCK) {
        const int64_t b1 = std::min(k_main, b0 + BLOCK);
        __m512 part[R], s16[R];
        __m512i sum[R];
        for (int r = 0; r < R; r++) {
            part[r] = _mm512_setzero_ps();
            sum[r] = _mm512_setzero_si512();
        }
        if (small) {  // the block's groups' scales (16 or 8 at most) in one vector per row
            const int64_t g0 = b0 / g, count = (b1 - b0) / g;
            const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1u);
            for (int r = 0; r < R; r++) {
                if (byte_scale) {
                    const __m512i index = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, scale_bytes[r] + g0));
                    s16[r] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, index, scale_table[r], 4);
                } else {
                    s16[r] = _mm512_maskz_loadu_ps(mask, scales[r] + g0);
                }
            }
        }
        for (int64_t k = b0; k < b1; k += CHUNK) {
            if ((k & 127) == 0)
                for (int r = 0; r < R; r++) _mm_prefetch(reinterpret_cast<const char *>(codes[r] + k / 2 + 1024), _MM_HINT_T0);
            const __m512i xa = _mm512_loadu_si512(in.x + k), xb = _mm512_loadu_si512(in.x + k + 32);
            for (int r = 0; r < R; r++) {
                const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes[r] + k / 2)));
                const __m512i even = _mm512_permutexvar_epi16(_mm512_and_si512(w, low), table);
                const __m512i odd = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
                sum[r] = _mm512_dpwssd_epi32(sum[r], even, xa);
                sum[r] = _mm512_dpwssd_epi32(sum[r], odd, xb);
            }
            const int64_t end = k + CHUNK;
            if (small) {
                const __m512i index = _mm512_add_epi32(lane_group, _mm512_set1_epi32(static_cast<int>((k - b0) / g)));
                for (int r = 0; r < R; r++) {
                    part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_permutexvar_ps(index, s16[r]), part[r]);
                    sum[r] = _mm512_setzero_si512();
                }
            } else if (end % g == 0 || end == b1) {  // since the last flush: one group
                const int64_t group = k / g;
                for (int r = 0; r < R; r++) {
                    const float s = byte_scale ? scale_table[r][scale_bytes[r][group]] : scales[r][group];
                    part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_set1_ps(s), part[r]);
                    sum[r] = _mm512_setzero_si512();
                }
            }
        }
        const __m512 unit = _mm512_set1_ps(in.unit[b0 / BLOCK]);
        for (int r = 0; r < R; r++) total[r] = _mm512_fmadd_ps(part[r], unit, total[r]);
    }
    for (int r = 0; r < R; r++) acc[n + r] = _mm512_reduce_add_ps(total[r]);
}

}  // namespace qscheme_gemv_int16

namespace qscheme_gemv {

void gemv_int16_avx512(const Params &p, const Int16Input &in, int64_t n0, int64_t n1, float *acc) {
    using namespace qscheme_gemv_int16;
    Scratch &work = scratch();
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_int16<4>(p, in, n, acc, work);
    for (; n < n1; n++) rows_int16<1>(p, in, n, acc, work);
}

}  // namespace qscheme_gemv

#else  // not x86: never called (int16_fits refuses every layer)

#include "cpu_gemv.h"

namespace qscheme_gemv {
void gemv_int16_avx512(const Params &, const Int16Input &, int64_t, int64_t, float *) {}
}  // namespace qscheme_gemv

#endif
