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
#include <memory>
#include <mutex>
#include <vector>

#include "cpu_gemv.h"
#include "cpu_gemv_gguf.h"
#include "thread_pool.h"

namespace qscheme_gguf {

namespace {

constexpr int HEADER = 12;
constexpr int FACTOR_INTS = 9;
constexpr int64_t TASK_ROWS = 64;  // the fewest rows a worker takes

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

// A program parsed once, with its vector plans and what the AVX512-BF16 loop reads. It owns copies of
// the program and its tables, so a call finds its entry by their contents, whatever their addresses.
struct Prepared {
    std::vector<int32_t> program;
    std::vector<float> values, byte_tables;
    Layout layout;  // pointing into the copies; codes, n, k and row_bytes unset
    Plan plan16, plan8;
    bool bf16 = false;  // this CPU has the AVX512-BF16 loop and it takes the layout (words filled)
    Bf16Input words;
    int bytes_offset = -1;  // the codes' offset where the integer products take blocks of bytes (Q8_0)
};

constexpr size_t MAX_PREPARED = 64;  // programs kept (a model has a few: one per block type)
std::mutex prepared_lock;
std::vector<std::shared_ptr<const Prepared>> prepared_cache;  // the most recently used first

template <class T>
bool holds(const std::vector<T> &kept, const T *p, size_t count) {
    return kept.size() == count && (count == 0 || std::memcmp(kept.data(), p, count * sizeof(T)) == 0);
}

// The program of `length` ints with its element values (max(16, 2**bits) floats) and `tables` byte
// tables (256 floats each), parsed and planned, from the cache or added to it; null with a Python
// error where the program is inconsistent. Called with the GIL held (it may set the error).
std::shared_ptr<const Prepared> prepared(const int32_t *program, int64_t length, const float *values,
                                         const float *byte_tables, int64_t tables) {
    if (!program || !values || length < HEADER || length > (1LL << 24) || tables < 0 || tables > 64 ||
        (tables && !byte_tables) || program[6] < 1 || program[6] > 8) {
        bad("header values");
        return nullptr;
    }
    const size_t n_program = static_cast<size_t>(length), n_values = static_cast<size_t>(std::max(16, 1 << program[6]));
    const size_t n_tables = static_cast<size_t>(256 * tables);
    {
        std::lock_guard<std::mutex> lock(prepared_lock);
        for (size_t i = 0; i < prepared_cache.size(); i++) {
            const std::shared_ptr<const Prepared> entry = prepared_cache[i];
            if (holds(entry->program, program, n_program) && holds(entry->values, values, n_values) &&
                holds(entry->byte_tables, byte_tables, n_tables)) {
                if (i) {
                    prepared_cache.erase(prepared_cache.begin() + static_cast<std::ptrdiff_t>(i));
                    prepared_cache.insert(prepared_cache.begin(), entry);
                }
                return entry;
            }
        }
    }
    auto entry = std::make_shared<Prepared>();
    entry->program.assign(program, program + n_program);
    entry->values.assign(values, values + n_values);
    if (n_tables) entry->byte_tables.assign(byte_tables, byte_tables + n_tables);
    Layout &l = entry->layout;
    if (!parse(entry->program.data(), length, tables, l)) return nullptr;
    l.values = entry->values.data();
    l.byte_tables = n_tables ? entry->byte_tables.data() : nullptr;
    entry->plan16 = make_plan(l, 16);
    entry->plan8 = make_plan(l, 8);
    entry->bf16 = bf16_blocks_supported() && bf16_blocks_fits(l, entry->plan16, entry->words);
    entry->bytes_offset = byte_codes_offset(l);
    std::lock_guard<std::mutex> lock(prepared_lock);
    prepared_cache.insert(prepared_cache.begin(), entry);
    if (prepared_cache.size() > MAX_PREPARED) prepared_cache.pop_back();
    return entry;
}

// The buffers of one call, kept per calling thread between calls.
struct Scratch {
    std::vector<float> xs, xsum, acc, units;
    std::vector<int16_t> words;
};

template <class T>
T *room(std::vector<T> &buffer, int64_t count) {
    if (buffer.size() < static_cast<size_t>(count)) buffer.resize(static_cast<size_t>(count));
    return buffer.data();
}

}  // namespace

bool bf16_blocks_supported() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool supported = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512bf16") != 0 && __builtin_cpu_supports("avx512vbmi") != 0;
    }();
    return supported;
#else
    return false;
#endif
}

bool gemm_blocks_supported() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool supported = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512bf16") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
               __builtin_cpu_supports("avx512vbmi") != 0;
    }();
    return supported;
#else
    return false;
#endif
}

