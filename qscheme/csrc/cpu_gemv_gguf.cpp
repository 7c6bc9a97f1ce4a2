/* qscheme._cpu_gemv, packed blocks (see cpu_gemv_gguf.h): the Python entry point gemv_blocks,
 * the program parser and the portable scalar loop; the AVX-512 and AVX2 loops are in
 * cpu_gemv_gguf_avx512.cpp / cpu_gemv_gguf_avx2.cpp, chosen by the ISA cpu_gemv.cpp selected
 * (set_isa / QSCHEME_CPU_GEMV_ISA), and the scalar loop runs where the layout does not fit them.
 *
 * y[m, n] = sum over sub-blocks g of row n: s_g * (sum_{k in g} x[m, k] * value(code_k))
 *           -/+ m_g * (sum_{k in g} x[m, k]), plus bias[n], in float32, rounded once to x's dtype.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_gemv.h"
#include "cpu_gemv_gguf.h"

namespace qscheme_gguf {

namespace {

constexpr int HEADER = 12;
constexpr int FACTOR_INTS = 9;
constexpr int64_t TASK_ROWS = 64;

bool bad(const char *what) {
    PyErr_Format(PyExc_ValueError, "qscheme._cpu_gemv.gemv_blocks: inconsistent block program (%s)", what);
    return false;
}

// Every piece within the block, and every value within `bits` bits.
bool slots_ok(const int32_t *slots, int depth, int count, int block_bytes, int bits) {
    for (int s = 0; s < depth; s++) {
        const int32_t *slot = slots + s * 4 * count;
        for (int i = 0; i < count; i++) {
            const int32_t mask = slot[2 * count + i], dest = slot[3 * count + i];
            const int width = mask > 0 ? 32 - __builtin_clz(static_cast<unsigned>(mask)) : 0;
            if (slot[i] < 0 || slot[i] >= block_bytes || slot[count + i] < 0 || slot[count + i] > 7 || mask < 0 ||
                mask > 255 || dest < 0 || dest + width > bits)
                return false;
        }
    }
    return true;
}

// Fill `l` from the program (see cpu_gemv_gguf.h); false with a Python error where it is inconsistent.
bool parse(const int32_t *p, int64_t length, int64_t tables, Layout &l) {
    if (length < HEADER) return bad("short header");
    l.block_bytes = p[0];
    l.elements = p[1];
    l.groups = p[2];
    l.n_scale = p[3];
    l.n_minimum = p[4];
    l.minimum_sign = p[5];
    l.el_bits = p[6];
    l.el_depth = p[7];
    l.el_table = p[8];
    l.el_signed = p[9];
    l.el_offset = p[10];
    if (p[11] != tables) return bad("table count");
    if (l.block_bytes < 1 || l.elements < 1 || l.groups < 1 || l.groups > MAX_GROUPS || l.elements % l.groups ||
        l.n_scale < 1 || l.n_scale > MAX_FACTORS || l.n_minimum < 0 || l.n_minimum > MAX_FACTORS ||
        l.minimum_sign < -1 || l.minimum_sign > 1 || l.el_bits < 1 || l.el_bits > 8 || l.el_depth < 1 ||
        l.el_depth > MAX_DEPTH)
        return bad("header values");
    l.sub = l.elements / l.groups;
    int64_t at = HEADER;
    if (at + 4LL * l.el_depth * l.elements > length) return bad("element slots");
    l.el_slots = p + at;
    if (!slots_ok(l.el_slots, l.el_depth, l.elements, l.block_bytes, l.el_bits)) return bad("element slot values");
    at += 4LL * l.el_depth * l.elements;
    for (int i = 0; i < l.n_scale + l.n_minimum; i++) {
        if (at + FACTOR_INTS > length) return bad("factor header");
        Factor &f = i < l.n_scale ? l.scale[i] : l.minimum[i - l.n_scale];
        const int32_t *q = p + at;
        f.is_field = q[0];
        f.count = q[1];
        f.offset = q[2];
        f.format = q[3];
        f.table = q[4];
        f.bits = q[5];
        f.is_signed = q[6];
        f.add = q[7];
        f.depth = q[8];
        at += FACTOR_INTS;
        if (f.count < 1 || f.count > l.elements || l.groups % f.count) return bad("factor count");
        for (int g = 0; g < l.groups; g++) f.at[g] = static_cast<uint8_t>(g * f.count / l.groups);
        if (f.is_field) {
            const int size = f.format == FIELD_FP32 ? 4 : (f.format == FIELD_TABLE ? 1 : 2);
            if (f.format < FIELD_FP16 || f.format > FIELD_TABLE || f.offset < 0 ||
                f.offset + size * f.count > l.block_bytes || (f.format == FIELD_TABLE && (f.table < 0 || f.table >= tables)))
                return bad("float field");
        } else {
            if (f.depth < 1 || f.depth > MAX_DEPTH || f.bits < 1 || f.bits > 24 || at + 4LL * f.depth * f.count > length)
                return bad("integer factor");
            f.slots = p + at;
            if (!slots_ok(f.slots, f.depth, f.count, l.block_bytes, f.bits)) return bad("integer factor slot values");
            at += 4LL * f.depth * f.count;
        }
    }
    if (at != length) return bad("trailing values");
    return true;
}

struct ScalarHalf {
    inline float operator()(uint16_t h) const { return qscheme_gemv::half_value(h); }
};

// The portable loop: rows [n0, n1), every row of x.
void gemv_scalar(const Layout &l, const float *x, int64_t ldx, const float *xsum, int m, int64_t n0, int64_t n1,
                 float *acc, int64_t ldy) {
    const int64_t blocks = l.k / l.elements, xs_stride = l.k / l.sub;
    float scale[MAX_GROUPS], minimum[MAX_GROUPS];
    std::vector<float> sum(static_cast<size_t>(m)), msum(static_cast<size_t>(m));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = l.codes + n * l.row_bytes;
        std::fill(sum.begin(), sum.end(), 0.0f);
        std::fill(msum.begin(), msum.end(), 0.0f);
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = row + b * l.block_bytes;
            block_products(l, l.scale, l.n_scale, block, scale, ScalarHalf());
            if (l.n_minimum) block_products(l, l.minimum, l.n_minimum, block, minimum, ScalarHalf());
            for (int g = 0; g < l.groups; g++) {
                for (int r = 0; r < m; r++) {
                    const float *xr = x + r * ldx + b * l.elements + g * l.sub;
                    float part = 0.0f;
                    for (int i = 0; i < l.sub; i++) part += xr[i] * l.values[element_code(l, block, g * l.sub + i)];
                    sum[r] += scale[g] * part;
                    if (l.n_minimum) msum[r] += minimum[g] * xsum[r * xs_stride + b * l.groups + g];
                }
            }
        }
        for (int r = 0; r < m; r++) acc[r * ldy + n] = sum[r] + static_cast<float>(l.minimum_sign) * msum[r];
    }
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

// The `count` integer arguments of entry point `name` into v; false with a Python error otherwise.
bool integer_args(PyObject *args, const char *name, long long *v, Py_ssize_t count) {
    if (!PyTuple_Check(args) || PyTuple_Size(args) != count) {
        PyErr_Format(PyExc_TypeError, "qscheme._cpu_gemv.%s takes %zd integer arguments", name, count);
        return false;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        v[i] = PyLong_AsLongLong(PyTuple_GetItem(args, i));
        if (v[i] == -1 && PyErr_Occurred()) return false;
    }
    return true;
}

// The loop's order of a row of x (cpu_gemv_gguf_bf16.cpp): per pair of sub-blocks
// [s: 0-15 | s + 1: 0-15 | s: 16-31 | s + 1: 16-31].
inline int64_t bf16_position(int64_t i) {
    const int64_t e = i % 64, sub = e / 32, j = e % 32;
    return i - e + (j / 16) * 32 + sub * 16 + j % 16;
}

}  // namespace

bool bf16_blocks_available() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool supported = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512bf16") != 0 && __builtin_cpu_supports("avx512vbmi") != 0;
    }();
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_BF16DOT");
    return supported && !(setting && setting[0] == '0');
#else
    return false;
#endif
}

bool bf16_blocks_prepare(const Bf16Input &in, const float *x, int64_t k, int16_t *xq) {
    std::memset(xq, 0, static_cast<size_t>(in.pairs * 64) * sizeof(int16_t));
    for (int64_t i = 0; i < k; i++) {
        uint32_t bits;
        std::memcpy(&bits, &x[i], 4);
        const float a = std::fabs(x[i]);
        // zero or a magnitude in [2**-100, 2**64]; a bfloat16 value (x came as one)
        if ((bits & 0xFFFFu) || !(a == 0.0f || (a >= 0x1p-100f && a <= 0x1p64f))) return false;
        xq[bf16_position(i)] = static_cast<int16_t>(bits >> 16);
    }
    return true;
}

/* gemv_blocks(x, x_bf16, m, out, out_bf16, bias, threads, codes, n, k, row_bytes, program,
 * program_length, values, byte_tables, tables): out[m, N] = x[m, K] W^T (+ bias), all ints. */
