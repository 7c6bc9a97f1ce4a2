// The vector GEMV loop over packed blocks (cpu_gemv_gguf.h), written once over a vector type V and
// included by one translation unit per instruction set (cpu_gemv_gguf_avx512.cpp,
// cpu_gemv_gguf_avx2.cpp), each compiled for its ISA by a target pragma in its own namespace.
//
// V provides: W (float lanes), vec, ivec, Table, zero(), load(const float *), set1(float),
// fma(a, b, c), hsum(vec), window(bytes, const Chunk &) (W bytes of a 16-byte window, shuffled
// unless the chunk reads them in order, zero-extended to int32 lanes), srlv/sllv(ivec, const
// int32_t *), and_(ivec, const int32_t *), or_(ivec, ivec), table(const float *) (16 values),
// lut(ivec, Table), integer(ivec, shift, add) (sign-extended from 32 - shift bits when shift > 0,
// plus add, to float).
//
// A block's elements are taken W at a time ("chunks"): for each piece of the element integer
// ("slot") a chunk's W bytes lie within one 16-byte window of the block, each lane with its own
// shift, mask and destination bit (precomputed per layout: `Chunk`). Chunks never straddle a
// sub-block (sub % W == 0), so each sub-block's products are summed apart and scaled once.
#pragma once

#include <type_traits>

#include "cpu_gemv_gguf.h"
#include "row_streams.h"

