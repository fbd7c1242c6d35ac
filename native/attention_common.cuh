// attention_common.cuh: pieces of gated attention shared by attention.cu's kernels and the
// persistent kernel (persistent.cu): the IMROPE angle, a warp max, the q8_0 store of one block.
#pragma once

#include <cuda_fp16.h>

#include "model_dims.h"

namespace oj {
namespace {

struct RopeParams {
    int n_rot;
    int sections[4];
    float freq_base;
};

inline RopeParams rope_params(const ModelDims &d) {
    RopeParams rp;
    rp.n_rot = d.hp.n_rot;
    for (int i = 0; i < 4; ++i) rp.sections[i] = d.hp.rope_sections[i];
    rp.freq_base = d.hp.rope_freq_base;
    return rp;
}

// Angle of pair i at text position pos (ggml_mrope_cache_init with is_imrope).
__device__ float imrope_angle(const RopeParams &rp, int i, int pos) {
    const int sect_dims = rp.sections[0] + rp.sections[1] + rp.sections[2] + rp.sections[3];
    const int sector = i % sect_dims;
    float coord;
    if (sector % 3 == 1 && sector < 3 * rp.sections[1]) coord = (float)pos;        // h
    else if (sector % 3 == 2 && sector < 3 * rp.sections[2]) coord = (float)pos;   // w
    else if (sector % 3 == 0 && sector < 3 * rp.sections[0]) coord = (float)pos;   // t
    else coord = 0.0f;                                                              // e
    return coord * powf(rp.freq_base, -2.0f * (float)i / (float)rp.n_rot);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One value x per lane, the warp's 32 lanes = one q8_0 block: the quant of x, and the block's
// scale to lane 0's *scale (ggml's quantize_row_q8_0_ref, so the numpy reference can repeat it).
__device__ __forceinline__ void q8_0_store(float x, int8_t *quant, __half *scale) {
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *quant = (int8_t)roundf(x * id);
    if ((threadIdx.x & 31) == 0) *scale = __float2half(d);
}

}  // namespace
}  // namespace oj
