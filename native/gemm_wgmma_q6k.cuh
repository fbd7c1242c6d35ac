// gemm_wgmma_q6k.cuh: Q6_K weights x P positions on Hopper's warpgroup MMA (wgmma.mma_async,
// sm_90a), the A operand (dequantised weights) from REGISTERS, B (fp16 activations) from shared
// memory. The Q6_K companion of gemm_wgmma.cuh (read it first: roles, pipeline, X staging and the
// fragment layout are the same); the arithmetic is gemm_f16.cuh's Q6_K path (read its header).
//
// Y[p][m] (+)= sum_k W[m][k] X[p][k]; W in the engine's Q6_K device layout (quant_blocks.cuh:
// regrouped planes q and scales int8 in row tiles, d fp16 [M*nb], nb = K/256: block (row m,
// super-block u) at q6_K_q_offset / q6_K_sc_offset and d index m nb + u), X prepared ONCE by gemmf16::prep_x (the same
// workspace as Q4_K: one k order for every type, see gemm_f16.cuh "k order": k16 step ks of a
// super-block covers values 16 ks .. 16 ks + 15 = exactly ggml scale group ks, and lane t's word
// C = 2 half + (ks & 1) of plane K01 = quarter & 1 holds values 16 (ks & 1) + 4 t + j, bytes 0 / 2
// for mma k 2t, 2t+1 and bytes 1 / 3 for k 2t+8, 2t+9, as Q4_K's nibble words). Step ks =
// 8 half + 2 quarter + (ks & 1) (gemm_f16's KS = S). tools/gemm_wgmma_bench.cu checks and times it
// beside gemm_f16's Q6_K kernel.
//
// Exactness. A = q - 32 is exact in fp16 ((1024 + q6) from the 0x64 magic, minus 1056), but
// (q - 32) * sc is NOT (|q - 32| <= 32, sc int8 -128..127: 31 * 127 = 3937 needs 12 significant
// bits, fp16 has 11), so the per-16-value scale stays out of fp16 (gemm_f16's form): each k16
//   step (= one scale group) is one wgmma into a fresh temporary (scale-d 0), then acc +=
//   (d_row * sc_row,ks) * tmp (d * sc exact in fp32: 11 x 8 bits; one FFMA per accumulator per
//   group). Each group's wgmma is waited for (wait_group 0) before its FFMAs: the overlap of tensor
//   and FP32 work comes from the other consumer warpgroups. (Two alternating temporaries, FFMAs of
//   group n - 1 under group n's wgmma, made ptxas serialise every wgmma: C7513, "non wgmma
//   instructions defining input registers of a wgmma between start and end of the pipeline
//   stage". A form splitting sc into two exact wgmma per group, 1/16 of the FFMAs, was measured and
//   deleted: no faster at 2,048 positions, slower at 64, and its rounding differs; H100, 7f2633d.)
// fp16 rounding of x (prep_x) stays the only rounding before the fp32 accumulation, as in gemm_f16.
//
// Shared memory per stage (the stage base 1024-aligned):
//   X   BN positions x 512 bytes as 4 "k-atoms" (TMA boxes {64 halves, BN rows}, 128B swizzle;
//       wgmma descriptor 128B swizzle, SBO 1024, start = atom base + 32 (ks & 3)): gemm_wgmma.cuh's,
//       unchanged;
//   Q   BM rows x 192 bytes (the super-block's regrouped q bytes), one TMA box {192, 32, 1, BM / 32}
//       of the 4-D map over the q plane's row tiles (gemmwg::encode_tile_map: the rows land in row
//       order). 192 B = 48 words = 16 mod 32: a quarter-warp's 16-byte loads (rows g, g + 1, t 0..3)
//       hit 32 banks;
//   SC  BM rows x 16 bytes, one TMA box {16, 32, 1, BM / 32} of the scale plane's row tiles.
//   The d plane (row stride nb * 2 bytes, NOT a multiple of 16, so no TMA map) is read from global
//   by each consumer thread for its two rows, one super-block ahead (__ldg, rows clamped to M - 1).
//   Rows past M / positions past P_pad are zero-filled by TMA and count their full bytes.
//   Bytes per stage: BN 512 + BM 208, rounded up to 1024: (nwg 2, BN 128): 92,160; (3, 64):
//   72,704.
//
// Roles and pipeline as gemm_wgmma.cuh (warpgroup 0 producer: one thread, TMA + full/empty
// mbarriers; warpgroups 1..NWG consumers, 64 rows each x BN positions; each consumer warp arrives
// on a stage's `empty` once the wait after the super-block's last wgmma has returned). Consumer
// loop per super-block: wait full; per kind K01 (ql plane 0 / 1) one 16-byte load per row of the
// ql plane and of the qh plane (lane t's run: words C = 0..3); 8 k16 steps, each: q6_bytes + 2
// PRMT + 2 HSUB2 per row -> A (rows g, g + 8), the two rows' scale bytes (1-byte loads, a
// broadcast per row), then per-group: fence, wgmma (scale-d 0), commit, wait 0, acc += d sc tmp
// (the 16th step's wait releases the stage). Grid x = position tiles (fastest), y = row tiles, as gemm_wgmma.
//
// Limits: Q6_K only, K % 256 == 0, M >= 1, P >= 1; sm_90a only (elsewhere the kernel body traps
// and gemmwg::wgmma_available() says false; run() refuses with a clear error).
#pragma once

