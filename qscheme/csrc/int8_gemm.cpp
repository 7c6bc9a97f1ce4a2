/* qscheme._int8_gemm: the cpu_int8_gemm kernel's loops (int8_gemm.h has the arithmetic).
 *
 * quantize: rows of x as compressed-tensors' int8 per-token codes (+ 128) and their float32 scales,
 * bit for bit qscheme.emulation's rule (act_quant.cpp's arithmetic, shared with prepare_input).
 * gemm: y = x W^T from those codes and an int8 weight [N, K] as stored (no copy, no repacking).
 *
 * A portable loop, and AVX512-VNNI loops (int8_gemm_vnni.cpp) chosen at run time by cpuid; set_isa
 * narrows the choice. Rows of the weight are shared out over `threads` workers (qscheme_threads:
 * torch's OpenMP team in the normal build), one span each; the GIL is released meanwhile.
 *
 * No torch headers: the Python wrapper (qscheme.int8_gemm) passes the tensors' addresses.
 */
#include "int8_gemm.h"

#include <algorithm>
#include <cstring>

#include "act_quant.h"
#include "thread_pool.h"

namespace qscheme_int8 {

namespace {

enum Isa : int { ISA_SCALAR = 0, ISA_VNNI = 1 };
const char *const ISA_NAMES[] = {"scalar", "vnni"};

int isa_supported() {
    static const int level = [] {
#if defined(__x86_64__) || defined(__i386__)
        if (!vnni_compiled()) return static_cast<int>(ISA_SCALAR);
        __builtin_cpu_init();
        const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
        return static_cast<int>(vnni ? ISA_VNNI : ISA_SCALAR);
#else
        return static_cast<int>(ISA_SCALAR);
#endif
    }();
    return level;
}

int isa_active = -1;

int isa_level() {
    if (isa_active < 0) isa_active = isa_supported();
    return isa_active;
}

template <class T>
T *address(long long value) {
    return reinterpret_cast<T *>(static_cast<uintptr_t>(value));
}

bool read_ints(PyObject *args, Py_ssize_t count, long long *out, const char *name) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != count) {
        PyErr_Format(PyExc_TypeError, "qscheme._int8_gemm.%s takes %zd integer arguments", name, count);
        return false;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args, i));
        if (out[i] == -1 && PyErr_Occurred()) return false;
    }
    return true;
}

}  // namespace

void rows_portable(const Problem &p, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = p.w + n * p.w_stride;
        for (int64_t row = 0; row < p.m; row++) {
            const uint8_t *x = p.x + row * p.x_stride;
            uint32_t sum = 0;
            for (int64_t i = 0; i < p.k; i++)
                sum += static_cast<uint32_t>(static_cast<int32_t>(x[i]) * static_cast<int32_t>(w[i]));
            store(p, row, n, exact_dot(sum, p.w_sum[n]));
        }
    }
}

