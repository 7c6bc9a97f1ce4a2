// The AMX multiply of a decoded weight panel (amx_panel.cpp), shared by the canonical tensors' fused
// GEMM (tile_gemm_amx.cpp, in qscheme._tile_gemm) and the packed blocks' (cpu_gemv_gguf_gemm.cpp, in
// qscheme._cpu_gemv); each extension compiles its own copy.
//
// A panel is 32 weight rows of bfloat16, `pitch` words apart (not a power of two: 16 rows a tile
// reads would share a set of the L1 cache), decoded for one chunk of K: `steps` runs of 32 columns.
// Its two 16-row halves are the A tiles; x, packed once per call into the tiles' pair layout (for
// each block of 16 input rows and each pair of columns (2r, 2r + 1), 16 uint32: row j's x[2r] | x[2r
// + 1] << 16; zeros past M and K), gives the B tiles. TDPBF16PS sums products of bfloat16 values in
// float32 (bfloat16 subnormals read as zero); the outputs are rounded once to bfloat16 (to nearest
// even), a float32 bias added first.
//
// Tiles 0-3 hold the 2 x 2 float32 accumulators (16 weight rows x 16 input rows each) of two
// blocks of input rows at a time; 4 and 5 the panel's halves; 6 and 7 two blocks of x.
#pragma once

#include <cstdint>

namespace qscheme_amx {

// The caller's tile configuration, kept while the panels' configuration is in use.
struct alignas(64) TileState {
    uint8_t bytes[64];
};

// Whether the AMX loops were compiled (x86-64 and a compiler with the AMX intrinsics: GCC 11, clang 12).
bool compiled();

// Whether this CPU has AMX-BF16 and AVX512-BF16 and Linux granted this process the tile state
// (asked once, ARCH_REQ_XCOMP_PERM).
bool granted();

// Save the caller's tile configuration into `saved` and configure the eight tiles (16 rows of 64
// bytes each); `end` restores it (or releases the tiles where the caller had none).
void begin(TileState &saved);
void end(const TileState &saved);

// One chunk of a 32-row panel (rows pp .. pp + 31 of the weight; rows past r1 are not written) times
// every block of 16 rows of x (xp: mp rows packed, kp columns, the chunk starting at column k0):
// the sums accumulate over chunks (first: from zero; last: the outputs are written: out[i, n - r0],
// bfloat16, row stride ldy, + bias[n] where bias is not null). acc keeps the float32 sums between
// chunks, 1024 a pair of input blocks ((mp / 16 + 1) / 2 pairs), unless `keep` (a single pair of
// blocks and no other panel between the calls: the sums stay in the tiles).
void multiply_panel(const uint16_t *panel, int64_t pitch, int64_t steps, const uint32_t *xp, int64_t m, int64_t mp,
                    int64_t kp, int64_t k0, bool first, bool last, bool keep, float *acc, const float *bias,
                    uint16_t *out, int64_t ldy, int64_t pp, int64_t r0, int64_t r1);

}  // namespace qscheme_amx
