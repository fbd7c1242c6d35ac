// attention_prefill.cu: qwen35's gated attention for many positions at once (prefill), on the
// fp16 tensor cores: causal flash attention over the KV cache, then the sigmoid output gate.
//
// Math, for query position i (absolute position p = pos0 + i) and query head h, KV head
// g = h / (n_head / n_head_kv):
//   out[i][h][:] = sum_{j <= p} softmax_j(q_i . k_j / sqrt(D)) v_j * sigmoid(gate[i][h][:])
// q_i = q_rot[i][h] (normed + roped by attention_prepare_kernel), gate = qg[i][h][1][:], k_j / v_j
// cache rows of KV head g (fp16, or q8_0 quant * fp16 scale per 32 values: engine.cuh's Layer).
//
// Why not the decode kernels: attention_partial reads every cached K/V row once per (query
// position, query head): at depth 30K with 2048 new positions and 24 heads that is
// 2048 * 24 * 30K * 256 dims * 2 (K, V) * 2 bytes ~ 1.5 TB per layer. Here a K/V tile is read
// once per (16-position query tile, KV head) and used by the GQA group's heads together
// (6 x 16 = 96 query rows on the 27B), ~100x less traffic, and the dot products run on mma.sync.
//
// Tiling (FlashAttention-2):
//   - block = (query tile of BQ = 16 * NP positions, KV head, chunk of HB heads of its group);
//     warp w owns 16 query rows: head (w % HB) of the chunk, positions q0 + 16 * (w / HB) + 0..15.
//     HB = the largest divisor of the group size <= MAXW, NP = MAXW / HB.
//   - Q: converted once to fp16, pre-multiplied by log2(e) / sqrt(D) (softmax in base 2), into
//     shared memory; D <= 128 keeps the warp's Q fragments in registers, D = 256 reads them from
//     shared memory per key tile (16 x 256 fp16 fragments would cost 64 more registers on top
//     of the 128 fp32 output accumulators).
//   - keys in tiles of BK (64, or 32 for D = 256): S = Q K^T with mma.sync m16n8k16 (fp16 in,
//     fp32 accumulate), causal mask only on tiles reaching past the warp's first position, tiles
//     past the block's last position never loaded, tiles past a warp's last position skipped;
//     online softmax in fp32 (running max m, row sum l, O rescaled by 2^(m_old - m_new));
//     P rounded to fp16 straight from the S accumulators (the C fragment of two n8 tiles is the
//     A fragment of one k16 step) and O += P V with V fragments by ldmatrix.trans.
//   - one K buffer and one V buffer per block, filled by cp.async and overlapped the FA2 way:
//     V_j loads while S_j = Q K_j^T runs, K_{j+1} loads while O += P_j V_j runs. q8_0 tiles go
//     through one int8 staging buffer (quants + scales by cp.async) and are dequantised into the
//     same fp16 K / V buffers (value = q * scale, rounded to fp16 once), so the mma code is shared.
//   - keys at or past the block's last position + 1 are zero-filled (cp.async src-size 0), never
//     read: a masked key has P = 0, and 0 * (garbage NaN) would still poison O.
//   - shared-memory rows padded by 16 bytes (stride D + 8 halves) so that ldmatrix's 8 row
//     addresses fall in 8 different 16-byte bank groups.
//   - keys in segments of PREFILL_SEGMENT (512): each segment's (O, m, l) starts from a fresh
//     online softmax and the segments are merged in order, z = 0 first (O = O a + o b, L = L a +
//     l b, a and b the two parts' weights at the new max), O kept unnormalised in `out` between
//     segments by the thread that owns those elements.
//   - epilogue: O / L * sigmoid(gate), fp32 to out. Blocks of the latest query tiles (the most
//     keys) are launched first.
//   - split blocks, where a few blocks would run many keys each (a prefill piece of 64 positions
//     at depth 12K has 16 blocks of 384 key tiles for 132 SMs): grid z = segments, block z runs
//     segment z alone and writes its (O, m, l) to the caller's partial buffer; combine_kernel
//     merges each row's segments in the same order with the same operations. The same bits as the
//     whole kernel: which one runs is a speed decision only.
// Numerics: Q and P rounded to fp16 (K/V are fp16 or dequantised to fp16 anyway), fp32
// accumulation and softmax: ~1e-4..1e-3 of max |out| from the fp32 decode path
// (tools/attn_prefill_bench.cu measures it).
#include <cfloat>

#include "engine.cuh"
#include "reduce.cuh"

