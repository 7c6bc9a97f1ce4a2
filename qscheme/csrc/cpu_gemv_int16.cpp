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
    const __m512i evens = qscheme_bf16_words::every_other_word(0), odds = qscheme_bf16_words::every_other_word(1);
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    for (int64_t b0 = 0, b = 0; b0 < in.k_main; b0 += 256, b++) {
        const int64_t b1 = b0 + 256 < in.k_main ? b0 + 256 : in.k_main;  // multiples of 64
        // the block's largest magnitude: the largest of the bit patterns less their signs
        __m512i top = _mm512_setzero_si512();
        for (int64_t c = b0; c < b1; c += 32) top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512(x + c), magnitude));
        const __m256i half = _mm256_max_epu16(_mm512_castsi512_si256(top), _mm512_extracti64x4_epi64(top, 1));
        const __m128i quarter = _mm_max_epu16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
        const int largest = 0xFFFF - (_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(quarter, _mm_set1_epi16(-1)))) & 0xFFFF);
        if (largest >= 0x7F80) return false;  // an element not finite
        int exponent = 0;  // largest = f * 2**exponent, 0.5 <= f < 1 (frexp's)
        if (largest > 0) {
            if ((largest >> 7) == 0) return false;  // subnormal: below 2**-100
            exponent = (largest >> 7) - 126;
            if (exponent < -100 || exponent > 100) return false;
        }
        // step 2**(exponent - 15): largest / step = f * 2**15 < 32768, at most 32640 for a bfloat16 value;
        // each element times 2**(15 - exponent) exactly, rounded to the nearest integer (ties to even)
        const __m512 inverse = _mm512_set1_ps(std::ldexp(1.0f, 15 - exponent));
        unit[b] = std::ldexp(1.0f, exponent - 15) / in.factor;
        auto integers = [&](__m512i words, int64_t at) {  // 32 words into xq[at, at + 32)
            for (int h = 0; h < 2; h++) {
                const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, h)), 16);
                const __m512 scaled = _mm512_mul_ps(_mm512_castsi512_ps(wide), inverse);
                const __m512i rounded = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(xq + at + 16 * h), _mm512_cvtsepi32_epi16(rounded));
            }
        };
        for (int64_t c = b0; c < b1; c += 64) {  // per chunk of 64: its 32 even elements, then its 32 odd ones
            const __m512i lo = _mm512_loadu_si512(x + c), hi = _mm512_loadu_si512(x + c + 32);
            integers(_mm512_permutex2var_epi16(lo, evens, hi), c);
            integers(_mm512_permutex2var_epi16(lo, odds, hi), c + 32);
        }
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
