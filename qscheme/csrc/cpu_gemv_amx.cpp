// The AMX tile path of the CPU GEMV (see cpu_gemv_amx.h).
#include "cpu_gemv_amx.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

// x86-64 Linux (the tile state is requested from the kernel) and a compiler with the AMX
// intrinsics (GCC 11, clang 12); elsewhere the stubs at the end decline every layer.
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,amx-tile,amx-bf16,avx2,fma,f16c")
#include <immintrin.h>

#include "amx_config.h"
#include "amx_panel.h"

namespace qscheme_gemv {
namespace {

constexpr int ROWS = 16;        // weight rows per tile
constexpr int COLS = 32;        // weight columns (bfloat16) per tile row
constexpr int AHEAD = 4;        // chunks decoded ahead of their tile loads
constexpr int DEPTH = 8;        // tile buffers (twice AHEAD: a buffer is rewritten long after its tile load)
constexpr int MAX_M = 16;       // rows of x per pass (a tile row holds 16 float32 sums)

using qscheme_amx_config::load_config;
using qscheme_amx_config::store_config;
using qscheme_amx_config::TileConfig;

// Tiles: 0 and 3 sum the even and odd chunks of even scale groups (two chains, so that one
// product need not wait for the last), 6 and 7 those of odd groups (one group's sums are read
// while the next accumulates), 1 and 4 hold the decoded weights, 2 and 5 the matching x.
void configure(int m) {
    TileConfig config;
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = ROWS;
        config.colsb[t] = static_cast<uint16_t>(t == 1 || t == 4 ? 2 * COLS : 4 * m);
    }
    load_config(config);
}

uint16_t bf16_bits(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);
}

bool bf16_exact(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return (bits & 0xFFFFu) == 0;
}

// A value the tiles multiply as the float32 loop would: exact in bfloat16, and zero, or normal
// in bfloat16 (the tile unit reads subnormals as zero), or not finite.
bool tile_exact(float f) {
    if (!bf16_exact(f)) return false;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    return magnitude == 0 || magnitude >= 0x00800000u;
}

// The 16 code values as bfloat16 words, twice (vpermw reads 5 index bits; the fifth is noise).
struct Tables {
    float lut[16];
    float scale_table[256];
    int scale_kind = -1;
    bool lut_exact = false;
    alignas(64) uint16_t base[32];
    alignas(64) uint16_t folded[256][32];  // value * scale_table[b], for byte scales of 4-bit codes
    uint8_t bad[256];                      // folded[b] not exact: its rows take the float32 loop
};

const Tables &tables_for(const Params &p) {
    thread_local Tables t;
    const bool byte_scale = p.scale_kind == SCALE_BYTE;
    if (t.scale_kind == p.scale_kind && std::memcmp(t.lut, p.lut, sizeof(t.lut)) == 0 &&
        (!byte_scale || std::memcmp(t.scale_table, p.scale_table, sizeof(t.scale_table)) == 0))
        return t;
    std::memcpy(t.lut, p.lut, sizeof(t.lut));
    std::memcpy(t.scale_table, p.scale_table, sizeof(t.scale_table));
    t.scale_kind = p.scale_kind;
    t.lut_exact = true;
    for (int i = 0; i < 16; i++) {
        t.lut_exact = t.lut_exact && tile_exact(p.lut[i]);
        t.base[i] = t.base[i + 16] = bf16_bits(p.lut[i]);
    }
    if (byte_scale) {
        for (int b = 0; b < 256; b++) {
            bool bad = false;
            for (int i = 0; i < 16; i++) {
                const float v = p.lut[i] * p.scale_table[b];  // exact where it passes tile_exact
                const double exact = static_cast<double>(p.lut[i]) * static_cast<double>(p.scale_table[b]);
                bad = bad || !tile_exact(v) || static_cast<double>(v) != exact || !std::isfinite(v);
                t.folded[b][i] = t.folded[b][i + 16] = bf16_bits(v);
            }
            t.bad[b] = bad;
        }
    }
    return t;
}

