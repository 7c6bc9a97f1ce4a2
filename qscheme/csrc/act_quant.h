// qscheme._cpu_gemv.prepare_input and activation_codes: the exact activation quantize-dequantize of
// qscheme.emulation for the FP8 (e4m3) and int8 rules, in one pass over the input (act_quant.cpp).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace qscheme_act {

// The rules (qscheme.emulation.SUPPORTED_ACTIVATIONS) this pass computes; NONE: no quantization
// (prepare_input with a pre-scale alone).
enum Mode : int { E4M3_STATIC = 0, E4M3_TOKEN = 1, E4M3_GROUP = 2, INT8_TOKEN = 3, NONE = 4 };

// One pass's arguments (rows [0, m) of x, rows of k; see run_pass).
struct Pass {
    const void *x;
    bool bf16;               // x is bfloat16 (else float32)
    void *out;               // m x k values
    bool out_bf16;           // out is bfloat16, each float32 value rounded to nearest even (else float32)
    int64_t m, k;
    int mode;                // Mode
    int64_t group;           // E4M3_GROUP's block length
    float scale;             // E4M3_STATIC's scale
    const float *pre_scale;  // k multipliers applied (float32 product) before quantizing, or null
    float *scales;           // with it: out receives the codes' values, scales each block's s (row by row)
};

// Whether mode, group and scale make a pass run_pass computes: a mode of this enum, a group of at least
// one element for E4M3_GROUP, a positive finite scale for E4M3_STATIC.
bool rule_valid(int mode, int64_t group, float scale);

// Elements per block (a row for the per-token and static rules), and blocks per row.
inline int64_t block_length(const Pass &pass) { return pass.mode == E4M3_GROUP ? pass.group : pass.k; }
inline int64_t blocks_per_row(const Pass &pass) { return (pass.k + block_length(pass) - 1) / block_length(pass); }

// Rows [0, m) of x (float32 or bfloat16, rows of k), each element first times its column's pre-scale
// where there is one (a float32 product), quantized and dequantized into out: a block of `group`
// elements (a row for per-token rules and the static scale) shares the scale s (static: `scale`;
// dynamic: absmax / 448 or / 127.5, float32 eps when zero), and each element becomes round(x / s) * s,
// round being e4m3's saturating round to nearest even or int8's clamp(round half even) (an int8 zero
// is +0.0); NONE leaves the values. With `scales` (one float per block, row by row), out receives
// round(x / s) alone, the code's value, and scales each block's s. Its rows are shared out over
// `threads` workers (qscheme_threads) where the pass is large enough to gain.
void run_pass(const Pass &pass, bool vector, int threads);

// Rows [r0, r1) of `pass` on the calling thread (the AVX-512 loop where `vector` and the CPU has it):
// for callers that share rows out themselves (qscheme._tile_gemm pads each row of x this way).
void pass_rows(const Pass &pass, int64_t r0, int64_t r1, bool vector);

// Rows [0, m) of x quantized by the int8 per-token rule (INT8_TOKEN: the same arithmetic) into their
// codes plus 128 (row r at codes + r * stride; bytes [k, stride) of a row set to 0) and scales.
void int8_codes(const void *x, bool bf16, int64_t m, int64_t k, uint8_t *codes, int64_t stride, float *scales,
                bool vector);

// Whether none of x's n elements (float32, bfloat16 or float16: `dtype` 0, 1 or 2) is inf or NaN.
bool all_finite(const void *x, int dtype, int64_t n, bool vector);

// Whether the AVX-512 pass was compiled (x86 and a compiler that has its intrinsics).
bool vector_compiled();

// activation_codes(x, bf16, out, scales, m, k, mode, group, scale, vector): run_pass with `scales`
// (addresses as ints), float32 out, one thread.
PyObject *activation_codes_method(PyObject *, PyObject *args);

// prepare_input(x, bf16, out, out_bf16, pre_scale, m, k, mode, group, scale, vector, threads): run_pass
// without scales (addresses as ints, pre_scale 0 for none): the input the tile GEMMs multiply.
PyObject *prepare_input_method(PyObject *, PyObject *args);

// all_finite(x, dtype, n): the Python method (True or False).
PyObject *all_finite_method(PyObject *, PyObject *args);

}  // namespace qscheme_act
