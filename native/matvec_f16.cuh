// matvec_f16.cuh: decode matvec (quantised W x 1..16 activation vectors, every weight byte read once
// per call) with fp16 activations on the fp16 tensor cores: the decode default for Q4_K and Q6_K
// (issue 8), the int8 path's instruction budget with near-bf16-split accuracy. Q4_K and Q6_K (the 27B
// Q4_K_M map's types) in the engine's device layouts (quant_blocks.cuh). Checked and timed by
// tools/matvec_f16_bench.cu (scripts/gpu.sh matvec-f16); the engine calls it for every Q4_K and
// Q6_K matrix of a decode pass (matvec.cu; Q5_K and Q8_0 take its bf16-split kernels).
//
// Numerics (gemm_f16.cuh's, which passed every prefill check):
//   - x: one power-of-two scale per (vector, 256-value super-block) so that max |x| lands in
//     [2^14, 2^15) (no global reduction: the prep kernel is one pass, one warp per (super-block,
//     vector); undone exactly per super-block). fp16 rounding of x is the only rounding before
//     fp32 accumulation. Each vector's prep and columns are independent of the others, and every
//     reduction is in a fixed order, so 1..16 vectors per call give bit-identical results.
//   - Q4_K: A = q * sc exactly in fp16 by one HFMA2 on the magic (1024 + q) / (1024 + 16 q)
//     (gemm_f16.cuh's nibble_pair_magic); 16 k16 steps of a super-block accumulate into a
//     temporary tile; the mins are one more mma (A' = m_s, B' = per-sub-block sum of the scaled,
//     unrounded x split into fp16 hi + lo, times 2^-6); then acc += inv_x * (d * tmp - 64 dmin * tmp').
//   - Q6_K: A = q - 32 exactly (magic 1024 + q6, minus 1056); each 16-value scale group is one mma
//     into a fresh temporary, s += sc * tmp; acc += (inv_x * d) * s per super-block.
//
// Work split: a block holds 32 weight rows (two m16 tiles, so each B fragment serves two mma) and
// WARPS warps; warp w walks super-blocks u = u0 + w, u0 + w + WARPS, ... of its block's range
// (split-K inside the block), and the warps' partial sums meet in shared memory in warp order.
// Split-K across blocks (when the row tiles alone leave the GPU's block slots short): S blocks per
// row tile, block b = tile * S + s taking the contiguous super-blocks [u0, u1) = [s nb / S,
// (s + 1) nb / S). S depends on the shape and device only (pick()), never on n_vec. The S partials
// meet in a fixed order, no float atomics: each block of the tile writes its partial [n_vec][32] to
// its own workspace slot, fences, and bumps the tile's arrival counter; the block that arrives last
// sums slots 0..S-1 in that order (the same sum whichever block is last), writes y (+)= it, and
// resets the counter to 0 for the next call (see "Split-K workspace" below).
// Streaming: each warp has a private ring of STAGES
// shared-memory stages filled by cp.async (its 32 rows' bytes of one super-block + the prepared x
// of the call's vectors), STAGES - 1 super-blocks in flight while it computes one; no block barrier
// inside the loop. Q4_K on sm_90+ (stream_tma, the default there): the same ring filled by the
// copy engine, one bulk copy of the row tile's 4,608 bytes (quant_blocks.cuh's tiled Q4_K) and two bulk
// copies of x per step, each stage an
// mbarrier with the stage's byte count; 16-byte cp.async with a queue of 10-20 copies per lane
// held the SM's load path (ncu: a third of the FFN group's stall samples in the block's first
// copies, a quarter waiting on registers of queued copies) and the FFN group at 1.6 TB/s, 2.3 on
// the copy engine. Lane ownership: lane t of a quad takes Q4_K qs chunk t (bytes 32t..32t+31 =
// sub-blocks 2t, 2t+1) of rows g, g+8 of each tile, so its scales are fixed for the super-block;
// Q6_K uses the regrouped planes as matvec.cu / gemm_f16.cuh do. The k order inside an mma is free
// as long as A and B agree: the prep kernel writes x in the order each type's lanes consume it.
//
// Prepared x, per super-block u a record of REC bytes: 16 vector slots, then at INV_OFF 16 fp32
// inverse scales 2^-e (1 for vectors past n_vec). Vectors past n_vec are neither written nor read
// (their lanes feed B = 0). A vector's slot (vec_bytes, the stride a stage keeps too):
//   - Q4_K, 576 bytes: 512 of fp16 x as [chunk c 0..7][lane t 0..3][8 halfs] (chunk c = k16 steps
//     2c, 2c+1 of lane t), 32 of min sums [t][hi_2t, hi_2t+1, lo_2t, lo_2t+1], 32 pad (a stride of
//     144 words keeps the quads' 16-byte shared loads conflict-free);
//   - Q6_K, 512 bytes: the fp16 x alone, the two 64-byte halves of each 128 bytes swapped in odd
//     vectors (x_swizzle: a stride of 128 words with the same conflict-free loads). Without the 64
//     bytes a 5-vector stage (4 warps x 2 stages) is 9,472 bytes instead of 9,728, which keeps 3
//     blocks on an SM of 228 KB instead of 2: a 5-position pass lost 0.2-0.5 ms in its Q6_K-bearing
//     projections at 2 (H100, bench/results/2026-12-07-session23-h100.md).
//
// Split-K workspace: the caller's workspace (matvec.cu keeps one per (device, stream); a call's two
// kernels run on that stream, so calls sharing a workspace are serialised, and calls on other
// streams have their own) starts with a fixed-size region, at a fixed offset so that a buffer
// reused for matrices of another K keeps it in place: MAX_TILES uint32 arrival counters, then
// MAX_SLOTS partial slots of [16 vectors][32 rows] fp32; the prepared x follows. The counters are 0
// between calls: the prep kernel zeroes them (a fresh cudaMalloc holds garbage; the matvec touches
// them only after griddepcontrol.wait, i.e. after the whole prep grid and its writes), and each
// tile's last block resets its own (so a matvec run again on an already prepared x finds them 0
// too: a kernel launched later on the stream starts its split epilogue after this grid has ended).
// pick() keeps tiles x S <= MAX_SLOTS. A workspace must not be shared by two streams at once (it
// never could: the prepared x would clash too).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>


#include "engine.cuh"
#include "pdl.cuh"        // pdl_wait, pdl_launch_dependents, launch
#include "reduce.cuh"     // block_sum
#include "gemm_f16.cuh"   // nibble_pair_magic, q6_bytes, SEL_LO/HI, splat_byte_sel, mma_f16, h2u/u2h, cp.async

