// row_select_bench.cu: checks and times the row kernels over a vocabulary: elementwise.cu's
// argmax_rows (ROW_CHUNK values a block, the row's last block merging) and sample.cu's sample_top,
// sample_draft and sample_verify (oj_cycle_sampled's draws).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Inative native/tools/row_select_bench.cu native/sample.cu \
//        native/elementwise.cu -o rsb          (scripts/gpu.sh row-select builds and runs it)
//
// Checks (each failure prints FAIL, exit 1); every output NaN- or -7-poisoned before each call:
//   - argmax_rows against the host's first index of the largest value (NaN never wins, a row with
//     no value above -FLT_MAX gives 0) on widths 1,000 / 8,192 / 8,193 / 32,768 / 248,320 and
//     1 / 5 / 8 rows, with planted ties (the largest value several times), NaN, +-inf and all -inf
//     rows; each call three times in a row (the counters reset by the merging block): the same;
//   - sample_top against the host's k largest finite values (value descending, index ascending;
//     n = min(k, finite values)), k 1 / 8 / 40 / 64, on the same rows and on rows of few distinct
//     values (ties across the k-th), ids mapped through a permutation when set; entries past n
//     untouched;
//   - sample_draft's distribution against the host's candidate_distribution (temperature, min-p,
//     top-p over the pool's temperature-1 mass) to 1e-12, and its draws over 200,000 seeds against
//     it (chi-square, reported with its p-value by the Wilson-Hilferty approximation);
//   - sample_verify with one draft drawn from q: the emitted token over 200,000 seeds against p
//     (chi-square), with q far from p; the draft's acceptance rate against sum min(p, q).
// Timing (CUDA events, median of 20): argmax_rows against argmax_reference_kernel (the one-block
// kernel it replaced, kept here as the reference) and sample_top, at 248,320 values, 1 and 5 rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "engine.cuh"
#include "pdl.cuh"
#include "reduce.cuh"

#include "tools/harness.cuh"

using namespace oj;

