// bfloat16 rows of x as the AVX-512 dot-product loops take them (cpu_gemv_bf16dot.cpp,
// cpu_gemv_int16.cpp, cpu_gemv_gguf_bf16.cpp): include after the unit's `#pragma GCC target` with
// AVX512-BW, so that these inline helpers compile for it.
#pragma once

#include <immintrin.h>

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

}  // namespace qscheme_bf16_words
