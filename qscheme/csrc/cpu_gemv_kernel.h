// The vector GEMV loop of qscheme._cpu_gemv, written once over a vector type V and included by
// one translation unit per instruction set (cpu_gemv_avx512.cpp, cpu_gemv_avx2.cpp), each
// compiled for its ISA by a target pragma and in its own namespace.
//
// V provides: W (float lanes), vec, zero(), load(const float *), set1(float), fma(a, b, c),
// mul, sub, pair(values) (lanes [0, W/2) values[0], the rest values[1]), pair2(a, b) (the same from two floats), hsum(vec), decode_nibbles(bytes,
// table, even, odd) (W bytes -> the W low-nibble values and the W high-nibble values, through
// the table), decode_bytes(bytes, kind) (W bytes -> W values), decode_bytes2(bytes, kind, a, b)
// (2 W bytes -> their values, the first W in a), and Table, table(const float *).
//
// Rows are taken R at a time so that each load of x serves R rows; per chunk of each row the
// codes are decoded, the zero point subtracted and the effective scale multiplied in (the
// reference's fp32 weight), then multiplied into every row of x. With one row of x and no zero
// points, the effective scale multiplies each scale group's partial sum instead (one multiply
// per group instead of one per weight; the same products, rounded in another place).
#pragma once

#include <algorithm>
#include <vector>

#include "cpu_gemv.h"
#include "row_streams.h"

