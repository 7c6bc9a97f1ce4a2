// The AVX512-VNNI loops of qscheme._int8_gemm (int8_gemm.h has the arithmetic; int8_gemm.cpp the
// portable loops, whose bits these give).
//
// gemm below PANEL_M rows of x: a worker's span of weight rows is read as four streams
// (row_streams.h); each four rows (4 K bytes, in L1) are multiplied by every row of x, up to four
// at a time, along the whole of K, 64 bytes a step: VPDPBUSD adds four products of an unsigned
// input byte and a signed weight byte into each of 16 int32 lanes, 16 accumulators for 4 x 4 rows,
// summed across their lanes at the end. From PANEL_M rows: panels of PANEL_N weight rows repacked
// into VPDPBUSD's column layout (see panel_rows).
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) || defined(__GNUC__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "int8_gemm.h"
#include "row_streams.h"

namespace qscheme_int8 {

bool vnni_compiled() { return true; }

namespace {

inline __mmask16 tail16(int64_t count) {
    return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

inline __mmask64 tail64(int64_t count) {
    return count >= 64 ? ~__mmask64{0} : static_cast<__mmask64>((uint64_t{1} << count) - 1u);
}

// The lane sums of four accumulators into out[0..3] (modulo 2**32): pairs of accumulators
// interleaved and added within each 128-bit lane, then the four 128-bit lanes added.
inline void reduce4(const __m512i *a, uint32_t *out) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0x4E));  // 128-bit lanes 2, 3, 0, 1
    t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, 0xB1));  // 1, 0, 3, 2
    _mm_storeu_si128(reinterpret_cast<__m128i *>(out), _mm512_castsi512_si128(t));
}

// MR rows of x (codes + 128, rows of k) times NR weight rows: the unsigned sums into sums[r * NR + j].
template <int MR, int NR>
inline void tile(const uint8_t *x, int64_t xs, int64_t k, const int8_t *const *w, uint32_t *sums) {
    __m512i acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        __m512i wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_si512(w[j] + i);
        for (int r = 0; r < MR; r++) {
            const __m512i xv = _mm512_loadu_si512(x + r * xs + i);
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
        }
    }
    if (i < k) {  // the rest of K: both operands zero past it
        const __mmask64 mask = tail64(k - i);
        __m512i wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_epi8(mask, w[j] + i);
        for (int r = 0; r < MR; r++) {
            const __m512i xv = _mm512_maskz_loadu_epi8(mask, x + r * xs + i);
            for (int j = 0; j < NR; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < MR; r++) {
        if constexpr (NR == 4) {
            reduce4(acc[r], sums + r * 4);
        } else {
            for (int j = 0; j < NR; j++) sums[r * NR + j] = static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[r][j]));
        }
    }
}

// Weight rows n, n + step, ... (NR of them) times every row of x.
template <int NR>
void rows(const Problem &p, int64_t n, int64_t step) {
    const int8_t *w[NR];
    for (int j = 0; j < NR; j++) w[j] = p.w + (n + j * step) * p.w_stride;
    uint32_t sums[4 * NR];
    int64_t row = 0;
    for (; row + 4 <= p.m; row += 4) {
        tile<4, NR>(p.x + row * p.x_stride, p.x_stride, p.k, w, sums);
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < NR; j++)
                store(p, row + r, n + j * step, exact_dot(sums[r * NR + j], p.w_sum[n + j * step]));
    }
    const int left = static_cast<int>(p.m - row);
    if (left == 0) return;
    const uint8_t *x = p.x + row * p.x_stride;
    switch (left) {
        case 1: tile<1, NR>(x, p.x_stride, p.k, w, sums); break;
        case 2: tile<2, NR>(x, p.x_stride, p.k, w, sums); break;
        default: tile<3, NR>(x, p.x_stride, p.k, w, sums); break;
    }
    for (int r = 0; r < left; r++)
        for (int j = 0; j < NR; j++)
            store(p, row + r, n + j * step, exact_dot(sums[r * NR + j], p.w_sum[n + j * step]));
}

}  // namespace

