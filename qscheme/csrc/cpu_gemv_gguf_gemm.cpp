// The fused GEMM over packed blocks on AVX-512 BF16 (cpu_gemv_gguf.h: gemm_blocks_bf16), dequant_gemm's
// kernel for many rows of x (prefill) on GGUF's types and any other `packing: blocks` declaration.
//
// A task takes 32 weight rows. For each chunk of K (whole blocks, about 4096 columns) it decodes the
// rows into a bfloat16 panel that stays in the core's cache, then multiplies the panel by every row
// of x: on the AMX tiles where the CPU has them (amx_panel.h, x packed once per call into the tiles'
// pair layout), else with VDPBF16PS dot products (tile_gemm_bf16_kernel.h; both as the canonical
// tensors' fused GEMM does). Each
// weight is the value qscheme's block decoder forms (the sub-block's scale product times the
// element's value, then its minimum product subtracted or added: one float32 rounding each, written
// with the rounding-mode intrinsics so that the compiler fuses no multiply-add), rounded once to
// bfloat16 (to nearest even, VCVTNE2PS2BF16: a float32 subnormal becomes zero, as VDPBF16PS would
// read a bfloat16 subnormal). Products of bfloat16 values are exact in float32 and summed in float32;
// the output is rounded once to bfloat16, a float32 bias added first. The weight is never stored
// whole: a thread holds one panel (32 x ~4096 bfloat16) and its float32 sums.
//
// Two decoders fill the panel, each templated on what varies per layout so that its loop is tight
// (measured on Zen 4: a loop that read its options per block decoded 2-3x slower):
// - codes of at most 4 bits from one piece (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS, MXFP4, Q2_K): 32 weights
//   at a time as 16-bit lanes, each looked up (VPERMW) from 32 bfloat16 words formed per sub-block
//   from the 16 code values (WordPair);
// - integer codes of two or three pieces, each piece a run of bytes in order with one shift and mask
//   per 16 codes (Q3_K, Q5_K, Q6_K) or single bits picked per lane (Q5_0's and Q5_1's fifth bits): 32
//   codes at a time assembled as bytes (RunPair), widened to float32 16 at a time, times the scale
//   product (and the minimum): decode 1.4-1.6x faster than the element decoder (Q6_K 0.19 -> 0.12 ns,
//   Q5_0 0.19 -> 0.12 ns a weight on one Zen 4 core);
// - any other element (Q8_0's bytes; layouts that fit neither form): the vector loops' element decode,
//   16 at a time, times the scale product (and the minimum), two chunks rounded together.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c")
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#define QS_GGUF_NAMESPACE qscheme_gguf_gemm
#include "cpu_gemv_gguf_kernel.h"
#include "amx_panel.h"
#include "cpu_gemv_gguf_v512.h"
#include "tile_gemm_bf16_kernel.h"

namespace qscheme_gguf_gemm {

constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
constexpr int64_t PANEL_ROWS = 32;
constexpr int64_t PANEL_PAD = 32;  // words past a panel row, so that rows are not a power of two apart

struct Buffers {
    std::vector<uint16_t> panel;
    std::vector<float> acc, scale, minimum;
    template <class T>
    static T *fit(std::vector<T> &v, int64_t count) {
        if (v.size() < static_cast<size_t>(count)) v.resize(static_cast<size_t>(count));
        return v.data();
    }
    void release() {  // buffers above 1 MiB in all are not kept between calls
        if (2 * panel.size() + 4 * (acc.size() + scale.size() + minimum.size()) > (size_t(1) << 20)) {
            std::vector<uint16_t>().swap(panel);
            std::vector<float>().swap(acc);
            std::vector<float>().swap(scale);
            std::vector<float>().swap(minimum);
        }
    }
};

thread_local Buffers buffers;

// Whether each block holds one sub-block, scaled by one fp16 field and offset by at most one more
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): then the decoders read both as they reach the block, instead
// of forming the row's products first.
inline bool block_halves(const Layout &l) {
    auto half_field = [](const Factor &f) { return f.is_field && f.count == 1 && f.format == FIELD_FP16; };
    return l.groups == 1 && l.n_scale == 1 && half_field(l.scale[0]) &&
           (l.n_minimum == 0 || (l.n_minimum == 1 && half_field(l.minimum[0])));
}

// Sub-block g's scale product and signed minimum product (the minimum negated where it is subtracted:
// w - m and w + (-m) round alike) of block b: read from the block (HALVES) or from the row's products.
// The layout's fields are copied in: the panel's stores (through a vector type that may alias anything)
// would otherwise make the compiler read them again after each one.
template <bool HALVES, bool MIN>
struct Factors {
    const float *scale, *minimum;
    float sign;
    int scale_offset, minimum_offset, groups;
    float s = 0.0f, m = 0.0f;
    const float *sb = nullptr, *mb = nullptr;
    Factors(const Layout &l, const float *scale_, const float *minimum_)
        : scale(scale_),
          minimum(minimum_),
          sign(l.minimum_sign < 0 ? -1.0f : 1.0f),
          scale_offset(l.n_scale ? l.scale[0].offset : 0),
          minimum_offset(l.n_minimum ? l.minimum[0].offset : 0),
          groups(l.groups) {}
    inline void block(const uint8_t *bytes, int64_t b) {
        if (HALVES) {
            s = block_half(bytes, scale_offset, Half());
            if (MIN) m = sign * block_half(bytes, minimum_offset, Half());
        } else {
            sb = scale + b * groups;
            mb = minimum + b * groups;
        }
    }
    // values times sub-block g's scale product, plus its signed minimum product
    inline __m512 apply(__m512 values, int g) const {
        __m512 w = _mm512_mul_round_ps(values, _mm512_set1_ps(HALVES ? s : sb[g]), ROUND);
        if (MIN) w = _mm512_add_round_ps(w, _mm512_set1_ps(HALVES ? m : sign * mb[g]), ROUND);
        return w;
    }
};