namespace oj {

namespace {

// Per head_dim: keys per tile, warps per block at most, blocks per SM the register cap aims at.
// D = 256 (the 27B, group 6): 6 warps = 96 query rows, smem 93 KB with q8_0 staging (fits the
// 99 KB per-block limit of sm_86/89/120), 2 blocks per SM on sm_90 at <= 168 registers.
template <int D> struct PrefillShape;
template <> struct PrefillShape<64> {
    static constexpr int BK = 64, MAXW = 4, MINB = 4;
    static constexpr bool Q_IN_REGS = true;
};
template <> struct PrefillShape<128> {
    static constexpr int BK = 64, MAXW = 4, MINB = 3;
    static constexpr bool Q_IN_REGS = true;
};
template <> struct PrefillShape<256> {
    static constexpr int BK = 32, MAXW = 6, MINB = 2;
    static constexpr bool Q_IN_REGS = false;
};

template <int D, bool Q8>
constexpr int prefill_smem_bytes() {
    using S = PrefillShape<D>;
    constexpr int stride = D + 8;   // halves per shared row
    return (S::MAXW * 16 + 2 * S::BK) * stride * 2 + (Q8 ? S::BK * D + S::BK * (D / 32) * 2 : 0);
}

// Keys per segment: the unit a query row's keys are summed in (online softmax from a fresh state),
// the segments then merged in order, z = 0 first. The whole kernel and the split blocks +
// combine_kernel run the same float operations per segment and per merge, so the result does not
// depend on which runs (on P, the depth or the device): a prompt prefilled in pieces equals the
// same prompt prefilled whole, bit for bit. A multiple of every BK.
constexpr int PREFILL_SEGMENT = 512;

struct PrefillArgs {
    const float *q_rot;   // [n][n_head][D]
    const float *qg;      // [n][n_head][2][D]
    float *out;           // [n][n_head][D]
    const void *k_cache, *v_cache;
    const __half *k_scale, *v_scale;
    int n, pos0, n_ctx, n_head;
    int group;            // query heads per KV head
    int heads_per_block;  // HB
    int chunks;           // group / HB
    int pos_tiles;        // NP: 16-position tiles per block
    int n_qtiles;         // blocks along x
    int seg_tiles;        // key tiles per segment (SEG / BK)
    float q_scale;        // log2(e) / sqrt(D)
    float *part;          // split blocks: [segments][n][n_head][D] segment outputs, then [segments][n][n_head] (m, l)
    int n_segments;       // segments of the deepest position: (pos0 + n - 1) / SEG + 1
};

// ---- PTX wrappers (sm_80+: every architecture the library targets) --------------------------
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, L2 only; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
#else
    __trap();
#endif
}
// BYTES (4, 8 or 16) global -> shared, zero-filled when !valid.
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void *dst, const void *src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_u32(dst)), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0)
                 : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Four 8x8 fp16 matrices; lane l gives the row address of matrix l / 8, and receives in r[i]
// row l / 4, elements 2 (l % 4), +1 of matrix i (of its transpose with .trans).
// addr: a shared-memory address (smem_u32), kept as 32 bits to spare registers.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#else
    __trap();
#endif
}

// c += A (16x16 fp16, row-major fragment a) * B (16x8 fp16, "col" fragment b0 b1), fp32 c.
// Fragments (g = lane / 4, t = lane % 4): a[0] row g cols 2t,2t+1; a[1] row g+8; a[2] row g cols
// 2t+8,2t+9; a[3] row g+8 cols 2t+8,2t+9. b0 rows(k) 2t,2t+1 col(n) g; b1 rows 2t+8,2t+9.
// c[0], c[1] row g cols 2t, 2t+1; c[2], c[3] row g+8.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);   // lo -> low 16 bits (the lower column)
    return *reinterpret_cast<const uint32_t *>(&h);
}

