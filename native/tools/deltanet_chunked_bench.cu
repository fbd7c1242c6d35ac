// deltanet_chunked_bench.cu: correctness and speed of deltanet_chunked.cuh (the chunked Gated
// DeltaNet recurrence of a prefill pass on the fp16 tensor cores) against the engine's sequential
// kernel on the 27B shapes (48 value heads, 16 key heads, d = 128).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -Xptxas -v -Inative native/tools/deltanet_chunked_bench.cu -o dnb
//   ./dnb                                 (scripts/gpu.sh deltanet builds and runs it)
//
// Per P in {1, 70, 64, 512, 777, 2048}: random inputs in the shape of a pass (q, k heads L2-normed,
// q / sqrt(d), as after deltanet_qk_norm_kernel; v of SiLU scale; raw beta and alpha; per-head
// dt_bias and ssm_a spanning slow (decay ~0.999) to fast heads), a nonzero initial state; both
// kernels from the same state, outputs poisoned with NaN before each run. Checks:
//   output: max |chunked - sequential| / max |sequential| <= 2e-3 (every value finite);
//   final state: relative L2 <= 1e-3, and <= 1e-2 on the worst head;
//   nothing written past the pass: output rows P .. P_MAX - 1 still hold the poison, and the
//   coefficient buffer (given exactly deltanet_chunked_coef_bytes(P) bytes) untouched past that size.
// Timing: CUDA events, median of 10 runs (state restored before each, outside the timed region),
// positions/s and the time of the 48 DeltaNet layers of the 27B at that P. Exit 1 on a failed check.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine.cuh"
#include "reduce.cuh"

#include "tools/harness.cuh"

#include "deltanet_chunked.cuh"
#include "deltanet_step.cuh"

using namespace oj;

// The engine's sequential recurrence (deltanet_step.cuh's recurrence_row, as
// deltanet_recurrence_kernel runs it for a prefill pass: nothing to replay, commit).
namespace sequential {
template <int S>
__global__ void __launch_bounds__(128)
recurrence(const float *__restrict__ conv_out, const float *__restrict__ beta_raw, const float *__restrict__ alpha_raw, int n,
           const float *__restrict__ dt_bias, const float *__restrict__ ssm_a, float *__restrict__ state,
           float *__restrict__ out, int C, int key_dim, int n_key_heads, int n_v_heads) {
    recurrence_row<S>(blockIdx.x, blockIdx.y * 4 + (threadIdx.x >> 5), threadIdx.x & 31, nullptr, nullptr, nullptr, 0, conv_out,
                      beta_raw, alpha_raw, n, dt_bias, ssm_a, state, out, C, key_dim, n_key_heads, n_v_heads, true);
}
}  // namespace sequential

