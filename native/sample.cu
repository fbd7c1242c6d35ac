// sample.cu: the draws of oj_cycle_sampled (issue 28) on the GPU. A row's top-k candidates by
// radix select in shared memory, a row's chunks in blocks of their own; their distribution under min-p, top-p and temperature as
// openjet_plugin.sampling.candidate_distribution makes it; the speculative acceptance rule of
// speculative.verify_sampled (accept draft d with probability min(1, p(d) / q(d)), else draw from
// max(0, p - q)); the uniforms from a counter-based stream of the call's seed. The rows never
// leave the GPU: a call copies back two ints a verify and one a draft.
#include <cfloat>

#include "engine.cuh"
#include "pdl.cuh"

namespace oj {

namespace {

constexpr int SELECT_THREADS = 1024;
constexpr int K = OJ_SAMPLE_TOP_MAX;   // a warp's lanes hold candidates lane and lane + 32
static_assert(K == 64, "the distribution's warp code takes two candidates a lane");

// Unsigned keys in the order of the floats they come from (finite values).
__device__ __forceinline__ uint32_t order_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ bool finite(float v) { return v > -INFINITY && v < INFINITY; }   // NaN fails both

// Uniform ctr of the stream `seed`, in [0, 1) with 53 bits (splitmix64 of seed + (ctr + 1) x the
// golden ratio): stateless, so each draw of a call has its own counter.
__device__ __forceinline__ double uniform(uint64_t seed, uint64_t ctr) {
    uint64_t z = seed + (ctr + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ double warp_scan_d(double v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// The k largest finite values among `count` values in shared memory (sv; their row indices si[j],
// or base + j without si), in (value descending, index ascending) order, into cv / ci unsorted
// (the caller ranks them); returns how many (min(k, the finite values)). Equal values must lie in
// ascending index order in sv. Radix select finds the k-th largest key 8 bits at a time (4 passes,
// the first also counting the finite values), then one pass in storage order takes every larger
// value and the first of the values equal to it. Every thread of the block calls it.
__device__ int block_select(const float *sv, const int *si, int base, int count, int k, float *cv, int *ci) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    __shared__ uint32_t hist[256];
    __shared__ uint32_t s_prefix, s_need, s_k, s_count;
    __shared__ uint32_t warp_eq[SELECT_THREADS / 32];
    uint32_t prefix = 0, mask = 0, need = 0, kk = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = t; b < 256; b += SELECT_THREADS) hist[b] = 0;
        __syncthreads();
        for (int j0 = 0; j0 < count; j0 += SELECT_THREADS) {   // the whole warp in every step
            const float v = j0 + t < count ? sv[j0 + t] : NAN;
            const uint32_t key = order_key(v);
            const bool take = finite(v) && (key & mask) == prefix;
            const uint32_t takers = __ballot_sync(0xffffffffu, take);
            if (take) {
                // logits share a few top bins: one add per bin a warp, not one per value
                const uint32_t bin = (key >> shift) & 255u;
                const uint32_t peers = __match_any_sync(takers, bin);
                if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        if (warp == 0) {
            // lane l: bins 255 - 8l down to 248 - 8l; counts from the top bin down
            uint32_t c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) sum += (c[j] = hist[255 - 8 * lane - j]);
            uint32_t incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            uint32_t nd = need;
            if (shift == 24) {   // every finite value is in this pass's bins
                nd = min((uint32_t)k, __shfl_sync(0xffffffffu, incl, 31));
                if (lane == 0) s_k = nd;
            }
            const uint32_t excl = incl - sum;
            if (nd > 0 && excl < nd && nd <= incl) {
                uint32_t acc = excl;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (acc + c[j] >= nd) {
                        s_prefix = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                        s_need = nd - acc;
                        break;
                    }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        kk = s_k;
        if (kk == 0) return 0;
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    // prefix: the k-th largest key; need: how many values equal to it the k take
    if (t == 0) s_count = 0;
    __syncthreads();
    uint32_t eq_before = 0;   // values equal to it in earlier tiles (the same in every thread)
    for (int j0 = 0; j0 < count; j0 += SELECT_THREADS) {
        const int j = j0 + t;
        const float v = j < count ? sv[j] : NAN;
        const bool ok = finite(v);
        const uint32_t key = order_key(v);
        const int idx = j < count ? (si ? si[j] : base + j) : 0;
        if (ok && key > prefix) {
            const uint32_t slot = atomicAdd(&s_count, 1u);
            cv[slot] = v, ci[slot] = idx;
        }
        const bool eq = ok && key == prefix;
        const int tile_eq = __syncthreads_count(eq);
        if (tile_eq == 0) continue;
        const uint32_t bal = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) warp_eq[warp] = __popc(bal);
        __syncthreads();
        if (eq) {
            uint32_t rank = eq_before + __popc(bal & ((1u << lane) - 1u));
            for (int w = 0; w < warp; ++w) rank += warp_eq[w];
            if (rank < need) {
                const uint32_t slot = atomicAdd(&s_count, 1u);
                cv[slot] = v, ci[slot] = idx;
            }
        }
        eq_before += tile_eq;
        __syncthreads();   // warp_eq is rewritten by the next tile
    }
    __syncthreads();
    return (int)kk;
}

// The place of candidate j among the kk in cv / ci: (value descending, index ascending).
__device__ __forceinline__ int select_rank(const float *cv, const int *ci, int kk, int j) {
    int rank = 0;
    for (int m = 0; m < kk; ++m) rank += cv[m] > cv[j] || (cv[m] == cv[j] && ci[m] < ci[j]);
    return rank;
}

// grid (blocks of the row, rows), SELECT_THREADS threads: each row's k largest finite values,
// ordered (value descending, index ascending), indices mapped through ids when set. Each block
// takes ROW_CHUNK values of its row into shared memory and leaves its own k best (a value of the
// row's k best is among its block's k best); the row's last block to finish selects from those,
// laid out block after block, each block's in order (so equal values lie in index order).
__global__ void __launch_bounds__(SELECT_THREADS)
    sample_top_kernel(const float *__restrict__ x, int64_t row_stride, int width, const int32_t *__restrict__ ids, int k,
                      SampleTop *__restrict__ out, SampleTop *__restrict__ part, uint32_t *__restrict__ done) {
    pdl_launch_dependents();
    pdl_wait();
    constexpr int PER = ROW_CHUNK / SELECT_THREADS;
    static_assert(2 * ROW_MAX_BLOCKS * K <= ROW_CHUNK, "the merge lays every block's candidates and ids in the chunk's room");
    const int t = threadIdx.x, row = blockIdx.y;
    const float *xr = x + row * row_stride;
    __shared__ float sv[ROW_CHUNK];
    int *si = reinterpret_cast<int *>(sv + ROW_MAX_BLOCKS * K);   // the merge's ids, past its values
    __shared__ float cv[K];
    __shared__ int ci[K];
    __shared__ int s_at[ROW_MAX_BLOCKS + 1];
    __shared__ bool last;
    const int c0 = blockIdx.x * ROW_CHUNK, n = min(ROW_CHUNK, width - c0);
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = j * SELECT_THREADS + t < n ? xr[c0 + j * SELECT_THREADS + t] : NAN;
#pragma unroll
    for (int j = 0; j < PER; ++j) sv[j * SELECT_THREADS + t] = v[j];
    __syncthreads();
    int kk = block_select(sv, nullptr, c0, n, k, cv, ci);
    SampleTop *pr = part + (int64_t)row * ROW_MAX_BLOCKS;
    if (t < kk) {
        const int r = select_rank(cv, ci, kk, t);
        pr[blockIdx.x].val[r] = cv[t];
        pr[blockIdx.x].id[r] = ci[t];
    }
    if (t == 0) pr[blockIdx.x].n = kk;
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(done + row, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (t == 0) {
        int at = 0;
        for (int b = 0; b < (int)gridDim.x; ++b) s_at[b] = at, at += __ldcg(&pr[b].n);
        s_at[gridDim.x] = at;
    }
    __syncthreads();
    for (int b = t / K; b < (int)gridDim.x; b += SELECT_THREADS / K) {
        const int j = t % K;
        if (s_at[b] + j < s_at[b + 1]) {
            sv[s_at[b] + j] = __ldcg(&pr[b].val[j]);
            si[s_at[b] + j] = __ldcg(&pr[b].id[j]);
        }
    }
    __syncthreads();
    kk = block_select(sv, si, 0, s_at[gridDim.x], k, cv, ci);
    if (t < kk) {
        const int r = select_rank(cv, ci, kk, t);
        out[row].val[r] = cv[t];
        out[row].id[r] = ids ? ids[ci[t]] : ci[t];
    }
    if (t == 0) {
        out[row].n = kk;
        done[row] = 0;   // for the next launch (which waits for this grid before reading it)
    }
}

// A row's distribution in one warp: lane l holds candidates l and l + 32 (id -1 and probability 0
// past the survivors). candidate_distribution's steps in its order: the pool's temperature-1
// weights and their total, the min-p prefix, the top-p prefix (the first whose cumulative mass over
// the total reaches top_p, that candidate included), softmax(logit / temperature) over it.
struct LaneDist {
    int32_t id[2];
    double prob[2];
    int n;
};
__device__ LaneDist warp_distribution(const SampleTop &c, const oj_sampling &p) {
    const int lane = threadIdx.x & 31;
    const int n = c.n;
    const double top = (double)c.val[0];
    LaneDist d;
    double v[2], w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        v[h] = j < n ? (double)c.val[j] : 0.0;
        w[h] = j < n ? exp(v[h] - top) : 0.0;
        d.id[h] = j < n ? c.id[j] : -1;
    }
    const double total = warp_sum_d(w[0] + w[1]);
    int keep = n;
    if (p.min_p > 0.0f) {
        const double cut = top + log((double)p.min_p);
        keep = __popc(__ballot_sync(0xffffffffu, lane < n && v[0] >= cut)) +
               __popc(__ballot_sync(0xffffffffu, lane + 32 < n && v[1] >= cut));
    }
    if (p.top_p < 1.0f) {
        const double a = warp_scan_d(lane < keep ? w[0] : 0.0);
        const double b = warp_scan_d(lane + 32 < keep ? w[1] : 0.0);
        const double a_total = __shfl_sync(0xffffffffu, a, 31);
        const uint32_t hit_a = __ballot_sync(0xffffffffu, lane < keep && a / total >= (double)p.top_p);
        const uint32_t hit_b = __ballot_sync(0xffffffffu, lane + 32 < keep && (a_total + b) / total >= (double)p.top_p);
        const int first = hit_a ? __ffs(hit_a) - 1 : hit_b ? 32 + __ffs(hit_b) - 1 : keep;
        keep = max(1, min(first + 1, keep));
    }
    const double inv_t = 1.0 / (double)p.temperature;
    double e[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) e[h] = lane + 32 * h < keep ? exp((v[h] - top) * inv_t) : 0.0;
    const double s = warp_sum_d(e[0] + e[1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        d.prob[h] = e[h] / s;
        if (lane + 32 * h >= keep) d.id[h] = -1;
    }
    d.n = keep;
    return d;
}

// The candidate at uniform u by inverse CDF over the weights r in candidate order (lane l's r[0]
// is candidate l, r[1] candidate l + 32): the first whose cumulative weight exceeds u x the sum
// (sampling.draw_token's rule); a zero weight is never drawn.
__device__ int32_t warp_draw(const int32_t id[2], const double r[2], double u) {
    const double a = warp_scan_d(r[0]);
    const double b = warp_scan_d(r[1]);
    const double a_total = __shfl_sync(0xffffffffu, a, 31);
    const double target = u * (a_total + __shfl_sync(0xffffffffu, b, 31));
    const uint32_t hit_a = __ballot_sync(0xffffffffu, r[0] > 0.0 && a > target);
    const uint32_t hit_b = __ballot_sync(0xffffffffu, r[1] > 0.0 && a_total + b > target);
    int j;
    if (hit_a || hit_b) {
        j = hit_a ? __ffs(hit_a) - 1 : 32 + __ffs(hit_b) - 1;
    } else {   // u x sum rounded to the sum itself: the last candidate with weight
        const uint32_t nz_a = __ballot_sync(0xffffffffu, r[0] > 0.0), nz_b = __ballot_sync(0xffffffffu, r[1] > 0.0);
        j = nz_b ? 32 + 31 - __clz(nz_b) : 31 - __clz(nz_a);
    }
    return __shfl_sync(0xffffffffu, j < 32 ? id[0] : id[1], j & 31);
}

// The probability the lane distribution d gives token `tok` (0 outside its survivors).
__device__ __forceinline__ double prob_of(const LaneDist &d, int32_t tok) {
    return warp_sum_d((d.id[0] == tok ? d.prob[0] : 0.0) + (d.id[1] == tok ? d.prob[1] : 0.0));
}
__device__ __forceinline__ double prob_of(const SampleDist &q, int32_t tok) {
    const int lane = threadIdx.x & 31;
    double v = 0.0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        if (j < q.n && q.id[j] == tok) v += q.prob[j];
    }
    return warp_sum_d(v);
}

// One warp: row i's distribution p_i; draft tokens[i + 1] (drawn from q[i]) is accepted with
// probability min(1, p_i(d) / q_i(d)) (uniform 2i), else the token is drawn from max(0, p_i - q_i)
// (uniform 2i + 1) and the cycle ends; after every draft accepted the token is drawn from the last
// row (uniform 2(n - 1) + 1).
__global__ void sample_verify_kernel(const SampleTop *__restrict__ cand, const int32_t *__restrict__ tokens,
                                     const SampleDist *__restrict__ q, int n, oj_sampling p, int32_t *__restrict__ out) {
    pdl_launch_dependents();
    pdl_wait();
    const int lane = threadIdx.x & 31;
    for (int i = 0; i < n; ++i) {
        if (cand[i].n == 0) {   // a row with no finite logit: the engine names it
            if (lane == 0) out[0] = i, out[1] = -1;
            return;
        }
        const LaneDist d = warp_distribution(cand[i], p);
        int32_t tok;
        if (i + 1 < n) {
            const int32_t draft = tokens[i + 1];
            const double pd = prob_of(d, draft), qd = prob_of(q[i], draft);
            if (qd > 0.0 && uniform(p.seed, 2 * i) * qd < pd) continue;   // u < p / q, qd > 0
            double r[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                double qv = 0.0;
                const int32_t id = d.id[h];
                if (id >= 0)
                    for (int j = 0; j < q[i].n; ++j)
                        if (q[i].id[j] == id) qv = q[i].prob[j];
                r[h] = id >= 0 ? fmax(0.0, d.prob[h] - qv) : 0.0;
            }
            const bool any = __any_sync(0xffffffffu, r[0] > 0.0 || r[1] > 0.0);
            // p <= q everywhere only when p = q up to rounding, where the draft is accepted always
            tok = any ? warp_draw(d.id, r, uniform(p.seed, 2 * i + 1)) : warp_draw(d.id, d.prob, uniform(p.seed, 2 * i + 1));
        } else {
            tok = warp_draw(d.id, d.prob, uniform(p.seed, 2 * i + 1));
        }
        if (lane == 0) out[0] = i, out[1] = tok;
        return;
    }
}

// One warp: the distribution of cand under p into *q and the token at uniform ctr into *token.
__global__ void sample_draft_kernel(const SampleTop *__restrict__ cand, oj_sampling p, int ctr, SampleDist *__restrict__ q,
                                    int32_t *__restrict__ token) {
    pdl_launch_dependents();
    pdl_wait();
    const int lane = threadIdx.x & 31;
    if (cand->n == 0) {   // no finite logit in the row: the engine names it
        if (lane == 0) q->n = 0, *token = -1;
        return;
    }
    const LaneDist d = warp_distribution(*cand, p);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        q->id[lane + 32 * h] = d.id[h];
        q->prob[lane + 32 * h] = d.prob[h];
    }
    if (lane == 0) q->n = d.n;
    const int32_t tok = warp_draw(d.id, d.prob, uniform(p.seed, ctr));
    if (lane == 0) *token = tok;
}

}  // namespace

void sample_top(const float *x, int64_t row_stride, int width, const int32_t *ids, int k, int n_rows, SampleTop *out,
                const RowScratch &rs, cudaStream_t st) {
    const int blocks = (width + ROW_CHUNK - 1) / ROW_CHUNK;
    if (k < 1 || k > K || blocks > ROW_MAX_BLOCKS || n_rows > OJ_MAX_POSITIONS)
        fail(OJ_ERR_INVALID_ARGUMENT, "sample_top: k " + std::to_string(k) + " over " + std::to_string(n_rows) + " rows of " +
                                          std::to_string(width) + " values");
    check_cuda(launch(sample_top_kernel, dim3(blocks, n_rows), SELECT_THREADS, 0, st, x, row_stride, width, ids, k, out,
                      rs.top_part, rs.done + OJ_MAX_POSITIONS),
               "sample_top");
}

void sample_verify(const SampleTop *cand, const int32_t *tokens, const SampleDist *q, int n, const oj_sampling &p,
                   int32_t *out, cudaStream_t st) {
    check_cuda(launch(sample_verify_kernel, 1, 32, 0, st, cand, tokens, q, n, p, out), "sample_verify");
}

void sample_draft(const SampleTop *cand, const oj_sampling &p, int ctr, SampleDist *q, int32_t *token, cudaStream_t st) {
    check_cuda(launch(sample_draft_kernel, 1, 32, 0, st, cand, p, ctr, q, token), "sample_draft");
}

}  // namespace oj