// Two chunks of 16 codes of at most 4 bits (one piece each) as 32 word lanes, each the index of its
// weight in a table of 32 words.
struct alignas(64) WordPair {
    int16_t shift[32] = {}, keep[32] = {}, upper[32] = {};  // per lane: right shift, mask, 16 for the second table
    alignas(16) uint8_t idx0[16] = {}, idx1[16] = {};
    int off0 = 0, off1 = 0;
    int form = 2;  // 0: one 16-byte window twice, 1: one 32-byte run, 2: two windows, each shuffled unless in order
    int ident0 = 1, ident1 = 1, g0 = 0, g1 = 0;
    bool mask = false;  // lanes need their mask (and the upper table's 16)
};

// The layout's chunks in pairs (a block's elements are a multiple of 32), where its codes are of at
// most 4 bits from one piece in sub-blocks of a multiple of 16; false (and no pairs) otherwise. With
// sub-blocks of 32 or more both chunks of a pair are one sub-block's: the table is its 16 values
// twice over, and 4-bit codes need no mask (a lane's fifth bit picks the same value). With sub-blocks
// of 16, a pair is two sub-blocks: the table is both, and each lane is masked and the second chunk's
// lanes moved to the upper half.
bool word_pairs(const Layout &l, const Plan &plan, std::vector<WordPair> &pairs) {
    pairs.clear();
    if (!(l.el_depth == 1 && l.el_bits <= 4) || l.elements % 32 || l.sub % 16) return false;
    const int chunks = l.elements / 16, per_group = l.sub / 16;
    pairs.assign(static_cast<size_t>(chunks / 2), WordPair());
    for (int c = 0; c < chunks; c += 2) {
        const Chunk &a = plan.element[c], &b = plan.element[c + 1];
        WordPair &p = pairs[c / 2];
        p.off0 = a.off;
        p.off1 = b.off;
        p.ident0 = a.ident;
        p.ident1 = b.ident;
        std::memcpy(p.idx0, a.idx, 16);
        std::memcpy(p.idx1, b.idx, 16);
        p.form = a.ident && b.ident && b.off == a.off ? 0 : (a.ident && b.ident && b.off == a.off + 16 ? 1 : 2);
        p.g0 = c / per_group;
        p.g1 = (c + 1) / per_group;
        bool nibbles = true;
        for (int i = 0; i < 16; i++) {
            p.shift[i] = static_cast<int16_t>(a.shift[i]);
            p.shift[16 + i] = static_cast<int16_t>(b.shift[i]);
            p.keep[i] = static_cast<int16_t>(a.mask[i]);
            p.keep[16 + i] = static_cast<int16_t>(b.mask[i]);
            p.upper[16 + i] = p.g1 != p.g0 ? 16 : 0;
            nibbles = nibbles && a.mask[i] == 0xF && b.mask[i] == 0xF && a.shift[i] <= 4 && b.shift[i] <= 4;
        }
        p.mask = p.g1 != p.g0 || !nibbles;
    }
    return true;
}

template <int FORM, bool MASK>
static inline __m512i pair_indices(const uint8_t *block, const WordPair &p) {
    __m256i bytes;
    if (FORM == 0) {
        bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(block + p.off0)));
    } else if (FORM == 1) {
        bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(block + p.off0));
    } else {
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block + p.off0));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block + p.off1));
        if (!p.ident0) a = _mm_shuffle_epi8(a, _mm_load_si128(reinterpret_cast<const __m128i *>(p.idx0)));
        if (!p.ident1) b = _mm_shuffle_epi8(b, _mm_load_si128(reinterpret_cast<const __m128i *>(p.idx1)));
        bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    }
    __m512i words = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(bytes), _mm512_load_si512(p.shift));
    if (MASK)  // (words & keep) | upper
        words = _mm512_ternarylogic_epi32(words, _mm512_load_si512(p.keep), _mm512_load_si512(p.upper), 0xEA);
    return words;
}

// What both decoders share: rows [n, n + count) of the layer, blocks [b0, b0 + l.k / elements) of each
// (l: the layer with k set to the chunk's columns), into panel rows `pitch` words apart; scale,
// minimum: room for the chunk's sub-block products (+ 16 floats). decode(block, factors, out) writes
// one block's weights.
template <bool HALVES, bool MIN, class Decode>
static inline void panel_rows(const Layout &l, const Plan &plan, int64_t n, int64_t count, int64_t b0, uint16_t *panel,
                              int64_t pitch, float *scale, float *minimum, Decode decode) {
    // the layout's fields as locals (see Factors)
    const int64_t blocks = l.k / l.elements, row_bytes = l.row_bytes, block_bytes = l.block_bytes;
    const int64_t elements = l.elements;
    const uint8_t *codes = l.codes;
    Factors<HALVES, MIN> f(l, scale, minimum);
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *row = codes + (n + r) * row_bytes + b0 * block_bytes;
        if (!HALVES) row_products<V512>(l, plan, row, scale, minimum, Half());
        uint16_t *out = panel + r * pitch;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = row + b * block_bytes;
            if (!HALVES)  // the next row's products start with its first bytes: fetch them meanwhile
                for (int64_t at = 0; at < block_bytes; at += 64)
                    _mm_prefetch(reinterpret_cast<const char *>(block + row_bytes + at), _MM_HINT_T0);
            f.block(block, b);
            decode(block, f, out + b * elements);
        }
    }
}