#include "gemm_wgmma.cuh"

namespace oj {
namespace {
namespace gemmwg6 {

using gemmf16::h2u;
using gemmf16::u2h;

constexpr int Q_ROW = 192;   // regrouped q bytes per super-block row
constexpr int SC_ROW = 16;   // int8 scales per super-block row

__host__ __device__ constexpr int stage_x(int bn) { return bn * 512; }
__host__ __device__ constexpr int stage_bytes(int nwg, int bn) {
    return (stage_x(bn) + 64 * nwg * (Q_ROW + SC_ROW) + 1023) / 1024 * 1024;
}
__host__ __device__ constexpr int smem_bytes(int nwg, int bn, int stages) { return stages * stage_bytes(nwg, bn) + 1024; }

struct Args {
    const float *inv;    // [P_pad] 2^-e_p
    const uint16_t *d;   // the Q6_K d plane, fp16 bits [M][nb]
    float *y;            // [P][M]
    int64_t M, P;
    int nsteps;          // K / 256
    bool accumulate;
};

#ifdef OJ_WGMMA_DEVICE
// float of the int8 scale byte b (0..255 as read): 2^23 + (b ^ 0x80) - (2^23 + 128), exact.
__device__ __forceinline__ float scale_f(uint32_t b) { return __uint_as_float(0x4B000000u | (b ^ 0x80u)) - 8388736.0f; }
#endif

// ---------------------------------------------------------------------------------------------
// the kernel

template <int NWG, int BN, int STAGES>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
    gemm_wgmma_q6k_kernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_sc, const Args a) {
#ifdef OJ_WGMMA_DEVICE
    static_assert(BN == 64 || BN == 128, "BN: 64 or 128 positions");
    constexpr int BM = 64 * NWG;
    constexpr int SB = stage_bytes(NWG, BN);
    constexpr int Q_OFF = stage_x(BN), SC_OFF = stage_x(BN) + BM * Q_ROW;
    constexpr uint32_t TX = stage_x(BN) + BM * (Q_ROW + SC_ROW);   // full boxes, OOB fill included
    constexpr int R = BN / 2;                                       // accumulators per thread
    static_assert(Q_OFF % 128 == 0 && SC_OFF % 128 == 0, "TMA destinations 128-byte aligned");
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES];

