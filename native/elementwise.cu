// elementwise.cu: RMSNorm, SwiGLU, argmax over the vocabulary, oj_commit_path's row moves, and the
// fault probe.
#include <algorithm>
#include <cfloat>

#include "engine.cuh"
#include "pdl.cuh"
#include "reduce.cuh"

namespace oj {

namespace {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w   (ggml_rms_norm, then build_norm's weight).
__global__ void rms_norm_kernel(const float *__restrict__ x, const float *__restrict__ w,
                                float *__restrict__ y, int width, float eps, int y_stride) {
    pdl_launch_dependents();
    pdl_wait();
    const float *xr = x + (int64_t)blockIdx.x * width;
    float *yr = y + (int64_t)blockIdx.x * y_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float scale = 1.0f / sqrtf(ss / width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

// gate = silu(gate) * up (LLM_FFN_SILU with LLM_FFN_PAR).
__global__ void swiglu_kernel(float *__restrict__ gate, const float *__restrict__ up, int64_t count) {
    pdl_launch_dependents();
    pdl_wait();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
         i += (int64_t)gridDim.x * blockDim.x)
        gate[i] = silu(gate[i]) * up[i];
}

// First index of the largest value of each row (numpy's argmax tie rule); NaN never wins.
__global__ void argmax_kernel(const float *__restrict__ x, int32_t *__restrict__ out, int width) {
    pdl_launch_dependents();
    pdl_wait();
    const float *xr = x + (int64_t)blockIdx.x * width;
    float best = -FLT_MAX;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = xr[i];
        if (v > best) { best = v; idx = i; }   // ascending i per thread: first index kept
    }
    __shared__ float sv[1024];
    __shared__ int si[1024];
    const int i = block_argmax(best, idx, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = i == 0x7fffffff ? 0 : i;
}

// out[i] = ids[out[i]]: the restricted draft head's argmax rows back to token ids.
__global__ void map_ids_kernel(int32_t *__restrict__ out, const int32_t *__restrict__ ids, int n) {
    pdl_launch_dependents();
    pdl_wait();
    if (threadIdx.x < n) out[threadIdx.x] = ids[out[threadIdx.x]];
}

// grid (n_jobs, blocks per job), block 256: job j's rows path[i] -> i for i < n_path, word by word.
// A thread reads its word of every source row before it writes any, so the move is safe in place
// (path[i] >= i; no two sources are one row).
__global__ void compact_rows_kernel(const CompactJob *__restrict__ jobs, uint64_t path, int n_path) {
    pdl_launch_dependents();
    pdl_wait();
    const CompactJob job = jobs[blockIdx.x];
    for (int w = blockIdx.y * blockDim.x + threadIdx.x; w < job.row_words; w += gridDim.y * blockDim.x) {
        uint32_t v[OJ_MAX_POSITIONS];
#pragma unroll
        for (int i = 0; i < OJ_MAX_POSITIONS; ++i)
            if (i < n_path) v[i] = job.base[(int64_t)((path >> (8 * i)) & 0xffu) * job.row_stride + w];
#pragma unroll
        for (int i = 0; i < OJ_MAX_POSITIONS; ++i)
            if (i < n_path) job.base[(int64_t)i * job.row_stride + w] = v[i];
    }
}

// Reads through an address no allocation covers: the test of how a kernel fault surfaces.
__global__ void fault_probe_kernel(int32_t *out) {
    const int32_t *bad = reinterpret_cast<const int32_t *>(uintptr_t(0x10));
    out[0] = bad[threadIdx.x];
}

}  // namespace

void rms_norm(const float *x, const float *w, float *y, int n, int width, float eps, int y_stride,
              cudaStream_t st) {
    check_cuda(launch(rms_norm_kernel, n, 256, 0, st, x, w, y, width, eps, y_stride), "rms_norm");
}

void swiglu(float *gate_inout, const float *up, int64_t count, cudaStream_t st) {
    const int blocks = (int)((count + 255) / 256);
    check_cuda(launch(swiglu_kernel, blocks, 256, 0, st, gate_inout, up, count), "swiglu");
}

void argmax_rows(const float *x, int32_t *out, int n, int width, cudaStream_t st) {
    check_cuda(launch(argmax_kernel, n, 1024, 0, st, x, out, width), "argmax");
}

void map_ids(int32_t *out, const int32_t *ids, int n, cudaStream_t st) {
    check_cuda(launch(map_ids_kernel, 1, 32, 0, st, out, ids, n), "map_ids");
}

void compact_rows(const CompactJob *jobs, int n_jobs, int max_row_words, uint64_t path, int n_path, cudaStream_t st) {
    if (n_jobs == 0) return;
    const int per_job = std::min(8, (max_row_words + 255) / 256);
    check_cuda(launch(compact_rows_kernel, dim3(n_jobs, per_job), 256, 0, st, jobs, path, n_path), "compact_rows");
}

void fault_probe(int32_t *out, cudaStream_t st) {
    fault_probe_kernel<<<1, 32, 0, st>>>(out);
    check_launch("fault_probe");
}

}  // namespace oj
