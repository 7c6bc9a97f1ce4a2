// The 4-bit GEMV loop for one to four bfloat16 rows of x on AVX512-BF16 (cpu_gemv.h: Int16Input
// with bf16 set): bfloat16 products summed in float32 (cpu_gemv_dot_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#define QS_ISA_NAMESPACE qscheme_gemv_bf16dot
#include "bf16_words.h"
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
    using namespace qscheme_bf16_words;
    __mmask32 bad = 0;
    dot_loop_order(x, 0, k_main, [&](__m512i words, int64_t at) {
        bad |= outside(words);
        _mm512_storeu_si512(xq + at, words);
    });
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
