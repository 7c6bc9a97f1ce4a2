// qscheme._tile_gemm: shared declarations of the tile decoder and the fused tile GEMM (tile_gemm.cpp).
//
// A layer is the canonical tensors as qscheme.cpu_gemv.layout_of describes them (codes never
// repacked, scales in their stored type, int16 zero points, an optional float32 per-row factor,
// the 16 values of a 4-bit code). Each weight is the reference's float32 value,
// fp32((value - zero) * effective_scale), rounded once to bfloat16 (round to nearest, ties to even).
#pragma once

#include <cstdint>

#include "byte_scales.h"

namespace qscheme_tile {

enum CodeKind : int { CODE_NIBBLE = 0, CODE_E4M3 = 1, CODE_INT8 = 2, CODE_UINT8 = 3 };
enum ScaleKind : int { SCALE_NONE = 0, SCALE_F32 = 1, SCALE_BF16 = 2, SCALE_F16 = 3, SCALE_BYTE = 4 };
using qscheme_bytes::BYTE_E4M3;
using qscheme_bytes::BYTE_E8M0;
using qscheme_bytes::BYTE_TABLE;

struct Layer {
    const uint8_t *codes = nullptr;
    int64_t code_stride = 0;  // bytes per row
    int code_kind = CODE_NIBBLE;
    float lut[16] = {};  // values of the 16 nibble codes
    const void *scale = nullptr;
    int scale_kind = SCALE_NONE;
    float scale_table[256] = {};  // values of the 256 scale bytes (SCALE_BYTE)
    int byte_format = BYTE_TABLE;  // the table is e4m3's or e8m0's values: decoded by arithmetic
    int64_t scale_cols = 1, group_n = 1, group_k = 1;
    const int16_t *zero = nullptr;  // indexed as the scale
    const float *row_scale = nullptr;  // [N]: effective = scale * row (or / row, or row alone)
    int row_divide = 0;
    int64_t n = 0, k = 0;
};

// Row n's effective scales of groups [g0, g1) and zero points (as float; 0 without) into s[g], z[g].
void row_scales(const Layer &p, int64_t n, int64_t g0, int64_t g1, float *s, float *z);
void row_scales_avx512(const Layer &p, int64_t n, int64_t g0, int64_t g1, float *s, float *z);

// The reference float32 value of weight (n, k) given row n's scales (the portable decoder).
float weight_value(const Layer &p, const uint8_t *row, const float *s, const float *z, int64_t k);

uint16_t float_to_bf16(float f);

// Whether the AVX-512 / AMX loops were compiled (x86 and a compiler with AMX intrinsics).
bool vector_compiled();

// Row n's bfloat16 weights for k in [k0, k1) into out[k - k0] (k0 a multiple of 32), as far as the
// vector decoder takes them (whole chunks of 32 within K, the layer's groups permitting): returns
// the k it stopped at (k0 where it takes nothing), the rest left to the portable decoder. fetch:
// codes to prefetch alongside, at the same offsets as the row's (or nullptr).
int64_t decode_row_avx512(const Layer &p, int64_t n, const float *s, const float *z, int64_t k0, int64_t k1,
                          uint16_t *out, const uint8_t *fetch = nullptr);

// Row n's bfloat16 weights for k in [k0, k1) (k0 a multiple of 32) into out, zero past K, given
// the row's effective scales and zero points (s, z: every group of the row, as row_scales gives
// them); the same columns of row n + 1 are prefetched meanwhile.
void decode_chunk(const Layer &p, int64_t n, int64_t k0, int64_t k1, uint16_t *out, const float *s, const float *z);

// Columns a panel row of gemm_rows_amx holds past its chunk, so that its rows are not a power of
// two apart (16 rows a tile reads would share a set of the L1 cache).
constexpr int64_t PANEL_PAD = 32;

// What the fused GEMM applies to each row of x as it pads it (qscheme.emulation.prepare_input's pass,
// act_quant.h: the AWQ pre-scale, then an FP8 or int8 rule's quantize-dequantize, the float32 values
// rounded once to bfloat16), so that the input needs no pass of its own; mode NONE with no pre-scale
// (or no InputPass) copies the row.
struct InputPass {
    int mode;                // qscheme_act::Mode
    int64_t group;           // E4M3_GROUP's block length
    float scale;             // E4M3_STATIC's scale
    const float *pre_scale;  // K multipliers, or null
};

// Whether this CPU and kernel run AMX tiles (asks the kernel for the tile state once).
bool amx_ready();

// The fused GEMM on AMX over weight rows [q0, q1) (a multiple of 32 rows from r0; rows past r1 are
// zeros and not written): out[i, n - r0] (bfloat16, row stride ldy) = sum_k x[i, k] w[n, k]
// (+ bias[n]), x packed by pack_block (mp rows, a multiple of 16; kp columns, a multiple of 32),
// K taken kc columns at a time. panel: (q1 - q0) * (kc + PANEL_PAD) bfloat16; acc: (q1 - q0) * (mp rounded up
// to 32) float32; s, z: scale_cols floats each.
void gemm_rows_amx(const Layer &p, const uint32_t *xp, int64_t m, int64_t mp, int64_t kp, const float *bias,
                   uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int64_t q0, int64_t q1, int64_t kc,
                   uint16_t *panel, float *acc, float *s, float *z);

// The fused GEMM on AVX-512 BF16 (VDPBF16PS) over weight rows [q0, q1) (a multiple of 32 rows
// from r0; rows past r1 are not decoded or written): out[i, n - r0] as gemm_rows_amx's, x being m
// rows of kp bfloat16 (a multiple of 32, zeros past K), K taken kc columns at a time; its first mp
// rows (0 or a multiple of 16) also packed by pack_pairs_bf16 into xv, one block of 16 rows every
// 16 * kp words. panel: (q1 - q0) * (kc + PANEL_PAD) bfloat16; acc: m * (q1 - q0) float32; s, z:
// (q1 - q0) * scale_cols floats.
void gemm_rows_bf16(const Layer &p, const uint16_t *x, int64_t m, int64_t kp, const uint16_t *xv, int64_t mp,
                    const float *bias, uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int64_t q0, int64_t q1,
                    int64_t kc, uint16_t *panel, float *acc, float *s, float *z);

// 16 rows of x (ldx apart, kp columns, a multiple of 32) as pairs of k: xv[32 t + 2 j + e] = x[j][2 t + e].
void pack_pairs_bf16(const uint16_t *x, int64_t ldx, int64_t kp, uint16_t *xv);

// How many of m input rows gemm_rows_bf16 multiplies as packed pairs (tile_gemm_bf16_kernel.h's pair_rows).
int64_t pair_rows_bf16(int64_t m);

}  // namespace qscheme_tile