template <int FORM, bool TWO, bool MASK, bool HALVES, bool MIN>
void panel_words(const Layout &l, const Plan &plan, const std::vector<WordPair> &pairs, int64_t n, int64_t count,
                 int64_t b0, uint16_t *panel, int64_t pitch, float *scale, float *minimum) {
    const __m512 values = _mm512_loadu_ps(l.values);
    const WordPair *ps = pairs.data();
    const int steps = static_cast<int>(pairs.size());
    panel_rows<HALVES, MIN>(l, plan, n, count, b0, panel, pitch, scale, minimum,
                            [&](const uint8_t *block, const Factors<HALVES, MIN> &f, uint16_t *out) {
                                for (int i = 0; i < steps; i++) {
                                    const WordPair &p = ps[i];
                                    const __m512 first = f.apply(values, p.g0);
                                    const __m512 second = TWO ? f.apply(values, p.g1) : first;
                                    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(second, first);
                                    const __m512i index = pair_indices<FORM, MASK>(block, p);
                                    _mm512_storeu_si512(out + 32 * i, _mm512_permutexvar_epi16(index, table));
                                }
                            });
}

template <int DEPTH, bool LUT, bool HALVES, bool MIN>
void panel_elements(const Layout &l, const Plan &plan, int64_t n, int64_t count, int64_t b0, uint16_t *panel,
                    int64_t pitch, float *scale, float *minimum) {
    using V = V512;
    const V::Table table = V::table(l.values);
    const int int_shift = l.el_signed ? 32 - l.el_bits : 0, int_add = l.el_offset;
    const int per_group = l.sub / V::W, chunks = l.elements / V::W;
    const Chunk *plan_chunks = plan.element.data();
    constexpr int SLOTS = DEPTH == 0 || DEPTH >= 8 ? 1 : DEPTH;
    panel_rows<HALVES, MIN>(l, plan, n, count, b0, panel, pitch, scale, minimum,
                            [&](const uint8_t *block, const Factors<HALVES, MIN> &f, uint16_t *out) {
                                for (int c = 0; c < chunks; c += 2) {  // chunks of 16 in pairs
                                    const __m512 e0 = decode<V, DEPTH, LUT>(block, plan_chunks + c * SLOTS, table,
                                                                            int_shift, int_add);
                                    const __m512 e1 = decode<V, DEPTH, LUT>(block, plan_chunks + (c + 1) * SLOTS,
                                                                            table, int_shift, int_add);
                                    const __m512 w0 = f.apply(e0, c / per_group), w1 = f.apply(e1, (c + 1) / per_group);
                                    _mm512_storeu_si512(out + c * V::W, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                                }
                            });
}

// Integer codes of two or three pieces, 64 at a time, where every piece of a step of 64 elements is one
// run of bytes in order: 64 bytes, or 32 bytes read for both halves (Q6_K's low nibbles are runs of 64
// and its high bits runs of 32; Q3_K's and Q5_K's pieces runs of 32). Each piece's bits are moved to
// their place with one rotation per 64-bit lane (a lane's eight bytes share a shift, so each byte's
// bits stay within the byte) and kept with one mask, so that a step of 64 codes costs two operations a
// piece instead of the runs' decoder's four per 32 codes. Codes and their offset (and sign) are then
// formed as bytes, which holds where every value fits a signed byte.
struct alignas(64) RunStep {
    uint64_t rot[MAX_DEPTH][8];
    uint8_t mask[MAX_DEPTH][64];
    int off[MAX_DEPTH];
    int g[4];
};

struct Run64Plan {
    std::vector<RunStep> steps;
    int forms = 0;          // bit s: piece s is a run of 64 bytes (else 32 read twice)
    int8_t flip = 0, add = 0;  // value = (code ^ flip) + add, as signed bytes
};

Run64Plan run64_plan(const Layout &l) {
    Run64Plan none, found;
    const int depth = l.el_depth, count = l.elements;
    if (l.el_table || depth < 2 || depth > 3 || l.el_bits > 8 || count % 64 || l.sub % 16 || !l.el_slots) return none;
    // the codes' values as signed bytes
    const int bits = l.el_bits, lo = (l.el_signed ? -(1 << (bits - 1)) : 0) + l.el_offset;
    const int hi = (l.el_signed ? (1 << (bits - 1)) - 1 : (1 << bits) - 1) + l.el_offset;
    if (lo < -128 || hi > 127) return none;
    const int flip = l.el_signed ? 1 << (bits - 1) : 0;
    found.flip = static_cast<int8_t>(static_cast<uint8_t>(flip));
    found.add = static_cast<int8_t>(static_cast<uint8_t>((l.el_offset - flip) & 0xFF));  // bytes add modulo 256
    found.steps.resize(static_cast<size_t>(count / 64));
    const int per_group = l.sub / 16;
    for (int s = 0; s < depth; s++) {
        const int32_t *byte = l.el_slots + s * 4 * count, *shift = byte + count, *mask = shift + count,
                      *dest = mask + count;
        int form = -1;
        for (int st = 0; st < count / 64; st++) {
            RunStep &step = found.steps[static_cast<size_t>(st)];
            const int e0 = 64 * st, off = byte[e0];
            // a run of 64 bytes, else of 32 read for both halves
            auto run = [&](int length) {
                for (int i = 0; i < 64; i++)
                    if (byte[e0 + i] != off + i % length) return false;
                return true;
            };
            const int here = run(64) ? 1 : (run(32) ? 0 : -1);
            if (here < 0) return none;
            if (form >= 0 && here != form) return none;
            form = here;
            step.off[s] = off;
            for (int q = 0; q < 8; q++) {
                const int sh = shift[e0 + 8 * q], ds = dest[e0 + 8 * q];
                for (int i = 8 * q; i < 8 * q + 8; i++) {
                    const int m = mask[e0 + i];
                    if (shift[e0 + i] != sh || dest[e0 + i] != ds || m <= 0 || sh < 0 || ds < 0 || m > (0xFF >> sh) ||
                        (m << ds) > 0xFF)
                        return none;
                    step.mask[s][i] = static_cast<uint8_t>(m << ds);
                }
                step.rot[s][q] = static_cast<uint64_t>((ds - sh + 64) % 64);
            }
            if (s == 0)
                for (int j = 0; j < 4; j++) step.g[j] = (4 * st + j) / per_group;
        }
        found.forms |= form << s;
    }
    if (depth == 3 && found.forms != 0) return none;  // three pieces: runs of 32 only (decode_panel)
    return found;
}

template <int FORM>
static inline __m512i run_piece(const uint8_t *block, const RunStep &p, int s) {
    const __m512i bytes =
        FORM ? _mm512_loadu_si512(block + p.off[s])
             : _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(block + p.off[s])));
    return _mm512_rolv_epi64(bytes, _mm512_load_si512(p.rot[s]));
}