namespace oj {
// Internal linkage (an unnamed namespace): a harness that includes this header AND links matvec.cu
// would otherwise hold two instantiations of each kernel template under one host symbol, and the
// shared-memory attribute set through one could miss the other at launch (first GPU run: "launch:
// invalid argument" in tools/matvec_f16_bench.cu, while the engine, one TU, passed its tests).
namespace {
namespace mvf16 {

constexpr int MAX_VEC = 16;                     // vectors a call takes: 1..8 one n8 tile of the mma, 9..16 two
constexpr int SSQ_VEC = MAX_VEC;                // vectors of a row tile's sums of squares ([tile][16])
constexpr int VEC_BYTES = 576;                  // a vector slot of a record (Q4_K's stride; Q6_K takes 512 of it)
constexpr int XS_OFF = 512;                     // min sums inside it
constexpr int INV_OFF = MAX_VEC * VEC_BYTES;    // the 16 inverse scales
constexpr int REC = INV_OFF + 4 * MAX_VEC;      // bytes per super-block of prepared x
constexpr int ROWS = 32;                        // weight rows per block (two m16 tiles)
constexpr int MAX_SLOTS = 4096;                 // split partial slots (row tiles x splits) per call
constexpr int MAX_TILES = MAX_SLOTS / 2;        // a split call has S >= 2, so at most this many tiles
constexpr size_t SLOT_FLOATS = MAX_VEC * ROWS;  // one partial: [16 vectors][32 rows] fp32
constexpr size_t PART_OFF = (size_t)MAX_TILES * 4;                          // counters first
constexpr size_t XP_OFF = PART_OFF + (size_t)MAX_SLOTS * SLOT_FLOATS * 4;   // then the prepared x
static_assert(MAX_TILES % 1024 == 0 && XP_OFF % 256 == 0, "split region: whole uint4 per thread, aligned x");

// the prepared x in the call's type's order, then room for the same x in the other type's order
// (prep's `both`: a group of Q4_K and Q6_K members reads one prep)
inline size_t workspace_bytes(int64_t K) { return XP_OFF + 2 * (size_t)(K / QK_K) * REC; }
__host__ __device__ constexpr int other_type(int type) { return type == TYPE_Q4_K ? TYPE_Q6_K : TYPE_Q4_K; }

// Weight bytes per stage (32 rows of one super-block): Q4_K as stored; Q6_K q plane + scales.
// Q6_K: q [32][192], scales [32][16], then per row the aligned 4-byte word holding its fp16 d.
__host__ __device__ constexpr int w_bytes(int type) { return type == TYPE_Q4_K ? ROWS * 144 : ROWS * (192 + 16 + 4); }
// a vector's bytes of x in a record and a stage (Q6_K has no min sums, and no pad: x_swizzle)
__host__ __device__ constexpr int vec_bytes(int type) { return type == TYPE_Q4_K ? VEC_BYTES : 512; }
// Q6_K, vector v: logical byte offset o of its 512 bytes lies at o ^ x_swizzle(v)
__host__ __device__ constexpr int x_swizzle(int v) { return (v & 1) * 64; }
// vector tiles (n8 columns of the mma) of n_vec vectors, and their inverse scales' bytes in a stage
__host__ __device__ constexpr int vec_tiles(int n_vec) { return n_vec > 8 ? 2 : 1; }
__host__ __device__ constexpr int inv_bytes(int n_vec) { return 32 * vec_tiles(n_vec); }
__host__ __device__ constexpr int x_bytes(int type, int n_vec) { return n_vec * vec_bytes(type) + inv_bytes(n_vec); }
// rounded up to 128 bytes: a stage is a bulk copy's destination (stream_tma)
__host__ __device__ constexpr int stage_bytes(int type, int n_vec) { return (w_bytes(type) + x_bytes(type, n_vec) + 127) / 128 * 128; }

// k order: lane t, k16 step ks, slot e (0, 1: mma k 2t, 2t+1; 2, 3: k 2t+8, 2t+9) holds value
// column col of the super-block. Both types take bytes (0, 2) of a word for slots (0, 1) and
// bytes (1, 3) for (2, 3): J below. Inverse: where column c goes in the vector's 256 halfs.
__host__ __device__ inline int jmap(int j) { return j == 1 ? 2 : j == 2 ? 1 : j; }   // self-inverse
__host__ __device__ inline int x_dest(int type, int c) {
    if (type == TYPE_Q4_K) {   // c = 64 t + 32 nib + 4 wi + J(e), ks = 2 wi + nib
        const int t = c >> 6, nib = (c >> 5) & 1, wi = (c >> 2) & 7;
        return wi * 32 + t * 8 + 4 * nib + jmap(c & 3);
    }
    // Q6_K: c = 128 H + 32 QQ + 16 c1 + 4 t + J(e), group C = 2 H + c1, ks = 4 C + QQ
    const int H = c >> 7, QQ = (c >> 5) & 3, c1 = (c >> 4) & 1, t = (c >> 2) & 3, C = 2 * H + c1;
    return (2 * C + (QQ >> 1)) * 32 + t * 8 + 4 * (QQ & 1) + jmap(c & 3);
}

// Q6_K: where the prep stores vector v's column c (in halfs of the vector's 512 bytes), and the
// byte offsets of lane (g, t)'s two 16-byte loads of group 0 (logical 16 t and 64 + 16 t; group C's
// are 128 C further). tools/matvec_f16_config_check.cu checks on the CPU that every load finds the
// columns the unswizzled order puts there, and that each 8 lanes' loads hit 8 different bank quads.
__host__ __device__ inline int q6_x_store(int v, int c) { return x_dest(TYPE_Q6_K, c) ^ (x_swizzle(v) / 2); }
__host__ __device__ inline int q6_x_load(int g, int t, int half) { return 16 * t + (half ? 64 - x_swizzle(g) : x_swizzle(g)); }

// Vector v's 8 values of super-block record rec held by this lane (columns 8 lane .. 8 lane + 7):
// their power-of-two scale, fp16 values in TYPE's k order, Q4_K's sub-block sums, the inverse
// scale (prep_kernel below).
template <int TYPE>
__device__ __forceinline__ void prep_store(float (&xv)[8], uint8_t *rec, int v, int lane) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(xv[j]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    int e = 0;   // amax * 2^e in [2^14, 2^15); |e| <= 126 keeps 2^-e normal
    if (amax > 0.0f && amax <= 3.0e38f) {
        int ex;
        frexpf(amax, &ex);
        e = max(min(15 - ex, 126), -126);
    }
    const float scale = ldexpf(1.0f, e);
    __half *xh = reinterpret_cast<__half *>(rec + v * vec_bytes(TYPE));
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float vs = xv[j] * scale;   // exact (power of two)
        s += vs;
        xh[TYPE == TYPE_Q6_K ? q6_x_store(v, 8 * lane + j) : x_dest(TYPE, 8 * lane + j)] = __float2half_rn(vs);
    }
    if (TYPE == TYPE_Q4_K) {   // sub-block sb = lane / 4: the 4 lanes' sums, fixed order
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if ((lane & 3) == 0) {
            const int sb = lane >> 2, t = sb >> 1;
            const float vs = s * (1.0f / 64.0f);
            const __half hi = __float2half_rn(vs);
            const __half lo = __float2half_rn(vs - __half2float(hi));
            __half *xs = reinterpret_cast<__half *>(rec + v * VEC_BYTES + XS_OFF) + 4 * t;
            xs[sb & 1] = hi;
            xs[2 + (sb & 1)] = lo;
        }
    }
    if (lane == 0) reinterpret_cast<float *>(rec + INV_OFF)[v] = ldexpf(1.0f, -e);
}

// What the prep reads: x as it is; or (norm set) rms_norm(x) * norm, the layer's input norm, bit
// for bit as elementwise.cu's rms_norm_kernel computes it (every block sums each vector's squares
// with that kernel's 256-thread loop and block_sum, then 1 / sqrt(ss / K + eps), x * scale * w); or (up set) silu(x) * up, SwiGLU with x
// the gate. xn, when set, receives the fp32 values the prep rounds (what the unfused kernels wrote).
struct PrepIn {
    const float *x = nullptr;      // [n_vec][K]
    const float *norm = nullptr;   // [K]
    float eps = 0.0f;
    const float *up = nullptr;     // [n_vec][K]
    // (head_norm set) the Gated DeltaNet output norm, as deltanet.cu's gated norm kernel computes
    // it: per head of S values (S = 32, 64 or 128, a divisor of the super-block) x / sqrt(ss / S +
    // eps) * head_norm * silu(z), the head's sum of squares over its S / 8 lanes
    const float *head_norm = nullptr;   // [S]
    const float *z = nullptr;           // [n_vec][K]
    int S = 0;
    float *xn = nullptr;           // [n_vec][K] or nullptr
    // (norm set) the sums of squares of x's row tiles of 32 ([K / 32][16], from the launch that wrote
    // x: Args::ssq): each vector's sum over K is the sum of its K / 32 partials, not of K squares
    const float *ssq = nullptr;
};

// One block per super-block u and 8 vectors (blockIdx.y: vectors 8 y .. 8 y + 7), warp w = vector
// 8 y + w: lane l holds columns 8 l .. 8 l + 7.
// ws: the whole workspace; block (0, 0) also zeroes the split-K arrival counters at its start.
// both: also the records in the other type's order, after these (region 1: XP_OFF + nb * REC on).
template <int TYPE>
__global__ void __launch_bounds__(256) prep_kernel(const PrepIn in, int64_t K, int n_vec, uint8_t *__restrict__ ws, bool both) {
    pdl_launch_dependents();
    const int64_t u = blockIdx.x;
    const int v0 = 8 * (int)blockIdx.y, v = v0 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int64_t at = (int64_t)v * K + u * QK_K + 8 * lane;
    // The norm weights: no kernel writes them, so they load before the wait, while the kernel
    // before still runs.
    float wv[8];
    if (in.norm && v < n_vec) {
        const float4 *w = reinterpret_cast<const float4 *>(in.norm + u * QK_K + 8 * lane);
        const float4 w0 = w[0], w1 = w[1];
        wv[0] = w0.x; wv[1] = w0.y; wv[2] = w0.z; wv[3] = w0.w;
        wv[4] = w1.x; wv[5] = w1.y; wv[6] = w1.z; wv[7] = w1.w;
    }
    pdl_wait();   // x, and the workspace the previous matvec on it may still read
    if (blockIdx.x == 0 && blockIdx.y == 0)
#pragma unroll
        for (int i = 0; i < MAX_TILES / 1024; ++i)
            reinterpret_cast<uint4 *>(ws)[threadIdx.x + 256 * i] = make_uint4(0u, 0u, 0u, 0u);
    float xv[8];
    float norm_scale = 1.0f;   // (norm set) vector v's 1 / rms, the same in every lane of warp v
    const bool x_early = in.norm && in.ssq;
    if (x_early) {   // warp v: vector v's x and partials loaded together; the partials lane-strided in order, then the xor tree
        if (v < n_vec) {
            const float4 *src = reinterpret_cast<const float4 *>(in.x + at);
            const float4 a = src[0], b = src[1];
            xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
            xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
            float t = 0.0f;
            for (int64_t i = lane; i < K / 32; i += 32) t += in.ssq[i * SSQ_VEC + v];
            t = warp_sum(t);
            norm_scale = 1.0f / sqrtf(t / K + in.eps);
        }
    } else if (in.norm) {   // the whole block, for every vector (rms_norm_kernel's order: blockDim.x is 256 there too)
        // Every vector's load of one i is issued together, each vector still summed in i order:
        // summed one vector after another, the sums were n_vec chains of L2 round trips in a row
        // (H100, 5 positions: +24 us per fused projection, 2.60 -> 3.78 ms of deltanet projections).
        __shared__ float scales[8];
        float ss[8];
#pragma unroll
        for (int vv = 0; vv < 8; ++vv) ss[vv] = 0.0f;
#pragma unroll 4
        for (int64_t i = threadIdx.x; i < K; i += blockDim.x) {
#pragma unroll
            for (int vv = 0; vv < 8; ++vv)
                if (v0 + vv < n_vec) {
                    const float xi = in.x[(int64_t)(v0 + vv) * K + i];
                    ss[vv] += xi * xi;
                }
        }
#pragma unroll
        for (int vv = 0; vv < 8; ++vv)
            if (v0 + vv < n_vec) {   // n_vec and v0 are the block's: every thread takes the same branches
                const float t = block_sum(ss[vv]);
                if (threadIdx.x == 0) scales[vv] = 1.0f / sqrtf(t / K + in.eps);
            }
        __syncthreads();
        if (v < n_vec) norm_scale = scales[v - v0];
    }
    uint8_t *rec = ws + XP_OFF + u * REC, *rec2 = ws + XP_OFF + (K / QK_K + u) * REC;
    if (v >= n_vec) {
        if (lane == 0) reinterpret_cast<float *>(rec + INV_OFF)[v] = 1.0f;
        if (lane == 0 && both) reinterpret_cast<float *>(rec2 + INV_OFF)[v] = 1.0f;
        return;
    }
    if (!x_early) {
        const float4 *src = reinterpret_cast<const float4 *>(in.x + at);
        const float4 a = src[0], b = src[1];
        xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
        xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
    }
    if (in.norm) {
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[j] = xv[j] * norm_scale * wv[j];
    } else if (in.head_norm) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += xv[j] * xv[j];
        for (int off = 1; off < in.S / 8; off <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float r = sqrtf(ss / in.S + in.eps);
        const int i0 = (8 * lane) % in.S;   // this lane's first value within its head
        const float4 *zp = reinterpret_cast<const float4 *>(in.z + at);
        const float4 c = zp[0], d = zp[1];
        const float zv[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[j] = xv[j] / r * in.head_norm[i0 + j] * (zv[j] / (1.0f + expf(-zv[j])));
    } else if (in.up) {
        const float4 *up = reinterpret_cast<const float4 *>(in.up + at);
        const float4 c = up[0], d = up[1];
        const float uv[8] = {c.x, c.y, c.z, c.w, d.x, d.y, d.z, d.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[j] = xv[j] / (1.0f + expf(-xv[j])) * uv[j];   // reduce.cuh's silu
    }
    if (in.xn) {
        float4 *dst = reinterpret_cast<float4 *>(in.xn + at);
        dst[0] = make_float4(xv[0], xv[1], xv[2], xv[3]);
        dst[1] = make_float4(xv[4], xv[5], xv[6], xv[7]);
    }
    prep_store<TYPE>(xv, rec, v, lane);
    if (both) prep_store<other_type(TYPE)>(xv, rec2, v, lane);
}

__device__ __forceinline__ void cp8(void *dst, const void *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(gemm::smem_addr(dst)), "l"(src));
#endif
}
__device__ __forceinline__ void cp4(void *dst, const void *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(gemm::smem_addr(dst)), "l"(src));
#endif
}
__device__ __forceinline__ uint4 lds16(const uint8_t *p) { return *reinterpret_cast<const uint4 *>(p); }
__device__ __forceinline__ uint2 lds8(const uint8_t *p) { return *reinterpret_cast<const uint2 *>(p); }

template <int C>
__device__ __forceinline__ uint32_t wd(const uint4 &v) {
    if constexpr (C == 0) return v.x;
    else if constexpr (C == 1) return v.y;
    else if constexpr (C == 2) return v.z;
    else return v.w;
}

constexpr int GROUP_MAX = 4;   // matrices of one launch (one type, one K, one prepared x)

// Members after the first of a grouped launch: their row tiles follow the first member's in the
// grid (member i's tiles start at tile0[i]); the kernel swaps the member a block belongs to into
// w / y / n_out. n_more = 0: a plain call.
struct More {
    Matrix w[GROUP_MAX - 1];
    float *y[GROUP_MAX - 1];
    int64_t n_out[GROUP_MAX - 1];
    int64_t tile0[GROUP_MAX - 1];
};

struct Args {
    Matrix w;
    const uint8_t *xp;           // prepared x (the workspace + XP_OFF)
    float *y;
    const int32_t *rows;         // nullptr: output row o reads weight row o (a group has none)
    float *part;                 // split partial slots [tile * split + s][8][32] (the workspace + PART_OFF)
    uint32_t *count;             // per-tile arrival counters, 0 between calls (the workspace's start)
    int64_t n_out;
    int n_vec;
    int split;                   // S: blocks per row tile (1: no split, y written directly)
    bool accumulate;
    int n_more;                  // grouped launch: members after this one (0..GROUP_MAX - 1)
    bool tma;                    // sm_90+, no row gather: tensor and bulk copies (stream_tma)
    More more;
    float *ssq;                  // set (one matrix, no row gather): each tile's sums of squares of its final y
};

// Where a lane's copies of one super-block come from (src_at: super-block u; advance: u + WARPS).
// The main loop issues super-blocks in order, so it moves one cursor instead of recomputing 64-bit
// addresses from u per 16-byte copy (~130 integer instructions of a Q4_K step before).
struct Src {
    const uint8_t *w[2];   // rows l/2 (mma tile 0) and 16 + l/2 (mma tile 1): Q4_K the block, Q6_K its q bytes
    const uint8_t *sc;     // Q6_K: the scales of the lane's own row (tile `lane & 1`)
    int64_t bi;            // Q6_K: that row's block index (its d word)
    const uint8_t *x;      // the prepared x record
};

template <int TYPE>
__device__ __forceinline__ Src src_at(const Args &a, const int64_t (&crow)[2], int64_t u, int lane) {
    Src c;
    const int64_t nb = a.w.K / QK_K;
    if constexpr (TYPE == TYPE_Q4_K) {
#pragma unroll
        for (int r = 0; r < 2; ++r) c.w[r] = a.w.data + q4_K_offset(crow[r], u, nb);
        c.sc = nullptr;
        c.bi = 0;
    } else {
        const Q6Planes p = q6_K_planes(a.w.M, a.w.K);
#pragma unroll
        for (int r = 0; r < 2; ++r) c.w[r] = a.w.data + p.q + q6_K_q_offset(crow[r], u, nb);
        const int64_t own = (lane & 1) ? crow[1] : crow[0];   // a select: crow[lane & 1] would put crow in local memory
        c.bi = own * nb + u;
        c.sc = a.w.data + p.sc + q6_K_sc_offset(own, u, nb);
    }
    c.x = a.xp + u * REC;
    return c;
}

template <int TYPE, int WARPS>
__device__ __forceinline__ void advance(Src &c) {
#pragma unroll
    for (int r = 0; r < 2; ++r) c.w[r] += WARPS * ROWS * (TYPE == TYPE_Q4_K ? 144 : 192);
    if constexpr (TYPE == TYPE_Q6_K) {
        c.sc += WARPS * ROWS * 16;
        c.bi += WARPS;
    }
    c.x += WARPS * REC;
}

// Copies a super-block's weight bytes of the block's 32 rows into a stage. Lane l copies for rows
// l/2 (tile 0) and 16 + l/2 (tile 1), the lane pair taking alternate 16-byte chunks (each
// instruction reads 32 contiguous bytes of 16 rows).
template <int TYPE>
__device__ __forceinline__ void issue_w(const Args &a, uint8_t *st, const Src &c, int lane) {
    const int half = lane & 1, rr = lane >> 1;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = 16 * r + rr;
        if constexpr (TYPE == TYPE_Q4_K) {
#pragma unroll
            for (int i = 0; i < 5; ++i) {
                const int j = half + 2 * i;
                if (j < 9) gemm::cp16(st + row * 144 + 16 * j, c.w[r] + 16 * j);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 6; ++i) {
                const int j = half + 2 * i;
                gemm::cp16(st + row * 192 + 16 * j, c.w[r] + 16 * j);
            }
        }
    }
    if constexpr (TYPE == TYPE_Q6_K) {   // even lanes: tile 0's row, odd lanes: tile 1's
        const int row = 16 * half + rr;
        const Q6Planes p = q6_K_planes(a.w.M, a.w.K);
        const int64_t bi = c.bi, nblk = a.w.M * (a.w.K / QK_K);
        gemm::cp16(st + ROWS * 192 + row * 16, c.sc);
        uint8_t *dd = st + ROWS * 208 + row * 4;
        if ((bi | 1) < nblk) cp4(dd, a.w.data + p.d + (bi & ~int64_t(1)) * 2);
        else   // the plane's last entry at an even index: its word would reach past the plane
            *reinterpret_cast<uint32_t *>(dd) = __ldg(reinterpret_cast<const unsigned short *>(a.w.data + p.d + bi * 2));
    }
}

// The prepared x of a super-block (its record rec) for the call's vectors: lane (g, t) copies
// vector g's chunks t, t + 4, ... (and vector g + 8's for NT = 2), where the vector is < n_vec;
// lanes 0 .. 2 NT - 1 the inverse scales.
template <int TYPE, int NT>
__device__ __forceinline__ void issue_x(const Args &a, uint8_t *xs, const uint8_t *rec, int g, int t, int lane) {
    constexpr int VB = vec_bytes(TYPE);
#pragma unroll
    for (int h = 0; h < NT; ++h) {
        const int v = g + 8 * h;
        if (v < a.n_vec) {
#pragma unroll
            for (int j = 0; j < 8; ++j) gemm::cp16(xs + v * VB + 16 * (t + 4 * j), rec + v * VB + 16 * (t + 4 * j));
            // Q4_K: the 32 bytes of min sums (not the pad: the prep never writes it)
            if (TYPE == TYPE_Q4_K && t < 2) gemm::cp16(xs + v * VB + XS_OFF + 16 * t, rec + v * VB + XS_OFF + 16 * t);
        }
    }
    if (lane < 2 * NT) gemm::cp16(xs + a.n_vec * VB + 16 * lane, rec + INV_OFF + 16 * lane);
}

// Q4_K, one super-block for the warp's two row tiles and NT vector tiles (vectors g, g + 8): each
// A fragment dequantised once serves NT mma.
template <int NT>
__device__ __forceinline__ void step_q4(const uint8_t *ws, const uint8_t *xs, int n_vec, int g, int t,
                                        float (&acc)[NT][2][4]) {
    bool hx[NT];
#pragma unroll
    for (int h = 0; h < NT; ++h) hx[h] = g + 8 * h < n_vec;
    const uint8_t *xg = xs + g * vec_bytes(TYPE_Q4_K);   // vector g; g + 8 is 8 slots on
    __half2 scL[2][2], biL[2][2], scH[2][2], biH[2][2];
    uint32_t mA[2][2];
    float d[2][2], dm[2][2];
    uint4 qlo[2][2], qhi[2][2];
    const int b = (2 * t) & 3;
    const __half2 c1024 = __float2half2_rn(1024.0f), cm1024 = __float2half2_rn(-1024.0f);
    const __half2 c16th = __float2half2_rn(0.0625f), cm64 = __float2half2_rn(-64.0f);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint8_t *row = ws + (16 * i + g + 8 * r) * 144;
            const uint4 h = lds16(row);
            qlo[i][r] = lds16(row + 16 + 32 * t);
            qhi[i][r] = lds16(row + 32 + 32 * t);
            d[i][r] = gemm::half_bits(h.x & 0xFFFFu);
            dm[i][r] = -64.0f * gemm::half_bits(h.x >> 16);   // the min sums carry 2^-6
            // scales and mins of sub-blocks 2t, 2t+1 (get_scale_min_k4): bytes b, b+1 of one word
            const uint32_t scw = t < 2 ? (h.y & 0x3F3F3F3Fu) : ((h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u));
            const uint32_t mnw = t < 2 ? (h.z & 0x3F3F3F3Fu) : (((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u));
            const __half2 pl = gemmf16::u2h(__byte_perm(scw, 0x64646464u, gemmf16::splat_byte_sel(b)));
            const __half2 ph = gemmf16::u2h(__byte_perm(scw, 0x64646464u, gemmf16::splat_byte_sel(b + 1)));
            scL[i][r] = __hsub2(pl, c1024);                  // sc (low nibbles: 1024 + q)
            biL[i][r] = __hmul2(scL[i][r], cm1024);          // -1024 sc
            scH[i][r] = __hfma2(ph, c16th, cm64);            // sc / 16 (high nibbles: 1024 + 16 q)
            biH[i][r] = __hmul2(scH[i][r], cm1024);          // -64 sc
            const uint32_t mp = __byte_perm(mnw, 0x64646464u, 0x4040u | b | ((b + 1) << 8));
            mA[i][r] = gemmf16::h2u(__hsub2(gemmf16::u2h(mp), c1024));
        }
    float tmp[NT][2][4];
#pragma unroll
    for (int wi = 0; wi < 8; ++wi) {
        uint4 bx[NT];
#pragma unroll
        for (int h = 0; h < NT; ++h)
            bx[h] = hx[h] ? lds16(xg + 8 * h * vec_bytes(TYPE_Q4_K) + 64 * wi + 16 * t) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const uint32_t w0 = wi < 4 ? (wi == 0 ? qlo[i][0].x : wi == 1 ? qlo[i][0].y : wi == 2 ? qlo[i][0].z : qlo[i][0].w)
                                       : (wi == 4 ? qhi[i][0].x : wi == 5 ? qhi[i][0].y : wi == 6 ? qhi[i][0].z : qhi[i][0].w);
            const uint32_t w1 = wi < 4 ? (wi == 0 ? qlo[i][1].x : wi == 1 ? qlo[i][1].y : wi == 2 ? qlo[i][1].z : qlo[i][1].w)
                                       : (wi == 4 ? qhi[i][1].x : wi == 5 ? qhi[i][1].y : wi == 6 ? qhi[i][1].z : qhi[i][1].w);
            const uint32_t s0 = w0 >> 8, s1 = w1 >> 8;
            {   // low nibbles: sub-block 2t, B = step 2 wi
                const uint32_t A0 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<0>(w0)), scL[i][0], biL[i][0]));
                const uint32_t A1 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<0>(w1)), scL[i][1], biL[i][1]));
                const uint32_t A2 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<0>(s0)), scL[i][0], biL[i][0]));
                const uint32_t A3 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<0>(s1)), scL[i][1], biL[i][1]));
