// The AVX512-BF16 loop over packed blocks (cpu_gemv_gguf.h: Bf16Input), for 4-bit codes in
// sub-blocks of 32 read as nibble pairs: 64 weights (two sub-blocks) per step, their code values
// looked up as bfloat16 words (VPERMW) and multiplied by x as it is (VDPBF16PS: products exact,
// summed in float32 lanes), each sub-block's lane sums multiplied by its scale product s_g.
//
// Kind 1 (each sub-block one 16-byte window: its low nibbles are elements 0-15, its high nibbles
// 16-31): the two windows of sub-blocks s and s + 1 make one vector of 32 bytes, so that the low
// nibbles' words are [s: 0-15 | s + 1: 0-15] and the high ones' [s: 16-31 | s + 1: 16-31]; lanes
// 0-7 of both products hold sub-block s and lanes 8-15 s + 1, and one multiply by [s_s x 8 | s_s+1 x 8]
// scales both (x is stored in that order: bf16_blocks_words). Where a block
// holds one sub-block and at most 32 bytes, the two blocks come in one masked 64-byte load and VPERMB
// takes their code bytes (and an fp16 scale of each) out of it.
// Kind 2 (two windows of 16 bytes: low nibbles sub-block s, high nibbles s + 1; Q4_K): each window
// widened twice gives the same lanes, [s: 0-15 | s + 1: 0-15] and [s: 16-31 | s + 1: 16-31]; x in the
// same order.
// Kind 3 (integer codes of up to 6 bits, from one or two pieces, in sub-blocks of 16 or 32: Q2_K,
// Q3_K, Q5_0, Q5_1, Q5_K, Q6_K): 32 elements a step in their own order, each piece gathered into
// 16-bit lanes (PlaneStep), the codes' values looked up from 64 words (VPERMT2W); lanes 0-7 of a
// product are elements 0-15 and lanes 8-15 elements 16-31, so with sub-blocks of 16 one multiply by
// [s_a x 8 | s_b x 8] scales two of them. Where a piece's windows are two 32-byte runs (the K-quants),
// 64 elements a step, gathered as bytes and widened after. K-quant factors and one fp16 scale (and
// minimum) per block are read in the loop, any others formed per row first (row_products).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#define QS_GGUF_NAMESPACE qscheme_gguf_bf16
#include "bf16_words.h"
#include "cpu_gemv_gguf_kernel.h"
#include "cpu_gemv_gguf_v512.h"
#include "row_streams.h"

namespace qscheme_gguf_bf16 {

constexpr int SUB = 32;

static inline __m512 dot(__m512 sum, __m512i weights, __m512i x) {
    return _mm512_dpbf16_ps(sum, reinterpret_cast<__m512bh>(weights), reinterpret_cast<__m512bh>(x));
}

// Each of R rows' M lane sums into acc[m * ldy + n + r * step], with the minimum products (minimums + r *
// stride, one per sub-block) times the sums of x over the sub-blocks (xsum, [M][K / sub]) added in the
// layout's sign.
template <int M, int R>
static inline void store_sums(const Layout &l, const __m512 (&sum)[R][M], const float *minimums, int64_t stride,
                              const float *xsum, int64_t n, int64_t step, float *acc, int64_t ldy) {
    const int64_t subs = l.k / l.sub;
    const float sign = static_cast<float>(l.minimum_sign);
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            float total = _mm512_reduce_add_ps(sum[r][m]);
            if (l.n_minimum) total += sign * dot<V512>(minimums + r * stride, xsum + m * subs, subs);
            acc[m * ldy + n + r * step] = total;
        }
}

// A block's sub-block products of K-quant factors (in.kquant: [d, sc] and any [dmin, m], sc and m one
// integer per sub-block): the integers in one vector [sc | m], sign-extended and offset as declared,
// times [d ... | dmin ...] (each product d * sc exact, as the reference forms it).
static inline __m512 kquant_block(const Layout &l, const Bf16Input &in, const uint8_t *block) {
    const Chunk *cs = in.kquant.data();
    __m512i v = V512::and_(V512::srlv(V512::window(block + cs[0].off, cs[0]), cs[0].shift), cs[0].mask);
    for (int s = 1; s < in.kquant_depth; s++) {
        const __m512i w = V512::and_(V512::srlv(V512::window(block + cs[s].off, cs[s]), cs[s].shift), cs[s].mask);
        v = _mm512_or_si512(v, V512::sllv(w, cs[s].dest));
    }
    if (!in.kquant_plain) {
        const __m512i shift = _mm512_load_si512(in.kquant_shift);
        v = _mm512_add_epi32(_mm512_srav_epi32(_mm512_sllv_epi32(v, shift), shift), _mm512_load_si512(in.kquant_add));
    }
    if (in.kquant_halves) {
        const __m512 halves = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(block)));
        return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_load_si512(in.kquant_half_index), halves), _mm512_cvtepi32_ps(v));
    }
    const float dmin = l.n_minimum ? block_half(block, l.minimum[0].offset, Half()) : 0.0f;
    const __m512 d = _mm512_mask_blend_ps(in.kquant_minimum_lanes,
                                          _mm512_set1_ps(block_half(block, l.scale[0].offset, Half())), _mm512_set1_ps(dmin));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
}

// How a paired loop reads its factors (Bf16Input::inline_factors): not from the block (row products
// formed first), an fp16 scale, an fp16 scale and an fp16 minimum, a one-byte scale through its table.
enum Inline : int { FROM_ROW = 0, FP16_SCALE = 1, FP16_SCALE_MINIMUM = 2, BYTE_SCALE = 3 };

// Two blocks' fp16 fields (`raw`: their bytes) in the float lanes `index` names.
static inline __m512 fp16_lanes(__m512i raw, __m512i index) {
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(index, raw)));
}