namespace QS_GGUF_NAMESPACE {

using namespace qscheme_gguf;

// DEPTH 0: one slot of 4-bit codes through the table, which reads only each lane's low 4 bits
// (the mask is skipped); 8 and 9: whole bytes in order, unsigned or signed, plus the offset.
template <class V, int DEPTH, bool LUT>
static inline typename V::vec decode(const uint8_t *block, const Chunk *cs, const typename V::Table &table,
                                     int int_shift, int int_add) {
    using ivec = typename V::ivec;
    if (DEPTH == 0) return V::lut(V::srlv(V::window(block + cs[0].off, cs[0]), cs[0].shift), table);
    if (DEPTH == 8 || DEPTH == 9) return V::integer(V::bytes(block + cs[0].off, DEPTH == 9), 0, int_add);
    ivec v = V::and_(V::srlv(V::window(block + cs[0].off, cs[0]), cs[0].shift), cs[0].mask);
    for (int s = 1; s < DEPTH; s++) {
        const ivec w = V::and_(V::srlv(V::window(block + cs[s].off, cs[s]), cs[s].shift), cs[s].mask);
        v = V::or_(v, V::sllv(w, cs[s].dest));
    }
    if (LUT) return V::lut(v, table);
    return V::integer(v, int_shift, int_add);
}

// The float32 values of factor f of a block into out[count] (out padded to a multiple of W).
template <class V, class HALF>
static inline void factor_values(const Layout &l, const Plan &plan, int index, const Factor &f, const uint8_t *block,
                                 float *out, HALF half) {
    const std::vector<Chunk> &chunks = plan.factor[index];
    if (chunks.empty()) {
        for (int i = 0; i < f.count; i++) out[i] = factor_value(l, f, block, i, half);
        return;
    }
    using ivec = typename V::ivec;
    const int count = static_cast<int>(chunks.size()) / f.depth;
    const int shift = f.is_signed ? 32 - f.bits : 0;
    for (int c = 0; c < count; c++) {
        const Chunk *cs = chunks.data() + c * f.depth;
        ivec v = V::and_(V::srlv(V::window(block + cs[0].off, cs[0]), cs[0].shift), cs[0].mask);
        for (int s = 1; s < f.depth; s++) {
            const ivec w = V::and_(V::srlv(V::window(block + cs[s].off, cs[s]), cs[s].shift), cs[s].mask);
            v = V::or_(v, V::sllv(w, cs[s].dest));
        }
        V::store(out + c * V::W, V::integer(v, shift, f.add));
    }
}

template <class HALF>
static inline float block_half(const uint8_t *block, int offset, HALF half) {
    uint16_t h;
    __builtin_memcpy(&h, block + offset, 2);
    return half(h);
}

// Scales [fp16 d, integer sc] with one sc per sub-block, and a minimum of none or the same shape
// ([fp16 dmin, integer m]), the integers read by one window each (GGUF's K-quants, IQ4_XS).
inline bool k_quant_products(const Layout &l, const Plan &plan, int W) {
    auto pair_fits = [&](const Factor *f, int first) {
        return f[0].is_field && f[0].count == 1 && f[0].format == FIELD_FP16 && !f[1].is_field &&
               f[1].count == l.groups && static_cast<int>(plan.factor[first + 1].size()) == f[1].depth;
    };
    return l.groups <= W && l.n_scale == 2 && pair_fits(l.scale, 0) &&
           (l.n_minimum == 0 || (l.n_minimum == 2 && pair_fits(l.minimum, l.n_scale)));
}

// The sub-block products of a row's blocks: scale[b * groups + g] (and minimum[...] when the layout
// has one), formed as the reference decoder forms them (factors multiplied left to right).
template <class V, class HALF>
static void row_products(const Layout &l, const Plan &plan, const uint8_t *row, float *scale, float *minimum,
                         HALF half) {
    const int64_t blocks = l.k / l.elements;
    const int groups = l.groups;
    const Factor &first = l.scale[0];
    if (l.n_scale == 1 && !l.n_minimum && first.is_field && first.count == 1 && first.format == FIELD_FP16) {
        for (int64_t b = 0; b < blocks; b++) {  // one fp16 per block (Q4_0, Q8_0, IQ4_NL, ...)
            uint16_t h;
            __builtin_memcpy(&h, row + b * l.block_bytes + first.offset, 2);
            const float v = half(h);
            for (int g = 0; g < groups; g++) scale[b * groups + g] = v;
        }
        return;
    }
    if (k_quant_products(l, plan, V::W)) {  // [d, sc] (and [dmin, m]): one vector product per block
        using vec = typename V::vec;
        auto integers = [&](int index, const uint8_t *block) {
            const Factor &f = index < l.n_scale ? l.scale[index] : l.minimum[index - l.n_scale];
            const Chunk *cs = plan.factor[index].data();
            typename V::ivec v = V::and_(V::srlv(V::window(block + cs[0].off, cs[0]), cs[0].shift), cs[0].mask);
            for (int s = 1; s < f.depth; s++)
                v = V::or_(v, V::sllv(V::and_(V::srlv(V::window(block + cs[s].off, cs[s]), cs[s].shift), cs[s].mask),
                                      cs[s].dest));
            return V::integer(v, f.is_signed ? 32 - f.bits : 0, f.add);
        };
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = row + b * l.block_bytes;
            const vec s = V::mul(V::set1(block_half(block, first.offset, half)), integers(1, block));
            V::store(scale + b * groups, s);  // lanes past `groups`: overwritten by the next block
            if (l.n_minimum) {
                const vec m = V::mul(V::set1(block_half(block, l.minimum[0].offset, half)), integers(l.n_scale + 1, block));
                V::store(minimum + b * groups, m);
            }
        }
        return;
    }
    alignas(64) float values[2 * MAX_FACTORS][MAX_GROUPS + 16];
    for (int i = 0; i < l.n_scale + l.n_minimum; i++)  // lanes past a factor's count: zeros, never garbage
        for (int j = 0; j < V::W; j++) values[i][j] = 0.0f;
    bool vector_products = groups <= V::W;
    for (int i = 0; i < l.n_scale + l.n_minimum; i++) {
        const Factor &f = i < l.n_scale ? l.scale[i] : l.minimum[i - l.n_scale];
        vector_products = vector_products && (f.count == 1 || f.count == groups);
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * l.block_bytes;
        for (int i = 0; i < l.n_scale + l.n_minimum; i++) {
            const Factor &f = i < l.n_scale ? l.scale[i] : l.minimum[i - l.n_scale];
            factor_values<V>(l, plan, i, f, block, values[i], half);
        }
        for (int part = 0; part < (l.n_minimum ? 2 : 1); part++) {
            const int first_factor = part ? l.n_scale : 0, count = part ? l.n_minimum : l.n_scale;
            const Factor *factors = part ? l.minimum : l.scale;
            float *out = (part ? minimum : scale) + b * groups;
            if (vector_products) {  // every factor one value per block or one per sub-block
                auto take = [&](int f) {
                    return factors[f].count == 1 ? V::set1(values[first_factor + f][0]) : V::load(values[first_factor + f]);
                };
                typename V::vec v = take(0);
                for (int f = 1; f < count; f++) v = V::mul(v, take(f));
                V::store(out, v);  // lanes past `groups`: overwritten by the next block (rows are padded)
                continue;
            }
            for (int g = 0; g < groups; g++) {
                float v = values[first_factor][factors[0].at[g]];
                for (int f = 1; f < count; f++) v = v * values[first_factor + f][factors[f].at[g]];
                out[g] = v;
            }
        }
    }
}

