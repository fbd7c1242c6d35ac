// gemm_wgmma_bench.cu: correctness and speed of gemm_wgmma.cuh (Q4_K x P positions on Hopper's
// wgmma, A = dequantised weights from registers) and gemm_wgmma_q6k.cuh (the same for Q6_K)
// beside gemm_f16.cuh's kernel of the same type, on the same prepared X (gemmf16::prep_x: one
// workspace for all).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp -Inative \
//        native/tools/gemm_wgmma_bench.cu native/matvec.cu native/elementwise.cu native/deltanet.cu -o gwb -lgomp
//   ./gwb [--table FILE] [--only Q4_K|Q6_K|FFN]     (scripts/gpu.sh gemm-wgmma builds and runs it)
//
// Cases (K -> M): Q4_K 5120 -> 17408 (ffn_gate/up), 17408 -> 5120 (ffn_down), 5120 -> 10240
// (attn_qkv), 6144 -> 5120 (ssm_out); Q6_K 17408 -> 5120 (ffn_down), 5120 -> 10240 (attn_qkv),
// 5120 -> 1024 (attn_v); per type 512 -> 200 (a partial row tile for every configuration) and
// 256 -> 72 (one super-block: a single pipeline step; fewer rows than one row tile). Random valid
// blocks (bench_blocks.cuh), the engine's to_device_layout, random X with a different scale per
// position (every 13th 300x larger, position 5 all zero). For EVERY wgmma configuration, per P in
// {77, 64, 256, 512, 2048} plus an accumulate run at P = 77, the output NaN-poisoned before each
// run (the accumulate run starts from random values, a NaN guard row past P), then, as
// gemm_f16_bench:
//   (a) against a float64 host dequant times the UNROUNDED X on sampled (row, position) pairs
//       (rows 0..191: every fragment slot of up to 3 consumer warpgroups, plus spread and random
//       rows; positions 0..15, tile edges, random): |err| <= 2e-3 of sum_k |w_k x_k|;
//   (b) every output against matvec.cu's bf16-split path: |err| <= 3e-2 of the position's rms;
//   every output finite, nothing past P written. gemm_f16 (same type) gets the same checks at
//   P = 77, 2048.
// A kernel still running after 20 s is reported as a hang (exit 3).
// Timing: median of RUNS (10; GB_RUNS) after 3 warm-ups, L2 flushed (256 MB memset) before each;
// both GEMMs from the same prepared X (prep_x timed once); TFLOP/s = 2 M K P / GEMM time; then
// every wgmma configuration at P = 64 and 2048 (GB/s of the weights too: a small prefill is bound by
// them); per type the 27B map's uses of the cases summed. Exit status 1 on any failed check.
//
// FFN cases (run first; with --only Q4_K too, alone with --only FFN): gate + up + SwiGLU in one
// kernel (gemm_wgmma_q4k_swiglu) on K 5120 -> M 17408 (the 27B's ffn_gate / ffn_up), 512 -> 200,
// 256 -> 72, P in {77, 64, 256, 512, 2048}, against gemm_f16's gate and up through float64
// SwiGLU and bit for bit against the unfused wgmma path; timed against gate + up + swiglu (see
// run_ffn_case).
#include <unistd.h>

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
#include "gemm_f16.cuh"
#include "gemm_wgmma.cuh"
#include "gemm_wgmma_q6k.cuh"

#include "tools/harness.cuh"

using namespace oj;


static int g_failures = 0;
static int RUNS = 10;

#include "bench_blocks.cuh"

static FILE *g_table = nullptr;

struct Shape {
    int type;   // TYPE_Q4_K (gemm_wgmma.cuh) or TYPE_Q6_K (gemm_wgmma_q6k.cuh)
    const char *name;
    int64_t K, M;
    int count;   // uses in the 27B Q4_K_M map (64 layers + MTP), as gemm_f16_bench
};

static const int PS[4] = {64, 256, 512, 2048};
static const int P_ODD = 77;
static const int P_MAX = 2048;

// Waits for the stream; a kernel still running after 20 s is a hang (an mbarrier phase that
// never completes): report it and leave at once (exit status 3).
static void sync_or_die(const char *what) {
    for (int i = 0; i < 20000; ++i) {
        const cudaError_t e = cudaStreamQuery(0);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) check_cuda(e, what);
        usleep(1000);
    }
    std::printf("FAIL %s: still running after 20 s (hang)\n", what);
    std::fflush(stdout);
    std::_Exit(3);
}

constexpr int MAX_CONFIGS = gemmwg::N_CONFIGS > gemmwg6::N_CONFIGS ? gemmwg::N_CONFIGS : gemmwg6::N_CONFIGS;

struct Result {
    double f_ms[4] = {0}, w_ms[4] = {0}, prep[4] = {0}, cfg_ms[MAX_CONFIGS] = {0};
    double err_w = 0, err_f = 0;
    bool ok = true;
};

template <typename Config>
static std::string cfg_name(const Config &c) {
    return std::to_string(c.nwg) + "," + std::to_string(c.bn) + "," + std::to_string(c.stages);
}

