// Rows of packed blocks as float32 or bfloat16 on AVX-512 (cpu_gemv_gguf.h: dequantize_blocks_avx512),
// for dequant_gemm's tiles: each weight exactly as qscheme's block decoder forms it (the sub-block's
// scale product times the element's value, then its minimum product subtracted or added: one float32
// rounding each, written with the rounding-mode intrinsics so that the compiler fuses no multiply-add),
// bfloat16 rounded once to nearest even (NaN as 0x7FC0, as torch rounds).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#include <vector>

#define QS_GGUF_NAMESPACE qscheme_gguf_dequant
#include "cpu_gemv_gguf_kernel.h"
#include "cpu_gemv_gguf_v512.h"

namespace qscheme_gguf_dequant {

constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

static inline __m256i bf16_words(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
}

template <int DEPTH, bool LUT>
static void rows_to(const Layout &l, const Plan &plan, int64_t n0, int64_t n1, void *out, bool bf16) {
    using V = V512;
    const V::Table table = V::table(l.values);
    const int int_shift = l.el_signed ? 32 - l.el_bits : 0, int_add = l.el_offset;
    const int groups = l.groups, per_group = l.sub / V::W;
    const int64_t blocks = l.k / l.elements, row_groups = l.k / l.sub;
    const Chunk *chunks = plan.element.data();
    constexpr int SLOTS = DEPTH == 0 || DEPTH >= 8 ? 1 : DEPTH;
    std::vector<float> scale(static_cast<size_t>(row_groups + 16)), minimum(static_cast<size_t>(row_groups + 16));
    const bool subtract = l.minimum_sign < 0;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = l.codes + n * l.row_bytes;
        row_products<V>(l, plan, row, scale.data(), minimum.data(), Half());
        float *f32 = static_cast<float *>(out) + (n - n0) * l.k;
        uint16_t *b16 = static_cast<uint16_t *>(out) + (n - n0) * l.k;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = row + b * l.block_bytes;
            for (int g = 0; g < groups; g++) {
                const __m512 s = _mm512_set1_ps(scale[b * groups + g]);
                const __m512 m = _mm512_set1_ps(l.n_minimum ? minimum[b * groups + g] : 0.0f);
                for (int c = g * per_group; c < (g + 1) * per_group; c++) {
                    const __m512 e = decode<V, DEPTH, LUT>(block, chunks + c * SLOTS, table, int_shift, int_add);
                    __m512 w = _mm512_mul_round_ps(e, s, ROUND);
                    if (l.n_minimum) w = subtract ? _mm512_sub_round_ps(w, m, ROUND) : _mm512_add_round_ps(w, m, ROUND);
                    const int64_t at = b * l.elements + c * V::W;
                    if (bf16)
                        _mm256_storeu_si256(reinterpret_cast<__m256i *>(b16 + at), bf16_words(w));
                    else
                        _mm512_storeu_ps(f32 + at, w);
                }
            }
        }
    }
}

}  // namespace qscheme_gguf_dequant

namespace qscheme_gguf {

bool dequantize_blocks_avx512(const Layout &l, const Plan &plan, int64_t n0, int64_t n1, void *out, bool bf16) {
    using namespace qscheme_gguf_dequant;
    if (plan.width != 16) return false;
    with_element_decoder<V512>(l, plan, [&](auto depth, auto lut) {
        rows_to<decltype(depth)::value, decltype(lut)::value>(l, plan, n0, n1, out, bf16);
    });
    return true;
}

}  // namespace qscheme_gguf

#else  // not x86: the Python side decodes with qscheme.formats.blocks

#include "cpu_gemv_gguf.h"

namespace qscheme_gguf {
bool dequantize_blocks_avx512(const Layout &, const Plan &, int64_t, int64_t, void *, bool) { return false; }
}  // namespace qscheme_gguf

#endif
