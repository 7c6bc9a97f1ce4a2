// AVX2 (with FMA) instances of the packed-block GEMV loop (cpu_gemv_gguf_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define QS_GGUF_NAMESPACE qscheme_gguf_avx2
#include "cpu_gemv_gguf_kernel.h"

namespace qscheme_gguf_avx2 {

struct Lut8 {
    __m256 low, high;  // entries 0-7 and 8-15
};

struct V256 {
    static constexpr int W = 8;
    using vec = __m256;
    using ivec = __m256i;
    using Table = Lut8;
    static inline vec zero() { return _mm256_setzero_ps(); }
    static inline vec load(const float *p) { return _mm256_loadu_ps(p); }
    static inline void store(float *p, vec v) { _mm256_storeu_ps(p, v); }
    static inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
    static inline vec set1(float v) { return _mm256_set1_ps(v); }
    static inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
    static inline float hsum(vec v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static inline ivec window(const uint8_t *p, const Chunk &c) {
        __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        if (!c.ident) w = _mm_shuffle_epi8(w, _mm_load_si128(reinterpret_cast<const __m128i *>(c.idx)));
        return _mm256_cvtepu8_epi32(w);
    }
    static inline ivec raw(const uint8_t *p) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
    }
    static inline ivec srli4(ivec v) { return _mm256_srli_epi32(v, 4); }
    static inline ivec bytes(const uint8_t *p, bool is_signed) {
        const __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
        return is_signed ? _mm256_cvtepi8_epi32(w) : _mm256_cvtepu8_epi32(w);
    }
    static inline ivec srlv(ivec v, const int32_t *s) {
        return _mm256_srlv_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i *>(s)));
    }
    static inline ivec sllv(ivec v, const int32_t *s) {
        return _mm256_sllv_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i *>(s)));
    }
    static inline ivec and_(ivec v, const int32_t *s) {
        return _mm256_and_si256(v, _mm256_load_si256(reinterpret_cast<const __m256i *>(s)));
    }
    static inline ivec or_(ivec a, ivec b) { return _mm256_or_si256(a, b); }
    static inline Table table(const float *values) { return {_mm256_loadu_ps(values), _mm256_loadu_ps(values + 8)}; }
    static inline vec lut(ivec v, const Table &t) {  // bit 3 of each index chooses the half
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.low, v), _mm256_permutevar8x32_ps(t.high, v),
                                _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
    }
    static inline vec integer(ivec v, int shift, int add) {
        if (shift) v = _mm256_srai_epi32(_mm256_slli_epi32(v, shift), shift);
        return _mm256_cvtepi32_ps(add ? _mm256_add_epi32(v, _mm256_set1_epi32(add)) : v);
    }
};

struct Half {
    inline float operator()(uint16_t h) const { return _cvtsh_ss(h); }
};

}  // namespace qscheme_gguf_avx2

namespace qscheme_gguf {

void gemv_blocks_avx2(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int m,
                      int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    using namespace qscheme_gguf_avx2;
    gemv_blocks_vector<V256>(l, plan, x, ldx, xsum, m, n0, n1, acc, ldy, Half());
}

}  // namespace qscheme_gguf
#endif