#pragma unroll
                for (int h = 0; h < NT; ++h) {
                    if (wi == 0) gemmf16::mma_f16<true>(tmp[h][i], A0, A1, A2, A3, bx[h].x, bx[h].y);
                    else gemmf16::mma_f16<false>(tmp[h][i], A0, A1, A2, A3, bx[h].x, bx[h].y);
                }
            }
            {   // high nibbles: sub-block 2t + 1, B = step 2 wi + 1
                const uint32_t A0 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<1>(w0)), scH[i][0], biH[i][0]));
                const uint32_t A1 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<1>(w1)), scH[i][1], biH[i][1]));
                const uint32_t A2 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<1>(s0)), scH[i][0], biH[i][0]));
                const uint32_t A3 = gemmf16::h2u(__hfma2(gemmf16::u2h(gemmf16::nibble_pair_magic<1>(s1)), scH[i][1], biH[i][1]));
#pragma unroll
                for (int h = 0; h < NT; ++h) gemmf16::mma_f16<false>(tmp[h][i], A0, A1, A2, A3, bx[h].z, bx[h].w);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < NT; ++h) {
        const uint2 bs = hx[h] ? lds8(xg + 8 * h * vec_bytes(TYPE_Q4_K) + XS_OFF + 8 * t) : make_uint2(0u, 0u);
        const float2 inv = *reinterpret_cast<const float2 *>(xs + n_vec * vec_bytes(TYPE_Q4_K) + 32 * h + 8 * t);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float t2[4];
            gemmf16::mma_f16<true>(t2, mA[i][0], mA[i][1], mA[i][0], mA[i][1], bs.x, bs.y);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = fmaf(d[i][e >> 1], tmp[h][i][e], dm[i][e >> 1] * t2[e]);
                acc[h][i][e] = fmaf((e & 1) ? inv.y : inv.x, v, acc[h][i][e]);
            }
        }
    }
}