template <int DEPTH, int FORMS, bool HALVES, bool MIN>
void panel_run64(const Layout &l, const Plan &plan, const Run64Plan &runs, int64_t n, int64_t count, int64_t b0,
                 uint16_t *panel, int64_t pitch, float *scale, float *minimum) {
    const RunStep *ps = runs.steps.data();
    const int steps = static_cast<int>(runs.steps.size());
    const __m512i flip = _mm512_set1_epi8(runs.flip);
    const bool flips = runs.flip != 0;
    // each value plus 128 as an unsigned byte, moved into the low byte of 2**23's float32 bits (one byte
    // permute per 16 elements, VPERMB, the other bytes kept), then 2**23 + 128 subtracted: exact
    const __m512i add = _mm512_set1_epi8(static_cast<char>(runs.add + 128));
    const __m512i magic = _mm512_set1_epi32(0x4B000000);
    const __m512 unbias = _mm512_set1_ps(8388608.0f + 128.0f);
    alignas(64) uint8_t index[4][64] = {};
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 16; i++) index[j][4 * i] = static_cast<uint8_t>(16 * j + i);
    const __m512i i0 = _mm512_load_si512(index[0]), i1 = _mm512_load_si512(index[1]);
    const __m512i i2 = _mm512_load_si512(index[2]), i3 = _mm512_load_si512(index[3]);
    constexpr __mmask64 LOW = 0x1111111111111111ULL;
    auto value = [&](__m512i v, __m512i idx) {
        return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(magic, LOW, idx, v)), unbias);
    };
    panel_rows<HALVES, MIN>(l, plan, n, count, b0, panel, pitch, scale, minimum,
                            [&](const uint8_t *block, const Factors<HALVES, MIN> &f, uint16_t *out) {
                                for (int i = 0; i < steps; i++) {
                                    const RunStep &p = ps[i];
                                    __m512i v = _mm512_and_si512(run_piece<FORMS & 1>(block, p, 0),
                                                                 _mm512_load_si512(p.mask[0]));
                                    v = _mm512_ternarylogic_epi64(v, run_piece<(FORMS >> 1) & 1>(block, p, 1),
                                                                  _mm512_load_si512(p.mask[1]), 0xF8);
                                    if (DEPTH == 3)
                                        v = _mm512_ternarylogic_epi64(v, run_piece<(FORMS >> 2) & 1>(block, p, 2),
                                                                      _mm512_load_si512(p.mask[2]), 0xF8);
                                    if (flips) v = _mm512_xor_si512(v, flip);
                                    v = _mm512_add_epi8(v, add);
                                    const __m512 e0 = value(v, i0), e1 = value(v, i1), e2 = value(v, i2),
                                                 e3 = value(v, i3);
                                    const __m512 w0 = f.apply(e0, p.g[0]), w1 = f.apply(e1, p.g[1]);
                                    const __m512 w2 = f.apply(e2, p.g[2]), w3 = f.apply(e3, p.g[3]);
                                    _mm512_storeu_si512(out + 64 * i, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                                    _mm512_storeu_si512(out + 64 * i + 32, (__m512i)_mm512_cvtne2ps_pbh(w3, w2));
                                }
                            });
}