// The wgmma kernel of each type: its configurations (ci = -1: the default) and its run.
// A matrix's bytes as stored (what a weight-bandwidth-bound GEMM must read once).
static size_t w_bytes_of(const Matrix &w) { return file_bytes(w.type, w.K, w.M); }

static int n_configs(int type) { return type == TYPE_Q6_K ? gemmwg6::N_CONFIGS : gemmwg::N_CONFIGS; }
static std::string cfg_label(int type, int ci) {
    return type == TYPE_Q6_K ? cfg_name(gemmwg6::CONFIGS[ci]) : cfg_name(gemmwg::CONFIGS[ci]);
}
static std::string cfg_shape(int type, int ci) {   // "(rows x positions x stages ...)"
    char buf[96];
    const int nwg = type == TYPE_Q6_K ? gemmwg6::CONFIGS[ci].nwg : gemmwg::CONFIGS[ci].nwg;
    const int bn = type == TYPE_Q6_K ? gemmwg6::CONFIGS[ci].bn : gemmwg::CONFIGS[ci].bn;
    const int stages = type == TYPE_Q6_K ? gemmwg6::CONFIGS[ci].stages : gemmwg::CONFIGS[ci].stages;
    std::snprintf(buf, sizeof buf, "(rows x positions x stages %d x %d x %d)", 64 * nwg, bn, stages);
    return buf;
}
static void wg_run(int type, const Matrix &w, const void *ws, int64_t P, float *y, bool accumulate, int ci) {
    if (type == TYPE_Q6_K) {
        if (ci < 0) gemm_wgmma_q6k_run(w, ws, P, y, accumulate, 0);
        else gemmwg6::run(w, ws, P, y, accumulate, 0, gemmwg6::CONFIGS[ci]);
    } else {
        if (ci < 0) gemmwg::run(w, ws, P, y, accumulate, 0);
        else gemmwg::run(w, ws, P, y, accumulate, 0, gemmwg::CONFIGS[ci]);
    }
}