// R weight rows n, n + step, ... (one from each of R streams: row_streams.h) times M rows of x (xw,
// [M][bf16_pairs(K) * 64]); acc[m * ldy + n]: row m's sums. INT: xw holds int16_blocks_words' integers,
// the code values are in.int_table's, the products VPDPWSSD's (exact 32-bit sums), each block of 4 pairs'
// sums multiplied by its unit (unit: [M][blocks]).
template <int M, int R, int KIND, bool PAIRED, int INLINE, bool INT = false>
static void rows_bf16(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                      int64_t n, int64_t step, float *acc, int64_t ldy, const float *unit = nullptr) {
    const int64_t subs = l.k / SUB, pairs = bf16_pairs(l.k), xstride = pairs * 64, unit_blocks = (pairs + 3) / 4;
    const __m512i table = _mm512_load_si512(INT ? in.int_table : in.table);
    const __m512i code_index = _mm512_load_si512(in.code_index), scale_index = _mm512_load_si512(in.scale_index);
    const __m512i minimum_index = _mm512_load_si512(in.minimum_index);
    const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __mmask64 even_bytes = 0x5555555555555555ULL;
    const __m512i nibble_shift = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 4);  // kind 2
    // per row, its sub-block scale and minimum products: formed for the whole row first (FROM_ROW),
    // or, for K-quant factors, block by block in the loop (the block's bytes then in cache; only the
    // minimum products kept, for the end)
    const bool kquant = !PAIRED && in.kquant_depth;
    thread_local std::vector<float> buffer;
    const int64_t stride = subs + 17;  // row_products may write 16 values past a row's last; one more: 0
    if (buffer.size() < static_cast<size_t>(2 * R * stride)) buffer.resize(static_cast<size_t>(2 * R * stride));
    const uint8_t *rows[R];
    const float *scales[R];
    float *minimums[R];
    const int scale_at = l.scale[0].offset;
    const float *byte_table = INLINE == BYTE_SCALE ? l.byte_tables + 256 * l.scale[0].table : nullptr;
    for (int r = 0; r < R; r++) {
        rows[r] = l.codes + (n + r * step) * l.row_bytes;
        float *s = buffer.data() + r * stride, *mn = buffer.data() + (R + r) * stride;
        minimums[r] = mn;
        if (INLINE == FROM_ROW && !kquant) {
            row_products<V512>(l, plan, rows[r], s, mn, Half());
            s[subs] = 0.0f;  // the missing half of an odd last pair: its products are zero
        }
        scales[r] = s;
    }
    __m512 sum[R][M], total[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = total[r][m] = _mm512_setzero_ps();
    // the pair's place: the block holding sub-block s0 (its bytes from the row's start) and s0's index
    // in it (groups is 1 or even: sub-blocks s0 and s0 + 1 share a block unless there is one per block)
    int64_t base = 0;
    int g0 = 0;
    __m512 products[R] = {};  // kquant: the current block's
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t s0 = 2 * p;
        const bool whole = s0 + 1 < subs;
        __m512i first[R], second[R];
        __m512 scale[R];
        if (kquant && g0 == 0)
            for (int r = 0; r < R; r++) {
                products[r] = kquant_block(l, in, rows[r] + base);
                if (l.n_minimum)
                    _mm256_storeu_ps(minimums[r] + 8 * (base / l.block_bytes), _mm512_extractf32x8_ps(products[r], 1));
            }
        for (int r = 0; r < R; r++) {
            const uint8_t *block = rows[r] + base;
            [[maybe_unused]] __m512i w;
            scale[r] = _mm512_setzero_ps();
            if constexpr (KIND == 2) {
                // each window twice, its low nibbles in words 0-15 and its high ones in 16-31:
                // [s: 0-15 | s + 1: 0-15] from the first, [s: 16-31 | s + 1: 16-31] from the second
                const uint8_t *at = block + plan.element[2 * g0].off;  // the second 16 bytes on
                auto halves = [&](const uint8_t *bytes) {
                    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes));
                    const __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(raw));
                    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(words, nibble_shift), table);
                };
                first[r] = halves(at);
                second[r] = halves(at + 16);
            } else if constexpr (PAIRED) {
                const __m512i raw = _mm512_maskz_loadu_epi8(whole ? in.mask_two : in.mask_one, block);
                w = _mm512_maskz_permutexvar_epi8(even_bytes, code_index, raw);
                if constexpr (INLINE == FP16_SCALE || INLINE == FP16_SCALE_MINIMUM)
                    scale[r] = fp16_lanes(raw, scale_index);
                if constexpr (INLINE == FP16_SCALE_MINIMUM)  // the two minimum products, for the end
                    _mm_storel_pi(reinterpret_cast<__m64 *>(minimums[r] + s0),
                                  _mm512_castps512_ps128(fp16_lanes(raw, minimum_index)));
                if constexpr (INLINE == BYTE_SCALE) {
                    const float a = byte_table[block[scale_at]], b = whole ? byte_table[block[l.block_bytes + scale_at]] : 0.0f;
                    scale[r] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
                }
            } else {  // both sub-blocks in this block (a missing last one: s0's window again, x zero)
                const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block + plan.element[2 * g0].off));
                const __m128i b = _mm_loadu_si128(
                    reinterpret_cast<const __m128i *>(block + plan.element[2 * (whole ? g0 + 1 : g0)].off));
                w = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
            }
            if constexpr (KIND == 1) {
                // the table repeats its 16 values over index bits 0-4, so the low nibble needs no mask
                first[r] = _mm512_permutexvar_epi16(w, table);
                second[r] = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
            }
            if (kquant) {
                scale[r] = _mm512_permutexvar_ps(_mm512_add_epi32(pair_lanes, _mm512_set1_epi32(g0)), products[r]);
            } else if constexpr (INLINE == FROM_ROW) {
                double two;  // scales s0 and s0 + 1
                std::memcpy(&two, scales[r] + s0, sizeof(two));
                scale[r] = _mm512_permutexvar_ps(pair_lanes, _mm512_castpd_ps(_mm512_set1_pd(two)));
            }
        }
        for (int m = 0; m < M; m++) {
            const __m512i x1 = _mm512_loadu_si512(xw + m * xstride + 64 * p);
            const __m512i x2 = _mm512_loadu_si512(xw + m * xstride + 64 * p + 32);
            for (int r = 0; r < R; r++) {
                if constexpr (INT) {
                    const __m512i d = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), first[r], x1), second[r], x2);
                    sum[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale[r], sum[r][m]);
                } else {
                    sum[r][m] = _mm512_fmadd_ps(dot(dot(_mm512_setzero_ps(), first[r], x1), second[r], x2), scale[r], sum[r][m]);
                }
            }
        }
        if constexpr (INT) {  // a block of x's integers ends: its sums times its step
            if ((p & 3) == 3 || p == pairs - 1)
                for (int m = 0; m < M; m++) {
                    const __m512 u = _mm512_set1_ps(unit[m * unit_blocks + p / 4]);
                    for (int r = 0; r < R; r++) {
                        total[r][m] = _mm512_fmadd_ps(sum[r][m], u, total[r][m]);
                        sum[r][m] = _mm512_setzero_ps();
                    }
                }
        }
        if (PAIRED) {
            base += 2 * l.block_bytes;
        } else if ((g0 += 2) >= l.groups) {
            g0 = 0;
            base += l.block_bytes;
        }
    }
    store_sums<M, R>(l, INT ? total : sum, buffer.data() + R * stride, stride, xsum, n, step, acc, ldy);
}

