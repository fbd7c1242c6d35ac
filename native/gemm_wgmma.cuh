// gemm_wgmma.cuh: Q4_K weights x P positions on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a),
// the A operand (dequantised weights) from REGISTERS, B (fp16 activations) from shared memory.
// Same arithmetic as gemm_f16.cuh's Q4_K path (read its header first); only the main loop differs.
//
// Y[p][m] (+)= sum_k W[m][k] X[p][k]; W Q4_K (144-byte super-blocks in row tiles, quant_blocks.cuh), X
// prepared ONCE by gemmf16::prep_x (its workspace, unchanged: fp16 x * 2^e_p k-permuted within each
// 32-block, xsum hi/lo [K/256][P_pad][16], 2^-e_p). tools/gemm_wgmma_bench.cu
// (scripts/gpu.sh gemm-wgmma) checks and times it beside gemm_f16.
//
// Why: mma.sync (HMMA) on Hopper tops out well below wgmma; gemm_f16 ran at 226-229 TFLOP/s for
// Q4_K at P = 2,048 and the 27B prefill wants >= ~350-400.
//
// Exactness (as gemm_f16): A = q * sc in fp16 exactly (magic-number HFMA2), per super-block the
// wgmma accumulates into a temporary tile `tmp` (first k16 step with scale-d = 0), then
// acc += d_row * tmp; the mins: one more m64nNk16 per super-block with A' = m_s (exact) and
// B' = xsum hi/lo (k 0..7 hi of sub-blocks 0..7, 8..15 lo) into `tmpm`, acc += (-64 dmin) * tmpm.
//
// Fragments (PTX ISA, wgmma .m64nNk16 .f16): warp w of a warpgroup owns rows 16 w .. 16 w + 15 of
// the 64; within a warp the A registers are those of mma.m16n8k16 (lane = 4 g + t: a0 row g k 2t,
// 2t+1; a1 row g+8; a2 row g, k 2t+8, 2t+9; a3 row g+8, k 2t+8..), and D value 4 j + e is row
// g + 8 (e >> 1), column 8 j + 2 t + (e & 1). So gemm_f16's dequant (two rows g, g + 8 per lane,
// bytes 0/2 and 1/3 of a nibble word) and its k permutation carry over unchanged; B = X rows
// [position][k] is K-major ("non-transposed", imm-trans-b = 0).
//
// Shared memory per stage (one super-block = 256 k; the stage base is 1024-aligned):
//   X     BN positions x 512 bytes as 4 "k-atoms" of BN rows x 128 bytes (k 64 a .. 64 a + 63),
//         each written by one TMA box {64 halves, BN rows} with CU_TENSOR_MAP_SWIZZLE_128B (16-byte
//         chunk c of row r at chunk c ^ (r & 7)); wgmma descriptor: 128B swizzle, SBO = 1024 (8
//         rows x 128 B), LBO unused (1), start = atom base + 32 * (k16 step & 3) (the hardware
//         applies the XOR on the address bits, as CUTLASS / DeepGEMM advance K inside an atom);
//   XSUM  BN positions x 32 bytes, one TMA box {16 halves, BN, 1} of the 3-D map [K/256][P_pad][16]
//         with CU_TENSOR_MAP_SWIZZLE_32B; descriptor: 32B swizzle, SBO = 256 (8 rows x 32 B);
//   W     BM rows x 144 bytes (the super-block as stored), one TMA box {144 bytes, 32 rows, 1, BM / 32}
//         of the 4-D map [tiles][K/256][32][144] over quant_blocks.cuh's tiled Q4_K, landing in row
//         order (rows past the last tile zero-filled; the last tile's rows past M are zero blocks). 144 B = 36 words = 4 mod 32: a
//         quad's 32-bit loads of 8 rows hit 32 different banks.
//   TMA boxes past P_pad / M are zero-filled and still count their full bytes for complete_tx.
//
// Roles (warp specialisation): warpgroup 0 = producer (setmaxnreg.dec; one thread issues the TMA
// copies of a stage and arrive.expect_tx on its `full` mbarrier after waiting on `empty`);
// warpgroups 1..NWG = consumers (setmaxnreg.inc), each 64 rows x BN positions; block = BM = 64 NWG
// rows x BN positions. Consumer loop per super-block: wait full; read the 2 rows' headers; mins
// wgmma into tmpm; 16 x (dequant A of step ks, wgmma.wait_group 1 (frees the A registers of step
// ks - 2), wgmma.fence, wgmma into tmp, commit); wait_group 0; each warp arrives on `empty`; acc +=
// d tmp + dm tmpm. Grid x = position tiles (fastest), y = row tiles.
//
// Limits: Q4_K only, K % 256 == 0, M >= 1, P >= 1; sm_90a only (for any other target the kernel
// body is a trap and wgmma_available() says false; run() refuses with a clear error).
//
// FFN gate + up + SwiGLU in one kernel (template flag SWIGLU; gemm_wgmma_q4k_swiglu; the prefill
// default on cc 9.0, first run 2026-11-30): y[p][m] = silu(W_gate[m] x_p) * (W_up[m] x_p). NWG = 2;
// the block owns 64 OUTPUT rows m0 .. m0 + 63 (grid y = ceil(M / 64)): the producer loads per stage the
// shared X / xsum boxes as above and TWO W boxes of 64 rows (gate rows m0.. at W_OFF from tm_w, up
// rows m0.. at W_OFF + 64 * 144 from tm_w2: the same bytes, the same TX, as one 128-row box), so
// consumer 0 computes the gate tile and consumer 1 the up tile of the same rows with the main loop
// unchanged (rl0 = 64 c + ... lands in box c). The two accumulators have the same (row, position)
// per (thread of the warpgroup, register), so the epilogue splits the tile's positions: consumer 0
// finishes registers i < BN/4 (positions n0 .. n0 + BN/2 - 1), consumer 1 the rest (both warpgroups
// busy: the epilogue is not overlapped with MMA at one block per SM). After the loop each stores the
// OTHER half of its acc registers to an exchange area AFTER the stages, XCH[i][tid] (i = register
// 0 .. BN/2 - 1: up from consumer 1 for i < BN/4, gate from consumer 0 above; tid = thread of the
// warpgroup: consecutive threads, consecutive words, no bank conflicts; BN * 256 bytes), both
// consumer warpgroups meet at named barrier 1 (bar.sync 1, 256; barrier 0 is __syncthreads, the
// producer takes no part), and each reads XCH[i][tid] beside its own acc[i] for its half and writes
// silu(acc_g * inv) * (acc_u * inv) (reduce.cuh's silu, products rounded as the unfused epilogue
// stores them: the result is bit-identical to gate, up, then elementwise.cu's swiglu). The
// exchange area is its own (not a reused stage): consumers run up to STAGES steps apart, so when
// consumer 1 leaves its loop consumer 0's wgmma may still read the last stages' X; one block per SM
// either way, so the extra 16 / 32 KB costs nothing.
#pragma once

