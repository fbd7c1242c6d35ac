// deltanet_chunked.cuh: the Gated DeltaNet recurrence of one prefill pass in chunks of 64 positions
// (WY / UT transform) on the fp16 tensor cores; the numpy twin and the derivation are
// openjet_plugin/testing/chunked_deltanet.py. Same inputs and result as deltanet.cu's
// deltanet_recurrence_kernel with n_replay = 0, commit = true:
//   conv  [n][conv_dim]: q heads, k heads (L2-normed, q also / sqrt(d): after deltanet_qk_norm_kernel), v heads
//   beta, alpha [n][n_v_heads] raw; L.dt_bias, L.ssm_a [n_v_heads]
//   L.ssm_state [n_v][d (value j)][d (key i)] fp32, read and written back; out [n][n_v * d].
//
// Per chunk of C = 64 positions of value head h (G = cumulative log-decay, gamma = exp(G)):
//   A = strictly-lower(beta_r exp(G_r - G_s) k_r.k_s),  T = (I + A)^-1,  M = lower(exp(G_r - G_s) q_r.k_s)
//   Y = diag(beta) (V - diag(gamma) K S^T);  U = T Y
//   O = diag(gamma) Q S^T + M U;             S <- gamma_C S + (diag(exp(G_C - G)) U)^T K
// Two kernels:
//   deltanet_chunk_prep   grid (chunks, n_v), state-independent and fully parallel: A, M (mma),
//                         T by forward substitution in fp32 (one thread per column, no barriers),
//                         gamma / exp(G_C - G) / beta per position; G summed in double (a float
//                         prefix of large log-decays loses the small differences G_r - G_s).
//   deltanet_chunk_scan   grid (n_v, d / 32), 4 warps: block (h, slice of 32 value columns j) keeps
//                         its 32 x d state slice in shared memory (fp32) across the chunks and runs
//                         the five state-dependent products of each chunk on mma.sync m16n8k16.
// Why fp16 operands (fp32 accumulation): the numpy twin with every product's operands rounded to
// fp16 stays at ~6e-4 (output) and ~4e-4 (state, relative L2) of the float64 recurrence after
// 2,048 positions; bf16 at ~5e-3 / ~3e-3 misses the 1e-3 state bar (tests/test_chunked_deltanet.py);
// tf32 m16n8k8 has fp16's 10-bit mantissa at half the rate, and nothing here needs its range
// (|k| = 1, |q| <= 1/sqrt(d), |T|, |M| = O(1), state and v of the scale of the values).
// Ragged tail: positions past n act as k = q = v = 0, beta = 0, decay 1 (they change nothing).
//
// mma.sync.m16n8k16.row.col fragments (g = lane / 4, t = lane % 4; PTX ISA "Matrix Fragments for
// mma.m16n8k16", the same layout attention_prefill.cu uses): a0 (row g, k 2t..2t+1), a1 (row g+8),
// a2 (row g, k 2t+8..2t+9), a3 (row g+8, k 2t+8..); b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g);
// c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8). The lower 16 bits of a register hold the lower index.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "engine.cuh"
#include "reduce.cuh"

namespace oj {
namespace chunked {

constexpr int C = 64;         // positions per chunk
constexpr int J = 32;         // value columns per scan block
constexpr int THREADS = 128;  // 4 warps

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);   // .x (low bits) = lo
    return *reinterpret_cast<uint32_t *>(&h);
}
__device__ __forceinline__ uint32_t pack(__half lo, __half hi) {
    __half2 h = __halves2half2(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}
__device__ __forceinline__ uint32_t ld32(const __half *p) { return *reinterpret_cast<const uint32_t *>(p); }

// Rows [c0, c0 + C) of heads' d floats at `src + col0` (row stride ld floats) into half shared rows
// of stride sld, zeros for rows at or past n.
template <int D>
__device__ __forceinline__ void load_rows_half(__half *dst, int sld, const float *__restrict__ src, int64_t ld, int col0,
                                               int c0, int n) {
    constexpr int Q4 = D / 4;
    for (int e = threadIdx.x; e < C * Q4; e += THREADS) {
        const int r = e / Q4, c = (e % Q4) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c0 + r < n) v = *reinterpret_cast<const float4 *>(src + (int64_t)(c0 + r) * ld + col0 + c);
        *reinterpret_cast<__half2 *>(dst + r * sld + c) = __floats2half2_rn(v.x, v.y);
        *reinterpret_cast<__half2 *>(dst + r * sld + c + 2) = __floats2half2_rn(v.z, v.w);
    }
}

