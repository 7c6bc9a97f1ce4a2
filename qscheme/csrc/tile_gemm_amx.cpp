// AVX-512 (with BF16) row decoder into bfloat16, and the fused tile GEMM on AMX tiles (tile_gemm.h): its
// panels decoded here, multiplied by amx_panel.cpp.
//
// The decoder forms each weight as the reference does, fp32((value - zero) * scale), and rounds it
// once to bfloat16 with VCVTNE2PS2BF16 (round to nearest even). That instruction reads a float32
// subnormal as zero: such a weight (|w| < 2**-126) becomes 0 instead of a bfloat16 subnormal,
// which the AMX dot product (TDPBF16PS) would read as zero anyway; the portable decoder keeps it.
// 4-bit codes go through a bfloat16 table of the 16 values times the group's scale (VPERMW: one
// table per group, or per pair of 16-wide groups); e4m3 codes through a table of the group's 128
// magnitudes times its scale (two VPERMT2W, the sign flipped for codes 0x80-0xFF), other 8-bit codes
// are widened, scaled and rounded.
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "amx_panel.h"
#include "tile_gemm.h"

namespace qscheme_tile {

namespace {

inline __m512 decode16(const uint8_t *bytes, int kind) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes));
    if (kind == CODE_E4M3) {
        // s eeee mmm -> float16 s 0 eeee mmm 0000000 (exact, subnormals included), widened and
        // scaled by 2**8 (the bias difference); 0x7F and 0xFF are NaN, as float8_e4m3fn says
        __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
        h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(static_cast<short>(0xBF80)));
        const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
        const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(raw, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::nanf("")));
    }
    if (kind == CODE_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
}

inline __m512i bf16_pair(__m512 high, __m512 low) { return (__m512i)_mm512_cvtne2ps_pbh(high, low); }

inline __m512 scaled(__m512 values, const float *s, const float *z, int64_t g, bool zero) {
    if (zero) values = _mm512_sub_ps(values, _mm512_set1_ps(z[g]));
    return _mm512_mul_ps(values, _mm512_set1_ps(s[g]));
}

// The values of the e4m3 codes 0-127 (0x7F: NaN), as decode16 gives them.
struct E4m3Magnitudes {
    alignas(64) float value[128];
    E4m3Magnitudes() {
        alignas(16) uint8_t bytes[16];
        for (int c = 0; c < 128; c += 16) {
            for (int i = 0; i < 16; i++) bytes[i] = static_cast<uint8_t>(c + i);
            _mm512_store_ps(value + c, decode16(bytes, CODE_E4M3));
        }
    }
};

// A group's 128 bfloat16 magnitudes bf16(value(c) * scale), c = 0-127, as four vectors of 32 words.
struct E4m3Table {
    __m512i t[4];
    E4m3Table(const float *magnitudes, float scale) {
        const __m512 s = _mm512_set1_ps(scale);
        for (int q = 0; q < 4; q++)
            t[q] = bf16_pair(_mm512_mul_ps(_mm512_load_ps(magnitudes + 32 * q + 16), s),
                             _mm512_mul_ps(_mm512_load_ps(magnitudes + 32 * q), s));
    }
    // 32 code bytes as their bfloat16 weights: the magnitude's entry, its sign flipped for codes
    // 0x80-0xFF (bf16(-v * s) is -bf16(v * s) for a finite s), NaN (0x7FC0, unsigned) for 0xFF
    __m512i lookup(const uint8_t *bytes) const {
        const __m512i code = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(bytes)));
        const __m512i low = _mm512_permutex2var_epi16(t[0], code, t[1]);
        const __m512i high = _mm512_permutex2var_epi16(t[2], code, t[3]);
        const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(code, _mm512_set1_epi16(0x40)), low, high);
        // magnitude ^ (code << 8 & 0x8000)
        const __m512i word = _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(code, 8),
                                                       _mm512_set1_epi16(static_cast<short>(0x8000)), 0x78);
        return _mm512_mask_mov_epi16(word, _mm512_cmpeq_epi16_mask(code, _mm512_set1_epi16(0xFF)),
                                     _mm512_set1_epi16(0x7FC0));
    }
};