// Q6_K, one scale group (half C >> 1, quarter QQ, 16-value half C & 1): k16 step 4 C + QQ.
template <int C, int QQ, int NT>
__device__ __forceinline__ void q6_group(const uint4 (&qa)[2][2], const uint4 (&qb)[2][2], const uint4 (&qh)[2][2],
                                         const uint4 (&scw)[2][2], const uint32_t (&b0)[NT], const uint32_t (&b1)[NT],
                                         float (&s)[NT][2][4]) {
    constexpr int S = 8 * (C >> 1) + 2 * QQ + (C & 1);   // ggml's scale index
    const __half2 c1056 = __float2half2_rn(1056.0f);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t v = gemmf16::q6_bytes((QQ & 1) ? wd<C>(qb[i][r]) : wd<C>(qa[i][r]), wd<C>(qh[i][r]), QQ);
            a[r] = gemmf16::h2u(__hsub2(gemmf16::u2h(__byte_perm(v, 0x64646464u, gemmf16::SEL_LO)), c1056));
            a[2 + r] = gemmf16::h2u(__hsub2(gemmf16::u2h(__byte_perm(v, 0x64646464u, gemmf16::SEL_HI)), c1056));
        }
        float tq[NT][4];
#pragma unroll
        for (int h = 0; h < NT; ++h) gemmf16::mma_f16<true>(tq[h], a[0], a[1], a[2], a[3], b0[h], b1[h]);
        // signed scale bytes, stored XOR 0x80: (2^23 + 128 + sc) - (2^23 + 128). The constant is
        // PRMT's first operand (always a register, set once) so that the selector is the immediate:
        // the other order had ptxas move the selector into a register before every PRMT.
        const float sg = __uint_as_float(__byte_perm(0x4B000000u, wd<(S >> 2)>(scw[i][0]), 0x3004u | (S & 3))) - 8388736.0f;
        const float s8 = __uint_as_float(__byte_perm(0x4B000000u, wd<(S >> 2)>(scw[i][1]), 0x3004u | (S & 3))) - 8388736.0f;
#pragma unroll
        for (int h = 0; h < NT; ++h) {
            s[h][i][0] = fmaf(sg, tq[h][0], s[h][i][0]);
            s[h][i][1] = fmaf(sg, tq[h][1], s[h][i][1]);
            s[h][i][2] = fmaf(s8, tq[h][2], s[h][i][2]);
            s[h][i][3] = fmaf(s8, tq[h][3], s[h][i][3]);
        }
    }
}

// x0 / x1: the lane's 16 bytes of logical offsets 16 t and 64 + 16 t of vector g (x_swizzle
// applied); group C's are 128 C further; vector g + 8's (NT = 2, the same swizzle: the same parity)
// 8 slots on.
template <int C, int NT>
__device__ __forceinline__ void q6_groups(const uint4 (&qa)[2][2], const uint4 (&qb)[2][2], const uint4 (&qh)[2][2],
                                          const uint4 (&scw)[2][2], const uint8_t *x0, const uint8_t *x1,
                                          const bool (&hx)[NT], float (&s)[NT][2][4]) {
    uint4 b01[NT], b23[NT];
#pragma unroll
    for (int h = 0; h < NT; ++h) {
        b01[h] = hx[h] ? lds16(x0 + 8 * h * vec_bytes(TYPE_Q6_K) + 128 * C) : make_uint4(0u, 0u, 0u, 0u);
        b23[h] = hx[h] ? lds16(x1 + 8 * h * vec_bytes(TYPE_Q6_K) + 128 * C) : make_uint4(0u, 0u, 0u, 0u);
    }
    uint32_t p[8][NT];   // the four groups' B words (b0, b1) a vector tile
#pragma unroll
    for (int h = 0; h < NT; ++h) {
        p[0][h] = b01[h].x, p[1][h] = b01[h].y, p[2][h] = b01[h].z, p[3][h] = b01[h].w;
        p[4][h] = b23[h].x, p[5][h] = b23[h].y, p[6][h] = b23[h].z, p[7][h] = b23[h].w;
    }
    q6_group<C, 0, NT>(qa, qb, qh, scw, p[0], p[1], s);
    q6_group<C, 1, NT>(qa, qb, qh, scw, p[2], p[3], s);
    q6_group<C, 2, NT>(qa, qb, qh, scw, p[4], p[5], s);
    q6_group<C, 3, NT>(qa, qb, qh, scw, p[6], p[7], s);
}

template <int NT>
__device__ __forceinline__ void step_q6(const uint8_t *ws, const uint8_t *xs, int n_vec, int g, int t,
                                        const uint32_t (&par)[2][2], float (&acc)[NT][2][4]) {
    bool hx[NT];
#pragma unroll
    for (int h = 0; h < NT; ++h) hx[h] = g + 8 * h < n_vec;
    const uint8_t *xg = xs + g * vec_bytes(TYPE_Q6_K);
    const uint8_t *x0 = xg + q6_x_load(g, t, 0), *x1 = xg + q6_x_load(g, t, 1);
    uint4 qa[2][2], qb[2][2], qh[2][2], scw[2][2];
    float dq[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = 16 * i + g + 8 * r;
            const uint8_t *q = ws + row * 192 + 16 * t;
            qa[i][r] = lds16(q);
            qb[i][r] = lds16(q + 64);
            qh[i][r] = lds16(q + 128);
            uint4 sc = lds16(ws + ROWS * 192 + row * 16);
            sc.x ^= 0x80808080u;
            sc.y ^= 0x80808080u;
            sc.z ^= 0x80808080u;
            sc.w ^= 0x80808080u;
            scw[i][r] = sc;
            const uint32_t dw = *reinterpret_cast<const uint32_t *>(ws + ROWS * 208 + row * 4);
            dq[i][r] = gemm::half_bits(par[i][r] ? dw >> 16 : dw & 0xFFFFu);
        }
    float s[NT][2][4];
#pragma unroll
    for (int h = 0; h < NT; ++h)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[h][i][e] = 0.0f;
    q6_groups<0, NT>(qa, qb, qh, scw, x0, x1, hx, s);
    q6_groups<1, NT>(qa, qb, qh, scw, x0, x1, hx, s);
    q6_groups<2, NT>(qa, qb, qh, scw, x0, x1, hx, s);
    q6_groups<3, NT>(qa, qb, qh, scw, x0, x1, hx, s);
#pragma unroll
    for (int h = 0; h < NT; ++h) {
        const float2 inv = *reinterpret_cast<const float2 *>(xs + n_vec * vec_bytes(TYPE_Q6_K) + 32 * h + 8 * t);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[h][i][e] = fmaf(((e & 1) ? inv.y : inv.x) * dq[i][e >> 1], s[h][i][e], acc[h][i][e]);
    }
}