// What the prep kernel leaves for the scan, per (value head, chunk): T and M (fp16, [C][C] row-major),
// then gamma_r = exp(G_r), tail_r = exp(G_last - G_r), beta_r (fp32, C each).
struct ChunkCoef {
    static constexpr int64_t bytes = 2 * C * C * sizeof(__half) + 3 * C * sizeof(float);
    __half *T, *M;
    float *gamma, *tail, *beta;
    __device__ __host__ ChunkCoef(void *base, int64_t index) {
        char *p = static_cast<char *>(base) + index * bytes;
        T = reinterpret_cast<__half *>(p);
        M = T + C * C;
        gamma = reinterpret_cast<float *>(M + C * C);
        tail = gamma + C;
        beta = tail + C;
    }
};

template <int D>
struct PrepSmem {
    static constexpr int KLD = D + 8;   // halves; the 16-byte pad spreads rows over the banks
    // floats. The solve's lanes walk a diagonal (lane c reads a[c + 1 + o][c + i], t[c + i][c]: lane stride
    // ALD + 1 = 66), so lanes c and c + 16 share a bank (2-way); an even ALD (C + 2) would make it conflict-free.
    static constexpr int ALD = C + 1;
    __half k[C * KLD], q[C * KLD];
    float a[C * ALD], t[C * ALD];
    double G[C];
    float beta[C];
};

// grid (chunks, n_v), block THREADS.
template <int D>
__global__ void __launch_bounds__(THREADS)
deltanet_chunk_prep(const float *__restrict__ conv, const float *__restrict__ beta_raw, const float *__restrict__ alpha_raw,
                    const float *__restrict__ dt_bias, const float *__restrict__ ssm_a, void *coef, int n, int conv_dim,
                    int key_dim, int n_key_heads, int n_v_heads) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    PrepSmem<D> &sm = *reinterpret_cast<PrepSmem<D> *>(smem_raw);
    constexpr int KLD = PrepSmem<D>::KLD, ALD = PrepSmem<D>::ALD;
    const int chunk = blockIdx.x, h = blockIdx.y, kh = h % n_key_heads, c0 = chunk * C;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    ChunkCoef cf(coef, (int64_t)h * gridDim.x + chunk);

    load_rows_half<D>(sm.k, KLD, conv, conv_dim, key_dim + kh * D, c0, n);
    load_rows_half<D>(sm.q, KLD, conv, conv_dim, kh * D, c0, n);
    if (threadIdx.x < 32) {   // log-decays and betas; the prefix sum in double by lane 0
        float lg[2];
        for (int u = 0; u < 2; ++u) {
            const int r = lane + 32 * u, p = c0 + r;
            float b = 0.0f, l = 0.0f;   // past n: beta 0, decay 1
            if (p < n) {
                b = sigmoid(beta_raw[(int64_t)p * n_v_heads + h]);
                const float x = alpha_raw[(int64_t)p * n_v_heads + h] + dt_bias[h];
                const float softplus = x > 20.0f ? x : log1pf(expf(x));
                l = softplus * ssm_a[h];   // deltanet.cu: decay = expf(softplus * a)
            }
            sm.beta[r] = b;
            lg[u] = l;
        }
        double run = 0.0;
        for (int r = 0; r < C; ++r) {
            const float l = __shfl_sync(0xffffffffu, lg[r >> 5], r & 31);
            run += (double)l;
            if (lane == 0) sm.G[r] = run;
        }
    }
    __syncthreads();
    if (threadIdx.x < C) {
        const int r = threadIdx.x;
        cf.gamma[r] = expf((float)sm.G[r]);
        cf.tail[r] = expf((float)(sm.G[C - 1] - sm.G[r]));
        cf.beta[r] = sm.beta[r];
    }
    // K K^T and Q K^T: warp w rows 16 w .. 16 w + 15, all C columns
    float kk[C / 8][4], qk[C / 8][4];
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[nt][e] = qk[nt][e] = 0.0f;
    const int m0 = 16 * warp;
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
        const __half *ka = sm.k + (m0 + g) * KLD + k0 + 2 * t, *qa = sm.q + (m0 + g) * KLD + k0 + 2 * t;
        const uint32_t a0 = ld32(ka), a1 = ld32(ka + 8 * KLD), a2 = ld32(ka + 8), a3 = ld32(ka + 8 * KLD + 8);
        const uint32_t q0 = ld32(qa), q1 = ld32(qa + 8 * KLD), q2 = ld32(qa + 8), q3 = ld32(qa + 8 * KLD + 8);