bool run64_on() {
    const char *setting = std::getenv("QSCHEME_CPU_GEMM_BLOCKS_RUN64");
    return !(setting && setting[0] == '0');
}

// Integer codes of two or three pieces, 32 at a time as bytes (two chunks: one 16-byte window each per
// piece), instead of 16 lanes of 32 bits each shifted, masked and moved by its own plan vectors. A
// piece ("slot") is either
// - a run: the window's bytes in order, one shift, mask and destination per chunk (Q3_K, Q5_K, Q6_K:
//   every piece), shifted, masked and moved as 16-bit lanes; or
// - single bits: each lane's byte picked from the window (PSHUFB), one bit tested, its value set
//   (Q5_0's and Q5_1's fifth bits, bit i of a 32-bit field for element i).
struct alignas(64) RunPair {
    uint8_t mask[MAX_DEPTH][32], bit[MAX_DEPTH][32], value[MAX_DEPTH][32];
    uint16_t shift[MAX_DEPTH][16], dest[MAX_DEPTH][16];
    alignas(16) uint8_t idx0[MAX_DEPTH][16], idx1[MAX_DEPTH][16];
    int off0[MAX_DEPTH], off1[MAX_DEPTH];
    int g0 = 0, g1 = 0;
};

// Slot sl of chunk `ch` as a run (`as_bits` false) or as single bits into half `half` of p; false
// where the chunk's lanes do not fit that form.
inline bool fill_slot(const Chunk &ch, int sl, int half, bool as_bits, RunPair &p) {
    (half ? p.off1 : p.off0)[sl] = ch.off;
    uint8_t *idx = half ? p.idx1[sl] : p.idx0[sl];
    for (int i = 0; i < 16; i++) {
        const int32_t shift = ch.shift[i], mask = ch.mask[i], dest = ch.dest[i];
        if (as_bits) {
            if (mask != 1 || shift < 0 || shift > 7 || dest < 0 || dest > 7) return false;
            idx[i] = ch.idx[i];
            p.bit[sl][16 * half + i] = static_cast<uint8_t>(1 << shift);
            p.value[sl][16 * half + i] = static_cast<uint8_t>(1 << dest);
            continue;
        }
        if (!ch.ident || shift != ch.shift[0] || mask != ch.mask[0] || dest != ch.dest[0]) return false;
        if (shift < 0 || shift > 7 || mask < 0 || mask > (0xFF >> shift) || dest < 0 || (mask << dest) > 0xFF) return false;
        p.mask[sl][16 * half + i] = static_cast<uint8_t>(mask);
        if (i < 8) {
            p.shift[sl][8 * half + i] = static_cast<uint16_t>(shift);
            p.dest[sl][8 * half + i] = static_cast<uint16_t>(dest);
        }
    }
    return true;
}

// A layout's chunk pairs as RunPairs, and which slots are single bits (bit s: slot s; the same in
// every chunk). Empty where the layout fits neither form, or a mix of slots the loops are not built
// for: (run, run), (run, bits) and three runs.
struct RunPlan {
    std::vector<RunPair> pairs;
    int bits = 0;
    Run64Plan run64;  // where not empty, it decodes the layout (and pairs is empty)
};

RunPlan run_plan(const Layout &l, const Plan &plan) {
    RunPlan none, found;
    if (run64_on()) {
        found.run64 = run64_plan(l);
        if (!found.run64.steps.empty()) return found;
    }
    // codes of one piece take the word decoder (at most 4 bits) or whole bytes already
    if (l.el_table || l.el_depth < 2 || l.el_depth > MAX_DEPTH || l.el_bits > 8 || l.elements % 32 || l.sub % 16)
        return none;
    const int depth = l.el_depth, chunks = l.elements / 16, per_group = l.sub / 16;
    for (int sl = 0; sl < depth; sl++) {  // a slot is a run where the first chunk's is, else single bits
        RunPair probe;
        if (!fill_slot(plan.element[sl], sl, 0, false, probe)) found.bits |= 1 << sl;
    }
    if (!(found.bits == 0 || (found.bits == 2 && depth == 2))) return none;
    found.pairs.resize(static_cast<size_t>(chunks / 2));
    for (int c = 0; c < chunks; c++) {
        RunPair &p = found.pairs[c / 2];
        const int half = c % 2;
        (half ? p.g1 : p.g0) = c / per_group;
        for (int sl = 0; sl < depth; sl++)
            if (!fill_slot(plan.element[c * depth + sl], sl, half, (found.bits >> sl) & 1, p)) return none;
    }
    return found;
}

// 32 codes of a slot as bytes (see RunPair).
template <bool BITS>
static inline __m256i slot_bytes(const uint8_t *block, const RunPair &p, int sl) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block + p.off0[sl]));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(block + p.off1[sl]));
    if (BITS) {
        a = _mm_shuffle_epi8(a, _mm_load_si128(reinterpret_cast<const __m128i *>(p.idx0[sl])));
        b = _mm_shuffle_epi8(b, _mm_load_si128(reinterpret_cast<const __m128i *>(p.idx1[sl])));
        const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
        const __mmask32 set = _mm256_test_epi8_mask(w, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p.bit[sl])));
        return _mm256_maskz_mov_epi8(set, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p.value[sl])));
    }
    __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    w = _mm256_srlv_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p.shift[sl])));
    w = _mm256_and_si256(w, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p.mask[sl])));
    return _mm256_sllv_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p.dest[sl])));
}

