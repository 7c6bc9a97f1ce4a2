/* qscheme._tile_gemm: the dequant_gemm kernel's tile decoder and fused tile GEMM on the CPU.
 *
 * dequantize: rows of a canonical quantized weight as bfloat16, each the reference's float32
 * value fp32((value - zero) * effective_scale) rounded once (to nearest, ties to even). Vector
 * loops for AVX-512 with BF16 (tile_gemm_amx.cpp), a portable loop otherwise and for what the
 * vector loops do not tile (the rest of K past a multiple of 32, 4-bit groups other than 16 or a
 * multiple of 32, 8-bit groups not a multiple of 16).
 *
 * gemm: y = x W^T (+ bias) for bfloat16 x on AMX: panels of 32 weight rows are decoded as above
 * into a bfloat16 buffer that stays in the core's cache and multiplied at once by every row of x
 * with TDPBF16PS (products of bfloat16 values summed in float32), the output rounded once to
 * bfloat16 (the bias added in float32 first). x is packed once per call into the tiles' pair
 * layout. Panels are shared out over a pool of worker threads (the caller passes the count); the
 * GIL is released meanwhile. Never is the whole weight dequantized: a thread holds one panel.
 *
 * No torch headers: the Python wrapper (qscheme.tile_gemm) passes the tensors' addresses, in the
 * order of the layer description qscheme.cpu_gemv.layout_of gives.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "act_quant.h"
#include "amx_panel.h"
#include "thread_pool.h"
#include "tile_gemm.h"

namespace qscheme_tile {

using qscheme_bytes::half_value;

namespace {

float bf16_value(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace

uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu)) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(bits >> 16);
}

void row_scales(const Layer &p, int64_t n, int64_t g0, int64_t g1, float *s, float *z) {
    const int64_t base = (n / p.group_n) * p.scale_cols;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t i = base + g;
        float v;
        switch (p.scale_kind) {
            case SCALE_F32: v = static_cast<const float *>(p.scale)[i]; break;
            case SCALE_BF16: v = bf16_value(static_cast<const uint16_t *>(p.scale)[i]); break;
            case SCALE_F16: v = half_value(static_cast<const uint16_t *>(p.scale)[i]); break;
            case SCALE_BYTE: v = p.scale_table[static_cast<const uint8_t *>(p.scale)[i]]; break;
            default: v = p.row_scale ? p.row_scale[n] : 1.0f; break;
        }
        if (p.scale_kind != SCALE_NONE && p.row_scale) v = p.row_divide ? v / p.row_scale[n] : v * p.row_scale[n];
        s[g] = v;
        z[g] = p.zero ? static_cast<float>(p.zero[i]) : 0.0f;
    }
}

float weight_value(const Layer &p, const uint8_t *row, const float *s, const float *z, int64_t k) {
    float v;
    switch (p.code_kind) {
        case CODE_NIBBLE: v = p.lut[(row[k >> 1] >> ((k & 1) * 4)) & 0xF]; break;
        case CODE_E4M3: v = qscheme_bytes::e4m3_value(row[k]); break;
        case CODE_INT8: v = static_cast<float>(static_cast<int8_t>(row[k])); break;
        default: v = static_cast<float>(row[k]); break;
    }
    const int64_t g = k / p.group_k;
    if (p.zero) v = v - z[g];
    return v * s[g];
}

bool amx_ready() { return vector_compiled() && qscheme_amx::compiled() && qscheme_amx::granted(); }

}  // namespace qscheme_tile

using namespace qscheme_tile;

namespace {

enum { ISA_SCALAR = 0, ISA_AVX512 = 1, ISA_AMX = 2 };
const char *const ISA_NAMES[] = {"scalar", "avx512", "amx"};

bool avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
    if (!vector_compiled()) return false;
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c")))
        return false;
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);  // AVX512_BF16
#else
    return false;
#endif
}

int isa_supported() {
    static const int level = [] {
        if (!avx512_bf16()) return static_cast<int>(ISA_SCALAR);
        return static_cast<int>(amx_ready() ? ISA_AMX : ISA_AVX512);
    }();
    return level;
}

int isa_active = -1;

int isa_level() {
    if (isa_active < 0) isa_active = isa_supported();
    return isa_active;
}


constexpr int LAYER_INTS = 15;

bool read_ints(PyObject *args, Py_ssize_t first, int count, long long *out) {
    for (int i = 0; i < count; i++) {
        PyObject *item = PyTuple_GetItem(args, first + i);
        if (!item) return false;
        out[i] = PyLong_AsLongLong(item);
        if (out[i] == -1 && PyErr_Occurred()) return false;
    }
    return true;
}

template <class T>
T *address(long long value) {
    return reinterpret_cast<T *>(static_cast<uintptr_t>(value));
}

/* The layer from its 15 integers (addresses as ints): codes, code stride, code kind, lut, scale,
 * scale kind, scale table, scale columns, group rows, group columns, zero, row scale, divide, N, K. */