// Kind 2 with K-quant factors on the integer products, 128 elements a step (Bf16Input::wide): units s / s + 1
// and s + 2 / s + 3 (each 32 bytes, low nibbles one sub-block, high nibbles the next) are one 64-byte load.
// Its 32 words hold four codes each: bits 0-3 and 8-11 are elements 2j and 2j + 1 of sub-block s (words
// 0-15) or s + 2 (16-31), bits 4-7 and 12-15 those of s + 1 or s + 3, looked up (VPERMW reads five bits; the
// table is there twice) after shifts of 0, 4, 8 and 12. x comes in the same order (bf16_blocks_words), so that
// lanes 0-7 of the first and third products hold sub-block s and lanes 8-15 s + 2, of the second and fourth
// s + 1 and s + 3: two multiplies by their K-quant products scale all four. Against the pairs' loop (64
// elements a step) it loads and widens once, not four times, and converts and scales half as often.
template <int M, int R>
static void rows_wide(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                      int64_t n, int64_t step, float *acc, int64_t ldy, const float *unit) {
    const int64_t subs = l.k / SUB, xstride = bf16_pairs(l.k) * 64, unit_blocks = (bf16_pairs(l.k) + 3) / 4;
    const int64_t blocks = l.k / l.elements, steps = l.elements / 128;
    const __m512i table = _mm512_load_si512(in.int_table);
    // the sub-blocks of a step's lanes: [s x 8 | s + 2 x 8] (first and third products), then s + 1 and s + 3
    const __m512i even_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i odd_lanes = _mm512_add_epi32(even_lanes, _mm512_set1_epi32(1));
    thread_local std::vector<float> buffer;  // each row's minimum products, for the end
    const int64_t stride = subs + 17;
    if (buffer.size() < static_cast<size_t>(2 * R * stride)) buffer.resize(static_cast<size_t>(2 * R * stride));
    const uint8_t *rows[R];
    for (int r = 0; r < R; r++) rows[r] = l.codes + (n + r * step) * l.row_bytes;
    __m512 sum[R][M], total[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = total[r][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t base = b * l.block_bytes;
        __m512 products[R];
        for (int r = 0; r < R; r++) {
            for (int64_t at = 0; at < l.block_bytes; at += 64)  // 1 KiB ahead (past the row: its stream's next)
                __builtin_prefetch(rows[r] + base + at + 1024, 0, 3);
            products[r] = kquant_block(l, in, rows[r] + base);
            if (l.n_minimum)
                _mm256_storeu_ps(buffer.data() + (R + r) * stride + 8 * b, _mm512_extractf32x8_ps(products[r], 1));
        }
        for (int64_t t = 0; t < steps; t++) {
            const int64_t k0 = b * l.elements + 128 * t;
            const int off = plan.element[8 * t].off;  // unit 2t's first window; unit 2t + 1's 32 bytes on
            const __m512i first = _mm512_add_epi32(even_lanes, _mm512_set1_epi32(static_cast<int>(4 * t)));
            const __m512i second = _mm512_add_epi32(odd_lanes, _mm512_set1_epi32(static_cast<int>(4 * t)));
            for (int r = 0; r < R; r++) {
                const __m512i w = _mm512_loadu_si512(rows[r] + base + off);
                const __m512i q0 = _mm512_permutexvar_epi16(w, table);
                const __m512i q1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
                const __m512i q2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table);
                const __m512i q3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table);
                const __m512 s_first = _mm512_permutexvar_ps(first, products[r]);
                const __m512 s_second = _mm512_permutexvar_ps(second, products[r]);
                for (int m = 0; m < M; m++) {
                    const int16_t *x = xw + m * xstride + k0;
                    const __m512i a = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), q0,
                                                                              _mm512_loadu_si512(x)),
                                                          q2, _mm512_loadu_si512(x + 64));
                    const __m512i c = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), q1,
                                                                              _mm512_loadu_si512(x + 32)),
                                                          q3, _mm512_loadu_si512(x + 96));
                    sum[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s_first, sum[r][m]);
                    sum[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), s_second, sum[r][m]);
                }
            }
            if ((k0 + 128) % 256 == 0 || k0 + 128 == l.k)  // a block of x's integers ends: its sums times its step
                for (int m = 0; m < M; m++) {
                    const __m512 u = _mm512_set1_ps(unit[m * unit_blocks + k0 / 256]);
                    for (int r = 0; r < R; r++) {
                        total[r][m] = _mm512_fmadd_ps(sum[r][m], u, total[r][m]);
                        sum[r][m] = _mm512_setzero_ps();
                    }
                }
        }
    }
    store_sums<M, R>(l, total, buffer.data() + R * stride, stride, xsum, n, step, acc, ldy);
}

// How kind 3 reads a block's factors: its K-quant products in the loop (kquant_block), its one fp16
// scale (and any one fp16 minimum) in the loop, or products formed for the whole row first.
enum PlaneFactors : int { PLANE_KQUANT = 0, PLANE_HALF = 1, PLANE_ROW = 2 };

