// gemm_f16_bench.cu: correctness and speed of gemm_f16.cuh (Q4_K / Q5_K / Q6_K / Q8_0 x P positions
// on the fp16 tensor cores) beside gemm_prefill.cuh's int8 GEMM, on the same data.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xcompiler -fopenmp -Inative native/tools/gemm_f16_bench.cu \
//        native/matvec.cu native/elementwise.cu native/deltanet.cu -o gfb -lgomp
//   ./gfb [--table FILE]          (scripts/gpu.sh gemm-f16 builds and runs it)
//
// Cases (type, K -> M): Q4_K 5120 -> 17408 (ffn_gate/up), 17408 -> 5120 (ffn_down), 5120 -> 10240
// (attn_qkv), 6144 -> 5120 (ssm_out); Q6_K 17408 -> 5120 (ffn_down), 5120 -> 10240 (attn_qkv); Q5_K
// 5120 -> 1024 (attn_kv); Q8_0 5120 -> 10240. Random valid blocks (bench_blocks.cuh), the engine's
// to_device_layout, random X with a different scale per position (every 13th 300x larger,
// position 5 all zero). Per P in {64, 256, 512, 2048, 77} plus an accumulate run at P = 77, the
// output NaN-poisoned before each run, then:
//   (a) against a float64 host dequant times the UNROUNDED X on sampled (row, position) pairs
//       (rows 0..63 = two warps' worth of every fragment slot, plus spread and random rows;
//       positions 0..15, tile edges, random): |err| <= 2e-3 of sum_k |w_k x_k| (fp16 rounding of X
//       ~ 2^-12 per value; expect ~1e-4); the int8 kernel's error on the same pairs is printed;
//   (b) every output against matvec.cu's bf16-split kernels (matvec_force_path(0), ~fp32
//       accurate): |err| <= 3e-2 of the position's rms output (catches any unwritten / misplaced
//       tile; the fp16 error is ~1e-3 of rms);
//   every output finite, nothing past P written (a NaN guard row stays NaN).
// Timing: median of RUNS (10; GB_RUNS) after 3 warm-ups, L2 flushed (256 MB memset) before each; the X
// preparation and the GEMM timed separately for both kernels; TFLOP/s = 2 M K P / GEMM time.
// Exit status 1 on any failed check.
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
#include "gemm_prefill.cuh"
#include "gemm_f16.cuh"

#include "tools/harness.cuh"

using namespace oj;


static int g_failures = 0;
static int RUNS = 10;

#include "bench_blocks.cuh"

struct Shape {
    int type;
    const char *name;
    int64_t K, M;
    int count;   // uses of this type and shape in the 27B Q4_K_M map (64 layers + MTP), gemm_bench's
};

static const int PS[4] = {64, 256, 512, 2048};
static const int P_ODD = 77;
static const int P_MAX = 2048;

struct Result {
    double f_prep[4] = {0}, f_ms[4] = {0}, i_prep[4] = {0}, i_ms[4] = {0};
    double err_f = 0, err_i = 0, err_all = 0;
    bool ok = true;
};