// ---- tile loads -----------------------------------------------------------------------------
// Keys [key0, key0 + BK) of cache rows row0 + key (key < kv_end; zeros past it, not read) into shared:
// fp16 straight into dst_h [BK][D + 8]; q8_0 quants into stage [BK][D] bytes and their scales
// into stage_s [BK][D / 32]. One commit group.
template <int D, int BK, bool Q8>
// (row0 = kv_head * n_ctx < 2^31)
__device__ __forceinline__ void load_kv_tile(const void *cache, const __half *scale, int row0, int key0,
                                             int kv_end, __half *dst_h, int8_t *stage, __half *stage_s) {
    constexpr int STRIDE = D + 8;
    if constexpr (!Q8) {
        constexpr int CPR = D / 8;   // 16-byte chunks per row
        const __half *base = static_cast<const __half *>(cache);
#pragma unroll 1   // issued while O (and P) occupy most registers
        for (int c = threadIdx.x; c < BK * CPR; c += blockDim.x) {
            const int r = c / CPR, ch = c % CPR;
            const int key = key0 + r;
            const bool ok = key < kv_end;
            cp_async16(dst_h + r * STRIDE + ch * 8, base + (int64_t)(row0 + (ok ? key : 0)) * D + ch * 8, ok);
        }
    } else {
        constexpr int CPR = D / 16;
        const int8_t *base = static_cast<const int8_t *>(cache);
#pragma unroll 1
        for (int c = threadIdx.x; c < BK * CPR; c += blockDim.x) {
            const int r = c / CPR, ch = c % CPR;
            const int key = key0 + r;
            const bool ok = key < kv_end;
            cp_async16(stage + r * D + ch * 16, base + (int64_t)(row0 + (ok ? key : 0)) * D + ch * 16, ok);
        }
        // a row's D / 32 scales are D / 16 bytes, aligned to that (not always to 16: the plane of
        // KV head g starts at g * n_ctx rows), so one copy of that size per row
        for (int r = threadIdx.x; r < BK; r += blockDim.x) {
            const int key = key0 + r;
            const bool ok = key < kv_end;
            cp_async_small<D / 16>(stage_s + r * (D / 32), scale + (int64_t)(row0 + (ok ? key : 0)) * (D / 32), ok);
        }
    }
    cp_async_commit();
}

// stage (int8 [BK][D], scales [BK][D/32]) -> dst_h [BK][D + 8] fp16, value = q * scale.
template <int D, int BK>
__device__ __forceinline__ void dequant_tile(const int8_t *stage, const __half *stage_s, __half *dst_h) {
    constexpr int STRIDE = D + 8, CPR = D / 16;
    for (int c = threadIdx.x; c < BK * CPR; c += blockDim.x) {
        const int r = c / CPR, ch = c % CPR;
        const float d = __half2float(stage_s[r * (D / 32) + ch / 2]);   // 16 values in one 32-block
        const char4 *q = reinterpret_cast<const char4 *>(stage + r * D + ch * 16);
        uint32_t w[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const char4 v = q[k];
            // q * d is exact in fp32 (8-bit x 11-bit significands): one rounding, to fp16
            w[2 * k] = pack_half2((float)v.x * d, (float)v.y * d);
            w[2 * k + 1] = pack_half2((float)v.z * d, (float)v.w * d);
        }
        uint4 *dst = reinterpret_cast<uint4 *>(dst_h + r * STRIDE + ch * 16);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
}

// ---- the kernel -----------------------------------------------------------------------------
// blockIdx.y read afresh (volatile: not merged with an earlier read), so that values derived from
// it are recomputed where used instead of held in registers across the key loop: D = 256 sits
// right at the 168-register cap of 2 blocks per SM.
__device__ __forceinline__ int block_y() {
    int r;
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(r));
    return r;
}
// Query head of this warp and first cache row of the block's KV head.
__device__ __forceinline__ int warp_head(const PrefillArgs &a) {
    const int y = block_y(), kvh = y / a.chunks, chunk = y - kvh * a.chunks;
    return kvh * a.group + chunk * a.heads_per_block + (int)(threadIdx.x >> 5) % a.heads_per_block;
}
__device__ __forceinline__ int kv_row0(const PrefillArgs &a) { return block_y() / a.chunks * a.n_ctx; }

// A segment's (m, l, O) merged into the running (M, L, O): the one sequence of float operations both
// the whole kernel (in the key loop) and combine_kernel (over the split blocks' segments) run, so
// that the two give the same bits. a = the running part's weight, b = the segment's.
__device__ __forceinline__ void merge_weights(float &M, float &L, float m, float l, float &a, float &b) {
    const float mn = fmaxf(M, m);
    a = exp2f(M - mn);
    b = exp2f(m - mn);
    L = __fmaf_rn(L, a, __fmul_rn(l, b));
    M = mn;
}
__device__ __forceinline__ float merged(float O, float a, float o, float b) { return __fmaf_rn(O, a, __fmul_rn(o, b)); }