// x rows [0, m) as the tiles' second operand: for each chunk of 32 columns, 16 rows of m pairs
// of bfloat16 (x[k], x[k + 1]). False where an element is not a bfloat16 value or is nonzero
// and smaller than 2**-100 (products and sums then stay clear of the subnormals the tiles flush).
bool pack_x(const float *x, int64_t ldx, int m, int64_t chunks, bool half, bool nibble, uint32_t *out) {
    __m512i inexact = _mm512_setzero_si512();
    __mmask16 tiny = 0;
    const __m512i low = _mm512_set1_epi32(0xFFFF), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), small = _mm512_set1_epi32(0x0D7FFFFF);  // 2**-100
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i index_even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i index_odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    // m = 2 and 4: the [m][16] pairs of a chunk written as [16][m] through permutes
    const __m512i mix_low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i mix_high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512i quad_low = _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0);
    const __m512i quad_high = _mm512_set_epi64(15, 7, 14, 6, 13, 5, 12, 4);
    const __m512i stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(m));
    const int64_t total = chunks + (half ? 1 : 0);
    __m512i pairs[MAX_M];
    for (int64_t c = 0; c < total; c++) {
        const bool part = half && c == chunks;
        for (int r = 0; r < m; r++) {
            const float *row = x + r * ldx + c * COLS;
            __m512i a = _mm512_castps_si512(_mm512_loadu_ps(row));
            __m512i b = part ? _mm512_setzero_si512() : _mm512_castps_si512(_mm512_loadu_ps(row + 16));
            inexact = _mm512_or_si512(inexact, _mm512_and_si512(_mm512_or_si512(a, b), low));
            tiny |= _mm512_cmplt_epu32_mask(_mm512_sub_epi32(_mm512_and_si512(a, magnitude), one), small);
            tiny |= _mm512_cmplt_epu32_mask(_mm512_sub_epi32(_mm512_and_si512(b, magnitude), one), small);
            if (!nibble) {  // natural order: pair j is (row[2j], row[2j + 1])
                const __m512i even = _mm512_permutex2var_epi32(a, index_even, b);
                b = _mm512_permutex2var_epi32(a, index_odd, b);
                a = even;
            }  // a 4-bit layer's chunk is stored as its 16 even columns, then its 16 odd ones
            pairs[r] = _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, high));
        }
        uint32_t *base = out + c * ROWS * m;
        if (m == 1) {
            _mm512_storeu_si512(base, pairs[0]);
        } else if (m == 2) {
            _mm512_storeu_si512(base, _mm512_permutex2var_epi32(pairs[0], mix_low, pairs[1]));
            _mm512_storeu_si512(base + 16, _mm512_permutex2var_epi32(pairs[0], mix_high, pairs[1]));
        } else if (m == 4) {
            const __m512i t0 = _mm512_permutex2var_epi32(pairs[0], mix_low, pairs[1]);
            const __m512i t1 = _mm512_permutex2var_epi32(pairs[0], mix_high, pairs[1]);
            const __m512i u0 = _mm512_permutex2var_epi32(pairs[2], mix_low, pairs[3]);
            const __m512i u1 = _mm512_permutex2var_epi32(pairs[2], mix_high, pairs[3]);
            _mm512_storeu_si512(base, _mm512_permutex2var_epi64(t0, quad_low, u0));
            _mm512_storeu_si512(base + 16, _mm512_permutex2var_epi64(t0, quad_high, u0));
            _mm512_storeu_si512(base + 32, _mm512_permutex2var_epi64(t1, quad_low, u1));
            _mm512_storeu_si512(base + 48, _mm512_permutex2var_epi64(t1, quad_high, u1));
        } else {
            for (int r = 0; r < m; r++) _mm512_i32scatter_epi32(base + r, stride, pairs[r], 4);
        }
    }
    return _mm512_test_epi32_mask(inexact, inexact) == 0 && tiny == 0;
}

