/* qscheme._cpu_gemv: a GEMV over canonical quantized weights on the CPU, decoded in registers.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x (float32 or bfloat16), where
 * w[n, k] = fp32((value(code[n, k]) - zero) * effective_scale) is formed chunk by chunk in
 * registers exactly as qscheme's reference dequantization forms it, and never stored. The
 * products are summed in float32 (fused multiply-add, in another order than the reference's
 * matmul) and the output rounded once to x's dtype. Codes: two 4-bit codes per byte through a
 * 16-entry value table (e2m1, int4, uint4, lookup tables), e4m3, int8 and uint8 bytes. Scales:
 * float32, bfloat16, float16 or a byte format through a 256-entry value table (e4m3, e8m0), in any
 * group x block tiling, times or over a float32 per-row factor (per-partition global scales).
 *
 * Vector loops for AVX-512 and AVX2 (cpu_gemv_avx512.cpp, cpu_gemv_avx2.cpp), chosen at run time
 * by cpuid; a portable scalar loop otherwise, for the remainder of K past the last whole chunk,
 * and for group sizes the vector loops do not tile. set_isa / QSCHEME_CPU_GEMV_ISA (read by the
 * Python wrapper) choose narrower loops. Rows of the weight are split over a pool of worker
 * threads (the caller passes the count); the GIL is released meanwhile. No torch headers: the
 * Python wrapper (qscheme.cpu_gemv) passes the tensors' addresses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu_gemv.h"
#include "cpu_gemv_amx.h"
#include "thread_pool.h"
#include "cpu_gemv_gguf.h"
#include "act_quant.h"

namespace qscheme_gemv {

void halves_to_floats(const uint16_t *h, float *out, int64_t n) {
#if defined(__x86_64__) || defined(__i386__)
    static const bool f16c = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("f16c") != 0;
    }();
    if (f16c) return halves_to_floats_f16c(h, out, n);
#endif
    for (int64_t i = 0; i < n; i++) out[i] = half_value(h[i]);
}

static float e4m3_value(uint8_t b) {
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
    if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
    return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);  // 0x7F / 0xFF: 480 (as the vector loops)
}

static inline float code_value(const Params &p, const uint8_t *row, int64_t k) {
    switch (p.code_kind) {
        case CODE_NIBBLE: return p.lut[(row[k >> 1] >> ((k & 1) * 4)) & 0xF];
        case CODE_E4M3:
        case CODE_E4M3_X256: return e4m3_value(row[k]);
        case CODE_INT8: return static_cast<float>(static_cast<int8_t>(row[k]));
        default: return static_cast<float>(row[k]);
    }
}

static inline float weight_value(const Params &p, const uint8_t *row, int64_t base, int64_t n, int64_t k) {
    const int64_t g = base + k / p.group_k;
    float v = code_value(p, row, k);
    if (p.zero) v = v - static_cast<float>(p.zero[g]);
    return v * scale_value(p, g, n);
}

bool vector_fits(const Params &p, int width) {
    if (p.code_kind == CODE_NIBBLE) return p.group_k == width || p.group_k % (2 * width) == 0;
    return p.group_k % width == 0;
}

}  // namespace qscheme_gemv

namespace qscheme_gemv {

// A CPU feature, asked once (__builtin_cpu_supports takes a literal name); false off x86.
#if defined(__x86_64__) || defined(__i386__)
#define QS_CPU_FEATURE(name)                                                \
    [] {                                                                    \
        static const bool supported = [] {                                  \
            __builtin_cpu_init();                                           \
            return __builtin_cpu_supports(name) != 0;                       \
        }();                                                                \
        return supported;                                                   \
    }()
#else
#define QS_CPU_FEATURE(name) false
#endif

static bool vnni_supported() { return QS_CPU_FEATURE("avx512vnni"); }

bool int16_fits(const Params &p, Int16Input &in) {
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_INT16");
    if ((setting && setting[0] == '0') || !vnni_supported()) return false;
    if (p.code_kind != CODE_NIBBLE || p.k < 64) return false;
    // a chunk of 128 (cpu_gemv_dot_kernel.h) never straddles two groups of a multiple of 128
    if (!(p.group_k == 16 || p.group_k == 32 || p.group_k == 64 || p.group_k % 128 == 0 || p.group_k >= p.k))
        return false;
    for (int shift = 0; shift <= 4; shift++) {  // the smallest power of two making every value an integer
        const float factor = static_cast<float>(1 << shift);
        bool integral = true;
        for (int i = 0; i < 16 && integral; i++) {
            const float v = p.lut[i] * factor;  // exact: a power of two
            integral = std::isfinite(v) && std::fabs(v) <= 2047.0f && v == std::nearbyint(v);
        }
        if (!integral || (p.zero && static_cast<double>(p.zero_max) * factor > 2047.0)) continue;
        // twice over: VPERMW reads five bits of each index, the fifth another code's
        for (int i = 0; i < 32; i++) in.table[i] = static_cast<int16_t>(p.lut[i % 16] * factor);
        in.factor = factor;
        in.k_main = (p.k / 64) * 64;
        in.blocks = (in.k_main + 255) / 256;
        return true;
    }
    return false;
}

static bool bf16_supported() { return QS_CPU_FEATURE("avx512bf16"); }

static bool bf16_word(float v, int16_t &word) {  // v as a bfloat16 word, where it is one exactly (and not subnormal)
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if ((bits & 0xFFFFu) || !std::isfinite(v) || (v != 0.0f && std::fabs(v) < 0x1p-126f)) return false;
    word = static_cast<int16_t>(bits >> 16);
    return true;
}

// Whether the AVX512-BF16 loop is wanted: QSCHEME_CPU_GEMV_BF16DOT=0 / 1 (read at each call); by default
// everywhere but on CPUs with AMX-BF16 (Intel), where VDPBF16PS issues at half the FMA's rate and the integer
// loop ran 1.2-1.6x faster (NVFP4A16, MXFP4A16, W4A16 at M = 1-3).
static bool bf16dot_wanted() {
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_BF16DOT");
    if (setting && (setting[0] == '0' || setting[0] == '1')) return setting[0] == '1';
    return !slow_bf16_dot();
}

bool bf16dot_fits(const Params &p, int64_t m, Int16Input &in) {
    if (!bf16dot_wanted() || !bf16_supported() || p.zero) return false;
    if (!(p.group_k == 16 || p.group_k == 32 || m >= 2)) return false;
    int16_t table[32] = {};
    for (int i = 0; i < 32; i++)  // twice over, as int16_fits's
        if (!bf16_word(p.lut[i % 16], table[i])) return false;
    std::memcpy(in.table, table, sizeof(table));
    in.factor = 1.0f;
    in.bf16 = true;
    return true;
}

}  // namespace qscheme_gemv

using namespace qscheme_gemv;

namespace {

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
const char *const ISA_NAMES[] = {"scalar", "avx2", "avx512"};

int isa_supported() {
    int found = ISA_SCALAR;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
        found = ISA_AVX512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        found = ISA_AVX2;
    }
#endif
    return found;
}

int isa_active = -1;

int isa_level() {
    if (isa_active < 0) isa_active = isa_supported();
    return isa_active;
}


/* The fewest weight rows per task of the GEMV (a multiple of the loops' 4-row blocks). */
constexpr int64_t TASK_ROWS = 64;