// grid (n_qtiles, n_head_kv * chunks, 1 | segments), block 32 * HB * NP, dynamic smem
// prefill_smem_bytes. SPLIT: block z runs segment z alone and writes its (O, m, l) to a.part
// (combine_kernel finishes); else the block runs every segment and merges them into out.
template <int D, bool Q8, bool SPLIT>
__global__ void __launch_bounds__(32 * PrefillShape<D>::MAXW, PrefillShape<D>::MINB)
attention_prefill_kernel(const PrefillArgs a) {
    using S = PrefillShape<D>;
    constexpr int BK = S::BK, STRIDE = D + 8;
    constexpr int NT = BK / 8;    // n8 tiles of S per warp (keys)
    constexpr int KD = D / 16;    // k16 steps of Q K^T (dims)
    constexpr int OT = D / 8;     // n8 tiles of O (dims)
    constexpr int KK = BK / 16;   // k16 steps of P V (keys)
    static_assert(NT % 2 == 0 && OT % 2 == 0, "tiles are loaded in pairs");

    extern __shared__ __align__(16) uint8_t smem[];
    __half *qs = reinterpret_cast<__half *>(smem);   // [MAXW * 16][STRIDE]
    __half *ks = qs + S::MAXW * 16 * STRIDE;          // [BK][STRIDE]
    __half *vs = ks + BK * STRIDE;                    // [BK][STRIDE]
    int8_t *stage = reinterpret_cast<int8_t *>(vs + BK * STRIDE);        // q8_0: [BK][D]
    __half *stage_s = reinterpret_cast<__half *>(stage + BK * D);        // q8_0: [BK][D / 32]

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int bq = 16 * a.pos_tiles;
    const int q0 = (a.n_qtiles - 1 - (int)blockIdx.x) * bq;   // latest (longest) tiles first
    const int i_first = q0 + (warp / a.heads_per_block) * 16;   // the warp's first query index
    // keys the block needs: [0, pos0 + min(q0 + bq, n)); loads zero-fill only past pos0 + n (the
    // rows between are valid cache rows, finite, and masked for every row of this block)
    const int n_tiles = (a.pos0 + min(q0 + bq, a.n) + BK - 1) / BK;
    // Row r of the warp (position qpos + r) may see keys <= min(qpos + r, last): rows past n act
    // as row n - 1 (their results are never written). Kept as two values to spare registers.
    const int qpos = a.pos0 + i_first;
    const int last = a.pos0 + a.n - 1;
    // the tiles this block runs: all, or (SPLIT) segment z's. A segment no row of the block reaches
    // is left out by the combine too (it reads segments up to the row's own).
    int j_begin = 0, j_end = n_tiles;
    if constexpr (SPLIT) {
        j_begin = (int)blockIdx.z * a.seg_tiles;
        if (j_begin >= n_tiles) return;
        j_end = min(n_tiles, j_begin + a.seg_tiles);
    }

    // first K tile in flight while Q is converted
    if constexpr (Q8)
        load_kv_tile<D, BK, true>(a.k_cache, a.k_scale, kv_row0(a), j_begin * BK, a.pos0 + a.n, nullptr, stage, stage_s);
    else load_kv_tile<D, BK, false>(a.k_cache, nullptr, kv_row0(a), j_begin * BK, a.pos0 + a.n, ks, nullptr, nullptr);

    // Q rows of this warp -> fp16 * log2(e) / sqrt(D); rows past n are zeros
    __half *qw = qs + warp * 16 * STRIDE;
    const int h = warp_head(a);
    for (int c = lane; c < 16 * (D / 4); c += 32) {
        const int r = c / (D / 4), col = (c % (D / 4)) * 4;
        const int i = i_first + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < a.n) v = *reinterpret_cast<const float4 *>(a.q_rot + ((int64_t)i * a.n_head + h) * D + col);
        *reinterpret_cast<uint2 *>(qw + r * STRIDE + col) =
            make_uint2(pack_half2(v.x * a.q_scale, v.y * a.q_scale), pack_half2(v.z * a.q_scale, v.w * a.q_scale));
    }
    __syncwarp();
    // One lane offset serves every ldmatrix: lane l addresses row l % 16, column block l / 16 of
    // a 16 x 16 tile, so matrix i = l / 8 is (rows 8 (i % 2).., columns 8 (i / 2)..). For Q (A
    // operand) that gives a[0..3] directly; for K (n = keys = rows) the registers come out as
    // b0(keys 0-7), b0(keys 8-15), b1(keys 0-7), b1(keys 8-15); for V with .trans (k = keys =
    // rows, n = dims = columns) as b0, b1 of dims 0-7, then b0, b1 of dims 8-15.
    const uint32_t lane_off = ((lane & 15) * STRIDE + (lane >> 4) * 8) * 2;   // bytes
    const uint32_t q_lane = smem_u32(qw) + lane_off;
    const uint32_t k_lane = smem_u32(ks) + lane_off;
    const uint32_t v_lane = smem_u32(vs) + lane_off;
    uint32_t qf[S::Q_IN_REGS ? KD : 1][4];
    if constexpr (S::Q_IN_REGS) {
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) ldmatrix_x4(qf[kd], q_lane + kd * 32);
    }

    const int i0 = qpos - a.pos0 + g, i1 = i0 + 8;   // this thread's rows
    float o[OT][4];
    float m0 = -INFINITY, m1 = -INFINITY;   // running max (base-2 units) of rows g, g + 8 in the segment
    float l0 = 0.0f, l1 = 0.0f;             // this thread's share of the row sums in the segment
    float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.0f, L1 = 0.0f;   // merged segments (not SPLIT)

    for (int j = j_begin; j < j_end; ++j) {
        if (j % a.seg_tiles == 0) {   // a segment's first tile (j_begin is one)
#pragma unroll
            for (int ot = 0; ot < OT; ++ot) o[ot][0] = o[ot][1] = o[ot][2] = o[ot][3] = 0.0f;
            m0 = m1 = -INFINITY;
            l0 = l1 = 0.0f;
        }
        const int key0 = j * BK;
        cp_async_wait_all();
        __syncthreads();   // K_j landed (for everyone); every warp is done with V_{j-1}
        if constexpr (Q8) {
            dequant_tile<D, BK>(stage, stage_s, ks);
            __syncthreads();   // ks written, stage free
            load_kv_tile<D, BK, true>(a.v_cache, a.v_scale, kv_row0(a), key0, a.pos0 + a.n, nullptr, stage, stage_s);
        } else {
            load_kv_tile<D, BK, false>(a.v_cache, nullptr, kv_row0(a), key0, a.pos0 + a.n, vs, nullptr, nullptr);
        }

        const bool compute = qpos <= last && key0 <= min(qpos + 15, last);   // rows to do, keys to see
        uint32_t pf[KK][4];   // P in fp16: the A fragments of O += P V
        if (compute) {
            float s[NT][4];
            // S = Q K^T (already in base-2 log units)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kd = 0; kd < KD; ++kd) {
                uint32_t qa[4];
                if constexpr (S::Q_IN_REGS) {
                    qa[0] = qf[kd][0]; qa[1] = qf[kd][1]; qa[2] = qf[kd][2]; qa[3] = qf[kd][3];
                } else {
                    ldmatrix_x4(qa, q_lane + kd * 32);
                }
#pragma unroll
                for (int np = 0; np < NT / 2; ++np) {
                    uint32_t kb[4];
                    ldmatrix_x4(kb, k_lane + (np * 16 * STRIDE + kd * 16) * 2);
                    mma_f16(s[2 * np], qa, kb[0], kb[2]);
                    mma_f16(s[2 * np + 1], qa, kb[1], kb[3]);
                }
            }
            if (key0 + BK - 1 > qpos) {   // the tile reaches past the first row's position
                const int lim0 = min(qpos + g, last), lim1 = min(qpos + g + 8, last);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int key = key0 + nt * 8 + 2 * t;
                    if (key > lim0) s[nt][0] = -INFINITY;
                    if (key + 1 > lim0) s[nt][1] = -INFINITY;
                    if (key > lim1) s[nt][2] = -INFINITY;
                    if (key + 1 > lim1) s[nt][3] = -INFINITY;
                }
            }
            // online softmax: a row's 4 threads (t = 0..3) share its max
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
                mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            // every row sees key 0 in tile 0, so mx is finite from then on; guard anyway
            const float b0 = mx0 == -INFINITY ? 0.0f : mx0, b1 = mx1 == -INFINITY ? 0.0f : mx1;
            const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);   // 0 on the first tile
            m0 = mx0;
            m1 = mx1;
            float r0 = 0.0f, r1 = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][0] = exp2f(s[nt][0] - b0);
                s[nt][1] = exp2f(s[nt][1] - b0);
                s[nt][2] = exp2f(s[nt][2] - b1);
                s[nt][3] = exp2f(s[nt][3] - b1);
                r0 += s[nt][0] + s[nt][1];
                r1 += s[nt][2] + s[nt][3];
            }
            l0 = l0 * c0 + r0;
            l1 = l1 * c1 + r1;
            // P's C fragments of n8 tiles 2kk, 2kk+1 are the A fragment of k16 step kk; packed
            // now so that S's registers are free while the next K tile is issued