// 16 code bytes (32 nibbles, element 2i in the low nibble of byte i) as 32 word indices in k order.
inline __m512i nibble_indices(const uint8_t *bytes) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes)));
    // (d | d << 12) & 0x000F000F: the low nibble in word 2i, the high one in word 2i + 1
    return _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
}

}  // namespace

bool vector_compiled() { return true; }

void row_scales_avx512(const Layer &p, int64_t n, int64_t g0, int64_t g1, float *s, float *z) {
    const int64_t base = (n / p.group_n) * p.scale_cols;
    if (p.scale_kind == SCALE_NONE) {
        row_scales(p, n, g0, g1, s, z);
        return;
    }
    const bool factor = p.row_scale != nullptr, divide = p.row_divide != 0;
    const __m512 row = _mm512_set1_ps(factor ? p.row_scale[n] : 1.0f);
    int64_t g = g0;
    for (; g + 16 <= g1; g += 16) {
        const int64_t i = base + g;
        __m512 v;
        switch (p.scale_kind) {
            case SCALE_F32: v = _mm512_loadu_ps(static_cast<const float *>(p.scale) + i); break;
            case SCALE_BF16: {
                const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(p.scale) + i));
                v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                break;
            }
            case SCALE_F16:
                v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const uint16_t *>(p.scale) + i)));
                break;
            default: {
                const uint8_t *bytes = static_cast<const uint8_t *>(p.scale) + i;
                if (p.byte_format == BYTE_E4M3) {
                    v = decode16(bytes, CODE_E4M3);
                } else if (p.byte_format == BYTE_E8M0) {
                    // 2**(e - 127): the exponent field; e = 0 is the subnormal 2**-127, e = 255 NaN
                    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes)));
                    __m512i bits = _mm512_slli_epi32(e, 23);
                    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                                 _mm512_set1_epi32(0x00400000));
                    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                                 _mm512_set1_epi32(0x7FC00000));
                    v = _mm512_castsi512_ps(bits);
                } else {
                    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes));
                    v = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), p.scale_table, 4);
                }
                break;
            }
        }
        if (factor) v = divide ? _mm512_div_ps(v, row) : _mm512_mul_ps(v, row);
        _mm512_storeu_ps(s + g, v);
        if (p.zero) {
            const __m256i zz = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p.zero + i));
            _mm512_storeu_ps(z + g, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(zz)));
        }
    }
    if (g < g1) row_scales(p, n, g, g1, s, z);
}

