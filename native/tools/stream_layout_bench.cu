// stream_layout_bench.cu: whether a Q4_K weight layout made for the decode matvec streams faster on
// the copy engine (issue 25). Copy-only kernels with matvec_f16's stream_tma structure (a block =
// 32 rows x its split's super-blocks, 4 warps, each with a private 3-stage ring of mbarrier-armed
// stages; lane 0 copies a step's weights, then the vector's x record and inverse scales as two
// bulk copies, as the engine's matvec does at one vector), over two layouts of the same bytes:
//   - rows: the file's: row-major, 144 bytes per row and super-block; a step is one tensor copy of
//     32 rows x 144 bytes (a 2D box, rows nb * 144 bytes apart; the engine's until 78e66d9);
//   - tiles: [row tile of 32][super-block][32 rows][144 bytes] (quant_blocks.cuh, the engine's
//     layout now); a step is one bulk copy of 4,608 contiguous bytes.
// Measured (an H100, 2026-12-07, bench/results/2026-12-07-session17-h100.md): tiles 5-14% faster
// alone and 7-9% in the chain on the 27B's FFN gate+up, ffn_down, attention q/k/v and ssm_out.
// Each timed alone (one launch, L2 flushed before) and as a PDL chain of 4 launches over 4
// matrices (each kernel issues its first weight copies before griddepcontrol.wait, as the engine's
// matvecs do): the chain is the engine's steady state between preps. Median of 20 runs.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Inative native/tools/stream_layout_bench.cu -o slb
//   (scripts/gpu.sh stream-layout)
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "pdl.cuh"
#include "tools/harness.cuh"
#include "matvec_f16.cuh"   // mvf16::su32, bar_init, bar_expect_tx, bar_wait, bulk: the engine's copy helpers

using namespace oj;
static int RUNS = 20;
#include "bench_blocks.cuh"   // median_ms (CUDA events, L2 flushed by g_flush before each run)

namespace slb {   // named: an unnamed one would clash with matvec_f16.cuh's in the launch stubs

constexpr int WARPS = 4, STAGES = 3, SB = 144, STEP = 32 * SB;   // a step: 32 rows x one super-block
constexpr int XB = mvf16::VEC_BYTES, INV = 32, REC = mvf16::REC;  // one vector's x record, the 8 inverse scales
constexpr int STAGE = (STEP + XB + INV + 127) / 128 * 128;

// the helpers live in matvec_f16.cuh's sm_90 section: the device code below exists only there
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void tensor_2d(void *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                     mvf16::su32(dst)),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(mvf16::su32(bar))
                 : "memory");
}
#endif

// TILES: the tile-major layout (bulk copies); else the row-major one (tensor copies through map)
template <bool TILES>
__global__ void __launch_bounds__(32 * WARPS) copy_kernel(const __grid_constant__ CUtensorMap map, const uint8_t *w,
                                                          const uint8_t *xp, int64_t nb, int S, uint32_t *sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) uint8_t smem[];
    pdl_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t tile = blockIdx.x / S, sp = blockIdx.x % S;
    const int64_t u0 = sp * nb / S, u1 = (sp + 1) * nb / S;
    const int64_t uw = u0 + warp;
    const int nj = uw < u1 ? (int)((u1 - uw + WARPS - 1) / WARPS) : 0;
    uint8_t *ring = smem + warp * STAGES * STAGE;
    uint64_t *bars = reinterpret_cast<uint64_t *>(smem + WARPS * STAGES * STAGE) + warp * STAGES;
    if (lane < STAGES) mvf16::bar_init(bars + lane, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
    auto issue_w = [&](uint8_t *st, uint64_t *bar, int64_t u) {
        if (lane != 0) return;
        mvf16::bar_expect_tx(bar, STEP + XB + INV);
        if (TILES) mvf16::bulk(st, w + (tile * nb + u) * STEP, STEP, bar);
        else tensor_2d(st, &map, (int)(u * SB), (int)(tile * 32), bar);
    };
    auto issue_x = [&](uint8_t *st, uint64_t *bar, int64_t u) {
        if (lane != 0) return;
        mvf16::bulk(st + STEP, xp + u * REC, XB, bar);
        mvf16::bulk(st + STEP + XB, xp + u * REC + mvf16::INV_OFF, INV, bar);
    };
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < nj) issue_w(ring + s * STAGE, bars + s, uw + (int64_t)s * WARPS);
    pdl_wait();
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < nj) issue_x(ring + s * STAGE, bars + s, uw + (int64_t)s * WARPS);
    uint32_t acc = 0, ph = 0;
    int rd = 0, wr = STAGES - 1;
    int64_t un = uw + (int64_t)(STAGES - 1) * WARPS;
    for (int j = 0; j < nj; ++j) {
        mvf16::bar_wait(bars + rd, (ph >> rd) & 1u);
        ph ^= 1u << rd;
        if (j + STAGES - 1 < nj) {
            uint8_t *st = ring + wr * STAGE;
            if (lane == 0) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            issue_w(st, bars + wr, un);
            issue_x(st, bars + wr, un);
            un += WARPS;
        }
        const uint32_t *s32 = reinterpret_cast<const uint32_t *>(ring + rd * STAGE);
        acc ^= s32[lane] ^ s32[STEP / 4 + lane];
        rd = rd == STAGES - 1 ? 0 : rd + 1;
        wr = wr == STAGES - 1 ? 0 : wr + 1;
        __syncwarp();
    }
    if (lane < STAGES) asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(mvf16::su32(bars + lane)) : "memory");
    if (acc == 0x9E3779B9u) sink[threadIdx.x] = acc;   // never in practice: keeps the reads