// From PANEL_M rows of x (int8_gemm.h): panels of 64 weight rows, repacked per thread K chunk by K chunk into
// VPDPBUSD's column layout ([K / 4][64 rows][4 bytes], zeros past K and past the weight's rows), so
// that one 4-byte broadcast of x times four vectors of the panel adds into 64 outputs of a row with
// no sums across lanes; 6 rows of x by 64 outputs in 24 accumulators.
constexpr int64_t PANEL_K = 4096, PANEL_MR = 6;

namespace {

// store(p, row, n + i, exact_dot(sums[i], w_sum[n + i])) for i < count (at most 16), the same
// float32 operations 16 at a time.
void store16(const Problem &p, int64_t row, int64_t n, int64_t count, const uint32_t *sums) {
    const __mmask16 mask = tail16(count);
    const __m512i dot = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(mask, sums),
                                         _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, p.w_sum + n), 7));
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(p.x_scale[row]));
    y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(mask, p.w_scale + n));
    if (p.bias) {
        __asm__("" : "+v"(y));  // no fused multiply-add: the product rounds first, as in store()
        y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, p.bias + n));
    }
    if (!p.out_bf16) {
        _mm512_mask_storeu_ps(static_cast<float *>(p.out) + row * p.ldy + n, mask, y);
        return;
    }
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i words = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    words = _mm512_mask_or_epi32(words, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(static_cast<uint16_t *>(p.out) + row * p.ldy + n, mask, _mm512_cvtepi32_epi16(words));
}

// 16 vectors of 16 dwords transposed in place: v[i] lane j becomes v[j] lane i.
inline void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // each 128-bit lane L of v[4a + b] now holds rows 4a..4a+3 at dword column 4L + b
    for (int a = 0; a < 4; a += 2)
        for (int b = 0; b < 4; b++) {
            const __m512i lo = v[4 * a + b], hi = v[4 * a + 4 + b];
            t[4 * a + b] = _mm512_shuffle_i32x4(lo, hi, 0x88);  // lanes 0, 2 of each
            t[4 * a + 4 + b] = _mm512_shuffle_i32x4(lo, hi, 0xDD);  // lanes 1, 3
        }
    for (int b = 0; b < 4; b++) {
        // t[b], t[4 + b]: rows 0-7, columns (lanes 0, 2) and (1, 3); t[8 + b], t[12 + b]: rows 8-15
        v[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);
        v[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xDD);
        v[4 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0x88);
        v[12 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0xDD);
    }
}

// Weight rows [n, n + rows) from column k0, kq quads of 4 bytes, as [kq][64 rows][4 bytes] (zeros
// past K and past `rows`): 16 rows by 16 quads at a time, loaded as rows and transposed.
void pack_panel(const Problem &p, int64_t n, int64_t rows, int64_t k0, int64_t kq, int8_t *out) {
    const int64_t length = std::min(p.k - k0, kq * 4);
    for (int64_t r0 = 0; r0 < PANEL_N; r0 += 16) {
        for (int64_t c = 0; c < kq; c += 16) {
            __m512i v[16];
            const __mmask64 mask = tail64(length - 4 * c);
            for (int i = 0; i < 16; i++)
                v[i] = r0 + i < rows ? _mm512_maskz_loadu_epi8(mask, p.w + (n + r0 + i) * p.w_stride + k0 + 4 * c)
                                     : _mm512_setzero_si512();
            transpose16(v);
            const int64_t quads = std::min<int64_t>(16, kq - c);
            for (int64_t q = 0; q < quads; q++) _mm512_storeu_si512(out + ((c + q) * PANEL_N + r0) * 4, v[q]);
        }
    }
}