int64_t width_of(int level) { return level == ISA_AVX512 ? 16 : (level == ISA_AVX2 ? 8 : 0); }

/* The layer's integers (qscheme.cpu_gemv._layer_args): codes, code stride, code kind, lut, scale,
 * scale kind, scale table, scale columns, group rows, group columns, zero points, row scales, divide,
 * N, K, the largest |zero point|. */
constexpr int LAYER_INTS = 16;

/* Fill Params from the Python arguments (a tuple of ints; addresses as ints). */
bool parse_params(PyObject *args, Params &p, Py_ssize_t first) {
    long long v[LAYER_INTS];
    for (int i = 0; i < LAYER_INTS; i++) {
        PyObject *item = PyTuple_GetItem(args, first + i);
        if (!item) return false;
        v[i] = PyLong_AsLongLong(item);
        if (v[i] == -1 && PyErr_Occurred()) return false;
    }
    p.codes = reinterpret_cast<const uint8_t *>(static_cast<uintptr_t>(v[0]));
    p.code_stride = v[1];
    p.code_kind = static_cast<int>(v[2]);
    const float *lut = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[3]));
    p.scale = reinterpret_cast<const void *>(static_cast<uintptr_t>(v[4]));
    p.scale_kind = static_cast<int>(v[5]);
    const float *table = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[6]));
    p.scale_cols = v[7];
    p.group_n = v[8];
    p.group_k = v[9];
    p.zero = reinterpret_cast<const int16_t *>(static_cast<uintptr_t>(v[10]));
    p.row_scale = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[11]));
    p.row_divide = static_cast<int>(v[12]);
    p.n = v[13];
    p.k = v[14];
    p.zero_max = v[15];
    if (p.code_kind < CODE_NIBBLE || p.code_kind > CODE_UINT8 || p.scale_kind < SCALE_NONE ||
        p.scale_kind > SCALE_BYTE || p.scale_cols < 1 || p.group_n < 1 || p.group_k < 1 || p.n < 0 || p.k < 0 || p.zero_max < 0 ||
        !p.codes || (p.scale_kind != SCALE_NONE && !p.scale) || (p.scale_kind == SCALE_NONE && !p.row_scale) ||
        (p.code_kind == CODE_NIBBLE && !lut) || (p.scale_kind == SCALE_BYTE && !table)) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv: inconsistent layer description");
        return false;
    }
    static std::atomic<uint64_t> calls{0};
    p.serial = ++calls;
    if (lut) std::memcpy(p.lut, lut, sizeof(p.lut));
    if (table) {
        std::memcpy(p.scale_table, table, sizeof(p.scale_table));
        p.byte_format = qscheme_bytes::byte_format_of(p.scale_table);
    }
    return true;
}

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(bits >> 16);
}