#pragma unroll
            for (int kk = 0; kk < KK; ++kk) {
                pf[kk][0] = pack_half2(s[2 * kk][0], s[2 * kk][1]);
                pf[kk][1] = pack_half2(s[2 * kk][2], s[2 * kk][3]);
                pf[kk][2] = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[kk][3] = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
#pragma unroll
            for (int ot = 0; ot < OT; ++ot) {
                o[ot][0] *= c0;
                o[ot][1] *= c0;
                o[ot][2] *= c1;
                o[ot][3] *= c1;
            }
        }

        cp_async_wait_all();
        __syncthreads();   // V_j landed; every warp is done with K_j
        if constexpr (Q8) {
            dequant_tile<D, BK>(stage, stage_s, vs);
            __syncthreads();   // vs written, stage free
            if (j + 1 < j_end)
                load_kv_tile<D, BK, true>(a.k_cache, a.k_scale, kv_row0(a), key0 + BK, a.pos0 + a.n, nullptr, stage, stage_s);
        } else {
            if (j + 1 < j_end)
                load_kv_tile<D, BK, false>(a.k_cache, nullptr, kv_row0(a), key0 + BK, a.pos0 + a.n, ks, nullptr, nullptr);
        }

        if (compute) {
            // O += P V
#pragma unroll
            for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
                for (int dp = 0; dp < OT / 2; ++dp) {
                    uint32_t vb[4];
                    ldmatrix_x4_trans(vb, v_lane + (kk * 16 * STRIDE + dp * 16) * 2);
                    mma_f16(o[2 * dp], pf[kk], vb[0], vb[1]);
                    mma_f16(o[2 * dp + 1], pf[kk], vb[2], vb[3]);
                }
            }
        }

        // the segment's end: its row sums whole, then its (O, m, l) to a.part (SPLIT) or merged
        // into the running result kept in out (unnormalised until the last segment)
        if ((j + 1) % a.seg_tiles != 0 && j + 1 != j_end) continue;
        if (qpos > last) continue;   // all 16 rows past n
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const int hw = warp_head(a);
        if constexpr (SPLIT) {
            const int64_t plane = (int64_t)a.n * a.n_head;   // rows of one segment
            float *po = a.part + (int64_t)blockIdx.z * plane * D;
            float *pml = a.part + (int64_t)a.n_segments * plane * D + (int64_t)blockIdx.z * plane * 2;
            if (t == 0) {
                if (i0 < a.n) *reinterpret_cast<float2 *>(pml + ((int64_t)i0 * a.n_head + hw) * 2) = make_float2(m0, l0);
                if (i1 < a.n) *reinterpret_cast<float2 *>(pml + ((int64_t)i1 * a.n_head + hw) * 2) = make_float2(m1, l1);
            }
#pragma unroll
            for (int ot = 0; ot < OT; ++ot) {
                const int col = ot * 8 + 2 * t;
                if (i0 < a.n) *reinterpret_cast<float2 *>(po + ((int64_t)i0 * a.n_head + hw) * D + col) = make_float2(o[ot][0], o[ot][1]);
                if (i1 < a.n) *reinterpret_cast<float2 *>(po + ((int64_t)i1 * a.n_head + hw) * D + col) = make_float2(o[ot][2], o[ot][3]);
            }
        } else {
            // a row whose keys all lie past the segment's start saw none of it (m = -inf): skipped
            const bool first = j < a.seg_tiles;   // segment 0: the running result is the segment
            float a0 = 0.0f, b0 = 0.0f, a1 = 0.0f, b1 = 0.0f;
            const bool use0 = i0 < a.n && m0 != -INFINITY, use1 = i1 < a.n && m1 != -INFINITY;
            if (first) {
                M0 = m0; L0 = l0; M1 = m1; L1 = l1;
            } else {
                if (use0) merge_weights(M0, L0, m0, l0, a0, b0);
                if (use1) merge_weights(M1, L1, m1, l1, a1, b1);
            }
#pragma unroll
            for (int ot = 0; ot < OT; ++ot) {
                const int col = ot * 8 + 2 * t;
                if (use0) {
                    float2 *p = reinterpret_cast<float2 *>(a.out + ((int64_t)i0 * a.n_head + hw) * D + col);
                    if (first) *p = make_float2(o[ot][0], o[ot][1]);
                    else { const float2 r = *p; *p = make_float2(merged(r.x, a0, o[ot][0], b0), merged(r.y, a0, o[ot][1], b0)); }
                }
                if (use1) {
                    float2 *p = reinterpret_cast<float2 *>(a.out + ((int64_t)i1 * a.n_head + hw) * D + col);
                    if (first) *p = make_float2(o[ot][2], o[ot][3]);
                    else { const float2 r = *p; *p = make_float2(merged(r.x, a1, o[ot][2], b1), merged(r.y, a1, o[ot][3], b1)); }
                }
            }
        }
    }

    if constexpr (!SPLIT) {
        if (qpos > last) return;
        // out = O / L * sigmoid(gate), each thread over the elements it wrote (combine_kernel's
        // expression)
        const float inv0 = 1.0f / L0, inv1 = 1.0f / L1;
        const int hw = warp_head(a);
#pragma unroll
        for (int ot = 0; ot < OT; ++ot) {
            const int col = ot * 8 + 2 * t;
            if (i0 < a.n) {
                const int64_t row = (int64_t)i0 * a.n_head + hw;
                const float2 gate = *reinterpret_cast<const float2 *>(a.qg + (row * 2 + 1) * D + col);
                float2 *p = reinterpret_cast<float2 *>(a.out + row * D + col);
                const float2 r = *p;
                *p = make_float2(r.x * inv0 * sigmoid(gate.x), r.y * inv0 * sigmoid(gate.y));
            }
            if (i1 < a.n) {
                const int64_t row = (int64_t)i1 * a.n_head + hw;
                const float2 gate = *reinterpret_cast<const float2 *>(a.qg + (row * 2 + 1) * D + col);
                float2 *p = reinterpret_cast<float2 *>(a.out + row * D + col);
                const float2 r = *p;
                *p = make_float2(r.x * inv1 * sigmoid(gate.x), r.y * inv1 * sigmoid(gate.y));
            }
        }
    }
}