PyObject *gemv_blocks(PyObject *, PyObject *args) {
    long long v[16];
    if (!integer_args(args, "gemv_blocks", v, 16)) return nullptr;
    const void *x = reinterpret_cast<const void *>(static_cast<uintptr_t>(v[0]));
    const int x_bf16 = static_cast<int>(v[1]);
    const int64_t m = v[2];
    void *out = reinterpret_cast<void *>(static_cast<uintptr_t>(v[3]));
    const int out_bf16 = static_cast<int>(v[4]);
    const float *bias = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[5]));
    const int threads = static_cast<int>(std::max(1LL, std::min(v[6], 256LL)));
    Layout l;
    l.codes = reinterpret_cast<const uint8_t *>(static_cast<uintptr_t>(v[7]));
    l.n = v[8];
    l.k = v[9];
    l.row_bytes = v[10];
    const int32_t *program = reinterpret_cast<const int32_t *>(static_cast<uintptr_t>(v[11]));
    l.values = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[13]));
    l.byte_tables = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[14]));
    if (!program || !parse(program, v[12], v[15], l)) return nullptr;
    if (m < 0 || !x || !out || !l.codes || !l.values || l.n < 0 || l.k < 0 || l.k % l.elements ||
        l.row_bytes != l.k / l.elements * l.block_bytes) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.gemv_blocks: inconsistent sizes");
        return nullptr;
    }
    if (m == 0 || l.n == 0) Py_RETURN_NONE;

    Py_BEGIN_ALLOW_THREADS;
    int level = qscheme_gemv::active_isa();
    Plan plan;
    if (level == 2) plan = make_plan(l, 16);
    if (plan.width == 0 && level >= 1) plan = make_plan(l, 8);
    level = plan.width == 16 ? 2 : (plan.width == 8 ? 1 : 0);
    const int64_t ldx = std::max<int64_t>(l.k, 1);
    const int64_t groups = l.k / l.sub;
    std::vector<float> xs(static_cast<size_t>(m * ldx), 0.0f), xsum(static_cast<size_t>(m * std::max<int64_t>(groups, 1)), 0.0f);
    for (int64_t r = 0; r < m; r++) {
        float *row = xs.data() + r * ldx;
        for (int64_t k = 0; k < l.k; k++) {
            row[k] = x_bf16 ? bf16_to_float(static_cast<const uint16_t *>(x)[r * l.k + k])
                            : static_cast<const float *>(x)[r * l.k + k];
        }
        if (l.n_minimum) {
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int i = 0; i < l.sub; i++) s += row[g * l.sub + i];
                xsum[r * groups + g] = s;
            }
        }
    }
    // bfloat16 rows of x on the AVX512-BF16 loop where it takes the layout and every element of x
    Bf16Input words;
    std::vector<int16_t> xq;
    bool bf16 = level == 2 && x_bf16 && bf16_blocks_available() && bf16_blocks_fits(l, plan, words);
    if (bf16) {
        xq.resize(static_cast<size_t>(m * words.pairs * 64));
        for (int64_t r = 0; r < m && bf16; r++)
            bf16 = bf16_blocks_prepare(words, xs.data() + r * ldx, l.k, xq.data() + r * words.pairs * 64);
        words.x = xq.data();
    }
    std::vector<float> acc(static_cast<size_t>(m * l.n), 0.0f);
    const int64_t tasks = (l.n + TASK_ROWS - 1) / TASK_ROWS;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    auto job = [&](int64_t task) {
        const int64_t lo = task * TASK_ROWS, hi = std::min(l.n, lo + TASK_ROWS);
#if defined(__x86_64__) || defined(__i386__)
        if (bf16)
            gemv_blocks_bf16(l, plan, words, xsum.data(), static_cast<int>(m), lo, hi, acc.data(), l.n);
        else if (level == 2)
            gemv_blocks_avx512(l, plan, xs.data(), ldx, xsum.data(), static_cast<int>(m), lo, hi, acc.data(), l.n);
        else if (level == 1)
            gemv_blocks_avx2(l, plan, xs.data(), ldx, xsum.data(), static_cast<int>(m), lo, hi, acc.data(), l.n);
        else
#endif
            gemv_scalar(l, xs.data(), ldx, xsum.data(), static_cast<int>(m), lo, hi, acc.data(), l.n);
        for (int64_t n = lo; n < hi; n++) {
            for (int64_t r = 0; r < m; r++) {
                float sum = acc[r * l.n + n];
                if (bias) sum += bias[n];
                if (out_bf16)
                    static_cast<uint16_t *>(out)[r * l.n + n] = float_to_bf16(sum);
                else
                    static_cast<float *>(out)[r * l.n + n] = sum;
            }
        }
    };
    qscheme_gemv::run_tasks(count, tasks, job);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* blocks_bf16(): 1 where this CPU runs the AVX512-BF16 loop (AVX512-BF16 and VBMI, the AVX-512 loops in
 * use, QSCHEME_CPU_GEMV_BF16DOT not 0), else 0. */