// 32 byte codes (or 16, the rest zero) as bfloat16 words.
inline __m512i decode_bytes(const uint8_t *q, int kind, bool part) {
    if (kind == CODE_E4M3) {
        const __m256i raw = part ? _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q)))
                                 : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q));
        __m512i w = _mm512_cvtepu8_epi16(raw);
        if (part) w = _mm512_maskz_mov_epi16(0x0000FFFFu, w);
        // s eeee mmm -> bfloat16 s (e + 120) mmm0000 for e > 0; e = 0 from a table of m * 2**-9
        const __m512i magnitude = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x7F0)),
                                                   _mm512_set1_epi16(0x3C00));
        const __m512i sign = _mm512_slli_epi16(w, 8);
        __m512i v = _mm512_ternarylogic_epi32(magnitude, sign, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
        const __mmask32 sub = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
        const __m512i subnormal = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                   0, 0, 0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
        const __m512i small = _mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(7)), subnormal);
        v = _mm512_mask_mov_epi16(v, sub, _mm512_or_si512(small, _mm512_and_si512(sign, _mm512_set1_epi16(static_cast<short>(0x8000)))));
        return v;
    }
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i *>(q));
    const __m128i hi = part ? _mm_setzero_si128() : _mm_loadu_si128(reinterpret_cast<const __m128i *>(q + 16));
    __m512 a, b;
    if (kind == CODE_INT8) {
        a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    } else {
        a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
        b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    }
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // exact: integers of 8 bits
}

enum Mode { FOLD16 = 0, FOLD = 1, BASE = 2, BYTES = 3 };

struct Pass {
    const Params *p;
    const Tables *t;
    const uint32_t *xb;
    int m;
    int64_t chunks;
    bool half;
    int32_t rows[ROWS * MAX_M];  // rows[i]: the weight row of element i of a [16][m] tile store (i / m)
};

// Whether a row's scale bytes include one the fold cannot take (t.bad, looked up 64 at a time).
bool scales_bad(const uint8_t *bytes, int64_t count, const Tables &t) {
    const __m512i t0 = _mm512_loadu_si512(t.bad), t1 = _mm512_loadu_si512(t.bad + 64);
    const __m512i t2 = _mm512_loadu_si512(t.bad + 128), t3 = _mm512_loadu_si512(t.bad + 192);
    __m512i any = _mm512_setzero_si512();
    for (int64_t i = 0; i < count; i += 64) {
        const __mmask64 lanes = count - i >= 64 ? ~0ULL : (1ULL << (count - i)) - 1;
        const __m512i v = _mm512_maskz_loadu_epi8(lanes, bytes + i);
        const __m512i low = _mm512_permutex2var_epi8(t0, v, t1), high = _mm512_permutex2var_epi8(t2, v, t3);
        any = _mm512_or_si512(any, _mm512_maskz_mov_epi8(lanes, _mm512_mask_blend_epi8(_mm512_movepi8_mask(v), low, high)));
    }
    return _mm512_test_epi8_mask(any, any) != 0;
}

// Chunk c (32 columns) of 16 rows (codes at codes + r * code_stride, byte scales likewise) as
// bfloat16 rows of the tile buffer `a`; `g`: the chunk's scale group (FOLD).
template <int MODE>
inline void decode_chunk(const Tables &t, int kind, const uint8_t *codes, int64_t code_stride, const uint8_t *scales,
                         int64_t scale_stride, int64_t c, int64_t g, bool part, uint8_t *a) {
    const __m512i base = _mm512_load_si512(t.base);
    const __mmask32 upper = 0xFFFF0000u;
    const uint8_t *q = codes + (MODE == BYTES ? c * COLS : c * (COLS / 2));
    const uint8_t *sc = scales + (MODE == FOLD16 ? 2 * c : g);
    for (int r = 0; r < ROWS; r++, q += code_stride, sc += scale_stride) {
        __m512i w;
        if (MODE == BYTES) {
            w = decode_bytes(q, kind, part);
        } else {
            const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q)));
            const __m512i index = _mm512_or_si512(d, _mm512_slli_epi32(d, 12));
            if (MODE == BASE) {
                w = _mm512_permutexvar_epi16(index, base);
            } else if (MODE == FOLD16) {  // two scale groups: columns 0-15 and 16-31
                w = _mm512_permutexvar_epi16(index, _mm512_load_si512(t.folded[sc[0]]));
                w = _mm512_mask_permutexvar_epi16(w, upper, index, _mm512_load_si512(t.folded[sc[1]]));
            } else {
                w = _mm512_permutexvar_epi16(index, _mm512_load_si512(t.folded[sc[0]]));
            }
        }
        _mm512_store_si512(a + r * 2 * COLS, w);
    }
}