// Kind 3: R weight rows n, n + step, ... times M rows of x in their own order (xw, [M][bf16_pairs(K) * 64]);
// SUB16: sub-blocks of 16 (else 32); DEPTH: the pieces of a code (1 or 2); WIDE: 64 elements a step
// (Bf16Input::planes64), their pieces gathered as bytes and widened to words after.
template <int M, int R, bool SUB16, int DEPTH, int FACTORS, bool WIDE>
static void rows_planes(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                        int64_t n, int64_t step, float *acc, int64_t ldy) {
    const int64_t subs = l.k / l.sub, xstride = bf16_pairs(l.k) * 64, blocks = l.k / l.elements;
    constexpr int STEP = WIDE ? 64 : 32;
    const int steps = l.elements / STEP;
    const __m512i low_table = _mm512_load_si512(in.table64), high_table = _mm512_load_si512(in.table64 + 32);
    const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __mmask64 even_bytes = 0x5555555555555555ULL;
    thread_local std::vector<float> buffer;
    const int64_t stride = subs + 17;  // row_products may write 16 values past a row's last
    if (buffer.size() < static_cast<size_t>(2 * R * stride)) buffer.resize(static_cast<size_t>(2 * R * stride));
    const uint8_t *rows[R];
    const float *scales[R];
    float *minimums[R];
    for (int r = 0; r < R; r++) {
        rows[r] = l.codes + (n + r * step) * l.row_bytes;
        float *sc = buffer.data() + r * stride, *mn = buffer.data() + (R + r) * stride;
        if (FACTORS == PLANE_ROW) row_products<V512>(l, plan, rows[r], sc, mn, Half());
        scales[r] = sc;
        minimums[r] = mn;
    }
    const int groups = l.elements / l.sub;
    const __mmask16 low_lanes = static_cast<__mmask16>((1u << groups) - 1u);
    const __m512i minimum_lanes = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                   _mm512_set1_epi32(groups));
    __m512 products[R];  // the current block's factors: K-quant products, or its fp16 scale in every lane
    __m512 sum[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t base = b * l.block_bytes;
        for (int r = 0; r < R; r++) {
            const uint8_t *block = rows[r] + base;
            if constexpr (FACTORS == PLANE_KQUANT) {
                products[r] = kquant_block(l, in, block);
                if (l.n_minimum)  // the minimum products (lanes groups..2 groups - 1), for the end (not
                    _mm512_mask_storeu_ps(minimums[r] + groups * b, low_lanes,  // VCOMPRESSPS: slow on Zen 4)
                                          _mm512_permutexvar_ps(minimum_lanes, products[r]));
            } else if constexpr (FACTORS == PLANE_HALF) {
                products[r] = _mm512_set1_ps(block_half(block, l.scale[0].offset, Half()));
                if (l.n_minimum) minimums[r][b] = block_half(block, l.minimum[0].offset, Half());
            }
        }
        for (int t = 0; t < steps; t++) {
            const PlaneStep *ps = (WIDE ? in.planes64 : in.planes).data() + t * DEPTH;
            __m512i index[DEPTH], shift[DEPTH], mask[DEPTH], dest[DEPTH];
            for (int d = 0; d < DEPTH; d++) {
                index[d] = _mm512_load_si512(ps[d].index);
                shift[d] = _mm512_load_si512(ps[d].shift);
                mask[d] = _mm512_load_si512(ps[d].mask);
                dest[d] = _mm512_load_si512(ps[d].dest);
            }
            constexpr int HALVES = WIDE ? 2 : 1;  // products of 32 elements a step
            __m512i value[HALVES][R];
            for (int r = 0; r < R; r++) {
                const uint8_t *block = rows[r] + base;
                __m512i code = _mm512_setzero_si512();
                for (int d = 0; d < DEPTH; d++) {
                    __m512i w;
                    if constexpr (WIDE) {  // 32 bytes at each offset, each byte lane's byte, shift, mask, place
                        const __m512i four = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(block + ps[d].off0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i *>(block + ps[d].off1)), 1);
                        w = _mm512_permutexvar_epi8(index[d], four);
                    } else {  // the piece's two windows, each word lane's byte, shift, mask, place
                        const __m256i two = _mm256_inserti128_si256(
                            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(block + ps[d].off0))),
                            _mm_loadu_si128(reinterpret_cast<const __m128i *>(block + ps[d].off1)), 1);
                        w = _mm512_maskz_permutexvar_epi8(even_bytes, index[d], _mm512_zextsi256_si512(two));
                    }
                    w = _mm512_and_si512(_mm512_srlv_epi16(w, shift[d]), mask[d]);
                    code = _mm512_or_si512(code, _mm512_sllv_epi16(w, dest[d]));
                }
                if constexpr (WIDE) {
                    value[0][r] = _mm512_permutex2var_epi16(low_table, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(code)),
                                                            high_table);
                    value[HALVES - 1][r] = _mm512_permutex2var_epi16(
                        low_table, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(code, 1)), high_table);
                } else {
                    value[0][r] = _mm512_permutex2var_epi16(low_table, code, high_table);
                }
            }
            for (int h = 0; h < HALVES; h++) {
                const int u = HALVES * t + h;  // the product's 32 elements within the block
                __m512 scale[R];
                const int64_t g = b * groups + (SUB16 ? 2 * u : u);  // its (first) sub-block
                for (int r = 0; r < R; r++) {
                    if constexpr (FACTORS == PLANE_HALF) {
                        scale[r] = products[r];  // one sub-block per block
                    } else if constexpr (FACTORS == PLANE_KQUANT) {
                        const __m512i lanes = SUB16 ? _mm512_add_epi32(pair_lanes, _mm512_set1_epi32(2 * u)) : _mm512_set1_epi32(u);
                        scale[r] = _mm512_permutexvar_ps(lanes, products[r]);
                    } else if constexpr (SUB16) {
                        double two;  // sub-blocks g and g + 1
                        std::memcpy(&two, scales[r] + g, sizeof(two));
                        scale[r] = _mm512_permutexvar_ps(pair_lanes, _mm512_castpd_ps(_mm512_set1_pd(two)));
                    } else {
                        scale[r] = _mm512_set1_ps(scales[r][g]);
                    }
                }
                const int64_t at = b * l.elements + 32 * u;
                for (int m = 0; m < M; m++) {
                    const __m512i xv = _mm512_loadu_si512(xw + m * xstride + at);
                    for (int r = 0; r < R; r++)
                        sum[r][m] = _mm512_fmadd_ps(dot(_mm512_setzero_ps(), value[h][r], xv), scale[r], sum[r][m]);
                }
            }
        }
    }
    store_sums<M, R>(l, sum, buffer.data() + R * stride, stride, xsum, n, step, acc, ldy);
}