bool parse_layer(PyObject *args, Py_ssize_t first, Layer &p) {
    long long v[LAYER_INTS];
    if (!read_ints(args, first, LAYER_INTS, v)) return false;
    p.codes = address<const uint8_t>(v[0]);
    p.code_stride = v[1];
    p.code_kind = static_cast<int>(v[2]);
    const float *lut = address<const float>(v[3]);
    p.scale = address<const void>(v[4]);
    p.scale_kind = static_cast<int>(v[5]);
    const float *table = address<const float>(v[6]);
    p.scale_cols = v[7];
    p.group_n = v[8];
    p.group_k = v[9];
    p.zero = address<const int16_t>(v[10]);
    p.row_scale = address<const float>(v[11]);
    p.row_divide = static_cast<int>(v[12]);
    p.n = v[13];
    p.k = v[14];
    if (p.code_kind < CODE_NIBBLE || p.code_kind > CODE_UINT8 || p.scale_kind < SCALE_NONE ||
        p.scale_kind > SCALE_BYTE || p.scale_cols < 1 || p.group_n < 1 || p.group_k < 1 || p.n < 0 || p.k < 0 ||
        !p.codes || (p.scale_kind != SCALE_NONE && !p.scale) || (p.scale_kind == SCALE_NONE && p.scale_cols != 1) ||
        (p.code_kind == CODE_NIBBLE && !lut) || (p.scale_kind == SCALE_BYTE && !table)) {
        PyErr_SetString(PyExc_ValueError, "qscheme._tile_gemm: inconsistent layer description");
        return false;
    }
    if (lut) std::memcpy(p.lut, lut, sizeof(p.lut));
    if (table) {
        std::memcpy(p.scale_table, table, sizeof(p.scale_table));
        p.byte_format = qscheme_bytes::byte_format_of(p.scale_table);
    }
    return true;
}

struct RowBuffers {
    std::vector<float> s, z, acc;
    std::vector<uint16_t> panel;
    void fit(const Layer &p, size_t panel_elements, size_t acc_elements, int64_t rows = 1) {
        if (s.size() < static_cast<size_t>(rows * p.scale_cols)) {
            s.resize(static_cast<size_t>(rows * p.scale_cols));
            z.resize(static_cast<size_t>(rows * p.scale_cols));
        }
        if (panel.size() < panel_elements) panel.resize(panel_elements);
        if (acc.size() < acc_elements) acc.resize(acc_elements);
    }
    void release() {  // buffers above 1 MiB are not kept between calls
        if (2 * panel.size() + 4 * (acc.size() + s.size() + z.size()) > (size_t(1) << 20)) {
            std::vector<uint16_t>().swap(panel);
            std::vector<float>().swap(acc);
            std::vector<float>().swap(s);
            std::vector<float>().swap(z);
        }
    }
};

thread_local RowBuffers buffers;

void decode_row(const Layer &p, int64_t n, uint16_t *out, bool vector) {
    RowBuffers &b = buffers;
    b.fit(p, 0, 0);
    if (vector)
        row_scales_avx512(p, n, 0, p.scale_cols, b.s.data(), b.z.data());
    else
        row_scales(p, n, 0, p.scale_cols, b.s.data(), b.z.data());
    const uint8_t *row = p.codes + n * p.code_stride;
    int64_t k = vector ? decode_row_avx512(p, n, b.s.data(), b.z.data(), 0, p.k, out) : 0;
    for (; k < p.k; k++) out[k] = float_to_bf16(weight_value(p, row, b.s.data(), b.z.data(), k));
}

