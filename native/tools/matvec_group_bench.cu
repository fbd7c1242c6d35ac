// matvec_group_bench.cu: checks and times matvec.cu's matvec_group (a layer's projections of one
// normed input in one fp16 launch, matvec_f16.cuh's run_group) against the same matrices one
// matvec each, on the 27B Q4_K_M map's groups.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Inative -Xcompiler -fopenmp native/tools/matvec_group_bench.cu \
//        native/matvec.cu native/elementwise.cu native/deltanet.cu -o mvg -lgomp        (scripts/gpu.sh matvec-group builds and runs it)
//
// Per group: random valid blocks (bench_blocks.cuh) for each member, 8 activation vectors (one
// 300x larger). Checks (each failure prints FAIL, exit 1), with the f16 path forced:
//   - every output written: each member's y NaN-poisoned before every call, none left for n = 1..8;
//     vectors n..7 of every member left untouched (still the poison);
//   - vector v of every n-vector call bit-identical to a 1-vector group call on x[v] (the group's
//     split depends on the shapes only);
//   - each member against the float64 dequant times the unrounded x on 48 sampled rows:
//     |y - ref| <= 2e-3 * sum_k |w_k x_k|;
//   - each member against its own matvec (another split, so another summation grouping):
//     max |y - y_alone| <= 1e-5 * rms(y_alone) per vector;
//   - the group called three times in a row on one workspace (the split-K counters of the launch's
//     tiles must be back at 0 after each call): bit-identical each time.
// Timing (CUDA events, median of RUNS, L2 flushed before each run): the group call against the
// members' matvecs one after the other (each its own prep + matvec), n = 1 and 5; the group under
// each forced configuration (OJ_MVF16_CFG = warps,stages) at n = 1; the 27B pass line sums count x
// median over the map's groups.
// Environment: MVG_ONLY=<group> runs that group only; MVG_PROFILE=1 skips checks and timing and
// makes 3 group calls at n = 1 (the kernel for a profiler: scripts/gpu.sh matvec-group --ncu).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine.cuh"
#include "matvec_f16.cuh"

#include "tools/harness.cuh"

using namespace oj;

static int g_failures = 0;
static int RUNS = 15;

#include "bench_blocks.cuh"

struct Member { int type; int64_t M; const char *name; };
struct Group { const char *name; int64_t K; std::vector<Member> members; int count; };

static const char *CFGS[] = {"4,2", "4,3", "8,2", "8,3"};
constexpr int NCFG = sizeof(CFGS) / sizeof(CFGS[0]);
static bool g_profile = false;

struct Timing { double group_ms[2] = {0, 0}, alone_ms[2] = {0, 0}, cfg_ms[NCFG] = {0}; size_t bytes = 0; };