/* gemv(x, x_bf16, m, out, out_bf16, bias, threads, <16 layer ints>): out[m, N] = x[m, K] W^T + bias. */
PyObject *gemv(PyObject *, PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != 7 + LAYER_INTS) {
        PyErr_SetString(PyExc_TypeError, "qscheme._cpu_gemv.gemv takes 23 integer arguments");
        return nullptr;
    }
    long long head[7];
    for (int i = 0; i < 7; i++) {
        head[i] = PyLong_AsLongLong(PyTuple_GetItem(args, i));
        if (head[i] == -1 && PyErr_Occurred()) return nullptr;
    }
    Params p;
    if (!parse_params(args, p, 7)) return nullptr;
    const void *x = reinterpret_cast<const void *>(static_cast<uintptr_t>(head[0]));
    const int x_bf16 = static_cast<int>(head[1]);
    const int64_t m = head[2];
    void *out = reinterpret_cast<void *>(static_cast<uintptr_t>(head[3]));
    const int out_bf16 = static_cast<int>(head[4]);
    const float *bias = reinterpret_cast<const float *>(static_cast<uintptr_t>(head[5]));
    const int threads = static_cast<int>(std::max(1LL, std::min(head[6], 256LL)));
    if (m < 0 || !x || !out) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.gemv: inconsistent sizes");
        return nullptr;
    }
    if (m == 0 || p.n == 0) Py_RETURN_NONE;

    Py_BEGIN_ALLOW_THREADS;
    int level = isa_level();
    if (level != ISA_SCALAR && !vector_fits(p, static_cast<int>(width_of(level)))) level = ISA_SCALAR;
    const int64_t width = width_of(level);
    const int64_t ce = level == ISA_SCALAR ? 1 : chunk_elements(p, static_cast<int>(width));
    const int64_t ldx = ((p.k + 15) / 16) * 16;
    // x as float32
    std::vector<float> xs(static_cast<size_t>(m * ldx), 0.0f);
    for (int64_t r = 0; r < m; r++) {
        if (x_bf16) {
            const uint16_t *row = static_cast<const uint16_t *>(x) + r * p.k;
            for (int64_t k = 0; k < p.k; k++) xs[r * ldx + k] = bf16_to_float(row[k]);
        } else {
            std::memcpy(xs.data() + r * ldx, static_cast<const float *>(x) + r * p.k, static_cast<size_t>(p.k) * 4);
        }
    }
    Int16Input in16;
    std::vector<int16_t> xq16;
    std::vector<float> unit16;
    // up to four bfloat16 rows of x and 4-bit codes on VNNI, unless the tiles go ahead (amx_ahead: MXFP4-like
    // layers at M = 4, every M where QSCHEME_CPU_GEMV_AMX=all sends it to them)
    bool int16 = level == ISA_AVX512 && m <= INT16_ROWS && x_bf16 && !amx_ahead(p, static_cast<int>(m)) &&
                 int16_fits(p, in16);
    if (int16) {
        xq16.resize(static_cast<size_t>(m * in16.k_main));
        unit16.resize(static_cast<size_t>(m * in16.blocks));
        Int16Input bf = in16;  // the AVX512-BF16 loop where it takes the layer and x, else the VNNI one
        bool words = bf16dot_fits(p, m, bf);
        for (int64_t r = 0; r < m && words; r++)
            words = bf16dot_words(static_cast<const uint16_t *>(x) + r * p.k, in16.k_main, xq16.data() + r * in16.k_main);
        if (words) {
            in16 = bf;
            std::fill(unit16.begin(), unit16.end(), 1.0f);
        }
        for (int64_t r = 0; r < m && int16 && !words; r++)
            int16 = int16_words(static_cast<const uint16_t *>(x) + r * p.k, in16, xq16.data() + r * in16.k_main,
                                unit16.data() + r * in16.blocks);
        in16.x = xq16.data();
        in16.unit = unit16.data();
    }
    const int64_t k_main = level == ISA_SCALAR ? 0 : (int16 ? in16.k_main : (p.k / ce) * ce);
    // the float32 loops: each whole chunk of a 4-bit layer reordered as its even then its odd elements
    for (int64_t r = 0; r < m && !int16; r++) {
        float *row = xs.data() + r * ldx;
        if (p.code_kind == CODE_NIBBLE && k_main > 0) {
            std::vector<float> chunk(static_cast<size_t>(ce));
            for (int64_t k0 = 0; k0 < k_main; k0 += ce) {
                for (int64_t i = 0; i < width; i++) {
                    chunk[i] = row[k0 + 2 * i];
                    chunk[width + i] = row[k0 + 2 * i + 1];
                }
                std::memcpy(row + k0, chunk.data(), static_cast<size_t>(ce) * 4);
            }
        }
    }
    // e4m3 codes on the float32 loops (where the tiles do not take them): x times 256, exact where
    // no finite element reaches 2**120, instead of a multiply by 256 of every decoded weight; the
    // products are the same numbers
    if (p.code_kind == CODE_E4M3 && level != ISA_SCALAR && (m < amx_min_rows(p) || !amx_usable())) {
        bool fits = true;
        for (const float v : xs) fits = fits && !(std::fabs(v) >= 0x1p120f && std::isfinite(v));
        if (fits) {
            for (float &v : xs) v *= 256.0f;
            p.code_kind = CODE_E4M3_X256;
        }
    }
    const float x_unit = p.code_kind == CODE_E4M3_X256 ? 1.0f / 256.0f : 1.0f;
    std::vector<float> acc(static_cast<size_t>(m * p.n), 0.0f);
    // one span of rows per worker (from memory, 1.02-1.06x faster than 64-row pieces shared out)
    const int64_t rows_per_task = qscheme_threads::span_rows(p.n, threads, TASK_ROWS);
    const int64_t tasks = (p.n + rows_per_task - 1) / rows_per_task;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    auto job = [&](int64_t task) {
        const int64_t lo = task * rows_per_task, hi = std::min(p.n, lo + rows_per_task);
#if defined(__x86_64__) || defined(__i386__)
        if (int16 && in16.bf16) {
            gemv_bf16dot_avx512(p, in16, static_cast<int>(m), lo, hi, acc.data(), p.n);
        } else if (int16) {
            gemv_int16_avx512(p, in16, static_cast<int>(m), lo, hi, acc.data(), p.n);
        } else if (level == ISA_AVX512) {
            gemv_avx512(p, xs.data(), ldx, static_cast<int>(m), lo, hi, acc.data(), p.n);
        } else if (level == ISA_AVX2) {
            gemv_avx2(p, xs.data(), ldx, static_cast<int>(m), lo, hi, acc.data(), p.n);
        }
#endif
        // the rest of K (all of it on the scalar path), in x's own order, then bias and rounding
        for (int64_t n = lo; n < hi; n++) {
            const uint8_t *row = p.codes + n * p.code_stride;
            const int64_t base = scale_row_base(p, n);
            for (int64_t r = 0; r < m; r++) {
                const float *xr = xs.data() + r * ldx;
                float sum = acc[r * p.n + n];
                for (int64_t k = k_main; k < p.k; k++) sum += (xr[k] * x_unit) * weight_value(p, row, base, n, k);
                if (bias) sum += bias[n];
                if (out_bf16)
                    static_cast<uint16_t *>(out)[r * p.n + n] = float_to_bf16(sum);
                else
                    static_cast<float *>(out)[r * p.n + n] = sum;
            }
        }
    };
    qscheme_threads::run_tasks(count, tasks, job);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* dequantize(out, out_bf16, n0, n1, threads, <16 layer ints>): rows [n0, n1) of the weight as
 * float32 or bfloat16 [n1 - n0, K], the reference's float32 values (rounded once to bfloat16). */