    const uint32_t base = (gemmwg::smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *const sbase = smem_raw + (base - gemmwg::smem_u32(smem_raw));
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int nsteps = a.nsteps;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            gemmwg::mbar_init(gemmwg::smem_u32(&full_bar[s]), 1);
            gemmwg::mbar_init(gemmwg::smem_u32(&empty_bar[s]), 4 * NWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(gemmwg::PRODUCER_REGS));
        if (warp == 0 && lane == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_x)) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_q)) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_sc)) : "memory");
            for (int u = 0; u < nsteps; ++u) {
                const int s = u % STAGES;
                if (u >= STAGES) gemmwg::mbar_wait(gemmwg::smem_u32(&empty_bar[s]), (uint32_t)((u / STAGES) - 1) & 1u);
                const uint32_t fb = gemmwg::smem_u32(&full_bar[s]);
                gemmwg::mbar_expect_tx(fb, TX);
                const uint32_t st = base + (uint32_t)s * SB;
#pragma unroll
                for (int at = 0; at < 4; ++at) gemmwg::tma_2d(st + at * BN * 128, &tm_x, u * 256 + 64 * at, n0, fb);
                gemmwg::tma_4d(st + Q_OFF, &tm_q, 0, 0, u, m0 / TILE_ROWS, fb);
                gemmwg::tma_4d(st + SC_OFF, &tm_sc, 0, 0, u, m0 / TILE_ROWS, fb);
            }
        }
    } else {
        // ---------------- consumers: warpgroup c = wg - 1 owns block rows 64 c .. 64 c + 63
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(gemmwg::consumer_regs(NWG)));
        const int c = wg - 1, g = lane >> 2, t = lane & 3;
        const int rl0 = 64 * c + 16 * warp + g;   // rows rl0, rl0 + 8 of the block
        float acc[R], tmp[R];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = tmp[i] = 0.0f;
        const __half2 c1056 = __float2half2_rn(1056.0f);

        // the super-block d of the lane's two rows, one step ahead (rows past M clamped: their
        // weights are TMA zeros, their outputs never written)
        int64_t drow[2];
        float dn[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int64_t row = min((int64_t)m0 + rl0 + 8 * r, a.M - 1);
            drow[r] = row * nsteps;
            dn[r] = gemm::half_bits(__ldg(a.d + drow[r]));
        }

        for (int u = 0; u < nsteps; ++u) {
            const int s = u % STAGES;
            const float d[2] = {dn[0], dn[1]};
            if (u + 1 < nsteps) {
#pragma unroll
                for (int r = 0; r < 2; ++r) dn[r] = gemm::half_bits(__ldg(a.d + drow[r] + u + 1));
            }
            gemmwg::mbar_wait(gemmwg::smem_u32(&full_bar[s]), (uint32_t)(u / STAGES) & 1u);
            const uint32_t st = base + (uint32_t)s * SB;
            const uint8_t *qrow = sbase + (size_t)s * SB + Q_OFF + rl0 * Q_ROW + 16 * t;   // row rl0, lane t's run
            const uint8_t *srow = sbase + (size_t)s * SB + SC_OFF + rl0 * SC_ROW;
#pragma unroll
            for (int K01 = 0; K01 < 2; ++K01) {
                uint4 qk[2], qh[2];   // [row]: ql plane K01 and the qh plane, words C = 0..3
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    qk[r] = *reinterpret_cast<const uint4 *>(qrow + 8 * r * Q_ROW + 64 * K01);
                    qh[r] = *reinterpret_cast<const uint4 *>(qrow + 8 * r * Q_ROW + 128);
                }
#pragma unroll
                for (int C = 0; C < 4; ++C)
#pragma unroll
                    for (int nq = 0; nq < 2; ++nq) {
                        const int n = 8 * K01 + 2 * C + nq;         // order of issue within the super-block
                        const int QQ = K01 + 2 * nq;                // quarter: low (0, 1) or high (2, 3) nibbles
                        const int ks = 8 * (C >> 1) + 2 * QQ + (C & 1);   // k16 step = ggml scale index
                        uint32_t A[4];   // q - 32: rows g (A0, A2), g + 8 (A1, A3); k 2t, 2t+1 (A0, A1), 2t+8, 2t+9
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            // word C of the lane's run (C is a constant once unrolled)
                            const uint32_t w = C == 0 ? qk[r].x : C == 1 ? qk[r].y : C == 2 ? qk[r].z : qk[r].w;
                            const uint32_t h = C == 0 ? qh[r].x : C == 1 ? qh[r].y : C == 2 ? qh[r].z : qh[r].w;
                            const uint32_t v = gemmf16::q6_bytes(w, h, QQ);   // bytes j: q6 (0..63) of values 16 (ks & 1) + 4 t + j
                            A[r] = h2u(__hsub2(u2h(__byte_perm(v, 0x64646464u, gemmf16::SEL_LO)), c1056));
                            A[2 + r] = h2u(__hsub2(u2h(__byte_perm(v, 0x64646464u, gemmf16::SEL_HI)), c1056));
                        }
                        const uint64_t desc = gemmwg::make_desc(st + (ks >> 2) * BN * 128 + (ks & 3) * 32, 1024, 1);
                        const uint32_t sb0 = srow[ks], sb1 = srow[8 * SC_ROW + ks];   // scale bytes of rows g, g + 8
                        gemmwg::wg_fence();
                        gemmwg::wgmma_bn<BN>(tmp, A[0], A[1], A[2], A[3], desc, 0);
                        gemmwg::wg_commit();
                        const float dsc[2] = {d[0] * scale_f(sb0), d[1] * scale_f(sb1)};   // exact in fp32
                        gemmwg::wg_wait<0>();
                        gemmwg::fence_regs<R>(tmp);
                        if (n == 15) {   // the super-block's last wgmma is done: release the stage
                            __syncwarp();
                            if (lane == 0) gemmwg::mbar_arrive(gemmwg::smem_u32(&empty_bar[s]));
                        }
#pragma unroll
                        for (int i = 0; i < R; ++i) acc[i] = fmaf(dsc[(i >> 1) & 1], tmp[i], acc[i]);
                    }
            }
        }
        gemmwg::store_tile<BN>(a, acc, m0, n0, rl0, t);
    }
