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
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

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

/* ------------------------------------------------------------------------ vector loops (x86-64)
 *
 * The same operations as the loops above, 16 (AVX-512) or 8 (AVX2) weights at a time: each weight's
 * code is assembled from its bytes with the same shifts and masks, its element value looked up
 * (a register permute for up to 16 codes, else a gather from the same table), multiplied by the
 * same float32 scale and the same minimum added or subtracted: one IEEE float32 rounding per
 * operation, in the same order, so the results are bit-identical to the scalar loops (the tests
 * compare every path). Chosen at run time by what the CPU supports (qscheme._blocks.isa() says
 * which; set_isa("scalar" | "avx2" | "avx512") chooses narrower ones, as QSCHEME_BLOCKS_ISA does).
 * Built with -DQS_PORTABLE (or off x86-64 or GCC/clang) only the scalar loops exist. A vector of weights never straddles a
 * scale group or a run: the caller takes these loops only where runs and groups are multiples of
 * the vector width, else the scalar ones. Outputs larger than the caches are written with
 * streaming stores (the weights are not read back soon; this skips reading the lines first),
 * except fresh ones (`fresh`: the kernel has just zeroed each page into the cache on first touch,
 * where plain stores find it). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(QS_PORTABLE)
#include <immintrin.h>
#define QS_HAVE_X86 1
#define QS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define QS_AVX2 __attribute__((target("avx2")))
#define QS_STREAM_BYTES ((int64_t)8 << 20)

/* How many bits a code assembled from these slots has (the table has 2**bits entries). */
static int64_t code_bits(const int32_t *slots, int64_t depth, int64_t elements) {
    int64_t bits = 0;
    for (int64_t d = 0; d < depth; d++) {
        for (int64_t v = 0; v < elements; v++) {
            const uint32_t mask = (uint32_t)slots[(d * 4 + 2) * elements + v];
            const int64_t top = (int64_t)slots[(d * 4 + 3) * elements + v] + (mask == 0 ? 0 : 32 - __builtin_clz(mask));
            bits = top > bits ? top : bits;
        }
    }
    return bits;
}

/* Per vector of `width` weights of a block, the index of its scale and of its minimum (no division
 * per vector in the loops). The caller checks elements / width <= QS_MAX_VECTORS. */
#define QS_MAX_VECTORS 1024
static void group_indices(int32_t *at_scale, int32_t *at_minimum, int64_t elements, int64_t width, int64_t group_size,
                          int64_t scale_step, int64_t minimum_step) {
    for (int64_t i = 0; i < elements / width; i++) {
        const int64_t g = i * width / group_size;
        at_scale[i] = (int32_t)(g / scale_step);
        at_minimum[i] = (int32_t)(g / minimum_step);
    }
}

QS_AVX512 static inline void store16(float *p, __m512 w, int stream) {
    if (stream) {
        _mm512_stream_ps(p, w);
    } else {
        _mm512_storeu_ps(p, w);
    }
}

QS_AVX512 static inline __m512 finish16(__m512 t, float s, float m, int has_minimum, int64_t minimum_sign) {
    __m512 w = _mm512_mul_ps(_mm512_set1_ps(s), t);
    if (has_minimum) {
        w = minimum_sign > 0 ? _mm512_add_ps(w, _mm512_set1_ps(m)) : _mm512_sub_ps(w, _mm512_set1_ps(m));
    }
    return w;
}

/* The element tables a 16-lane lookup uses: up to 64 codes in four registers (permutes, no
 * memory access), or a signed 8-bit integer table (converted, not looked up), else a gather. */
typedef struct {
    __m512 part[4];
    int codes, signed_bytes;
} table16;

QS_AVX512 static table16 make_table16(const float *table, int64_t codes) {
    table16 t;
    t.codes = (int)codes;
    t.signed_bytes = codes == 256;
    for (int64_t c = 0; c < codes && t.signed_bytes; c++) {
        t.signed_bytes = table[c] == (float)(int8_t)(uint8_t)c;
    }
    for (int i = 0; i < 4; i++) {
        const int64_t left = codes - 16 * i;
        const __mmask16 lanes = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
        t.part[i] = codes <= 64 ? _mm512_maskz_loadu_ps(lanes, table + 16 * i) : _mm512_setzero_ps();
    }
    return t;
}