PyObject *dequantize(PyObject *, PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != 5 + LAYER_INTS) {
        PyErr_SetString(PyExc_TypeError, "qscheme._cpu_gemv.dequantize takes 21 integer arguments");
        return nullptr;
    }
    long long head[5];
    for (int i = 0; i < 5; i++) {
        head[i] = PyLong_AsLongLong(PyTuple_GetItem(args, i));
        if (head[i] == -1 && PyErr_Occurred()) return nullptr;
    }
    Params p;
    if (!parse_params(args, p, 5)) return nullptr;
    void *out = reinterpret_cast<void *>(static_cast<uintptr_t>(head[0]));
    const int out_bf16 = static_cast<int>(head[1]);
    const int64_t n0 = head[2], n1 = head[3];
    const int threads = static_cast<int>(std::max(1LL, std::min(head[4], 256LL)));
    if (!out || n0 < 0 || n1 < n0 || n1 > p.n) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.dequantize: rows out of range");
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS;
    const bool vector = isa_level() == ISA_AVX512 && (p.group_k % 16 == 0 || p.group_k >= p.k);
    const int64_t k_main = vector ? (p.k / chunk_elements(p, 16)) * chunk_elements(p, 16) : 0;
    const int64_t rows = n1 - n0, per_task = 16;
    const int64_t tasks = (rows + per_task - 1) / per_task;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    auto job = [&](int64_t task) {
        const int64_t lo = task * per_task, hi = std::min(rows, lo + per_task);
#if defined(__x86_64__) || defined(__i386__)
        if (vector) dequantize_avx512(p, n0 + lo, n0 + hi, static_cast<char *>(out) + lo * p.k * (out_bf16 ? 2 : 4),
                                      out_bf16);
#endif
        for (int64_t n = n0 + lo; n < n0 + hi; n++) {
            const uint8_t *row = p.codes + n * p.code_stride;
            const int64_t base = scale_row_base(p, n);
            for (int64_t k = k_main; k < p.k; k++) {
                const float w = weight_value(p, row, base, n, k);
                if (out_bf16)
                    static_cast<uint16_t *>(out)[(n - n0) * p.k + k] = float_to_bf16(w);
                else
                    static_cast<float *>(out)[(n - n0) * p.k + k] = w;
            }
        }
    };
    qscheme_threads::run_tasks(count, tasks, job);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* int16_layer(m, <16 layer ints>): which loop m (1 to 4) bfloat16 rows of x run on this layer: 0
 * neither of the two below, 1 the VNNI loop (the AVX-512 loops in use, the tiles not taking every M,
 * and int16_fits), 2 the AVX512-BF16 loop (also bf16dot_fits; x of elements zero or of magnitudes in [2**-100, 2**64]). */
