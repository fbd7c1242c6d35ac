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

// (value, index) ordered as argmax's rule takes them: the larger value, among equals the smaller index.
__device__ __forceinline__ bool argmax_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// grid (blocks of the row, rows), 1024 threads: the first index of the largest value of each row
// (numpy's argmax tie rule); NaN never wins, a row with no value above -FLT_MAX gives 0. Each block
// takes ROW_CHUNK values (8 loads in flight a thread) and leaves its best; the row's last block
// to finish takes the best of the blocks' (the same index the whole row's scan gives).
__global__ void __launch_bounds__(1024) argmax_kernel(const float *__restrict__ x, int32_t *__restrict__ out, int width,
                                                      ArgmaxPart *__restrict__ part, uint32_t *__restrict__ done) {
    pdl_launch_dependents();
    pdl_wait();
    constexpr int PER = ROW_CHUNK / 1024;
    const int row = blockIdx.y;
    const float *xr = x + (int64_t)row * width;
    const int c0 = blockIdx.x * ROW_CHUNK;
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = c0 + j * 1024 + threadIdx.x;
        v[j] = i < width ? xr[i] : -FLT_MAX;
    }
    float best = -FLT_MAX;
    int idx = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if (v[j] > best) best = v[j], idx = c0 + j * 1024 + threadIdx.x;   // ascending index per thread
    __shared__ float sv[1024];
    __shared__ int si[1024];
    __shared__ bool last;
    const int i = block_argmax(best, idx, sv, si);
    ArgmaxPart *pr = part + (int64_t)row * ROW_MAX_BLOCKS;
    if (threadIdx.x == 0) {
        pr[blockIdx.x] = ArgmaxPart{sv[0], i};
        __threadfence();
        last = atomicAdd(done + row, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence();
    float bv = -FLT_MAX;
    int bi = 0x7fffffff;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += 32) {
        const float pv = __ldcg(&pr[b].val);
        const int pi = __ldcg(&pr[b].idx);
        if (argmax_before(pv, pi, bv, bi)) bv = pv, bi = pi;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (argmax_before(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (threadIdx.x == 0) {
        out[row] = bi == 0x7fffffff ? 0 : bi;
        done[row] = 0;   // for the next launch (which waits for this grid before reading it)
    }
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
        uint32_t v[OJ_MAX_TREE_NODES];
#pragma unroll
        for (int i = 0; i < OJ_MAX_TREE_NODES; ++i)
            if (i < n_path) v[i] = job.base[(int64_t)((path >> (8 * i)) & 0xffu) * job.row_stride + w];
#pragma unroll
        for (int i = 0; i < OJ_MAX_TREE_NODES; ++i)
            if (i < n_path) job.base[(int64_t)i * job.row_stride + w] = v[i];
    }
}

// One block of 1024 threads over a row of `width` logits: its TOP_MAX (or k) largest values in
// descending order (ties: the smaller index, as argmax_kernel), their indices mapped through `ids`
// when set (a restricted draft head's rows back to token ids), and the row's max and sum of
// exp(x - max) over its finite values, into a TreeTop (engine.cuh): a draft tree node's candidates and
// their probabilities without the row leaving the GPU (oj_draft_tree).
constexpr int TOP_MAX = OJ_TREE_MAX_CHILDREN;
__device__ __forceinline__ bool top_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

__global__ void __launch_bounds__(1024) row_top_kernel(const float *__restrict__ x, int width, const int32_t *__restrict__ ids,
                                                       int k, TreeTop *__restrict__ out) {
    pdl_launch_dependents();
    pdl_wait();
    float tv[TOP_MAX];
    int ti[TOP_MAX];
#pragma unroll
    for (int j = 0; j < TOP_MAX; ++j) tv[j] = -INFINITY, ti[j] = 0x7fffffff;
    float m = -INFINITY, sum = 0.0f;   // online max and sum of exp(x - m) of the finite values
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = x[i];
        if (!(v > -INFINITY && v < INFINITY)) continue;   // -inf, +inf and NaN: never a candidate
        if (v > m) {
            sum = sum * expf(m - v) + 1.0f;
            m = v;
        } else {
            sum += expf(v - m);
        }
        if (top_before(v, i, tv[TOP_MAX - 1], ti[TOP_MAX - 1])) {   // insert, keeping the order
            float cv = v;
            int ci = i;
#pragma unroll
            for (int j = 0; j < TOP_MAX; ++j)
                if (top_before(cv, ci, tv[j], ti[j])) {
                    const float sv = tv[j];
                    const int si = ti[j];
                    tv[j] = cv, ti[j] = ci, cv = sv, ci = si;
                }
        }
    }
    __shared__ float sm[1024], ss[1024];
    __shared__ int si[1024];
    sm[threadIdx.x] = m;
    ss[threadIdx.x] = sum;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h >>= 1) {
        if (threadIdx.x < h) {
            const float m1 = sm[threadIdx.x], m2 = sm[threadIdx.x + h], mm = fmaxf(m1, m2);
            if (mm > -INFINITY)
                ss[threadIdx.x] = (m1 > -INFINITY ? ss[threadIdx.x] * expf(m1 - mm) : 0.0f) +
                                  (m2 > -INFINITY ? ss[threadIdx.x + h] * expf(m2 - mm) : 0.0f);
            sm[threadIdx.x] = mm;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out->max = sm[0], out->sum = ss[0];
    __syncthreads();
    // k rounds: every thread offers its best remaining candidate; the block's best is taken
    int head = 0;
    for (int r = 0; r < k; ++r) {
        float hv = -INFINITY;
        int hi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < TOP_MAX; ++j)
            if (j == head) hv = tv[j], hi = ti[j];
        const int win = block_argmax(hv, hi, sm, si);
        if (hi == win && hi != 0x7fffffff) ++head;
        if (threadIdx.x == 0) {
            const bool real = win != 0x7fffffff;
            out->id[r] = real ? (ids ? ids[win] : win) : -1;
            out->val[r] = real ? x[win] : -INFINITY;
        }
        __syncthreads();
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

void argmax_rows(const float *x, int32_t *out, int n, int width, const RowScratch &rs, cudaStream_t st) {
    const int blocks = (width + ROW_CHUNK - 1) / ROW_CHUNK;
    if (blocks > ROW_MAX_BLOCKS || n > OJ_MAX_POSITIONS)
        fail(OJ_ERR_INVALID_ARGUMENT, "argmax_rows: " + std::to_string(n) + " rows of " + std::to_string(width) + " values");
    check_cuda(launch(argmax_kernel, dim3(blocks, n), 1024, 0, st, x, out, width, rs.argmax_part, rs.done), "argmax");
}

void map_ids(int32_t *out, const int32_t *ids, int n, cudaStream_t st) {
    check_cuda(launch(map_ids_kernel, 1, 32, 0, st, out, ids, n), "map_ids");
}

void row_top(const float *x, int width, const int32_t *ids, int k, TreeTop *out, cudaStream_t st) {
    if (k < 1 || k > TOP_MAX) fail(OJ_ERR_INVALID_ARGUMENT, "row_top: k must be 1.." + std::to_string(TOP_MAX));
    check_cuda(launch(row_top_kernel, 1, 1024, 0, st, x, width, ids, k, out), "row_top");
}

void compact_rows(const CompactJob *jobs, int n_jobs, int max_row_words, uint64_t path, int n_path, cudaStream_t st) {
    if (n_path > OJ_MAX_TREE_NODES)
        fail(OJ_ERR_INVALID_ARGUMENT, "compact_rows: a path of " + std::to_string(n_path) + " nodes (a tree has at most 8)");
    if (n_jobs == 0) return;
    const int per_job = std::min(8, (max_row_words + 255) / 256);
    check_cuda(launch(compact_rows_kernel, dim3(n_jobs, per_job), 256, 0, st, jobs, path, n_path), "compact_rows");
}

void fault_probe(int32_t *out, cudaStream_t st) {
    fault_probe_kernel<<<1, 32, 0, st>>>(out);
    check_launch("fault_probe");
}

}  // namespace oj
