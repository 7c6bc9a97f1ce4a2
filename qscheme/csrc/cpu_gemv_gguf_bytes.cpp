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
#include "row_streams.h"

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

// R weight rows n, n + step, ... (one from each of R streams: row_streams.h; neighbouring rows read by
// turns were 1.5x slower from memory) times M rows of x, each row's blocks prefetched 1 KiB ahead (past
// its end: into its stream's next row, the next in memory).
template <int M, int R>
void rows(const Layout &l, int offset, const int16_t *xq, const float *unit, int64_t n, int64_t step, float *acc,
          int64_t ldy) {
    const int64_t blocks = l.k / l.elements, row_bytes = l.row_bytes, block_bytes = l.block_bytes;
    const int64_t k = l.k, units = (k + 255) / 256, per_unit = 256 / l.elements;
    const int chunks = l.elements / 32, scale_offset = l.scale[0].offset;
    const uint8_t *row[R];
    for (int w = 0; w < R; w++) row[w] = l.codes + (n + w * step) * row_bytes;
    __m512 total[R][M], part[R][M];
    for (int r = 0; r < M; r++)
        for (int w = 0; w < R; w++) total[w][r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        for (int r = 0; r < M; r++)
            for (int w = 0; w < R; w++) part[w][r] = _mm512_setzero_ps();
        const int64_t last = std::min<int64_t>(blocks, (u + 1) * per_unit);
        for (int64_t b = u * per_unit; b < last; b++) {
            const uint8_t *block[R];
            __m512 scale[R];
            for (int w = 0; w < R; w++) {
                block[w] = row[w] + b * block_bytes;
                // once per cache line the row's blocks enter
                if (((reinterpret_cast<uintptr_t>(block[w]) + 1024) & 63) < static_cast<uintptr_t>(block_bytes))
                    __builtin_prefetch(block[w] + 1024, 0, 3);
                scale[w] = block_scale(block[w], scale_offset);
            }
            for (int c = 0; c < chunks; c++) {
                __m512i q[R];
                for (int w = 0; w < R; w++)
                    q[w] = _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256(reinterpret_cast<const __m256i *>(block[w] + offset + 32 * c)));
                for (int r = 0; r < M; r++) {
                    const __m512i xv = _mm512_loadu_si512(xq + r * k + b * l.elements + 32 * c);
                    for (int w = 0; w < R; w++)
                        part[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(q[w], xv)), scale[w], part[w][r]);
                }
            }
        }
        for (int r = 0; r < M; r++) {
            const __m512 unit_step = _mm512_set1_ps(unit[r * units + u]);
            for (int w = 0; w < R; w++) total[w][r] = _mm512_fmadd_ps(part[w][r], unit_step, total[w][r]);
        }
    }
    for (int r = 0; r < M; r++)
        for (int w = 0; w < R; w++) acc[r * ldy + n + w * step] = _mm512_reduce_add_ps(total[w][r]);
}

template <int M>
void rows_m(const Layout &l, int offset, const int16_t *xq, const float *unit, int64_t n0, int64_t n1, float *acc,
            int64_t ldy) {
    constexpr int R = M == 1 ? 4 : 2;  // the accumulators of R x M within the registers
    qscheme_rows::streams<R>(n0, n1, [&](auto streams, int64_t n, int64_t step) {
        rows<M, decltype(streams)::value>(l, offset, xq, unit, n, step, acc, ldy);
    });
}

}  // namespace

void gemv_bytes_int16(const Layout &l, int offset, const int16_t *xq, const float *unit, int m, int64_t n0,
                      int64_t n1, float *acc, int64_t ldy) {
    if (m == 1)
        rows_m<1>(l, offset, xq, unit, n0, n1, acc, ldy);
    else
        rows_m<2>(l, offset, xq, unit, n0, n1, acc, ldy);
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