#include <cuda.h>   // CUtensorMap (types only; the encode entry point comes via the runtime, no -lcuda)
#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "gemm_f16.cuh"
#include "reduce.cuh"   // silu, the engine's one SwiGLU formula

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OJ_WGMMA_DEVICE 1
#endif

namespace oj {
// Internal linkage (an unnamed namespace): prefill.cu and the harness both include this header, and
// two instantiations of a kernel template under one host symbol can miss each other's attributes.
namespace {
namespace gemmwg {

using gemmf16::h2u;
using gemmf16::u2h;

constexpr int W_ROW = 144;   // Q4_K super-block bytes

__host__ __device__ constexpr int stage_x(int bn) { return bn * 512; }
__host__ __device__ constexpr int stage_xs(int bn) { return bn * 32; }
__host__ __device__ constexpr int stage_bytes(int nwg, int bn) {
    return (stage_x(bn) + stage_xs(bn) + 64 * nwg * W_ROW + 1023) / 1024 * 1024;
}
__host__ __device__ constexpr int smem_bytes(int nwg, int bn, int stages) { return stages * stage_bytes(nwg, bn) + 1024; }
// SWIGLU: consumer 1's up accumulators, BN / 2 fp32 per thread x 128 threads, after the stages
__host__ __device__ constexpr int xch_bytes(int bn) { return bn / 2 * 128 * 4; }
__host__ __device__ constexpr int smem_bytes_swiglu(int bn, int stages) { return stages * stage_bytes(2, bn) + xch_bytes(bn) + 1024; }

// Registers per thread: the entry cap from __launch_bounds__(128 (NWG + 1), 1), the producer's
// after setmaxnreg.dec, the consumers' after .inc (the pool is the entry allocation).
__host__ __device__ constexpr int reg_cap(int nwg) { return (65536 / (128 * (nwg + 1))) / 8 * 8 > 256 ? 256 : (65536 / (128 * (nwg + 1))) / 8 * 8; }
constexpr int PRODUCER_REGS = 40;
__host__ __device__ constexpr int consumer_regs(int nwg) {
    return ((reg_cap(nwg) * (nwg + 1) - PRODUCER_REGS) / nwg) / 8 * 8 > 256 ? 256
                                                                              : ((reg_cap(nwg) * (nwg + 1) - PRODUCER_REGS) / nwg) / 8 * 8;
}

// ---------------------------------------------------------------------------------------------
// device helpers (sm_90a)

#ifdef OJ_WGMMA_DEVICE
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_4d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, int c3, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// named barrier ID over COUNT threads (whole warps); barrier 0 is __syncthreads'
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_sync() { asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(COUNT) : "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// keeps the compiler from moving reads of a wgmma accumulator above the wait_group
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor (PTX "matrix-descriptor-format"): start >> 4 in bits 0..13,
// leading byte offset >> 4 in 16..29, stride byte offset >> 4 in 32..45, base offset 0 (atoms
// 1024 / 256-aligned), layout in 62..63 (1 = 128B swizzle, 3 = 32B swizzle).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t sbo, uint32_t layout) {
    return (uint64_t)((addr >> 4) & 0x3FFFu) | ((uint64_t)1u << 16) | ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) |
           ((uint64_t)layout << 62);
}

// D (64 x 64, fp32) (+)= A (64 x 16 fp16, registers) x B (16 x 64 fp16, shared memory, K-major via desc)
__device__ __forceinline__ void wgmma_n64(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                          int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate));
}