/* dequantize(out, n0, n1, threads, <15 layer ints>): rows [n0, n1) as bfloat16 [n1 - n0, K]. */
PyObject *dequantize(PyObject *, PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != 4 + LAYER_INTS) {
        PyErr_SetString(PyExc_TypeError, "qscheme._tile_gemm.dequantize takes 19 integer arguments");
        return nullptr;
    }
    long long head[4];
    Layer p;
    if (!read_ints(args, 0, 4, head) || !parse_layer(args, 4, p)) return nullptr;
    uint16_t *out = address<uint16_t>(head[0]);
    const int64_t n0 = head[1], n1 = head[2];
    const int threads = static_cast<int>(std::max(1LL, std::min(head[3], 256LL)));
    if (!out || n0 < 0 || n1 < n0 || n1 > p.n) {
        PyErr_SetString(PyExc_ValueError, "qscheme._tile_gemm.dequantize: rows out of range");
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS;
    const bool vector = isa_level() >= ISA_AVX512;
    const int64_t per_task = 16, tasks = (n1 - n0 + per_task - 1) / per_task;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    qscheme_threads::run_tasks(count, tasks, [&](int64_t task) {
        const int64_t lo = n0 + task * per_task, hi = std::min(n1, lo + per_task);
        for (int64_t n = lo; n < hi; n++) decode_row(p, n, out + (n - n0) * p.k, vector);
    });
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* x [M, K] bfloat16 -> the tiles' pair layout: for each block of 16 rows and each pair of columns
 * (2r, 2r + 1), 16 uint32 (row j: x[16b + j, 2r] | x[16b + j, 2r + 1] << 16), zero past M and K. */
void pack_block(const uint16_t *x, int64_t m, int64_t k, int64_t kp, int64_t block, uint32_t *xp) {
    uint32_t *dst = xp + block * (kp / 2) * 16;
    for (int j = 0; j < 16; j++) {
        const int64_t row = block * 16 + j;
        if (row >= m) {
            for (int64_t r = 0; r < kp / 2; r++) dst[r * 16 + j] = 0;
            continue;
        }
        const uint16_t *src = x + row * k;
        const int64_t pairs = k / 2;
        for (int64_t r = 0; r < pairs; r++)
            dst[r * 16 + j] = static_cast<uint32_t>(src[2 * r]) | (static_cast<uint32_t>(src[2 * r + 1]) << 16);
        for (int64_t r = pairs; r < kp / 2; r++) dst[r * 16 + j] = 2 * r < k ? src[2 * r] : 0;
    }
}

void gemm_amx(const Layer &p, const uint16_t *x, int64_t m, uint16_t *out, int64_t ldy, const float *bias, int64_t r0,
              int64_t r1, int threads, int64_t task_rows, int64_t kc, const InputPass *pass);
void gemm_bf16(const Layer &p, const uint16_t *x, int64_t m, uint16_t *out, int64_t ldy, const float *bias, int64_t r0,
               int64_t r1, int threads, int64_t task_rows, int64_t kc, const InputPass *pass);

constexpr int GEMM_HEAD = 14;

/* gemm(x, m, out, ldy, bias, r0, r1, threads, rows, kc, mode, group, pre_scale, scale_bits, <15 layer ints>):
 * out[i, n - r0] (bfloat16, row stride ldy) = sum_k x'[i, k] w[n, k] (+ bias[n], float32) for rows n in
 * [r0, r1) of the weight, x' being x with the input pass applied (tile_gemm.h: InputPass; mode -1 for
 * none, scale as its float32 bits); each task decodes `rows` weight rows (a multiple of 32) kc columns
 * (a multiple of 32) at a time, multiplied on AMX tiles where isa() is 'amx', with VDPBF16PS where it
 * is 'avx512'. */
PyObject *gemm(PyObject *, PyObject *args) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != GEMM_HEAD + LAYER_INTS) {
        PyErr_SetString(PyExc_TypeError, "qscheme._tile_gemm.gemm takes 29 integer arguments");
        return nullptr;
    }
    long long head[GEMM_HEAD];
    Layer p;
    if (!read_ints(args, 0, GEMM_HEAD, head) || !parse_layer(args, GEMM_HEAD, p)) return nullptr;
    const uint16_t *x = address<const uint16_t>(head[0]);
    const int64_t m = head[1];
    uint16_t *out = address<uint16_t>(head[2]);
    const int64_t ldy = head[3];
    const float *bias = address<const float>(head[4]);
    const int64_t r0 = head[5], r1 = head[6];
    const int threads = static_cast<int>(std::max(1LL, std::min(head[7], 256LL)));
    const int level = isa_level();
    if (level < ISA_AVX512) {
        PyErr_SetString(PyExc_RuntimeError, "qscheme._tile_gemm.gemm needs AMX or AVX-512 BF16 (isa() is 'scalar')");
        return nullptr;
    }
    const int64_t task_rows = head[8], kc = head[9];
    if (!x || !out || m < 0 || r0 < 0 || r1 < r0 || r1 > p.n || ldy < r1 - r0 || task_rows < 32 || task_rows % 32 ||
        kc < 32 || kc % 32) {
        PyErr_SetString(PyExc_ValueError, "qscheme._tile_gemm.gemm: inconsistent sizes");
        return nullptr;
    }
    const uint32_t scale_bits = static_cast<uint32_t>(head[13]);
    InputPass pass{static_cast<int>(head[10]), head[11], 0.0f, address<const float>(head[12])};
    std::memcpy(&pass.scale, &scale_bits, 4);
    const bool transforms = pass.mode != -1 || pass.pre_scale;
    if (pass.mode == -1) pass.mode = qscheme_act::NONE;
    if (transforms && !qscheme_act::rule_valid(pass.mode, pass.group, pass.scale)) {
        PyErr_SetString(PyExc_ValueError, "qscheme._tile_gemm.gemm: inconsistent input pass");
        return nullptr;
    }
    if (m == 0 || r1 == r0) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS;
    if (level == ISA_AMX)
        gemm_amx(p, x, m, out, ldy, bias, r0, r1, threads, task_rows, kc, transforms ? &pass : nullptr);
    else
        gemm_bf16(p, x, m, out, ldy, bias, r0, r1, threads, task_rows, kc, transforms ? &pass : nullptr);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* The weight rows [r0, r1) in tasks of task_rows (whole panels of 32 from r0), shared out over
 * `threads` workers: task(q0, q1, buffers) with the worker's buffers fitted to a panel of
 * `columns` (+ PANEL_PAD) bfloat16 and `accumulators` float32 per row. */