#pragma unroll
        for (int nt = 0; nt < C / 8; ++nt) {
            const __half *kb = sm.k + (8 * nt + g) * KLD + k0 + 2 * t;   // B[k][n] = K[n][k]
            const uint32_t b0 = ld32(kb), b1 = ld32(kb + 8);
            mma16816(kk[nt], a0, a1, a2, a3, b0, b1);
            mma16816(qk[nt], q0, q1, q2, q3, b0, b1);
        }
    }
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int r = m0 + g + 8 * hi, s = 8 * nt + 2 * t;
            float mv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float ratio = s + e <= r ? expf((float)(sm.G[r] - sm.G[s + e])) : 0.0f;
                sm.a[r * ALD + s + e] = s + e < r ? sm.beta[r] * ratio * kk[nt][2 * hi + e] : 0.0f;
                mv[e] = ratio * qk[nt][2 * hi + e];
            }
            *reinterpret_cast<__half2 *>(cf.M + r * C + s) = __floats2half2_rn(mv[0], mv[1]);
        }
    __syncthreads();
    // T = (I + A)^-1, column c by thread c: T[r][c] = delta_rc - sum_{c <= s < r} A[r][s] T[s][c]
    if (threadIdx.x < C) {
        const int c = threadIdx.x;
        for (int r = 0; r < c; ++r) sm.t[r * ALD + c] = 0.0f;
        sm.t[c * ALD + c] = 1.0f;
        for (int r = c + 1; r < C; ++r) {
            float acc = 0.0f;
            for (int s = c; s < r; ++s) acc -= sm.a[r * ALD + s] * sm.t[s * ALD + c];
            sm.t[r * ALD + c] = acc;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * C / 2; e += THREADS) {
        const int r = (2 * e) / C, s = (2 * e) % C;
        *reinterpret_cast<__half2 *>(cf.T + r * C + s) = __floats2half2_rn(sm.t[r * ALD + s], sm.t[r * ALD + s + 1]);
    }
}

template <int D>
struct ScanSmem {
    static constexpr int KLD = D + 8, SLD = D + 4, YLD = J + 4, TLD = C + 8;
    __half k[C * KLD], q[C * KLD];
    float s[J * SLD];     // the state slice: rows j0 .. j0 + J - 1, all d keys
    float y[C * YLD];     // v slice, then Y, then U
    __half tm[C * TLD], mm[C * TLD];
    float gamma[C], tail[C], beta[C];
};