// Weight rows [n, n + rows) (rows <= 16) times the packed x: sums[r * m + j] for x row j.
// bad[r]: the row has a byte scale the fold cannot take.
template <int MODE>
void tile_rows(const Pass &s, int64_t n, int rows, float *sums, bool *bad) {
    constexpr bool folded = MODE == FOLD16 || MODE == FOLD;
    const Params &p = *s.p;
    const Tables &t = *s.t;
    alignas(64) static thread_local uint8_t buffers_tls[DEPTH][ROWS * 2 * COLS];
    uint8_t(*buffers)[ROWS * 2 * COLS] = buffers_tls;
    thread_local std::vector<float> scales_tls;  // [group][16 rows]
    thread_local std::vector<uint8_t> copy_tls;  // a ragged block's rows, the last repeated
    const int64_t cols = p.scale_cols;
    const int m = s.m;
    const uint8_t *codes = p.codes + n * p.code_stride;
    const uint8_t *scale_bytes = folded ? static_cast<const uint8_t *>(p.scale) + scale_row_base(p, n) : nullptr;
    int64_t code_stride = p.code_stride, scale_stride = p.group_n == 1 ? cols : 0;
    for (int r = 0; r < ROWS; r++)
        bad[r] = r < rows && folded && scales_bad(static_cast<const uint8_t *>(p.scale) + scale_row_base(p, n + r), cols, t);
    if (rows < ROWS) {
        const int64_t code_bytes = p.code_stride, scale_row = folded ? cols : 0;
        copy_tls.resize(static_cast<size_t>(ROWS * (code_bytes + scale_row)));
        for (int r = 0; r < ROWS; r++) {
            const int64_t row = n + (r < rows ? r : rows - 1);
            std::memcpy(copy_tls.data() + r * code_bytes, p.codes + row * p.code_stride, code_bytes);
            if (folded)
                std::memcpy(copy_tls.data() + ROWS * code_bytes + r * scale_row,
                            static_cast<const uint8_t *>(p.scale) + scale_row_base(p, row), scale_row);
        }
        codes = copy_tls.data();
        code_stride = code_bytes;
        if (folded) {
            scale_bytes = copy_tls.data() + ROWS * code_bytes;
            scale_stride = scale_row;
        }
    }
    float *group_scales = nullptr;
    if (!folded) {
        thread_local std::vector<float> row_tls;
        if (scales_tls.size() < static_cast<size_t>(ROWS * cols)) scales_tls.resize(static_cast<size_t>(ROWS * cols));
        if (row_tls.size() < static_cast<size_t>(cols)) row_tls.resize(static_cast<size_t>(cols));
        group_scales = scales_tls.data();
        for (int r = 0; r < ROWS; r++) {
            fill_scales(p, n + (r < rows ? r : rows - 1), row_tls.data());
            for (int64_t g = 0; g < cols; g++) group_scales[g * ROWS + r] = row_tls[g];
        }
    }
    const int64_t total = s.chunks + (s.half ? 1 : 0);
    // chunks per scale group: FOLD's groups are read per chunk; the others' sums are scaled per group
    const int64_t per_group = folded || p.group_k >= p.k ? total : p.group_k / COLS;
    const int64_t xstride = 4 * m;
    alignas(64) float c0[ROWS * MAX_M], c1[ROWS * MAX_M];
    alignas(64) float sum[ROWS * MAX_M] = {};
    __m512 row_factor = _mm512_set1_ps(1.0f);
    if (folded && p.row_scale)
        row_factor = _mm512_mask_loadu_ps(row_factor, static_cast<__mmask16>((1u << rows) - 1u), p.row_scale + n);
    auto decode = [&](int64_t c) {
        const int64_t g = MODE == FOLD ? c * COLS / p.group_k : 0;
        decode_chunk<MODE>(t, p.code_kind, codes, code_stride, scale_bytes, scale_stride, c, g,
                           s.half && c == s.chunks, buffers[c % DEPTH]);
    };
    // the sums of scale group g (tiles 0 and 3 for even groups, 6 and 7 for odd), scaled into sum:
    // c0 and c1 hold [16 rows][m], so vector v covers elements 16 v .. 16 v + 15, of rows s.rows[v]
    // (a group of one chunk sums in one tile: 0 for even groups, 7 for odd ones)
    const bool single = per_group == 1;
    auto flush = [&](int64_t g) {
        if (single) {
            if (g & 1) {
                _tile_stored(7, c0, xstride);
                _tile_zero(7);
            } else {
                _tile_stored(0, c0, xstride);
                _tile_zero(0);
            }
        } else if (g & 1) {
            _tile_stored(6, c0, xstride);
            _tile_stored(7, c1, xstride);
            _tile_zero(6);
            _tile_zero(7);
        } else {
            _tile_stored(0, c0, xstride);
            _tile_stored(3, c1, xstride);
            _tile_zero(0);
            _tile_zero(3);
        }
        const __m512 scale = folded ? row_factor : _mm512_loadu_ps(group_scales + g * ROWS);
        for (int v = 0; v < m; v++) {
            __m512 part = _mm512_load_ps(c0 + 16 * v);
            if (!single) part = _mm512_add_ps(part, _mm512_load_ps(c1 + 16 * v));
            const __m512 factor = _mm512_permutexvar_ps(_mm512_loadu_si512(s.rows + 16 * v), scale);
            __m512 out;
            if (!folded)
                out = _mm512_fmadd_ps(part, factor, _mm512_load_ps(sum + 16 * v));
            else if (!p.row_scale)
                out = part;
            else
                out = p.row_divide ? _mm512_div_ps(part, factor) : _mm512_mul_ps(part, factor);
            _mm512_store_ps(sum + 16 * v, out);
        }
    };
    _tile_zero(0);
    _tile_zero(3);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < AHEAD && c < total; c++) decode(c);
    for (int64_t c = 0; c < total; c++) {
        const uint8_t *a = buffers[c % DEPTH];
        const uint32_t *b = s.xb + c * ROWS * m;
        const int64_t g = c / per_group;
        if (c & 1) {
            _tile_loadd(4, a, 2 * COLS);
            _tile_loadd(5, b, xstride);
            if (g & 1)
                _tile_dpbf16ps(7, 4, 5);
            else
                _tile_dpbf16ps(3, 4, 5);
        } else {
            _tile_loadd(1, a, 2 * COLS);
            _tile_loadd(2, b, xstride);
            if (g & 1)
                _tile_dpbf16ps(6, 1, 2);
            else
                _tile_dpbf16ps(0, 1, 2);
        }
        // the previous group's sums, once this group's first product is under way
        if (c > 0 && c % per_group == 0) flush(g - 1);
        // decoded after this chunk's tile load, which would otherwise wait for these stores
        if (c + AHEAD < total) decode(c + AHEAD);
    }
    flush((total - 1) / per_group);
    std::memcpy(sums, sum, sizeof(float) * rows * m);
}