namespace QS_ISA_NAMESPACE {

using namespace qscheme_gemv;

// Per-thread working memory of the loops, found once per task (a thread_local costs a call in a
// shared library): each row's float32 scales and zero points, and the byte-scale tables.
struct Scratch {
    static constexpr int SLOTS = 8;
    struct Slot {
        float values[256];
        uint64_t serial = 0, used = 0;
        uint32_t factor = 0;
    };
    std::vector<float> buffer;
    std::vector<int32_t> zeros;  // the VNNI loop's zero points of its rows
    Slot slots[SLOTS];
    uint64_t clock = 0;
};

static inline Scratch &scratch() {
    thread_local Scratch instance;
    return instance;
}

// The 256 effective values of the scale bytes for a row whose per-row factor is f: the value
// table divided (or multiplied) by f as fill_scales does element by element, computed once per
// call and factor in each thread (a fused layer's rows take a handful of factors) instead of once
// per scale. Eight tables per thread, the least recently used replaced: a block's rows (at most
// four) keep theirs valid while the block runs.
static inline const float *byte_scales(const Params &p, int64_t row, Scratch &work) {
    if (!p.row_scale) return p.scale_table;
    const float f = p.row_scale[row];
    uint32_t bits;
    __builtin_memcpy(&bits, &f, 4);
    int oldest = 0;
    for (int i = 0; i < Scratch::SLOTS; i++) {
        Scratch::Slot &slot = work.slots[i];
        if (slot.serial == p.serial && slot.factor == bits) {
            slot.used = ++work.clock;
            return slot.values;
        }
        if (slot.used < work.slots[oldest].used) oldest = i;
    }
    Scratch::Slot &slot = work.slots[oldest];
    for (int i = 0; i < 256; i++) slot.values[i] = p.row_divide ? p.scale_table[i] / f : p.scale_table[i] * f;
    slot.serial = p.serial;
    slot.factor = bits;
    slot.used = ++work.clock;
    return slot.values;
}

// Where to prefetch for byte `offset` of a row's codes, whose rows' reads run from byte `begin` to
// `end` (a block of K): 1 KiB ahead in the row, and past `end` as far into the row `later` rows
// further on (its stream's next row, row_streams.h, which reads from there next): at the end of each
// row the hardware prefetchers had nothing in flight for the next rows.
static inline const uint8_t *ahead(const Params &p, const uint8_t *row, int64_t later, int64_t offset, int64_t begin,
                                   int64_t end) {
    const int64_t target = offset + 1024;
    return target < end ? row + target : row + later * p.code_stride + begin + (target - end);
}

// One row of x, 4-bit codes in scale groups of W (NVFP4 on 16 lanes: two groups per chunk), no
// zero points: each chunk's products are summed, then multiplied by the pair of group scales.
template <class V, int R, bool BYTES>
static inline void late_pairs(const Params &p, const float *x, const uint8_t *const *codes, const float *const *scales,
                              const uint8_t *const *scale_bytes, const float *const *scale_table,
                              const typename V::Table &table, typename V::vec *sum, int64_t later) {
    using vec = typename V::vec;
    constexpr int W = V::W;
    const int64_t chunks = p.k / (2 * W);
    for (int64_t c = 0; c < chunks; c++) {
        if ((c & 3) == 0)
            for (int r = 0; r < R; r++) __builtin_prefetch(ahead(p, codes[r], later, c * W, 0, chunks * W), 0, 3);
        const vec xe = V::load(x + c * 2 * W), xo = V::load(x + c * 2 * W + W);
        for (int r = 0; r < R; r++) {
            vec even, odd;
            V::decode_nibbles(codes[r] + c * W, table, even, odd);
            const vec part = V::fma(xo, odd, V::mul(xe, even));
            const vec scale = BYTES ? V::pair2(scale_table[r][scale_bytes[r][2 * c]], scale_table[r][scale_bytes[r][2 * c + 1]])
                                    : V::pair(scales[r] + 2 * c);
            sum[r] = V::fma(part, scale, sum[r]);
        }
    }
}

// One row of x, no zero points, scale groups of whole chunks (KIND: the code kind, a constant so
// that the decode has no branch): each group's products are summed, then multiplied by the
// group's scale once. Groups are walked in order (no division per chunk).
template <class V, int R, int KIND, bool BYTES>
static inline void late_groups(const Params &p, const float *x, const uint8_t *const *codes, const float *const *scales,
                               const uint8_t *const *scale_bytes, const float *const *scale_table,
                               const typename V::Table &table, typename V::vec *sum, int64_t later) {
    using vec = typename V::vec;
    constexpr int W = V::W;
    constexpr bool NIBBLE = KIND == CODE_NIBBLE;
    constexpr int64_t CE = NIBBLE ? 2 * W : W;  // elements per chunk (W bytes either way)
    const int64_t chunks = p.k / CE, per_group = p.group_k / CE;
    for (int64_t c0 = 0, g = 0; c0 < chunks; c0 += per_group, g++) {
        const int64_t stop = c0 + per_group < chunks ? c0 + per_group : chunks;
        vec part[R];
        for (int r = 0; r < R; r++) part[r] = V::zero();
        // two vectors of codes per step (a chunk of 4-bit codes: its low and high nibbles; two chunks
        // of bytes, which decode_bytes2 may widen together), then a last chunk of bytes alone
        constexpr int64_t PER = NIBBLE ? 1 : 2;  // chunks per step
        int64_t c = c0;
        for (; c + PER <= stop; c += PER) {
            if (((c * W) & 63) < PER * W)  // once per cache line of each row
                for (int r = 0; r < R; r++) __builtin_prefetch(ahead(p, codes[r], later, c * W, 0, chunks * W), 0, 3);
            const vec xa = V::load(x + c * CE), xb = V::load(x + c * CE + W);
            for (int r = 0; r < R; r++) {
                vec a, b;
                if (NIBBLE)
                    V::decode_nibbles(codes[r] + c * W, table, a, b);
                else
                    V::decode_bytes2(codes[r] + c * W, KIND, a, b);
                part[r] = V::fma(xa, a, part[r]);
                part[r] = V::fma(xb, b, part[r]);
            }
        }
        if (!NIBBLE && c < stop) {
            const vec xv = V::load(x + c * CE);
            for (int r = 0; r < R; r++) part[r] = V::fma(xv, V::decode_bytes(codes[r] + c * W, KIND), part[r]);
        }
        for (int r = 0; r < R; r++)
            sum[r] = V::fma(part[r], V::set1(BYTES ? scale_table[r][scale_bytes[r][g]] : scales[r][g]), sum[r]);
    }
}

template <class V, int R, int KIND>
static inline void late_groups_any(const Params &p, const float *x, const uint8_t *const *codes,
                                   const float *const *scales, const uint8_t *const *scale_bytes,
                                   const float *const *scale_table, const typename V::Table &table,
                                   typename V::vec *sum, int64_t later) {
    if (p.scale_kind == SCALE_BYTE)
        late_groups<V, R, KIND, true>(p, x, codes, scales, scale_bytes, scale_table, table, sum, later);
    else
        late_groups<V, R, KIND, false>(p, x, codes, scales, scale_bytes, scale_table, table, sum, later);
}

// Rows n, n + step, ... (R of them, one from each of R streams: row_streams.h) over chunks
// [c_begin, c_end) of K, added into acc (M = 1: the whole of K).
template <class V, int M, int R, bool NIBBLE, bool ZERO>
static inline void rows_block(const Params &p, const float *x, int64_t ldx, int64_t n, int64_t step, float *acc,
                              int64_t ldy, const typename V::Table &table, int64_t c_begin, int64_t c_end,
                              Scratch &work) {
    const int64_t later = qscheme_rows::stream_next<R>(step);  // rows to this row's stream's next
    using vec = typename V::vec;
    constexpr int W = V::W;
    constexpr int64_t CE = NIBBLE ? 2 * W : W;  // elements per chunk
    const bool split = NIBBLE && p.group_k == W;  // two scale groups per chunk (NVFP4 on 16 lanes)
    const int64_t per_group = split ? 1 : p.group_k / CE;  // chunks per scale group (>= 1)
    const int64_t g_first = split ? 2 * c_begin : c_begin / per_group;
    const int64_t g_last = split ? 2 * c_end : (c_end + per_group - 1) / per_group;
    // one row of x without zero points: scales multiply each group's partial sums, not each weight
    constexpr bool LATE = M == 1 && !ZERO;
    vec sum[R][M];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) sum[r][m] = V::zero();
    const uint8_t *codes[R];
    const float *scales[R], *zeros[R];
    // each row's effective scales (and zero points) as float32, decoded once per call and row
    std::vector<float> &buffer = work.buffer;
    const int64_t cols = p.scale_cols;
    if (buffer.size() < static_cast<size_t>(2 * R * cols)) buffer.resize(static_cast<size_t>(2 * R * cols));
    // byte scales (NVFP4's e4m3, MXFP4's e8m0) are looked up group by group in the row's table
    // (a scalar loop over every scale of the row first cost NVFP4 a quarter of its time)
    const bool byte_scale = p.scale_kind == SCALE_BYTE;
    const uint8_t *scale_bytes[R];
    const float *scale_table[R];
    for (int r = 0; r < R; r++) {
        codes[r] = p.codes + (n + r * step) * p.code_stride;
        float *sr = buffer.data() + r * cols, *zr = buffer.data() + (R + r) * cols;
        if (byte_scale) {
            scale_bytes[r] = static_cast<const uint8_t *>(p.scale) + scale_row_base(p, n + r * step);
            scale_table[r] = byte_scales(p, n + r * step, work);
        } else {
            fill_scales(p, n + r * step, sr, g_first, g_last);
        }
        scales[r] = sr;
        zeros[r] = zr;
        if (ZERO) {
            const int16_t *z = p.zero + scale_row_base(p, n + r * step);
            for (int64_t g = g_first; g < g_last && g < cols; g++) zr[g] = static_cast<float>(z[g]);
        }
    }
    if (LATE) {
        vec late[R];
        for (int r = 0; r < R; r++) late[r] = V::zero();
        if (split && byte_scale)
            late_pairs<V, R, true>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        else if (split)
            late_pairs<V, R, false>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        else if (NIBBLE)
            late_groups_any<V, R, CODE_NIBBLE>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        else if (p.code_kind == CODE_E4M3)
            late_groups_any<V, R, CODE_E4M3>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        else if (p.code_kind == CODE_E4M3_X256)
            late_groups_any<V, R, CODE_E4M3_X256>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        else if (p.code_kind == CODE_INT8)
            late_groups_any<V, R, CODE_INT8>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        else
            late_groups_any<V, R, CODE_UINT8>(p, x, codes, scales, scale_bytes, scale_table, table, late, later);
        for (int r = 0; r < R; r++) acc[n + r * step] = V::hsum(late[r]);
        return;
    }
    for (int64_t c = c_begin, group = g_first; c < c_end; group += split ? 2 : 1) {  // groups in order
        const int64_t stop = split ? c + 1 : ((group + 1) * per_group < c_end ? (group + 1) * per_group : c_end);
        vec scale[R], zero[R];
        for (int r = 0; r < R; r++) {
            if (split) {
                scale[r] = byte_scale ? V::pair2(scale_table[r][scale_bytes[r][group]], scale_table[r][scale_bytes[r][group + 1]])
                                      : V::pair(scales[r] + group);
                if (ZERO) zero[r] = V::pair(zeros[r] + group);
            } else {
                scale[r] = V::set1(byte_scale ? scale_table[r][scale_bytes[r][group]] : scales[r][group]);
                if (ZERO) zero[r] = V::set1(zeros[r][group]);
            }
        }
        for (; c < stop; c++) {
            if ((c & 3) == 0)
                for (int r = 0; r < R; r++)
                    __builtin_prefetch(ahead(p, codes[r], later, c * W, c_begin * W, c_end * W), 0, 3);
            if (NIBBLE) {
                vec xe[M], xo[M];
                for (int m = 0; m < M; m++) {
                    xe[m] = V::load(x + m * ldx + c * CE);
                    xo[m] = V::load(x + m * ldx + c * CE + W);
                }
                for (int r = 0; r < R; r++) {
                    vec even, odd;
                    V::decode_nibbles(codes[r] + c * W, table, even, odd);
                    if (ZERO) {
                        even = V::sub(even, zero[r]);
                        odd = V::sub(odd, zero[r]);
                    }
                    even = V::mul(even, scale[r]);
                    odd = V::mul(odd, scale[r]);
                    for (int m = 0; m < M; m++) {
                        sum[r][m] = V::fma(xe[m], even, sum[r][m]);
                        sum[r][m] = V::fma(xo[m], odd, sum[r][m]);
                    }
                }
            } else {
                vec xv[M];
                for (int m = 0; m < M; m++) xv[m] = V::load(x + m * ldx + c * CE);
                for (int r = 0; r < R; r++) {
                    vec w = V::decode_bytes(codes[r] + c * W, p.code_kind);
                    if (ZERO) w = V::sub(w, zero[r]);
                    w = V::mul(w, scale[r]);
                    for (int m = 0; m < M; m++) sum[r][m] = V::fma(xv[m], w, sum[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[m * ldy + n + r * step] += V::hsum(sum[r][m]);
}

template <class V, int M, bool NIBBLE, bool ZERO>
static void rows_m(const Params &p, const float *x, int64_t ldx, int64_t n0, int64_t n1, float *acc, int64_t ldy) {
    constexpr int R = M <= 4 ? 4 : 1;  // M = 3-4: 4 rows (2 were 15-35% slower), M > 4: one
    const typename V::Table table = V::table(p.lut);
    Scratch &work = scratch();
    constexpr int64_t CE = NIBBLE ? 2 * V::W : V::W;
    const int64_t chunks = p.k / CE;
    // Several rows of x: K in blocks whose slice of x (M rows) stays in L1 (24 KiB) while the rows
    // pass over it; whole, M rows of x were read from L2 again for every R rows of the weight
    // (M = 4, K = 4096: 64 KiB, 2x the time). One row of x: all of K (16 KiB at K = 4096).
    const int64_t block = M == 1 ? chunks : std::max<int64_t>(1, 6144 / M / CE);
    for (int64_t c = 0; c < chunks; c += block) {
        const int64_t stop = std::min(chunks, c + block);
        qscheme_rows::streams<R>(n0, n1, [&](auto rows, int64_t n, int64_t step) {
            rows_block<V, M, decltype(rows)::value, NIBBLE, ZERO>(p, x, ldx, n, step, acc, ldy, table, c, stop, work);
        });
    }
}

template <class V, bool NIBBLE, bool ZERO>
static void rows_any(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                     int64_t ldy) {
    switch (m) {
        case 1: return rows_m<V, 1, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 2: return rows_m<V, 2, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 3: return rows_m<V, 3, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 4: return rows_m<V, 4, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 5: return rows_m<V, 5, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 6: return rows_m<V, 6, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        case 7: return rows_m<V, 7, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
        default: return rows_m<V, 8, NIBBLE, ZERO>(p, x, ldx, n0, n1, acc, ldy);
    }
}

// M rows of x in blocks of at most 8 (each block reads the weight once).
template <class V>
static void gemv_vector(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                        int64_t ldy) {
    const bool nibble = p.code_kind == CODE_NIBBLE, zero = p.zero != nullptr;
    for (int m0 = 0; m0 < m; m0 += 8) {
        const int count = m - m0 < 8 ? m - m0 : 8;
        const float *xs = x + m0 * ldx;
        float *ys = acc + m0 * ldy;
        if (nibble)
            zero ? rows_any<V, true, true>(p, xs, ldx, count, n0, n1, ys, ldy)
                 : rows_any<V, true, false>(p, xs, ldx, count, n0, n1, ys, ldy);
        else
            zero ? rows_any<V, false, true>(p, xs, ldx, count, n0, n1, ys, ldy)
                 : rows_any<V, false, false>(p, xs, ldx, count, n0, n1, ys, ldy);
    }
}

}  // namespace QS_ISA_NAMESPACE