template <int M, bool SUB16, int DEPTH, int FACTORS, bool WIDE>
static void planes_m(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                     int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    // 4 rows at every M (at most 4): at M = 3-4 four rows ran Q6_K 1.22-1.58x, Q3_K 1.17-1.41x, Q5_0
    // 1.07-1.33x and Q5_K 1.04-1.23x faster than two (alternating builds, 4096x4096, bf16, 2 threads)
    constexpr int R = 4;
    qscheme_rows::streams<R>(n0, n1, [&](auto rows, int64_t n, int64_t step) {
        rows_planes<M, decltype(rows)::value, SUB16, DEPTH, FACTORS, WIDE>(l, plan, in, xw, xsum, n, step, acc, ldy);
    });
}

template <bool SUB16, int DEPTH, int FACTORS, bool WIDE>
static void planes_rows(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                        int m, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    switch (m) {
        case 1: return planes_m<1, SUB16, DEPTH, FACTORS, WIDE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
        case 2: return planes_m<2, SUB16, DEPTH, FACTORS, WIDE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
        case 3: return planes_m<3, SUB16, DEPTH, FACTORS, WIDE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
        default: return planes_m<4, SUB16, DEPTH, FACTORS, WIDE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
    }
}

// 64 elements a step where the layout allows it (never with an fp16 factor per block: one sub-block of
// at most 32), else 32.
template <bool SUB16, int DEPTH, int FACTORS>
static void planes_factors(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                           int m, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    if constexpr (FACTORS != PLANE_HALF) {
        if (!in.planes64.empty() && bf16_planes64_on())
            return planes_rows<SUB16, DEPTH, FACTORS, true>(l, plan, in, xw, xsum, m, n0, n1, acc, ldy);
    }
    planes_rows<SUB16, DEPTH, FACTORS, false>(l, plan, in, xw, xsum, m, n0, n1, acc, ldy);
}

template <bool SUB16, int DEPTH>
static void planes_kind(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                        int m, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    if (in.plane_factors == PLANE_KQUANT)
        planes_factors<SUB16, DEPTH, PLANE_KQUANT>(l, plan, in, xw, xsum, m, n0, n1, acc, ldy);
    else if (in.plane_factors == PLANE_HALF)
        planes_factors<SUB16, DEPTH, PLANE_HALF>(l, plan, in, xw, xsum, m, n0, n1, acc, ldy);
    else
        planes_factors<SUB16, DEPTH, PLANE_ROW>(l, plan, in, xw, xsum, m, n0, n1, acc, ldy);
}

template <int M, int KIND, bool PAIRED, int INLINE, bool INT = false>
static void rows_m(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                   int64_t n0, int64_t n1, float *acc, int64_t ldy, const float *unit = nullptr) {
    // 4 rows at every M (at most 4): at M = 3-4 four rows ran Q4_0 1.08-1.10x and IQ4_XS 1.12-1.35x faster
    // than two, Q4_K as fast (alternating builds, 4096x4096, bf16, 2 threads)
    qscheme_rows::streams<4>(n0, n1, [&](auto rows, int64_t n, int64_t step) {
        rows_bf16<M, decltype(rows)::value, KIND, PAIRED, INLINE, INT>(l, plan, in, xw, xsum, n, step, acc, ldy, unit);
    });
}

template <int M>
static void wide_m(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                   int64_t n0, int64_t n1, float *acc, int64_t ldy, const float *unit) {
    qscheme_rows::streams<4>(n0, n1, [&](auto rows, int64_t n, int64_t step) {
        rows_wide<M, decltype(rows)::value>(l, plan, in, xw, xsum, n, step, acc, ldy, unit);
    });
}

template <int KIND, bool PAIRED, int INLINE>
static void rows_kind(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *xw, const float *xsum,
                      int m, int64_t n0, int64_t n1, float *acc, int64_t ldy, const float *unit) {
    if (unit) {  // the integer products: at most INT16_BLOCK_ROWS rows of x
        if (m == 1) return rows_m<1, KIND, PAIRED, INLINE, true>(l, plan, in, xw, xsum, n0, n1, acc, ldy, unit);
        return rows_m<2, KIND, PAIRED, INLINE, true>(l, plan, in, xw, xsum, n0, n1, acc, ldy, unit);
    }
    switch (m) {
        case 1: return rows_m<1, KIND, PAIRED, INLINE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
        case 2: return rows_m<2, KIND, PAIRED, INLINE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
        case 3: return rows_m<3, KIND, PAIRED, INLINE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
        default: return rows_m<4, KIND, PAIRED, INLINE>(l, plan, in, xw, xsum, n0, n1, acc, ldy);
    }
}

}  // namespace qscheme_gguf_bf16

namespace qscheme_gguf {

// A bfloat16 word for v where v is one exactly, finite, and zero or of a magnitude in [2**-8, 2**8].
static bool value_word(float v, int16_t &word) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const float a = v < 0.0f ? -v : v;
    if ((bits & 0xFFFFu) || !(a == 0.0f || (a >= 0x1p-8f && a <= 0x1p8f))) return false;
    word = static_cast<int16_t>(bits >> 16);
    return true;
}

// Whether factors f[0..count) are one field of `format`, one value per block.
static bool one_field(const Factor *f, int count, int format) {
    return count == 1 && f[0].is_field && f[0].count == 1 && f[0].format == format;
}

