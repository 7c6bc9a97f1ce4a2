// qscheme._cpu_gemv: shared declarations of the CPU GEMV kernels (see cpu_gemv.cpp).
//
// A layer is described by `Params`: the canonical codes (never repacked), the scale tensor in its
// stored element type, optional int16 zero points (laid out as the scale), an optional float32
// per-row factor (a fused partition's global scale, multiplied or divided as the reference does)
// and the 16-entry value table of a 4-bit code. Every weight is formed as the reference forms it,
// fp32((value - zero) * effective_scale), in registers; only the order of the sums differs.
#pragma once

#include <cstdint>

#include "byte_scales.h"

namespace qscheme_gemv {

enum CodeKind : int { CODE_NIBBLE = 0, CODE_E4M3 = 1, CODE_INT8 = 2, CODE_UINT8 = 3 };
// Inside gemv only (never passed in): e4m3 codes with x multiplied by 256 beforehand, so that the
// vector loops use each code's float16 form (its value / 256) with no multiply per weight.
constexpr int CODE_E4M3_X256 = 4;
enum ScaleKind : int { SCALE_NONE = 0, SCALE_F32 = 1, SCALE_BF16 = 2, SCALE_F16 = 3, SCALE_BYTE = 4 };
using qscheme_bytes::BYTE_E4M3;
using qscheme_bytes::BYTE_E8M0;
using qscheme_bytes::BYTE_TABLE;

struct Params {
    const uint8_t *codes = nullptr;
    int64_t code_stride = 0;  // bytes per row
    int code_kind = CODE_NIBBLE;
    float lut[16] = {};  // values of the 16 nibble codes
    const void *scale = nullptr;
    int scale_kind = SCALE_NONE;
    float scale_table[256] = {};  // values of the 256 scale bytes (SCALE_BYTE)
    int byte_format = 0;  // ByteFormat: the table holds e4m3's or e8m0's values (decoded by arithmetic)
    int64_t scale_cols = 1, group_n = 1, group_k = 1;
    const int16_t *zero = nullptr;  // indexed as the scale
    int64_t zero_max = 0;  // the largest |zero point| (0 without)
    const float *row_scale = nullptr;  // [N]: effective = scale * row (or / row, or row alone)
    int row_divide = 0;
    int64_t n = 0, k = 0;
    uint64_t serial = 0;  // this call's number (keys the per-thread tables derived from it)
};

using qscheme_bytes::half_value;

// n float16 bit patterns as float32 (half_value's values), eight at a time with F16C where the CPU
// has it: a row of scale groups of 32 at K = 4096 is 128 of them per row and call.
void halves_to_floats(const uint16_t *h, float *out, int64_t n);
#if defined(__x86_64__) || defined(__i386__)
void halves_to_floats_f16c(const uint16_t *h, float *out, int64_t n);  // cpu_gemv_avx2.cpp
#endif

// The effective scale of scale element `index` for row `row` (as qscheme.canonical.effective_scale).
inline float scale_value(const Params &p, int64_t index, int64_t row) {
    float s;
    switch (p.scale_kind) {
        case SCALE_F32: s = static_cast<const float *>(p.scale)[index]; break;
        case SCALE_BF16: {
            uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t *>(p.scale)[index]) << 16;
            float f;
            __builtin_memcpy(&f, &bits, 4);
            s = f;
            break;
        }
        case SCALE_F16: s = half_value(static_cast<const uint16_t *>(p.scale)[index]); break;
        case SCALE_BYTE: s = p.scale_table[static_cast<const uint8_t *>(p.scale)[index]]; break;
        default: return p.row_scale ? p.row_scale[row] : 1.0f;
    }
    if (p.row_scale) {
        s = p.row_divide ? s / p.row_scale[row] : s * p.row_scale[row];
    }
    return s;
}

inline int64_t scale_row_base(const Params &p, int64_t row) { return (row / p.group_n) * p.scale_cols; }

// The effective scales of row `row`'s groups [first, last) (default: all scale_cols) into
// out[first, last) (the branch on the scale's type taken once per row, not per group).
inline void fill_scales(const Params &p, int64_t row, float *out, int64_t first = 0, int64_t last = -1) {
    if (last < 0 || last > p.scale_cols) last = p.scale_cols;
    const int64_t base = scale_row_base(p, row) + first, count = last - first;
    out += first;
    switch (p.scale_kind) {
        case SCALE_F32: {
            const float *s = static_cast<const float *>(p.scale) + base;
            for (int64_t g = 0; g < count; g++) out[g] = s[g];
            break;
        }
        case SCALE_BF16: {
            const uint16_t *s = static_cast<const uint16_t *>(p.scale) + base;
            for (int64_t g = 0; g < count; g++) {
                const uint32_t bits = static_cast<uint32_t>(s[g]) << 16;
                __builtin_memcpy(out + g, &bits, 4);
            }
            break;
        }
        case SCALE_F16: {
            const uint16_t *s = static_cast<const uint16_t *>(p.scale) + base;
            halves_to_floats(s, out, count);
            break;
        }
        case SCALE_BYTE: {
            const uint8_t *s = static_cast<const uint8_t *>(p.scale) + base;
            for (int64_t g = 0; g < count; g++) out[g] = p.scale_table[s[g]];
            break;
        }
        default:
            for (int64_t g = 0; g < count; g++) out[g] = p.row_scale ? p.row_scale[row] : 1.0f;
            return;
    }
    if (p.row_scale) {
        const float f = p.row_scale[row];
        if (p.row_divide)
            for (int64_t g = 0; g < count; g++) out[g] = out[g] / f;
        else
            for (int64_t g = 0; g < count; g++) out[g] = out[g] * f;
    }
}