// The split blocks' segments of row i (grid x) and head h (grid y), thread = column: merged in
// order, z = 0 first, up to the row's own segment (the ones before all hold its keys), then
// out = O / L * sigmoid(gate).
template <int D>
__global__ void __launch_bounds__(D) combine_kernel(const PrefillArgs a, int seg) {
    const int i = blockIdx.x, col = threadIdx.x;
    const int nz = (a.pos0 + i) / seg + 1;
    const int64_t plane = (int64_t)a.n * a.n_head;
    const int64_t row = (int64_t)i * a.n_head + blockIdx.y;
    const float *pml = a.part + (int64_t)a.n_segments * plane * D;
    float M = pml[row * 2], L = pml[row * 2 + 1], O = a.part[row * D + col];
    for (int z = 1; z < nz; ++z) {
        const float m = pml[(z * plane + row) * 2], l = pml[(z * plane + row) * 2 + 1];
        if (m == -INFINITY) continue;
        float wa, wb;
        merge_weights(M, L, m, l, wa, wb);
        O = merged(O, wa, a.part[(z * plane + row) * D + col], wb);
    }
    const float inv = 1.0f / L;
    a.out[row * D + col] = O * inv * sigmoid(a.qg[(row * 2 + 1) * D + col]);
}

template <int D, bool Q8>
void launch_prefill(const ModelDims &d, const Layer &L, const float *q_rot, const float *qg, float *out, int n,
                    int pos0, int n_ctx, cudaStream_t st, float *part, size_t part_bytes, int split) {
    using S = PrefillShape<D>;
    const int H = d.hp.n_head, Hkv = d.hp.n_head_kv, G = H / Hkv;
    int hb = 1;   // the largest divisor of the group that fits the block
    for (int c = G < S::MAXW ? G : S::MAXW; c >= 1; --c)
        if (G % c == 0) { hb = c; break; }
    PrefillArgs a;
    a.q_rot = q_rot;
    a.qg = qg;
    a.out = out;
    a.k_cache = L.k_cache;
    a.v_cache = L.v_cache;
    a.k_scale = L.k_scale;
    a.v_scale = L.v_scale;
    a.n = n;
    a.pos0 = pos0;
    a.n_ctx = n_ctx;
    a.n_head = H;
    a.group = G;
    a.heads_per_block = hb;
    a.chunks = G / hb;
    a.pos_tiles = S::MAXW / hb;
    a.n_qtiles = (n + 16 * a.pos_tiles - 1) / (16 * a.pos_tiles);
    a.seg_tiles = PREFILL_SEGMENT / S::BK;
    a.q_scale = 1.4426950408889634f / sqrtf((float)D);
    a.n_segments = (pos0 + n - 1) / PREFILL_SEGMENT + 1;
    a.part = nullptr;
    const int blocks = a.n_qtiles * Hkv * a.chunks;
    const size_t need = (size_t)a.n_segments * n * H * (D + 2) * sizeof(float);
    if (split == 1 && (a.n_segments < 2 || !part || need > part_bytes))
        fail(OJ_ERR_INVALID_ARGUMENT, "attention_prefill: split blocks need 2 or more segments (there are " +
                                          std::to_string(a.n_segments) + ") and " + std::to_string(need) +
                                          " bytes of partials (given " + std::to_string(part ? part_bytes : 0) + ")");
    if (split < 0 && a.n_segments >= 2 && part && need <= part_bytes) {
        int dev = 0, sms = 0;
        check_cuda(cudaGetDevice(&dev), "attention_prefill: device");
        check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "attention_prefill: SM count");
        if (blocks < sms) split = 1;
    }
    constexpr int SMEM = prefill_smem_bytes<D, Q8>();
    static bool attr_set[2] = {false, false};   // per instance; the engine and the harness use one device
    const bool sp = split == 1;
    if (!attr_set[sp]) {
        check_cuda(cudaFuncSetAttribute(sp ? attention_prefill_kernel<D, Q8, true> : attention_prefill_kernel<D, Q8, false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM),
                   "attention_prefill: shared memory attribute");
        attr_set[sp] = true;
    }
    const int threads = 32 * hb * a.pos_tiles;
    if (sp) {
        a.part = part;
        attention_prefill_kernel<D, Q8, true><<<dim3(a.n_qtiles, Hkv * a.chunks, a.n_segments), threads, SMEM, st>>>(a);
        check_launch("attention_prefill (split)");
        combine_kernel<D><<<dim3(n, H), D, 0, st>>>(a, PREFILL_SEGMENT);
        check_launch("attention_prefill combine");
    } else {
        attention_prefill_kernel<D, Q8, false><<<dim3(a.n_qtiles, Hkv * a.chunks), threads, SMEM, st>>>(a);
        check_launch("attention_prefill");
    }
}