int64_t decode_row_avx512(const Layer &p, int64_t n, const float *s, const float *z, int64_t k0, int64_t k1,
                          uint16_t *out, const uint8_t *fetch) {
    // k0: a multiple of 32; k1: clipped to the whole chunks of 32 in K
    const int64_t g = p.group_k;
    k1 = std::min<int64_t>(k1, (p.k / 32) * 32);
    if (k1 <= k0) return k0;
    const uint8_t *row = p.codes + n * p.code_stride;
    const bool zero = p.zero != nullptr;
    if (p.code_kind == CODE_NIBBLE) {
        if (g != 16 && g % 32 != 0) return k0;
        const __m512 lut = _mm512_loadu_ps(p.lut);
        if (g == 16) {  // two groups per 32 codes: a 32-entry table, the upper 16 words index its upper half
            const __m512i upper = _mm512_set_epi32(0x00100010, 0x00100010, 0x00100010, 0x00100010, 0x00100010,
                                                   0x00100010, 0x00100010, 0x00100010, 0, 0, 0, 0, 0, 0, 0, 0);
            for (int64_t k = k0; k < k1; k += 32) {
                if (fetch && (k & 127) == 0) _mm_prefetch(reinterpret_cast<const char *>(fetch + k / 2), _MM_HINT_T0);
                const int64_t c = k / 32;
                const __m512i table = bf16_pair(scaled(lut, s, z, 2 * c + 1, zero), scaled(lut, s, z, 2 * c, zero));
                const __m512i index = _mm512_or_si512(nibble_indices(row + 16 * c), upper);
                _mm512_storeu_si512(out + (k - k0), _mm512_permutexvar_epi16(index, table));
            }
            return k1;
        }
        int64_t group = k0 / g;  // one division per call: a group's run ends at the next multiple of g
        for (int64_t k = k0; k < k1; group++) {
            const int64_t stop = std::min<int64_t>(k1, (group + 1) * g);
            const __m512 values = scaled(lut, s, z, group, zero);
            const __m512i table = bf16_pair(values, values);
            for (; k < stop; k += 32) {
                if (fetch && (k & 127) == 0) _mm_prefetch(reinterpret_cast<const char *>(fetch + k / 2), _MM_HINT_T0);
                _mm512_storeu_si512(out + (k - k0), _mm512_permutexvar_epi16(nibble_indices(row + k / 2), table));
            }
        }
        return k1;
    }
    if (g == 16) {
        for (int64_t k = k0; k < k1; k += 32) {
            if (fetch && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char *>(fetch + k), _MM_HINT_T0);
            const __m512 low = scaled(decode16(row + k, p.code_kind), s, z, k / 16, zero);
            const __m512 high = scaled(decode16(row + k + 16, p.code_kind), s, z, k / 16 + 1, zero);
            _mm512_storeu_si512(out + (k - k0), bf16_pair(high, low));
        }
        return k1;
    }
    if (g % 32 != 0) return k0;
    int64_t group = k0 / g, k = k0;
    if (p.code_kind == CODE_E4M3 && !zero) {
        // a table of the group's 128 magnitudes times its scale: one lookup per 32 codes, the
        // multiply and rounding done once per code value (groups with a non-finite scale, whose
        // products' NaN signs the sign flip would not give, take the loop below)
        static const E4m3Magnitudes magnitudes;
        for (; k < k1 && std::isfinite(s[group]); group++) {
            const int64_t stop = std::min<int64_t>(k1, (group + 1) * g);
            const E4m3Table table(magnitudes.value, s[group]);
            for (; k < stop; k += 32) {
                if (fetch && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char *>(fetch + k), _MM_HINT_T0);
                _mm512_storeu_si512(out + (k - k0), table.lookup(row + k));
            }
        }
        if (k >= k1) return k1;
    }
    if (p.code_kind == CODE_INT8 || p.code_kind == CODE_UINT8) {
        // bytes widened, scaled and rounded 32 at a time, one loop per form (the loop below, which
        // chooses the form per 16 codes, took twice as long: 0.13 ns a weight against 0.06)
        auto bytes = [&](auto is_signed, auto has_zero) {
            constexpr bool SIGNED = decltype(is_signed)::value, ZERO = decltype(has_zero)::value;
            const auto widen = [](__m128i b) {
                return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
            };
            for (; k < k1; group++) {
                const int64_t stop = std::min<int64_t>(k1, (group + 1) * g);
                const __m512 scale = _mm512_set1_ps(s[group]), offset = _mm512_set1_ps(ZERO ? z[group] : 0.0f);
                for (; k < stop; k += 32) {
                    if (fetch && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char *>(fetch + k), _MM_HINT_T0);
                    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(row + k));
                    __m512 low = widen(_mm256_castsi256_si128(raw)), high = widen(_mm256_extracti128_si256(raw, 1));
                    if (ZERO) {
                        low = _mm512_sub_ps(low, offset);
                        high = _mm512_sub_ps(high, offset);
                    }
                    _mm512_storeu_si512(out + (k - k0), bf16_pair(_mm512_mul_ps(high, scale), _mm512_mul_ps(low, scale)));
                }
            }
        };
        using yes = std::true_type;
        using no = std::false_type;
        if (p.code_kind == CODE_INT8)
            zero ? bytes(yes{}, yes{}) : bytes(yes{}, no{});
        else
            zero ? bytes(no{}, yes{}) : bytes(no{}, no{});
        return k1;
    }
    for (; k < k1; group++) {
        const int64_t stop = std::min<int64_t>(k1, (group + 1) * g);
        const __m512 scale = _mm512_set1_ps(s[group]), offset = _mm512_set1_ps(zero ? z[group] : 0.0f);
        for (; k < stop; k += 32) {
            if (fetch && (k & 63) == 0) _mm_prefetch(reinterpret_cast<const char *>(fetch + k), _MM_HINT_T0);
            __m512 low = decode16(row + k, p.code_kind), high = decode16(row + k + 16, p.code_kind);
            if (zero) {
                low = _mm512_sub_ps(low, offset);
                high = _mm512_sub_ps(high, offset);
            }
            _mm512_storeu_si512(out + (k - k0), bf16_pair(_mm512_mul_ps(high, scale), _mm512_mul_ps(low, scale)));
        }
    }
    return k1;
}