// Whether a vector kernel of `width` float lanes runs this layer (else the scalar one does).
bool vector_fits(const Params &p, int width);

// Rows [n0, n1) of the layer times M rows of x: acc[m * ldy + n] = sum over k < k_main of
// x[m, k] * w[n, k], with x prepared by prepare_x (4-bit codes: each chunk of 2 * width elements
// as its even elements, then its odd ones). k_main: K rounded down to the kernel's chunk.
void gemv_avx512(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                 int64_t ldy);
void gemv_avx2(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
               int64_t ldy);
// Up to INT16_ROWS bfloat16 rows of x as 16-bit integers, for the 4-bit loop on VNNI
// (gemv_int16_avx512): each block of 256 elements of a row (the last one shorter) over its own
// power-of-two step, the smallest that keeps the block's largest magnitude within 15 bits, so that
// an element within 2**7 of it is exact and any other is off by at most half a step (2**-16 of
// that largest magnitude).
constexpr int INT16_ROWS = 4;
struct Int16Input {
    const int16_t *x = nullptr;  // [M][k_main]: in the loop's order (bf16_words.h: dot_loop_order)
    const float *unit = nullptr;  // [M][blocks]: each block's step divided by the code table's factor
    int64_t k_main = 0;  // K rounded down to a multiple of 64 (the rest: the portable loop)
    int64_t blocks = 0;  // blocks of 256 in k_main (the last one may be shorter)
    int16_t table[32] = {};  // the 16 code values times the table's factor (a power of two), twice over
    float factor = 1.0f;
    // the AVX512-BF16 loop instead (bf16dot_fits): x and table hold bfloat16 words (x in the same
    // order, each unit 1, the factor 1)
    bool bf16 = false;
};

// Whether the VNNI loop takes this layer (4-bit codes whose values times a power of two up to 16
// are integers within 2047, and so are the zero points times it, scale groups of 16, 32, 64, a
// multiple of 128 or the whole row, at least 64 columns), this CPU runs AVX512-VNNI and QSCHEME_CPU_GEMV_INT16 is not
// "0"; fills the table.
bool int16_fits(const Params &p, Int16Input &in);
// One bfloat16 row of x (in.k_main words read) into xq (k_main int16, in the loop's order) and unit
// (in.blocks steps); false where an element is not finite or a block's largest magnitude is outside
// [2**-100, 2**100]. Call only where int16_fits took the layer.
bool int16_words(const uint16_t *x, const Int16Input &in, int16_t *xq, float *unit);
// Rows [n0, n1) times m (<= INT16_ROWS) rows of x: acc[r * ldy + n] = the sum over k < in.k_main
// of row r, with integer products.
void gemv_int16_avx512(const Params &p, const Int16Input &in, int m, int64_t n0, int64_t n1, float *acc,
                       int64_t ldy);
// Whether the AVX512-BF16 loop takes m rows of x on a layer int16_fits took: this CPU runs
// AVX512-BF16, no zero points, every code value exact in bfloat16, groups of 16 or 32 (any group
// from m = 2), and it is wanted (QSCHEME_CPU_GEMV_BF16DOT=1, or unset on a CPU without AMX-BF16: on
// Intel's AMX CPUs VDPBF16PS issues at half the FMA's rate). With groups of 16 or 32 the integer loop
// converts and scales its sums every 64 elements where this one only scales them; with larger
// groups and one row of x the integer loop was faster (Zen 4: 1.1-1.5x), with 2-4 rows slower
// (1.1-1.25x). Sets in.bf16 and puts the code values' bfloat16 words in the table.
bool bf16dot_fits(const Params &p, int64_t m, Int16Input &in);
// One bfloat16 row of x (k_main words read, a multiple of 64) into xq in the loop's order; false
// where an element is nonzero and its magnitude outside [2**-100, 2**64] (not finite included): the
// products and sums then stay clear of the subnormals the instruction flushes, and of overflows the
// reference's order (scale times code first) avoids. Call only where bf16dot_fits took the layer.
bool bf16dot_words(const uint16_t *x, int64_t k_main, int16_t *xq);
// As gemv_int16_avx512, with bfloat16 products summed in float32 (VDPBF16PS).
void gemv_bf16dot_avx512(const Params &p, const Int16Input &in, int m, int64_t n0, int64_t n1, float *acc,
                         int64_t ldy);

// Rows [n0, n1) dequantized into out (float32 or bfloat16 rows of K), as the reference does.
void dequantize_avx512(const Params &p, int64_t n0, int64_t n1, void *out, int out_bf16);

inline int64_t chunk_elements(const Params &p, int width) { return p.code_kind == CODE_NIBBLE ? 2 * width : width; }

}  // namespace qscheme_gemv