// K-quant factors read in the loop (Bf16Input::kquant): [d, sc] with any [dmin, m] of the same depth,
// sc and m one integer per sub-block, at most 16 integers in all (8 sub-blocks with minimums, 16
// without). Leaves kquant_depth 0 where the layout has no such factors or their windows do not fit.
static void plan_kquant(const Layout &l, const Plan &plan, Bf16Input &in) {
    in.kquant_depth = 0;
    in.kquant.clear();
    const Factor &sc = l.scale[1], &mn = l.minimum[1];
    const int g = l.groups, count = l.n_minimum ? 2 * g : g;
    if (count > 16 || !qscheme_gguf_bf16::k_quant_products(l, plan, 16) || (l.n_minimum && sc.depth != mn.depth)) return;
    const int depth = sc.depth;
    std::vector<int32_t> slots(static_cast<size_t>(depth * 4 * count), 0);  // [sc | m]'s pieces
    for (int s = 0; s < depth; s++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < g; i++) {
                slots[(s * 4 + j) * count + i] = sc.slots[(s * 4 + j) * g + i];
                if (l.n_minimum) slots[(s * 4 + j) * count + g + i] = mn.slots[(s * 4 + j) * g + i];
            }
    for (int i = 0; i < 16; i++) {
        const Factor *f = i < g ? &sc : (l.n_minimum && i < 2 * g ? &mn : nullptr);
        in.kquant_shift[i] = f && f->is_signed ? 32 - f->bits : 0;
        in.kquant_add[i] = f ? f->add : 0;
    }
    in.kquant_minimum_lanes = l.n_minimum ? static_cast<uint16_t>(((1u << g) - 1u) << g) : 0;
    in.kquant_plain = true;
    for (int i = 0; i < 16; i++) in.kquant_plain = in.kquant_plain && !in.kquant_shift[i] && !in.kquant_add[i];
    const int d_at = l.scale[0].offset, dmin_at = l.n_minimum ? l.minimum[0].offset : d_at;
    in.kquant_halves = l.block_bytes >= 32 && d_at % 2 == 0 && d_at < 32 && dmin_at % 2 == 0 && dmin_at < 32;
    for (int i = 0; i < 16; i++) in.kquant_half_index[i] = ((in.kquant_minimum_lanes >> i) & 1 ? dmin_at : d_at) / 2;
    in.kquant = plan_windows(slots.data(), depth, count, l.block_bytes, 16);
    if (!in.kquant.empty()) in.kquant_depth = depth;
}

// Kind 3 with 64 elements a step: where each piece's four chunk windows are two runs of 32 bytes
// (chunks 1 and 3 start 16 bytes after 0 and 2) and every two neighbouring lanes share their shift
// and destination (the word shifts then serve both bytes: a code of at most 6 bits never crosses
// into the next byte). Fills in.planes64 ([elements / 64][depth]: index and mask per byte lane, shift
// and destination per word, the two runs' offsets in off0 and off1).
static bool wide_planes_fit(const Layout &l, const Plan &plan, Bf16Input &in) {
    const int depth = l.el_depth, steps = l.elements / 64;
    if (l.elements % 64) return false;
    std::vector<PlaneStep> planes(static_cast<size_t>(steps * depth));
    for (int t = 0; t < steps; t++)
        for (int d = 0; d < depth; d++) {
            const Chunk *c[4];
            for (int i = 0; i < 4; i++) c[i] = &plan.element[(4 * t + i) * depth + d];
            if (c[1]->off != c[0]->off + 16 || c[3]->off != c[2]->off + 16) return false;
            PlaneStep &st = planes[t * depth + d];
            st.off0 = c[0]->off;
            st.off1 = c[2]->off;
            uint8_t *mask = reinterpret_cast<uint8_t *>(st.mask);
            for (int e = 0; e < 64; e++) {
                const Chunk &ch = *c[e / 16];
                const int lane = e % 16, pair = lane ^ 1;
                if (ch.mask[lane] > 0xFF || ch.shift[lane] > 7 || (ch.mask[lane] << ch.dest[lane]) > 0xFF ||
                    ch.shift[lane] != ch.shift[pair] || ch.dest[lane] != ch.dest[pair])
                    return false;
                st.index[e] = static_cast<uint8_t>(16 * (e / 16) + ch.idx[lane]);
                mask[e] = static_cast<uint8_t>(ch.mask[lane]);
                st.shift[e / 2] = static_cast<int16_t>(ch.shift[lane]);
                st.dest[e / 2] = static_cast<int16_t>(ch.dest[lane]);
            }
        }
    in.planes64 = std::move(planes);
    return true;
}

// Kind 3 (see the file's head): integer codes of up to 6 bits in one or two pieces, each of which
// the plan reads as 16-byte windows, whose values are bfloat16 numbers as value_word takes them.
static bool planes_fit(const Layout &l, const Plan &plan, Bf16Input &in) {
    using namespace qscheme_gguf_bf16;
    if (plan.width != 16 || !(l.sub == 16 || l.sub == 32) || l.elements % 32 || l.el_bits > 6 || l.el_depth < 1 ||
        l.el_depth > 2 || l.el_table)
        return false;
    const int codes = 1 << l.el_bits, depth = l.el_depth, steps = l.elements / 32;
    for (int i = 0; i < 64; i++) {
        int16_t word = 0;
        if (i < codes && !value_word(l.values[i], word)) return false;
        in.table64[i] = word;
    }
    if (!wide_planes_fit(l, plan, in)) in.planes64.clear();
    in.planes.assign(static_cast<size_t>(steps * depth), PlaneStep());
    for (int t = 0; t < steps; t++)
        for (int d = 0; d < depth; d++) {
            const Chunk &a = plan.element[(2 * t) * depth + d], &b = plan.element[(2 * t + 1) * depth + d];
            PlaneStep &st = in.planes[t * depth + d];
            st.off0 = a.off;
            st.off1 = b.off;
            for (int i = 0; i < 32; i++) {
                const Chunk &c = i < 16 ? a : b;
                const int lane = i % 16;
                if (c.mask[lane] > 0xFF || c.shift[lane] > 7 || c.dest[lane] + l.el_bits > 16) return false;
                st.index[2 * i] = static_cast<uint8_t>((i < 16 ? 0 : 16) + c.idx[lane]);
                st.shift[i] = static_cast<int16_t>(c.shift[lane]);
                st.mask[i] = static_cast<int16_t>(c.mask[lane]);
                st.dest[i] = static_cast<int16_t>(c.dest[lane]);
            }
        }
    in.plane_depth = depth;
    in.kind = 3;
    plan_kquant(l, plan, in);
    // an fp16 scale (and an fp16 minimum) per block of one sub-block (Q5_0, Q5_1): read in the loop
    const bool half = l.groups == 1 && one_field(l.scale, l.n_scale, FIELD_FP16) &&
                      (!l.n_minimum || one_field(l.minimum, l.n_minimum, FIELD_FP16));
    in.plane_factors = in.kquant_depth ? PLANE_KQUANT : (half ? PLANE_HALF : PLANE_ROW);
    return true;
}