static Result run_case(const Shape &s, uint64_t seed) {
    Result res;
    const int64_t K = s.K, M = s.M;
    const int type = s.type;
    const char *tn = type_name(type);
    std::vector<uint8_t> file = make_matrix(type, K, M, seed);
    const Matrix w = upload_matrix(type, K, M, file);

    Rng g(seed ^ 0xABCDEFull);
    std::vector<float> x = position_inputs(g, K, P_MAX);
    float *dx, *dy, *dref;
    void *ws;
    const size_t ws_bytes = gemm_f16_workspace_bytes(K, P_MAX);
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dy, ((size_t)P_MAX + 1) * M * 4));
    CK(cudaMalloc(&dref, (size_t)P_MAX * M * 4));
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));

    // float64 reference on sampled pairs: rows 0..191 (every fragment slot of 3 warpgroups; Q6_K
    // 0..255: its configurations go up to 4), spread and random rows, the last row; positions
    // 0..15, tile edges, random, the last
    std::vector<int64_t> srows;
    for (int64_t r = 0; r < std::min<int64_t>(type == TYPE_Q6_K ? 256 : 192, M); ++r) srows.push_back(r);
    for (int i = 0; i < 12; ++i) srows.push_back((int64_t)((double)i / 11 * (M - 1)));
    for (int i = 0; i < 8; ++i) srows.push_back((int64_t)(g.next() % (uint64_t)M));
    std::vector<int> spos;
    for (int p = 0; p < 16; ++p) spos.push_back(p);
    for (int p : {63, 64, 65, 76, 127, 128, 129, 191, 255}) spos.push_back(p);
    for (int i = 0; i < 9; ++i) spos.push_back((int)(g.next() % (uint64_t)P_MAX));
    spos.push_back(P_MAX - 1);
    const size_t NR = srows.size(), NP = spos.size();
    std::vector<double> ref, mag;
    sampled_reference(type, K, file, x, srows, spos, ref, mag);
    std::vector<float>().swap(x);
    std::vector<uint8_t>().swap(file);

    // matvec's bf16-split path on all positions: the all-output reference
    matvec_force_path(0);
    CK(cudaMemset(dref, 0xFF, (size_t)P_MAX * M * 4));
    for (int p0 = 0; p0 < P_MAX; p0 += 8) matvec(w, dx + (size_t)p0 * K, dref + (size_t)p0 * M, 8, false, 0);
    CK(cudaDeviceSynchronize());
    std::vector<float> yref((size_t)P_MAX * M), y((size_t)(P_MAX + 1) * M);
    CK(cudaMemcpy(yref.data(), dref, yref.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<double> rms(P_MAX);
    for (int p = 0; p < P_MAX; ++p) {
        double ss = 0;
        for (int64_t m = 0; m < M; ++m) ss += (double)yref[(size_t)p * M + m] * yref[(size_t)p * M + m];
        rms[p] = std::sqrt(ss / M) + 1e-30;
    }

    auto fail_msg = [&](const std::string &who, const char *what, int P, const char *detail) {
        std::printf("FAIL %s %s %s P=%d %s: %s\n", tn, s.name, who.c_str(), P, what, detail);
        res.ok = false;
    };
    auto fetch = [&](int P, const char *what) {
        sync_or_die(what);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(y.data(), dy, ((size_t)P + 1) * M * 4, cudaMemcpyDeviceToHost));
    };
    auto sampled_err = [&](int P, const std::vector<float> *prev) {
        double worst = 0;
        for (size_t ri = 0; ri < NR; ++ri)
            for (size_t pi = 0; pi < NP; ++pi) {
                const int p = spos[pi];
                if (p >= P) continue;
                const size_t i = (size_t)p * M + srows[ri];
                const double base = prev ? (*prev)[i] : 0.0;
                const double e = std::fabs(((double)y[i] - base) - ref[ri * NP + pi]) / (mag[ri * NP + pi] + std::fabs(base));
                worst = std::isnan(e) ? INFINITY : std::max(worst, e);
            }
        return worst;
    };
    // every check on the fetched y of kernel `who`
    auto check = [&](const std::string &who, int P, const std::vector<float> *prev) {
        char buf[256];
        int64_t unwritten = 0, guard = 0;
        for (size_t i = 0; i < (size_t)P * M; ++i) unwritten += !std::isfinite(y[i]);
        for (int64_t m = 0; m < M; ++m) guard += !std::isnan(y[(size_t)P * M + m]);
        if (unwritten || guard) {
            std::snprintf(buf, sizeof buf, "%lld outputs not finite, %lld written past P", (long long)unwritten, (long long)guard);
            fail_msg(who, "coverage", P, buf);
        }
        const double es = sampled_err(P, prev);
        double ea = 0;
        for (int p = 0; p < P; ++p)
            for (int64_t m = 0; m < M; ++m) {
                const size_t i = (size_t)p * M + m;
                const double base = prev ? (*prev)[i] : 0.0;
                const double d = std::fabs(((double)y[i] - base) - yref[i]) / (rms[p] + std::fabs(base));
                ea = std::isnan(d) ? INFINITY : std::max(ea, d);
            }
        if (!(es <= 2e-3)) { std::snprintf(buf, sizeof buf, "vs float64 %.3e of sum|w x| (bar 2e-3)", es); fail_msg(who, "float64", P, buf); }
        if (!(ea <= 3e-2)) { std::snprintf(buf, sizeof buf, "vs matvec bf16 %.3e of rms on some output (bar 3e-2)", ea); fail_msg(who, "all-outputs", P, buf); }
        std::printf("  %s %-9s %-12s P=%-5d%s vs float64 %.3e of sum|wx|, all outputs vs matvec bf16 %.3e of rms\n", tn, s.name,
                    who.c_str(), P, prev ? " (accumulate)" : "", es, ea);
        return es;
    };

    // every wgmma configuration (the default first) on every P, plus the accumulate run; gemm_f16
    // beside. Every configuration's outputs bit for bit those of the first (Q4_K: the engine picks
    // the configuration by P, and a prompt in pieces must equal the prompt whole; Q6_K: its
    // per-group ones, the evidence a pick by P would need)
    std::vector<std::vector<float>> first_y;
    for (int ci = 0; ci < n_configs(type); ++ci) {
        const std::string who = "wgmma " + cfg_label(type, ci);
        int pi = 0;
        for (int P : {P_ODD, PS[0], PS[1], PS[2], PS[3]}) {
            gemmf16::prep_x(dx, K, P, ws, 0);
            CK(cudaMemset(dy, 0xFF, ((size_t)P + 1) * M * 4));
            wg_run(type, w, ws, P, dy, false, ci);
            fetch(P, who.c_str());
            const double es = check(who, P, nullptr);
            res.err_w = std::max(res.err_w, es);
            // every configuration of a type against the first, bit for bit
            {
                const size_t n = (size_t)P * M;
                if (ci == 0) first_y.emplace_back(y.begin(), y.begin() + n);
                else {
                    int64_t differ = 0;
                    for (size_t i = 0; i < n; ++i) differ += std::memcmp(&y[i], &first_y[pi][i], 4) != 0;
                    if (differ) {
                        char buf[160];
                        std::snprintf(buf, sizeof buf, "%lld of %lld outputs not bit-identical to configuration %s's", (long long)differ,
                                      (long long)n, cfg_label(type, 0).c_str());
                        fail_msg(who, "bits", P, buf);
                    }
                }
            }
            ++pi;
        }
        {
            const int P = P_ODD;
            std::vector<float> prev((size_t)(P + 1) * M);
            for (auto &v : prev) v = g.normalish();
            for (int64_t m = 0; m < M; ++m) prev[(size_t)P * M + m] = NAN;
            gemmf16::prep_x(dx, K, P, ws, 0);
            CK(cudaMemcpy(dy, prev.data(), prev.size() * 4, cudaMemcpyHostToDevice));
            wg_run(type, w, ws, P, dy, true, ci);
            fetch(P, who.c_str());
            res.err_w = std::max(res.err_w, check(who, P, &prev));
        }
    }
    for (int P : {P_ODD, PS[3]}) {   // gemm_f16 on the same data, for its error beside ours
        gemmf16::prep_x(dx, K, P, ws, 0);
        CK(cudaMemset(dy, 0xFF, ((size_t)P + 1) * M * 4));
        gemmf16::run(w, ws, P, dy, false, 0);
        fetch(P, "gemm_f16");
        res.err_f = std::max(res.err_f, check("gemm_f16", P, nullptr));
    }

    for (int pi = 0; pi < 4; ++pi) {
        const int P = PS[pi];
        res.prep[pi] = median_ms([&] { gemmf16::prep_x(dx, K, P, ws, 0); });
        gemmf16::prep_x(dx, K, P, ws, 0);
        res.f_ms[pi] = median_ms([&] { gemmf16::run(w, ws, P, dy, false, 0); });
        res.w_ms[pi] = median_ms([&] { wg_run(type, w, ws, P, dy, false, -1); });
        const double fl = 2.0 * M * K * P;
        const char *fmt = "%s %-9s %6lld %6lld P=%-5d wgmma %8.4f ms %6.1f TFLOP/s | f16 %8.4f ms %6.1f TFLOP/s | prep_x %7.4f ms | "
                          "speedup %.2fx\n";
        std::printf(fmt, tn, s.name, (long long)K, (long long)M, P, res.w_ms[pi], fl / (res.w_ms[pi] * 1e-3) / 1e12, res.f_ms[pi],
                    fl / (res.f_ms[pi] * 1e-3) / 1e12, res.prep[pi], res.f_ms[pi] / res.w_ms[pi]);
        if (g_table)
            std::fprintf(g_table, fmt, tn, s.name, (long long)K, (long long)M, P, res.w_ms[pi], fl / (res.w_ms[pi] * 1e-3) / 1e12,
                         res.f_ms[pi], fl / (res.f_ms[pi] * 1e-3) / 1e12, res.prep[pi], res.f_ms[pi] / res.w_ms[pi]);
        std::fflush(stdout);
    }
    // every configuration at P = 64 (a small oj_prefill: an appended turn, a prompt piece beside
    // decoding streams; weight-bandwidth bound, so GB/s of the matrix too) and at P = 2048 (res.cfg_ms)
    for (const int P : {PS[0], PS[3]}) {
        gemmf16::prep_x(dx, K, P, ws, 0);
        for (int ci = 0; ci < n_configs(type); ++ci) {
            const double ms = median_ms([&] { wg_run(type, w, ws, P, dy, false, ci); });
            if (P == PS[3]) res.cfg_ms[ci] = ms;
            std::printf("%s %-9s P=%-5d wgmma config %s %s: %8.4f ms %6.1f TFLOP/s %7.0f GB/s of weights\n", tn, s.name, P,
                        cfg_label(type, ci).c_str(), cfg_shape(type, ci).c_str(), ms, 2.0 * M * K * P / (ms * 1e-3) / 1e12,
                        (double)w_bytes_of(w) / (ms * 1e-3) / 1e9);
        }
    }
    CK(cudaFree(w.data));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaFree(dref));
    CK(cudaFree(ws));
    if (!res.ok) ++g_failures;
    return res;
}