QS_AVX512 static inline __m512 lookup16(const table16 *t, __m512i code, const float *table) {
    if (t->codes <= 16) {
        return _mm512_permutexvar_ps(code, t->part[0]);
    }
    if (t->codes <= 32) {
        return _mm512_permutex2var_ps(t->part[0], code, t->part[1]);
    }
    if (t->codes <= 64) {
        const __m512 low = _mm512_permutex2var_ps(t->part[0], code, t->part[1]);
        const __m512 high = _mm512_permutex2var_ps(t->part[2], code, t->part[3]);
        return _mm512_mask_blend_ps(_mm512_test_epi32_mask(code, _mm512_set1_epi32(32)), low, high);
    }
    if (t->signed_bytes) { /* code c is the byte c: its value is (int8_t)c */
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(code, 24), 24));
    }
    return _mm512_i32gather_ps(code, table, 4);
}

QS_AVX512 static void plane_avx512(const uint8_t *restrict raw, float *restrict out, const float *restrict scale,
                                   const float *restrict minimum, const float *restrict table, int64_t blocks,
                                   int64_t block_bytes, int64_t elements, int64_t plane_offset, int64_t bits, int64_t run,
                                   int64_t scale_count, int64_t minimum_count, int64_t minimum_sign, int stream) {
    const int64_t groups = minimum_count > scale_count ? minimum_count : scale_count;
    const int64_t group_size = elements / groups, scale_step = groups / scale_count;
    const int64_t minimum_step = minimum_count > 0 ? groups / minimum_count : 1;
    const int64_t per_run = run * (8 / bits), codes = (int64_t)1 << bits;
    const int has_minimum = minimum_count > 0;
    const __m512i mask = _mm512_set1_epi32((int)(codes - 1));
    int32_t at_scale[QS_MAX_VECTORS], at_minimum[QS_MAX_VECTORS];
    group_indices(at_scale, at_minimum, elements, 16, group_size, scale_step, minimum_step);
    const table16 lookup = make_table16(table, codes);
    if (run == 8 && per_run == 16) { /* runs of 8 bytes of two nibbles: one vector per run */
        const __m512i shifts = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *restrict block = raw + b * block_bytes + plane_offset;
            float *restrict row = out + b * elements;
            for (int64_t v = 0; v < elements; v += 16) {
                const __m128i eight = _mm_loadl_epi64((const __m128i *)(block + v / 2));
                __m512i code = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(eight, eight));
                code = _mm512_and_si512(_mm512_srlv_epi32(code, shifts), mask);
                const float s = scale[b * scale_count + at_scale[v / 16]];
                const float m = has_minimum ? minimum[b * minimum_count + at_minimum[v / 16]] : 0.0f;
                store16(row + v, finish16(lookup16(&lookup, code, table), s, m, has_minimum, minimum_sign), stream);
            }
        }
        if (stream) {
            _mm_sfence();
        }
        return;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *restrict block = raw + b * block_bytes + plane_offset;
        float *restrict row = out + b * elements;
        for (int64_t v0 = 0; v0 < elements; v0 += run) {
            const __m128i shift = _mm_cvtsi64_si128(((v0 % per_run) / run) * bits);
            const uint8_t *restrict bytes = block + (v0 / per_run) * run;
            for (int64_t j = 0; j < run; j += 16) {
                const int64_t v = v0 + j;
                const float s = scale[b * scale_count + at_scale[v / 16]];
                const float m = has_minimum ? minimum[b * minimum_count + at_minimum[v / 16]] : 0.0f;
                __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + j)));
                code = _mm512_and_si512(_mm512_srl_epi32(code, shift), mask);
                store16(row + v, finish16(lookup16(&lookup, code, table), s, m, has_minimum, minimum_sign), stream);
            }
        }
    }
    if (stream) {
        _mm_sfence();
    }
}