#endif
}

CUtensorMap rows_map(const uint8_t *base, int64_t rows, int64_t row_bytes) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !p) fail(OJ_ERR_UNSUPPORTED, "no cuTensorMapEncodeTiled");
        encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    const cuuint64_t dims[2] = {(cuuint64_t)row_bytes, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t boxd[2] = {SB, 32}, estr[2] = {1, 1};
    alignas(64) CUtensorMap m;
    if (encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t *>(base), dims, strides, boxd, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        fail(OJ_ERR_INVALID_ARGUMENT, "cuTensorMapEncodeTiled failed");
    return m;
}

}  // namespace slb

using namespace slb;

int main() {
    int dev = 0, n_sm = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    std::printf("device %s sm_%d%d, %d SMs; copy-only, matvec_f16's TMA ring (4 warps x 3 stages), median of %d\n", prop.name,
                prop.major, prop.minor, n_sm, RUNS);
    CK(cudaMalloc(&g_flush, FLUSH_BYTES));
    uint32_t *sink;
    CK(cudaMalloc(&sink, 4096));
    const int smem = WARPS * STAGES * STAGE + WARPS * STAGES * 8;
    CK(cudaFuncSetAttribute(copy_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(copy_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    struct Shape { const char *name; int64_t M, K; int S; };
    const Shape shapes[] = {{"ffn gate+up", 2 * 17408, 5120, 1}, {"ffn_down", 5120, 17408, 4},
                            {"attn_q+k+v", 14336, 5120, 1}, {"ssm_out", 5120, 6144, 4}};
    constexpr int CHAIN = 4;
    for (const Shape &s : shapes) {
        const int64_t nb = s.K / 256, bytes = s.M * nb * SB;
        std::vector<uint8_t *> w(CHAIN);
        std::vector<CUtensorMap> maps(CHAIN);
        for (int c = 0; c < CHAIN; ++c) {
            CK(cudaMalloc(&w[c], bytes));
            CK(cudaMemset(w[c], 0x5A + c, bytes));
            maps[c] = rows_map(w[c], s.M, nb * SB);
        }
        uint8_t *xp;
        CK(cudaMalloc(&xp, nb * REC));
        CK(cudaMemset(xp, 1, nb * REC));
        const unsigned grid = (unsigned)(s.M / 32 * s.S);
        auto run = [&](bool tiles, int n) {
            for (int c = 0; c < n; ++c)
                CK(tiles ? launch(copy_kernel<true>, dim3(grid), dim3(32 * WARPS), smem, 0, maps[c], w[c], xp, nb, s.S, sink)
                         : launch(copy_kernel<false>, dim3(grid), dim3(32 * WARPS), smem, 0, maps[c], w[c], xp, nb, s.S, sink));
        };
        auto gbs = [&](double ms, int n) { return (double)bytes * n / (ms * 1e-3) / 1e9; };
        std::printf("%-12s %7.1f MB (M %lld, K %lld, split %d, %u blocks)\n", s.name, bytes / 1e6, (long long)s.M, (long long)s.K,
                    s.S, grid);
        for (int tiles = 0; tiles < 2; ++tiles) {
            const double one = median_ms([&] { run(tiles, 1); });
            const double chain = median_ms([&] { run(tiles, CHAIN); });
            std::printf("  %-30s alone %8.4f ms %6.0f GB/s   chain of %d %8.4f ms %6.0f GB/s (%.4f ms a launch)\n",
                        tiles ? "tiles: bulk 4,608 contiguous" : "rows: tensor 32 x 144 box", one, gbs(one, 1), CHAIN, chain,
                        gbs(chain, CHAIN), chain / CHAIN);
        }
        for (int c = 0; c < CHAIN; ++c) CK(cudaFree(w[c]));
        CK(cudaFree(xp));
    }
    return 0;
}
