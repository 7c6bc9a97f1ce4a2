// AVX-512 (F, BW, VL, DQ) instances of the GEMV loop (cpu_gemv_kernel.h) and of row dequantization.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#define QS_ISA_NAMESPACE qscheme_gemv_avx512
#include "cpu_gemv_amx.h"
#include "cpu_gemv_kernel.h"

namespace qscheme_gemv_avx512 {

struct V512 {
    static constexpr int W = 16;
    using vec = __m512;
    using Table = __m512;
    static inline vec zero() { return _mm512_setzero_ps(); }
    static inline vec load(const float *p) { return _mm512_loadu_ps(p); }
    static inline vec pair2(float a, float b) { return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1); }
    static inline vec set1(float v) { return _mm512_set1_ps(v); }
    static inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
    static inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
    static inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
    static inline vec pair(const float *v) {
        const __m512i index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double *>(v)))));
    }
    static inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
    static inline Table table(const float *lut) { return _mm512_loadu_ps(lut); }
    static inline void decode_nibbles(const uint8_t *bytes, Table lut, vec &even, vec &odd) {
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes)));
        even = _mm512_permutexvar_ps(d, lut);  // the low 4 bits of each index
        odd = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
    }
    // 32 bytes: e4m3 codes widened to float16 all at once (one widening and one shift pair for both
    // halves), other kinds as two decode_bytes
    static inline void decode_bytes2(const uint8_t *bytes, int kind, vec &a, vec &b) {
        if (kind == CODE_E4M3 || kind == CODE_E4M3_X256) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bytes));
            __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(raw), 8);
            h = _mm512_and_si512(_mm512_srai_epi16(h, 1), _mm512_set1_epi16(static_cast<short>(0xBF80)));
            a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
            b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            if (kind == CODE_E4M3) {
                a = _mm512_mul_ps(a, _mm512_set1_ps(256.0f));
                b = _mm512_mul_ps(b, _mm512_set1_ps(256.0f));
            }
            return;
        }
        a = decode_bytes(bytes, kind);
        b = decode_bytes(bytes + 16, kind);
    }
    static inline vec decode_bytes(const uint8_t *bytes, int kind) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i *>(bytes));
        if (kind == CODE_E4M3 || kind == CODE_E4M3_X256) {
            // s eeee mmm -> float16 bits s 0 eeee mmm 0000000 (exact, subnormals included), widened by
            // the F16C conversion and scaled by 2**8 (the bias difference): no float32 subnormal ever
            // reaches an arithmetic instruction (those would take microcode assists)
            __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
            h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(static_cast<short>(0xBF80)));
            const __m512 value = _mm512_cvtph_ps(h);  // the code's value / 256
            return kind == CODE_E4M3_X256 ? value : _mm512_mul_ps(value, _mm512_set1_ps(256.0f));
        }
        if (kind == CODE_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
    }
};

}  // namespace qscheme_gemv_avx512

namespace qscheme_gemv {

static void vector_rows(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                        int64_t ldy) {
    qscheme_gemv_avx512::gemv_vector<qscheme_gemv_avx512::V512>(p, x, ldx, m, n0, n1, acc, ldy);
}

// The tiles where the CPU, the layer and x allow them (cpu_gemv_amx.h), else the float32 loops.
void gemv_avx512(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc,
                 int64_t ldy) {
    if (gemv_amx(p, x, ldx, m, n0, n1, acc, ldy, vector_rows)) return;
    vector_rows(p, x, ldx, m, n0, n1, acc, ldy);
}

// bf16 with round-to-nearest-even (finite values; NaN stays NaN).
static inline __m256i to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

void dequantize_avx512(const Params &p, int64_t n0, int64_t n1, void *out, int out_bf16) {
    using V = qscheme_gemv_avx512::V512;
    const bool nibble = p.code_kind == CODE_NIBBLE;
    const int64_t ce = nibble ? 32 : 16, chunks = p.k / ce;
    const __m512 lut = V::table(p.lut);
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *codes = p.codes + n * p.code_stride;
        const int64_t base = scale_row_base(p, n);
        float *o32 = static_cast<float *>(out) + (n - n0) * p.k;
        uint16_t *o16 = static_cast<uint16_t *>(out) + (n - n0) * p.k;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t k0 = c * ce;
            __m512 w[2];
            int count;
            if (nibble) {
                __m512 even, odd;
                V::decode_nibbles(codes + c * 16, lut, even, odd);
                w[0] = _mm512_permutex2var_ps(even, lo_idx, odd);
                w[1] = _mm512_permutex2var_ps(even, hi_idx, odd);
                count = 2;
            } else {
                w[0] = V::decode_bytes(codes + c * 16, p.code_kind);
                count = 1;
            }
            for (int h = 0; h < count; h++) {
                const int64_t k = k0 + 16 * h;
                const int64_t g0 = base + k / p.group_k, g1 = base + (k + 15) / p.group_k;
                __m512 s, z = _mm512_setzero_ps();
                if (g0 == g1) {
                    s = _mm512_set1_ps(scale_value(p, g0, n));
                    if (p.zero) z = _mm512_set1_ps(static_cast<float>(p.zero[g0]));
                } else {  // groups narrower than 16 (vector_fits refuses those) never get here
                    alignas(64) float sv[16], zv[16];
                    for (int i = 0; i < 16; i++) {
                        const int64_t g = base + (k + i) / p.group_k;
                        sv[i] = scale_value(p, g, n);
                        zv[i] = p.zero ? static_cast<float>(p.zero[g]) : 0.0f;
                    }
                    s = _mm512_load_ps(sv);
                    z = _mm512_load_ps(zv);
                }
                __m512 v = p.zero ? _mm512_mul_ps(_mm512_sub_ps(w[h], z), s) : _mm512_mul_ps(w[h], s);
                if (out_bf16)
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(o16 + k), to_bf16(v));
                else
                    _mm512_storeu_ps(o32 + k, v);
            }
        }
    }
}

}  // namespace qscheme_gemv
#endif