// D (64 x 128, fp32) (+)= A (64 x 16 fp16, registers) x B (16 x 128 fp16, shared memory, K-major via desc)
__device__ __forceinline__ void wgmma_n128(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                          int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(accumulate));
}

template <int BN>
__device__ __forceinline__ void wgmma_bn(float (&d)[BN / 2], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc,
                                         int accumulate) {
    if constexpr (BN == 128) wgmma_n128(d, a0, a1, a2, a3, desc, accumulate);
    else wgmma_n64(d, a0, a1, a2, a3, desc, accumulate);
}

// The plain epilogue of a consumer's 64 x BN accumulator tile (Q4_K and gemm_wgmma_q6k.cuh's Q6_K):
// D value i = 4 jn + e is row rl0 + 8 (e >> 1), position 8 jn + 2 t + (e & 1); y[pos][row] (+)=
// acc * 2^-e_pos for rows < M and positions < P. ARGS: inv, y, M, P, accumulate.
template <int BN, class ARGS>
__device__ __forceinline__ void store_tile(const ARGS &a, const float (&acc)[BN / 2], int m0, int n0, int rl0, int t) {
#pragma unroll
    for (int jn = 0; jn < BN / 8; ++jn)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
            const int64_t pos = n0 + 8 * jn + 2 * t + e1;
            if (pos >= a.P) continue;
            const float iv = a.inv[pos];
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
                const int64_t row = (int64_t)m0 + rl0 + 8 * e2;
                if (row >= a.M) continue;
                float *dst = a.y + pos * a.M + row;
                const float v = acc[4 * jn + 2 * e2 + e1] * iv;
                *dst = a.accumulate ? *dst + v : v;
            }
        }
}
#endif  // OJ_WGMMA_DEVICE

struct Args {
    const float *inv;   // [P_pad] 2^-e_p
    float *y;           // [P][M]
    int64_t M, P;
    int nsteps;         // K / 256
    bool accumulate;
};

// ---------------------------------------------------------------------------------------------
// the kernel

