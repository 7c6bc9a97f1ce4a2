// The AMX (tile) path of the CPU GEMV (cpu_gemv_amx.cpp), tried first by the AVX-512 entry point.
//
// Where the CPU has AMX-BF16 and AVX512-BF16 (cpuid, and Linux granted the tile state), every
// element of x is a bfloat16 value (x is float32 here, widened from bfloat16 or given so) of
// magnitude 0 or at least 2**-100, and the layer's weights are exact in bfloat16 (4-bit codes
// whose table values are; e4m3, int8 and uint8 codes), 16 weight rows at a time are decoded to
// bfloat16 in registers, 32 columns at a time, into a small buffer that a tile load reads, and
// multiplied with TDPBF16PS by up to 16 rows of x at once (the weight read once for all of them):
//
// - byte scales of 4-bit codes (NVFP4's e4m3, MXFP4's e8m0) are folded into the decode table:
//   value * scale has at most 6 significant bits, exact in bfloat16 (a scale whose 16 products
//   are not exact, normal or zero, and finite sends its row to the float32 loop); a per-row
//   factor multiplies (or divides) the row's sum at the end;
// - other scales (float group, channel, block, tensor) multiply each scale group's tile sums in
//   float32 (groups of a multiple of 32 columns; otherwise the float32 loop runs).
//
// Products are exact (bfloat16 x bfloat16 in float32); sums are float32 with one rounding per
// addition. Per thread it keeps 8 KiB of tile buffers, the packed x and a 16 KiB table of folded
// values (rebuilt when a layer's code or scale table differs from the last one's); the caller's
// tile configuration is saved and restored around each call.
#pragma once

#include <cstdint>

#include "cpu_gemv.h"

namespace qscheme_gemv {

// The float32 loop for rows [n0, n1) (the AVX-512 one), for rows the tiles do not take.
using RowsFunction = void (*)(const Params &, const float *, int64_t, int, int64_t, int64_t, float *, int64_t);

// Whether this CPU and process run the tile path (cpuid; tile state granted by Linux; not
// disabled by QSCHEME_CPU_GEMV_AMX=0, read once).
bool amx_usable();

// The fewest rows of x the tile path takes: 4 (int8 / uint8 codes: 5). With fewer the float32
// loops are faster (4096x4096, one thread: 1.1-1.5x at M = 1-2, 1.03-1.1x at M = 3, int8 1.16x at
// M = 4), unless QSCHEME_CPU_GEMV_AMX=all (the tests use it to run the tile path at every M).
int amx_min_rows(const Params &p);

// Whether the tiles go ahead of the 16-bit dot-product loops for m (at most INT16_ROWS) rows of bfloat16 x
// on this layer: from M = 4 for 4-bit codes with byte scales in groups of 32 or more (MXFP4: on the AMX
// Xeon the tiles took 0.74-0.99x the integer loop's time at M = 4, four cases of four), never for the
// other layers, at every M with QSCHEME_CPU_GEMV_AMX=all; never where the tiles do not take the layer.
bool amx_ahead(const Params &p, int m);

// Rows [n0, n1) through the tiles, as gemv_avx512 (same arguments); false where the layer or x
// does not qualify (nothing written then).
bool gemv_amx(const Params &p, const float *x, int64_t ldx, int m, int64_t n0, int64_t n1, float *acc, int64_t ldy,
              RowsFunction fallback);

}  // namespace qscheme_gemv