PyObject *int16_layer(PyObject *, PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != 1 + LAYER_INTS) {
        PyErr_SetString(PyExc_TypeError, "qscheme._cpu_gemv.int16_layer takes 17 integer arguments");
        return nullptr;
    }
    const long long m = PyLong_AsLongLong(PyTuple_GetItem(args, 0));
    if (m == -1 && PyErr_Occurred()) return nullptr;
    Params p;
    if (!parse_params(args, p, 1)) return nullptr;
    Int16Input in;
    const bool runs = m >= 1 && m <= INT16_ROWS && isa_level() == ISA_AVX512 && vector_fits(p, 16) &&
                      !amx_ahead(p, static_cast<int>(m)) && int16_fits(p, in);
    return PyLong_FromLong(runs ? (bf16dot_fits(p, m, in) ? 2 : 1) : 0);
}

PyObject *isa(PyObject *, PyObject *) { return PyUnicode_FromString(ISA_NAMES[isa_level()]); }

PyObject *supported_isa(PyObject *, PyObject *) { return PyUnicode_FromString(ISA_NAMES[isa_supported()]); }

PyObject *set_isa(PyObject *, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
    for (int level = ISA_SCALAR; level <= ISA_AVX512; level++) {
        if (std::strcmp(name, ISA_NAMES[level]) == 0) {
            if (level > isa_supported()) {
                PyErr_Format(PyExc_ValueError, "qscheme._cpu_gemv.set_isa: this CPU does not run %s loops (it runs %s)",
                             name, ISA_NAMES[isa_supported()]);
                return nullptr;
            }
            isa_active = level;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "qscheme._cpu_gemv.set_isa: %s is not one of scalar, avx2, avx512", name);
    return nullptr;
}

}  // namespace

