// reduce.cuh: warp and block sums shared by the kernels.
#pragma once

namespace oj {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();   // partial may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int n_warps = (blockDim.x + 31) >> 5;
    float t = lane < n_warps ? partial[lane] : 0.0f;
    return warp_sum(t);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

}  // namespace oj