static FILE *g_table = nullptr;

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
    void *wsf, *wsi;
    const size_t wsf_bytes = gemm_f16_workspace_bytes(K, P_MAX), wsi_bytes = gemm::workspace_bytes(K, P_MAX);
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dy, ((size_t)P_MAX + 1) * M * 4));
    CK(cudaMalloc(&dref, (size_t)P_MAX * M * 4));
    CK(cudaMalloc(&wsf, wsf_bytes));
    CK(cudaMalloc(&wsi, wsi_bytes));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));

    // float64 reference on sampled pairs
    std::vector<int64_t> srows;
    for (int64_t r = 0; r < std::min<int64_t>(64, M); ++r) srows.push_back(r);
    for (int i = 0; i < 12; ++i) srows.push_back((int64_t)((double)i / 11 * (M - 1)));
    for (int i = 0; i < 8; ++i) srows.push_back((int64_t)(g.next() % (uint64_t)M));
    std::vector<int> spos;
    for (int p = 0; p < 16; ++p) spos.push_back(p);
    for (int p : {63, 64, 65, 76, 127, 128}) spos.push_back(p);
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

    auto fail_msg = [&](const char *what, int P, const char *detail) {
        std::printf("FAIL %s %s P=%d %s: %s\n", tn, s.name, P, what, detail);
        res.ok = false;
    };
    auto fetch = [&](int P) {
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(y.data(), dy, ((size_t)P + 1) * M * 4, cudaMemcpyDeviceToHost));
    };
    // worst sampled error of y (minus prev) against float64, relative to sum |w x|
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
    auto check_f16 = [&](int P, const std::vector<float> *prev) {
        fetch(P);
        char buf[256];
        int64_t unwritten = 0, guard = 0;
        for (size_t i = 0; i < (size_t)P * M; ++i) unwritten += !std::isfinite(y[i]);
        for (int64_t m = 0; m < M; ++m) guard += !std::isnan(y[(size_t)P * M + m]);
        if (unwritten || guard) {
            std::snprintf(buf, sizeof buf, "%lld outputs not finite, %lld written past P", (long long)unwritten, (long long)guard);
            fail_msg("coverage", P, buf);
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
        if (!(es <= 2e-3)) { std::snprintf(buf, sizeof buf, "vs float64 %.3e of sum|w x| (bar 2e-3)", es); fail_msg("float64", P, buf); }
        if (!(ea <= 3e-2)) { std::snprintf(buf, sizeof buf, "vs matvec bf16 %.3e of rms on some output (bar 3e-2)", ea); fail_msg("all-outputs", P, buf); }
        res.err_f = std::max(res.err_f, es);
        res.err_all = std::max(res.err_all, ea);
        std::printf("  %s %-9s P=%-5d%s f16 vs float64 %.3e of sum|wx|, all outputs vs matvec bf16 %.3e of rms\n", tn, s.name,
                    P, prev ? " (accumulate)" : "", es, ea);
    };

    for (int P : {PS[0], PS[1], PS[2], PS[3], P_ODD}) {
        CK(cudaMemset(dy, 0xFF, ((size_t)P + 1) * M * 4));
        gemm_f16(w, dx, P, dy, false, wsf, wsf_bytes, 0);
        check_f16(P, nullptr);
        // the int8 kernel on the same data, for comparison (its own harness checks it)
        CK(cudaMemset(dy, 0xFF, ((size_t)P + 1) * M * 4));
        gemm::gemm_prefill(w, dx, P, dy, false, wsi, wsi_bytes, 0);
        fetch(P);
        res.err_i = std::max(res.err_i, sampled_err(P, nullptr));
    }
    {
        const int P = P_ODD;
        std::vector<float> prev((size_t)(P + 1) * M);
        for (auto &v : prev) v = g.normalish();
        for (int64_t m = 0; m < M; ++m) prev[(size_t)P * M + m] = NAN;
        CK(cudaMemcpy(dy, prev.data(), prev.size() * 4, cudaMemcpyHostToDevice));
        gemm_f16(w, dx, P, dy, true, wsf, wsf_bytes, 0);
        check_f16(P, &prev);
    }

    for (int pi = 0; pi < 4; ++pi) {
        const int P = PS[pi];
        res.f_prep[pi] = median_ms([&] { gemmf16::prep_x(dx, K, P, wsf, 0); });
        gemmf16::prep_x(dx, K, P, wsf, 0);
        res.f_ms[pi] = median_ms([&] { gemmf16::run(w, wsf, P, dy, false, 0); });
        res.i_prep[pi] = median_ms([&] { gemm::quantize_x(dx, K, P, type, wsi, 0); });
        gemm::quantize_x(dx, K, P, type, wsi, 0);
        res.i_ms[pi] = median_ms([&] { gemm::gemm_run(w, wsi, P, dy, false, 0); });
        const double fl = 2.0 * M * K * P;
        const char *fmt = "%s %-9s %6lld %6lld P=%-5d f16 %8.4f ms (+prep %7.4f) %6.1f TFLOP/s | int8 %8.4f ms (+quant %7.4f) "
                          "%6.1f TOPS | speedup %.2fx\n";
        std::printf(fmt, tn, s.name, (long long)K, (long long)M, P, res.f_ms[pi], res.f_prep[pi], fl / (res.f_ms[pi] * 1e-3) / 1e12,
                    res.i_ms[pi], res.i_prep[pi], fl / (res.i_ms[pi] * 1e-3) / 1e12, res.i_ms[pi] / res.f_ms[pi]);
        if (g_table)
            std::fprintf(g_table, fmt, tn, s.name, (long long)K, (long long)M, P, res.f_ms[pi], res.f_prep[pi],
                         fl / (res.f_ms[pi] * 1e-3) / 1e12, res.i_ms[pi], res.i_prep[pi], fl / (res.i_ms[pi] * 1e-3) / 1e12,
                         res.i_ms[pi] / res.f_ms[pi]);
        std::fflush(stdout);
    }
    {   // the other tile configurations at P = 2048 (the default picks 8,3 there when it fits)
        const int P = PS[3];
        const char *prev_cfg = std::getenv("OJ_GEMMF16_CFG");
        const std::string keep = prev_cfg ? prev_cfg : "";
        gemmf16::prep_x(dx, K, P, wsf, 0);
        gemmf16::Config cands[4];
        const int nc = gemmf16::configs_of(type, cands);
        for (int ci = 0; ci < nc && ci < 3; ++ci) {
            const std::string cfg = std::to_string(cands[ci].wm) + "," + std::to_string(cands[ci].stages);
            setenv("OJ_GEMMF16_CFG", cfg.c_str(), 1);
            const gemmf16::Config c = gemmf16::pick_config(type, M, gemmf16::padded_positions(P));
            if (c.wm != cands[ci].wm || c.stages != cands[ci].stages) continue;   // does not fit this device
            const double ms = median_ms([&] { gemmf16::run(w, wsf, P, dy, false, 0); });
            std::printf("%s %-9s P=%-5d f16 config %s (rows x stages %d x %d): %8.4f ms %6.1f TFLOP/s\n", tn, s.name, P,
                        cfg.c_str(), 32 * c.wm, c.stages, ms, 2.0 * M * K * P / (ms * 1e-3) / 1e12);
        }
        if (prev_cfg) setenv("OJ_GEMMF16_CFG", keep.c_str(), 1);
        else unsetenv("OJ_GEMMF16_CFG");
    }
    CK(cudaFree(w.data));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaFree(dref));
    CK(cudaFree(wsf));
    CK(cudaFree(wsi));
    if (!res.ok) ++g_failures;
    return res;
}

