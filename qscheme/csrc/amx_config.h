// An AMX tile configuration (the 64 bytes LDTILECFG reads), for the translation units that run the tiles
// (amx_panel.cpp, cpu_gemv_amx.cpp). Plain inline assembly: no target pragma needed to include it.
#pragma once

#include <cstdint>

namespace qscheme_amx_config {

struct alignas(64) TileConfig {
    uint8_t palette = 0, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "a tile configuration is 64 bytes");

// The whole configuration as the asm operand: GCC's _tile_loadconfig names only the first 8 bytes of its
// operand, so that the stores filling the rest may be dropped as dead.
inline void load_config(const TileConfig &config) { __asm__ volatile("ldtilecfg %0" ::"m"(config)); }
inline void store_config(TileConfig &config) { __asm__ volatile("sttilecfg %0" : "=m"(config)); }

}  // namespace qscheme_amx_config