bool bf16_blocks_available() {
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_BF16DOT");
    return bf16_blocks_supported() && !(setting && setting[0] == '0');
}

// The layer of a call from its 9 integers (codes, n, k, row_bytes, program, program_length, values,
// byte_tables, tables): its program prepared and `l` filled; null with a Python error where the
// program or the sizes are inconsistent.
static std::shared_ptr<const Prepared> layer(const long long *v, Layout &l) {
    std::shared_ptr<const Prepared> prep = prepared(
        reinterpret_cast<const int32_t *>(static_cast<uintptr_t>(v[4])), v[5],
        reinterpret_cast<const float *>(static_cast<uintptr_t>(v[6])), reinterpret_cast<const float *>(static_cast<uintptr_t>(v[7])), v[8]);
    if (!prep) return nullptr;
    l = prep->layout;
    l.codes = reinterpret_cast<const uint8_t *>(static_cast<uintptr_t>(v[0]));
    l.n = v[1];
    l.k = v[2];
    l.row_bytes = v[3];
    if (!l.codes || l.n < 0 || l.k < 0 || l.k % l.elements || l.row_bytes != l.k / l.elements * l.block_bytes) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv: a packed-block layer of inconsistent sizes");
        return nullptr;
    }
    return prep;
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
    const std::shared_ptr<const Prepared> prep = layer(v + 7, l);
    if (!prep || m < 0 || !x || !out) {
        if (prep) PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.gemv_blocks: inconsistent sizes");
        return nullptr;
    }
    if (m == 0 || l.n == 0) Py_RETURN_NONE;

    Py_BEGIN_ALLOW_THREADS;
    thread_local Scratch scratch;
    int level = qscheme_gemv::active_isa();
    const Plan *plan = &prep->plan16;
    if (level < 2 || plan->width == 0) plan = level >= 1 ? &prep->plan8 : nullptr;
    level = plan && plan->width == 16 ? 2 : (plan && plan->width == 8 ? 1 : 0);
    static const Plan none;
    if (!plan) plan = &none;
    const int64_t ldx = std::max<int64_t>(l.k, 1);
    const int64_t groups = l.k / l.sub;
    // per row of x and sub-block: the sum of x (for the minimum products)
    float *xsum = room(scratch.xsum, m * std::max<int64_t>(groups, 1));
    if (l.n_minimum)
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int i = 0; i < l.sub; i++) {
                    const int64_t at = r * l.k + g * l.sub + i;
                    s += x_bf16 ? bf16_to_float(static_cast<const uint16_t *>(x)[at]) : static_cast<const float *>(x)[at];
                }
                xsum[r * groups + g] = s;
            }
    // bfloat16 rows of x on the AVX512-BF16 loop where it takes the layout and every element of x,
    // else float32 rows on the other loops
    const int64_t words_per_row = bf16_pairs(l.k) * 64;
    int16_t *words = nullptr;
    bool bf16 = level == 2 && x_bf16 && prep->bf16 && bf16_blocks_available();
    // the 4-bit codes whose values are small integers, one or two rows of x, on CPUs where the integer
    // products are on (int16_blocks_on): x's words as 16-bit integers per block of 256, VPDPWSSD
    const bool integer = bf16 && prep->words.kind != 3 && prep->words.integer && m <= INT16_BLOCK_ROWS &&
                         int16_blocks_on();
    const bool wide = integer && prep->words.wide && bf16_wide_on();  // 128 elements a step
    if (bf16) {
        words = room(scratch.words, m * words_per_row);
        for (int64_t r = 0; r < m && bf16; r++)
            bf16 = bf16_blocks_words(static_cast<const uint16_t *>(x) + r * l.k, l.k, prep->words.kind,
                                     words + r * words_per_row, wide);
    }
    float *units = nullptr;
    if (bf16 && integer) {
        const int64_t blocks = (bf16_pairs(l.k) + 3) / 4;
        units = room(scratch.units, m * blocks);
        for (int64_t r = 0; r < m; r++) int16_blocks_words(words + r * words_per_row, l.k, units + r * blocks);
    }
    // blocks of byte codes (Q8_0), one or two bfloat16 rows of x, where the integer products are on: x as
    // 16-bit integers per block of 256 (in words), VPMADDWD
    bool bytes = !bf16 && level == 2 && x_bf16 && prep->bytes_offset >= 0 && m <= INT16_BLOCK_ROWS &&
                 int16_blocks_on();
    if (bytes) {
        const int64_t units_per_row = (l.k + 255) / 256;
        words = room(scratch.words, m * l.k);
        units = room(scratch.units, m * units_per_row);
        for (int64_t r = 0; r < m && bytes; r++)
            bytes = bytes_words(static_cast<const uint16_t *>(x) + r * l.k, l.k, words + r * l.k,
                                units + r * units_per_row);
    }
    float *xs = nullptr;
    if (!bf16 && !bytes) {
        xs = room(scratch.xs, m * ldx);
        if (x_bf16)
            for (int64_t i = 0; i < m * l.k; i++) xs[i] = bf16_to_float(static_cast<const uint16_t *>(x)[i]);
        else
            std::memcpy(xs, x, static_cast<size_t>(m * l.k) * sizeof(float));
    }
    float *acc = room(scratch.acc, m * l.n);
    // one span of rows per worker (2048x2048 Q4_0 from memory, 2 threads: 183 -> 150 us against
    // 64-row pieces shared out)
    const int64_t span = qscheme_threads::span_rows(l.n, threads, TASK_ROWS);
    const int64_t tasks = (l.n + span - 1) / span;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    auto job = [&](int64_t task) {
        const int64_t lo = task * span, hi = std::min(l.n, lo + span);
#if defined(__x86_64__) || defined(__i386__)
        if (bf16)
            gemv_blocks_bf16(l, *plan, prep->words, words, xsum, static_cast<int>(m), lo, hi, acc, l.n, units, wide);
        else if (bytes)
            gemv_bytes_int16(l, prep->bytes_offset, words, units, static_cast<int>(m), lo, hi, acc, l.n);
        else if (level == 2)
            gemv_blocks_avx512(l, *plan, xs, ldx, xsum, static_cast<int>(m), lo, hi, acc, l.n);
        else if (level == 1)
            gemv_blocks_avx2(l, *plan, xs, ldx, xsum, static_cast<int>(m), lo, hi, acc, l.n);
        else
#endif
            gemv_scalar(l, xs, ldx, xsum, static_cast<int>(m), lo, hi, acc, l.n);
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

/* dequantize_blocks(out, out_bf16, n0, n1, threads, codes, n, k, row_bytes, program, program_length,
 * values, byte_tables, tables): rows [n0, n1) of the weight into out as float32 (bit for bit
 * qscheme.formats.blocks.decode_blocks) or bfloat16 (those values rounded once to nearest even);
 * True where the AVX-512 decoder ran, False where it does not run here (the AVX-512 loops not in use,
 * a layout they do not read): the caller then decodes another way. */
PyObject *dequantize_blocks(PyObject *, PyObject *args) {
    long long v[14];
    if (!integer_args(args, "dequantize_blocks", v, 14)) return nullptr;
    void *out = reinterpret_cast<void *>(static_cast<uintptr_t>(v[0]));
    const bool bf16 = v[1] != 0;
    const int64_t n0 = v[2], n1 = v[3];
    const int threads = static_cast<int>(std::max(1LL, std::min(v[4], 256LL)));
    Layout l;
    const std::shared_ptr<const Prepared> prep = layer(v + 5, l);
    if (!prep || !out || n0 < 0 || n1 < n0 || n1 > l.n) {
        if (prep) PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.dequantize_blocks: inconsistent sizes");
        return nullptr;
    }
    if (qscheme_gemv::active_isa() != 2 || prep->plan16.width != 16) Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS;
    constexpr int64_t ROWS = 16;  // rows per task
    const int64_t tasks = (n1 - n0 + ROWS - 1) / ROWS;
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
    const size_t element = bf16 ? 2 : 4;
    auto job = [&](int64_t task) {
        const int64_t lo = n0 + task * ROWS, hi = std::min(n1, lo + ROWS);
        dequantize_blocks_avx512(l, prep->plan16, lo, hi, static_cast<char *>(out) + (lo - n0) * l.k * element, bf16);
    };
    qscheme_gemv::run_tasks(count, tasks, job);
    Py_END_ALLOW_THREADS;
    Py_RETURN_TRUE;
}

// Whether gemm_blocks runs this layer here: the AVX-512 loops in use, AVX512-BF16 and VBMI, a layout its
// panel decoders read.
static bool gemm_blocks_here(const Layout &l, const Prepared &prep) {
    return qscheme_gemv::active_isa() == 2 && gemm_blocks_supported() && gemm_blocks_fits(l, prep.plan16);
}

/* gemm_blocks(x, m, out, ldy, bias, r0, r1, threads, kc, codes, n, k, row_bytes, program, program_length,
 * values, byte_tables, tables): out[i, n - r0] (bfloat16, row stride ldy) = sum_k x[i, k] w[n, k]
 * (+ bias[n], float32) for weight rows n in [r0, r1), x bfloat16 [m, K] (contiguous), in tasks of 32
 * rows, K in chunks of about kc columns (gemm_blocks_bf16); True where it ran, False where it does not
 * run here (the AVX-512 loops not in use, no AVX512-BF16, a layout the vector decoder does not read):
 * the caller then multiplies another way. With m = 0 it only answers (x and out may be 0). */
PyObject *gemm_blocks(PyObject *, PyObject *args) {
    long long v[18];
    if (!integer_args(args, "gemm_blocks", v, 18)) return nullptr;
    const uint16_t *x = reinterpret_cast<const uint16_t *>(static_cast<uintptr_t>(v[0]));
    const int64_t m = v[1];
    uint16_t *out = reinterpret_cast<uint16_t *>(static_cast<uintptr_t>(v[2]));
    const int64_t ldy = v[3];
    const float *bias = reinterpret_cast<const float *>(static_cast<uintptr_t>(v[4]));
    const int64_t r0 = v[5], r1 = v[6];
    const int threads = static_cast<int>(std::max(1LL, std::min(v[7], 256LL)));
    const int64_t kc = v[8];
    Layout l;
    const std::shared_ptr<const Prepared> prep = layer(v + 9, l);
    if (!prep || (m > 0 && (!x || !out)) || m < 0 || r0 < 0 || r1 < r0 || r1 > l.n || ldy < r1 - r0 || kc < 32) {
        if (prep) PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.gemm_blocks: inconsistent sizes");
        return nullptr;
    }
    if (!gemm_blocks_here(l, *prep)) Py_RETURN_FALSE;
    if (m == 0 || r1 == r0) Py_RETURN_TRUE;
    Py_BEGIN_ALLOW_THREADS;
    const bool amx = gemm_blocks_amx();
    gemm_blocks_bf16(l, prep->plan16, x, m, bias, out, ldy, r0, r1, threads, kc, amx);
    Py_END_ALLOW_THREADS;
    Py_RETURN_TRUE;
}

/* gemm_blocks_decoder(codes, n, k, row_bytes, program, program_length, values, byte_tables, tables): which
 * decoder fills gemm_blocks' panels on this layer (gemm_blocks_decoder in cpu_gemv_gguf.h: 1 words, 2 runs
 * of 64 elements a step, 3 runs of 32, 4 elements); 0 where gemm_blocks does not run it here. */
PyObject *gemm_blocks_decoder(PyObject *, PyObject *args) {
    long long v[9];
    if (!integer_args(args, "gemm_blocks_decoder", v, 9)) return nullptr;
    Layout l;
    const std::shared_ptr<const Prepared> prep = layer(v, l);
    if (!prep) return nullptr;
    return PyLong_FromLong(gemm_blocks_here(l, *prep) ? gemm_blocks_decoder(l, prep->plan16) : 0);
}

/* blocks_gemm(): where gemm_blocks runs here on the layouts it takes (the AVX-512 loops in use on a CPU
 * with AVX512-BF16), 2 where it multiplies on the AMX tiles (gemm_blocks_amx), 1 with VDPBF16PS; else 0. */
PyObject *blocks_gemm(PyObject *, PyObject *) {
    if (qscheme_gemv::active_isa() != 2 || !gemm_blocks_supported()) return PyLong_FromLong(0);
    return PyLong_FromLong(gemm_blocks_amx() ? 2 : 1);
}

/* blocks_loop(k, program, program_length, values, byte_tables, tables): where bfloat16 rows of x
 * (every element zero or of a magnitude in [2**-100, 2**64]) run the AVX512-BF16 loop on a layer of
 * this program and K here, 1 (4-bit nibble pairs), 2 (integer codes, 32 elements a step) or 3 (64 a
 * step); 0 where they run the float32 loops. */
PyObject *blocks_loop(PyObject *, PyObject *args) {
    long long v[6];
    if (!integer_args(args, "blocks_loop", v, 6)) return nullptr;
    const int64_t k = v[0];
    const std::shared_ptr<const Prepared> prep =
        prepared(reinterpret_cast<const int32_t *>(static_cast<uintptr_t>(v[1])), v[2],
                 reinterpret_cast<const float *>(static_cast<uintptr_t>(v[3])),
                 reinterpret_cast<const float *>(static_cast<uintptr_t>(v[4])), v[5]);
    if (!prep) return nullptr;
    if (k <= 0 || k % prep->layout.elements) {
        PyErr_SetString(PyExc_ValueError, "qscheme._cpu_gemv.blocks_loop: K is not a whole number of blocks");
        return nullptr;
    }
    const bool runs = qscheme_gemv::active_isa() == 2 && bf16_blocks_available() && prep->bf16;
    const Bf16Input &in = prep->words;
    return PyLong_FromLong(!runs ? 0 : (in.kind != 3 ? 1 : (!in.planes64.empty() && bf16_planes64_on() ? 3 : 2)));
}

}  // namespace qscheme_gguf