static int g_failures = 0;

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    constexpr int D = 128;
    const int Hk = 16, Hv = 48, LAYERS = 48, RUNS = 10;
    ModelDims dims{};
    dims.hp.ssm_d_state = D;
    dims.hp.ssm_n_group = Hk;
    dims.hp.ssm_dt_rank = Hv;
    const int key_dim = dims.ssm_key_dim(), conv_dim = dims.ssm_conv_dim();
    const int P_MAX = 2048;
    const int PS[] = {1, 70, 64, 512, 777, 2048};

    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);

    // inputs for the largest pass; smaller passes use its first P rows
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    auto silu_h = [](float x) { return x / (1.0f + std::exp(-x)); };
    std::vector<float> conv((size_t)P_MAX * conv_dim), beta((size_t)P_MAX * Hv), alpha((size_t)P_MAX * Hv);
    for (int p = 0; p < P_MAX; ++p) {
        float *row = conv.data() + (size_t)p * conv_dim;
        for (int c = 0; c < conv_dim; ++c) row[c] = silu_h(nd(rng) * (c < 2 * key_dim ? 1.5f : 2.0f));
        for (int hh = 0; hh < 2 * Hk; ++hh) {   // L2 norm of q and k heads, q also / sqrt(d)
            double ss = 0;
            for (int i = 0; i < D; ++i) ss += (double)row[hh * D + i] * row[hh * D + i];
            const float sc = (float)(1.0 / std::sqrt(ss + 1e-6)) * (hh < Hk ? 1.0f / std::sqrt((float)D) : 1.0f);
            for (int i = 0; i < D; ++i) row[hh * D + i] *= sc;
        }
        for (int h = 0; h < Hv; ++h) {
            beta[(size_t)p * Hv + h] = 2.0f * nd(rng);
            alpha[(size_t)p * Hv + h] = nd(rng);
        }
    }
    std::vector<float> dt_bias(Hv), ssm_a(Hv), state0((size_t)Hv * D * D);
    for (int h = 0; h < Hv; ++h) {   // heads from slow (a ~ -e^-6: decay ~0.999) to fast (a ~ -e^1.5)
        dt_bias[h] = -1.0f + 2.0f * ud(rng);
        ssm_a[h] = -std::exp(-6.0f + 7.5f * h / (Hv - 1));
    }
    for (auto &x : state0) x = 0.5f * nd(rng);

    float *d_conv, *d_beta, *d_alpha, *d_bias, *d_a, *d_state, *d_state0, *d_out_seq, *d_out_chk;
    const size_t out_n = (size_t)P_MAX * Hv * D, st_n = state0.size();
    CK(cudaMalloc(&d_conv, conv.size() * 4));
    CK(cudaMalloc(&d_beta, beta.size() * 4));
    CK(cudaMalloc(&d_alpha, alpha.size() * 4));
    CK(cudaMalloc(&d_bias, Hv * 4));
    CK(cudaMalloc(&d_a, Hv * 4));
    CK(cudaMalloc(&d_state, st_n * 4));
    CK(cudaMalloc(&d_state0, st_n * 4));
    CK(cudaMalloc(&d_out_seq, out_n * 4));
    CK(cudaMalloc(&d_out_chk, out_n * 4));
    CK(cudaMemcpy(d_conv, conv.data(), conv.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_beta, beta.data(), beta.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_alpha, alpha.data(), alpha.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_bias, dt_bias.data(), Hv * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_a, ssm_a.data(), Hv * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_state0, state0.data(), st_n * 4, cudaMemcpyHostToDevice));

    Layer L;
    L.dt_bias = d_bias;
    L.ssm_a = d_a;
    L.ssm_state = d_state;
    cudaStream_t st = 0;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    auto run_seq = [&](int P) {
        sequential::recurrence<D><<<dim3(Hv, D / 4), 128, 0, st>>>(d_conv, d_beta, d_alpha, P, d_bias, d_a, d_state, d_out_seq,
                                                                 conv_dim, key_dim, Hk, Hv);
        check_launch("sequential recurrence (copy)");
    };
    const size_t coef_bytes = deltanet_chunked_coef_bytes(dims, P_MAX);
    void *d_coef = nullptr;
    CK(cudaMalloc(&d_coef, coef_bytes));
    // exactly the bytes a pass of P needs (as the engine sizes PrefillScratch.dn_coef), so that a write past them shows
    auto run_chk = [&](int P) {
        deltanet_chunked(dims, L, d_conv, d_beta, d_alpha, d_out_chk, P, d_coef, deltanet_chunked_coef_bytes(dims, P), st);
    };
    std::vector<unsigned char> coef_host(coef_bytes);
    auto poison = [&](float *p) { CK(cudaMemsetAsync(p, 0xFF, out_n * 4, st)); };   // 0xFFFFFFFF is a NaN
    auto reset_state = [&]() { CK(cudaMemcpyAsync(d_state, d_state0, st_n * 4, cudaMemcpyDeviceToDevice, st)); };
    auto time_it = [&](auto &&fn, int P) {
        std::vector<float> ms;
        for (int r = 0; r < RUNS + 2; ++r) {
            reset_state();
            CK(cudaEventRecord(e0, st));
            fn(P);
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float t;
            CK(cudaEventElapsedTime(&t, e0, e1));
            if (r >= 2) ms.push_back(t);
        }
        return median(ms);
    };

    std::vector<float> o_seq(out_n), o_chk(out_n), s_seq(st_n), s_chk(st_n);
    std::printf("%6s %12s %12s %12s %12s %10s %10s %12s %12s %8s\n", "P", "out err", "state L2", "worst head", "seq ms",
                "chunk ms", "speedup", "seq pos/s", "chunk pos/s", "48L ms");
    for (int P : PS) {
        reset_state();
        poison(d_out_seq);
        run_seq(P);
        CK(cudaMemcpyAsync(s_seq.data(), d_state, st_n * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaMemcpyAsync(o_seq.data(), d_out_seq, (size_t)P * Hv * D * 4, cudaMemcpyDeviceToHost, st));
        reset_state();
        poison(d_out_chk);
        CK(cudaMemsetAsync(d_coef, 0xA5, coef_bytes, st));   // a canary past the bytes this pass may use
        run_chk(P);
        CK(cudaMemcpyAsync(s_chk.data(), d_state, st_n * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaMemcpyAsync(o_chk.data(), d_out_chk, out_n * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaMemcpyAsync(coef_host.data(), d_coef, coef_bytes, cudaMemcpyDeviceToHost, st));
        CK(cudaStreamSynchronize(st));
        // positions past P write nothing: rows P.. keep the poison bit pattern, the coefficients stay in their bytes
        size_t stray_out = 0, stray_coef = 0;
        for (size_t i = (size_t)P * Hv * D; i < out_n; ++i) {
            uint32_t bits;
            std::memcpy(&bits, &o_chk[i], 4);
            stray_out += bits != 0xFFFFFFFFu;
        }
        for (size_t i = deltanet_chunked_coef_bytes(dims, P); i < coef_bytes; ++i) stray_coef += coef_host[i] != 0xA5;
        double max_ref = 0, max_err = 0;
        bool finite = true;
        for (size_t i = 0; i < (size_t)P * Hv * D; ++i) {
            if (!std::isfinite(o_chk[i]) || !std::isfinite(o_seq[i])) finite = false;
            max_ref = std::max(max_ref, (double)std::fabs(o_seq[i]));
            max_err = std::max(max_err, (double)std::fabs(o_chk[i] - o_seq[i]));
        }
        double num = 0, den = 0, worst = 0;
        for (int h = 0; h < Hv; ++h) {
            double nh = 0, dh = 0;
            for (size_t i = (size_t)h * D * D; i < (size_t)(h + 1) * D * D; ++i) {
                if (!std::isfinite(s_chk[i])) finite = false;
                const double dlt = (double)s_chk[i] - s_seq[i];
                nh += dlt * dlt;
                dh += (double)s_seq[i] * s_seq[i];
            }
            num += nh;
            den += dh;
            worst = std::max(worst, std::sqrt(nh / std::max(dh, 1e-300)));
        }
        const double out_err = max_err / std::max(max_ref, 1e-30), st_err = std::sqrt(num / std::max(den, 1e-300));
        const bool ok = finite && out_err <= 2e-3 && st_err <= 1e-3 && worst <= 1e-2 && !stray_out && !stray_coef;
        const float t_seq = time_it(run_seq, P), t_chk = time_it(run_chk, P);
        std::printf("%6d %12.3e %12.3e %12.3e %12.4f %10.4f %9.1fx %12.0f %12.0f %8.2f\n", P, out_err, st_err, worst, t_seq,
                    t_chk, t_seq / t_chk, P / (t_seq * 1e-3), P / (t_chk * 1e-3), LAYERS * t_chk);
        if (!ok) {
            std::printf("FAIL P=%d: %s output %.3e (bar 2e-3), state %.3e (bar 1e-3), worst head %.3e (bar 1e-2); "
                        "%zu output values written past row P, %zu coefficient bytes written past deltanet_chunked_coef_bytes(P)\n",
                        P, finite ? "" : "NON-FINITE VALUES;", out_err, st_err, worst, stray_out, stray_coef);
            ++g_failures;
        }
    }
    std::printf("48 DeltaNet layers at P = 2048: see the 48L ms column (chunked); sequential = 48 x seq ms\n");
    std::printf("%s\n", g_failures ? "FAILED" : "all checks passed");
    return g_failures ? 1 : 0;
}