void decode_chunk(const Layer &p, int64_t n, int64_t k0, int64_t k1, uint16_t *out, const float *s,
                         const float *z) {
    const int64_t last = std::min(k1, p.k);
    if (last > k0) {
        // the same columns of the next row, decoded next, fetched line by line as this one is decoded
        // (a row or chunk is a few pages at most: the hardware prefetchers stop at each page's end)
        const uint8_t *row = p.codes + n * p.code_stride;
        const uint8_t *next = n + 1 < p.n ? row + p.code_stride : nullptr;
        for (int64_t k = decode_row_avx512(p, n, s, z, k0, last, out, next); k < last; k++)
            out[k - k0] = float_to_bf16(weight_value(p, row, s, z, k));
    }
    for (int64_t k = std::max(last, k0); k < k1; k++) out[k - k0] = 0;
}

void gemm_rows_amx(const Layer &p, const uint32_t *xp, int64_t m, int64_t mp, int64_t kp, const float *bias,
                   uint16_t *out, int64_t ldy, int64_t r0, int64_t r1, int64_t q0, int64_t q1, int64_t kc,
                   uint16_t *panel, float *acc, float *s, float *z) {
    // s, z: (q1 - q0) rows of scale_cols effective scales and zero points, filled once here
    qscheme_amx::TileState saved;
    qscheme_amx::begin(saved);
    const int64_t rows = q1 - q0, subpanels = rows / 32, groups = (mp / 16 + 1) / 2;
    const bool keep = subpanels * groups == 1;  // one accumulator set: it stays in the tiles
    const int64_t cols = p.scale_cols;
    for (int64_t r = 0; r < rows && q0 + r < r1; r++) row_scales_avx512(p, q0 + r, 0, cols, s + r * cols, z + r * cols);
    for (int64_t k0 = 0; k0 < kp; k0 += kc) {
        // panel rows PANEL_PAD columns longer than the chunk: rows a power of two apart fell into
        // one set of the L1 cache when a tile read 16 of them
        const int64_t width = std::min(kc, kp - k0), pitch = width + PANEL_PAD;
        for (int64_t r = 0; r < rows; r++) {
            uint16_t *dst = panel + r * pitch;
            if (q0 + r >= r1)
                std::memset(dst, 0, static_cast<size_t>(width) * 2);
            else
                decode_chunk(p, q0 + r, k0, k0 + width, dst, s + r * cols, z + r * cols);
        }
        for (int64_t sp = 0; sp < subpanels; sp++)
            qscheme_amx::multiply_panel(panel + sp * 32 * pitch, pitch, width / 32, xp, m, mp, kp, k0, k0 == 0,
                                        k0 + width >= kp, keep, acc + sp * groups * 1024, bias, out, ldy,
                                        q0 + sp * 32, r0, r1);
    }
    qscheme_amx::end(saved);
}

}  // namespace qscheme_tile

#else  // no x86, or a compiler without AMX intrinsics: the portable decoder runs, and no AMX

#include "tile_gemm.h"

namespace qscheme_tile {
bool vector_compiled() { return false; }
void row_scales_avx512(const Layer &p, int64_t n, int64_t g0, int64_t g1, float *s, float *z) { row_scales(p, n, g0, g1, s, z); }
int64_t decode_row_avx512(const Layer &, int64_t, const float *, const float *, int64_t k0, int64_t, uint16_t *,
                          const uint8_t *) {
    return k0;
}
void decode_chunk(const Layer &, int64_t, int64_t, int64_t, uint16_t *, const float *, const float *) {}
void gemm_rows_amx(const Layer &, const uint32_t *, int64_t, int64_t, int64_t, const float *, uint16_t *, int64_t,
                   int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t *, float *, float *, float *) {}
}  // namespace qscheme_tile

#endif
