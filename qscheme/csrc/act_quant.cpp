/* qscheme._cpu_gemv.prepare_input and activation_codes: qscheme.emulation's FP8 (e4m3) and int8 activation
 * quantize-dequantize in one pass, bit for bit the torch path's float32 arithmetic (act_quant.h).
 *
 * Per block: s = absmax / 448 (e4m3) or / 127.5 (int8), float32 division, FLT_EPSILON where it is 0,
 * or the static scale; then each element x / s (float32 division) rounded (e4m3: |v| >= 448 gives 448,
 * below 2**-6 to a multiple of 2**-9, otherwise to 3 mantissa bits, ties to even; int8: clamped
 * to [-128, 127], rounded half to even, a zero made +0.0 as the int8 code is) and multiplied by s.
 * prepare_input adds the AWQ pre-scale (each element times its column's multiplier, a float32 product,
 * before the rule) and a bfloat16 output (torch's rounding of the float32 value), so that the tile
 * GEMMs' input is one pass, not torch's four. The portable loop here; the AVX-512 one in
 * act_quant_avx512.cpp.
 */
#include "act_quant.h"

#include "thread_pool.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace qscheme_act {

void pass_rows_avx512(const Pass &pass, int64_t r0, int64_t r1);
bool all_finite_avx512(const void *x, int dtype, int64_t n);
void int8_codes_avx512(const void *x, bool bf16, int64_t m, int64_t k, uint8_t *codes, int64_t stride, float *scales);

namespace {

float load(const void *x, bool bf16, int64_t i) {
    if (!bf16) return static_cast<const float *>(x)[i];
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t *>(x)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Element i of the pass's input, times its pre-scale where it has one (a float32 product).
float input(const Pass &pass, int64_t row, int64_t i) {
    const float v = load(pass.x, pass.bf16, row * pass.k + i);
    return pass.pre_scale ? v * pass.pre_scale[i] : v;
}

// float32 to bfloat16, rounded to nearest even (NaN to 0x7FC0), as torch's conversion.
uint16_t to_bf16(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void store(const Pass &pass, int64_t i, float v) {
    if (pass.out_bf16)
        static_cast<uint16_t *>(pass.out)[i] = to_bf16(v);
    else
        static_cast<float *>(pass.out)[i] = v;
}

float round_e4m3(float v) {
    const float a = std::fabs(v);
    float r;
    if (a >= 448.0f) {
        r = 448.0f;
    } else if (a < 0.015625f) {  // e4m3 subnormals: multiples of 2**-9
        r = std::nearbyint(a * 512.0f) * (1.0f / 512.0f);
    } else {
        uint32_t bits;
        std::memcpy(&bits, &a, 4);
        bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
        std::memcpy(&r, &bits, 4);
    }
    return std::copysign(r, v);
}

float round_int8(float v) { return std::nearbyint(std::min(std::max(v, -128.0f), 127.0f)) + 0.0f; }

// s over elements [g0, g1) of a row: absmax / range (float32 division), FLT_EPSILON where it is 0.
float dynamic_scale(const Pass &pass, int64_t row, int64_t g0, int64_t g1, float range) {
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; i++) amax = std::max(amax, std::fabs(input(pass, row, i)));
    const float s = amax / range;
    return s == 0.0f ? FLT_EPSILON : s;
}

void pass_rows_portable(const Pass &pass, int64_t r0, int64_t r1) {
    const int64_t k = pass.k, length = block_length(pass);
    const bool e4m3 = pass.mode != INT8_TOKEN;
    const float range = e4m3 ? 448.0f : 127.5f;
    float *scales = pass.scales ? pass.scales + r0 * blocks_per_row(pass) : nullptr;
    for (int64_t row = r0; row < r1; row++) {
        const int64_t base = row * k;
        if (pass.mode == NONE) {
            for (int64_t i = 0; i < k; i++) store(pass, base + i, input(pass, row, i));
            continue;
        }
        for (int64_t g0 = 0; g0 < k; g0 += length) {
            const int64_t g1 = std::min(k, g0 + length);
            const float s = pass.mode == E4M3_STATIC ? pass.scale : dynamic_scale(pass, row, g0, g1, range);
            if (scales) *scales++ = s;
            for (int64_t i = g0; i < g1; i++) {
                const float v = input(pass, row, i) / s, code = e4m3 ? round_e4m3(v) : round_int8(v);
                store(pass, base + i, scales ? code : code * s);
            }
        }
    }
}

bool all_finite_portable(const void *x, int dtype, int64_t n) {
    if (dtype == 0) {  // float32: an exponent field of all ones is inf or NaN
        const uint32_t *w = static_cast<const uint32_t *>(x);
        uint32_t bad = 0;
        for (int64_t i = 0; i < n; i++) bad |= static_cast<uint32_t>((w[i] & 0x7F800000u) == 0x7F800000u);
        return bad == 0;
    }
    const uint16_t field = dtype == 1 ? 0x7F80u : 0x7C00u;  // bfloat16, float16
    const uint16_t *w = static_cast<const uint16_t *>(x);
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= static_cast<uint32_t>((w[i] & field) == field);
    return bad == 0;
}

void int8_codes_portable(const void *x, bool bf16, int64_t m, int64_t k, uint8_t *codes, int64_t stride,
                         float *scales) {
    const Pass pass{x, bf16, nullptr, false, m, k, INT8_TOKEN, 0, 0.0f, nullptr, nullptr};
    for (int64_t row = 0; row < m; row++) {
        const float s = scales[row] = dynamic_scale(pass, row, 0, k, 127.5f);
        uint8_t *out = codes + row * stride;
        for (int64_t i = 0; i < k; i++)
            out[i] = static_cast<uint8_t>(static_cast<int>(round_int8(input(pass, row, i) / s)) + 128);
        std::memset(out + k, 0, static_cast<size_t>(stride - k));
    }
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
    if (!vector_compiled()) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
    return false;
#endif
}

}  // namespace

void pass_rows(const Pass &pass, int64_t r0, int64_t r1, bool vector) {
    static const bool avx512 = cpu_has_avx512();
    if (vector && avx512)
        pass_rows_avx512(pass, r0, r1);
    else
        pass_rows_portable(pass, r0, r1);
}

void run_pass(const Pass &pass, bool vector, int threads) {
    // tasks of whole rows, at least 64K elements each (below that a worker's start costs more)
    const int64_t rows = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, pass.k));
    const int64_t tasks = (pass.m + rows - 1) / rows;
    qscheme_threads::run_tasks(threads, tasks, [&](int64_t task) {
        const int64_t r0 = task * rows;
        pass_rows(pass, r0, std::min(pass.m, r0 + rows), vector);
    });
}

