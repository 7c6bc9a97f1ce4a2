// qscheme._int8_gemm: y = x W^T for int8 weights and int8 per-token activations, with the products
// summed exactly in 32-bit integers (int8_gemm.cpp; the AVX512-VNNI loops in int8_gemm_vnni.cpp).
//
// The input arrives quantized as unsigned bytes (act_quant.h: int8_codes): each int8 code q of
// compressed-tensors' per-token rule (s = absmax / 127.5, q = round-half-even(clamp(x / s, -128, 127)))
// stored as q + 128, which is the operand VPDPBUSD multiplies unsigned. For a weight row w, sum_k (q_k + 128) w_k = sum_k q_k w_k +
// 128 sum_k w_k, so the exact dot product is that sum minus 128 times the row's sum of codes
// (`w_sum`, computed once per layer). Both sides are exact integers while K < 2**17 (|q w| <= 2**14),
// computed modulo 2**32 on the way, so any wrap of a partial sum cancels.
//
// Each output element is then, in float32, one rounding per operation and no fused multiply-add:
//     y = float(dot) * x_scale[m] * w_scale[n] (+ bias[n]),
// rounded once to bfloat16 where the output is bfloat16 (ties to even). The portable and the VNNI loops
// give the same bits.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace qscheme_int8 {

constexpr int64_t MAX_K = (int64_t{1} << 17) - 1;  // |dot| <= K * 2**14 < 2**31

struct Problem {
    const uint8_t *x = nullptr;  // [m, k] codes + 128, rows of x_stride bytes (a multiple of 4, zeros past k)
    int64_t x_stride = 0;
    const float *x_scale = nullptr;  // [m]
    int64_t m = 0;
    const int8_t *w = nullptr;  // [n, k] rows of w_stride bytes
    int64_t w_stride = 0;
    const int32_t *w_sum = nullptr;  // [n]: sum_k w[n, k]
    const float *w_scale = nullptr;  // [n]
    const float *bias = nullptr;  // [n] or null
    void *out = nullptr;  // [m, ldy] float32 or bfloat16
    bool out_bf16 = false;
    int64_t ldy = 0, n = 0, k = 0;
};

// The exact dot product from the unsigned-input sum (modulo 2**32, see above).
inline int32_t exact_dot(uint32_t unsigned_sum, int32_t w_sum) {
    return static_cast<int32_t>(unsigned_sum - static_cast<uint32_t>(w_sum) * 128u);
}

inline uint16_t to_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(bits >> 16);
}

// v as it is, through memory: the compiler cannot fuse the product that made it with an addition.
inline float rounded(float v) {
    __asm__ volatile("" : "+m"(v));
    return v;
}

// y[m, n] from the exact dot product, as the header says; stored as the problem's output dtype.
inline void store(const Problem &p, int64_t row, int64_t n, int32_t dot) {
    float y = static_cast<float>(dot) * p.x_scale[row];
    y = y * p.w_scale[n];
    if (p.bias) y = rounded(y) + p.bias[n];
    if (p.out_bf16)
        static_cast<uint16_t *>(p.out)[row * p.ldy + n] = to_bf16(y);
    else
        static_cast<float *>(p.out)[row * p.ldy + n] = y;
}

// Rows [n0, n1) of the weight times every row of x.
void rows_portable(const Problem &p, int64_t n0, int64_t n1);
void rows_vnni(const Problem &p, int64_t n0, int64_t n1);

// From PANEL_M rows of x, the VNNI loops take the weight in panels of PANEL_N rows instead:
// panels [panel0, panel1) times every row of x.
constexpr int64_t PANEL_M = 16, PANEL_N = 64;
void panels_vnni(const Problem &p, int64_t panel0, int64_t panel1);

// Whether int8_gemm_vnni.cpp was compiled with its loops (x86 and a compiler with the intrinsics).
bool vnni_compiled();

}  // namespace qscheme_int8
