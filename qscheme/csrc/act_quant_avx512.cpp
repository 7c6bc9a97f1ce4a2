// The AVX-512 pass of qscheme._cpu_gemv.fake_quantize (act_quant.cpp has the arithmetic, which this
// computes 16 elements at a time, bit for bit: the same float32 divisions, roundings and products).
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || defined(__GNUC__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstring>

#include "act_quant.h"

namespace qscheme_act {

bool vector_compiled() { return true; }

namespace {

inline __m512 load16(const void *x, bool bf16, int64_t i, __mmask16 mask) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, static_cast<const float *>(x) + i);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t *>(x) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 tail(int64_t count) {
    return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

inline __m512 round_e4m3(__m512 v) {
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512 a = _mm512_abs_ps(v);
    __m512i bits = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
    __m512 r = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFF00000u))));
    const __m512 small = _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                       _mm512_set1_ps(1.0f / 512.0f));
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), small);
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a, _mm512_set1_ps(448.0f), _CMP_GE_OQ), _mm512_set1_ps(448.0f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}

inline __m512 round_int8(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_add_ps(v, _mm512_setzero_ps());  // -0.0 + 0.0 = +0.0: the int8 code of zero has no sign
}

// absmax / range over elements [g0, g1) of x from base, as act_quant.cpp's dynamic_scale.
inline float dynamic_scale(const void *x, bool bf16, int64_t base, int64_t g0, int64_t g1, float range) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = g0; i < g1; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x, bf16, base + i, tail(g1 - i))));
    const float s = _mm512_reduce_max_ps(amax) / range;
    return s == 0.0f ? FLT_EPSILON : s;
}

}  // namespace

void fake_quantize_avx512(const void *x, bool bf16, float *out, int64_t m, int64_t k, int mode, int64_t group,
                          float scale, float *scales) {
    const bool e4m3 = mode != INT8_TOKEN;
    const float range = e4m3 ? 448.0f : 127.5f;
    const int64_t length = mode == E4M3_GROUP ? group : k;
    for (int64_t row = 0; row < m; row++) {
        const int64_t base = row * k;
        for (int64_t g0 = 0; g0 < k; g0 += length) {
            const int64_t g1 = std::min(k, g0 + length);
            const float s = mode == E4M3_STATIC ? scale : dynamic_scale(x, bf16, base, g0, g1, range);
            if (scales) *scales++ = s;
            const __m512 vs = _mm512_set1_ps(s);
            for (int64_t i = g0; i < g1; i += 16) {
                const __mmask16 mask = tail(g1 - i);
                const __m512 v = _mm512_div_ps(load16(x, bf16, base + i, mask), vs);
                const __m512 code = e4m3 ? round_e4m3(v) : round_int8(v);
                _mm512_mask_storeu_ps(out + base + i, mask, scales ? code : _mm512_mul_ps(code, vs));
            }
        }
    }
}

void int8_codes_avx512(const void *x, bool bf16, int64_t m, int64_t k, uint8_t *codes, int64_t stride, float *scales) {
    for (int64_t row = 0; row < m; row++) {
        const int64_t base = row * k;
        const float s = scales[row] = dynamic_scale(x, bf16, base, 0, k, 127.5f);
        const __m512 vs = _mm512_set1_ps(s);
        uint8_t *out = codes + row * stride;
        for (int64_t i = 0; i < k; i += 16) {
            const __mmask16 mask = tail(k - i);
            const __m512 q = round_int8(_mm512_div_ps(load16(x, bf16, base + i, mask), vs));
            const __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
            _mm_mask_storeu_epi8(out + i, mask, _mm512_cvtepi32_epi8(shifted));
        }
        std::memset(out + k, 0, static_cast<size_t>(stride - k));
    }
}

bool all_finite_avx512(const void *x, int dtype, int64_t n) {
    const uint8_t *bytes = static_cast<const uint8_t *>(x);
    const int size = dtype == 0 ? 4 : 2;
    const int64_t total = n * size;
    __mmask64 bad = 0;  // any lane whose exponent field is all ones (inf or NaN)
    if (dtype == 0) {
        const __m512i field = _mm512_set1_epi32(0x7F800000);
        for (int64_t i = 0; i < total; i += 64) {
            const int64_t left = (total - i) / 4;
            const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
            const __m512i w = _mm512_maskz_loadu_epi32(mask, bytes + i);
            bad |= _mm512_mask_cmpeq_epi32_mask(mask, _mm512_and_si512(w, field), field);
        }
    } else {
        const __m512i field = _mm512_set1_epi16(static_cast<short>(dtype == 1 ? 0x7F80 : 0x7C00));
        for (int64_t i = 0; i < total; i += 64) {
            const int64_t left = (total - i) / 2;
            const __mmask32 mask = left >= 32 ? ~0u : static_cast<__mmask32>((1u << left) - 1u);
            const __m512i w = _mm512_maskz_loadu_epi16(mask, bytes + i);
            bad |= _mm512_mask_cmpeq_epi16_mask(mask, _mm512_and_si512(w, field), field);
        }
    }
    return bad == 0;
}

}  // namespace qscheme_act

#else  // no x86: the portable pass only

#include "act_quant.h"

namespace qscheme_act {
bool vector_compiled() { return false; }
void fake_quantize_avx512(const void *, bool, float *, int64_t, int64_t, int, int64_t, float, float *) {}
bool all_finite_avx512(const void *, int, int64_t) { return false; }
void int8_codes_avx512(const void *, bool, int64_t, int64_t, uint8_t *, int64_t, float *) {}
}  // namespace qscheme_act

#endif