// grid (n_v, d / J), block THREADS.
template <int D>
__global__ void __launch_bounds__(THREADS, 1)
deltanet_chunk_scan(const float *__restrict__ conv, const void *__restrict__ coef, float *__restrict__ state,
                    float *__restrict__ out, int n, int conv_dim, int key_dim, int n_key_heads, int n_v_heads) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    ScanSmem<D> &sm = *reinterpret_cast<ScanSmem<D> *>(smem_raw);
    constexpr int KLD = ScanSmem<D>::KLD, SLD = ScanSmem<D>::SLD, YLD = ScanSmem<D>::YLD, TLD = ScanSmem<D>::TLD;
    const int h = blockIdx.x, j0 = blockIdx.y * J, kh = h % n_key_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int chunks = (n + C - 1) / C;
    float *srow = state + ((int64_t)h * D + j0) * D;
    for (int e = threadIdx.x; e < J * D / 4; e += THREADS) {
        const int j = e / (D / 4), i = (e % (D / 4)) * 4;
        *reinterpret_cast<float4 *>(sm.s + j * SLD + i) = *reinterpret_cast<const float4 *>(srow + (int64_t)j * D + i);
    }
    const int m0 = 16 * warp;   // steps 2-4: this warp's 16 positions of the chunk
    for (int chunk = 0; chunk < chunks; ++chunk) {
        const int c0 = chunk * C;
        const ChunkCoef cf(const_cast<void *>(coef), (int64_t)h * chunks + chunk);
        __syncthreads();   // the previous chunk is done with k, y, tm, mm
        // 1. this chunk's inputs
        load_rows_half<D>(sm.k, KLD, conv, conv_dim, key_dim + kh * D, c0, n);
        load_rows_half<D>(sm.q, KLD, conv, conv_dim, kh * D, c0, n);
        for (int e = threadIdx.x; e < C * J / 4; e += THREADS) {
            const int r = e / (J / 4), j = (e % (J / 4)) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c0 + r < n) v = *reinterpret_cast<const float4 *>(conv + (int64_t)(c0 + r) * conv_dim + 2 * key_dim + h * D + j0 + j);
            *reinterpret_cast<float4 *>(sm.y + r * YLD + j) = v;
        }
        for (int e = threadIdx.x; e < C * C / 8; e += THREADS) {   // 8 halves per 16-byte copy
            const int r = e / (C / 8), s = (e % (C / 8)) * 8;
            *reinterpret_cast<uint4 *>(sm.tm + r * TLD + s) = *reinterpret_cast<const uint4 *>(cf.T + r * C + s);
            *reinterpret_cast<uint4 *>(sm.mm + r * TLD + s) = *reinterpret_cast<const uint4 *>(cf.M + r * C + s);
        }
        if (threadIdx.x < C) {
            sm.gamma[threadIdx.x] = cf.gamma[threadIdx.x];
            sm.tail[threadIdx.x] = cf.tail[threadIdx.x];
            sm.beta[threadIdx.x] = cf.beta[threadIdx.x];
        }
        __syncthreads();
        // 2. X = K S^T and Q S^T (rows m0.., J columns): Y = beta (V - gamma X), O = gamma Q S^T
        float x[J / 8][4], o[J / 8][4];