// SWIGLU (see the header): tm_w = W_gate, tm_w2 = W_up (boxes of 64 rows), y = swiglu, no
// accumulate; otherwise tm_w2 is unused (the launcher passes tm_w again).
template <int NWG, int BN, int STAGES, bool SWIGLU = false>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap tm_x, const __grid_constant__ CUtensorMap tm_xs,
                      const __grid_constant__ CUtensorMap tm_w, const __grid_constant__ CUtensorMap tm_w2, const Args a) {
#ifdef OJ_WGMMA_DEVICE
    static_assert(BN == 64 || BN == 128, "BN: 64 or 128 positions");
    static_assert(!SWIGLU || NWG == 2, "SWIGLU: consumer 0 the gate rows, consumer 1 the same rows of up");
    constexpr int BM = 64 * NWG;                   // W rows per stage (both matrices' under SWIGLU)
    constexpr int BM_OUT = SWIGLU ? 64 : BM;       // output rows per block
    constexpr int SB = stage_bytes(NWG, BN);
    constexpr int XS_OFF = stage_x(BN), W_OFF = stage_x(BN) + stage_xs(BN);
    constexpr uint32_t TX = stage_x(BN) + stage_xs(BN) + BM * W_ROW;   // full boxes, OOB fill included
    constexpr int R = BN / 2;                                           // accumulators per thread
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES];

    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    uint8_t *const sbase = smem_raw + (base - smem_u32(smem_raw));
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM_OUT;
    const int nsteps = a.nsteps;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(smem_u32(&full_bar[s]), 1);
            mbar_init(smem_u32(&empty_bar[s]), 4 * NWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ---------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
        if (warp == 0 && lane == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_x)) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_xs)) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_w)) : "memory");
            if constexpr (SWIGLU) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_w2)) : "memory");
            for (int u = 0; u < nsteps; ++u) {
                const int s = u % STAGES;
                if (u >= STAGES) mbar_wait(smem_u32(&empty_bar[s]), (uint32_t)((u / STAGES) - 1) & 1u);
                const uint32_t fb = smem_u32(&full_bar[s]);
                mbar_expect_tx(fb, TX);
                const uint32_t st = base + (uint32_t)s * SB;
#pragma unroll
                for (int at = 0; at < 4; ++at) tma_2d(st + at * BN * 128, &tm_x, u * 256 + 64 * at, n0, fb);
                tma_3d(st + XS_OFF, &tm_xs, 0, n0, u, fb);
                if constexpr (SWIGLU) {   // gate rows m0.. for consumer 0, the same rows of up for consumer 1
                    tma_4d(st + W_OFF, &tm_w, 0, 0, u, m0 / TILE_ROWS, fb);
                    tma_4d(st + W_OFF + 64 * W_ROW, &tm_w2, 0, 0, u, m0 / TILE_ROWS, fb);
                } else
                    tma_4d(st + W_OFF, &tm_w, 0, 0, u, m0 / TILE_ROWS, fb);
            }
        }
    } else {
        // ---------------- consumers: warpgroup c = wg - 1 owns block rows 64 c .. 64 c + 63
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(consumer_regs(NWG)));
        const int c = wg - 1, g = lane >> 2, t = lane & 3;
        const int rl0 = 64 * c + 16 * warp + g;   // rows rl0, rl0 + 8 of the block
        float acc[R], tmp[R], tmpm[R];
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = tmp[i] = tmpm[i] = 0.0f;
        const __half2 c1024 = __float2half2_rn(1024.0f), cm1024 = __float2half2_rn(-1024.0f);
        const __half2 c16th = __float2half2_rn(0.0625f), cm64 = __float2half2_rn(-64.0f);

        for (int u = 0; u < nsteps; ++u) {
            const int s = u % STAGES;
            mbar_wait(smem_u32(&full_bar[s]), (uint32_t)(u / STAGES) & 1u);
            const uint32_t st = base + (uint32_t)s * SB;
            const uint8_t *ws = sbase + (size_t)s * SB + W_OFF;
            // the two rows' headers: d, dmin, 6-bit scales and mins (as gemm_f16's step_q45)
            float d[2], dm[2];
            uint32_t scw[2][2], mA[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint4 h = *reinterpret_cast<const uint4 *>(ws + (rl0 + 8 * r) * W_ROW);
                d[r] = gemm::half_bits(h.x & 0xFFFFu);
                dm[r] = -64.0f * gemm::half_bits(h.x >> 16);   // xsum carries 2^-6
                scw[r][0] = h.y & 0x3F3F3F3Fu;
                scw[r][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
                const uint32_t mn0 = h.z & 0x3F3F3F3Fu;
                const uint32_t mn1 = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
                const int b = (2 * t) & 3;   // mins of sub-blocks 2t, 2t+1 (k 2t, 2t+1 and 2t+8, 2t+9)
                const uint32_t mp = __byte_perm(t < 2 ? mn0 : mn1, 0x64646464u, 0x4040u | b | ((b + 1) << 8));
                mA[r] = h2u(__hsub2(u2h(mp), c1024));
            }
            // mins tile: tmpm = m x xsum (k16 = 8 hi + 8 lo)
            wg_fence();
            wgmma_bn<BN>(tmpm, mA[0], mA[1], mA[0], mA[1], make_desc(st + XS_OFF, 256, 3), 0);
            wg_commit();
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                uint32_t raw[2][2];   // [row][half]: qs bytes 32 j + 16 h + 4 t .. + 3
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        raw[r][h] = *reinterpret_cast<const uint32_t *>(ws + (rl0 + 8 * r) * W_ROW + 16 + 32 * j + 16 * h + 4 * t);
#pragma unroll
                for (int nib = 0; nib < 2; ++nib) {
                    const int sb = 2 * j + nib;   // sub-block
                    __half2 scH[2], biH[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const __half2 p = u2h(__byte_perm(scw[r][sb >> 2], 0x64646464u, gemmf16::splat_byte_sel(sb & 3)));
                        scH[r] = nib ? __hfma2(p, c16th, cm64) : __hsub2(p, c1024);   // sc / 16 or sc, exact
                        biH[r] = __hmul2(scH[r], cm1024);                            // -64 sc or -1024 sc, exact
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int ks = 2 * sb + h;   // k16 step: permuted k 16 ks .. 16 ks + 15
                        uint32_t m[4];
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const uint32_t w = raw[r][h];
                            m[r] = nib ? gemmf16::nibble_pair_magic<1>(w) : gemmf16::nibble_pair_magic<0>(w);
                            m[2 + r] = nib ? gemmf16::nibble_pair_magic<1>(w >> 8) : gemmf16::nibble_pair_magic<0>(w >> 8);
                        }
                        const uint32_t A0 = h2u(__hfma2(u2h(m[0]), scH[0], biH[0]));
                        const uint32_t A1 = h2u(__hfma2(u2h(m[1]), scH[1], biH[1]));
                        const uint32_t A2 = h2u(__hfma2(u2h(m[2]), scH[0], biH[0]));
                        const uint32_t A3 = h2u(__hfma2(u2h(m[3]), scH[1], biH[1]));
                        wg_wait<1>();   // step ks - 2's A registers are free again
                        wg_fence();
                        wgmma_bn<BN>(tmp, A0, A1, A2, A3, make_desc(st + (ks >> 2) * BN * 128 + (ks & 3) * 32, 1024, 1), ks);
                        wg_commit();
                    }
                }
            }
            wg_wait<0>();
            fence_regs<R>(tmp);
            fence_regs<R>(tmpm);
            __syncwarp();
            if (lane == 0) mbar_arrive(smem_u32(&empty_bar[s]));
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const int r = (i >> 1) & 1;
                acc[i] = fmaf(dm[r], tmpm[i], fmaf(d[r], tmp[i], acc[i]));
            }
        }

        if constexpr (SWIGLU) {
            // Both consumer warpgroups finish half of the tile: consumer 0 positions n0 .. n0 + BN/2 - 1
            // (registers i < R/2, jn < BN/16), consumer 1 the rest. Each hands the other half of its
            // accumulators over through XCH[i][tid] (i < R/2: up from consumer 1; i >= R/2: gate
            // from consumer 0; same fragment layout in both warpgroups), then named barrier 1 over
            // the two consumer warpgroups orders the stores before the loads (bar.sync: shared-memory
            // accesses before it are performed for every participating thread after it).
            constexpr int H = R / 2;
            float *const xch = reinterpret_cast<float *>(sbase + (size_t)STAGES * SB);
            const int tid = threadIdx.x & 127;
            if (c == 0) {
#pragma unroll
                for (int i = H; i < R; ++i) xch[i * 128 + tid] = acc[i];
            } else {
#pragma unroll
                for (int i = 0; i < H; ++i) xch[i * 128 + tid] = acc[i];
            }
            named_bar_sync<1, 256>();
            const int rb = 16 * warp + g;   // the block's output rows rb, rb + 8 (either consumer)
            // D value i = 4 jn + e: row rb + 8 (e >> 1), position 8 jn + 2 t + (e & 1)
            auto finish = [&](const int jn) {
#pragma unroll
                for (int e1 = 0; e1 < 2; ++e1) {
                    const int64_t pos = n0 + 8 * jn + 2 * t + e1;
                    if (pos >= a.P) continue;
                    const float iv = a.inv[pos];
#pragma unroll
                    for (int e2 = 0; e2 < 2; ++e2) {
                        const int64_t row = (int64_t)m0 + rb + 8 * e2;
                        if (row >= a.M) continue;
                        const int i = 4 * jn + 2 * e2 + e1;
                        const float other = xch[i * 128 + tid];
                        // rounded as the unfused epilogue stores gate and up (no contraction)
                        const float gate = __fmul_rn(c == 0 ? acc[i] : other, iv), up = __fmul_rn(c == 0 ? other : acc[i], iv);
                        a.y[pos * a.M + row] = silu(gate) * up;
                    }
                }
            };
            if (c == 0) {
#pragma unroll
                for (int jn = 0; jn < BN / 16; ++jn) finish(jn);
            } else {
#pragma unroll
                for (int jn = BN / 16; jn < BN / 8; ++jn) finish(jn);
            }
        } else {
            store_tile<BN>(a, acc, m0, n0, rl0, t);
        }
    }