#else
    __trap();   // built for a target without wgmma (needs -gencode arch=compute_90a,code=sm_90a)
#endif
}

// ---------------------------------------------------------------------------------------------
// host side

struct Config {
    int nwg, bn, stages;   // consumer warpgroups (BM = 64 nwg rows), positions per block, pipeline depth
};

// The instantiated configurations, the default first (shared memory: see the header): 128 rows x
// 128 positions x 2 stages (181 KB), 192 x 64 x 3 (214 KB). (192 x 128 spills at 152 consumer
// registers; 256 x 64 x 2 lost at every size measured: ffn_down 0.220 ms at 64 positions, 1.09 at
// 2,048, against 0.169 and 0.98; H100, 7f2633d.)
constexpr int N_CONFIGS = 2;
constexpr Config CONFIGS[N_CONFIGS] = {{2, 128, 2}, {3, 64, 3}};

template <int NWG, int BN, int STAGES>
inline void launch_cfg(const Matrix &w, const uint8_t *ws, int64_t P, float *y, bool accumulate, cudaStream_t st) {
    constexpr int SMEM = smem_bytes(NWG, BN, STAGES);
    {   // once per device (cudaFuncSetAttribute acts on the current device only)
        static std::mutex mu;
        static std::set<int> done;
        int dev = 0;
        check_cuda(cudaGetDevice(&dev), "gemm_wgmma_q6k: cudaGetDevice");
        std::lock_guard<std::mutex> lock(mu);
        if (!done.count(dev)) {
            check_cuda(cudaFuncSetAttribute(gemm_wgmma_q6k_kernel<NWG, BN, STAGES>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM),
                       "gemm_wgmma_q6k: shared-memory attribute");
            done.insert(dev);
        }
    }
    const int64_t K = w.K, M = w.M, pp = gemmf16::padded_positions(P), nb = K / QK_K;
    const gemmf16::WsLayout l = gemmf16::ws_layout(K, P);
    const Q6Planes planes = q6_K_planes(M, K);
    alignas(64) CUtensorMap tx, tq, tsc;
    {   // X fp16 [P_pad][K]: boxes of 64 halves (128 B, the swizzle span) x BN positions (as gemm_wgmma)
        const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)pp}, strides[1] = {(cuuint64_t)K * 2};
        const cuuint32_t box[2] = {64, (cuuint32_t)BN};
        gemmwg::encode(&tx, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, ws + l.xh, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, "X");
    }
    // the q plane and the scale plane (row tiles): boxes of one super-block x BM rows
    gemmwg::encode_tile_map(&tq, w.data + planes.q, M, nb, Q_ROW, 64 * NWG, "Q6_K q plane");
    gemmwg::encode_tile_map(&tsc, w.data + planes.sc, M, nb, SC_ROW, 64 * NWG, "Q6_K scale plane");
    Args a;
    a.inv = reinterpret_cast<const float *>(ws + l.inv);
    a.d = reinterpret_cast<const uint16_t *>(w.data + planes.d);
    a.y = y;
    a.M = M;
    a.P = P;
    a.nsteps = (int)nb;
    a.accumulate = accumulate;
    const dim3 grid((unsigned)((P + BN - 1) / BN), (unsigned)((M + 64 * NWG - 1) / (64 * NWG)));
    gemm_wgmma_q6k_kernel<NWG, BN, STAGES><<<grid, 128 * (NWG + 1), SMEM, st>>>(tx, tq, tsc, a);
    check_launch("gemm_wgmma_q6k: kernel");
}

