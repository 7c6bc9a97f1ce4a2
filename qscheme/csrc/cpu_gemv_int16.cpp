// The 4-bit GEMV loop for one to four bfloat16 rows of x on AVX512-VNNI (cpu_gemv.h: Int16Input):
// integer products (cpu_gemv_dot_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include <cmath>

#define QS_ISA_NAMESPACE qscheme_gemv_int16
#include "bf16_words.h"
#include "cpu_gemv_dot_kernel.h"

namespace qscheme_gemv_int16 {

// 16-bit integers (x over its block's step, code values times the table's factor), summed exactly
// in 32-bit lanes.
struct IntegerProducts {
    static constexpr bool INTEGER = true;
    using acc = __m512i;
    static inline acc zero() { return _mm512_setzero_si512(); }
    static inline acc dot(acc sum, __m512i weights, __m512i x) { return _mm512_dpwssd_epi32(sum, weights, x); }
    static inline __m512 widen(acc sum) { return _mm512_cvtepi32_ps(sum); }
};

}  // namespace qscheme_gemv_int16

namespace qscheme_gemv {

void gemv_int16_avx512(const Params &p, const Int16Input &in, int m, int64_t n0, int64_t n1, float *acc,
                       int64_t ldy) {
    qscheme_gemv_int16::gemv_dot<qscheme_gemv_int16::IntegerProducts>(p, in, m, n0, n1, acc, ldy);
}

bool int16_words(const uint16_t *x, const Int16Input &in, int16_t *xq, float *unit) {
    using namespace qscheme_bf16_words;
    for (int64_t b0 = 0, b = 0; b0 < in.k_main; b0 += 256, b++) {
        const int64_t b1 = b0 + 256 < in.k_main ? b0 + 256 : in.k_main;  // multiples of 64
        const int largest = largest_magnitude(x, b0, b1);
        if (largest >= 0x7F80) return false;  // an element not finite
        if (largest > 0 && (largest >> 7) == 0) return false;  // subnormal: below 2**-100
        const int exponent = step_exponent(largest);
        if (exponent < -100 || exponent > 100) return false;
        // step 2**(exponent - 15), each element times 2**(15 - exponent) exactly, rounded (bf16_words.h)
        const __m512 inverse = _mm512_set1_ps(std::ldexp(1.0f, 15 - exponent));
        unit[b] = std::ldexp(1.0f, exponent - 15) / in.factor;
        dot_loop_order(x, b0, b1, [&](__m512i words, int64_t at) {  // 32 words into xq[at, at + 32)
            words_to_integers(_mm512_castsi512_si256(words), inverse, xq + at);
            words_to_integers(_mm512_extracti64x4_epi64(words, 1), inverse, xq + at + 16);
        });
    }
    return true;
}

}  // namespace qscheme_gemv

#else  // not x86: never called (int16_fits refuses every layer)

#include "cpu_gemv.h"

namespace qscheme_gemv {
void gemv_int16_avx512(const Params &, const Int16Input &, int, int64_t, int64_t, float *, int64_t) {}
bool int16_words(const uint16_t *, const Int16Input &, int16_t *, float *) { return false; }
}  // namespace qscheme_gemv

#endif