#else
    __trap();   // built for a target without wgmma (needs -gencode arch=compute_90a,code=sm_90a)
#endif
}

// Writes 1 when this translation unit's device code was built for sm_90a (wgmma present).
__global__ void wgmma_probe_kernel(int *out) {
#ifdef OJ_WGMMA_DEVICE
    *out = 1;
#else
    *out = 0;
#endif
}

// ---------------------------------------------------------------------------------------------
// host side

struct Config {
    int nwg, bn, stages;   // consumer warpgroups (BM = 64 nwg rows), positions per block, pipeline depth
};

// The instantiated configurations, the default first (see the header for the shared-memory sums):
// 128 rows x 128 positions x 2 stages (173 KB), 128 x 64 x 4 (209 KB), 192 x 64 x 3 (184 KB).
constexpr int N_CONFIGS = 3;
constexpr Config CONFIGS[N_CONFIGS] = {{2, 128, 2}, {2, 64, 4}, {3, 64, 3}};

// Whether the current device is a Hopper (cc 9.0) and this build carries sm_90a device code (a probe
// kernel, once per device: code JIT-compiled from compute_90 PTX has a trap where wgmma would be).
inline bool wgmma_available() {
    static std::mutex mu;
    static std::map<int, bool> avail;
    int dev = 0;
    check_cuda(cudaGetDevice(&dev), "gemm_wgmma: cudaGetDevice");
    std::lock_guard<std::mutex> lock(mu);
    auto it = avail.find(dev);
    if (it != avail.end()) return it->second;
    int major = 0, minor = 0, h = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "gemm_wgmma: compute capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "gemm_wgmma: compute capability");
    if (major == 9 && minor == 0) {
        int *d = nullptr;
        check_cuda(cudaMalloc(&d, sizeof(int)), "gemm_wgmma: probe alloc");
        wgmma_probe_kernel<<<1, 1>>>(d);
        check_launch("gemm_wgmma: probe");
        check_cuda(cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost), "gemm_wgmma: probe copy");
        check_cuda(cudaFree(d), "gemm_wgmma: probe free");
    }
    return avail.emplace(dev, h == 1).first->second;
}

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!fn) {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q),
                   "gemm_wgmma: cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
        if (q != cudaDriverEntryPointSuccess || !p) fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma: the driver has no cuTensorMapEncodeTiled");
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}