template <class Task>
void run_row_tasks(const Layer &p, int64_t r0, int64_t r1, int threads, int64_t task_rows, int64_t columns,
                   int64_t accumulators, Task task) {
    const int64_t tasks = (r1 - r0 + task_rows - 1) / task_rows;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    qscheme_threads::run_tasks(count, tasks, [&](int64_t t) {
        const int64_t q0 = r0 + t * task_rows;
        const int64_t q1 = q0 + std::min(task_rows, (r1 - q0 + 31) / 32 * 32);
        RowBuffers &b = buffers;
        b.fit(p, static_cast<size_t>((q1 - q0) * (columns + PANEL_PAD)), static_cast<size_t>((q1 - q0) * accumulators),
              q1 - q0);
        task(q0, q1, b);
        b.release();
    });
}

/* Row `row` of x [M, K] bfloat16 into row `row` of xp (rows of ldp), with the input pass applied where
 * there is one, else copied. */
void prepare_row(const uint16_t *x, int64_t k, int64_t ldp, int64_t row, uint16_t *xp, const InputPass *pass) {
    if (!pass) {
        std::memcpy(xp + row * ldp, x + row * k, static_cast<size_t>(k) * 2);
        return;
    }
    const qscheme_act::Pass one{x + row * k, true, xp + row * ldp, true, 1, k, pass->mode, pass->group, pass->scale,
                                pass->pre_scale, nullptr};
    qscheme_act::pass_rows(one, 0, 1, true);
}

void gemm_amx(const Layer &p, const uint16_t *x, int64_t m, uint16_t *out, int64_t ldy, const float *bias, int64_t r0,
              int64_t r1, int threads, int64_t task_rows, int64_t kc, const InputPass *pass) {
    const int64_t kp = (p.k + 31) / 32 * 32, blocks = (m + 15) / 16, mp = blocks * 16;
    std::vector<uint32_t> xp(static_cast<size_t>(mp * kp / 2));
    const int packers = static_cast<int>(std::min<int64_t>(threads, blocks));
    std::unique_ptr<uint16_t[]> prepared(pass ? new uint16_t[static_cast<size_t>(m * p.k)] : nullptr);
    qscheme_threads::run_tasks(packers, blocks, [&](int64_t block) {
        if (pass)
            for (int64_t row = 16 * block; row < std::min(m, 16 * block + 16); row++)
                prepare_row(x, p.k, p.k, row, prepared.get(), pass);
        pack_block(pass ? prepared.get() : x, m, p.k, kp, block, xp.data());
    });
    run_row_tasks(p, r0, r1, threads, task_rows, std::min(kc, kp), (mp + 31) / 32 * 32,
                  [&](int64_t q0, int64_t q1, RowBuffers &b) {
                      gemm_rows_amx(p, xp.data(), m, mp, kp, bias, out, ldy, r0, r1, q0, q1, kc, b.panel.data(),
                                    b.acc.data(), b.s.data(), b.z.data());
                  });
}