static Timing run_group_case(const Group &gr, uint64_t seed) {
    Timing tm;
    const int64_t K = gr.K;
    const int n = (int)gr.members.size();
    std::vector<Matrix> w(n);
    std::vector<std::vector<uint8_t>> files(n);
    for (int i = 0; i < n; ++i) {
        size_t b = 0;
        files[i] = make_matrix(gr.members[i].type, K, gr.members[i].M, seed * 31 + i);
        w[i] = upload_matrix(gr.members[i].type, K, gr.members[i].M, files[i], &b);
        tm.bytes += b;
    }
    Rng g(seed ^ 0x5151ull);
    std::vector<float> x(8 * K);
    for (int v = 0; v < 8; ++v) {
        const float scale = v == 7 ? 300.0f : 0.5f + v;
        for (int64_t k = 0; k < K; ++k) x[v * K + k] = g.normalish() * scale;
    }
    float *dx;
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    std::vector<float *> dy(n), dy1(n), dya(n);
    for (int i = 0; i < n; ++i) {
        CK(cudaMalloc(&dy[i], 8 * w[i].M * 4));
        CK(cudaMalloc(&dy1[i], 8 * w[i].M * 4));
        CK(cudaMalloc(&dya[i], 8 * w[i].M * 4));
    }
    std::vector<const Matrix *> wp(n);
    for (int i = 0; i < n; ++i) wp[i] = &w[i];
    auto fetch = [&](const float *d, int64_t count) {
        std::vector<float> h((size_t)count);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost));
        return h;
    };
    auto fail_case = [&](const char *what, int member, int nv, double v) {
        std::printf("FAIL group %s member %s (%s) n=%d %s: %.3e\n", gr.name, gr.members[member].name,
                    type_name(gr.members[member].type), nv, what, v);
        ++g_failures;
    };
    const uint32_t POISON = 0xFFFFFFFFu;
    matvec_force_path(2);
    if (g_profile) {
        for (int rep = 0; rep < 3; ++rep) matvec_group(wp.data(), dy.data(), n, dx, 1, 0);
        CK(cudaDeviceSynchronize());
        std::printf("%s: 3 group calls at n = 1 (profile mode)\n", gr.name);
    } else {
    // 1-vector group calls on each x[v]
    for (int i = 0; i < n; ++i) CK(cudaMemset(dy1[i], 0xFF, 8 * w[i].M * 4));
    for (int v = 0; v < 8; ++v) {
        std::vector<float *> yv(n);
        for (int i = 0; i < n; ++i) yv[i] = dy1[i] + (size_t)v * w[i].M;
        matvec_group(wp.data(), yv.data(), n, dx + (size_t)v * K, 1, 0);
    }
    CK(cudaGetLastError());
    std::vector<std::vector<float>> y1(n);
    for (int i = 0; i < n; ++i) y1[i] = fetch(dy1[i], 8 * w[i].M);
    for (int nv = 1; nv <= 8; ++nv) {
        for (int i = 0; i < n; ++i) CK(cudaMemset(dy[i], 0xFF, 8 * w[i].M * 4));
        matvec_group(wp.data(), dy.data(), n, dx, nv, 0);
        CK(cudaGetLastError());
        for (int i = 0; i < n; ++i) {
            const int64_t M = w[i].M;
            const std::vector<float> y = fetch(dy[i], 8 * M);
            int64_t unwritten = 0, differ = 0, past = 0;
            for (size_t j = 0; j < (size_t)nv * M; ++j) {
                unwritten += !std::isfinite(y[j]);
                differ += std::memcmp(&y[j], &y1[i][j], 4) != 0;
            }
            for (size_t j = (size_t)nv * M; j < y.size(); ++j) past += std::memcmp(&y[j], &POISON, 4) != 0;
            if (unwritten) fail_case("outputs not finite (count)", i, nv, (double)unwritten);
            if (differ) fail_case("outputs differing from the 1-vector group calls (count)", i, nv, (double)differ);
            if (past) fail_case("outputs of vectors past n written (count)", i, nv, (double)past);
        }
    }
    // float64 on sampled rows, and each member alone (its own matvec: another split)
    for (int i = 0; i < n; ++i) {
        const int64_t M = w[i].M;
        std::vector<int64_t> srows;
        for (int r = 0; r < 48; ++r) srows.push_back(M == 1 ? 0 : (int64_t)((double)r / 47 * (M - 1)));
        std::vector<int> spos = {0, 1, 2, 3, 4, 5, 6, 7};
        std::vector<double> ref, mag;
        sampled_reference(gr.members[i].type, K, files[i], x, srows, spos, ref, mag);
        double worst = 0;
        for (size_t r = 0; r < srows.size(); ++r)
            for (int v = 0; v < 8; ++v)
                worst = std::max(worst, std::fabs(y1[i][(size_t)v * M + srows[r]] - ref[r * 8 + v]) / mag[r * 8 + v]);
        if (!(worst <= 2e-3)) fail_case("error / sum|w x| vs float64 (tol 2e-3)", i, 8, worst);
        CK(cudaMemset(dya[i], 0xFF, 8 * M * 4));
        matvec(w[i], dx, dya[i], 8, false, 0);
        const std::vector<float> ya = fetch(dya[i], 8 * M);
        double dmax = 0;
        for (int v = 0; v < 8; ++v) {
            double ss = 0;
            for (int64_t m = 0; m < M; ++m) ss += (double)ya[(size_t)v * M + m] * ya[(size_t)v * M + m];
            const double rms = std::sqrt(ss / M) + 1e-30;
            for (int64_t m = 0; m < M; ++m) {
                const double d = std::fabs((double)y1[i][(size_t)v * M + m] - ya[(size_t)v * M + m]) / rms;
                dmax = std::max(dmax, std::isfinite(d) ? d : 1e30);
            }
        }
        if (!(dmax <= 1e-5)) fail_case("max |group - alone| / rms (tol 1e-5)", i, 8, dmax);
        std::printf("  %s %-9s %-5s M %6lld: vs float64 %.2e of sum|wx|, vs alone %.2e of rms\n", gr.name,
                    gr.members[i].name, type_name(gr.members[i].type), (long long)M, worst, dmax);
    }
    // three calls in a row on one workspace
    for (int rep = 0; rep < 3; ++rep) {
        for (int i = 0; i < n; ++i) CK(cudaMemset(dy[i], 0xFF, 8 * w[i].M * 4));
        matvec_group(wp.data(), dy.data(), n, dx, 8, 0);
        for (int i = 0; i < n; ++i) {
            const std::vector<float> y = fetch(dy[i], 8 * w[i].M);
            int64_t differ = 0;
            for (size_t j = 0; j < y.size(); ++j) differ += std::memcmp(&y[j], &y1[i][j], 4) != 0;
            if (differ) fail_case("repeated group call differing (count)", i, 8, (double)differ);
        }
    }
    // timing
    for (int j = 0; j < 2; ++j) {
        const int nv = j ? 5 : 1;
        tm.group_ms[j] = median_ms([&] { matvec_group(wp.data(), dy.data(), n, dx, nv, 0); });
        tm.alone_ms[j] = median_ms([&] {
            for (int i = 0; i < n; ++i) matvec(w[i], dx, dy[i], nv, false, 0);
        });
    }
    for (int c = 0; c < NCFG; ++c) {
        setenv("OJ_MVF16_CFG", CFGS[c], 1);
        tm.cfg_ms[c] = median_ms([&] { matvec_group(wp.data(), dy.data(), n, dx, 1, 0); });
    }
    unsetenv("OJ_MVF16_CFG");
    std::printf("%-12s %7.1f MB x %2d: group n=1 %7.4f ms (%5.0f GB/s) alone %7.4f ms | n=5 group %7.4f alone %7.4f | "
                "n=1 forced warps,stages",
                gr.name, tm.bytes / 1e6, gr.count, tm.group_ms[0], tm.bytes / (tm.group_ms[0] * 1e-3) / 1e9,
                tm.alone_ms[0], tm.group_ms[1], tm.alone_ms[1]);
    for (int c = 0; c < NCFG; ++c) std::printf(" %s %7.4f", CFGS[c], tm.cfg_ms[c]);
    std::printf("\n");
    std::fflush(stdout);
    }
    matvec_force_path(-1);
    for (int i = 0; i < n; ++i) {
        CK(cudaFree(w[i].data));
        CK(cudaFree(dy[i]));
        CK(cudaFree(dy1[i]));
        CK(cudaFree(dya[i]));
    }
    CK(cudaFree(dx));
    return tm;
}