// Q6_K: which half of each compute row's d word is its d in super-block u's stage: the parity of
// the row's block index row * nb + u (par: of row * nb).
__device__ __forceinline__ void q6_parity(const uint32_t (&par)[2][2], int64_t u, uint32_t (&pr)[2][2]) {
    const uint32_t pu = (uint32_t)(u & 1);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) pr[i][r] = par[i][r] ^ pu;
}

// Bulk copies (sm_90): cp.async.bulk global -> shared, completing on an mbarrier's transaction
// count. The copy engine tracks them, not the SM's load path: with 16-byte cp.async the warps of a
// mid-size matvec spent a third of their stall samples in the block's first copies and another
// quarter waiting on registers still held by queued copies (ncu source counters, FFN group).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t su32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(su32(bar)), "r"(count));
}
__device__ __forceinline__ void bar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(su32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(su32(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(su32(dst)),
                 "l"(src), "r"(bytes), "r"(su32(bar))
                 : "memory");
}

// The barrier's next phase also waits for this thread's cp.async copies so far (one arrival each,
// counted in the barrier's init count: .noinc).
__device__ __forceinline__ void bar_cp_async_arrive(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(su32(bar)) : "memory");
}

// The main loop on the copy engine (stream_tma): the same stages, steps and step_q4 / step_q6 as
// the cp.async loop, a warp's ring with one mbarrier per stage, but each stage refilled as soon as
// its step is computed, so STAGES super-blocks are in flight while the warp waits (the cp.async
// loop refills after the next step's wait: STAGES - 1). Lane 0 arms a stage's barrier with
// its byte count and issues bulk copies of the row tile's super-block u, contiguous in the tiled
// layouts (quant_blocks.cuh; Q4_K: 4,608 bytes; Q6_K: the q plane's 6,144 and the scale plane's 512)
// and of the vectors' x and inverse scales. A copy instruction takes uniform operands: one copy per
// lane and row would be issued lane after lane (an ELECT loop of 32 per step). Q6_K's fp16 d of a
// row is 2 bytes of the row-major d plane, so each lane still copies its row's d word by cp.async,
// tied to the barrier by cp.async.mbarrier.arrive.noinc (init count 1 + 32).
template <int TYPE, int WARPS, int STAGES, int NT>
__device__ __forceinline__ void stream_tma(const Args &a, uint8_t *ring, int SB, uint64_t *bars, int m0, int64_t uw, int nj, int g,
                                           int t, int lane, const int64_t (&crow)[2], const uint32_t (&par)[2][2],
                                           float (&acc)[NT][2][4]) {
    constexpr bool Q6 = TYPE == TYPE_Q6_K;
    constexpr int W = w_bytes(TYPE), IB = 32 * NT;   // IB: the inverse scales' bytes (inv_bytes)
    const uint32_t xb = (uint32_t)a.n_vec * vec_bytes(TYPE), tx = (Q6 ? ROWS * 208 : W) + xb + IB;
    if (lane < STAGES) bar_init(bars + lane, Q6 ? 33 : 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
    const int64_t nb = a.w.K / QK_K;
    // the row tile's bytes at super-block 0 (rows past M: the last tile's zero blocks); super-block u
    // is u tile steps further (Q4_K: W bytes; Q6_K: ROWS x 192 of the q plane, ROWS x 16 of the scales)
    const uint8_t *wt, *sct = nullptr;
    if constexpr (Q6) {
        const Q6Planes p = q6_K_planes(a.w.M, a.w.K);
        wt = a.w.data + p.q + q6_K_q_offset(m0, 0, nb);
        sct = a.w.data + p.sc + q6_K_sc_offset(m0, 0, nb);
    } else {
        wt = a.w.data + q4_K_offset(m0, 0, nb);
    }
    // the weights of super-block u into stage st: lane 0's bulk copies, and for Q6_K each lane's d word
    auto issue_w = [&](uint8_t *st, uint64_t *bar, int64_t u) {
        if (lane == 0) {
            bar_expect_tx(bar, tx);
            if constexpr (Q6) {
                bulk(st, wt + u * (ROWS * 192), ROWS * 192, bar);
                bulk(st + ROWS * 192, sct + u * (ROWS * 16), ROWS * 16, bar);
            } else {
                bulk(st, wt + u * W, W, bar);
            }
        }
        if constexpr (Q6) {   // lane l: row 16 (l & 1) + l / 2, as issue_w
            const int half = lane & 1, row = 16 * half + (lane >> 1);
            const Q6Planes p = q6_K_planes(a.w.M, a.w.K);
            const int64_t bi = (half ? crow[1] : crow[0]) * nb + u, nblk = a.w.M * nb;
            uint8_t *dd = st + ROWS * 208 + row * 4;
            if ((bi | 1) < nblk) cp4(dd, a.w.data + p.d + (bi & ~int64_t(1)) * 2);
            else   // the plane's last entry at an even index: its word would reach past the plane
                *reinterpret_cast<uint32_t *>(dd) = __ldg(reinterpret_cast<const unsigned short *>(a.w.data + p.d + bi * 2));
            bar_cp_async_arrive(bar);
        }
    };
    // Every stage is filled before the first wait, and a stage is refilled as soon as the warp has
    // read it (after the step's compute, not after the next step's wait): a warp keeps STAGES
    // super-blocks in flight while it waits, not STAGES - 1, and the weights of the first STAGES
    // of them stream while the prep before runs.
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
        if (s < nj) issue_w(ring + s * SB, bars + s, uw + (int64_t)s * WARPS);
    pdl_wait();   // the prep grid's x
    if (lane == 0)
#pragma unroll
        for (int s = 0; s < STAGES; ++s)
            if (s < nj) {
                const uint8_t *rec = a.xp + (uw + (int64_t)s * WARPS) * REC;
                bulk(ring + s * SB + W, rec, xb, bars + s);
                bulk(ring + s * SB + W + xb, rec + INV_OFF, IB, bars + s);
            }
    int64_t un = uw + (int64_t)STAGES * WARPS;   // the super-block of the next refill
    const uint8_t *xn = a.xp + un * REC;
    uint32_t ph = 0;   // bit s: the parity stage s's barrier completes next
    int rd = 0;        // the ring stage of step j (refilled with step j + STAGES once read)
    for (int j = 0; j < nj; ++j) {
        bar_wait(bars + rd, (ph >> rd) & 1u);
        ph ^= 1u << rd;
        uint8_t *st = ring + rd * SB;
        if constexpr (Q6) {
            uint32_t pr[2][2];
            q6_parity(par, uw + j * WARPS, pr);
            step_q6<NT>(st, st + W, a.n_vec, g, t, pr, acc);
        } else {
            step_q4<NT>(st, st + W, a.n_vec, g, t, acc);
        }
        __syncwarp();   // every lane is past its reads of the stage
        if (j + STAGES < nj) {
            if (lane == 0) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // generic reads, then async writes
            issue_w(st, bars + rd, un);
            if (lane == 0) {
                bulk(st + W, xn, xb, bars + rd);
                bulk(st + W + xb, xn + INV_OFF, IB, bars + rd);
            }
            un += WARPS;
            xn += WARPS * REC;
        }
        rd = rd == STAGES - 1 ? 0 : rd + 1;
    }
    // every phase armed has completed (the loop waited on each)
    if (lane < STAGES) asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(su32(bars + lane)) : "memory");
}
#endif

// Args::ssq: the sums of squares of the tile's final y rows, per vector ([tile][16]), once its block
// has written them (the residual a norm prep reads next: PrepIn::ssq). fin: the same final values
// as the block stored them to y, staged in shared memory ([vector][32 rows]), so the sums wait for
// no read of y back from L2. Warp v sums vector v's 32 rows by the xor tree. Not inlined: its
// registers stay out of the main loop's count. Scalars, not the block's Args: a reference to its
// local copy would make the main loop keep one.
__device__ __noinline__ void tile_ssq(const float *fin, int64_t n_out, int n_vec, float *ssq, int64_t m0, int64_t tile) {
    __syncthreads();   // the block's staged values, visible to the whole block
    const int lane = threadIdx.x & 31;
    for (int v = threadIdx.x >> 5; v < n_vec; v += blockDim.x >> 5) {
        const int64_t o = m0 + lane;
        const float y = o < n_out ? fin[v * ROWS + lane] : 0.0f;
        const float t = warp_sum(y * y);
        if (lane == 0) ssq[tile * SSQ_VEC + v] = t;
    }
}

// TMA: the stream_tma loop (launched on sm_90+ only; the instance holds no cp.async loop, and the
// cp.async instance no copy-engine loop, so neither pays the other's registers).
// Block `bid` of a launch over args (matvec_kernel: blockIdx.x).
// smem: the block's dynamic shared memory (smem_bytes).
// NT: vector tiles (1: 1..8 vectors, 2: 9..16; vec_tiles).
template <int TYPE, int WARPS, int STAGES, bool TMA, int NT>
__device__ __forceinline__ void matvec_block(const Args &args, unsigned bid, uint8_t *smem) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int S = args.split;
    const int64_t tile = (int64_t)(bid / (unsigned)S);   // the launch's row tile: counters, slots
    const int sp = (int)(bid - (unsigned)tile * (unsigned)S);   // this block's split, 0..S-1
    // the member this tile belongs to (a plain call: the only one), and the tile within it
    Args a = args;
    int64_t mtile = tile;
    for (int i = 0; i < args.n_more; ++i)
        if (tile >= args.more.tile0[i]) {
            a.w = args.more.w[i];
            a.y = args.more.y[i];
            a.n_out = args.more.n_out[i];
            mtile = tile - args.more.tile0[i];
        }
    const int64_t m0 = mtile * ROWS;
    const int64_t nb = a.w.K / QK_K;
    const int64_t u0 = (int64_t)sp * nb / S, len = (int64_t)(sp + 1) * nb / S - u0;   // super-blocks [u0, u0 + len)
    const int SB = stage_bytes(TYPE, a.n_vec);
    uint8_t *ring = smem + (size_t)warp * STAGES * SB;
    auto src_row = [&](int64_t o) -> int64_t {   // rows past the end compute a copy, never written
        if (o >= a.n_out) o = a.n_out - 1;
        return a.rows ? (int64_t)a.rows[o] : o;
    };
    int64_t crow[2];   // copy rows of this lane, mma tiles 0 and 1