QS_AVX512 static void decode_avx512(const uint8_t *restrict raw, float *restrict out, const float *restrict scale,
                                    const float *restrict minimum, const int32_t *restrict slots,
                                    const float *restrict table, int64_t blocks, int64_t block_bytes, int64_t elements,
                                    int64_t depth, int64_t scale_count, int64_t minimum_count, int64_t minimum_sign,
                                    int stream) {
    const int64_t groups = minimum_count > scale_count ? minimum_count : scale_count;
    const int64_t run = elements / groups, scale_step = groups / scale_count;
    const int64_t minimum_step = minimum_count > 0 ? groups / minimum_count : 1;
    const int has_minimum = minimum_count > 0;
    const __m512i low_byte = _mm512_set1_epi32(0xFF);
    const table16 lookup = make_table16(table, (int64_t)1 << code_bits(slots, depth, elements));
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *restrict block = raw + b * block_bytes;
        float *restrict row = out + b * elements;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[b * scale_count + g / scale_step];
            const float m = has_minimum ? minimum[b * minimum_count + g / minimum_step] : 0.0f;
            for (int64_t v = g * run; v < (g + 1) * run; v += 16) {
                __m512i code = _mm512_setzero_si512();
                for (int64_t d = 0; d < depth; d++) {
                    const int32_t *slot = slots + d * 4 * elements + v;
                    const __m512i at = _mm512_loadu_si512((const void *)slot);
                    __m512i part = _mm512_and_si512(_mm512_i32gather_epi32(at, (const void *)block, 1), low_byte);
                    part = _mm512_srlv_epi32(part, _mm512_loadu_si512((const void *)(slot + elements)));
                    part = _mm512_and_si512(part, _mm512_loadu_si512((const void *)(slot + 2 * elements)));
                    code = _mm512_or_si512(code, _mm512_sllv_epi32(part, _mm512_loadu_si512((const void *)(slot + 3 * elements))));
                }
                store16(row + v, finish16(lookup16(&lookup, code, table), s, m, has_minimum, minimum_sign), stream);
            }
        }
    }
    if (stream) {
        _mm_sfence();
    }
}

QS_AVX2 static inline __m256 finish8(__m256 t, float s, float m, int has_minimum, int64_t minimum_sign) {
    __m256 w = _mm256_mul_ps(_mm256_set1_ps(s), t);
    if (has_minimum) {
        w = minimum_sign > 0 ? _mm256_add_ps(w, _mm256_set1_ps(m)) : _mm256_sub_ps(w, _mm256_set1_ps(m));
    }
    return w;
}

QS_AVX2 static inline void store8(float *p, __m256 w, int stream) {
    if (stream) {
        _mm256_stream_ps(p, w);
    } else {
        _mm256_storeu_ps(p, w);
    }
}

QS_AVX2 static void plane_avx2(const uint8_t *restrict raw, float *restrict out, const float *restrict scale,
                               const float *restrict minimum, const float *restrict table, int64_t blocks,
                               int64_t block_bytes, int64_t elements, int64_t plane_offset, int64_t bits, int64_t run,
                               int64_t scale_count, int64_t minimum_count, int64_t minimum_sign, int stream) {
    const int64_t groups = minimum_count > scale_count ? minimum_count : scale_count;
    const int64_t group_size = elements / groups, scale_step = groups / scale_count;
    const int64_t minimum_step = minimum_count > 0 ? groups / minimum_count : 1;
    const int64_t per_run = run * (8 / bits), codes = (int64_t)1 << bits;
    const int has_minimum = minimum_count > 0;
    const __m256i mask = _mm256_set1_epi32((int)(codes - 1));
    int32_t at_scale[QS_MAX_VECTORS], at_minimum[QS_MAX_VECTORS];
    group_indices(at_scale, at_minimum, elements, 8, group_size, scale_step, minimum_step);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *restrict block = raw + b * block_bytes + plane_offset;
        float *restrict row = out + b * elements;
        for (int64_t v0 = 0; v0 < elements; v0 += run) {
            const __m128i shift = _mm_cvtsi64_si128(((v0 % per_run) / run) * bits);
            const uint8_t *restrict bytes = block + (v0 / per_run) * run;
            for (int64_t j = 0; j < run; j += 8) {
                const int64_t v = v0 + j;
                const float s = scale[b * scale_count + at_scale[v / 8]];
                const float m = has_minimum ? minimum[b * minimum_count + at_minimum[v / 8]] : 0.0f;
                __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + j)));
                code = _mm256_and_si256(_mm256_srl_epi32(code, shift), mask);
                store8(row + v, finish8(_mm256_i32gather_ps(table, code, 4), s, m, has_minimum, minimum_sign), stream);
            }
        }
    }
    if (stream) {
        _mm_sfence();
    }
}