inline void encode(CUtensorMap *m, CUtensorMapDataType type, int rank, const void *addr, const cuuint64_t *dims,
                   const cuuint64_t *strides, const cuuint32_t *box, CUtensorMapSwizzle swz, const char *what) {
    const cuuint32_t estr[4] = {1, 1, 1, 1};
    const CUresult r = encode_fn()(m, type, (cuuint32_t)rank, const_cast<void *>(addr), dims, strides, box, estr,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, swz, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) fail(OJ_ERR_INVALID_ARGUMENT, std::string("gemm_wgmma: cuTensorMapEncodeTiled failed for ") + what +
                                                             " (CUresult " + std::to_string((int)r) + ")");
}

// X fp16 [P_pad][K] (boxes of 64 halves = 128 B, the swizzle span, x bn positions) and xsum hi/lo
// fp16 [K/256][P_pad][16] (boxes of 16 halves = 32 B x bn positions x 1 step) of a prepared workspace
inline void encode_x_maps(CUtensorMap *tx, CUtensorMap *txs, const uint8_t *ws, int64_t K, int64_t P, int bn) {
    const int64_t pp = gemmf16::padded_positions(P), nb = K / QK_K;
    const gemmf16::WsLayout l = gemmf16::ws_layout(K, P);
    {
        const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)pp}, strides[1] = {(cuuint64_t)K * 2};
        const cuuint32_t box[2] = {64, (cuuint32_t)bn};
        encode(tx, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, ws + l.xh, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, "X");
    }
    {
        const cuuint64_t dims[3] = {16, (cuuint64_t)pp, (cuuint64_t)nb}, strides[2] = {32, (cuuint64_t)pp * 32};
        const cuuint32_t box[3] = {16, (cuuint32_t)bn, 1};
        encode(txs, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, ws + l.xs, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_32B, "xsum");
    }
}

// A plane in row tiles (quant_blocks.cuh: [tiles][nb][32][bytes], M rows) as a 4-D map whose boxes
// are one super-block x `rows` rows ({bytes, 32, 1, rows / 32}: the rows land in shared memory in
// row order, `bytes` apart, as a 2-D box over row-major rows did); coordinates {0, 0, u, m0 / 32}.
inline void encode_tile_map(CUtensorMap *tm, const uint8_t *plane, int64_t M, int64_t nb, int bytes, int rows, const char *what) {
    const cuuint64_t dims[4] = {(cuuint64_t)bytes, (cuuint64_t)TILE_ROWS, (cuuint64_t)nb, (cuuint64_t)row_tiles(M)};
    const cuuint64_t strides[3] = {(cuuint64_t)bytes, (cuuint64_t)(TILE_ROWS * bytes), (cuuint64_t)(nb * TILE_ROWS * bytes)};
    const cuuint32_t box[4] = {(cuuint32_t)bytes, (cuuint32_t)TILE_ROWS, 1, (cuuint32_t)(rows / TILE_ROWS)};
    encode(tm, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, plane, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE, what);
}

// Q4_K tiled: boxes of one super-block x `rows` rows
inline void encode_w_map(CUtensorMap *tw, const Matrix &w, int rows, const char *what) {
    encode_tile_map(tw, w.data, w.M, w.K / QK_K, W_ROW, rows, what);
}

template <int NWG, int BN, int STAGES>
inline void launch_cfg(const Matrix &w, const uint8_t *ws, int64_t P, float *y, bool accumulate, cudaStream_t st) {
    constexpr int SMEM = smem_bytes(NWG, BN, STAGES);
    {   // once per device (cudaFuncSetAttribute acts on the current device only)
        static std::mutex mu;
        static std::set<int> done;
        int dev = 0;
        check_cuda(cudaGetDevice(&dev), "gemm_wgmma: cudaGetDevice");
        std::lock_guard<std::mutex> lock(mu);
        if (!done.count(dev)) {
            check_cuda(cudaFuncSetAttribute(gemm_wgmma_kernel<NWG, BN, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            SMEM),
                       "gemm_wgmma: shared-memory attribute");
            done.insert(dev);
        }
    }
    const int64_t K = w.K, M = w.M, nb = K / QK_K;
    const gemmf16::WsLayout l = gemmf16::ws_layout(K, P);
    alignas(64) CUtensorMap tx, txs, tw;
    encode_x_maps(&tx, &txs, ws, K, P, BN);
    encode_w_map(&tw, w, 64 * NWG, "Q4_K weights");
    Args a;
    a.inv = reinterpret_cast<const float *>(ws + l.inv);
    a.y = y;
    a.M = M;
    a.P = P;
    a.nsteps = (int)nb;
    a.accumulate = accumulate;
    const dim3 grid((unsigned)((P + BN - 1) / BN), (unsigned)((M + 64 * NWG - 1) / (64 * NWG)));
    gemm_wgmma_kernel<NWG, BN, STAGES><<<grid, 128 * (NWG + 1), SMEM, st>>>(tx, txs, tw, tw, a);
    check_launch("gemm_wgmma: kernel");
}