inline int config_index(const Config &c) {
    for (int i = 0; i < N_CONFIGS; ++i)
        if (CONFIGS[i].nwg == c.nwg && CONFIGS[i].bn == c.bn && CONFIGS[i].stages == c.stages)
            return i;
    return -1;
}

// The configuration for P positions, or OJ_GEMMWG6_CFG="nwg,bn,stages" (one of CONFIGS): kept
// because scripts/gpu.sh gemm-wgmma times each configuration through it; users never set it.
// P <= 64 (a prefill piece beside decoding streams) takes 192 x 64 x 3: one position tile either
// way, and 3 stages in flight for calls bound by the weights (ffn_down at 64 positions: 0.169
// against 0.198 ms, attn_qkv 0.058 against 0.065, H100); from 128 positions on 128 x 128 x 2 wins
// (ffn_down at 2048: 0.98 against 1.17 ms). The per-group configurations give the same bits (the
// harness compares them), so the pick by P keeps a prompt in pieces equal to the prompt whole.
constexpr int64_t SMALL_P = 64;
inline Config pick_config(int64_t P) {
    if (const char *e = std::getenv("OJ_GEMMWG6_CFG")) {
        Config c = {0, 0, 0};
        if (std::sscanf(e, "%d,%d,%d", &c.nwg, &c.bn, &c.stages) == 3 && config_index(c) >= 0) return c;
        fail(OJ_ERR_INVALID_ARGUMENT,
             std::string("gemm_wgmma_q6k: OJ_GEMMWG6_CFG=") + e + " is not one of the instantiated configurations");
    }
    return P <= SMALL_P ? CONFIGS[1] : CONFIGS[0];
}

inline void check_shape(const Matrix &w, int64_t P) {
    if (w.type != TYPE_Q6_K) fail(OJ_ERR_UNSUPPORTED, std::string("gemm_wgmma_q6k: Q6_K only, got ") + type_name(w.type));
    if (w.K <= 0 || w.K % QK_K != 0)
        fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma_q6k: K must be a positive multiple of 256, got " + std::to_string(w.K));
    if (w.M <= 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q6k: M must be positive");
    if (w.M >= ((int64_t)1 << 31)) fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma_q6k: M too large for 32-bit TMA coordinates");
    if (P < 1) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q6k: position count must be >= 1");
    if (w.K / QK_K * Q_ROW >= ((int64_t)1 << 31))
        fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma_q6k: K too large for 32-bit TMA coordinates");
    if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q6k: weights not 16-byte aligned");
}

// y (+)= W x from a workspace prepared by gemmf16::prep_x (same K and P): Q6_K on wgmma.
inline void run(const Matrix &w, const void *workspace, int64_t P, float *y, bool accumulate, cudaStream_t st,
                Config c = Config{0, 0, 0}) {
    check_shape(w, P);
    if (!gemmwg::wgmma_available())
        fail(OJ_ERR_UNSUPPORTED,
             "gemm_wgmma_q6k: needs a Hopper GPU (cc 9.0) and a build with -gencode arch=compute_90a,code=sm_90a");
    if (!c.nwg) c = pick_config(P);
    // TMA reads X and the q / scale planes through tensor maps whose global addresses must be
    // 16-byte aligned (the workspace and plane offsets are multiples of 16; the bases are the caller's)
    if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q6k: workspace not 16-byte aligned");
    const uint8_t *ws = static_cast<const uint8_t *>(workspace);
    switch (config_index(c)) {
        case 0: launch_cfg<2, 128, 2>(w, ws, P, y, accumulate, st); break;
        case 1: launch_cfg<3, 64, 3>(w, ws, P, y, accumulate, st); break;
        default: fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q6k: unknown configuration");
    }
}

}  // namespace gemmwg6

// y[p][m] (+)= W[m] . x[p] for Q6_K W on Hopper's wgmma from a workspace already prepared by
// gemmf16::prep_x(x, w.K, P, workspace, st) (gemm_f16_workspace_bytes(w.K, P) bytes; the same
// workspace serves Q4_K (gemmwg::run) and gemm_f16).
inline void gemm_wgmma_q6k_run(const Matrix &w, const void *workspace, int64_t P, float *y, bool accumulate, cudaStream_t st) {
    gemmwg6::run(w, workspace, P, y, accumulate, st);
}

}  // namespace
}  // namespace oj
