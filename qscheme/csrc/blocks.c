/* qscheme._blocks: the per-weight loop of decoding packed blocks (qscheme.formats.blocks).
 *
 * For each block b and weight v of it: the weight's code is assembled from its pieces (a byte of
 * the block, a shift, a mask, a destination bit: the descriptor's bit planes or piece table,
 * compiled by the caller into one slot table per piece depth), looked up in a float table of
 * every code's element value (an integer with its offset, a codebook, or an element format),
 * multiplied by the block's scale for that weight's sub-block and, when the layout has a minimum,
 * the minimum subtracted or added. Each operation is one float32 rounding, in the same order as
 * the torch decoder, and this file is compiled with -ffp-contract=off: no fused multiply-add.
 * The scales and minimums per sub-block are computed by the caller (torch), the same float32
 * products as the torch decoder forms.
 *
 * decode(raw, out, scale, minimum, slots, table, blocks, block_bytes, elements, depth,
 *        scale_count, minimum_count, minimum_sign): addresses and sizes as Python ints; the GIL
 * is released while it runs, so the caller's worker threads decode slabs of rows in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static void decode_range(const uint8_t *restrict raw, float *restrict out, const float *restrict scale,
                         const float *restrict minimum, const int32_t *restrict slots, const float *restrict table, int64_t blocks, int64_t block_bytes,
                         int64_t elements, int64_t depth, int64_t scale_count, int64_t minimum_count,
                         int64_t minimum_sign) {
    /* slots: [depth][4][elements] int32: byte, shift, mask, destination. Weights are taken a
     * sub-block at a time (the finer of the scale's and the minimum's), so that no division runs
     * per weight. */
    const int64_t groups = minimum_count > scale_count ? minimum_count : scale_count;
    const int64_t run = elements / groups;
    const int64_t scale_step = groups / scale_count;
    const int64_t minimum_step = minimum_count > 0 ? groups / minimum_count : 1;
    const int32_t *byte0 = slots, *shift0 = slots + elements, *mask0 = slots + 2 * elements;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *restrict block = raw + b * block_bytes;
        float *restrict row = out + b * elements;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[b * scale_count + g / scale_step];
            const int64_t first = g * run, last = first + run;
            if (depth == 1) { /* one piece per code: the common case (every 4- and 8-bit layout) */
                if (minimum_count == 0) {
                    for (int64_t v = first; v < last; v++) {
                        row[v] = s * table[((uint32_t)block[byte0[v]] >> shift0[v]) & (uint32_t)mask0[v]];
                    }
                    continue;
                }
                const float m = minimum[b * minimum_count + g / minimum_step];
                for (int64_t v = first; v < last; v++) {
                    float w = s * table[((uint32_t)block[byte0[v]] >> shift0[v]) & (uint32_t)mask0[v]];
                    row[v] = minimum_sign > 0 ? w + m : w - m;
                }
                continue;
            }
            const float m = minimum_count > 0 ? minimum[b * minimum_count + g / minimum_step] : 0.0f;
            for (int64_t v = first; v < last; v++) {
                uint32_t code = 0;
                for (int64_t d = 0; d < depth; d++) {
                    const int32_t *slot = slots + d * 4 * elements;
                    uint32_t part = ((uint32_t)block[slot[v]] >> slot[elements + v]) & (uint32_t)slot[2 * elements + v];
                    code |= part << slot[3 * elements + v];
                }
                float w = s * table[code];
                if (minimum_count > 0) {
                    w = minimum_sign > 0 ? w + m : w - m;
                }
                row[v] = w;
            }
        }
    }
}

/* A group's weight for every code: s * table[c], then the minimum added or subtracted (the same
 * float32 operations, in the same order, as decoding each weight). */
static void tabulate_group(float *restrict values, const float *restrict table, int64_t codes, float s, float m,
                           int has_minimum, int64_t minimum_sign) {
    for (int64_t c = 0; c < codes; c++) {
        float w = s * table[c];
        if (has_minimum) {
            w = minimum_sign > 0 ? w + m : w - m;
        }
        values[c] = w;
    }
}

/* One bit plane holds every code (the 4- and 8-bit layouts, and 2-bit ones): bit group f of byte
 * j of each run of `run` bytes is weight f * run + j of that run. Weights are produced segment by
 * segment (a run of bytes within one scale group); where a group has at least as many weights as
 * there are codes, the group's value of every code is computed once (the same float32 products
 * and sums, in the same order) and the weights are looked up in it. */