// The fused gate + up + SwiGLU kernel (NWG = 2, 64 output rows per block; see the header).
template <int BN, int STAGES>
inline void launch_swiglu_cfg(const Matrix &w_gate, const Matrix &w_up, const uint8_t *ws, int64_t P, float *y, cudaStream_t st) {
    constexpr int SMEM = smem_bytes_swiglu(BN, STAGES);
    {   // once per device (cudaFuncSetAttribute acts on the current device only)
        static std::mutex mu;
        static std::set<int> done;
        int dev = 0;
        check_cuda(cudaGetDevice(&dev), "gemm_wgmma swiglu: cudaGetDevice");
        std::lock_guard<std::mutex> lock(mu);
        if (!done.count(dev)) {
            check_cuda(cudaFuncSetAttribute(gemm_wgmma_kernel<2, BN, STAGES, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            SMEM),
                       "gemm_wgmma swiglu: shared-memory attribute");
            done.insert(dev);
        }
    }
    const int64_t K = w_gate.K, M = w_gate.M, nb = K / QK_K;
    const gemmf16::WsLayout l = gemmf16::ws_layout(K, P);
    alignas(64) CUtensorMap tx, txs, tg, tu;
    encode_x_maps(&tx, &txs, ws, K, P, BN);
    encode_w_map(&tg, w_gate, 64, "Q4_K ffn gate weights");
    encode_w_map(&tu, w_up, 64, "Q4_K ffn up weights");
    Args a;
    a.inv = reinterpret_cast<const float *>(ws + l.inv);
    a.y = y;
    a.M = M;
    a.P = P;
    a.nsteps = (int)nb;
    a.accumulate = false;
    const dim3 grid((unsigned)((P + BN - 1) / BN), (unsigned)((M + 63) / 64));
    gemm_wgmma_kernel<2, BN, STAGES, true><<<grid, 128 * 3, SMEM, st>>>(tx, txs, tg, tu, a);
    check_launch("gemm_wgmma swiglu: kernel");
}

// The fused gate + up + SwiGLU kernel's configurations (NWG = 2 only), the default first:
// 64 output rows x 128 positions x 2 stages (205 KB with the 32 KB exchange area), 64 x 64 x 4 (225 KB).
constexpr int N_SWIGLU_CONFIGS = 2;
constexpr Config SWIGLU_CONFIGS[N_SWIGLU_CONFIGS] = {{2, 128, 2}, {2, 64, 4}};

inline int config_index(const Config &c) {
    for (int i = 0; i < N_CONFIGS; ++i)
        if (CONFIGS[i].nwg == c.nwg && CONFIGS[i].bn == c.bn && CONFIGS[i].stages == c.stages) return i;
    return -1;
}

// The configuration for P positions, or OJ_GEMMWG_CFG="nwg,bn,stages" (one of CONFIGS): kept
// because scripts/gpu.sh gemm-wgmma times each configuration through it; users never set it.
// P <= 64 (a prefill piece beside decoding streams, a short turn) takes 128 x 64 x 4: one position
// tile either way, half the MMA work of 128 positions and twice the stages in flight for calls
// bound by the weights (the fused FFN at 64 positions: 0.102 against 0.161 ms, H100). The
// configurations give the same bits (the sum over K runs in one order; the harness checks it), so
// the pick by P keeps a prompt in pieces equal to the prompt whole.
constexpr int64_t SMALL_P = 64;
inline Config pick_config(int64_t P) {
    if (const char *e = std::getenv("OJ_GEMMWG_CFG")) {
        Config c = {0, 0, 0};
        if (std::sscanf(e, "%d,%d,%d", &c.nwg, &c.bn, &c.stages) == 3 && config_index(c) >= 0) return c;
        fail(OJ_ERR_INVALID_ARGUMENT, std::string("gemm_wgmma: OJ_GEMMWG_CFG=") + e + " is not one of the instantiated configurations");
    }
    return P <= SMALL_P ? CONFIGS[1] : CONFIGS[0];
}

inline int swiglu_config_index(const Config &c) {
    for (int i = 0; i < N_SWIGLU_CONFIGS; ++i)
        if (SWIGLU_CONFIGS[i].nwg == c.nwg && SWIGLU_CONFIGS[i].bn == c.bn && SWIGLU_CONFIGS[i].stages == c.stages) return i;
    return -1;
}

// OJ_GEMMWG_CFG when it names one of SWIGLU_CONFIGS (a 2-warpgroup one), else the default: the
// variable is a comparison knob for the plain kernel, whose 3-warpgroup shape has no fused form.
inline Config pick_swiglu_config(int64_t P) {
    const Config c = pick_config(P);
    return swiglu_config_index(c) >= 0 ? c : SWIGLU_CONFIGS[0];
}