#pragma unroll
        for (int nt = 0; nt < J / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) x[nt][e] = o[nt][e] = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 16) {
            const __half *ka = sm.k + (m0 + g) * KLD + k0 + 2 * t, *qa = sm.q + (m0 + g) * KLD + k0 + 2 * t;
            const uint32_t a0 = ld32(ka), a1 = ld32(ka + 8 * KLD), a2 = ld32(ka + 8), a3 = ld32(ka + 8 * KLD + 8);
            const uint32_t q0 = ld32(qa), q1 = ld32(qa + 8 * KLD), q2 = ld32(qa + 8), q3 = ld32(qa + 8 * KLD + 8);
#pragma unroll
            for (int nt = 0; nt < J / 8; ++nt) {
                const float *sb = sm.s + (8 * nt + g) * SLD + k0 + 2 * t;   // B[k = i][n = j] = S[j][i]
                const float2 lo = *reinterpret_cast<const float2 *>(sb), hi = *reinterpret_cast<const float2 *>(sb + 8);
                const uint32_t b0 = pack(lo.x, lo.y), b1 = pack(hi.x, hi.y);
                mma16816(x[nt], a0, a1, a2, a3, b0, b1);
                mma16816(o[nt], q0, q1, q2, q3, b0, b1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < J / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = m0 + g + 8 * (e >> 1), j = 8 * nt + 2 * t + (e & 1);
                float &yv = sm.y[r * YLD + j];   // only this thread touches (r, j) in this step
                yv = sm.beta[r] * (yv - sm.gamma[r] * x[nt][e]);
                o[nt][e] *= sm.gamma[r];
            }
        __syncthreads();
        // 3. U = T Y
        float u[J / 8][4];
#pragma unroll
        for (int nt = 0; nt < J / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) u[nt][e] = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < C; k0 += 16) {
            const __half *ta = sm.tm + (m0 + g) * TLD + k0 + 2 * t;
            const uint32_t a0 = ld32(ta), a1 = ld32(ta + 8 * TLD), a2 = ld32(ta + 8), a3 = ld32(ta + 8 * TLD + 8);
#pragma unroll
            for (int nt = 0; nt < J / 8; ++nt) {
                const float *yb = sm.y + (k0 + 2 * t) * YLD + 8 * nt + g;   // B[k = s][n = j] = Y[s][j]
                const uint32_t b0 = pack(yb[0], yb[YLD]), b1 = pack(yb[8 * YLD], yb[9 * YLD]);
                mma16816(u[nt], a0, a1, a2, a3, b0, b1);
            }
        }
        __syncthreads();   // every warp has read Y
#pragma unroll
        for (int nt = 0; nt < J / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) sm.y[(m0 + g + 8 * (e >> 1)) * YLD + 8 * nt + 2 * t + (e & 1)] = u[nt][e];
        __syncthreads();
        // 4. O += M U, written out
#pragma unroll
        for (int k0 = 0; k0 < C; k0 += 16) {
            const __half *ma = sm.mm + (m0 + g) * TLD + k0 + 2 * t;
            const uint32_t a0 = ld32(ma), a1 = ld32(ma + 8 * TLD), a2 = ld32(ma + 8), a3 = ld32(ma + 8 * TLD + 8);
#pragma unroll
            for (int nt = 0; nt < J / 8; ++nt) {
                const float *ub = sm.y + (k0 + 2 * t) * YLD + 8 * nt + g;
                const uint32_t b0 = pack(ub[0], ub[YLD]), b1 = pack(ub[8 * YLD], ub[9 * YLD]);
                mma16816(o[nt], a0, a1, a2, a3, b0, b1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < J / 8; ++nt)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const int r = m0 + g + 8 * hi;
                if (c0 + r < n)
                    *reinterpret_cast<float2 *>(out + (int64_t)(c0 + r) * n_v_heads * D + h * D + j0 + 8 * nt + 2 * t) =
                        make_float2(o[nt][2 * hi], o[nt][2 * hi + 1]);
            }
        // 5. S = gamma_last S + (diag(tail) U)^T K: warp w owns keys i in [w D/4, (w+1) D/4), all J rows
        constexpr int NT5 = D / 32;
        const float gl = sm.gamma[C - 1];
        float sa[J / 16][NT5][4];
#pragma unroll
        for (int mt = 0; mt < J / 16; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT5; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    sa[mt][nt][e] = gl * sm.s[(16 * mt + g + 8 * (e >> 1)) * SLD + warp * (D / 4) + 8 * nt + 2 * t + (e & 1)];
#pragma unroll
        for (int k0 = 0; k0 < C; k0 += 16) {
            const int s0 = k0 + 2 * t;
            const float t0 = sm.tail[s0], t1 = sm.tail[s0 + 1], t8 = sm.tail[s0 + 8], t9 = sm.tail[s0 + 9];
#pragma unroll
            for (int mt = 0; mt < J / 16; ++mt) {
                const float *ua = sm.y + s0 * YLD + 16 * mt + g;   // A[m = j][k = s] = tail_s U[s][j]
                const uint32_t a0 = pack(t0 * ua[0], t1 * ua[YLD]), a1 = pack(t0 * ua[8], t1 * ua[YLD + 8]);
                const uint32_t a2 = pack(t8 * ua[8 * YLD], t9 * ua[9 * YLD]), a3 = pack(t8 * ua[8 * YLD + 8], t9 * ua[9 * YLD + 8]);
#pragma unroll
                for (int nt = 0; nt < NT5; ++nt) {
                    const __half *kb = sm.k + s0 * KLD + warp * (D / 4) + 8 * nt + g;   // B[k = s][n = i] = K[s][i]
                    const uint32_t b0 = pack(kb[0], kb[KLD]), b1 = pack(kb[8 * KLD], kb[9 * KLD]);
                    mma16816(sa[mt][nt], a0, a1, a2, a3, b0, b1);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < J / 16; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT5; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    sm.s[(16 * mt + g + 8 * (e >> 1)) * SLD + warp * (D / 4) + 8 * nt + 2 * t + (e & 1)] = sa[mt][nt][e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < J * D / 4; e += THREADS) {
        const int j = e / (D / 4), i = (e % (D / 4)) * 4;
        *reinterpret_cast<float4 *>(srow + (int64_t)j * D + i) = *reinterpret_cast<const float4 *>(sm.s + j * SLD + i);
    }
}

template <int D>
void launch(const ModelDims &d, Layer &L, const float *conv, const float *beta, const float *alpha, float *out, int n,
            void *coef, cudaStream_t st) {
    static bool configured = false;
    if (!configured) {
        check_cuda(cudaFuncSetAttribute(deltanet_chunk_prep<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)sizeof(PrepSmem<D>)), "deltanet_chunk_prep smem");
        check_cuda(cudaFuncSetAttribute(deltanet_chunk_scan<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)sizeof(ScanSmem<D>)), "deltanet_chunk_scan smem");
        configured = true;
    }
    const int Hk = d.hp.ssm_n_group, Hv = d.hp.ssm_dt_rank, chunks = (n + C - 1) / C;
    deltanet_chunk_prep<D><<<dim3(chunks, Hv), THREADS, sizeof(PrepSmem<D>), st>>>(
        conv, beta, alpha, L.dt_bias, L.ssm_a, coef, n, d.ssm_conv_dim(), d.ssm_key_dim(), Hk, Hv);
    check_launch("deltanet_chunk_prep");
    deltanet_chunk_scan<D><<<dim3(Hv, D / J), THREADS, sizeof(ScanSmem<D>), st>>>(
        conv, coef, L.ssm_state, out, n, d.ssm_conv_dim(), d.ssm_key_dim(), Hk, Hv);
    check_launch("deltanet_chunk_scan");
}

}  // namespace chunked

// Bytes of the prep results for a pass of n positions (the caller's buffer: PrefillScratch.dn_coef).
inline size_t deltanet_chunked_coef_bytes(const ModelDims &d, int n) {
    return (size_t)((n + chunked::C - 1) / chunked::C) * d.hp.ssm_dt_rank * chunked::ChunkCoef::bytes;
}

// The recurrence of one prefill pass of n positions (deltanet_recurrence_kernel with n_replay = 0,
// commit = true) in chunks on the tensor cores; `conv` as after deltanet_qk_norm_kernel.
inline void deltanet_chunked(const ModelDims &d, Layer &L, const float *conv, const float *beta, const float *alpha,
                             float *out, int n, void *coef, size_t coef_bytes, cudaStream_t st) {
    if (n < 0) fail(OJ_ERR_INVALID_ARGUMENT, "deltanet_chunked: n is " + std::to_string(n));
    if (n == 0) return;
    if (!conv || !beta || !alpha || !out || !L.ssm_state || !L.dt_bias || !L.ssm_a)
        fail(OJ_ERR_INVALID_ARGUMENT, "deltanet_chunked: a NULL buffer (conv, beta, alpha, out, ssm_state, ssm_dt or ssm_a)");
    if (!coef || coef_bytes < deltanet_chunked_coef_bytes(d, n))
        fail(OJ_ERR_INVALID_ARGUMENT, "deltanet_chunked: coefficient buffer of " + std::to_string(coef_bytes) + " bytes, need " +
                                          std::to_string(deltanet_chunked_coef_bytes(d, n)));
    if (d.hp.ssm_dt_rank % d.hp.ssm_n_group != 0)
        fail(OJ_ERR_UNSUPPORTED, "deltanet_chunked: ssm.time_step_rank must be a multiple of ssm.group_count");
    switch (d.hp.ssm_d_state) {
        case 32: chunked::launch<32>(d, L, conv, beta, alpha, out, n, coef, st); break;
        case 64: chunked::launch<64>(d, L, conv, beta, alpha, out, n, coef, st); break;
        case 128: chunked::launch<128>(d, L, conv, beta, alpha, out, n, coef, st); break;
        default: fail(OJ_ERR_UNSUPPORTED, "deltanet_chunked: ssm.state_size must be 32, 64 or 128");
    }
}

}  // namespace oj
