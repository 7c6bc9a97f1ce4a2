// qscheme._cpu_gemv, packed blocks: the GEMV over weights stored as raw blocks (GGUF's types and
// any other `packing: blocks` declaration), decoded in registers from the block bytes.
//
// A layout arrives as a "program" of int32 built by qscheme.cpu_gemv_blocks from the scheme's
// block declaration (nothing here knows a type by name):
//
//   header  block_bytes, elements, groups, n_scale, n_minimum, minimum_sign (+1 add, -1 subtract,
//           0 none), element bits, element slot depth, element by table (1) or as an integer (0),
//           element signed, element offset
//   slots   the element integer's pieces: int32 [depth][4][elements] (byte within the block,
//           shift, mask, destination bit), as qscheme.formats.blocks compiles them
//   factors n_scale then n_minimum, each: is_field, count, offset, format (0 fp16, 1 bf16,
//           2 fp32, 3 a byte through table `table`), table, bits, signed, integer offset, depth,
//           then (integers) their pieces int32 [depth][4][count]
//
// Each block's `groups` sub-block scale products s_g (and minimum products m_g) are formed in
// float32 left to right, as the reference decoder forms them; the GEMV then sums, per sub-block,
// x_k * value(code_k) in float32 and adds s_g times that sum (and -/+ m_g times the sub-block's sum
// of x). The weight is never stored.
#pragma once

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace qscheme_gguf {

constexpr int MAX_FACTORS = 4;
constexpr int MAX_GROUPS = 64;  // sub-blocks per block
constexpr int MAX_DEPTH = 4;    // pieces of one integer value
enum FieldFormat : int { FIELD_FP16 = 0, FIELD_BF16 = 1, FIELD_FP32 = 2, FIELD_TABLE = 3 };

struct Factor {
    int is_field = 0, count = 1, offset = 0, format = 0, table = 0, bits = 0, is_signed = 0, add = 0, depth = 0;
    const int32_t *slots = nullptr;  // [depth][4][count]
    uint8_t at[MAX_GROUPS] = {};     // the value covering sub-block g: g * count / groups
};

struct Layout {
    const uint8_t *codes = nullptr;
    int64_t n = 0, k = 0, row_bytes = 0;
    int block_bytes = 0, elements = 0, groups = 1, sub = 0;
    int n_scale = 0, n_minimum = 0, minimum_sign = 0;
    int el_bits = 0, el_depth = 0, el_table = 0, el_signed = 0, el_offset = 0;
    const int32_t *el_slots = nullptr;  // [depth][4][elements]
    Factor scale[MAX_FACTORS], minimum[MAX_FACTORS];
    const float *values = nullptr;       // the element's value of every raw code [2**bits]
    const float *byte_tables = nullptr;  // [tables][256]: float fields of one byte
};

// The value of integer `index` of a factor or of the element, from its pieces.
inline int32_t integer_value(const uint8_t *block, const int32_t *slots, int depth, int count, int index) {
    uint32_t v = 0;
    for (int s = 0; s < depth; s++) {
        const int32_t *slot = slots + s * 4 * count;
        v |= ((static_cast<uint32_t>(block[slot[index]]) >> slot[count + index]) & static_cast<uint32_t>(slot[2 * count + index]))
             << slot[3 * count + index];
    }
    return static_cast<int32_t>(v);
}

// The raw (unsigned, before sign and offset) element code `index` of a block.
inline uint32_t element_code(const Layout &l, const uint8_t *block, int index) {
    return static_cast<uint32_t>(integer_value(block, l.el_slots, l.el_depth, l.elements, index));
}

// Value i of a factor in a block, as float32; HALF converts fp16 bits.
template <class HALF>
inline float factor_value(const Layout &l, const Factor &f, const uint8_t *block, int i, HALF half) {
    if (f.is_field) {
        switch (f.format) {
            case FIELD_FP16: {
                uint16_t h;
                __builtin_memcpy(&h, block + f.offset + 2 * i, 2);
                return half(h);
            }
            case FIELD_BF16: {
                uint16_t h;
                __builtin_memcpy(&h, block + f.offset + 2 * i, 2);
                const uint32_t bits = static_cast<uint32_t>(h) << 16;
                float v;
                __builtin_memcpy(&v, &bits, 4);
                return v;
            }
            case FIELD_FP32: {
                float v;
                __builtin_memcpy(&v, block + f.offset + 4 * i, 4);
                return v;
            }
            default: return l.byte_tables[256 * f.table + block[f.offset + i]];
        }
    }
    int32_t v = integer_value(block, f.slots, f.depth, f.count, i);
    if (f.is_signed) v -= ((v >> (f.bits - 1)) & 1) << f.bits;
    return static_cast<float>(v + f.add);
}

// The block's sub-block products of `factors` (left to right, float32), into out[groups].
template <class HALF>
inline void block_products(const Layout &l, const Factor *factors, int count, const uint8_t *block, float *out,
                           HALF half) {
    const int groups = l.groups;
    if (count == 1 && factors[0].count == 1) {  // one value per block (Q4_0's d)
        const float v = factor_value(l, factors[0], block, 0, half);
        for (int g = 0; g < groups; g++) out[g] = v;
        return;
    }
    for (int g = 0; g < groups; g++) {
        float v = factor_value(l, factors[0], block, factors[0].at[g], half);
        for (int f = 1; f < count; f++) {
            const float w = factor_value(l, factors[f], block, factors[f].at[g], half);
            v = v * w;
        }
        out[g] = v;
    }
}

struct alignas(64) Chunk {
    int32_t shift[16], mask[16], dest[16];
    uint8_t idx[16];
    int32_t off = 0, ident = 1;
};

// The pieces `slots` ([depth][4][count]) of `count` values taken W at a time: per chunk of W values
// and per slot, a 16-byte window of the block holding their bytes, with each lane's byte within
// it, shift, mask and destination (lanes past `count` have mask 0). Empty where some chunk's
// bytes do not fit one window.
inline std::vector<Chunk> plan_windows(const int32_t *slots, int depth, int count, int block_bytes, int W) {
    std::vector<Chunk> plan;
    if (block_bytes < 16 || depth < 1 || depth > MAX_DEPTH) return plan;
    const int chunks = (count + W - 1) / W;
    plan.resize(static_cast<size_t>(chunks * depth));
    for (int c = 0; c < chunks; c++) {
        const int lanes = count - c * W < W ? count - c * W : W;
        for (int s = 0; s < depth; s++) {
            Chunk &ch = plan[c * depth + s];
            const int32_t *slot = slots + s * 4 * count;
            int lo = 1 << 30, hi = -1;
            for (int i = 0; i < lanes; i++) {
                const int byte = slot[c * W + i];
                lo = byte < lo ? byte : lo;
                hi = byte > hi ? byte : hi;
            }
            const int off = lo + 16 > block_bytes ? block_bytes - 16 : lo;
            if (hi - off >= 16) return {};
            ch.off = off;
            ch.ident = lanes == W;
            std::memset(ch.idx, 0, sizeof(ch.idx));
            for (int i = 0; i < 16; i++) ch.shift[i] = ch.mask[i] = ch.dest[i] = 0;
            for (int i = 0; i < lanes; i++) {
                const int e = c * W + i;
                ch.idx[i] = static_cast<uint8_t>(slot[e] - off);
                if (ch.idx[i] != i) ch.ident = 0;
                ch.shift[i] = slot[count + e];
                ch.mask[i] = slot[2 * count + e];
                ch.dest[i] = slot[3 * count + e];
            }
        }
    }
    return plan;
}

// What the vector loops of width W read: the element's windows ([elements / W][depth]) and each
// integer factor's ([chunks][depth]; empty: decoded by the scalar code). width 0: the layout does
// not fit (then the scalar loop runs).
struct Plan {
    int width = 0;
    std::vector<Chunk> element;
    std::vector<Chunk> factor[2 * MAX_FACTORS];
};

inline Plan make_plan(const Layout &l, int W) {
    Plan p;
    if (l.elements % W || l.sub % W || l.el_depth > 3 || (l.el_table && l.el_bits > 4)) return p;
    p.element = plan_windows(l.el_slots, l.el_depth, l.elements, l.block_bytes, W);
    if (p.element.empty()) return p;
    for (int i = 0; i < l.n_scale + l.n_minimum; i++) {
        const Factor &f = i < l.n_scale ? l.scale[i] : l.minimum[i - l.n_scale];
        if (!f.is_field) p.factor[i] = plan_windows(f.slots, f.depth, f.count, l.block_bytes, W);
    }
    p.width = W;
    return p;
}

// Vector loops: rows [n0, n1) of the layer times m rows of x (float32 [m][ldx]); xsum holds, per
// row of x, the sum of x over each sub-block of K ([m][K / sub]); acc[m * ldy + n] receives the
// sum. plan: make_plan(l, W) for their width W (16, 8), with width W.
void gemv_blocks_avx512(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int m,
                        int64_t n0, int64_t n1, float *acc, int64_t ldy);
void gemv_blocks_avx2(const Layout &l, const Plan &plan, const float *x, int64_t ldx, const float *xsum, int m,
                      int64_t n0, int64_t n1, float *acc, int64_t ldy);

// The AVX512-BF16 loop (cpu_gemv_gguf_bf16.cpp) for up to four bfloat16 rows of x on 4-bit codes
// in sub-blocks of 32 that the vector loops read as nibble pairs ("low nibbles, then high" windows),
// whose 16 code values are bfloat16 numbers, each zero or of a magnitude in [2**-8, 2**8]: x as it is
// times the code values, each product exact and added in float32 (VDPBF16PS), each sub-block's sums
// multiplied by its scale product s_g in float32, the minimum products applied as the vector loops
// apply them. Elements of x must be zero or of a magnitude in [2**-100, 2**64] (the instruction
// flushes subnormals: products stay multiples of 2**-122, sums of up to 2**31 of them finite).
// Kind 3 of the loop: how a step's piece of the element integer (one slot of its plan chunks of 16)
// is gathered. 32 elements: into 16-bit lanes, the two chunks' 16-byte windows (at off0, off1) side by
// side, byte 2i of `index` naming lane i's byte within them, then each lane's shift, mask and
// destination bit. 64 elements: into byte lanes, two 32-byte runs (at off0, off1), byte e of `index`
// naming lane e's byte, `mask` read as 64 bytes, shift and destination per pair of lanes (a word).
struct alignas(64) PlaneStep {
    uint8_t index[64] = {};
    int16_t shift[32] = {}, mask[32] = {}, dest[32] = {};
    int32_t off0 = 0, off1 = 0;  // the windows' bytes within the block
};

struct Bf16Input {
    int kind = 0;                // 1: each sub-block one 16-byte window, its low then its high nibbles
                                 // (Q4_0, Q4_1, IQ4_NL, IQ4_XS, MXFP4); 2: two windows of 16 bytes,
                                 // low nibbles one sub-block, high nibbles the next (Q4_K); 3: integer
                                 // codes of up to 6 bits from one or two pieces in sub-blocks of 16 or
                                 // 32, 32 or 64 elements a step in their own order (Q2_K, Q3_K, Q5_0,
                                 // Q5_1, Q5_K, Q6_K)
    bool paired = false;         // kind 1 with one sub-block per block of at most 32 bytes: two blocks
                                 // per 64-byte load, codes (and an fp16 scale) taken by byte permutes
    int inline_factors = 0;       // paired: how the loop reads the factors from each block (0: formed
                                  // per row first; cpu_gemv_gguf_bf16.cpp: Inline)
    alignas(64) int16_t table[32] = {};         // the code values as bfloat16 words, twice over
    // kinds 1 and 2 whose 16 code values are integers of at most 127 in magnitude (every 4-bit GGUF type): the
    // values as 16-bit integers, twice over, for the integer products (int16_blocks_words)
    bool integer = false;
    alignas(64) int16_t int_table[32] = {};
    alignas(64) uint8_t code_index[64] = {};    // paired: byte j of the codes' words (odd bytes zeroed)
    alignas(64) uint8_t scale_index[64] = {};   // fp16 scales: the two blocks', 8 lanes each
    alignas(64) uint8_t minimum_index[64] = {}; // fp16 minimums: the two blocks', lanes 0 and 1
    uint64_t mask_two = 0, mask_one = 0;      // paired: the bytes of two blocks, of one
    // K-quant factors ([d, sc] and any [dmin, m], 8 sub-blocks, sc and m integers; not paired): sc
    // and m of a block read as one vector of 16 integers (its windows, each lane's sign-extension
    // shift and offset), formed block by block in the loop
    alignas(64) int32_t kquant_shift[16] = {}, kquant_add[16] = {};
    uint16_t kquant_minimum_lanes = 0;  // the lanes of the minimum integers (m), multiplied by dmin
    bool kquant_plain = false;          // every shift and offset 0: the integers as the windows give them
    // d and dmin as two of the first 16 fp16 words of a block (even offsets under 32, blocks of 32 bytes
    // or more): lane i's word, so that one load, one conversion and one permute give [d ... | dmin ...]
    bool kquant_halves = false;
    alignas(64) int32_t kquant_half_index[16] = {};
    int kquant_depth = 0;
    std::vector<Chunk> kquant;
    // kind 2 with K-quant factors, blocks of a multiple of 128 elements whose units of two sub-blocks lie
    // two by two in 64 contiguous bytes (Q4_K): the integer products take 128 elements a step, x in their
    // order (bf16_blocks_words with wide; cpu_gemv_gguf_bf16.cpp: rows_wide)
    bool wide = false;
    // kind 3: the code values of up to 64 codes as bfloat16 words, and the steps ([steps][depth])
    alignas(64) int16_t table64[64] = {};
    int plane_depth = 0;
    int plane_factors = 0;  // how the loop reads the factors (cpu_gemv_gguf_bf16.cpp: PlaneFactors)
    std::vector<PlaneStep> planes;    // 32 elements a step
    std::vector<PlaneStep> planes64;  // 64 elements a step, where the pieces' windows allow it (else empty)
};

// Pairs of sub-blocks of 32 in a row of K (the last may be half): a row of x in the loop's order
// holds 64 words per pair.
inline int64_t bf16_pairs(int64_t k) { return (k / 32 + 1) / 2; }

// Whether this CPU runs the loop (AVX512-BF16 and VBMI), whatever QSCHEME_CPU_GEMV_BF16DOT says.
bool bf16_blocks_supported();
// Whether this CPU runs the loop and QSCHEME_CPU_GEMV_BF16DOT is not 0.
bool bf16_blocks_available();
// Whether the loop takes the layout (plan16: make_plan(l, 16), width 16; K need not be set); fills
// `in`. Call only where bf16_blocks_supported().
bool bf16_blocks_fits(const Layout &l, const Plan &plan16, Bf16Input &in);
// Whether QSCHEME_CPU_GEMV_PLANES64 (read at each call) leaves kind 3's 64-element steps on (not 0);
// with it 0, every layout takes 32 elements a step (the tests run both).
bool bf16_planes64_on();
// Whether QSCHEME_CPU_GEMV_GGUF_WIDE (read at each call) leaves the integer products' 128-element steps on
// for the layouts that have them (Bf16Input::wide; not 0); with it 0 they take the pairs' loop (the tests run
// both).
bool bf16_wide_on();
// A bfloat16 row of x ([k], k a multiple of 32) into xq ([bf16_pairs(k) * 64] words in the loop's
// order for `kind`: kinds 1 and 2 pair sub-blocks of 32, kind 3 keeps x's own order; zero padded;
// wide: the order of rows_wide's steps of 128, k a multiple of 128); false where an element is neither
// zero nor of a magnitude in [2**-100, 2**64]. Call only where bf16_blocks_supported().
bool bf16_blocks_words(const uint16_t *x, int64_t k, int kind, int16_t *xq, bool wide = false);
// The integer products (kinds 1 and 2 where Bf16Input::integer, at most INT16_BLOCK_ROWS rows of x): a row of
// words from bf16_blocks_words rewritten in place as 16-bit integers, each block of 256 words (4 pairs)
// over its own power-of-two step unit[b] (the smallest that holds the block's largest magnitude in 15
// bits): an element within 2**8 of that magnitude is exact, a smaller one off by at most half a step.
constexpr int INT16_BLOCK_ROWS = 2;
void int16_blocks_words(int16_t *xq, int64_t k, float *unit);
// Whether the GEMV takes integer products (VPDPWSSD) for those layouts, and for blocks of byte codes
// (byte_codes_offset, VPMADDWD): QSCHEME_CPU_GEMV_GGUF_INT16 (read
// at each call) 1 or 0, else on CPUs with AMX-BF16 and AVX512-VNNI (Intel, where VDPBF16PS issues at half
// the FMA's rate: docs/notes/cpu-gemv-2026-12.md items 70 and 74).
bool int16_blocks_on();
// Integer products for blocks of 8-bit codes (cpu_gemv_gguf_bytes.cpp), one or two bfloat16 rows of x where
// int16_blocks_on: the codes' offset in each block where they are signed bytes in order, scaled by one fp16
// field and nothing else (Q8_0), else -1; a row of x (K words, K a multiple of 32) as 16-bit integers per
// block of 256 over the step unit[b] (as int16_blocks_words rounds), false where an element is neither zero
// nor of a magnitude in [2**-100, 2**64] (the float32 loops then take the call); rows [n0, n1) times m such
// rows (xq [m][K], unit [m][(K + 255) / 256]) into acc[r * ldy + n].
int byte_codes_offset(const Layout &l);
bool bytes_words(const uint16_t *x, int64_t k, int16_t *xq, float *unit);
void gemv_bytes_int16(const Layout &l, int offset, const int16_t *xq, const float *unit, int m, int64_t n0,
                      int64_t n1, float *acc, int64_t ldy);

// Rows [n0, n1) of the layer times m rows of xw ([m][bf16_pairs(l.k) * 64], from bf16_blocks_words;
// in passes of at most 4), as gemv_blocks_avx512. With unit ([m][blocks of 256 words]) the rows of xw
// are int16_blocks_words' integers and the products integer (m <= INT16_BLOCK_ROWS, in.integer); wide: in
// 128-element steps (in.wide, xw from bf16_blocks_words with wide).
void gemv_blocks_bf16(const Layout &l, const Plan &plan16, const Bf16Input &in, const int16_t *xw, const float *xsum,
                      int m, int64_t n0, int64_t n1, float *acc, int64_t ldy, const float *unit = nullptr,
                      bool wide = false);

// Rows [n0, n1) of the layer into out ([n1 - n0][K], float32 or bfloat16): each weight as qscheme's
// block decoder forms it, bfloat16 rounded once (cpu_gemv_gguf_dequant.cpp). False where plan16 has no
// width (the layout does not fit the vector loops) or the build is not for x86.
bool dequantize_blocks_avx512(const Layout &l, const Plan &plan16, int64_t n0, int64_t n1, void *out, bool bf16);

// The fused GEMM over packed blocks for many rows of x (cpu_gemv_gguf_gemm.cpp): weight rows [r0, r1) of
// the layer in tasks of 32 over `threads` workers, each task's rows decoded chunk by chunk of about kc
// columns (whole blocks) into a bfloat16 panel (each weight as dequantize_blocks_avx512 forms it, rounded
// once to nearest even, a float32 subnormal to zero) and multiplied by m rows of x (bfloat16 [m][K]) on
// the AMX tiles (amx: amx_panel.h) or with VDPBF16PS: out[i * ldy + n - r0] (bfloat16) = the float32 sum
// (+ bias[n]) rounded once. Call only where gemm_blocks_fits and the CPU has AVX512-BF16
// (gemm_blocks_supported), with amx only where gemm_blocks_amx.
bool gemm_blocks_fits(const Layout &l, const Plan &plan16);
void gemm_blocks_bf16(const Layout &l, const Plan &plan16, const uint16_t *x, int64_t m, const float *bias,
                      uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int threads, int64_t kc, bool amx);
// Which decoder fills gemm_blocks_bf16's panels for this layout: 1 the 4-bit words' (VPERMW), 2 the runs'
// of 64 elements a step (QSCHEME_CPU_GEMM_BLOCKS_RUN64, read at each call, not 0), 3 the runs' of 32
// a step, 4 the element decoder.
int gemm_blocks_decoder(const Layout &l, const Plan &plan16);
// Whether this CPU has AVX512-BF16 and VBMI (the panel decoders permute bytes), and the extension was built for x86.
bool gemm_blocks_supported();
// Whether the fused GEMM multiplies on the AMX tiles here: the AMX loops compiled, the tile state granted,
// and QSCHEME_CPU_GEMM_BLOCKS_AMX (read at each call) not 0.
bool gemm_blocks_amx();

// The Python entry points (in cpu_gemv_gguf.cpp), listed in cpu_gemv.cpp's method table.
PyObject *gemv_blocks(PyObject *, PyObject *args);
PyObject *dequantize_blocks(PyObject *, PyObject *args);
PyObject *gemm_blocks(PyObject *, PyObject *args);
PyObject *gemm_blocks_decoder(PyObject *, PyObject *args);
PyObject *blocks_gemm(PyObject *, PyObject *);
PyObject *blocks_loop(PyObject *, PyObject *args);
PyObject *blocks_bf16(PyObject *, PyObject *);

}  // namespace qscheme_gguf

namespace qscheme_gemv {
// From cpu_gemv.cpp: the ISA in use (0 scalar, 1 AVX2, 2 AVX-512) and its pool of worker threads.
int active_isa();
// Whether this CPU has AMX-BF16: Intel's, where VDPBF16PS issues at half the FMA's rate, so that the integer
// loops are the default there (cpu_gemv's bf16dot_fits, int16_blocks_on).
bool slow_bf16_dot();
void run_tasks(int threads, int64_t tasks, const std::function<void(int64_t)> &job);
}  // namespace qscheme_gemv
