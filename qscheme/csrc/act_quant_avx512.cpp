// The AVX-512 pass of qscheme._cpu_gemv.prepare_input and activation_codes (act_quant.cpp has the arithmetic, which this
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

// e4m3's saturating round to nearest even, as act_quant.cpp's: |v| clamped to 448 first, then
// rounded to 3 fraction bits at its own exponent (at least -6, e4m3's subnormal spacing 2**-9 below):
// scaled by 2**-e into [1, 2) (or [0, 1)), rounded to a multiple of 1/8 (ties to even), scaled back.
// Every scaling is by a power of two, exact.
inline __m512 round_e4m3(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m512 e = _mm512_max_ps(_mm512_getexp_ps(v), _mm512_set1_ps(-6.0f));
    const __m512 scaled = _mm512_scalef_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), e));
    return _mm512_scalef_ps(_mm512_roundscale_ps(scaled, (3 << 4) | _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), e);
}

inline __m512 round_int8(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_add_ps(v, _mm512_setzero_ps());  // -0.0 + 0.0 = +0.0: the int8 code of zero has no sign
}

// 16 elements of a row from column i (mask: the columns present), times their pre-scales where the
// pass has them (float32 products, as act_quant.cpp's input).
inline __m512 input16(const Pass &pass, int64_t row, int64_t i, __mmask16 mask) {
    const __m512 v = load16(pass.x, pass.bf16, row * pass.k + i, mask);
    return pass.pre_scale ? _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, pass.pre_scale + i)) : v;
}

// 16 values stored from element i of out: float32, or bfloat16 rounded to nearest even (NaN to 0x7FC0).
inline void store16(const Pass &pass, int64_t i, __mmask16 mask, __m512 v) {
    if (!pass.out_bf16) {
        _mm512_mask_storeu_ps(static_cast<float *>(pass.out) + i, mask, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t *>(pass.out) + i, mask, _mm512_cvtepi32_epi16(rounded));
}

// s over elements [g0, g1) of a row, as act_quant.cpp's dynamic_scale.
inline float dynamic_scale(const Pass &pass, int64_t row, int64_t g0, int64_t g1, float range) {
    __m512 amax = _mm512_setzero_ps();
    int64_t i = g0;
    for (; i + 16 <= g1; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(input16(pass, row, i, 0xFFFF)));
    if (i < g1) amax = _mm512_max_ps(amax, _mm512_abs_ps(input16(pass, row, i, tail(g1 - i))));
    const float s = _mm512_reduce_max_ps(amax) / range;
    return s == 0.0f ? FLT_EPSILON : s;
}

}  // namespace

void pass_rows_avx512(const Pass &pass, int64_t r0, int64_t r1) {
    const int64_t k = pass.k, length = block_length(pass);
    const bool e4m3 = pass.mode != INT8_TOKEN;
    const float range = e4m3 ? 448.0f : 127.5f;
    float *scales = pass.scales ? pass.scales + r0 * blocks_per_row(pass) : nullptr;
    for (int64_t row = r0; row < r1; row++) {
        const int64_t base = row * k;
        if (pass.mode == NONE) {
            int64_t i = 0;
            for (; i + 16 <= k; i += 16) store16(pass, base + i, 0xFFFF, input16(pass, row, i, 0xFFFF));
            if (i < k) store16(pass, base + i, tail(k - i), input16(pass, row, i, tail(k - i)));
            continue;
        }
        for (int64_t g0 = 0; g0 < k; g0 += length) {
            const int64_t g1 = std::min(k, g0 + length);
            const float s = pass.mode == E4M3_STATIC ? pass.scale : dynamic_scale(pass, row, g0, g1, range);
            if (scales) *scales++ = s;
            const __m512 vs = _mm512_set1_ps(s);
            const auto one = [&](int64_t i, __mmask16 mask) {
                const __m512 v = _mm512_div_ps(input16(pass, row, i, mask), vs);
                const __m512 code = e4m3 ? round_e4m3(v) : round_int8(v);
                store16(pass, base + i, mask, scales ? code : _mm512_mul_ps(code, vs));
            };
            int64_t i = g0;
            for (; i + 16 <= g1; i += 16) one(i, static_cast<__mmask16>(0xFFFF));
            if (i < g1) one(i, tail(g1 - i));
        }
    }
}

void int8_codes_avx512(const void *x, bool bf16, int64_t m, int64_t k, uint8_t *codes, int64_t stride, float *scales) {
    const Pass pass{x, bf16, nullptr, false, m, k, INT8_TOKEN, 0, 0.0f, nullptr, nullptr};
    for (int64_t row = 0; row < m; row++) {
        const float s = scales[row] = dynamic_scale(pass, row, 0, k, 127.5f);
        const __m512 vs = _mm512_set1_ps(s);
        uint8_t *out = codes + row * stride;
        for (int64_t i = 0; i < k; i += 16) {
            const __mmask16 mask = tail(k - i);
            const __m512 q = round_int8(_mm512_div_ps(input16(pass, row, i, mask), vs));
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
void pass_rows_avx512(const Pass &, int64_t, int64_t) {}
bool all_finite_avx512(const void *, int, int64_t) { return false; }
void int8_codes_avx512(const void *, bool, int64_t, int64_t, uint8_t *, int64_t, float *) {}
}  // namespace qscheme_act

#endif