// Kinds 1 and 2 (see the file's head): 4-bit codes in sub-blocks of 32 read as nibble pairs.
static bool nibble_pairs_fit(const Layout &l, const Plan &plan, Bf16Input &in) {
    using namespace qscheme_gguf_bf16;
    if (plan.width != 16 || l.sub != SUB || l.el_depth != 1 || l.el_bits != 4 || l.k % SUB) return false;
    for (int i = 0; i < l.elements; i++)
        if (l.el_slots[2 * l.elements + i] != 0xF) return false;
    int16_t table[16];
    for (int i = 0; i < 16; i++)
        if (!value_word(l.values[i], table[i])) return false;
    for (int i = 0; i < 32; i++) in.table[i] = table[i % 16];
    in.integer = true;  // every 4-bit GGUF type: small integers (e2m1 values doubled for MXFP4)
    for (int i = 0; i < 16; i++) {
        const float v = l.values[i];
        in.integer = in.integer && v == std::nearbyint(v) && std::fabs(v) <= 127.0f;
    }
    for (int i = 0; i < 32; i++) in.int_table[i] = static_cast<int16_t>(in.integer ? l.values[i % 16] : 0.0f);
    if (l.groups != 1 && l.groups % 2) return false;  // a step: two sub-blocks of one block, or two blocks
    if (pairs_fit(l, plan, 16, 1))
        in.kind = 1;
    else if (l.groups % 2 == 0 && pairs_fit(l, plan, 16, 2))
        in.kind = 2;
    else
        return false;
    if (in.kind == 2)  // each unit's two windows adjacent: one 32-byte load
        for (int u = 0; u < l.groups / 2; u++)
            if (plan.element[4 * u + 1].off != plan.element[4 * u].off + 16) return false;
    if (l.groups == 8) plan_kquant(l, plan, in);
    // rows_wide: K-quant factors, integer code values, blocks of steps of 128 whose two units are adjacent
    in.wide = in.kind == 2 && in.kquant_depth && in.integer && l.elements % 128 == 0;
    for (int u = 0; in.wide && u + 1 < l.groups / 2; u += 2)
        in.wide = plan.element[4 * (u + 1)].off == plan.element[4 * u].off + 32;
    in.paired = in.kind == 1 && l.groups == 1;
    if (in.paired && 2 * l.block_bytes > 64) return false;  // two blocks of one sub-block: one 64-byte load
    // an fp16 scale (and an fp16 minimum) or a one-byte scale per block: read in the loop from the block
    in.inline_factors = FROM_ROW;
    if (in.paired && one_field(l.scale, l.n_scale, FIELD_FP16))
        in.inline_factors =
            !l.n_minimum ? FP16_SCALE : (one_field(l.minimum, l.n_minimum, FIELD_FP16) ? FP16_SCALE_MINIMUM : FROM_ROW);
    else if (in.paired && one_field(l.scale, l.n_scale, FIELD_TABLE) && !l.n_minimum)
        in.inline_factors = BYTE_SCALE;
    if (in.paired) {
        const int bytes = l.block_bytes, off = plan.element[0].off;
        std::memset(in.code_index, 0, sizeof(in.code_index));
        for (int j = 0; j < 16; j++) {
            in.code_index[2 * j] = static_cast<uint8_t>(off + j);
            in.code_index[2 * (16 + j)] = static_cast<uint8_t>(bytes + off + j);
        }
        // fp16 word i of a field's index: block (i < half ? s : s + 1)'s field
        auto fp16_index = [&](const Factor &f, uint8_t *index, int half) {
            std::memset(index, 0, 64);
            for (int i = 0; i < 2 * half; i++) {
                const int at = (i < half ? 0 : bytes) + f.offset;
                index[2 * i] = static_cast<uint8_t>(at);
                index[2 * i + 1] = static_cast<uint8_t>(at + 1);
            }
        };
        if (in.inline_factors == FP16_SCALE || in.inline_factors == FP16_SCALE_MINIMUM) fp16_index(l.scale[0], in.scale_index, 8);
        if (in.inline_factors == FP16_SCALE_MINIMUM) fp16_index(l.minimum[0], in.minimum_index, 1);
        in.mask_two = 2 * bytes == 64 ? ~0ULL : (1ULL << (2 * bytes)) - 1ULL;
        in.mask_one = (1ULL << bytes) - 1ULL;
    }
    return true;
}

bool bf16_planes64_on() {
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_PLANES64");
    return !(setting && setting[0] == '0');
}

bool bf16_wide_on() {
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_GGUF_WIDE");
    return !(setting && setting[0] == '0');
}

bool bf16_blocks_fits(const Layout &l, const Plan &plan, Bf16Input &in) {
    if (nibble_pairs_fit(l, plan, in)) return true;
    in = Bf16Input();
    return planes_fit(l, plan, in);
}