// ---------------------------------------------------------------------------------------------
// FFN: gate + up + SwiGLU in one kernel (gemmwg::run_swiglu, gemm_wgmma.cuh's SWIGLU variant)
// beside the unfused path (gate and up on wgmma, then elementwise.cu's swiglu kernel).
//
// Checks, per fused configuration and P in {77, 64, 256, 512, 2048} (output NaN-poisoned, a
// guard row past P):
//   (a) against gemm_f16's gate g and up u (the mma.sync kernel, itself checked against float64
//       above) through SwiGLU in float64 on the host, every output: |y - silu(g) u| <=
//       1e-3 (|u| rms_g(p) + |silu(g)| rms_u(p) + 1e-3 rms_g(p) rms_u(p)). The scale is the first-order
//       propagation of errors dg, du, each a fraction of its position's rms (|silu'| <= 1.1), plus a
//       second-order floor where g and u are both ~0. The two GEMMs share the prepared X and the
//       exact fp16 A and differ only in fp32 accumulation order (orders of magnitude below 1e-3
//       of rms), so 1e-3 leaves a wide margin, while any misplaced or stale value (a wrong
//       exchange index, a missed barrier, a wrong row or box) errs by O(1) of the scale;
//   (b) bit-identical to the unfused path of the SAME wgmma configuration (same NWG, BN, stages:
//       the accumulators are the same arithmetic, the epilogue rounds gate and up as the unfused
//       stores do and applies the same silu);
//   every output finite, nothing past P written.
// Timing (P = 64 .. 2048, L2 flushed before each run): the fused kernel against gate + up +
// swiglu launched back to back (and the swiglu pass alone); per 27B the 65 FFNs' saving.