// One fp16 scale field per block and nothing else (Q4_0, Q8_0, IQ4_NL, Q5_0): the scale is read
// in the loop from the block itself, with no pass over the row first.
inline bool one_half_scale(const Layout &l) {
    const Factor &f = l.scale[0];
    return l.n_scale == 1 && !l.n_minimum && l.groups == 1 && f.is_field && f.count == 1 && f.format == FIELD_FP16;
}

template <class V>
static inline float dot(const float *a, const float *b, int64_t count) {
    typename V::vec s = V::zero();
    int64_t i = 0;
    for (; i + V::W <= count; i += V::W) s = V::fma(V::load(a + i), V::load(b + i), s);
    float total = V::hsum(s);
    for (; i < count; i++) total += a[i] * b[i];
    return total;
}

// R weight rows n, n + step, ... (one from each of R streams: row_streams.h) times M rows of x;
// acc[m * ldy + n]: row m's sums.
template <class HALF, class V, int M, int R, int DEPTH, bool LUT>
static void rows_block(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int64_t n,
                       int64_t step, float *acc, int64_t ldy, const typename V::Table &table, HALF half) {
    using vec = typename V::vec;
    constexpr int W = V::W;
    const int groups = l.groups, per_group = l.sub / W;
    const int64_t blocks = l.k / l.elements, row_groups = l.k / l.sub;
    const int int_shift = l.el_signed ? 32 - l.el_bits : 0, int_add = l.el_offset;
    const Chunk *chunks = plan.element.data();
    const bool inline_scale = one_half_scale(l);
    // each row's sub-block products, formed once per call and row
    thread_local std::vector<float> buffer;
    const int64_t stride = row_groups + 16;  // row_products may write 16 values past a row's last
    if (buffer.size() < static_cast<size_t>(2 * R * stride)) buffer.resize(static_cast<size_t>(2 * R * stride));
    const float *scales[R];
    const uint8_t *rows[R];
    for (int r = 0; r < R; r++) {
        rows[r] = l.codes + (n + r * step) * l.row_bytes;
        float *s = buffer.data() + r * stride, *mn = buffer.data() + (R + r) * stride;
        if (!inline_scale) row_products<V>(l, plan, rows[r], s, mn, half);
        scales[r] = s;
    }
    vec sum[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = V::zero();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block[R];
        for (int r = 0; r < R; r++) {
            block[r] = rows[r] + b * l.block_bytes;
            // 1 KiB ahead, once per cache line the row's blocks enter
            if (((reinterpret_cast<uintptr_t>(block[r]) + 1024) & 63) < static_cast<uintptr_t>(l.block_bytes))
                __builtin_prefetch(block[r] + 1024, 0, 3);
        }
        const float *xb = x + b * l.elements;
        for (int g = 0; g < groups; g++) {
            vec part[R][M];
            for (int r = 0; r < R; r++)
                for (int m = 0; m < M; m++) part[r][m] = V::zero();
            for (int c = g * per_group; c < (g + 1) * per_group; c++) {
                vec xv[M];
                for (int m = 0; m < M; m++) xv[m] = V::load(xb + m * ldx + c * W);
                const Chunk *cs = chunks + c * (DEPTH == 0 || DEPTH >= 8 ? 1 : DEPTH);
                for (int r = 0; r < R; r++) {
                    const vec e = decode<V, DEPTH, LUT>(block[r], cs, table, int_shift, int_add);
                    for (int m = 0; m < M; m++) part[r][m] = V::fma(xv[m], e, part[r][m]);
                }
            }
            const int64_t at = b * groups + g;
            for (int r = 0; r < R; r++) {
                const vec s = V::set1(inline_scale ? block_half(block[r], l.scale[0].offset, half) : scales[r][at]);
                for (int m = 0; m < M; m++) sum[r][m] = V::fma(part[r][m], s, sum[r][m]);
            }
        }
    }
    const float sign = static_cast<float>(l.minimum_sign);
    for (int r = 0; r < R; r++) {
        const float *mn = buffer.data() + (R + r) * stride;
        for (int m = 0; m < M; m++) {
            float total = V::hsum(sum[r][m]);
            if (l.n_minimum) total += sign * dot<V>(mn, xsum + m * row_groups, row_groups);
            acc[m * ldy + n + r * step] = total;
        }
    }
}