// The tiles (amx_panel.h: AMX-BF16, AVX512-BF16, the tile state granted) and VBMI, which the decode uses.
bool tile_state_granted() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") && qscheme_amx::granted();
}

}  // namespace

bool amx_usable() {
    static const bool granted = tile_state_granted();
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_AMX");
    return granted && !(setting && setting[0] == '0');
}

int amx_min_rows(const Params &p) {
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_AMX");
    if (setting && std::strcmp(setting, "all") == 0) return 1;
    return p.code_kind == CODE_INT8 || p.code_kind == CODE_UINT8 ? 5 : 4;
}

namespace {

// The tile mode of a layer (Mode), or -1 where the tiles do not take it (whatever x and M); *tables: the
// layer's tables (tables_for), where it has a mode.
int layer_mode(const Params &p, const Tables **tables) {
    if (p.zero || p.code_kind == CODE_E4M3_X256 || !amx_usable()) return -1;
    const bool nibble = p.code_kind == CODE_NIBBLE;
    const int64_t ce = nibble ? 32 : 16;
    if ((p.k / ce) * ce < COLS) return -1;
    const bool fold = nibble && p.scale_kind == SCALE_BYTE && p.group_n == 1;
    if (fold ? !(p.group_k == 16 || p.group_k % COLS == 0) : !(p.group_k % COLS == 0 || p.group_k >= p.k)) return -1;
    *tables = &tables_for(p);
    if (nibble && !(*tables)->lut_exact) return -1;
    return !nibble ? BYTES : !fold ? BASE : p.group_k == 16 ? FOLD16 : FOLD;
}

}  // namespace

