// What every AMX kernel shares: the OS's permission to use the tiles, and one tile configuration
// (every tile 16 rows of 64 bytes: 16 floats, or 32 bfloat16 as 16 pairs), which each kernel
// loads on every thread it runs on before its first tile instruction.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define QW_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace qw::amx {

constexpr int64_t kRows = 16, kCols = 16, kDepth = 32;  // one tile multiply: 16 x 16, k of 32

// Linux hands out the tile registers' state only to a process that asks (once; for every thread)
inline bool request_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}

inline bool tiles_ready() {
  static const bool ready = request_tiles();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kRows;
  }
  _tile_loadconfig(&config);
}

}  // namespace qw::amx

#endif