// 4-bit codes whose chunks go in pairs reading the same 16-byte window, the first of a pair its
// low nibbles and the second its high nibbles (llama.cpp's "low nibbles first, then high"): each
// window is widened once for both. A unit is 2 * D chunks: chunks i and i + D (i < D) share a
// window; the unit is one sub-block (SAME) or the first D chunks are one sub-block and the next D
// the next one (NEXT). Rows n, n + step, ... as rows_block's.
template <class HALF, class V, int M, int R, bool NEXT, int DT>
static void rows_block_pairs(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum,
                             int64_t n, int64_t step, float *acc, int64_t ldy, const typename V::Table &table, HALF half,
                             int DR) {
    const int D = DT ? DT : DR;  // chunks per half unit: a constant where the dispatch knows it
    using vec = typename V::vec;
    using ivec = typename V::ivec;
    constexpr int W = V::W;
    const int groups = l.groups, per_group = l.sub / W, units = l.elements / W / (2 * D);
    const int64_t blocks = l.k / l.elements, row_groups = l.k / l.sub;
    const Chunk *chunks = plan.element.data();
    const bool inline_scale = one_half_scale(l);
    thread_local std::vector<float> buffer;
    const int64_t stride = row_groups + 16;
    if (buffer.size() < static_cast<size_t>(2 * R * stride)) buffer.resize(static_cast<size_t>(2 * R * stride));
    const float *scales[R];
    const uint8_t *rows[R];
    for (int r = 0; r < R; r++) {
        rows[r] = l.codes + (n + r * step) * l.row_bytes;
        float *s = buffer.data() + r * stride, *mn = buffer.data() + (R + r) * stride;
        if (!inline_scale) row_products<V>(l, plan, rows[r], s, mn, half);
        scales[r] = s;
    }
    vec sum[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = V::zero();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block[R];
        for (int r = 0; r < R; r++) {
            block[r] = rows[r] + b * l.block_bytes;
            // 1 KiB ahead, once per cache line the row's blocks enter
            if (((reinterpret_cast<uintptr_t>(block[r]) + 1024) & 63) < static_cast<uintptr_t>(l.block_bytes))
                __builtin_prefetch(block[r] + 1024, 0, 3);
        }
        const float *xb = x + b * l.elements;
        for (int u = 0; u < units; u++) {
            const int c0 = u * 2 * D, g0 = c0 / per_group;
            vec low[R][M], high[R][M];
            for (int r = 0; r < R; r++)
                for (int m = 0; m < M; m++) {
                    low[r][m] = V::zero();
                    if (NEXT) high[r][m] = V::zero();
                }
            for (int i = 0; i < D; i++) {
                const int off = chunks[c0 + i].off;
                vec xl[M], xh[M];
                for (int m = 0; m < M; m++) {
                    xl[m] = V::load(xb + m * ldx + (c0 + i) * W);
                    xh[m] = V::load(xb + m * ldx + (c0 + D + i) * W);
                }
                for (int r = 0; r < R; r++) {
                    const ivec raw = V::raw(block[r] + off);
                    const vec el = V::lut(raw, table), eh = V::lut(V::srli4(raw), table);
                    for (int m = 0; m < M; m++) {
                        low[r][m] = V::fma(xl[m], el, low[r][m]);
                        if (NEXT)
                            high[r][m] = V::fma(xh[m], eh, high[r][m]);
                        else
                            low[r][m] = V::fma(xh[m], eh, low[r][m]);
                    }
                }
            }
            const int64_t at = b * groups + g0;
            for (int r = 0; r < R; r++) {
                const vec s = V::set1(inline_scale ? block_half(block[r], l.scale[0].offset, half) : scales[r][at]);
                for (int m = 0; m < M; m++) sum[r][m] = V::fma(low[r][m], s, sum[r][m]);
                if (NEXT) {
                    const vec t = V::set1(scales[r][at + 1]);
                    for (int m = 0; m < M; m++) sum[r][m] = V::fma(high[r][m], t, sum[r][m]);
                }
            }
        }
    }
    const float sign = static_cast<float>(l.minimum_sign);
    for (int r = 0; r < R; r++) {
        const float *mn = buffer.data() + (R + r) * stride;
        for (int m = 0; m < M; m++) {
            float total = V::hsum(sum[r][m]);
            if (l.n_minimum) total += sign * dot<V>(mn, xsum + m * row_groups, row_groups);
            acc[m * ldy + n + r * step] = total;
        }
    }
}