inline void check_shape(const Matrix &w, int64_t P) {
    if (w.type != TYPE_Q4_K) fail(OJ_ERR_UNSUPPORTED, std::string("gemm_wgmma: Q4_K only, got ") + type_name(w.type));
    if (w.K <= 0 || w.K % QK_K != 0)
        fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma: K must be a positive multiple of 256, got " + std::to_string(w.K));
    if (w.M <= 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma: M must be positive");
    if (P < 1) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma: position count must be >= 1");
    if (w.K / QK_K * W_ROW * 1 > ((int64_t)1 << 31) || w.K > ((int64_t)1 << 31))
        fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma: K too large for 32-bit TMA coordinates");
    if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma: weights not 16-byte aligned");
}

// y (+)= W x from a workspace prepared by gemmf16::prep_x (same K and P): Q4_K on wgmma.
inline void run(const Matrix &w, const void *workspace, int64_t P, float *y, bool accumulate, cudaStream_t st,
                Config c = Config{0, 0, 0}) {
    check_shape(w, P);
    if (!wgmma_available())
        fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma: needs a Hopper GPU (cc 9.0) and a build with -gencode arch=compute_90a,code=sm_90a");
    if (!c.nwg) c = pick_config(P);
    // TMA reads X, xsum and the weights through tensor maps whose global addresses must be 16-byte
    // aligned (the workspace offsets are multiples of 16; the base is the caller's)
    if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma: workspace not 16-byte aligned");
    const uint8_t *ws = static_cast<const uint8_t *>(workspace);
    switch (config_index(c)) {
        case 0: launch_cfg<2, 128, 2>(w, ws, P, y, accumulate, st); break;
        case 1: launch_cfg<2, 64, 4>(w, ws, P, y, accumulate, st); break;
        case 2: launch_cfg<3, 64, 3>(w, ws, P, y, accumulate, st); break;
        default: fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma: unknown configuration");
    }
}

// y[p][m] = silu(W_gate[m] . x[p]) * (W_up[m] . x[p]) from a workspace prepared by gemmf16::prep_x
// (K and P): the FFN's gate and up in one wgmma kernel, SwiGLU in its epilogue.
inline void run_swiglu(const Matrix &w_gate, const Matrix &w_up, const void *workspace, int64_t P, float *y, cudaStream_t st,
                       Config c = Config{0, 0, 0}) {
    if (w_gate.type != TYPE_Q4_K || w_up.type != TYPE_Q4_K)
        fail(OJ_ERR_UNSUPPORTED, std::string("gemm_wgmma_q4k_swiglu: gate and up must both be Q4_K, got gate ") + type_name(w_gate.type) +
                                     ", up " + type_name(w_up.type));
    if (w_gate.K != w_up.K || w_gate.M != w_up.M)
        fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q4k_swiglu: gate is K " + std::to_string(w_gate.K) + " x M " + std::to_string(w_gate.M) +
                                          ", up is K " + std::to_string(w_up.K) + " x M " + std::to_string(w_up.M) + "; they must match");
    check_shape(w_gate, P);
    check_shape(w_up, P);
    if (!y) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q4k_swiglu: output is NULL");
    if (!wgmma_available())
        fail(OJ_ERR_UNSUPPORTED, "gemm_wgmma_q4k_swiglu: needs a Hopper GPU (cc 9.0) and a build with -gencode arch=compute_90a,code=sm_90a");
    if (!c.nwg) c = pick_swiglu_config(P);
    if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q4k_swiglu: workspace not 16-byte aligned");
    const uint8_t *ws = static_cast<const uint8_t *>(workspace);
    switch (swiglu_config_index(c)) {
        case 0: launch_swiglu_cfg<128, 2>(w_gate, w_up, ws, P, y, st); break;
        case 1: launch_swiglu_cfg<64, 4>(w_gate, w_up, ws, P, y, st); break;
        default: fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma_q4k_swiglu: unknown configuration (2,128,2 or 2,64,4)");
    }
}

}  // namespace gemmwg

// The FFN's SwiGLU input of the down projection, y[p][m] = silu(W_gate[m] . x[p]) * (W_up[m] . x[p]),
// in one wgmma kernel (both Q4_K, same K and M); the workspace prepared by gemmf16::prep_x for K, P.
inline void gemm_wgmma_q4k_swiglu(const Matrix &w_gate, const Matrix &w_up, const void *workspace, int64_t P, float *y,
                                  cudaStream_t st) {
    gemmwg::run_swiglu(w_gate, w_up, workspace, P, y, st);
}

// y[p][m] (+)= W[m] . x[p] for Q4_K W on Hopper's wgmma; the workspace is gemm_f16's
// (gemm_f16_workspace_bytes(w.K, P) bytes).
inline void gemm_wgmma_q4k(const Matrix &w, const float *x, int64_t P, float *y, bool accumulate, void *workspace,
                           size_t workspace_size, cudaStream_t st) {
    gemmwg::check_shape(w, P);
    if (workspace_size < gemm_f16_workspace_bytes(w.K, P))
        fail(OJ_ERR_INVALID_ARGUMENT, "gemm_wgmma: workspace of " + std::to_string(workspace_size) + " bytes, need " +
                                          std::to_string(gemm_f16_workspace_bytes(w.K, P)));
    gemmf16::prep_x(x, w.K, P, workspace, st);
    gemmwg::run(w, workspace, P, y, accumulate, st);
}

}  // namespace
}  // namespace oj