QS_AVX2 static void decode_avx2(const uint8_t *restrict raw, float *restrict out, const float *restrict scale,
                                const float *restrict minimum, const int32_t *restrict slots, const float *restrict table,
                                int64_t blocks, int64_t block_bytes, int64_t elements, int64_t depth, int64_t scale_count,
                                int64_t minimum_count, int64_t minimum_sign, int stream) {
    const int64_t groups = minimum_count > scale_count ? minimum_count : scale_count;
    const int64_t run = elements / groups, scale_step = groups / scale_count;
    const int64_t minimum_step = minimum_count > 0 ? groups / minimum_count : 1;
    const int has_minimum = minimum_count > 0;
    const __m256i low_byte = _mm256_set1_epi32(0xFF);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *restrict block = raw + b * block_bytes;
        float *restrict row = out + b * elements;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[b * scale_count + g / scale_step];
            const float m = has_minimum ? minimum[b * minimum_count + g / minimum_step] : 0.0f;
            for (int64_t v = g * run; v < (g + 1) * run; v += 8) {
                __m256i code = _mm256_setzero_si256();
                for (int64_t d = 0; d < depth; d++) {
                    const int32_t *slot = slots + d * 4 * elements + v;
                    const __m256i at = _mm256_loadu_si256((const __m256i *)slot);
                    __m256i part = _mm256_and_si256(_mm256_i32gather_epi32((const int *)block, at, 1), low_byte);
                    part = _mm256_srlv_epi32(part, _mm256_loadu_si256((const __m256i *)(slot + elements)));
                    part = _mm256_and_si256(part, _mm256_loadu_si256((const __m256i *)(slot + 2 * elements)));
                    code = _mm256_or_si256(code, _mm256_sllv_epi32(part, _mm256_loadu_si256((const __m256i *)(slot + 3 * elements))));
                }
                store8(row + v, finish8(_mm256_i32gather_ps(table, code, 4), s, m, has_minimum, minimum_sign), stream);
            }
        }
    }
    if (stream) {
        _mm_sfence();
    }
}
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

/* The widest vector loops this CPU runs. */
static int isa_supported(void) {
    int found = ISA_SCALAR;
#ifdef QS_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
        found = ISA_AVX512;
    } else if (__builtin_cpu_supports("avx2")) {
        found = ISA_AVX2;
    }
#endif
    return found;
}

static int isa_active = -1; /* the loops in use: the widest supported unless set_isa chose narrower ones */

static int isa_level(void) {
    if (isa_active < 0) {
        isa_active = isa_supported();
    }
    return isa_active;
}

static const char *const ISA_NAMES[] = {"scalar", "avx2", "avx512"};

#ifdef QS_HAVE_X86
/* Vectors of `width` weights fit the layout: every run and group a multiple of the width. */
static int vector_fits(int64_t width, int64_t elements, int64_t run, int64_t group_size) {
    return elements % width == 0 && run % width == 0 && group_size % width == 0 && elements / width <= 1024;
}

/* Streaming stores: a large output, aligned to the vector. */
static int use_stream(const float *out, int64_t blocks, int64_t elements, int64_t width) {
    return blocks * elements * 4 >= QS_STREAM_BYTES && ((uintptr_t)out % (uintptr_t)(width * 4)) == 0 &&
           (elements * 4) % (width * 4) == 0;
}

/* The largest byte a slot table reads, plus 4: a 32-bit gather at the block's last slot must stay
 * inside the caller's bytes, so the last block runs the scalar loop where it would not. */
static int64_t slots_reach(const int32_t *slots, int64_t depth, int64_t elements) {
    int64_t reach = 0;
    for (int64_t d = 0; d < depth; d++) {
        for (int64_t v = 0; v < elements; v++) {
            const int64_t at = (int64_t)slots[d * 4 * elements + v] + 4;
            reach = at > reach ? at : reach;
        }
    }
    return reach;
}
#endif