namespace {

int g_fail = 0;
void check(bool ok, const std::string &what) {
    if (!ok) {
        std::printf("FAIL %s\n", what.c_str());
        ++g_fail;
    }
}

// The one-block argmax the multi-block kernel replaced (one block of 1024 threads a row).
__global__ void argmax_reference_kernel(const float *__restrict__ x, int32_t *__restrict__ out, int width) {
    const float *xr = x + (int64_t)blockIdx.x * width;
    float best = -FLT_MAX;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = xr[i];
        if (v > best) best = v, idx = i;
    }
    __shared__ float sv[1024];
    __shared__ int si[1024];
    const int i = block_argmax(best, idx, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = i == 0x7fffffff ? 0 : i;
}

int host_argmax(const float *r, int w) {
    float best = -FLT_MAX;
    int idx = 0x7fffffff;
    for (int i = 0; i < w; ++i)
        if (r[i] > best) best = r[i], idx = i;
    return idx == 0x7fffffff ? 0 : idx;
}

struct Cand {
    float v;
    int i;
};
std::vector<Cand> host_top(const float *r, int w, int k) {
    std::vector<Cand> c;
    for (int i = 0; i < w; ++i)
        if (std::isfinite(r[i])) c.push_back({r[i], i});
    std::stable_sort(c.begin(), c.end(), [](const Cand &a, const Cand &b) { return a.v > b.v; });
    if ((int)c.size() > k) c.resize(k);
    return c;
}

// sampling.candidate_distribution over the candidates (best first): probabilities of the survivors.
std::vector<double> host_dist(const std::vector<float> &vals, const oj_sampling &p) {
    const double top = vals[0];
    double total = 0;
    for (float v : vals) total += std::exp((double)v - top);
    int keep = (int)vals.size();
    if (p.min_p > 0) {
        keep = 0;
        while (keep < (int)vals.size() && (double)vals[keep] >= top + std::log((double)p.min_p)) ++keep;
    }
    if (p.top_p < 1) {
        double cum = 0;
        int last = keep;
        for (int j = 0; j < keep; ++j) {
            cum += std::exp((double)vals[j] - top);
            if (cum / total >= (double)p.top_p) {
                last = j + 1;
                break;
            }
        }
        keep = std::max(1, std::min(last, keep));
    }
    std::vector<double> e(keep);
    double s = 0;
    for (int j = 0; j < keep; ++j) s += e[j] = std::exp(((double)vals[j] - top) / (double)p.temperature);
    for (double &x : e) x /= s;
    return e;
}

// Upper tail of chi-square with df degrees of freedom at x (Wilson-Hilferty; a few percent in the tail).
double chi2_p(double x, int df) {
    const double z = (std::cbrt(x / df) - (1 - 2.0 / (9 * df))) / std::sqrt(2.0 / (9 * df));
    return 0.5 * std::erfc(z / std::sqrt(2.0));
}
double chi2(const std::vector<long> &obs, const std::vector<double> &prob, long n, int *df) {
    double x = 0;
    *df = -1;
    for (size_t j = 0; j < prob.size(); ++j) {
        const double e = prob[j] * n;
        if (e < 5) continue;   // bins too small for the statistic: left out
        x += (obs[j] - e) * (obs[j] - e) / e;
        ++*df;
    }
    return x;
}

enum Fill { RANDOM, TIES, FEW_VALUES, SPECIAL, ALL_NEG_INF };
void fill_row(float *r, int w, Fill f, std::mt19937 &g) {
    std::normal_distribution<float> nd(0.f, 3.f);
    for (int i = 0; i < w; ++i) r[i] = nd(g);
    if (f == TIES) {
        const float m = *std::max_element(r, r + w) + 1.0f;
        for (int t = 0; t < 5; ++t) r[g() % w] = m;
    } else if (f == FEW_VALUES) {
        for (int i = 0; i < w; ++i) r[i] = (float)(int)(r[i] * 0.5f);   // a handful of distinct values
    } else if (f == SPECIAL) {
        for (int t = 0; t < 7; ++t) r[g() % w] = NAN;
        for (int t = 0; t < 3; ++t) r[g() % w] = -INFINITY;
        r[g() % w] = INFINITY;   // never a top candidate (not finite); argmax takes it
    } else if (f == ALL_NEG_INF) {
        for (int i = 0; i < w; ++i) r[i] = (i % 3) ? -INFINITY : NAN;
    }
}

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main() {
    std::mt19937 g(1234);
    const int N = OJ_MAX_POSITIONS;
    const int W_MAX = 248320;
    float *dx;
    int32_t *dout, *dids;
    SampleTop *dtop;
    SampleDist *dq;
    RowScratch rs;
    CK(cudaMalloc(&dx, (size_t)N * W_MAX * 4));
    CK(cudaMalloc(&dout, 64 * 4));
    CK(cudaMalloc(&dids, W_MAX * 4));
    CK(cudaMalloc(&dtop, N * sizeof(SampleTop)));
    CK(cudaMalloc(&dq, N * sizeof(SampleDist)));
    CK(cudaMalloc(&rs.argmax_part, N * ROW_MAX_BLOCKS * sizeof(ArgmaxPart)));
    CK(cudaMalloc(&rs.top_part, N * ROW_MAX_BLOCKS * sizeof(SampleTop)));
    CK(cudaMalloc(&rs.done, 2 * N * 4));
    CK(cudaMemset(rs.done, 0, 2 * N * 4));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    std::vector<float> hx((size_t)N * W_MAX);
    std::vector<int32_t> perm(W_MAX);

    // --- argmax_rows and sample_top against the host --------------------------------------------
    int cases = 0;
    for (int w : {1000, 8192, 8193, 32768, 248320}) {
        for (int n : {1, 5, 8}) {
            for (Fill f : {RANDOM, TIES, FEW_VALUES, SPECIAL, ALL_NEG_INF}) {
                for (int r = 0; r < n; ++r) fill_row(&hx[(size_t)r * w], w, f, g);
                CK(cudaMemcpy(dx, hx.data(), (size_t)n * w * 4, cudaMemcpyHostToDevice));
                const std::string tag = "w " + std::to_string(w) + " n " + std::to_string(n) + " fill " + std::to_string(f);
                for (int rep = 0; rep < 3; ++rep) {
                    CK(cudaMemset(dout, 0xf9, 64 * 4));   // -7-ish poison
                    argmax_rows(dx, dout, n, w, rs, st);
                    CK(cudaStreamSynchronize(st));
                    int32_t got[64];
                    CK(cudaMemcpy(got, dout, sizeof got, cudaMemcpyDeviceToHost));
                    for (int r = 0; r < n; ++r)
                        check(got[r] == host_argmax(&hx[(size_t)r * w], w),
                              "argmax " + tag + " row " + std::to_string(r) + " rep " + std::to_string(rep) + ": " +
                                  std::to_string(got[r]) + " vs " + std::to_string(host_argmax(&hx[(size_t)r * w], w)));
                    check(got[n] == (int32_t)0xf9f9f9f9, "argmax " + tag + ": a row past n written");
                }
                for (int k : {1, 8, 40, 64}) {
                    for (int mapped = 0; mapped < 2; ++mapped) {
                        if (mapped) {
                            for (int i = 0; i < w; ++i) perm[i] = i;
                            std::shuffle(perm.begin(), perm.begin() + w, g);
                            CK(cudaMemcpy(dids, perm.data(), w * 4, cudaMemcpyHostToDevice));
                        }
                        CK(cudaMemset(dtop, 0xff, N * sizeof(SampleTop)));   // NaN values, id -1, n -1
                        sample_top(dx, w, w, mapped ? dids : nullptr, k, n, dtop, rs, st);
                        CK(cudaStreamSynchronize(st));
                        std::vector<SampleTop> got(N);
                        CK(cudaMemcpy(got.data(), dtop, N * sizeof(SampleTop), cudaMemcpyDeviceToHost));
                        for (int r = 0; r < n; ++r) {
                            const auto want = host_top(&hx[(size_t)r * w], w, k);
                            bool ok = got[r].n == (int)want.size();
                            for (int j = 0; ok && j < (int)want.size(); ++j)
                                ok = got[r].val[j] == want[j].v && got[r].id[j] == (mapped ? perm[want[j].i] : want[j].i);
                            for (int j = (int)want.size(); ok && j < OJ_SAMPLE_TOP_MAX; ++j) ok = got[r].id[j] == -1;
                            check(ok, "sample_top " + tag + " k " + std::to_string(k) + (mapped ? " mapped" : "") + " row " +
                                          std::to_string(r) + " (n " + std::to_string(got[r].n) + " vs " +
                                          std::to_string(want.size()) + ")");
                        }
                        if (n < N) check(got[n].n == -1, "sample_top " + tag + ": a row past n written");
                        ++cases;
                    }
                }
            }
        }
    }
    std::printf("argmax_rows / sample_top: %d cases checked against the host\n", cases);

    // --- sample_draft: the distribution and its draws ---------------------------------------------
    const oj_sampling settings[] = {{0.7f, 40, 0.95f, 0.05f, 0}, {1.3f, 64, 1.0f, 0.0f, 0}, {0.4f, 8, 0.5f, 0.0f, 0}};
    const int DRAWS = 200000;
    for (const oj_sampling &p0 : settings) {
        const int w = 32768;
        fill_row(hx.data(), w, RANDOM, g);
        CK(cudaMemcpy(dx, hx.data(), w * 4, cudaMemcpyHostToDevice));
        sample_top(dx, w, w, nullptr, p0.top_k, 1, dtop, rs, st);
        const auto top = host_top(hx.data(), w, p0.top_k);
        std::vector<float> vals;
        for (const Cand &c : top) vals.push_back(c.v);
        const auto want = host_dist(vals, p0);
        std::vector<long> seen(want.size() + 1, 0);
        int32_t *dtok;
        CK(cudaMalloc(&dtok, 4));
        double max_err = 0;
        for (int s = 0; s < DRAWS; ++s) {
            oj_sampling p = p0;
            p.seed = 0x5eed0000ull + s;
            sample_draft(dtop, p, 32, dq, dtok, st);
            int32_t tok;
            CK(cudaMemcpyAsync(&tok, dtok, 4, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
            int j = 0;
            while (j < (int)want.size() && top[j].i != tok) ++j;
            ++seen[j];   // j == want.size(): a token outside the survivors
            if (s == 0) {
                SampleDist q;
                CK(cudaMemcpy(&q, dq, sizeof q, cudaMemcpyDeviceToHost));
                check(q.n == (int)want.size(), "sample_draft: " + std::to_string(q.n) + " survivors vs " + std::to_string(want.size()));
                for (int m = 0; m < q.n && m < (int)want.size(); ++m) {
                    check(q.id[m] == top[m].i, "sample_draft: survivor order");
                    max_err = std::max(max_err, std::fabs(q.prob[m] - want[m]));
                }
            }
        }
        CK(cudaFree(dtok));
        int df;
        const double x = chi2(seen, want, DRAWS, &df);
        const double pv = df > 0 ? chi2_p(x, df) : 1.0;   // one survivor: no statistic, every draw must be it
        std::printf("sample_draft T %.2f top_k %d top_p %.2f min_p %.2f: %zu survivors, |q - host| max %.2e, chi2 %.1f df %d p %.3g\n",
                    p0.temperature, p0.top_k, p0.top_p, p0.min_p, want.size(), max_err, x, df, pv);
        check(seen.back() == 0, "sample_draft drew a token outside the survivors");
        check(max_err < 1e-12, "sample_draft's probabilities against the host's");
        check(pv > 1e-4, "sample_draft's draws against its distribution");
    }

    // --- sample_verify: one draft from q, the emitted token against p ----------------------------
    {
        const oj_sampling p0 = {1.0f, 16, 1.0f, 0.0f, 0};
        const int w = 4096;
        // row 0 (the target after the current token) and row 1; q: the draft's, far from row 0
        std::vector<float> rows(2 * w), qrow(w);
        fill_row(rows.data(), w, RANDOM, g);
        fill_row(rows.data() + w, w, RANDOM, g);
        for (int i = 0; i < w; ++i) qrow[i] = rows[i] + 2.0f * std::normal_distribution<float>(0.f, 1.f)(g);
        CK(cudaMemcpy(dx, rows.data(), 2 * w * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx + 2 * w, qrow.data(), w * 4, cudaMemcpyHostToDevice));
        const auto ptop = host_top(rows.data(), w, p0.top_k), qtop = host_top(qrow.data(), w, p0.top_k);
        std::vector<float> pv_, qv_;
        for (const Cand &c : ptop) pv_.push_back(c.v);
        for (const Cand &c : qtop) qv_.push_back(c.v);
        const auto pd = host_dist(pv_, p0), qd = host_dist(qv_, p0);
        double overlap = 0;   // sum min(p, q): the acceptance rate
        for (size_t a = 0; a < pd.size(); ++a)
            for (size_t b = 0; b < qd.size(); ++b)
                if (ptop[a].i == qtop[b].i) overlap += std::min(pd[a], qd[b]);
        sample_top(dx, w, w, nullptr, p0.top_k, 2, dtop, rs, st);
        SampleTop *dqtop;
        int32_t *dtoks, *dres;
        CK(cudaMalloc(&dqtop, sizeof(SampleTop)));
        CK(cudaMalloc(&dtoks, 2 * 4));
        CK(cudaMalloc(&dres, 2 * 4));
        sample_top(dx + 2 * w, w, w, nullptr, p0.top_k, 1, dqtop, rs, st);
        std::vector<long> seen(pd.size() + 1, 0);
        long accepted = 0;
        for (int s = 0; s < DRAWS; ++s) {
            oj_sampling p = p0;
            p.seed = 0xabc00000ull + s;
            int32_t draft;
            sample_draft(dqtop, p, 32, dq, dtoks + 1, st);   // the draft, as the previous call drew it
            CK(cudaMemcpyAsync(&draft, dtoks + 1, 4, cudaMemcpyDeviceToHost, st));
            p.seed ^= 0x9e3779b97f4a7c15ull;                 // the verifying call's own stream
            sample_verify(dtop, dtoks, dq, 2, p, dres, st);
            int32_t res[2];
            CK(cudaMemcpyAsync(res, dres, sizeof res, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
            const int emitted = res[0] == 1 ? draft : res[1];
            accepted += res[0] == 1;
            int j = 0;
            while (j < (int)pd.size() && ptop[j].i != emitted) ++j;
            ++seen[j];
        }
        int df;
        const double x = chi2(seen, pd, DRAWS, &df);
        const double pv = df > 0 ? chi2_p(x, df) : 1.0;
        const double rate = (double)accepted / DRAWS;
        std::printf("sample_verify: acceptance %.4f (sum min(p, q) %.4f), emitted token chi2 %.1f df %d p %.3g\n", rate,
                    overlap, x, df, pv);
        check(seen.back() == 0, "sample_verify emitted a token outside p's survivors");
        check(std::fabs(rate - overlap) < 5 * std::sqrt(overlap * (1 - overlap) / DRAWS), "the acceptance rate against sum min(p, q)");
        check(pv > 1e-4, "the emitted token against p");
        CK(cudaFree(dqtop));
        CK(cudaFree(dtoks));
        CK(cudaFree(dres));
    }

    // --- timing ------------------------------------------------------------------------------------
    {
        const int w = 248320;
        for (int r = 0; r < N; ++r) fill_row(&hx[(size_t)r * w], w, RANDOM, g);
        CK(cudaMemcpy(dx, hx.data(), (size_t)N * w * 4, cudaMemcpyHostToDevice));
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        for (int n : {1, 5}) {
            std::vector<float> t_ref, t_new, t_top;
            for (int rep = 0; rep < 20; ++rep) {
                float ms;
                CK(cudaEventRecord(a, st));
                argmax_reference_kernel<<<n, 1024, 0, st>>>(dx, dout, w);
                CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                CK(cudaEventElapsedTime(&ms, a, b));
                t_ref.push_back(ms * 1000);
                CK(cudaEventRecord(a, st));
                argmax_rows(dx, dout, n, w, rs, st);
                CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                CK(cudaEventElapsedTime(&ms, a, b));
                t_new.push_back(ms * 1000);
                CK(cudaEventRecord(a, st));
                sample_top(dx, w, w, nullptr, 40, n, dtop, rs, st);
                CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                CK(cudaEventElapsedTime(&ms, a, b));
                t_top.push_back(ms * 1000);
            }
            std::printf("248,320 values x %d rows: argmax one block (reference) %.1f us, argmax_rows %.1f us, sample_top k 40 %.1f us\n",
                        n, median(t_ref), median(t_new), median(t_top));
        }
    }
    CK(cudaDeviceSynchronize());
    if (g_fail) {
        std::printf("row_select_bench: %d FAILED\n", g_fail);
        return 1;
    }
    std::printf("row_select_bench: all checks passed\n");
    return 0;
}