template <class HALF, class V, int M, bool NEXT>
static void rows_pairs_m(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum,
                         int64_t n0, int64_t n1, float *acc, int64_t ldy, HALF half, int D) {
    constexpr int R = M <= 2 ? 4 : 2;
    const typename V::Table table = V::table(l.values);
    qscheme_rows::streams<R>(n0, n1, [&](auto rows_t, int64_t at, int64_t step) {
        constexpr int RR = decltype(rows_t)::value;
        switch (D) {
            case 1: return rows_block_pairs<HALF, V, M, RR, NEXT, 1>(l, plan, x, ldx, xsum, at, step, acc, ldy, table, half, D);
            case 2: return rows_block_pairs<HALF, V, M, RR, NEXT, 2>(l, plan, x, ldx, xsum, at, step, acc, ldy, table, half, D);
            case 4: return rows_block_pairs<HALF, V, M, RR, NEXT, 4>(l, plan, x, ldx, xsum, at, step, acc, ldy, table, half, D);
            default: return rows_block_pairs<HALF, V, M, RR, NEXT, 0>(l, plan, x, ldx, xsum, at, step, acc, ldy, table, half, D);
        }
    });
}

template <class HALF, class V, bool NEXT>
static void rows_pairs(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int m,
                       int64_t n0, int64_t n1, float *acc, int64_t ldy, HALF half, int D) {
    switch (m) {
        case 1: return rows_pairs_m<HALF, V, 1, NEXT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half, D);
        case 2: return rows_pairs_m<HALF, V, 2, NEXT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half, D);
        case 3: return rows_pairs_m<HALF, V, 3, NEXT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half, D);
        default: return rows_pairs_m<HALF, V, 4, NEXT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half, D);
    }
}

// Whether every unit of 2 * D chunks pairs chunk i with chunk i + D on one window, shifts 0 and 4.
inline bool pairs_fit(const Layout &l, const Plan &plan, int W, int D) {
    const int chunks = l.elements / W;
    if (D < 1 || chunks % (2 * D)) return false;
    for (int c0 = 0; c0 < chunks; c0 += 2 * D)
        for (int i = 0; i < D; i++) {
            const Chunk &a = plan.element[c0 + i], &b = plan.element[c0 + D + i];
            if (!a.ident || !b.ident || a.off != b.off) return false;
            for (int j = 0; j < W; j++)
                if (a.shift[j] != 0 || b.shift[j] != 4) return false;
        }
    return true;
}

// Whether every chunk reads W whole bytes in order (no shift, every bit, no other piece).
inline bool whole_bytes(const Layout &l, const Plan &plan, int W) {
    if (l.el_depth != 1 || l.el_bits != 8 || l.el_table) return false;
    for (const Chunk &c : plan.element) {
        if (!c.ident) return false;
        for (int j = 0; j < W; j++)
            if (c.shift[j] != 0 || c.mask[j] != 0xFF || c.dest[j] != 0) return false;
    }
    return true;
}

