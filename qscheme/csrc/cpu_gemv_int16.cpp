// The 4-bit GEMV loop for one to four bfloat16 rows of x on AVX512-VNNI (cpu_gemv.h: Int16Input):
// integer products (cpu_gemv_dot_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#define QS_ISA_NAMESPACE qscheme_gemv_int16
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

}  // namespace qscheme_gemv

#else  // not x86: never called (int16_fits refuses every layer)

#include "cpu_gemv.h"

namespace qscheme_gemv {
void gemv_int16_avx512(const Params &, const Int16Input &, int, int64_t, int64_t, float *, int64_t) {}
}  // namespace qscheme_gemv

#endif