template <bool Q8>
void prefill_kv(const ModelDims &d, const Layer &L, const float *q_rot, const float *qg, float *out, int n, int pos0,
                int n_ctx, cudaStream_t st, float *part, size_t part_bytes, int split) {
    switch (d.hp.head_dim) {
        case 64: launch_prefill<64, Q8>(d, L, q_rot, qg, out, n, pos0, n_ctx, st, part, part_bytes, split); break;
        case 128: launch_prefill<128, Q8>(d, L, q_rot, qg, out, n, pos0, n_ctx, st, part, part_bytes, split); break;
        case 256: launch_prefill<256, Q8>(d, L, q_rot, qg, out, n, pos0, n_ctx, st, part, part_bytes, split); break;
        default:
            fail(OJ_ERR_UNSUPPORTED, "attention_prefill: attention.key_length (head_dim) must be 64, 128 or 256, not " +
                                         std::to_string(d.hp.head_dim));
    }
}

}  // namespace

void attention_prefill(const ModelDims &d, const Layer &L, const float *q_rot, const float *qg, float *out, int n,
                       int pos0, int n_ctx, cudaStream_t st, float *part, size_t part_bytes, int split) {
    if (n < 1 || pos0 < 0)
        fail(OJ_ERR_INVALID_ARGUMENT, "attention_prefill: n = " + std::to_string(n) + ", pos0 = " +
                                          std::to_string(pos0) + " (need n >= 1, pos0 >= 0)");
    if ((int64_t)pos0 + n > n_ctx)
        fail(OJ_ERR_CONTEXT_FULL, "attention_prefill: positions up to " + std::to_string((int64_t)pos0 + n) +
                                      " exceed the KV cache's n_ctx = " + std::to_string(n_ctx));
    if (d.hp.n_head_kv < 1 || d.hp.n_head % d.hp.n_head_kv != 0)
        fail(OJ_ERR_UNSUPPORTED, "attention_prefill: attention.head_count " + std::to_string(d.hp.n_head) +
                                     " is not a multiple of attention.head_count_kv " + std::to_string(d.hp.n_head_kv));
    switch (L.kv_type) {
        case OJ_KV_F16: prefill_kv<false>(d, L, q_rot, qg, out, n, pos0, n_ctx, st, part, part_bytes, split); break;
        case OJ_KV_Q8_0: prefill_kv<true>(d, L, q_rot, qg, out, n, pos0, n_ctx, st, part, part_bytes, split); break;
        default:
            fail(OJ_ERR_UNSUPPORTED,
                 "attention_prefill: KV cache type " + std::to_string(L.kv_type) + " has no prefill kernel");
    }
}

}  // namespace oj