PyObject *blocks_bf16(PyObject *, PyObject *) {
    return PyLong_FromLong(qscheme_gemv::active_isa() == 2 && bf16_blocks_available() ? 1 : 0);
}

/* blocks_loop(k, program, program_length, values, byte_tables, tables): 1 where bfloat16 rows of x
 * (every element zero or of a magnitude in [2**-100, 2**64]) run the AVX512-BF16 loop on a layer of
 * this program and K here, 0 where they run the float32 loops. */
PyObject *blocks_loop(PyObject *, PyObject *args) {
    long long v[6];
    if (!integer_args(args, "blocks_loop", v, 6)) return nullptr;
    Layout l;
    l.k = v[0];
    const int32_t *program = reinterpret_cast<const int32_t *>(static_cast<uintptr_t>(v[1]));
    l.values = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[3]));
    l.byte_tables = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[4]));
    if (!program || !l.values || !parse(program, v[2], v[5], l)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.blocks_loop: no program");
        return nullptr;
    }
    if (l.k <= 0 || l.k % l.elements) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.blocks_loop: K is not a whole number of blocks");
        return nullptr;
    }
    Bf16Input words;
    bool runs = qscheme_gemv::active_isa() == 2 && bf16_blocks_available();
    if (runs) runs = bf16_blocks_fits(l, make_plan(l, 16), words);
    return PyLong_FromLong(runs ? 1 : 0);
}

}  // namespace qscheme_gguf