#pragma unroll
    for (int r = 0; r < 2; ++r) crow[r] = src_row(m0 + 16 * r + (lane >> 1));
    // Q6_K: parity of each compute row's block index base (which half of the d word is its d)
    uint32_t par[2][2] = {{0u, 0u}, {0u, 0u}};
    if constexpr (TYPE == TYPE_Q6_K)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r) par[i][r] = (uint32_t)((src_row(m0 + 16 * i + g + 8 * r) * nb) & 1);
    float acc[NT][2][4];
#pragma unroll
    for (int h = 0; h < NT; ++h)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[h][i][e] = 0.0f;

    const int64_t J = warp < len ? (len - warp + WARPS - 1) / WARPS : 0;   // this warp's super-blocks
    const int64_t uw = u0 + warp;                                          // its first
    const int nj = (int)J;   // <= nb / WARPS + 1: an int step counter and ring indices below
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (TMA) {
        uint64_t *bars = reinterpret_cast<uint64_t *>(smem + (size_t)WARPS * STAGES * SB) + warp * STAGES;
        stream_tma<TYPE, WARPS, STAGES, NT>(a, ring, SB, bars, (int)m0, uw, nj, g, t, lane, crow, par, acc);
    } else
#endif
    {
    // prologue: weights of the first STAGES - 1 steps, then (after the prep grid) their x
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < J) {
            const int64_t u = uw + (int64_t)s * WARPS;
            issue_w<TYPE>(a, ring + s * SB, src_at<TYPE>(a, crow, u, lane), lane);
        }
    pdl_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < J) issue_x<TYPE, NT>(a, ring + s * SB + w_bytes(TYPE), a.xp + (uw + (int64_t)s * WARPS) * REC, g, t, lane);
    gemm::cp_commit();
#pragma unroll
    for (int s = 1; s < STAGES - 1; ++s) gemm::cp_commit();   // empty groups keep the count

    // the loop's copies: step jn = j + STAGES - 1 reads super-block uw + jn * WARPS
    Src nxt = src_at<TYPE>(a, crow, uw + (int64_t)(STAGES - 1) * WARPS, lane);
    int rd = 0, wr = STAGES - 1;   // ring stages of steps j and j + STAGES - 1
    for (int j = 0; j < nj; ++j) {
        gemm::cp_wait<STAGES - 2>();
        __syncwarp();   // every lane's copies of step j landed; step j - 1's stage is free
        if (j + STAGES - 1 < nj) {
            uint8_t *st = ring + wr * SB;
            issue_w<TYPE>(a, st, nxt, lane);
            issue_x<TYPE, NT>(a, st + w_bytes(TYPE), nxt.x, g, t, lane);
            advance<TYPE, WARPS>(nxt);
        }
        gemm::cp_commit();
        const uint8_t *st = ring + rd * SB;
        if constexpr (TYPE == TYPE_Q4_K) {
            step_q4<NT>(st, st + w_bytes(TYPE), a.n_vec, g, t, acc);
        } else {
            uint32_t pr[2][2];
            q6_parity(par, uw + j * WARPS, pr);
            step_q6<NT>(st, st + w_bytes(TYPE), a.n_vec, g, t, pr, acc);
        }
        rd = rd == STAGES - 1 ? 0 : rd + 1;
        wr = wr == STAGES - 1 ? 0 : wr + 1;
        __syncwarp();
    }
    }
    gemm::cp_wait<0>();
    __syncthreads();
    // partial sums of the warps meet in shared memory; summed in warp order (deterministic)
    constexpr int NS = 8 * NT;   // accumulators a lane: [vector tile][row tile][4]
    float *red = reinterpret_cast<float *>(smem);
#pragma unroll
    for (int s = 0; s < NS; ++s) red[(warp * NS + s) * 32 + lane] = acc[s >> 3][(s >> 2) & 1][s & 3];
    __syncthreads();
    float *slot = a.part + (size_t)bid * SLOT_FLOATS;   // split: this block's partial [16][32]
    float *fin = red + WARPS * NS * 32;                // args.ssq: the final y values [n_vec][32]
    for (int idx = threadIdx.x; idx < 32 * NS; idx += 32 * WARPS) {
        const int s = idx >> 5, ln = idx & 31;
        float v = 0.0f;
#pragma unroll
        for (int wi = 0; wi < WARPS; ++wi) v += red[(wi * NS + s) * 32 + ln];
        const int i = (s >> 2) & 1, e = s & 3, gg = ln >> 2, tt = ln & 3;
        const int r = 16 * i + gg + 8 * (e >> 1);   // row in the tile
        const int64_t o = m0 + r;
        const int vec = 8 * (s >> 3) + 2 * tt + (e & 1);
        if (vec < a.n_vec && o < a.n_out) {
            if (S == 1) {
                float *dst = a.y + (int64_t)vec * a.n_out + o;
                const float f = a.accumulate ? *dst + v : v;
                *dst = f;
                fin[vec * ROWS + r] = f;
            } else {
                __stcg(slot + vec * ROWS + r, v);
            }
        }
    }
    if (S == 1) {   // uniform over the grid
        if (args.ssq) tile_ssq(fin, args.n_out, args.n_vec, args.ssq, m0, tile);
        return;
    }
    // Split-K: the last of the tile's S blocks to arrive sums the S slots in split order. Release:
    // every thread fences its slot stores (gpu scope) before the barrier, then one atomic; acquire:
    // thread 0 fences after the atomic that saw the other S - 1 arrivals, and the barrier orders
    // the block's slot loads after it. The loads go to L2 (ld.global.cg): L1 is not coherent.
    __threadfence();
    __syncthreads();
    bool last = false;
    if (threadIdx.x == 0) {
        last = atomicAdd(a.count + tile, 1u) == (uint32_t)(S - 1);
        if (last) a.count[tile] = 0u;   // every arrival of this call is in; the next call starts from 0
        __threadfence();
    }
    if (!__syncthreads_or(last)) return;
    const float *slots = a.part + (size_t)tile * S * SLOT_FLOATS;
    for (int idx = threadIdx.x; idx < 32 * NS; idx += 32 * WARPS) {
        const int vec = idx >> 5, r = idx & 31;   // consecutive threads: consecutive rows
        const int64_t o = m0 + r;
        if (vec < a.n_vec && o < a.n_out) {
            float v = 0.0f;
            for (int q = 0; q < S; ++q) v += __ldcg(slots + (size_t)q * SLOT_FLOATS + vec * ROWS + r);
            float *dst = a.y + (int64_t)vec * a.n_out + o;
            const float f = a.accumulate ? *dst + v : v;
            *dst = f;
            fin[vec * ROWS + r] = f;
        }
    }
    if (args.ssq) tile_ssq(fin, args.n_out, args.n_vec, args.ssq, m0, tile);
}

template <int TYPE, int WARPS, int STAGES, bool TMA, int NT>
__global__ void __launch_bounds__(32 * WARPS) matvec_kernel(const __grid_constant__ Args args) {
    pdl_launch_dependents();   // the next kernel waits (pdl_wait) for this whole grid
    extern __shared__ __align__(128) uint8_t smem[];
    matvec_block<TYPE, WARPS, STAGES, TMA, NT>(args, blockIdx.x, smem);
}

// ---------------------------------------------------------------------------------------------
// host side

inline bool supports(int type) { return type == TYPE_Q4_K || type == TYPE_Q6_K; }

// What prep, run and run_group take: a type with a kernel, K a positive multiple of 256, 1..16 vectors.
inline void check_call(int type, int64_t K, int n_vec) {
    if (!supports(type)) fail(OJ_ERR_UNSUPPORTED, std::string("matvec_f16: no kernel for type ") + type_name(type));
    if (K <= 0 || K % QK_K) fail(OJ_ERR_UNSUPPORTED, "matvec_f16: K must be a positive multiple of 256, got " + std::to_string(K));
    if (n_vec < 1 || n_vec > MAX_VEC) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_f16: vector count must be 1..16, got " + std::to_string(n_vec));
}


// x [n_vec][K] fp32 -> the workspace, in the k order of `type` (Q4_K and Q6_K orders differ; both:
// also in the other type's order, region 1 for run / run_group); also zeroes the workspace's
// split-K arrival counters.
inline void prep(int type, const PrepIn &in, int64_t K, int n_vec, void *ws, cudaStream_t st, bool both = false) {
    check_call(type, K, n_vec);
    const dim3 grid((unsigned)(K / QK_K), (unsigned)vec_tiles(n_vec));   // a block per super-block and 8 vectors
    uint8_t *w = static_cast<uint8_t *>(ws);
    check_cuda(type == TYPE_Q4_K ? oj::launch(prep_kernel<TYPE_Q4_K>, grid, 256, 0, st, in, K, n_vec, w, both)
                                 : oj::launch(prep_kernel<TYPE_Q6_K>, grid, 256, 0, st, in, K, n_vec, w, both),
               "matvec_f16: prep");
}
inline void prep(int type, const float *x, int64_t K, int n_vec, void *ws, cudaStream_t st) {
    PrepIn in;
    in.x = x;
    prep(type, in, K, n_vec, ws, st);
}

// Per device (a process may drive several; cudaFuncSetAttribute acts on the current device only).
struct Device {
    int id = 0, n_sm = 0, smem_sm = 0, optin = 0;
    bool pdl = false;
};
inline Device device() {
    static std::mutex mu;
    static std::map<int, Device> devs;
    int dev = 0;
    check_cuda(cudaGetDevice(&dev), "matvec_f16: cudaGetDevice");
    std::lock_guard<std::mutex> lock(mu);
    auto it = devs.find(dev);
    if (it != devs.end()) return it->second;
    Device v;
    int major = 0;
    v.id = dev;
    check_cuda(cudaDeviceGetAttribute(&v.n_sm, cudaDevAttrMultiProcessorCount, dev), "matvec_f16: SM count");
    check_cuda(cudaDeviceGetAttribute(&v.smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), "matvec_f16: smem/SM");
    check_cuda(cudaDeviceGetAttribute(&v.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "matvec_f16: smem/block");
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "matvec_f16: capability");
    v.pdl = major >= 9;
    devs[dev] = v;
    return v;
}