bool amx_ahead(const Params &p, int m) {
    if (!amx_usable()) return false;
    const char *setting = std::getenv("QSCHEME_CPU_GEMV_AMX");
    const bool all = setting && std::strcmp(setting, "all") == 0;
    if (!all && m < amx_min_rows(p)) return false;  // before the layer's tables are looked at (M = 1-3)
    const Tables *tables = nullptr;
    const int mode = layer_mode(p, &tables);
    return mode >= 0 && (all || mode == FOLD);
}

bool gemv_amx(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc, int64_t ldy,
              RowsFunction fallback) {
    if (m < amx_min_rows(p) || n1 <= n0) return false;
    const Tables *tables = nullptr;
    const int mode = layer_mode(p, &tables);
    if (mode < 0) return false;
    const Tables &t = *tables;
    const bool nibble = p.code_kind == CODE_NIBBLE;
    const int64_t ce = nibble ? 32 : 16;
    const int64_t k_main = (p.k / ce) * ce;
    const int64_t chunks = k_main / COLS;
    const bool half = k_main % COLS != 0;
    thread_local std::vector<uint32_t> packed;
    TileConfig saved;
    store_config(saved);  // the caller's tile state (torch's own kernels may keep one)
    bool done = true;
    for (int m0 = 0; m0 < m && done; m0 += MAX_M) {
        const int mp = m - m0 < MAX_M ? m - m0 : MAX_M;
        packed.assign(static_cast<size_t>((chunks + 1) * ROWS * mp), 0u);
        if (!pack_x(x + m0 * ldx, ldx, mp, chunks, half, nibble, packed.data())) {
            done = m0 == 0 ? false : done;
            if (m0 > 0) fallback(p, x + m0 * ldx, ldx, m - m0, n0, n1, acc + m0 * ldy, ldy);
            break;
        }
        configure(mp);
        Pass pass{&p, &t, packed.data(), mp, chunks, half, {}};
        for (int i = 0; i < ROWS * mp; i++) pass.rows[i] = i / mp;
        alignas(64) float sums[ROWS * MAX_M];
        bool bad[ROWS];
        for (int64_t n = n0; n < n1; n += ROWS) {
            const int rows = n1 - n < ROWS ? static_cast<int>(n1 - n) : ROWS;
            switch (mode) {
                case FOLD16: tile_rows<FOLD16>(pass, n, rows, sums, bad); break;
                case FOLD: tile_rows<FOLD>(pass, n, rows, sums, bad); break;
                case BASE: tile_rows<BASE>(pass, n, rows, sums, bad); break;
                default: tile_rows<BYTES>(pass, n, rows, sums, bad); break;
            }
            for (int r = 0; r < rows; r++) {
                if (bad[r]) {
                    fallback(p, x + m0 * ldx, ldx, mp, n + r, n + r + 1, acc + m0 * ldy, ldy);
                    continue;
                }
                for (int j = 0; j < mp; j++) acc[(m0 + j) * ldy + n + r] = sums[r * mp + j];
            }
        }
    }
    if (saved.palette)
        load_config(saved);
    else
        _tile_release();
    return done;
}

}  // namespace qscheme_gemv

#else

namespace qscheme_gemv {
bool amx_usable() { return false; }
int amx_min_rows(const Params &) { return 1; }
bool amx_ahead(const Params &, int) { return false; }
bool gemv_amx(const Params &, const float *, int64_t, int, int64_t, int64_t, float *, int64_t, RowsFunction) {
    return false;
}
}  // namespace qscheme_gemv

#endif