int main() {
    if (const char *r = std::getenv("MB_RUNS")) RUNS = std::max(5, std::atoi(r));
    const char *only = std::getenv("MVG_ONLY");
    g_profile = std::getenv("MVG_PROFILE") && std::strcmp(std::getenv("MVG_PROFILE"), "1") == 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    CK(cudaMalloc(&g_flush, FLUSH_BYTES));
    // the 27B Q4_K_M map's groups (tools/matvec_f16_bench.cu's counts): DeltaNet layers' qkv (Q4_K in
    // 24, Q6_K in 24: the Q6_K one runs alone, the other three grouped), gate, beta, alpha; the
    // attention layers' q, k, v (k / v Q6_K in 9 of 17); the FFN's gate and up (64 + MTP's 1)
    const std::vector<Group> groups = {
        {"deltanet", 5120, {{TYPE_Q4_K, 10240, "qkv"}, {TYPE_Q4_K, 6144, "gate"}, {TYPE_Q4_K, 48, "beta"}, {TYPE_Q4_K, 48, "alpha"}}, 24},
        {"deltanet6", 5120, {{TYPE_Q6_K, 10240, "qkv"}, {TYPE_Q4_K, 6144, "gate"}, {TYPE_Q4_K, 48, "beta"}, {TYPE_Q4_K, 48, "alpha"}}, 24},
        {"attention", 5120, {{TYPE_Q4_K, 12288, "q"}, {TYPE_Q4_K, 1024, "k"}, {TYPE_Q4_K, 1024, "v"}}, 8},
        {"attention6", 5120, {{TYPE_Q4_K, 12288, "q"}, {TYPE_Q6_K, 1024, "k"}, {TYPE_Q6_K, 1024, "v"}}, 9},
        {"ffn", 5120, {{TYPE_Q4_K, 17408, "gate"}, {TYPE_Q4_K, 17408, "up"}}, 65},
        // edge: a partial last tile in every member, members of 1 tile, one super-block per row
        {"edge", 256, {{TYPE_Q4_K, 77, "a"}, {TYPE_Q4_K, 5, "b"}, {TYPE_Q4_K, 33, "c"}, {TYPE_Q4_K, 1, "d"}}, 0},
    };
    double pass_group[2] = {0, 0}, pass_alone[2] = {0, 0};
    uint64_t seed = 7;
    int ran = 0;
    for (const Group &gr : groups) {
        const uint64_t group_seed = seed++;   // every group keeps its seed whichever run
        if (only && std::strcmp(only, gr.name) != 0) continue;
        ++ran;
        const Timing t = run_group_case(gr, group_seed);
        for (int j = 0; j < 2; ++j) pass_group[j] += gr.count * t.group_ms[j], pass_alone[j] += gr.count * t.alone_ms[j];
    }
    if (!ran) {
        std::printf("MVG_ONLY=%s names no group\n", only ? only : "");
        return 2;
    }
    if (g_profile) return 0;
    std::printf("27B pass, grouped projections (prep included): n=1 group %6.2f ms alone %6.2f ms (saving %5.2f) | n=5 "
                "group %6.2f alone %6.2f (saving %5.2f)\n",
                pass_group[0], pass_alone[0], pass_alone[0] - pass_group[0], pass_group[1], pass_alone[1],
                pass_alone[1] - pass_group[1]);
    std::printf(g_failures ? "%d failing checks\n" : "all checks passed (%d failing)\n", g_failures);
    return g_failures ? 1 : 0;
}
