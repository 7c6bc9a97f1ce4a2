// Scale values shared by the CPU extensions (qscheme._cpu_gemv, qscheme._tile_gemm): float16 scales
// decoded exactly, and what a layer's 256-entry table of byte scale values holds, so that vector
// loops may decode e4m3 and e8m0 bytes by arithmetic instead of looking them up. Internal linkage:
// the files compiled for wider ISAs (target pragmas) must not share a copy with the portable ones.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace qscheme_bytes {

// A float16 bit pattern as float32, exactly (subnormals, infinities and NaN payloads included),
// without branches: normal values move their exponent and mantissa fields, subnormal ones are
// their 10-bit integer mantissa times 2**-24.
static inline float half_value(uint16_t h) {
    const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t bits = ((exponent + 112u) << 23) | (mantissa << 13);
    const float small = static_cast<float>(mantissa) * 0x1p-24f;
    uint32_t small_bits;
    std::memcpy(&small_bits, &small, 4);
    bits = exponent == 0 ? small_bits : bits;
    bits = exponent == 31 ? (0x7F800000u | (mantissa << 13)) : bits;
    bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// What a byte scale's table holds: any values, or every e4m3 value (NaN at 0x7F, 0xFF), or every
// e8m0 value (2**(b - 127), NaN at 0xFF), bit for bit.
enum ByteFormat : int { BYTE_TABLE = 0, BYTE_E4M3 = 1, BYTE_E8M0 = 2 };

// float8_e4m3fn's value of byte b (NaN at 0x7F and 0xFF).
static inline float e4m3_value(uint8_t b) {
    if ((b & 0x7F) == 0x7F) return std::nanf("");
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
    if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
    return sign * std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
}

static inline bool same_bits(float a, float b) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    return std::memcmp(&a, &b, 4) == 0;
}

// The ByteFormat of a table, the last answer kept per thread for the same contents (a layer
// passes the same table at every call: a 1 KiB comparison instead of 512 decodes).
static inline int byte_format_of(const float *table) {
    thread_local float last[256];
    thread_local int known = -1;
    if (known >= 0 && std::memcmp(last, table, sizeof(last)) == 0) return known;
    bool e4m3 = true, e8m0 = true;
    for (int b = 0; b < 256; b++) {
        if (!same_bits(table[b], e4m3_value(static_cast<uint8_t>(b)))) e4m3 = false;
        if (!same_bits(table[b], b == 255 ? std::nanf("") : std::ldexp(1.0f, b - 127))) e8m0 = false;
    }
    std::memcpy(last, table, sizeof(last));
    known = e4m3 ? BYTE_E4M3 : (e8m0 ? BYTE_E8M0 : BYTE_TABLE);
    return known;
}

}  // namespace qscheme_bytes