// elementwise.cu's swiglu_kernel and its launch (the unfused path's third kernel)
__global__ void swiglu_ref_kernel(float *__restrict__ gate, const float *__restrict__ up, int64_t count) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        gate[i] = silu(gate[i]) * up[i];
}
static void swiglu_ref(float *gate, const float *up, int64_t count) {
    swiglu_ref_kernel<<<(unsigned)((count + 255) / 256), 256>>>(gate, up, count);
    CK(cudaGetLastError());
}

struct FfnShape {
    const char *name;
    int64_t K, M;
    int count;   // uses in the 27B map (64 layers + MTP)
};

struct FfnResult {
    double fused_ms[4] = {0}, unfused_ms[4] = {0}, gemms_ms[4] = {0}, swiglu_ms[4] = {0};
    double cfg_ms[gemmwg::N_SWIGLU_CONFIGS] = {0};
    double err = 0;
    bool ok = true;
};

static Matrix upload_q4k(int64_t K, int64_t M, uint64_t seed) {
    return upload_matrix(TYPE_Q4_K, K, M, make_matrix(TYPE_Q4_K, K, M, seed));
}

static FfnResult run_ffn_case(const FfnShape &s, uint64_t seed) {
    FfnResult res;
    const int64_t K = s.K, M = s.M;
    const Matrix wg = upload_q4k(K, M, seed), wu = upload_q4k(K, M, seed * 7919 + 17);

    Rng g(seed ^ 0x5EEDull);
    std::vector<float> x = position_inputs(g, K, P_MAX);
    float *dx, *dg, *du, *dy;
    void *ws;
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dg, (size_t)P_MAX * M * 4));
    CK(cudaMalloc(&du, (size_t)P_MAX * M * 4));
    CK(cudaMalloc(&dy, ((size_t)P_MAX + 1) * M * 4));
    CK(cudaMalloc(&ws, gemm_f16_workspace_bytes(K, P_MAX)));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    std::vector<float>().swap(x);
    std::vector<float> hg((size_t)P_MAX * M), hu((size_t)P_MAX * M), hy((size_t)(P_MAX + 1) * M), hx((size_t)P_MAX * M);

    auto fail_msg = [&](const std::string &who, int P, const char *detail) {
        std::printf("FAIL FFN %s %s P=%d: %s\n", s.name, who.c_str(), P, detail);
        res.ok = false;
    };
    char buf[256];
    for (int P : {P_ODD, PS[0], PS[1], PS[2], PS[3]}) {
        const size_t n = (size_t)P * M;
        gemmf16::prep_x(dx, K, P, ws, 0);
        gemmf16::run(wg, ws, P, dg, false, 0);
        gemmf16::run(wu, ws, P, du, false, 0);
        sync_or_die("gemm_f16 gate / up");
        CK(cudaMemcpy(hg.data(), dg, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hu.data(), du, n * 4, cudaMemcpyDeviceToHost));
        std::vector<double> rg(P), ru(P);
        for (int p = 0; p < P; ++p) {
            double sg = 0, su = 0;
            for (int64_t m = 0; m < M; ++m) {
                sg += (double)hg[(size_t)p * M + m] * hg[(size_t)p * M + m];
                su += (double)hu[(size_t)p * M + m] * hu[(size_t)p * M + m];
            }
            rg[p] = std::sqrt(sg / M);
            ru[p] = std::sqrt(su / M);
        }
        for (int ci = 0; ci < gemmwg::N_SWIGLU_CONFIGS; ++ci) {
            const gemmwg::Config c = gemmwg::SWIGLU_CONFIGS[ci];
            const std::string who = "fused " + cfg_name(c);
            CK(cudaMemset(dy, 0xFF, n * 4 + (size_t)M * 4));
            gemmwg::run_swiglu(wg, wu, ws, P, dy, 0, c);
            sync_or_die(who.c_str());
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(hy.data(), dy, n * 4 + (size_t)M * 4, cudaMemcpyDeviceToHost));
            int64_t unwritten = 0, guard = 0;
            for (size_t i = 0; i < n; ++i) unwritten += !std::isfinite(hy[i]);
            for (int64_t m = 0; m < M; ++m) guard += !std::isnan(hy[n + m]);
            if (unwritten || guard) {
                std::snprintf(buf, sizeof buf, "%lld outputs not finite, %lld written past P", (long long)unwritten, (long long)guard);
                fail_msg(who, P, buf);
            }
            // (a) against gemm_f16's g, u through float64 SwiGLU
            double worst = 0;
            int64_t worst_i = -1;
#pragma omp parallel
            {
                double w_loc = 0;
                int64_t i_loc = -1;
#pragma omp for schedule(static)
                for (int64_t i = 0; i < (int64_t)n; ++i) {
                    const int p = (int)(i / M);
                    const double gv = hg[i], uv = hu[i];
                    const double sg = gv / (1.0 + std::exp(-gv));
                    const double bound = std::fabs(uv) * rg[p] + std::fabs(sg) * ru[p] + 1e-3 * rg[p] * ru[p];
                    double e = std::fabs((double)hy[i] - sg * uv) / (bound + 1e-300);
                    if (std::isnan(e)) e = INFINITY;
                    if (e > w_loc) { w_loc = e; i_loc = i; }
                }
#pragma omp critical
                if (w_loc > worst) { worst = w_loc; worst_i = i_loc; }
            }
            if (!(worst <= 1e-3)) {
                std::snprintf(buf, sizeof buf, "vs gemm_f16 gate/up + float64 SwiGLU: %.3e of the propagated scale (bar 1e-3) at "
                              "position %lld row %lld (got %.6g, want %.6g)", worst, (long long)(worst_i / M),
                              (long long)(worst_i % M), worst_i >= 0 ? hy[worst_i] : 0.0,
                              worst_i >= 0 ? hg[worst_i] / (1.0 + std::exp(-(double)hg[worst_i])) * hu[worst_i] : 0.0);
                fail_msg(who, P, buf);
            }
            res.err = std::max(res.err, worst);
            // (b) the unfused wgmma path of the same configuration, bit for bit
            const int cj = gemmwg::config_index(c);
            gemmwg::run(wg, ws, P, dg, false, 0, gemmwg::CONFIGS[cj]);
            gemmwg::run(wu, ws, P, du, false, 0, gemmwg::CONFIGS[cj]);
            swiglu_ref(dg, du, (int64_t)n);
            sync_or_die("unfused wgmma + swiglu");
            CK(cudaMemcpy(hx.data(), dg, n * 4, cudaMemcpyDeviceToHost));
            int64_t differ = 0;
            double dmax = 0;
            for (size_t i = 0; i < n; ++i)
                if (std::memcmp(&hx[i], &hy[i], 4) != 0) {
                    ++differ;
                    const double d = std::fabs((double)hx[i] - hy[i]) / (std::fabs((double)hx[i]) + 1e-30);
                    dmax = std::isnan(d) ? INFINITY : std::max(dmax, d);
                }
            if (differ) {
                std::snprintf(buf, sizeof buf, "%lld of %lld outputs not bit-identical to wgmma gate, up + swiglu (config %s); "
                              "largest relative difference %.3e", (long long)differ, (long long)n, cfg_name(c).c_str(), dmax);
                fail_msg(who, P, buf);
            }
            std::printf("  FFN %-9s %-14s P=%-5d vs gemm_f16 + float64 SwiGLU %.3e of the propagated scale; %lld outputs differ "
                        "from unfused wgmma + swiglu\n", s.name, who.c_str(), P, worst, (long long)differ);
        }
    }

    for (int pi = 0; pi < 4; ++pi) {
        const int P = PS[pi];
        const int64_t n = (int64_t)P * M;
        gemmf16::prep_x(dx, K, P, ws, 0);
        res.fused_ms[pi] = median_ms([&] { gemm_wgmma_q4k_swiglu(wg, wu, ws, P, dy, 0); });
        res.gemms_ms[pi] = median_ms([&] {
            gemmwg::run(wg, ws, P, dg, false, 0);
            gemmwg::run(wu, ws, P, du, false, 0);
        });
        res.swiglu_ms[pi] = median_ms([&] { swiglu_ref(dg, du, n); });
        res.unfused_ms[pi] = median_ms([&] {
            gemmwg::run(wg, ws, P, dg, false, 0);
            gemmwg::run(wu, ws, P, du, false, 0);
            swiglu_ref(dg, du, n);
        });
        const double fl = 2.0 * 2 * M * K * P;
        const char *fmt = "FFN %-9s %6lld %6lld P=%-5d fused %8.4f ms %6.1f TFLOP/s | unfused %8.4f ms (gate + up %8.4f, swiglu %7.4f) | "
                          "saving %7.4f ms (%.1f%%)\n";
        const double save = res.unfused_ms[pi] - res.fused_ms[pi];
        std::printf(fmt, s.name, (long long)K, (long long)M, P, res.fused_ms[pi], fl / (res.fused_ms[pi] * 1e-3) / 1e12,
                    res.unfused_ms[pi], res.gemms_ms[pi], res.swiglu_ms[pi], save, 100.0 * save / res.unfused_ms[pi]);
        if (g_table)
            std::fprintf(g_table, fmt, s.name, (long long)K, (long long)M, P, res.fused_ms[pi], fl / (res.fused_ms[pi] * 1e-3) / 1e12,
                         res.unfused_ms[pi], res.gemms_ms[pi], res.swiglu_ms[pi], save, 100.0 * save / res.unfused_ms[pi]);
        std::fflush(stdout);
    }
    for (const int P : {PS[0], PS[3]}) {   // every fused configuration at P = 64 and 2048 (res.cfg_ms)
        gemmf16::prep_x(dx, K, P, ws, 0);
        for (int ci = 0; ci < gemmwg::N_SWIGLU_CONFIGS; ++ci) {
            const gemmwg::Config c = gemmwg::SWIGLU_CONFIGS[ci];
            const double ms = median_ms([&] { gemmwg::run_swiglu(wg, wu, ws, P, dy, 0, c); });
            if (P == PS[3]) res.cfg_ms[ci] = ms;
            std::printf("FFN %-9s P=%-5d fused config %s (64 output rows x %d positions x %d stages): %8.4f ms %6.1f TFLOP/s "
                        "%7.0f GB/s of weights\n", s.name, P, cfg_name(c).c_str(), c.bn, c.stages, ms,
                        2.0 * 2 * M * K * P / (ms * 1e-3) / 1e12, (double)(w_bytes_of(wg) + w_bytes_of(wu)) / (ms * 1e-3) / 1e9);
        }
    }
    CK(cudaFree(wg.data));
    CK(cudaFree(wu.data));
    CK(cudaFree(dx));
    CK(cudaFree(dg));
    CK(cudaFree(du));
    CK(cudaFree(dy));
    CK(cudaFree(ws));
    if (!res.ok) ++g_failures;
    return res;
}