static PyObject *decode_plane(PyObject *self, PyObject *args) {
    unsigned long long raw, out, scale, minimum, table;
    long long blocks, block_bytes, elements, plane_offset, bits, run, scale_count, minimum_count, minimum_sign;
    (void)self;
    int fresh = 0; /* the output was just allocated: its pages come zeroed into the cache, so plain stores */
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLLLL|p", &raw, &out, &scale, &minimum, &table, &blocks, &block_bytes,
                          &elements, &plane_offset, &bits, &run, &scale_count, &minimum_count, &minimum_sign, &fresh)) {
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
    const int level = isa_level();
    (void)level; /* unused where only the scalar loops are built */
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *raw_p = (const uint8_t *)(uintptr_t)raw;
    float *out_p = (float *)(uintptr_t)out;
    const float *scale_p = (const float *)(uintptr_t)scale, *minimum_p = (const float *)(uintptr_t)minimum;
    const float *table_p = (const float *)(uintptr_t)table;
    int done = 0;
#ifdef QS_HAVE_X86
    const int nibble_runs = run == 8 && bits == 4 && elements % 16 == 0 && (elements / groups) % 16 == 0 && elements <= 16 * 1024;
    if (level == ISA_AVX512 && (vector_fits(16, elements, run, elements / groups) || nibble_runs)) {
        plane_avx512(raw_p, out_p, scale_p, minimum_p, table_p, blocks, block_bytes, elements, plane_offset, bits, run,
                     scale_count, minimum_count, minimum_sign, !fresh && use_stream(out_p, blocks, elements, 16));
        done = 1;
    } else if (level >= ISA_AVX2 && vector_fits(8, elements, run, elements / groups)) {
        plane_avx2(raw_p, out_p, scale_p, minimum_p, table_p, blocks, block_bytes, elements, plane_offset, bits, run,
                   scale_count, minimum_count, minimum_sign, !fresh && use_stream(out_p, blocks, elements, 8));
        done = 1;
    }
#endif
    if (!done) {
        decode_plane_range(raw_p, out_p, scale_p, minimum_p, table_p, blocks, block_bytes, elements, plane_offset, bits,
                           run, scale_count, minimum_count, minimum_sign);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long raw, out, scale, minimum, slots, table;
    long long blocks, block_bytes, elements, depth, scale_count, minimum_count, minimum_sign;
    (void)self;
    int fresh = 0; /* as in decode_plane */
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLLL|p", &raw, &out, &scale, &minimum, &slots, &table, &blocks, &block_bytes,
                          &elements, &depth, &scale_count, &minimum_count, &minimum_sign, &fresh)) {
        return NULL;
    }
    const long long groups = minimum_count > scale_count ? minimum_count : scale_count;
    if (blocks < 0 || block_bytes <= 0 || elements <= 0 || depth <= 0 || scale_count <= 0 ||
        elements % scale_count != 0 || minimum_count < 0 || (minimum_count > 0 && elements % minimum_count != 0) ||
        elements % groups != 0 || groups % scale_count != 0 || (minimum_count > 0 && groups % minimum_count != 0)) {
        PyErr_SetString(PyExc_ValueError, "qscheme._blocks.decode: inconsistent sizes");
        return NULL;
    }
    const int level = isa_level();
    (void)level; /* unused where only the scalar loops are built */
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *raw_p = (const uint8_t *)(uintptr_t)raw;
    float *out_p = (float *)(uintptr_t)out;
    const float *scale_p = (const float *)(uintptr_t)scale, *minimum_p = (const float *)(uintptr_t)minimum;
    const int32_t *slots_p = (const int32_t *)(uintptr_t)slots;
    const float *table_p = (const float *)(uintptr_t)table;
    int64_t vectored = 0; /* blocks the vector loop decodes; the rest run the scalar loop */
#ifdef QS_HAVE_X86
    const int64_t width = level == ISA_AVX512 ? 16 : 8, run = elements / groups;
    if (level >= ISA_AVX2 && vector_fits(width, elements, run, run)) {
        vectored = slots_reach(slots_p, depth, elements) <= block_bytes ? blocks : (blocks > 0 ? blocks - 1 : 0);
        const int stream = !fresh && use_stream(out_p, vectored, elements, width);
        if (level == ISA_AVX512) {
            decode_avx512(raw_p, out_p, scale_p, minimum_p, slots_p, table_p, vectored, block_bytes, elements, depth,
                          scale_count, minimum_count, minimum_sign, stream);
        } else {
            decode_avx2(raw_p, out_p, scale_p, minimum_p, slots_p, table_p, vectored, block_bytes, elements, depth,
                        scale_count, minimum_count, minimum_sign, stream);
        }
    }
#endif
    decode_range(raw_p + vectored * block_bytes, out_p + vectored * elements, scale_p + vectored * scale_count,
                 minimum_count > 0 ? minimum_p + vectored * minimum_count : minimum_p, slots_p, table_p,
                 blocks - vectored, block_bytes, elements, depth, scale_count, minimum_count, minimum_sign);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *isa(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyUnicode_FromString(ISA_NAMES[isa_level()]);
}