int main(int argc, char **argv) {
    const char *table_path = nullptr;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--table") && i + 1 < argc) table_path = argv[++i];
        else { std::fprintf(stderr, "gemm_f16_bench: unknown argument %s\n", argv[i]); return 2; }
    }
    if (const char *r = std::getenv("GB_RUNS")) RUNS = std::max(10, std::atoi(r));
    if (table_path) g_table = std::fopen(table_path, "w");
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int optin = 0;
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB, %d KB shared per block\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, prop.l2CacheSize >> 20, optin >> 10);
    CK(cudaMalloc(&g_flush, FLUSH_BYTES));

    // counts: gemm_bench's Q4_K_M map (uses of each type and shape, 64 layers + MTP; Q5_K / Q8_0 are not in it)
    const std::vector<Shape> shapes = {
        {TYPE_Q4_K, "ffn_gate", 5120, 17408, 130}, {TYPE_Q4_K, "ffn_down", 17408, 5120, 32},
        {TYPE_Q4_K, "attn_qkv", 5120, 10240, 24},  {TYPE_Q4_K, "ssm_out", 6144, 5120, 65},
        {TYPE_Q6_K, "ffn_down", 17408, 5120, 33},  {TYPE_Q6_K, "attn_qkv", 5120, 10240, 24},
        {TYPE_Q5_K, "attn_kv", 5120, 1024, 0},     {TYPE_Q8_0, "attn_qkv", 5120, 10240, 0}};
    std::vector<Result> results;
    uint64_t seed = 1;
    for (const Shape &s : shapes) {
        const Result r = run_case(s, seed++);
        results.push_back(r);
        std::printf("  -> %s %s: f16 vs float64 %.2e of sum|wx| (int8 %.2e), all outputs vs matvec bf16 %.2e of rms %s\n",
                    type_name(s.type), s.name, r.err_f, r.err_i, r.err_all, r.ok ? "ok" : "FAILED");
        std::fflush(stdout);
    }
    std::printf("\n%-14s | %-34s | %-34s | %s\n", "case", "f16 TFLOP/s at P = 64 256 512 2048", "int8 TOPS at P = 64 256 512 2048",
                "speedup at 2048");
    for (size_t c = 0; c < shapes.size(); ++c) {
        const Shape &s = shapes[c];
        const Result &r = results[c];
        double ft[4], it[4];
        for (int i = 0; i < 4; ++i) {
            const double fl = 2.0 * s.M * s.K * PS[i];
            ft[i] = fl / (r.f_ms[i] * 1e-3) / 1e12;
            it[i] = fl / (r.i_ms[i] * 1e-3) / 1e12;
        }
        const std::string cname = std::string(type_name(s.type)) + " " + s.name;
        std::printf("%-14s | %7.1f %7.1f %7.1f %8.1f | %7.1f %7.1f %7.1f %8.1f | %.2fx%s\n", cname.c_str(), ft[0], ft[1], ft[2], ft[3], it[0],
                    it[1], it[2], it[3], r.i_ms[3] / r.f_ms[3], r.ok ? "" : " FAIL");
    }
    for (int i = 0; i < 4; ++i) {
        double f = 0, fi = 0;
        for (size_t c = 0; c < shapes.size(); ++c) {
            f += shapes[c].count * (results[c].f_ms[i] + results[c].f_prep[i]);
            fi += shapes[c].count * (results[c].i_ms[i] + results[c].i_prep[i]);
        }
        std::printf("27B Q4_K_M map uses of these cases (Q4_K + Q6_K), P=%-5d: f16 %8.2f ms, int8 %8.2f ms (with X prep/quantise)\n",
                    PS[i], f, fi);
    }
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    if (g_table) std::fclose(g_table);
    return g_failures ? 1 : 0;
}
