// The AVX-512 vector type of the packed-block loops (cpu_gemv_gguf_kernel.h: V), 16 float32 lanes,
// and the F16C half conversion: included inside QS_GGUF_NAMESPACE by each translation unit compiled
// for AVX-512 (cpu_gemv_gguf_avx512.cpp, cpu_gemv_gguf_bf16.cpp), after <immintrin.h>.
#pragma once

namespace QS_GGUF_NAMESPACE {

struct V512 {
    static constexpr int W = 16;
    using vec = __m512;
    using ivec = __m512i;
    using Table = __m512;
    static inline vec zero() { return _mm512_setzero_ps(); }
    static inline vec load(const float *p) { return _mm512_loadu_ps(p); }
    static inline void store(float *p, vec v) { _mm512_storeu_ps(p, v); }
    static inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
    static inline vec set1(float v) { return _mm512_set1_ps(v); }
    static inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
    static inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
    static inline ivec window(const uint8_t *p, const Chunk &c) {
        __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        if (!c.ident) w = _mm_shuffle_epi8(w, _mm_load_si128(reinterpret_cast<const __m128i *>(c.idx)));
        return _mm512_cvtepu8_epi32(w);
    }
    static inline ivec raw(const uint8_t *p) {
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    }
    static inline ivec srli4(ivec v) { return _mm512_srli_epi32(v, 4); }
    static inline ivec bytes(const uint8_t *p, bool is_signed) {
        const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        return is_signed ? _mm512_cvtepi8_epi32(w) : _mm512_cvtepu8_epi32(w);
    }
    static inline ivec srlv(ivec v, const int32_t *s) { return _mm512_srlv_epi32(v, _mm512_load_si512(s)); }
    static inline ivec sllv(ivec v, const int32_t *s) { return _mm512_sllv_epi32(v, _mm512_load_si512(s)); }
    static inline ivec and_(ivec v, const int32_t *s) { return _mm512_and_si512(v, _mm512_load_si512(s)); }
    static inline ivec or_(ivec a, ivec b) { return _mm512_or_si512(a, b); }
    static inline Table table(const float *values) { return _mm512_loadu_ps(values); }
    static inline vec lut(ivec v, Table t) { return _mm512_permutexvar_ps(v, t); }
    static inline vec integer(ivec v, int shift, int add) {
        if (shift) v = _mm512_srai_epi32(_mm512_slli_epi32(v, shift), shift);
        return _mm512_cvtepi32_ps(add ? _mm512_add_epi32(v, _mm512_set1_epi32(add)) : v);
    }
};

struct Half {
    inline float operator()(uint16_t h) const { return _cvtsh_ss(h); }
};

}  // namespace QS_GGUF_NAMESPACE
