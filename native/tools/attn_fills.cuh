// attn_fills.cuh: device random fills of the attention harnesses (attn_prefill_bench.cu,
// attn_decode_bench.cu): a counter-based hash, so a (seed, index) gives the same value in any
// launch shape; fp32 buffers, and fp16 / q8_0 KV caches in the engine's [Hkv][n_ctx][D] layout.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float uniform01(uint64_t seed, uint64_t i) {
    return (float)(mix64(seed * 0x100000001B3ull + i) >> 40) * (1.0f / 16777216.0f);
}
// sum of three uniforms, centred, unit variance
__device__ __forceinline__ float normalish(uint64_t seed, uint64_t i) {
    return (uniform01(seed, 3 * i) + uniform01(seed, 3 * i + 1) + uniform01(seed, 3 * i + 2) - 1.5f) * 2.0f;
}
__global__ void fill_normal(float *p, int64_t count, uint64_t seed, float scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        p[i] = normalish(seed, i) * scale;
}
__global__ void fill_uniform(float *p, int64_t count, uint64_t seed, float lo, float hi) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        p[i] = lo + (hi - lo) * uniform01(seed, i);
}
// rows [0, rows) of every KV head of an fp16 cache [Hkv][n_ctx][D]
__global__ void fill_cache_f16(__half *c, int Hkv, int n_ctx, int rows, int D, uint64_t seed) {
    const int64_t count = (int64_t)Hkv * rows * D;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t head = i / ((int64_t)rows * D), rest = i % ((int64_t)rows * D);
        c[head * n_ctx * D + rest] = __float2half(normalish(seed, i));
    }
}
// q8_0: quants uniform in [-127, 127], per-32 scales in [0.5, 1.5] / 127 (values within ~+-1.5)
__global__ void fill_cache_q8(int8_t *q, __half *s, int Hkv, int n_ctx, int rows, int D, uint64_t seed) {
    const int64_t count = (int64_t)Hkv * rows * D;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t head = i / ((int64_t)rows * D), rest = i % ((int64_t)rows * D);
        const int64_t at = head * n_ctx * D + rest;
        q[at] = (int8_t)((int)(uniform01(seed, i) * 255.0f) - 127);
        if (at % 32 == 0) s[at / 32] = __float2half((0.5f + uniform01(seed ^ 0x5555, i)) / 127.0f);
    }
}