static void decode_plane_range(const uint8_t *restrict raw, float *restrict out, const float *restrict scale,
                               const float *restrict minimum, const float *restrict table, int64_t blocks, int64_t block_bytes, int64_t elements,
                               int64_t plane_offset, int64_t bits, int64_t run, int64_t scale_count,
                               int64_t minimum_count, int64_t minimum_sign) {
    const int64_t groups = minimum_count > scale_count ? minimum_count : scale_count;
    const int64_t group_size = elements / groups;
    const int64_t scale_step = groups / scale_count;
    const int64_t minimum_step = minimum_count > 0 ? groups / minimum_count : 1;
    const int64_t per_byte = 8 / bits;
    const int64_t per_run = run * per_byte;
    const int64_t codes = (int64_t)1 << bits;
    const uint32_t mask = (uint32_t)(codes - 1);
    const int tabulate = codes <= group_size;
    float values[256];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *restrict block = raw + b * block_bytes;
        float *restrict row = out + b * elements;
        int64_t tabulated = -1;
        for (int64_t v0 = 0; v0 < elements; v0 += run) {
            const int64_t chunk = v0 / per_run, shift = ((v0 % per_run) / run) * bits;
            const uint8_t *restrict bytes = block + plane_offset + chunk * run;
            for (int64_t j = 0; j < run;) {
                const int64_t v = v0 + j, g = v / group_size;
                int64_t segment = group_size - v % group_size;
                if (segment > run - j) {
                    segment = run - j;
                }
                const float s = scale[b * scale_count + g / scale_step];
                const float m = minimum_count > 0 ? minimum[b * minimum_count + g / minimum_step] : 0.0f;
                if (tabulate && shift == 0) { /* constant shifts: the compiler unrolls these */
                    if (tabulated != g) {
                        tabulate_group(values, table, codes, s, m, minimum_count > 0, minimum_sign);
                        tabulated = g;
                    }
                    for (int64_t i = 0; i < segment; i++) {
                        row[v + i] = values[bytes[j + i] & mask];
                    }
                } else if (tabulate) {
                    if (tabulated != g) {
                        tabulate_group(values, table, codes, s, m, minimum_count > 0, minimum_sign);
                        tabulated = g;
                    }
                    for (int64_t i = 0; i < segment; i++) {
                        row[v + i] = values[((uint32_t)bytes[j + i] >> shift) & mask];
                    }
                } else {
                    for (int64_t i = 0; i < segment; i++) {
                        float w = s * table[((uint32_t)bytes[j + i] >> shift) & mask];
                        if (minimum_count > 0) {
                            w = minimum_sign > 0 ? w + m : w - m;
                        }
                        row[v + i] = w;
                    }
                }
                j += segment;
            }
        }
    }
}

static PyObject *decode_plane(PyObject *self, PyObject *args) {
    unsigned long long raw, out, scale, minimum, table;
    long long blocks, block_bytes, elements, plane_offset, bits, run, scale_count, minimum_count, minimum_sign;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLLLL", &raw, &out, &scale, &minimum, &table, &blocks, &block_bytes,
                          &elements, &plane_offset, &bits, &run, &scale_count, &minimum_count, &minimum_sign)) {
        return NULL;
    }
    const long long groups = minimum_count > scale_count ? minimum_count : scale_count;
    if (blocks < 0 || block_bytes <= 0 || elements <= 0 || scale_count <= 0 || minimum_count < 0 ||
        (bits != 1 && bits != 2 && bits != 4 && bits != 8) || run <= 0 || elements % (run * (8 / bits)) != 0 ||
        elements % groups != 0 || groups % scale_count != 0 || (minimum_count > 0 && groups % minimum_count != 0) ||
        plane_offset < 0 || plane_offset + elements / (8 / bits) > block_bytes) {
        PyErr_SetString(PyExc_ValueError, "qscheme._blocks.decode_plane: inconsistent sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_plane_range((const uint8_t *)(uintptr_t)raw, (float *)(uintptr_t)out, (const float *)(uintptr_t)scale,
                       (const float *)(uintptr_t)minimum, (const float *)(uintptr_t)table, blocks, block_bytes,
                       elements, plane_offset, bits, run, scale_count, minimum_count, minimum_sign);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long raw, out, scale, minimum, slots, table;
    long long blocks, block_bytes, elements, depth, scale_count, minimum_count, minimum_sign;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLLL", &raw, &out, &scale, &minimum, &slots, &table, &blocks, &block_bytes,
                          &elements, &depth, &scale_count, &minimum_count, &minimum_sign)) {
        return NULL;
    }
    const long long groups = minimum_count > scale_count ? minimum_count : scale_count;
    if (blocks < 0 || block_bytes <= 0 || elements <= 0 || depth <= 0 || scale_count <= 0 ||
        elements % scale_count != 0 || minimum_count < 0 || (minimum_count > 0 && elements % minimum_count != 0) ||
        elements % groups != 0 || groups % scale_count != 0 || (minimum_count > 0 && groups % minimum_count != 0)) {
        PyErr_SetString(PyExc_ValueError, "qscheme._blocks.decode: inconsistent sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_range((const uint8_t *)(uintptr_t)raw, (float *)(uintptr_t)out, (const float *)(uintptr_t)scale,
                 (const float *)(uintptr_t)minimum, (const int32_t *)(uintptr_t)slots, (const float *)(uintptr_t)table,
                 blocks, block_bytes, elements, depth, scale_count, minimum_count, minimum_sign);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Decode packed blocks into float32 (see qscheme.formats.blocks)."},
    {"decode_plane", decode_plane, METH_VARARGS, "Decode packed blocks whose codes are one bit plane."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