template <int DEPTH, int BITS, bool HALVES, bool MIN>
void panel_runs(const Layout &l, const Plan &plan, const std::vector<RunPair> &pairs, int64_t n, int64_t count,
                int64_t b0, uint16_t *panel, int64_t pitch, float *scale, float *minimum) {
    const int int_shift = l.el_signed ? 32 - l.el_bits : 0, int_add = l.el_offset;
    const RunPair *ps = pairs.data();
    const int steps = static_cast<int>(pairs.size());
    panel_rows<HALVES, MIN>(l, plan, n, count, b0, panel, pitch, scale, minimum,
                            [&](const uint8_t *block, const Factors<HALVES, MIN> &f, uint16_t *out) {
                                for (int i = 0; i < steps; i++) {
                                    const RunPair &p = ps[i];
                                    __m256i v = slot_bytes<(BITS & 1) != 0>(block, p, 0);
                                    v = _mm256_or_si256(v, slot_bytes<(BITS & 2) != 0>(block, p, 1));
                                    if (DEPTH == 3) v = _mm256_or_si256(v, slot_bytes<(BITS & 4) != 0>(block, p, 2));
                                    const __m512 e0 = V512::integer(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)), int_shift, int_add);
                                    const __m512 e1 = V512::integer(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)), int_shift, int_add);
                                    const __m512 w0 = f.apply(e0, p.g0), w1 = f.apply(e1, p.g1);
                                    _mm512_storeu_si512(out + 32 * i, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                                }
                            });
}

template <class F>
static inline void with_factors(const Layout &l, F &&f) {
    const bool halves = block_halves(l), min = l.n_minimum > 0;
    if (halves)
        min ? f(Bool<true>(), Bool<true>()) : f(Bool<true>(), Bool<false>());
    else
        min ? f(Bool<false>(), Bool<true>()) : f(Bool<false>(), Bool<false>());
}

// The panel's rows: the word decoder where `pairs` is not empty, else the runs' decoder where `runs`
// is not, else the element decoder.
void decode_panel(const Layout &l, const Plan &plan, const std::vector<WordPair> &pairs, const RunPlan &runs,
                  int64_t n, int64_t count, int64_t b0, uint16_t *panel, int64_t pitch, float *scale, float *minimum) {
    if (pairs.empty()) {
        if (!runs.run64.steps.empty()) {
            with_factors(l, [&](auto halves, auto min) {
                constexpr bool H = decltype(halves)::value, M = decltype(min)::value;
                // (depth, forms) as run64_plan admits them: two pieces of either run, three of 32
                using Decoder = void (*)(const Layout &, const Plan &, const Run64Plan &, int64_t, int64_t, int64_t,
                                         uint16_t *, int64_t, float *, float *);
                static constexpr Decoder two[4] = {panel_run64<2, 0, H, M>, panel_run64<2, 1, H, M>,
                                                   panel_run64<2, 2, H, M>, panel_run64<2, 3, H, M>};
                const Decoder decoder = l.el_depth == 3 ? panel_run64<3, 0, H, M> : two[runs.run64.forms & 3];
                decoder(l, plan, runs.run64, n, count, b0, panel, pitch, scale, minimum);
            });
            return;
        }
        if (!runs.pairs.empty()) {
            const std::vector<RunPair> &rp = runs.pairs;
            with_factors(l, [&](auto halves, auto min) {
                constexpr bool H = decltype(halves)::value, M = decltype(min)::value;
                if (l.el_depth == 3)
                    panel_runs<3, 0, H, M>(l, plan, rp, n, count, b0, panel, pitch, scale, minimum);
                else if (runs.bits == 2)
                    panel_runs<2, 2, H, M>(l, plan, rp, n, count, b0, panel, pitch, scale, minimum);
                else
                    panel_runs<2, 0, H, M>(l, plan, rp, n, count, b0, panel, pitch, scale, minimum);
            });
            return;
        }
        with_element_decoder<V512>(l, plan, [&](auto depth, auto lut) {
            with_factors(l, [&](auto halves, auto min) {
                panel_elements<decltype(depth)::value, decltype(lut)::value, decltype(halves)::value,
                               decltype(min)::value>(l, plan, n, count, b0, panel, pitch, scale, minimum);
            });
        });
        return;
    }
    int form = pairs[0].form;
    bool two = false, mask = false;
    for (const WordPair &p : pairs) {
        form = p.form == form ? form : 2;
        two = two || p.g1 != p.g0;
        mask = mask || p.mask;
    }
    with_factors(l, [&](auto halves, auto min) {
        constexpr bool H = decltype(halves)::value, M = decltype(min)::value;
        if (two)  // sub-blocks of 16 (masked)
            panel_words<2, true, true, H, M>(l, plan, pairs, n, count, b0, panel, pitch, scale, minimum);
        else if (mask)
            panel_words<2, false, true, H, M>(l, plan, pairs, n, count, b0, panel, pitch, scale, minimum);
        else if (form == 0)
            panel_words<0, false, false, H, M>(l, plan, pairs, n, count, b0, panel, pitch, scale, minimum);
        else if (form == 1)
            panel_words<1, false, false, H, M>(l, plan, pairs, n, count, b0, panel, pitch, scale, minimum);
        else
            panel_words<2, false, false, H, M>(l, plan, pairs, n, count, b0, panel, pitch, scale, minimum);
    });
}

