// The 4-bit GEMV loop for one to four bfloat16 rows of x on AVX512-BF16 (cpu_gemv.h: Int16Input
// with bf16 set): bfloat16 products summed in float32 (cpu_gemv_dot_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#define QS_ISA_NAMESPACE qscheme_gemv_bf16dot
#include "cpu_gemv_dot_kernel.h"

namespace qscheme_gemv_bf16dot {

// bfloat16 words (x as it is, the code values), each product exact in float32 and added to its
// lane with one rounding (subnormal results read and written as zero).
struct Bf16Products {
    static constexpr bool INTEGER = false;
    using acc = __m512;
    static inline acc zero() { return _mm512_setzero_ps(); }
    static inline acc dot(acc sum, __m512i weights, __m512i x) {
        return _mm512_dpbf16_ps(sum, reinterpret_cast<__m512bh>(weights), reinterpret_cast<__m512bh>(x));
    }
    static inline __m512 widen(acc sum) { return sum; }
};

}  // namespace qscheme_gemv_bf16dot

namespace qscheme_gemv {

void gemv_bf16dot_avx512(const Params &p, const Int16Input &in, int m, int64_t n0, int64_t n1, float *acc,
                         int64_t ldy) {
    qscheme_gemv_bf16dot::gemv_dot<qscheme_gemv_bf16dot::Bf16Products>(p, in, m, n0, n1, acc, ldy);
}

bool bf16dot_words(const uint16_t *x, int64_t k_main, int16_t *xq) {
    // magnitudes as 15-bit integers: 2**-100 is 0x0D80 (exponent field 27), 2**64 is 0x5F80
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF), lowest = _mm512_set1_epi16(0x0D80);
    const __m512i highest = _mm512_set1_epi16(0x5F80);
    alignas(64) int16_t even[32], odd[32];
    for (int i = 0; i < 32; i++) {
        even[i] = static_cast<int16_t>(2 * i);
        odd[i] = static_cast<int16_t>(2 * i + 1);
    }
    const __m512i evens = _mm512_load_si512(even), odds = _mm512_load_si512(odd);
    auto outside = [&](__m512i v) {  // the words neither zero nor in range
        const __m512i size = _mm512_and_si512(v, magnitude);
        const __mmask32 in_range = _mm512_cmpge_epu16_mask(size, lowest) & _mm512_cmple_epu16_mask(size, highest);
        return static_cast<__mmask32>(~(in_range | _mm512_cmpeq_epi16_mask(size, _mm512_setzero_si512())));
    };
    __mmask32 bad = 0;
    for (int64_t c = 0; c < k_main; c += 64) {  // per chunk of 64: its 32 even elements, then its 32 odd ones
        const __m512i a = _mm512_loadu_si512(x + c), b = _mm512_loadu_si512(x + c + 32);
        bad |= outside(a) | outside(b);
        _mm512_storeu_si512(xq + c, _mm512_permutex2var_epi16(a, evens, b));
        _mm512_storeu_si512(xq + c + 32, _mm512_permutex2var_epi16(a, odds, b));
    }
    return bad == 0;
}

}  // namespace qscheme_gemv

#else  // not x86: never called (int16_fits refuses every layer)

#include "cpu_gemv.h"

namespace qscheme_gemv {
void gemv_bf16dot_avx512(const Params &, const Int16Input &, int, int64_t, int64_t, float *, int64_t) {}
bool bf16dot_words(const uint16_t *, int64_t, int16_t *) { return false; }
}  // namespace qscheme_gemv

#endif