void gemm_bf16(const Layer &p, const uint16_t *x, int64_t m, uint16_t *out, int64_t ldy, const float *bias, int64_t r0,
               int64_t r1, int threads, int64_t task_rows, int64_t kc, const InputPass *pass) {
    const int64_t kp = (p.k + 31) / 32 * 32, mp = pair_rows_bf16(m);
    // the input padded (and passed through the input pass, where there is one), and its whole blocks of
    // 16 rows packed as pairs (cache-line aligned), 16 rows a task in one parallel region (a region each
    // cost 0.05-0.3 ms more a call on 2 threads; the calling thread alone, 0.04 ms more at 128 x 2048);
    // the buffers are not zeroed first
    std::unique_ptr<uint16_t[]> xp(new uint16_t[static_cast<size_t>(m * kp)]);
    std::unique_ptr<uint16_t[]> packed(new uint16_t[static_cast<size_t>(mp * kp + 32)]);
    uint16_t *xv = packed.get() + ((64 - reinterpret_cast<uintptr_t>(packed.get()) % 64) % 64) / 2;
    const int64_t blocks = (m + 15) / 16;
    auto prepare = [&](int64_t block) {
        const int64_t first = 16 * block, last = std::min(m, first + 16);
        for (int64_t row = first; row < last; row++) {
            prepare_row(x, p.k, kp, row, xp.get(), pass);
            std::memset(xp.get() + row * kp + p.k, 0, static_cast<size_t>(kp - p.k) * 2);
        }
        if (last <= mp) pack_pairs_bf16(xp.get() + first * kp, kp, kp, xv + first * kp);
    };
    qscheme_threads::run_tasks(static_cast<int>(std::min<int64_t>(threads, blocks)), blocks, prepare);
    run_row_tasks(p, r0, r1, threads, task_rows, std::min(kc, kp), m, [&](int64_t q0, int64_t q1, RowBuffers &b) {
        gemm_rows_bf16(p, xp.get(), m, kp, xv, mp, bias, out, ldy, r0, r1, q0, q1, kc, b.panel.data(), b.acc.data(),
                       b.s.data(), b.z.data());
    });
}

PyObject *isa(PyObject *, PyObject *) { return PyUnicode_FromString(ISA_NAMES[isa_level()]); }

PyObject *supported_isa(PyObject *, PyObject *) { return PyUnicode_FromString(ISA_NAMES[isa_supported()]); }

PyObject *set_isa(PyObject *, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
    for (int level = ISA_SCALAR; level <= ISA_AMX; level++) {
        if (std::strcmp(name, ISA_NAMES[level]) == 0) {
            if (level > isa_supported()) {
                PyErr_Format(PyExc_ValueError, "qscheme._tile_gemm.set_isa: this CPU does not run %s (it runs %s)",
                             name, ISA_NAMES[isa_supported()]);
                return nullptr;
            }
            isa_active = level;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "qscheme._tile_gemm.set_isa: %s is not one of scalar, avx512, amx", name);
    return nullptr;
}

PyMethodDef methods[] = {
    {"dequantize", dequantize, METH_VARARGS, "Rows of a canonical quantized weight as bfloat16 (see qscheme.tile_gemm)."},
    {"gemm", gemm, METH_VARARGS, "y = x W^T (+ bias) for bfloat16 x on AMX tiles (see qscheme.tile_gemm)."},
    {"isa", isa, METH_NOARGS, "The loops in use: 'amx', 'avx512' or 'scalar'."},
    {"supported_isa", supported_isa, METH_NOARGS, "The widest loops this CPU runs."},
    {"set_isa", set_isa, METH_VARARGS, "Use the 'scalar', 'avx512' or 'amx' loops (at most what the CPU runs)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tile_gemm", nullptr, -1, methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__tile_gemm(void) { return PyModule_Create(&module); }