// Once per (kernel, device): the shared-memory attribute (the launch and the occupancy query need
// it), and whether the loaded code has the griddepcontrol.wait (compiled for compute_90+; code
// built for an older target and JIT-run on sm_90 has none, and an early start would read x before
// the prep wrote it).
template <int TYPE, int WARPS, int STAGES, bool TMA, int NT = 1>
inline bool setup(const Device &d) {
    static std::mutex mu;
    static std::map<int, bool> waits_of;
    std::lock_guard<std::mutex> lock(mu);
    auto it = waits_of.find(d.id);
    if (it == waits_of.end()) {
        check_cuda(cudaFuncSetAttribute(matvec_kernel<TYPE, WARPS, STAGES, TMA, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        d.optin),
                   "matvec_f16: shared-memory attribute");
        cudaFuncAttributes fa;
        check_cuda(cudaFuncGetAttributes(&fa, matvec_kernel<TYPE, WARPS, STAGES, TMA, NT>), "matvec_f16: kernel attributes");
        it = waits_of.emplace(d.id, fa.ptxVersion >= 90).first;
    }
    return it->second;
}

template <int TYPE, int WARPS, int STAGES>
inline size_t smem_bytes(int n_vec) {
    // the rings (the block reduction and the final values for tile_ssq reuse their start), then a
    // mbarrier per stage and warp
    return std::max<size_t>((size_t)WARPS * STAGES * stage_bytes(TYPE, n_vec), (size_t)(WARPS + 1) * 8 * vec_tiles(n_vec) * 32 * 4) +
           (size_t)WARPS * STAGES * 8;
}

// Both types stream on the copy engine on sm_90+ (measured 2026-11-30: the 27B's grouped
// projections 4.92 ms against 5.15 with Q6_K on cp.async and 6.86 with both there); the cp.async
// loop stays for older GPUs and for calls that gather rows (a bulk copy cannot).
inline bool tma_for(int type) { return type == TYPE_Q4_K || type == TYPE_Q6_K; }

template <int TYPE, int WARPS, int STAGES, int NT = 1>
inline void launch_cfg(const Args &a, int64_t tiles, const Device &d, bool pdl, cudaStream_t st) {
    // the copy engine: sm_90 code on a cc 9.0+ device, rows in order (a bulk copy cannot gather)
    const bool tma = d.pdl && !a.rows && tma_for(TYPE) && setup<TYPE, WARPS, STAGES, true, NT>(d);
    const bool waits = tma || setup<TYPE, WARPS, STAGES, false, NT>(d);
    const size_t smem = smem_bytes<TYPE, WARPS, STAGES>(a.n_vec);
    Args b = a;
    b.tma = tma;
    const int64_t blocks = tiles * a.split;
    const bool with_pdl = pdl && d.pdl && waits;
    const cudaError_t e =
        blocks > 0x7FFFFFFF ? cudaErrorInvalidConfiguration
        : tma ? launch_pdl_if(with_pdl, matvec_kernel<TYPE, WARPS, STAGES, true, NT>, dim3((unsigned)blocks), dim3(32 * WARPS), smem, st, b)
              : launch_pdl_if(with_pdl, matvec_kernel<TYPE, WARPS, STAGES, false, NT>, dim3((unsigned)blocks), dim3(32 * WARPS), smem, st, b);
    if (e != cudaSuccess)   // the launch's whole configuration, so a first failure is diagnosable
        check_cuda(e, ("matvec_f16: launch (type " + std::to_string(TYPE) + ", " + std::to_string(WARPS) + " warps, " +
                       std::to_string(STAGES) + " stages, split " + std::to_string(a.split) + ", " +
                       std::to_string(a.n_vec) + " vectors, grid " + std::to_string(blocks) + ", " + std::to_string(smem) +
                       " bytes of shared memory of " + std::to_string(d.optin) + ", PDL " + std::to_string(with_pdl) +
                       ", copy engine " + std::to_string(tma) + ")")
                          .c_str());
}

// Resident blocks per SM of a kernel at `threads` threads and `smem` bytes of shared memory (the
// occupancy calculator: registers, shared memory, its per-block reserve), cached per (kernel,
// device, bytes).
inline int occupancy(const void *kernel, const Device &d, int threads, size_t smem) {
    static std::mutex mu;
    static std::map<std::tuple<const void *, int, size_t>, int> cache;
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple(kernel, d.id, smem);
    auto it = cache.find(key);
    if (it == cache.end()) {
        int n = 0;
        check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem), "matvec_f16: occupancy");
        it = cache.emplace(key, std::max(n, 1)).first;
    }
    return it->second;
}

// Resident blocks per SM of one configuration at n_vec vectors: of the copy-engine instance where
// the type streams there (calls gathering rows take the other).
template <int TYPE, int WARPS, int STAGES>
inline int resident_cfg(const Device &d, int n_vec) {
    const size_t smem = smem_bytes<TYPE, WARPS, STAGES>(n_vec);
    const bool tma = d.pdl && tma_for(TYPE) && setup<TYPE, WARPS, STAGES, true>(d);
    if (!tma) setup<TYPE, WARPS, STAGES, false>(d);
    return occupancy(tma ? reinterpret_cast<const void *>(matvec_kernel<TYPE, WARPS, STAGES, true, 1>)
                         : reinterpret_cast<const void *>(matvec_kernel<TYPE, WARPS, STAGES, false, 1>),
                     d, 32 * WARPS, smem);
}
template <int TYPE>
inline int resident_type(const Device &d, int warps, int stages, int n_vec) {
    if (warps == 8) return stages == 3 ? resident_cfg<TYPE, 8, 3>(d, n_vec) : resident_cfg<TYPE, 8, 2>(d, n_vec);
    return stages == 3 ? resident_cfg<TYPE, 4, 3>(d, n_vec) : resident_cfg<TYPE, 4, 2>(d, n_vec);
}
inline int resident(const Device &d, int type, int warps, int stages, int n_vec) {
    return type == TYPE_Q4_K ? resident_type<TYPE_Q4_K>(d, warps, stages, n_vec)
                             : resident_type<TYPE_Q6_K>(d, warps, stages, n_vec);
}

// Configuration. Warps: 4; OJ_MVF16_CFG="warps,stages" forces a pair (kept for
// tools/matvec_f16_bench.cu, which checks every configuration the picker can choose through both
// copies of this header it runs, its own and matvec.cu's: the engine's users never set these two). Stages (Q4_K on the copy
// engine: 2, see stages_for): 3 when two blocks still fit an SM's shared memory, else 2. Split S (blocks per row tile): auto_split below;
// OJ_MVF16_SPLIT=n forces n (clamped to 1..nb and to MAX_SLOTS slots); forced to 1 it also brings
// back the unsplit rule for the warps (8 when the grid alone leaves SMs idle and K has >= 16
// super-blocks), i.e. this kernel as it was before split-K, for comparisons.
// The warp count and S set the summation order, so they depend on the shape and device only, never
// on n_vec (decided on 8 vectors' stages and occupancy where it matters): 1..16 vectors stay
// bit-identical on every device. The stage count may follow n_vec (it does not change the order).
struct Config { int warps, stages, split; };

// A type on the copy engine (stream_tma): 2 stages, for a fourth block per SM (the group harness
// at 8984bbb, every group faster forced to 4 warps x 2 stages: DeltaNet 26.4 vs 31.0 us, attention
// 24.8 vs 30.6, FFN 44.6 vs 45.8).
inline int stages_for(const Device &d, int type, int warps, size_t sb, int forced) {
    const size_t s3 = (size_t)warps * 3 * sb;
    const bool tma = d.pdl && tma_for(type);
    int st = forced ? forced : !tma && s3 <= (size_t)d.optin && 2 * (s3 + 1024) <= (size_t)d.smem_sm ? 3 : 2;
    if ((size_t)warps * st * sb > (size_t)d.optin) st = 2;
    return st;
}

// The split model: a row tile's S blocks stream nb / S super-blocks each, a warp ceil(nb / S /
// warps) of them; what bounds a mid-size call is that chain per warp (each step is latency-bound
// with few warps per SM), times the number of waves of `slots` resident blocks the grid needs (a
// ragged last wave costs a whole block time). Per block a fixed cost of SPLIT_FILL steps (the first
// loads, the block reduction) and, split, SPLIT_MEET more (fence, atomic, the last block's L2 reads).
// The resident-block count depends on n_vec through the shared memory, so S minimises the sum of
// the modelled times relative to their optimum at 8 vectors' and at 1 vector's occupancy.
constexpr double SPLIT_FILL = 1.0, SPLIT_MEET = 0.5;
inline double split_cost(int64_t tiles, int64_t nb, int warps, int S, int64_t slots) {
    const int64_t waves = (tiles * S + slots - 1) / slots;
    const int64_t per_warp = ((nb + S - 1) / S + warps - 1) / warps;
    return (double)waves * ((double)per_warp + SPLIT_FILL + (S > 1 ? SPLIT_MEET : 0.0));
}
inline int auto_split(int64_t tiles, int64_t nb, int warps, int n_sm, int res_lo, int res_hi) {
    const int64_t lo = (int64_t)n_sm * res_lo, hi = (int64_t)n_sm * std::max(res_lo, res_hi);
    if (tiles >= 4 * lo) return 1;   // four waves or more: the tail is small already
    // every warp at least one super-block; the partial slots; a sane bound on the loop
    const int smax = (int)std::min<int64_t>({std::max<int64_t>(1, nb / warps), MAX_SLOTS / tiles, 64});
    double best_lo = 1e300, best_hi = 1e300;
    for (int S = 1; S <= smax; ++S) {
        best_lo = std::min(best_lo, split_cost(tiles, nb, warps, S, lo));
        best_hi = std::min(best_hi, split_cost(tiles, nb, warps, S, hi));
    }
    int pick_s = 1;
    double pick_c = 1e300;
    for (int S = 1; S <= smax; ++S) {
        const double c = split_cost(tiles, nb, warps, S, lo) / best_lo + split_cost(tiles, nb, warps, S, hi) / best_hi;
        if (c < pick_c - 1e-9) pick_c = c, pick_s = S;   // ties: the smaller S
    }
    return pick_s;
}