template <class HALF, class V, int M, int DEPTH, bool LUT>
static void rows_m(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int64_t n0,
                   int64_t n1, float *acc, int64_t ldy, HALF half) {
    constexpr int R = M <= 2 ? 4 : 2;
    const typename V::Table table = V::table(l.values);
    qscheme_rows::streams<R>(n0, n1, [&](auto rows, int64_t n, int64_t step) {
        rows_block<HALF, V, M, decltype(rows)::value, DEPTH, LUT>(l, plan, x, ldx, xsum, n, step, acc, ldy, table, half);
    });
}

template <class HALF, class V, int DEPTH, bool LUT>
static void rows_any(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int m,
                     int64_t n0, int64_t n1, float *acc, int64_t ldy, HALF half) {
    switch (m) {
        case 1: return rows_m<HALF, V, 1, DEPTH, LUT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half);
        case 2: return rows_m<HALF, V, 2, DEPTH, LUT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half);
        case 3: return rows_m<HALF, V, 3, DEPTH, LUT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half);
        default: return rows_m<HALF, V, 4, DEPTH, LUT>(l, plan, x, ldx, xsum, n0, n1, acc, ldy, half);
    }
}

// Whether the element is one 4-bit piece whose mask is the low nibble (decode's DEPTH 0).
inline bool nibble_elements(const Layout &l) {
    bool nibbles = l.el_depth == 1 && l.el_bits <= 4;
    for (int i = 0; i < l.elements && nibbles; i++) nibbles = l.el_slots[2 * l.elements + i] == 0xF;
    return nibbles;
}

template <int N>
using Int = std::integral_constant<int, N>;
template <bool B>
using Bool = std::integral_constant<bool, B>;

// f(Int<DEPTH>(), Bool<LUT>()) with the decode<V, DEPTH, LUT> instance that reads the layout's elements.
template <class V, class F>
static inline void with_element_decoder(const Layout &l, const Plan &plan, F &&f) {
    const bool lut = l.el_bits <= 4;
    switch (l.el_depth * 2 + (lut ? 1 : 0)) {
        case 3: return nibble_elements(l) ? f(Int<0>(), Bool<true>()) : f(Int<1>(), Bool<true>());
        case 2:
            if (!whole_bytes(l, plan, V::W)) return f(Int<1>(), Bool<false>());
            return l.el_signed ? f(Int<9>(), Bool<false>()) : f(Int<8>(), Bool<false>());
        case 5: return f(Int<2>(), Bool<true>());
        case 4: return f(Int<2>(), Bool<false>());
        case 7: return f(Int<3>(), Bool<true>());
        default: return f(Int<3>(), Bool<false>());
    }
}

// M rows of x in passes of at most 4 (each pass reads the weight once).
template <class V, class HALF>
static void gemv_blocks_vector(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum,
                               int m, int64_t n0, int64_t n1, float *acc, int64_t ldy, HALF half) {
    const bool nibbles = nibble_elements(l);
    const int per_group = l.sub / V::W;
    const int same = nibbles && per_group % 2 == 0 && pairs_fit(l, plan, V::W, per_group / 2) ? per_group / 2 : 0;
    const int next = nibbles && !same && l.groups % 2 == 0 && pairs_fit(l, plan, V::W, per_group) ? per_group : 0;
    const int64_t xs_stride = l.k / l.sub;
    for (int m0 = 0; m0 < m; m0 += 4) {
        const int count = m - m0 < 4 ? m - m0 : 4;
        const float *xs = x + m0 * ldx, *ss = xsum + m0 * xs_stride;
        float *ys = acc + m0 * ldy;
        if (same)
            rows_pairs<HALF, V, false>(l, plan, xs, ldx, ss, count, n0, n1, ys, ldy, half, same);
        else if (next)
            rows_pairs<HALF, V, true>(l, plan, xs, ldx, ss, count, n0, n1, ys, ldy, half, next);
        else
            with_element_decoder<V>(l, plan, [&](auto depth, auto lut) {
                rows_any<HALF, V, decltype(depth)::value, decltype(lut)::value>(l, plan, xs, ldx, ss, count, n0, n1,
                                                                               ys, ldy, half);
            });
    }
}

}  // namespace QS_GGUF_NAMESPACE