// The panel decoders' plans for a layout, built once per call: the word pairs where the word decoder takes
// the layout, else the runs (of 64 or of 32 a step; both empty: the element decoder), as decode_panel
// takes them.
struct Decoders {
    std::vector<WordPair> pairs;
    RunPlan runs;
    // gemm_blocks_decoder's number (cpu_gemv_gguf.h)
    int kind() const { return !pairs.empty() ? 1 : !runs.run64.steps.empty() ? 2 : !runs.pairs.empty() ? 3 : 4; }
};

inline Decoders plan_decoders(const Layout &l, const Plan &plan) {
    Decoders d;
    if (!word_pairs(l, plan, d.pairs)) d.runs = run_plan(l, plan);
    return d;
}

}  // namespace qscheme_gguf_gemm

namespace qscheme_gguf {

bool gemm_blocks_fits(const Layout &l, const Plan &plan16) { return plan16.width == 16 && l.elements % 32 == 0; }

namespace {

// The panel of weight rows [q0, q0 + live) (live <= 32), chunk by chunk of about kc columns (whole
// blocks), on the calling thread: each chunk decoded into the thread's panel (rows [live, padded) zeroed),
// then multiply(panel, pitch, width, column, first, last) with the chunk's first column.
template <class Multiply>
void panel_chunks(const Layout &l, const Plan &plan16, const std::vector<qscheme_gguf_gemm::WordPair> &pairs,
                  const qscheme_gguf_gemm::RunPlan &runs, int64_t q0, int64_t live, int64_t padded, int64_t kc,
                  Multiply multiply) {
    using namespace qscheme_gguf_gemm;
    const int64_t blocks = l.k / l.elements, chunk_blocks = std::max<int64_t>(1, kc / l.elements);
    const int64_t width_most = std::min(blocks, chunk_blocks) * l.elements;
    Buffers &b = buffers;
    // the panel on whole cache lines (a vector's storage is aligned to 16 bytes only)
    uint16_t *panel = Buffers::fit(b.panel, PANEL_ROWS * (width_most + PANEL_PAD) + 32);
    panel = reinterpret_cast<uint16_t *>((reinterpret_cast<uintptr_t>(panel) + 63) & ~uintptr_t(63));
    const int64_t products = std::min(blocks, chunk_blocks) * l.groups + 16;  // row_products may write 16 past
    float *scale = Buffers::fit(b.scale, products), *minimum = Buffers::fit(b.minimum, products);
    Layout part = l;
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
        const int64_t nb = std::min(chunk_blocks, blocks - b0), width = nb * l.elements, pitch = width + PANEL_PAD;
        part.k = width;
        decode_panel(part, plan16, pairs, runs, q0, live, b0, panel, pitch, scale, minimum);
        for (int64_t r = live; r < padded; r++) std::memset(panel + r * pitch, 0, static_cast<size_t>(width) * 2);
        multiply(panel, pitch, width, b0 * l.elements, b0 == 0, b0 + nb >= blocks);
    }
}

// Weight rows [q0, q1) (at most 32: one panel) of gemm_blocks_bf16 with VDPBF16PS, on the calling thread.
void panel_task(const Layout &l, const Plan &plan16, const std::vector<qscheme_gguf_gemm::WordPair> &pairs,
                const qscheme_gguf_gemm::RunPlan &runs,
                const uint16_t *x, int64_t m, const uint16_t *xv, int64_t mp, const float *bias, uint16_t *out,
                int64_t ldy, int64_t r0, int64_t q0, int64_t q1, int64_t kc) {
    // x: m rows of K bfloat16; its first mp rows (0 or a multiple of 16) also packed as pairs in xv,
    // multiplied by the pairs' loop into acc's first PANEL_ROWS * mp sums, the other rows by the dot blocks
    using qscheme_gguf_gemm::PANEL_ROWS;
    const int64_t live = q1 - q0;
    float *acc = qscheme_gguf_gemm::Buffers::fit(qscheme_gguf_gemm::buffers.acc, m * PANEL_ROWS);
    panel_chunks(l, plan16, pairs, runs, q0, live, (live + 3) / 4 * 4, kc,
                 [&](const uint16_t *panel, int64_t pitch, int64_t width, int64_t column, bool first, bool) {
                     qscheme_panel::multiply_panel_all(panel, pitch, live, x, xv, l.k, m, mp, column, width / 32, acc,
                                                       PANEL_ROWS, first);
                 });
    qscheme_panel::store_panel_all(acc, PANEL_ROWS, live, m, mp, bias ? bias + q0 : nullptr, out + (q0 - r0), ldy);
    qscheme_gguf_gemm::buffers.release();
}

// The same on the AMX tiles: x packed whole (xp: mp rows, a multiple of 16, zeros past m), each chunk's
// panel multiplied at once by every block of 16 rows of x (amx_panel.h), the outputs written with the last.
void panel_task_amx(const Layout &l, const Plan &plan16, const std::vector<qscheme_gguf_gemm::WordPair> &pairs,
                    const qscheme_gguf_gemm::RunPlan &runs, const uint32_t *xp, int64_t m, int64_t mp,
                    const float *bias, uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int64_t q0, int64_t kc) {
    using qscheme_gguf_gemm::PANEL_ROWS;
    const int64_t groups = (mp / 16 + 1) / 2;  // pairs of blocks of 16 rows of x
    float *acc = qscheme_gguf_gemm::Buffers::fit(qscheme_gguf_gemm::buffers.acc, groups * 1024);
    qscheme_amx::TileState saved;
    qscheme_amx::begin(saved);
    panel_chunks(l, plan16, pairs, runs, q0, std::min(r1, q0 + PANEL_ROWS) - q0, PANEL_ROWS, kc,
                 [&](const uint16_t *panel, int64_t pitch, int64_t width, int64_t column, bool first, bool last) {
                     qscheme_amx::multiply_panel(panel, pitch, width / 32, xp, m, mp, l.k, column, first, last,
                                                 groups == 1, acc, bias, out, ldy, q0, r0, r1);
                 });
    qscheme_amx::end(saved);
    qscheme_gguf_gemm::buffers.release();
}

// x (m rows of K bfloat16) packed into the tiles' pair layout, mp = m rounded up to 16 rows (zeros past
// m), 16 rows a task over `threads` workers; xp holds mp * K words (cache-line aligned).
void pack_tiles(const uint16_t *x, int64_t m, int64_t k, int64_t mp, int threads, uint16_t *xp) {
    qscheme_gemv::run_tasks(static_cast<int>(std::min<int64_t>(threads, mp / 16)), mp / 16, [&](int64_t block) {
        const int64_t first = 16 * block, rows = std::min<int64_t>(16, m - first);
        if (rows == 16) {
            qscheme_panel::pack_pairs(x + first * k, k, k, xp + first * k);
            return;
        }
        std::vector<uint16_t> padded(static_cast<size_t>(16 * k), 0);
        std::memcpy(padded.data(), x + first * k, static_cast<size_t>(rows * k) * 2);
        qscheme_panel::pack_pairs(padded.data(), k, k, xp + first * k);
    });
}

}  // namespace

