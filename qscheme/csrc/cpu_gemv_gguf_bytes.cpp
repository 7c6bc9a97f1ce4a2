// Integer products for blocks of 8-bit codes (cpu_gemv_gguf.h: byte_codes_offset, bytes_words,
// gemv_bytes_int16): GGUF's Q8_0, or any declaration whose block holds one fp16 scale and its codes as
// signed bytes in order, for one or two bfloat16 rows of x.
//
// x is rounded to 16-bit integers per block of 256 elements over a power-of-two step (the same
// rounding as the 4-bit types' integer products, bf16_words.h): an element within 2**8 of its block's
// largest magnitude is exact, a smaller one off by at most half a step. Each block of codes is widened to
// 16-bit lanes (VPMOVSXBW) and multiplied by x's integers with VPMADDWD: 16 exact 32-bit sums of two
// products each (at most 2 * 128 * 32768 = 2**23 in magnitude, so exact in float32 too), converted and
// multiplied by the block's scale into float32 sums (one rounding each), every 256 elements' sums by
// their step. The float32 loop this replaces spent 3 vector instructions every 16 weights and a row
// (widen, convert, multiply-add), and spilled registers across its four rows.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "bf16_words.h"
#include "cpu_gemv_gguf.h"

namespace qscheme_gguf {

int byte_codes_offset(const Layout &l) {
    const bool half_scale = l.n_scale == 1 && l.scale[0].is_field && l.scale[0].count == 1 &&
                            l.scale[0].format == FIELD_FP16;
    if (!half_scale || l.n_minimum || l.groups != 1 || l.el_table || l.el_depth != 1 || l.el_bits != 8 ||
        !l.el_signed || l.el_offset || l.elements % 32 || l.block_bytes > 255)
        return -1;
    // a block of distinct bytes (1, 2, ...): element i must be byte offset + i
    uint8_t block[256];
    for (int j = 0; j < l.block_bytes; j++) block[j] = static_cast<uint8_t>(j + 1);
    const int offset = static_cast<int>(element_code(l, block, 0)) - 1;
    if (offset < 0 || offset + l.elements > l.block_bytes) return -1;
    for (int i = 0; i < l.elements; i++)
        if (static_cast<int>(element_code(l, block, i)) != offset + i + 1) return -1;
    const int scale = l.scale[0].offset;  // the scale's two bytes outside the codes
    if (scale < 0 || scale + 2 > l.block_bytes || (scale + 2 > offset && scale < offset + l.elements)) return -1;
    return offset;
}

bool bytes_words(const uint16_t *x, int64_t k, int16_t *xq, float *unit) {
    for (int64_t c = 0; c < k; c += 32)  // K a multiple of 32
        if (qscheme_bf16_words::outside(_mm512_loadu_si512(x + c))) return false;
    qscheme_bf16_words::integer_blocks(x, k, xq, unit);
    return true;
}

namespace {

inline __m512 block_scale(const uint8_t *block, int offset) {
    uint16_t h;
    std::memcpy(&h, block + offset, 2);
    return _mm512_set1_ps(_cvtsh_ss(h));
}

// Rows [n0, n1) times M rows of x, two weight rows at a time (the second's sums a second chain).
template <int M>
void rows(const Layout &l, int offset, const int16_t *xq, const float *unit, int64_t n0, int64_t n1, float *acc,
          int64_t ldy) {
    const int64_t blocks = l.k / l.elements, row_bytes = l.row_bytes, block_bytes = l.block_bytes;
    const int64_t k = l.k, units = (k + 255) / 256, per_unit = 256 / l.elements;
    const int chunks = l.elements / 32, scale_offset = l.scale[0].offset;
    const uint8_t *codes = l.codes;
    for (int64_t n = n0; n < n1; n += 2) {
        const bool two = n + 1 < n1;
        const uint8_t *row0 = codes + n * row_bytes, *row1 = two ? row0 + row_bytes : row0;
        __m512 total[2][M], part[2][M];
        for (int r = 0; r < M; r++)
            for (int w = 0; w < 2; w++) total[w][r] = _mm512_setzero_ps();
        for (int64_t u = 0; u < units; u++) {
            for (int r = 0; r < M; r++)
                for (int w = 0; w < 2; w++) part[w][r] = _mm512_setzero_ps();
            const int64_t last = std::min<int64_t>(blocks, (u + 1) * per_unit);
            for (int64_t b = u * per_unit; b < last; b++) {
                const uint8_t *block0 = row0 + b * block_bytes, *block1 = row1 + b * block_bytes;
                const __m512 s0 = block_scale(block0, scale_offset), s1 = block_scale(block1, scale_offset);
                for (int c = 0; c < chunks; c++) {
                    const __m512i q0 = _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256(reinterpret_cast<const __m256i *>(block0 + offset + 32 * c)));
                    const __m512i q1 = _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256(reinterpret_cast<const __m256i *>(block1 + offset + 32 * c)));
                    for (int r = 0; r < M; r++) {
                        const __m512i xv = _mm512_loadu_si512(xq + r * k + b * l.elements + 32 * c);
                        part[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(q0, xv)), s0, part[0][r]);
                        part[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(q1, xv)), s1, part[1][r]);
                    }
                }
            }
            for (int r = 0; r < M; r++) {
                const __m512 step = _mm512_set1_ps(unit[r * units + u]);
                for (int w = 0; w < 2; w++) total[w][r] = _mm512_fmadd_ps(part[w][r], step, total[w][r]);
            }
        }
        for (int r = 0; r < M; r++) {
            acc[r * ldy + n] = _mm512_reduce_add_ps(total[0][r]);
            if (two) acc[r * ldy + n + 1] = _mm512_reduce_add_ps(total[1][r]);
        }
    }
}

}  // namespace

void gemv_bytes_int16(const Layout &l, int offset, const int16_t *xq, const float *unit, int m, int64_t n0,
                      int64_t n1, float *acc, int64_t ldy) {
    if (m == 1)
        rows<1>(l, offset, xq, unit, n0, n1, acc, ldy);
    else
        rows<2>(l, offset, xq, unit, n0, n1, acc, ldy);
}

}  // namespace qscheme_gguf

#else  // not x86: byte_codes_offset is -1, so nothing calls the others

#include "cpu_gemv_gguf.h"

namespace qscheme_gguf {
int byte_codes_offset(const Layout &) { return -1; }
bool bytes_words(const uint16_t *, int64_t, int16_t *, float *) { return false; }
void gemv_bytes_int16(const Layout &, int, const int16_t *, const float *, int, int64_t, int64_t, float *, int64_t) {}
}  // namespace qscheme_gguf

#endif