bool rule_valid(int mode, int64_t group, float scale) {
    return mode >= E4M3_STATIC && mode <= NONE && (mode != E4M3_GROUP || group >= 1) &&
           (mode != E4M3_STATIC || (scale > 0.0f && std::isfinite(scale)));
}

bool all_finite(const void *x, int dtype, int64_t n, bool vector) {
    static const bool avx512 = cpu_has_avx512();
    return vector && avx512 ? all_finite_avx512(x, dtype, n) : all_finite_portable(x, dtype, n);
}

void int8_codes(const void *x, bool bf16, int64_t m, int64_t k, uint8_t *codes, int64_t stride, float *scales,
                bool vector) {
    static const bool avx512 = cpu_has_avx512();
    if (vector && avx512)
        int8_codes_avx512(x, bf16, m, k, codes, stride, scales);
    else
        int8_codes_portable(x, bf16, m, k, codes, stride, scales);
}

namespace {

// run_pass over addresses given as ints, the GIL released meanwhile.
PyObject *run_method(unsigned long long x, int bf16, unsigned long long out, int out_bf16, unsigned long long pre_scale,
                     unsigned long long scales, long long m, long long k, int mode, long long group, float scale,
                     int vector, int threads) {
    const Pass pass{reinterpret_cast<const void *>(static_cast<uintptr_t>(x)), bf16 != 0,
                    reinterpret_cast<void *>(static_cast<uintptr_t>(out)), out_bf16 != 0, m, k, mode, group, scale,
                    reinterpret_cast<const float *>(static_cast<uintptr_t>(pre_scale)),
                    reinterpret_cast<float *>(static_cast<uintptr_t>(scales))};
    Py_BEGIN_ALLOW_THREADS;
    run_pass(pass, vector != 0, threads);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

}  // namespace

PyObject *activation_codes_method(PyObject *, PyObject *args) {
    unsigned long long x, out, scales;
    int bf16, mode, vector;
    long long m, k, group;
    float scale;
    if (!PyArg_ParseTuple(args, "KpKKLLiLfp", &x, &bf16, &out, &scales, &m, &k, &mode, &group, &scale, &vector))
        return nullptr;
    if (!x || !out || !scales || m < 0 || k < 1 || mode == NONE || !rule_valid(mode, group, scale)) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.activation_codes: inconsistent arguments");
        return nullptr;
    }
    return run_method(x, bf16, out, 0, 0, scales, m, k, mode, group, scale, vector, 1);
}

PyObject *prepare_input_method(PyObject *, PyObject *args) {
    unsigned long long x, out, pre_scale;
    int bf16, out_bf16, mode, vector, threads;
    long long m, k, group;
    float scale;
    if (!PyArg_ParseTuple(args, "KpKpKLLiLfpi", &x, &bf16, &out, &out_bf16, &pre_scale, &m, &k, &mode, &group, &scale,
                          &vector, &threads))
        return nullptr;
    if (!x || !out || m < 0 || k < 1 || !rule_valid(mode, group, scale) || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.prepare_input: inconsistent arguments");
        return nullptr;
    }
    return run_method(x, bf16, out, out_bf16, pre_scale, 0, m, k, mode, group, scale, vector, threads);
}

PyObject *all_finite_method(PyObject *, PyObject *args) {
    unsigned long long x;
    int dtype, vector;
    long long n;
    if (!PyArg_ParseTuple(args, "KiLp", &x, &dtype, &n, &vector)) return nullptr;
    if ((!x && n > 0) || n < 0 || dtype < 0 || dtype > 2) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.all_finite: inconsistent arguments");
        return nullptr;
    }
    bool finite;
    Py_BEGIN_ALLOW_THREADS;
    finite = all_finite(reinterpret_cast<const void *>(static_cast<uintptr_t>(x)), dtype, n, vector != 0);
    Py_END_ALLOW_THREADS;
    if (finite) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

}  // namespace qscheme_act