bool bf16_blocks_words(const uint16_t *x, int64_t k, int kind, int16_t *xq, bool wide) {
    using namespace qscheme_gguf_bf16;
    const int64_t subs = k / SUB, pairs = bf16_pairs(k);
    using qscheme_bf16_words::outside;
    __mmask32 bad = 0;
    if (wide) {  // rows_wide: per 128, the even then the odd elements of sub-blocks s and s + 2, then s + 1 and s + 3
        const __m512i evens = qscheme_bf16_words::every_other_word(0), odds = qscheme_bf16_words::every_other_word(1);
        for (int64_t c = 0; c < k; c += 128) {
            const __m512i v0 = _mm512_loadu_si512(x + c), v1 = _mm512_loadu_si512(x + c + 32);
            const __m512i v2 = _mm512_loadu_si512(x + c + 64), v3 = _mm512_loadu_si512(x + c + 96);
            bad |= outside(v0) | outside(v1) | outside(v2) | outside(v3);
            _mm512_storeu_si512(xq + c, _mm512_permutex2var_epi16(v0, evens, v2));
            _mm512_storeu_si512(xq + c + 32, _mm512_permutex2var_epi16(v1, evens, v3));
            _mm512_storeu_si512(xq + c + 64, _mm512_permutex2var_epi16(v0, odds, v2));
            _mm512_storeu_si512(xq + c + 96, _mm512_permutex2var_epi16(v1, odds, v3));
        }
        return bad == 0;
    }
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i a = _mm512_loadu_si512(x + 64 * p);
        const __m512i b = 2 * p + 1 < subs ? _mm512_loadu_si512(x + 64 * p + 32) : _mm512_setzero_si512();
        bad |= outside(a) | outside(b);
        if (kind == 3) {  // x's own order
            _mm512_storeu_si512(xq + 64 * p, a);
            _mm512_storeu_si512(xq + 64 * p + 32, b);
            continue;
        }
        // [s: 0-15 | s + 1: 0-15], then [s: 16-31 | s + 1: 16-31]
        _mm512_storeu_si512(xq + 64 * p, _mm512_shuffle_i64x2(a, b, 0x44));
        _mm512_storeu_si512(xq + 64 * p + 32, _mm512_shuffle_i64x2(a, b, 0xEE));
    }
    return bad == 0;
}

void int16_blocks_words(int16_t *xq, int64_t k, float *unit) {
    // in place; bf16_blocks_words took only zeros and magnitudes in [2**-100, 2**64]: no check needed here
    qscheme_bf16_words::integer_blocks(reinterpret_cast<const uint16_t *>(xq), bf16_pairs(k) * 64, xq, unit);
}

bool int16_blocks_on() {
    static const bool vnni = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512vnni") != 0;
    }();
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_GGUF_INT16");
    if (setting && (setting[0] == '0' || setting[0] == '1')) return vnni && setting[0] == '1';
    return vnni && qscheme_gemv::slow_bf16_dot();
}

void gemv_blocks_bf16(const Layout &l, const Plan &plan, const Bf16Input &in, const int16_t *x, const float *xsum,
                      int m, int64_t n0, int64_t n1, float *acc, int64_t ldy, const float *unit, bool wide) {
    using namespace qscheme_gguf_bf16;
    const int64_t xs_stride = l.k / l.sub;  // xsum: [m][K / sub]
    if (unit && (in.kind == 3 || !in.integer || m > INT16_BLOCK_ROWS)) unit = nullptr;  // never: the caller checks
    for (int m0 = 0; m0 < m; m0 += 4) {
        const int count = m - m0 < 4 ? m - m0 : 4;
        const int16_t *xw = x + m0 * bf16_pairs(l.k) * 64;
        const float *ss = xsum + m0 * xs_stride;
        float *ys = acc + m0 * ldy;
        if (in.kind == 3) {
            const bool two = in.plane_depth == 2;
            if (l.sub == 16)
                two ? planes_kind<true, 2>(l, plan, in, xw, ss, count, n0, n1, ys, ldy)
                    : planes_kind<true, 1>(l, plan, in, xw, ss, count, n0, n1, ys, ldy);
            else
                two ? planes_kind<false, 2>(l, plan, in, xw, ss, count, n0, n1, ys, ldy)
                    : planes_kind<false, 1>(l, plan, in, xw, ss, count, n0, n1, ys, ldy);
        } else if (in.kind == 2 && wide && unit) {
            count == 1 ? wide_m<1>(l, plan, in, xw, ss, n0, n1, ys, ldy, unit)
                       : wide_m<2>(l, plan, in, xw, ss, n0, n1, ys, ldy, unit);
        } else if (in.kind == 2)
            rows_kind<2, false, FROM_ROW>(l, plan, in, xw, ss, count, n0, n1, ys, ldy, unit);
        else if (in.inline_factors == FP16_SCALE)
            rows_kind<1, true, FP16_SCALE>(l, plan, in, xw, ss, count, n0, n1, ys, ldy, unit);
        else if (in.inline_factors == FP16_SCALE_MINIMUM)
            rows_kind<1, true, FP16_SCALE_MINIMUM>(l, plan, in, xw, ss, count, n0, n1, ys, ldy, unit);
        else if (in.inline_factors == BYTE_SCALE)
            rows_kind<1, true, BYTE_SCALE>(l, plan, in, xw, ss, count, n0, n1, ys, ldy, unit);
        else if (in.paired)
            rows_kind<1, true, FROM_ROW>(l, plan, in, xw, ss, count, n0, n1, ys, ldy, unit);
        else
            rows_kind<1, false, FROM_ROW>(l, plan, in, xw, ss, count, n0, n1, ys, ldy, unit);
    }
}

}  // namespace qscheme_gguf

#else  // not x86: never called (bf16_blocks_available is false)

#include "cpu_gemv_gguf.h"

namespace qscheme_gguf {
bool bf16_blocks_fits(const Layout &, const Plan &, Bf16Input &) { return false; }
bool bf16_planes64_on() { return false; }
bool bf16_blocks_words(const uint16_t *, int64_t, int, int16_t *, bool) { return false; }
void int16_blocks_words(int16_t *, int64_t, float *) {}
bool int16_blocks_on() { return false; }
bool bf16_wide_on() { return false; }
void gemv_blocks_bf16(const Layout &, const Plan &, const Bf16Input &, const int16_t *, const float *, int, int64_t,
                      int64_t, float *, int64_t, const float *, bool) {}
}  // namespace qscheme_gguf

#endif
