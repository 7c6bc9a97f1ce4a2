// AVX-512 (F, BW, VL, DQ) instances of the packed-block GEMV loop (cpu_gemv_gguf_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#define QS_GGUF_NAMESPACE qscheme_gguf_avx512
#include "cpu_gemv_gguf_kernel.h"
#include "cpu_gemv_gguf_v512.h"

namespace qscheme_gguf {

void gemv_blocks_avx512(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int m,
                        int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    using namespace qscheme_gguf_avx512;
    gemv_blocks_vector<V512>(l, plan, x, ldx, xsum, m, n0, n1, acc, ldy, Half());
}

}  // namespace qscheme_gguf
#endif