inline Config decide(const Device &d, int type, int64_t n_out, int64_t K, int n_vec, const Config &forced) {
    const int64_t tiles = (n_out + ROWS - 1) / ROWS, nb = K / QK_K;
    const size_t sb = (size_t)stage_bytes(type, n_vec), sb1 = (size_t)stage_bytes(type, 1), sb8 = (size_t)stage_bytes(type, 8);
    Config c = {0, 0, 0};
    c.warps = forced.warps ? forced.warps : forced.split == 1 && tiles < d.n_sm && nb >= 16 ? 8 : 4;
    if ((size_t)c.warps * 2 * sb8 > (size_t)d.optin) c.warps = 4;   // 8 vectors' 2 stages must fit
    c.stages = stages_for(d, type, c.warps, sb, forced.stages);
    if (n_vec > 8) {   // two vector tiles: one instance, 4 warps x 2 stages (the same warps and split as 1..8 vectors)
        if (c.warps != 4)
            fail(OJ_ERR_UNSUPPORTED, "matvec_f16: 9..16 vectors run at 4 warps, this shape's configuration has " +
                                         std::to_string(c.warps) + " (a forced OJ_MVF16_CFG / OJ_MVF16_SPLIT=1)");
        c.stages = 2;
    }
    if ((size_t)c.warps * c.stages * sb > (size_t)d.optin)
        fail(OJ_ERR_UNSUPPORTED, "matvec_f16: the device's shared memory per block is too small");
    if (forced.split) {
        c.split = forced.split;
    } else {
        const int res8 = resident(d, type, c.warps, stages_for(d, type, c.warps, sb8, forced.stages), 8);
        const int res1 = resident(d, type, c.warps, stages_for(d, type, c.warps, sb1, forced.stages), 1);
        c.split = auto_split(tiles, nb, c.warps, d.n_sm, res8, res1);
    }
    c.split = (int)std::min<int64_t>(c.split, nb);                                  // no empty split
    if (c.split > 1 && tiles * c.split > MAX_SLOTS) c.split = (int)std::max<int64_t>(1, MAX_SLOTS / tiles);
    return c;
}

// decide() once per (device, type, shape, n_vec, forced values): a decode pass makes ~500 calls of a
// dozen shapes, and the split model and occupancy lookups need not run again for each. The
// overrides are read every call (the harness changes them between checks).
inline Config pick(const Device &d, int type, int64_t n_out, int64_t K, int n_vec) {
    Config forced = {0, 0, 0};
    if (const char *e = std::getenv("OJ_MVF16_CFG")) {
        int w = 0, s = 0;
        if (std::sscanf(e, "%d,%d", &w, &s) == 2 && (w == 4 || w == 8) && (s == 2 || s == 3)) forced.warps = w, forced.stages = s;
    }
    if (const char *e = std::getenv("OJ_MVF16_SPLIT")) {
        int n = 0;
        if (std::sscanf(e, "%d", &n) == 1 && n >= 1) forced.split = n;
    }
    using Key = std::tuple<int, int, int64_t, int64_t, int, int, int, int>;
    static std::mutex mu;
    static std::map<Key, Config> decided;
    const Key key{d.id, type, n_out, K, n_vec, forced.warps, forced.stages, forced.split};
    {
        std::lock_guard<std::mutex> lock(mu);
        auto it = decided.find(key);
        if (it != decided.end()) return it->second;
    }
    const Config c = decide(d, type, n_out, K, n_vec, forced);   // outside the lock: it takes others
    std::lock_guard<std::mutex> lock(mu);
    return decided.emplace(key, c).first->second;
}

// The launch at c's warps and stages.
template <int TYPE>
inline void launch_type(const Args &a, int64_t tiles, const Config &c, const Device &d, bool pdl, cudaStream_t st) {
    if (a.n_vec > 8) {   // decide() gave 4 warps x 2 stages
        launch_cfg<TYPE, 4, 2, 2>(a, tiles, d, pdl, st);
        return;
    }
    if (c.warps == 8) {
        if (c.stages == 3) launch_cfg<TYPE, 8, 3>(a, tiles, d, pdl, st);
        else launch_cfg<TYPE, 8, 2>(a, tiles, d, pdl, st);
    } else {
        if (c.stages == 3) launch_cfg<TYPE, 4, 3>(a, tiles, d, pdl, st);
        else launch_cfg<TYPE, 4, 2>(a, tiles, d, pdl, st);
    }
}

// The configuration run() takes for this call (harnesses print it).
inline Config config_for(int type, int64_t n_out, int64_t K, int n_vec) { return pick(device(), type, n_out, K, n_vec); }

// The launch's arguments over workspace ws for matrix w (a group's first member) writing y; the
// caller adds the other members, then launch() decides the split.
inline Args args_for(const Matrix &w, void *ws, float *y, const int32_t *rows, int64_t n_out, int n_vec, bool accumulate) {
    uint8_t *base = static_cast<uint8_t *>(ws);
    Args a;
    a.w = w;
    a.xp = base + XP_OFF;
    a.y = y;
    a.rows = rows;
    a.part = reinterpret_cast<float *>(base + PART_OFF);
    a.count = reinterpret_cast<uint32_t *>(base);
    a.n_out = n_out;
    a.n_vec = n_vec;
    a.accumulate = accumulate;
    a.n_more = 0;
    a.tma = false;   // launch_cfg decides
    a.ssq = nullptr;
    return a;
}

// The configuration for `rows` output rows of a.w's type and K (a group: all its members' row
// tiles, as one tall matrix), then the launch over their row tiles.
inline void launch(Args &a, int64_t rows, bool pdl, cudaStream_t st) {
    const Device d = device();
    const Config c = pick(d, a.w.type, rows, a.w.K, a.n_vec);
    a.split = c.split;
    const int64_t tiles = (rows + ROWS - 1) / ROWS;
    if (a.w.type == TYPE_Q4_K) launch_type<TYPE_Q4_K>(a, tiles, c, d, pdl, st);
    else launch_type<TYPE_Q6_K>(a, tiles, c, d, pdl, st);
}

// y[v][o] (+)= W[rows ? rows[o] : o] . x[v] from an already prepared workspace (prep with w.type's
// order, the same K and n_vec; region 1: a prep of the other type with `both`; run writes the
// workspace's split-K region). pdl: the previous kernel on the stream is the prep, or a matvec on
// the same workspace after it (sm_90: the weight loads start before it finishes).
inline void run(const Matrix &w, void *ws, float *y, int n_vec, bool accumulate, const int32_t *rows,
                int64_t n_out, bool pdl, cudaStream_t st, int region = 0, float *ssq = nullptr) {
    check_call(w.type, w.K, n_vec);
    if (n_out <= 0) return;
    Args a = args_for(w, ws, y, rows, n_out, n_vec, accumulate);
    a.xp += region * (w.K / QK_K) * REC;
    if (ssq && !rows) a.ssq = ssq;   // ssq: [tiles][SSQ_VEC] floats
    launch(a, n_out, pdl, st);
}

// The Args of the n (1..GROUP_MAX) matrices of one type and one K reading one prepared x from
// workspace ws: the members' row tiles one after the other (run_group); tiles: their
// sum. The split and the copy engine are the caller's.
inline Args group_args(const Matrix *w, float *const *y, int n, void *ws, int n_vec, bool accumulate, int64_t &tiles) {
    if (n < 1 || n > GROUP_MAX) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_f16: a group holds 1.." + std::to_string(GROUP_MAX) + " matrices");
    check_call(w[0].type, w[0].K, n_vec);
    int64_t tile0[GROUP_MAX];
    tiles = 0;
    for (int i = 0; i < n; ++i) {
        if (w[i].type != w[0].type || w[i].K != w[0].K)
            fail(OJ_ERR_INVALID_ARGUMENT, "matvec_f16: a group's matrices must share type and K");
        if (w[i].M <= 0) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_f16: a group member has no rows");
        tile0[i] = tiles;
        tiles += (w[i].M + ROWS - 1) / ROWS;
    }
    Args a = args_for(w[0], ws, y[0], nullptr, w[0].M, n_vec, accumulate);
    a.n_more = n - 1;
    for (int i = 1; i < n; ++i) {
        a.more.w[i - 1] = w[i];
        a.more.y[i - 1] = y[i];
        a.more.n_out[i - 1] = w[i].M;
        a.more.tile0[i - 1] = tile0[i];
    }
    return a;
}

// y_i[v][:] = W_i x[v] for the n (2..GROUP_MAX) matrices of one type and one K that read the same x
// (a layer's projections of one normed input), from one prepared workspace, in ONE launch: the
// members' row tiles one after the other in the grid, the split decided on their sum. Each output
// is what run() gives for that matrix alone at the group's split (the split sets the summation
// order, the group only which blocks run together).
inline void run_group(const Matrix *w, float *const *y, int n, void *ws, int n_vec, bool pdl, cudaStream_t st,
                      int region = 0) {
    if (n < 2) fail(OJ_ERR_INVALID_ARGUMENT, "matvec_f16: a group holds 2.." + std::to_string(GROUP_MAX) + " matrices");
    int64_t tiles = 0;
    Args a = group_args(w, y, n, ws, n_vec, false, tiles);
    a.xp += region * (w[0].K / QK_K) * REC;
    launch(a, tiles * ROWS, pdl, st);   // the group as one tall matrix
}

}  // namespace mvf16

// Bytes of workspace for K (the split-K region, a fixed ~4 MB, then twice K / 256 records of prepared x).
inline size_t matvec_f16_workspace_bytes(int64_t K) { return mvf16::workspace_bytes(K); }

// y (+)= W x for 1..16 vectors, Q4_K / Q6_K: prep + matvec (the matvec overlapping the prep's tail
// on sm_90). The workspace must hold matvec_f16_workspace_bytes(w.K), belong to this stream while
// the call runs, and need not be initialised (the prep zeroes what must start at 0).
inline void matvec_f16(const Matrix &w, const float *x, float *y, int n_vec, bool accumulate, void *ws,
                       cudaStream_t st) {
    mvf16::prep(w.type, x, w.K, n_vec, ws, st);
    mvf16::run(w, ws, y, n_vec, accumulate, nullptr, w.M, true, st);
}

}  // namespace
}  // namespace oj
