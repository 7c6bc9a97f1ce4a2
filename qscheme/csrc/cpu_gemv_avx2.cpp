// AVX2 (with FMA) instances of the GEMV loop (cpu_gemv_kernel.h).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define QS_ISA_NAMESPACE qscheme_gemv_avx2
#include "cpu_gemv_kernel.h"

namespace qscheme_gemv_avx2 {

struct Lut8 {
    __m256 low, high;  // entries 0-7 and 8-15
};

struct V256 {
    static constexpr int W = 8;
    using vec = __m256;
    using Table = Lut8;
    static inline vec zero() { return _mm256_setzero_ps(); }
    static inline vec load(const float *p) { return _mm256_loadu_ps(p); }
    static inline vec pair2(float a, float b) { return _mm256_blend_ps(_mm256_set1_ps(a), _mm256_set1_ps(b), 0xF0); }
    static inline vec set1(float v) { return _mm256_set1_ps(v); }
    static inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
    static inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
    static inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
    static inline vec pair(const float *v) { return _mm256_blend_ps(_mm256_set1_ps(v[0]), _mm256_set1_ps(v[1]), 0xF0); }
    static inline float hsum(vec v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static inline Table table(const float *lut) { return {_mm256_loadu_ps(lut), _mm256_loadu_ps(lut + 8)}; }
    // a value per lane from the low 4 bits of idx; `select` holds bit 3 of each index in its sign
    static inline vec lookup(const Table &t, __m256i idx, __m256i select) {
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.low, idx), _mm256_permutevar8x32_ps(t.high, idx),
                                _mm256_castsi256_ps(select));
    }
    static inline void decode_nibbles(const uint8_t *bytes, const Table &t, vec &even, vec &odd) {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(bytes)));
        even = lookup(t, d, _mm256_slli_epi32(d, 28));
        odd = lookup(t, _mm256_srli_epi32(d, 4), _mm256_slli_epi32(d, 24));
    }
    static inline void decode_bytes2(const uint8_t *bytes, int kind, vec &a, vec &b) {
        a = decode_bytes(bytes, kind);
        b = decode_bytes(bytes + 8, kind);
    }
    static inline vec decode_bytes(const uint8_t *bytes, int kind) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(bytes));
        if (kind == CODE_E4M3 || kind == CODE_E4M3_X256) {  // through float16, as the AVX-512 loop (no float32 subnormals)
            __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8);
            h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(static_cast<short>(0xBF80)));
            const __m256 value = _mm256_cvtph_ps(h);  // the code's value / 256
            return kind == CODE_E4M3_X256 ? value : _mm256_mul_ps(value, _mm256_set1_ps(256.0f));
        }
        if (kind == CODE_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
    }
};

}  // namespace qscheme_gemv_avx2

namespace qscheme_gemv {

void halves_to_floats_f16c(const uint16_t *h, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)  // exact: F16C converts every float16 value (a signalling NaN comes out quiet)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(h + i))));
    for (; i < n; i++) out[i] = half_value(h[i]);
}

void gemv_avx2(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    qscheme_gemv_avx2::gemv_vector<qscheme_gemv_avx2::V256>(p, x, ldx, m, n0, n1, acc, ldy);
}

}  // namespace qscheme_gemv
#endif
