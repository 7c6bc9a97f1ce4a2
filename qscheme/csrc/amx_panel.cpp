// The AMX multiply of a decoded weight panel (see amx_panel.h).
#include "amx_panel.h"

// x86-64 Linux (the tile state is requested from the kernel) and a compiler with the AMX intrinsics;
// elsewhere the stubs at the end: compiled() and granted() are false, and nothing calls the rest.
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "amx_config.h"

namespace qscheme_amx {

namespace {

using qscheme_amx_config::TileConfig;
static_assert(sizeof(TileConfig) == sizeof(TileState), "a tile state holds a configuration");

inline const TileConfig &config_of(const TileState &state) { return *reinterpret_cast<const TileConfig *>(&state); }

inline __m512i bf16_pair(__m512 high, __m512 low) { return (__m512i)_mm512_cvtne2ps_pbh(high, low); }

// Write the sums of weight rows [pp, pp + 32) and input rows [m0, m0 + count): out[m, n - r0] =
// bf16(c[n - pp][m - m0] + bias[n]), c stored as [32][32] float32.
void store_outputs(const float *c, int64_t m0, int count, int64_t pp, int64_t r0, int64_t r1, const float *bias,
                   uint16_t *out, int64_t ldy) {
    const int64_t valid = std::min<int64_t>(32, r1 - pp);
    const __mmask32 mask = valid >= 32 ? 0xFFFFFFFFu : ((1u << valid) - 1u);
    const __mmask16 low_mask = static_cast<__mmask16>(mask), high_mask = static_cast<__mmask16>(mask >> 16);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(32));
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        b0 = _mm512_maskz_loadu_ps(low_mask, bias + pp);
        b1 = _mm512_maskz_loadu_ps(high_mask, bias + pp + 16);
    }
    for (int j = 0; j < count; j++) {
        const __m512i index = _mm512_add_epi32(rows, _mm512_set1_epi32(j));
        const __m512 low = _mm512_add_ps(_mm512_i32gather_ps(index, c, 4), b0);
        const __m512 high = _mm512_add_ps(_mm512_i32gather_ps(index, c + 16 * 32, 4), b1);
        _mm512_mask_storeu_epi16(out + (m0 + j) * ldy + (pp - r0), mask, bf16_pair(high, low));
    }
}

}  // namespace

bool compiled() { return true; }

bool granted() {  // a static: the first call asks Linux, once
    static const bool ready = [] {
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("amx-tile") ||
            !__builtin_cpu_supports("amx-bf16"))
            return false;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ready;
}

void begin(TileState &saved) {
    // the caller's tile state (torch's own kernels may keep one)
    qscheme_amx_config::store_config(*reinterpret_cast<TileConfig *>(&saved));
    TileConfig config;
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    qscheme_amx_config::load_config(config);
}

void end(const TileState &saved) {
    if (config_of(saved).palette)
        qscheme_amx_config::load_config(config_of(saved));
    else
        _tile_release();
}

void multiply_panel(const uint16_t *a, int64_t pitch, int64_t steps, const uint32_t *xp, int64_t m, int64_t mp,
                    int64_t kp, int64_t k0, bool first, bool last, bool keep, float *acc, const float *bias,
                    uint16_t *out, int64_t ldy, int64_t pp, int64_t r0, int64_t r1) {
    alignas(64) float c[32 * 32];
    const int64_t groups = (mp / 16 + 1) / 2, block = (kp / 2) * 16;  // uint32 per 16 input rows
    const int64_t stride = pitch * 2;
    for (int64_t mg = 0; mg < groups; mg++) {
        const int64_t mb = 2 * mg;
        const bool two = mb + 1 < mp / 16;
        float *saved = acc + mg * 4 * 256;
        if (first) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        } else if (!keep) {
            _tile_loadd(0, saved, 64);
            _tile_loadd(1, saved + 256, 64);
            _tile_loadd(2, saved + 512, 64);
            _tile_loadd(3, saved + 768, 64);
        }
        const uint32_t *x0 = xp + mb * block + (k0 / 32) * 256, *x1 = x0 + block;
        if (two) {
            for (int64_t t = 0; t < steps; t++) {
                _tile_loadd(4, a + 32 * t, stride);
                _tile_loadd(6, x0 + 256 * t, 64);
                _tile_loadd(7, x1 + 256 * t, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(5, a + 16 * pitch + 32 * t, stride);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        } else {
            for (int64_t t = 0; t < steps; t++) {
                _tile_loadd(4, a + 32 * t, stride);
                _tile_loadd(6, x0 + 256 * t, 64);
                _tile_loadd(5, a + 16 * pitch + 32 * t, stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
            }
        }
        if (!last) {
            if (!keep) {
                _tile_stored(0, saved, 64);
                _tile_stored(1, saved + 256, 64);
                _tile_stored(2, saved + 512, 64);
                _tile_stored(3, saved + 768, 64);
            }
            continue;
        }
        _tile_stored(0, c, 128);
        _tile_stored(2, c + 16 * 32, 128);
        if (two) {
            _tile_stored(1, c + 16, 128);
            _tile_stored(3, c + 16 * 32 + 16, 128);
        }
        const int64_t m0 = mb * 16;
        const int count = static_cast<int>(std::min<int64_t>(m - m0, two ? 32 : 16));
        if (count > 0 && pp < r1) store_outputs(c, m0, count, pp, r0, r1, bias, out, ldy);
    }
}

}  // namespace qscheme_amx

#else  // no AMX loops here

namespace qscheme_amx {
bool compiled() { return false; }
bool granted() { return false; }
void begin(TileState &) {}
void end(const TileState &) {}
void multiply_panel(const uint16_t *, int64_t, int64_t, const uint32_t *, int64_t, int64_t, int64_t, int64_t, bool,
                    bool, bool, float *, const float *, uint16_t *, int64_t, int64_t, int64_t, int64_t) {}
}  // namespace qscheme_amx

#endif