static PyObject *supported_isa(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyUnicode_FromString(ISA_NAMES[isa_supported()]);
}

static PyObject *set_isa(PyObject *self, PyObject *args) {
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) {
        return NULL;
    }
    for (int level = ISA_SCALAR; level <= ISA_AVX512; level++) {
        if (strcmp(name, ISA_NAMES[level]) == 0) {
            if (level > isa_supported()) {
                PyErr_Format(PyExc_ValueError, "qscheme._blocks.set_isa: this CPU does not run %s loops (it runs %s)",
                             name, ISA_NAMES[isa_supported()]);
                return NULL;
            }
            isa_active = level;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "qscheme._blocks.set_isa: %s is not one of scalar, avx2, avx512", name);
    return NULL;
}

/* Ask the kernel to back [address, address + nbytes) with huge pages where it can (Linux's
 * transparent huge pages in `madvise` mode): a fresh output of tens of MB then takes a few
 * hundred page faults instead of tens of thousands. Only the 2 MiB-aligned interior is advised;
 * returns whether the advice was taken. */
static PyObject *advise_huge(PyObject *self, PyObject *args) {
    unsigned long long address, nbytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &address, &nbytes)) {
        return NULL;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const unsigned long long huge = 1ull << 21;
    const unsigned long long first = (address + huge - 1) & ~(huge - 1), last = (address + nbytes) & ~(huge - 1);
    if (last > first && madvise((void *)(uintptr_t)first, (size_t)(last - first), MADV_HUGEPAGE) == 0) {
        Py_RETURN_TRUE;
    }
#endif
    Py_RETURN_FALSE;
}

/* The first block with a value of a field whose masked bytes are all set (an fp16/bf16/fp32
 * exponent of all ones: infinite or NaN; an e8m0 byte of 255), or -1. Per value of `size` bytes at
 * `offset + i * size` in a block (i < count): byte0 & mask0 == mask0 and byte1 & mask1 == mask1. */
static PyObject *first_masked(PyObject *self, PyObject *args) {
    unsigned long long raw;
    long long blocks, block_bytes, offset, size, count, byte0, mask0, byte1, mask1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLLLLLLLL", &raw, &blocks, &block_bytes, &offset, &size, &count, &byte0, &mask0,
                          &byte1, &mask1)) {
        return NULL;
    }
    if (blocks < 0 || block_bytes <= 0 || offset < 0 || size <= 0 || count < 0 || byte0 < 0 || byte0 >= size ||
        byte1 < 0 || byte1 >= size || offset + count * size > block_bytes || mask0 < 0 || mask0 > 255 || mask1 < 0 ||
        mask1 > 255) {
        PyErr_SetString(PyExc_ValueError, "qscheme._blocks.first_masked: inconsistent sizes");
        return NULL;
    }
    long long found = -1;
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *bytes = (const uint8_t *)(uintptr_t)raw;
    const uint8_t m0 = (uint8_t)mask0, m1 = (uint8_t)mask1;
    for (long long b = 0; b < blocks && found < 0; b++) {
        const uint8_t *value = bytes + b * block_bytes + offset;
        int hit = 0;
        for (long long i = 0; i < count; i++, value += size) {
            hit |= (value[byte0] & m0) == m0 && (value[byte1] & m1) == m1;
        }
        if (hit) {
            found = b;
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(found);
}

static PyMethodDef methods[] = {
    {"first_masked", first_masked, METH_VARARGS, "The first block holding a value with all masked bits set, or -1."},
    {"isa", isa, METH_NOARGS, "The vector loops in use: 'avx512', 'avx2' or 'scalar'."},
    {"supported_isa", supported_isa, METH_NOARGS, "The widest vector loops this CPU runs."},
    {"set_isa", set_isa, METH_VARARGS, "Use the 'scalar', 'avx2' or 'avx512' loops (at most what the CPU runs)."},
    {"advise_huge", advise_huge, METH_VARARGS, "Advise huge pages for a fresh output buffer (Linux)."},
    {"decode", decode, METH_VARARGS, "Decode packed blocks into float32 (see qscheme.formats.blocks)."},
    {"decode_plane", decode_plane, METH_VARARGS, "Decode packed blocks whose codes are one bit plane."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