int main(int argc, char **argv) {
    const char *table_path = nullptr;
    const int ONLY_FFN = 1000;
    int only = -1;   // --only Q4_K | Q6_K | FFN: that type's cases alone (Q4_K includes the fused FFN cases)
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--table") && i + 1 < argc) table_path = argv[++i];
        else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
            ++i;
            if (!std::strcmp(argv[i], "Q4_K")) only = TYPE_Q4_K;
            else if (!std::strcmp(argv[i], "Q6_K")) only = TYPE_Q6_K;
            else if (!std::strcmp(argv[i], "FFN")) only = ONLY_FFN;
            else { std::fprintf(stderr, "gemm_wgmma_bench: --only takes Q4_K, Q6_K or FFN, got %s\n", argv[i]); return 2; }
        } else { std::fprintf(stderr, "gemm_wgmma_bench: unknown argument %s\n", argv[i]); return 2; }
    }
    if (const char *r = std::getenv("GB_RUNS")) RUNS = std::max(10, std::atoi(r));
    if (table_path) g_table = std::fopen(table_path, "w");
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int optin = 0;
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB, %d KB shared per block\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, prop.l2CacheSize >> 20, optin >> 10);
    if (!gemmwg::wgmma_available()) {
        std::printf("FAIL: no wgmma here (needs cc 9.0 and an sm_90a build)\n");
        return 1;
    }
    for (int ci = 0; ci < gemmwg::N_CONFIGS; ++ci) {
        const gemmwg::Config c = gemmwg::CONFIGS[ci];
        std::printf("wgmma config %s: %d threads, %d B dynamic shared memory, consumer registers %d (producer %d)\n",
                    cfg_name(c).c_str(), 128 * (c.nwg + 1), gemmwg::smem_bytes(c.nwg, c.bn, c.stages),
                    gemmwg::consumer_regs(c.nwg), gemmwg::PRODUCER_REGS);
        if (gemmwg::smem_bytes(c.nwg, c.bn, c.stages) > optin) {
            std::printf("FAIL: config %s needs more shared memory than the device allows\n", cfg_name(c).c_str());
            return 1;
        }
    }
    for (int ci = 0; ci < gemmwg::N_SWIGLU_CONFIGS; ++ci) {
        const gemmwg::Config c = gemmwg::SWIGLU_CONFIGS[ci];
        std::printf("wgmma fused gate+up+SwiGLU config %s: %d threads, %d B dynamic shared memory (%d B exchange), consumer registers "
                    "%d (producer %d)\n", cfg_name(c).c_str(), 128 * (c.nwg + 1), gemmwg::smem_bytes_swiglu(c.bn, c.stages),
                    gemmwg::xch_bytes(c.bn), gemmwg::consumer_regs(c.nwg), gemmwg::PRODUCER_REGS);
        if (gemmwg::smem_bytes_swiglu(c.bn, c.stages) > optin) {
            std::printf("FAIL: fused config %s needs more shared memory than the device allows\n", cfg_name(c).c_str());
            return 1;
        }
    }
    for (int ci = 0; ci < gemmwg6::N_CONFIGS; ++ci) {
        const gemmwg6::Config c = gemmwg6::CONFIGS[ci];
        std::printf("wgmma Q6_K config %s %s: %d threads, %d B dynamic shared memory, consumer registers %d (producer %d)\n",
                    cfg_name(c).c_str(), cfg_shape(TYPE_Q6_K, ci).c_str(), 128 * (c.nwg + 1),
                    gemmwg6::smem_bytes(c.nwg, c.bn, c.stages), gemmwg::consumer_regs(c.nwg), gemmwg::PRODUCER_REGS);
        if (gemmwg6::smem_bytes(c.nwg, c.bn, c.stages) > optin) {
            std::printf("FAIL: Q6_K config %s needs more shared memory than the device allows\n", cfg_name(c).c_str());
            return 1;
        }
    }
    CK(cudaMalloc(&g_flush, FLUSH_BYTES));

    // counts: uses in the 27B Q4_K_M map (Q6_K: ffn_down in 33 layers, attn_qkv in 24 of the 48
    // DeltaNet layers, attn_v in 9 of the 16 attention layers)
    std::vector<Shape> shapes;
    for (const Shape &s : std::vector<Shape>{{TYPE_Q4_K, "ffn_gate", 5120, 17408, 130},
                                             {TYPE_Q4_K, "ffn_down", 17408, 5120, 32},
                                             {TYPE_Q4_K, "attn_qkv", 5120, 10240, 24},
                                             {TYPE_Q4_K, "ssm_out", 6144, 5120, 65},
                                             {TYPE_Q4_K, "ragged_m", 512, 200, 0},    // M = 200: a partial row tile for every config
                                             {TYPE_Q4_K, "one_sblk", 256, 72, 0},     // K = 256: one step; M = 72 < every BM
                                             {TYPE_Q6_K, "ffn_down", 17408, 5120, 33},
                                             {TYPE_Q6_K, "attn_qkv", 5120, 10240, 24},
                                             {TYPE_Q6_K, "attn_v", 5120, 1024, 9},
                                             {TYPE_Q6_K, "ragged_m", 512, 200, 0},
                                             {TYPE_Q6_K, "one_sblk", 256, 72, 0}})
        if (only < 0 || s.type == only) shapes.push_back(s);
    // the fused FFN: the 27B's gate / up shape (64 layers + MTP), M = 200 (a partial 64-row tile,
    // several tiles), K = 256 / M = 72 (a single pipeline step; a second tile of 8 rows)
    std::vector<FfnShape> ffn_shapes;
    if (only < 0 || only == TYPE_Q4_K || only == ONLY_FFN)
        ffn_shapes = {{"gate_up", 5120, 17408, 65}, {"ragged_m", 512, 200, 0}, {"one_sblk", 256, 72, 0}};
    std::vector<Result> results;
    uint64_t seed = 1;
    std::vector<FfnResult> ffn_results;
    for (const FfnShape &s : ffn_shapes) {
        const FfnResult r = run_ffn_case(s, 100 + seed++);
        ffn_results.push_back(r);
        std::printf("  -> FFN %s: fused vs gemm_f16 + SwiGLU %.2e of the propagated scale %s\n", s.name, r.err, r.ok ? "ok" : "FAILED");
        std::fflush(stdout);
    }
    for (const Shape &s : shapes) {
        const Result r = run_case(s, seed++);
        results.push_back(r);
        std::printf("  -> %s %s: wgmma vs float64 %.2e of sum|wx| (gemm_f16 %.2e) %s\n", type_name(s.type), s.name, r.err_w, r.err_f,
                    r.ok ? "ok" : "FAILED");
        std::fflush(stdout);
    }
    std::printf("\n%-14s | %-36s | %-36s | %s\n", "case", "wgmma TFLOP/s at P = 64 256 512 2048", "f16 TFLOP/s at P = 64 256 512 2048",
                "speedup at 2048");
    for (size_t c = 0; c < shapes.size(); ++c) {
        const Shape &s = shapes[c];
        const Result &r = results[c];
        double wt[4], ft[4];
        for (int i = 0; i < 4; ++i) {
            const double fl = 2.0 * s.M * s.K * PS[i];
            wt[i] = fl / (r.w_ms[i] * 1e-3) / 1e12;
            ft[i] = fl / (r.f_ms[i] * 1e-3) / 1e12;
        }
        std::printf("%s %-9s | %7.1f %7.1f %7.1f %10.1f | %7.1f %7.1f %7.1f %10.1f | %.2fx%s\n", type_name(s.type), s.name, wt[0], wt[1],
                    wt[2], wt[3], ft[0], ft[1], ft[2], ft[3], r.f_ms[3] / r.w_ms[3], r.ok ? "" : " FAIL");
    }
    for (int type : {TYPE_Q4_K, TYPE_Q6_K}) {
        if (only >= 0 && type != only) continue;
        for (int i = 0; i < 4; ++i) {
            double wsum = 0, fsum = 0;
            for (size_t c = 0; c < shapes.size(); ++c) {
                if (shapes[c].type != type) continue;
                wsum += shapes[c].count * results[c].w_ms[i];
                fsum += shapes[c].count * results[c].f_ms[i];
            }
            std::printf("27B %s uses of these cases, P=%-5d: wgmma %8.2f ms, f16 %8.2f ms (GEMM only, X prep excluded)\n", type_name(type),
                        PS[i], wsum, fsum);
        }
    }
    for (int i = 0; i < 4 && !ffn_shapes.empty(); ++i) {
        double fsum = 0, usum = 0;
        for (size_t c = 0; c < ffn_shapes.size(); ++c) {
            fsum += ffn_shapes[c].count * ffn_results[c].fused_ms[i];
            usum += ffn_shapes[c].count * ffn_results[c].unfused_ms[i];
        }
        std::printf("27B FFN gate+up+SwiGLU (65 uses), P=%-5d: fused %8.2f ms, unfused %8.2f ms, saving %7.2f ms\n", PS[i], fsum, usum,
                    usum - fsum);
    }
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    if (g_table) std::fclose(g_table);
    return g_failures ? 1 : 0;
}
