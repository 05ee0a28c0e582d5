// AMX set-up shared by Sonar's CPU kernels: the process's permission to use the tile registers and
// the one tile shape every kernel uses (16 rows of 64 bytes: 16 x 32 bfloat16, or 16 x 16 float32
// accumulators). Built only where the compiler targets AMX (SONAR_AMX); a kernel still asks
// amx_permitted() at run time, since Linux may refuse the register state.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SONAR_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace sonar {

// Linux hands out the AMX register state only on request, once per process.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles as 16 rows of 64 bytes, in the calling thread (each thread loads its own
// configuration; _tile_release() when done, so that the kernel's tile state is not saved on
// every context switch). With `rows` (1-16), tiles 0-4 (a matmul's accumulators and the rows it
// multiplies) are that many rows high: a call of fewer than 16 rows then loads and stores its
// rows where they lie, with no zero-padded copy.
inline void configure_tiles(int rows = 16) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
  }
  _tile_loadconfig(&config);
}

}  // namespace sonar

#endif