// MR rows of x (from column k0, row stride xs) times a packed panel of kq quads, added into
// acc[r * 64 + j] (zeroed by the caller before the first chunk of K).
template <int MR>
void panel_tile(const uint8_t *x, int64_t xs, int64_t kq, const int8_t *panel, uint32_t *acc) {
    __m512i a0[MR], a1[MR], a2[MR], a3[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        a0[r] = _mm512_loadu_si512(acc + r * PANEL_N);
        a1[r] = _mm512_loadu_si512(acc + r * PANEL_N + 16);
        a2[r] = _mm512_loadu_si512(acc + r * PANEL_N + 32);
        a3[r] = _mm512_loadu_si512(acc + r * PANEL_N + 48);
    }
    for (int64_t q = 0; q < kq; q++) {
        const int8_t *wq = panel + q * PANEL_N * 4;
        const __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 64);
        const __m512i w2 = _mm512_loadu_si512(wq + 128), w3 = _mm512_loadu_si512(wq + 192);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            int32_t word;
            std::memcpy(&word, x + r * xs + 4 * q, 4);
            const __m512i xb = _mm512_set1_epi32(word);
            a0[r] = _mm512_dpbusd_epi32(a0[r], xb, w0);
            a1[r] = _mm512_dpbusd_epi32(a1[r], xb, w1);
            a2[r] = _mm512_dpbusd_epi32(a2[r], xb, w2);
            a3[r] = _mm512_dpbusd_epi32(a3[r], xb, w3);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_si512(acc + r * PANEL_N, a0[r]);
        _mm512_storeu_si512(acc + r * PANEL_N + 16, a1[r]);
        _mm512_storeu_si512(acc + r * PANEL_N + 32, a2[r]);
        _mm512_storeu_si512(acc + r * PANEL_N + 48, a3[r]);
    }
}

void panel_rows(const Problem &p, int64_t n, std::vector<int8_t> &panel, std::vector<uint32_t> &acc) {
    const int64_t rows = std::min(PANEL_N, p.n - n);
    acc.assign(static_cast<size_t>(p.m * PANEL_N), 0u);
    for (int64_t k0 = 0; k0 < p.k; k0 += PANEL_K) {
        const int64_t kq = (std::min(PANEL_K, p.k - k0) + 3) / 4;
        panel.resize(static_cast<size_t>(kq * PANEL_N * 4));
        pack_panel(p, n, rows, k0, kq, panel.data());
        int64_t row = 0;
        for (; row + PANEL_MR <= p.m; row += PANEL_MR)
            panel_tile<PANEL_MR>(p.x + row * p.x_stride + k0, p.x_stride, kq, panel.data(), acc.data() + row * PANEL_N);
        const uint8_t *x = p.x + row * p.x_stride + k0;
        uint32_t *out = acc.data() + row * PANEL_N;
        switch (p.m - row) {
            case 0: break;
            case 1: panel_tile<1>(x, p.x_stride, kq, panel.data(), out); break;
            case 2: panel_tile<2>(x, p.x_stride, kq, panel.data(), out); break;
            case 3: panel_tile<3>(x, p.x_stride, kq, panel.data(), out); break;
            case 4: panel_tile<4>(x, p.x_stride, kq, panel.data(), out); break;
            default: panel_tile<5>(x, p.x_stride, kq, panel.data(), out); break;
        }
    }
    for (int64_t row = 0; row < p.m; row++)
        for (int64_t j = 0; j < rows; j += 16)
            store16(p, row, n + j, std::min<int64_t>(16, rows - j), acc.data() + row * PANEL_N + j);
}

}  // namespace

void panels_vnni(const Problem &p, int64_t panel0, int64_t panel1) {
    thread_local std::vector<int8_t> panel;  // at most 256 KiB, kept for the next call
    thread_local std::vector<uint32_t> acc;  // M x 64 sums: kept up to 1 MiB (M <= 4096), else freed
    for (int64_t i = panel0; i < panel1; i++) panel_rows(p, i * PANEL_N, panel, acc);
    if (acc.capacity() * sizeof(uint32_t) > (size_t{1} << 20)) std::vector<uint32_t>().swap(acc);
}

// Below PANEL_M rows of x: the span as four streams, each weight row read once from memory; every
// four rows stay in L1 while all rows of x pass, four at a time.
void rows_vnni(const Problem &p, int64_t n0, int64_t n1) {
    qscheme_rows::streams<4>(n0, n1, [&](auto count, int64_t n, int64_t step) {
        rows<decltype(count)::value>(p, n, step);
    });
}

}  // namespace qscheme_int8

#else  // no x86: the portable loops only

#include <algorithm>

#include "int8_gemm.h"

namespace qscheme_int8 {
bool vnni_compiled() { return false; }
void rows_vnni(const Problem &p, int64_t n0, int64_t n1) { rows_portable(p, n0, n1); }
void panels_vnni(const Problem &p, int64_t panel0, int64_t panel1) {
    rows_portable(p, panel0 * PANEL_N, std::min(p.n, panel1 * PANEL_N));
}
}  // namespace qscheme_int8

#endif