namespace qscheme_gemv {  // for the packed-block loops (cpu_gemv_gguf.cpp)
int active_isa() { return isa_level(); }
// VDPBF16PS at half the FMA's rate: the AMX-BF16 CPUs (Intel)
bool slow_bf16_dot() { return QS_CPU_FEATURE("amx-bf16"); }
void run_tasks(int threads, int64_t tasks, const std::function<void(int64_t)> &job) { qscheme_threads::run_tasks(threads, tasks, job); }
}  // namespace qscheme_gemv

namespace {

PyMethodDef methods[] = {
    {"gemv", gemv, METH_VARARGS, "y = x W^T (+ bias) over a canonical quantized weight (see qscheme.cpu_gemv)."},
    {"dequantize", dequantize, METH_VARARGS, "Rows of a canonical quantized weight as float32 or bfloat16."},
    {"isa", isa, METH_NOARGS, "The vector loops in use: 'avx512', 'avx2' or 'scalar'."},
    {"int16_layer", int16_layer, METH_VARARGS, "Which loop one to four bfloat16 rows of x run on this layer: 0 neither, 1 VNNI, 2 AVX512-BF16."},
    {"supported_isa", supported_isa, METH_NOARGS, "The widest vector loops this CPU runs."},
    {"set_isa", set_isa, METH_VARARGS, "Use the 'scalar', 'avx2' or 'avx512' loops (at most what the CPU runs)."},
    {"gemv_blocks", qscheme_gguf::gemv_blocks, METH_VARARGS, "y = x W^T (+ bias) over packed blocks (qscheme.cpu_gemv_blocks)."},
    {"dequantize_blocks", qscheme_gguf::dequantize_blocks, METH_VARARGS, "Rows of packed blocks as float32 or bfloat16 (AVX-512; False where it does not run)."},
    {"gemm_blocks", qscheme_gguf::gemm_blocks, METH_VARARGS, "y = x W^T (+ bias) over packed blocks for many rows of bfloat16 x (AVX-512 BF16; False where it does not run)."},
    {"gemm_blocks_decoder", qscheme_gguf::gemm_blocks_decoder, METH_VARARGS, "Which decoder fills gemm_blocks' panels on a layer (1-4), 0 where it does not run."},
    {"blocks_gemm", qscheme_gguf::blocks_gemm, METH_NOARGS, "1 where gemm_blocks runs here (AVX512-BF16 and VBMI, the AVX-512 loops in use), else 0."},
    {"blocks_loop", qscheme_gguf::blocks_loop, METH_VARARGS, "1 where bfloat16 rows of x run the AVX512-BF16 loop on packed blocks, else 0."},
    {"blocks_bf16", qscheme_gguf::blocks_bf16, METH_NOARGS, "1 where this CPU runs the packed blocks' AVX512-BF16 loop, else 0."},
    {"activation_codes", qscheme_act::activation_codes_method, METH_VARARGS, "FP8 / int8 activation codes' values and their scales (qscheme.emulation)."},
    {"prepare_input", qscheme_act::prepare_input_method, METH_VARARGS, "The tile GEMMs' input: pre-scaled, quantized and dequantized, as float32 or bfloat16 (qscheme.emulation)."},
    {"all_finite", qscheme_act::all_finite_method, METH_VARARGS, "Whether a float32, bfloat16 or float16 buffer holds no inf or NaN."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_gemv(void) { return PyModule_Create(&module); }
