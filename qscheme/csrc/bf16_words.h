// bfloat16 rows of x as the AVX-512 dot-product loops take them (cpu_gemv_bf16dot.cpp,
// cpu_gemv_int16.cpp, cpu_gemv_gguf_bf16.cpp): include after the unit's `#pragma GCC target` with
// AVX512-BW, so that these inline helpers compile for it.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace qscheme_bf16_words {

// The words of v that are neither zero nor of a magnitude in [2**-100, 2**64] (not finite
// included): as 15-bit magnitudes, 2**-100 is 0x0D80 (exponent field 27) and 2**64 is 0x5F80.
static inline __mmask32 outside(__m512i v) {
    const __m512i size = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    const __mmask32 in_range = _mm512_cmpge_epu16_mask(size, _mm512_set1_epi16(0x0D80)) &
                               _mm512_cmple_epu16_mask(size, _mm512_set1_epi16(0x5F80));
    return static_cast<__mmask32>(~(in_range | _mm512_cmpeq_epi16_mask(size, _mm512_setzero_si512())));
}

// VPERMT2W indices over two vectors of 32 words: their 32 even words (odd = 0), or their odd ones.
static inline __m512i every_other_word(int odd) {
    alignas(64) int16_t index[32];
    for (int i = 0; i < 32; i++) index[i] = static_cast<int16_t>(2 * i + odd);
    return _mm512_load_si512(index);
}

// Words [c0, c1) of x (multiples of 64) in the order of cpu_gemv's dot loops (cpu_gemv_dot_kernel.h): each
// chunk of 128 as four runs of 32, run t holding the chunk's elements 4i + t; a last chunk of 64 as its 32 even
// elements, then its 32 odd ones. put(words, at) takes the 32 words for positions [at, at + 32).
template <class F>
static inline void dot_loop_order(const uint16_t *x, int64_t c0, int64_t c1, F put) {
    const __m512i evens = every_other_word(0), odds = every_other_word(1);
    int64_t c = c0;
    for (; c + 128 <= c1; c += 128) {
        const __m512i v0 = _mm512_loadu_si512(x + c), v1 = _mm512_loadu_si512(x + c + 32);
        const __m512i v2 = _mm512_loadu_si512(x + c + 64), v3 = _mm512_loadu_si512(x + c + 96);
        // elements 2i and 2i + 1 of each half, then every other one of those
        const __m512i e0 = _mm512_permutex2var_epi16(v0, evens, v1), o0 = _mm512_permutex2var_epi16(v0, odds, v1);
        const __m512i e1 = _mm512_permutex2var_epi16(v2, evens, v3), o1 = _mm512_permutex2var_epi16(v2, odds, v3);
        put(_mm512_permutex2var_epi16(e0, evens, e1), c);
        put(_mm512_permutex2var_epi16(o0, evens, o1), c + 32);
        put(_mm512_permutex2var_epi16(e0, odds, e1), c + 64);
        put(_mm512_permutex2var_epi16(o0, odds, o1), c + 96);
    }
    if (c < c1) {
        const __m512i lo = _mm512_loadu_si512(x + c), hi = _mm512_loadu_si512(x + c + 32);
        put(_mm512_permutex2var_epi16(lo, evens, hi), c);
        put(_mm512_permutex2var_epi16(lo, odds, hi), c + 32);
    }
}

// x rounded to 16-bit integers over a power-of-two step per block (the VNNI loops' integer products:
// cpu_gemv_int16.cpp, cpu_gemv_gguf_bf16.cpp): the block's largest magnitude, words [b0, b1) of x (b1 - b0 a
// multiple of 32), as a 15-bit pattern (the largest bit pattern less its sign).
static inline int largest_magnitude(const uint16_t *x, int64_t b0, int64_t b1) {
    __m512i top = _mm512_setzero_si512();
    for (int64_t c = b0; c < b1; c += 32)
        top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512(x + c), _mm512_set1_epi16(0x7FFF)));
    return _mm512_reduce_max_epi32(_mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(top)),
                                                    _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(top, 1))));
}

// The exponent e of a finite, normal bfloat16 magnitude `largest` (largest_magnitude's) = f * 2**e with
// 0.5 <= f < 1 (frexp's), 0 for zero: the step is 2**(e - 15), so that largest / step = f * 2**15 <= 32640.
static inline int step_exponent(int largest) { return largest > 0 ? (largest >> 7) - 126 : 0; }

// 16 bfloat16 words as integers into out[0, 16): each times `inverse` (2**(15 - e), exact), rounded to
// the nearest integer, ties to even.
static inline void words_to_integers(__m256i words, __m512 inverse, int16_t *out) {
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out), _mm512_cvtsepi32_epi16(q));
}

// Words [0, words) of x (a multiple of 32; every element zero or of a magnitude in [2**-100, 2**64]) as
// 16-bit integers into xq (x itself allowed: each 16 words are read before they are written), each block
// of 256 over its own step unit[b] = 2**(e - 15) (the GGUF integer products' rounding).
static inline void integer_blocks(const uint16_t *x, int64_t words, int16_t *xq, float *unit) {
    for (int64_t b0 = 0, b = 0; b0 < words; b0 += 256, b++) {
        const int64_t b1 = b0 + 256 < words ? b0 + 256 : words;
        const int exponent = step_exponent(largest_magnitude(x, b0, b1));
        const __m512 inverse = _mm512_set1_ps(std::ldexp(1.0f, 15 - exponent));
        unit[b] = std::ldexp(1.0f, exponent - 15);
        for (int64_t c = b0; c < b1; c += 16)
            words_to_integers(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x + c)), inverse, xq + c);
    }
}

}  // namespace qscheme_bf16_words
