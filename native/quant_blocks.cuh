// quant_blocks.cuh: the one table of quantised block layouts the engine reads.
//
// File layouts are ggml's (ggml/src/ggml-common.h); the engine keeps Q5_K's blocks as stored (176
// bytes, a multiple of 16, so every block stays aligned), orders Q4_K's blocks (144 bytes) by row
// tile, and rearranges Q8_0 (34 bytes) and Q6_K (210 bytes) at load into planes, so that every load
// in the matrix kernels is naturally aligned. Rearranging moves bytes only; no value changes.
//
//   Q4_K tiled, nb = K/256 blocks per row:          [tiles = ceil(M/32)][nb][32 rows][144 bytes]
//   a row tile's super-block u is 4,608 contiguous bytes: the decode matvec's step for one warp,
//   one bulk copy (a 2-D box of 32 rows x 144 bytes out of row-major rows streamed slower:
//   tools/stream_layout_bench.cu); rows past M in the last tile are zero blocks. A 4-D tensor map
//   {144, 32, nb, tiles} with a box {144, 32, 1, n} lands n tiles' rows in shared memory in row
//   order, as a 2-D box over row-major rows did (gemm_wgmma.cuh).
//   Q8_0 planar, a matrix of M rows and K columns:  qs int8 [M][K], then d fp16 [M][K/32]
//   Q6_K planar, nb = K/256 blocks per row:         q [tiles][nb][32][192], scales int8
//                                                   [tiles][nb][32][16] (row tiles, as Q4_K's),
//                                                   d fp16 [M*nb] (row-major)
//   where a block's 192 q bytes are ggml's ql (128) and qh (64) regrouped for the tensor-core
//   kernel: byte 64*i + 16*t + 4*c + j, with c = 2*half + l/16 and l = 16*(l/16) + 4*t + j, is
//   i=0: ql[64*half + l], i=1: ql[64*half + 32 + l], i=2: qh[32*half + l]
//   so that lane t of a quad reads its 16 bytes of each kind with one aligned load
//   (dequant.cuh: q6_K_byte; matvec.cu: to_device_layout).
#pragma once

#include <cstddef>
#include <cstdint>

namespace oj {

constexpr int QK_K = 256;   // values per K-quant super-block
constexpr int QK8_0 = 32;   // values per Q8_0 block

// ggml type ids (the GGUF file's), as in openjet.h's oj_type.
enum TensorType : int {
    TYPE_F32 = 0, TYPE_F16 = 1, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14,
    TYPE_BF16 = 30,
};

// File layouts (fp16 fields as raw uint16 so host code can use them too).
struct block_q8_0 { uint16_t d; int8_t qs[QK8_0]; };
struct block_q4_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct block_q5_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };

static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");
static_assert(sizeof(block_q4_K) == 144, "Q4_K block is 144 bytes");
static_assert(sizeof(block_q5_K) == 176, "Q5_K block is 176 bytes");
static_assert(sizeof(block_q6_K) == 210, "Q6_K block is 210 bytes");

// Values per block and bytes per block of each type (ggml's GGML_QUANT_SIZES).
inline int type_block_values(int type) {
    switch (type) {
        case TYPE_F32: case TYPE_F16: case TYPE_BF16: return 1;
        case TYPE_Q8_0: return QK8_0;
        case TYPE_Q4_K: case TYPE_Q5_K: case TYPE_Q6_K: return QK_K;
        default: return 0;
    }
}

inline int type_block_bytes(int type) {
    switch (type) {
        case TYPE_F32: return 4;
        case TYPE_F16: case TYPE_BF16: return 2;
        case TYPE_Q8_0: return 34;
        case TYPE_Q4_K: return 144;
        case TYPE_Q5_K: return 176;
        case TYPE_Q6_K: return 210;
        default: return 0;
    }
}

inline const char *type_name(int type) {
    switch (type) {
        case TYPE_F32: return "F32";
        case TYPE_F16: return "F16";
        case TYPE_BF16: return "BF16";
        case TYPE_Q8_0: return "Q8_0";
        case TYPE_Q4_K: return "Q4_K";
        case TYPE_Q5_K: return "Q5_K";
        case TYPE_Q6_K: return "Q6_K";
        default: return "unsupported";
    }
}

// Byte offsets of the planes of a rearranged Q8_0 / Q6_K matrix (see the table above).
struct Q8Planes { size_t qs, d, total; };
__host__ __device__ inline Q8Planes q8_0_planes(int64_t M, int64_t K) {
    Q8Planes p;
    p.qs = 0;
    p.d = (size_t)M * K;
    p.total = p.d + (size_t)M * (K / QK8_0) * 2;
    return p;
}

// Row tiles (the table above): row m's super-block u of a matrix whose super-blocks take `bytes`
// bytes (a plane of them for Q6_K), rows in tiles of 32, a tile's super-block u contiguous.
constexpr int TILE_ROWS = 32;
__host__ __device__ inline int64_t row_tiles(int64_t M) { return (M + TILE_ROWS - 1) / TILE_ROWS; }
__host__ __device__ inline size_t tile_offset(int64_t m, int64_t u, int64_t nb, int bytes) {
    return ((size_t)(m / TILE_ROWS) * nb + u) * (size_t)(TILE_ROWS * bytes) + (size_t)(m % TILE_ROWS) * bytes;
}
__host__ __device__ inline size_t q4_K_offset(int64_t m, int64_t u, int64_t nb) { return tile_offset(m, u, nb, 144); }
__host__ __device__ inline size_t q4_K_tiled_bytes(int64_t M, int64_t K) {
    return (size_t)row_tiles(M) * TILE_ROWS * (size_t)(K / QK_K) * 144;
}

// Q6_K planes: q and sc in row tiles (padded to whole tiles), d row-major [M * nb].
struct Q6Planes { size_t q, sc, d, total; };
__host__ __device__ inline Q6Planes q6_K_planes(int64_t M, int64_t K) {
    const size_t nblk = (size_t)M * (K / QK_K), tiled = (size_t)row_tiles(M) * TILE_ROWS * (K / QK_K);
    Q6Planes p;
    p.q = 0;
    p.sc = tiled * 192;
    p.d = p.sc + tiled * 16;
    p.total = p.d + nblk * 2;
    return p;
}
// row m's super-block u in the q plane and in the scale plane (offsets from the plane's start)
__host__ __device__ inline size_t q6_K_q_offset(int64_t m, int64_t u, int64_t nb) { return tile_offset(m, u, nb, 192); }
__host__ __device__ inline size_t q6_K_sc_offset(int64_t m, int64_t u, int64_t nb) { return tile_offset(m, u, nb, 16); }

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block.
__host__ __device__ inline void scale_min_k4(int j, const uint8_t *q, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

}  // namespace oj