int gemm_blocks_decoder(const Layout &l, const Plan &plan16) { return qscheme_gguf_gemm::plan_decoders(l, plan16).kind(); }

bool gemm_blocks_amx() {
    const char *setting = std::getenv("QSCHEME_CPU_GEMM_BLOCKS_AMX");
    return qscheme_amx::compiled() && qscheme_amx::granted() && !(setting && setting[0] == '0');
}

void gemm_blocks_bf16(const Layout &l, const Plan &plan16, const uint16_t *x, int64_t m, const float *bias,
                      uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int threads, int64_t kc, bool amx) {
    const qscheme_gguf_gemm::Decoders decoders = qscheme_gguf_gemm::plan_decoders(l, plan16);  // once per call
    const std::vector<qscheme_gguf_gemm::WordPair> &pairs = decoders.pairs;
    const qscheme_gguf_gemm::RunPlan &runs = decoders.runs;
    constexpr int64_t ROWS = qscheme_gguf_gemm::PANEL_ROWS;  // weight rows per task: one panel
    const int64_t tasks = (r1 - r0 + ROWS - 1) / ROWS;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    if (amx) {
        const int64_t mp = (m + 15) / 16 * 16;
        std::unique_ptr<uint16_t[]> packed(new uint16_t[static_cast<size_t>(mp * l.k + 32)]);  // not zeroed
        uint16_t *xp = packed.get() + ((64 - reinterpret_cast<uintptr_t>(packed.get()) % 64) % 64) / 2;
        pack_tiles(x, m, l.k, mp, threads, xp);
        qscheme_gemv::run_tasks(count, tasks, [&](int64_t task) {
            panel_task_amx(l, plan16, pairs, runs, reinterpret_cast<const uint32_t *>(xp), m, mp, bias, out, ldy, r0,
                           r1, r0 + task * ROWS, kc);
        });
        return;
    }
    // whole blocks of 16 input rows packed as pairs once per call (cache-line aligned), from 32 rows on
    const int64_t mp = qscheme_panel::pair_rows(m);
    std::unique_ptr<uint16_t[]> packed(new uint16_t[static_cast<size_t>(mp * l.k + 32)]);  // not zeroed
    uint16_t *xv = packed.get() + ((64 - reinterpret_cast<uintptr_t>(packed.get()) % 64) % 64) / 2;
    qscheme_gemv::run_tasks(static_cast<int>(std::min<int64_t>(threads, mp / 16)), mp / 16, [&](int64_t block) {
        qscheme_panel::pack_pairs(x + 16 * block * l.k, l.k, l.k, xv + 16 * block * l.k);
    });
    qscheme_gemv::run_tasks(count, tasks, [&](int64_t task) {
        const int64_t q0 = r0 + task * ROWS;
        panel_task(l, plan16, pairs, runs, x, m, xv, mp, bias, out, ldy, r0, q0, std::min(r1, q0 + ROWS), kc);
    });
}

}  // namespace qscheme_gguf

#else  // not x86: never called (gemm_blocks_supported is false)

#include "cpu_gemv_gguf.h"

namespace qscheme_gguf {
bool gemm_blocks_fits(const Layout &, const Plan &) { return false; }
bool gemm_blocks_amx() { return false; }
int gemm_blocks_decoder(const Layout &, const Plan &) { return 0; }
void gemm_blocks_bf16(const Layout &, const Plan &, const uint16_t *, int64_t, const float *, uint16_t *, int64_t,
                      int64_t, int64_t, int, int64_t, bool) {}
}  // namespace qscheme_gguf

#endif