namespace {

/* quantize(x, bf16, m, k, codes, stride, scales, threads) */
PyObject *quantize(PyObject *, PyObject *args) {
    long long v[8];
    if (!read_ints(args, 8, v, "quantize")) return nullptr;
    const void *x = address<const void>(v[0]);
    const bool bf16 = v[1] != 0;
    const int64_t m = v[2], k = v[3];
    uint8_t *codes = address<uint8_t>(v[4]);
    const int64_t stride = v[5];
    float *scales = address<float>(v[6]);
    const int threads = static_cast<int>(std::max(1LL, std::min(v[7], 256LL)));
    if (!x || !codes || !scales || m < 0 || k < 1 || stride < k) {
        PyErr_SetString(PyExc_ValueError, "qscheme._int8_gemm.quantize: inconsistent arguments");
        return nullptr;
    }
    const bool vector = isa_level() >= ISA_VNNI;
    const size_t width = bf16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS;
    qscheme_threads::run_tasks(static_cast<int>(std::min<int64_t>(threads, m)), m, [&](int64_t row) {
        const void *at = static_cast<const char *>(x) + static_cast<size_t>(row * k) * width;
        qscheme_act::int8_codes(at, bf16, 1, k, codes + row * stride, stride, scales + row, vector);
    });
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* Every row of x times rows of the weight shared out over `threads` workers: from PANEL_M rows of x
 * on the VNNI loops, panels of PANEL_N rows taken one at a time from a shared counter; otherwise one
 * span of rows per worker. */
void run(const Problem &p, int threads, bool vector) {
    if (vector && p.m >= PANEL_M) {
        const int64_t panels = (p.n + PANEL_N - 1) / PANEL_N;
        qscheme_threads::run_tasks(static_cast<int>(std::min<int64_t>(threads, panels)), panels,
                                   [&](int64_t panel) { panels_vnni(p, panel, panel + 1); });
        return;
    }
    const int64_t span = qscheme_threads::span_rows(p.n, threads, 4), tasks = (p.n + span - 1) / span;
    qscheme_threads::run_tasks(static_cast<int>(std::min<int64_t>(threads, tasks)), tasks, [&](int64_t task) {
        const int64_t n0 = task * span, n1 = std::min(p.n, n0 + span);
        if (vector)
            rows_vnni(p, n0, n1);
        else
            rows_portable(p, n0, n1);
    });
}

/* gemm(x, x_stride, x_scale, m, w, w_stride, w_sum, w_scale, bias, out, out_bf16, ldy, n, k, threads):
 * out[i, n] for every row i of x and n of the weight (int8_gemm.h). */
PyObject *gemm(PyObject *, PyObject *args) {
    long long v[15];
    if (!read_ints(args, 15, v, "gemm")) return nullptr;
    Problem p;
    p.x = address<const uint8_t>(v[0]);
    p.x_stride = v[1];
    p.x_scale = address<const float>(v[2]);
    p.m = v[3];
    p.w = address<const int8_t>(v[4]);
    p.w_stride = v[5];
    p.w_sum = address<const int32_t>(v[6]);
    p.w_scale = address<const float>(v[7]);
    p.bias = address<const float>(v[8]);
    p.out = address<void>(v[9]);
    p.out_bf16 = v[10] != 0;
    p.ldy = v[11];
    p.n = v[12];
    p.k = v[13];
    const int threads = static_cast<int>(std::max(1LL, std::min(v[14], 256LL)));
    if (!p.x || !p.x_scale || !p.w || !p.w_sum || !p.w_scale || !p.out || p.m < 0 || p.n < 1 || p.k < 1 ||
        p.k > MAX_K || p.w_stride < p.k || p.ldy < p.n || p.x_stride < (p.k + 3) / 4 * 4 || p.x_stride % 4) {
        PyErr_SetString(PyExc_ValueError, "qscheme._int8_gemm.gemm: inconsistent arguments");
        return nullptr;
    }
    if (p.m == 0) Py_RETURN_NONE;
    const bool vector = isa_level() >= ISA_VNNI;
    Py_BEGIN_ALLOW_THREADS;
    run(p, threads, vector);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

PyObject *isa(PyObject *, PyObject *) { return PyUnicode_FromString(ISA_NAMES[isa_level()]); }

PyObject *supported_isa(PyObject *, PyObject *) { return PyUnicode_FromString(ISA_NAMES[isa_supported()]); }

PyObject *set_isa(PyObject *, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
    for (int level = ISA_SCALAR; level <= ISA_VNNI; level++) {
        if (std::strcmp(name, ISA_NAMES[level]) == 0) {
            if (level > isa_supported()) {
                PyErr_Format(PyExc_ValueError, "qscheme._int8_gemm.set_isa: this CPU does not run %s (it runs %s)",
                             name, ISA_NAMES[isa_supported()]);
                return nullptr;
            }
            isa_active = level;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "qscheme._int8_gemm.set_isa: %s is not one of scalar, vnni", name);
    return nullptr;
}

PyObject *max_k(PyObject *, PyObject *) { return PyLong_FromLongLong(MAX_K); }

PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS, "Rows of x as int8 per-token codes + 128 and their scales."},
    {"gemm", gemm, METH_VARARGS, "y = x W^T from int8 codes of x and an int8 weight (exact integer sums)."},
    {"isa", isa, METH_NOARGS, "The loops in use: 'vnni' or 'scalar'."},
    {"supported_isa", supported_isa, METH_NOARGS, "The widest loops this CPU runs."},
    {"set_isa", set_isa, METH_VARARGS, "Use the 'scalar' or 'vnni' loops (at most what the CPU runs)."},
    {"max_k", max_k, METH_NOARGS, "The largest K whose sums stay exact in 32-bit integers."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "qscheme._int8_gemm", nullptr, -1, methods};

}  // namespace

}  // namespace qscheme_int8

PyMODINIT_FUNC PyInit__int8_gemm(void) { return PyModule_Create(&qscheme_int8::module); }
