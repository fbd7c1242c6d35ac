// matvec_bench.cu: correctness and speed of native/matvec.cu on the 27B shapes (both paths: the
// bf16-split "new" and the int8-activation "int8"), with the pre-tensor-core kernel ("old",
// tools/matvec_old.cuh) beside them; Q8_0 also at K a multiple of 32 only (the trained default
// model's 384/512/768/1024 and odd tails), where old cannot run. (The first tensor-core kernel,
// timed beside the current one on 2026-11-29 — native/README.md — is no longer kept here.)
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Inative native/tools/matvec_bench.cu native/matvec.cu -o mb
//   ./mb [--quick]            (scripts/gpu_matvec.sh builds and runs it)
//
// For each (type, shape): random but valid blocks (finite fp16 scales), random activations; the
// engine's to_device_layout; matvec for n_vec 1..8 and matvec_rows, the output poisoned with NaN
// before every run. Checked against a host float64 dequant + dot written from ggml's block
// definitions (ggml-common.h / dequantize_row_*), not from the kernels, on a sample of rows:
// error / sum_k |w_k x_k| (a relative error that stays meaningful when the dot is near 0).
// Also: every output written (no NaN left), vector 0 bit-identical for every n_vec, accumulate
// adds, matvec_rows equal to the full matvec's rows. Every check runs for both quantised paths
// of matvec.cu (bf16-split, tolerance 1e-4; int8 activations, OPENJET_MATVEC=int8, 1e-2),
// selected with matvec_force_path; "i8" rows and the int8 column/pass line are that path. Timing: CUDA events, median of RUNS runs
// after warm-up, L2 flushed (256 MB memset) before each; GB/s = device weight bytes / time, and
// the ratio to a device-to-device copy (read + write bytes) measured in the same run.
// Exit status 1 on any failure.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "engine.cuh"
#include "tools/matvec_old.cuh"

#include "tools/harness.cuh"

using namespace oj;

static int g_failures = 0;
static int RUNS = 25;

#include "bench_blocks.cuh"

static double copy_gbs() {
    const size_t bytes = 2ull << 30;
    void *s, *d;
    CK(cudaMalloc(&s, bytes));
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemset(s, 1, bytes));
    const double ms = median_ms([&] { CK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, 0)); });
    CK(cudaFree(s));
    CK(cudaFree(d));
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

// ---- one case -------------------------------------------------------------------------------
struct Shape {
    const char *name;
    int64_t K, M;
};

struct Result {
    double new_ms[9] = {0}, old_ms[9] = {0}, i8_ms[9] = {0};
    size_t bytes = 0;
    double i8_err = 0;   // int8 path: max error / sum |w x|
    double max_err = 0, old_err = 0, embed_err = 0;
    bool ok = true;
};

static double g_copy = 0;
static FILE *g_table = nullptr;

static Result run_case(int type, const Shape &s, uint64_t seed, bool with_old) {
    Result res;
    const int64_t K = s.K, M = s.M;
    std::vector<uint8_t> file = make_matrix(type, K, M, seed);
    const Matrix w = upload_matrix(type, K, M, file, &res.bytes);
    if (res.bytes != device_layout_bytes(type, K, M)) { std::printf("layout size mismatch\n"); res.ok = false; }
    Matrix wo = w;   // the old kernel's layout (differs for Q6_K only)
    if (with_old) {
        if (type == TYPE_Q6_K) {
            std::vector<uint8_t> od = oj_old::to_device_layout(type, K, M, file.data());
            CK(cudaMalloc(&wo.data, od.size()));
            CK(cudaMemcpy(wo.data, od.data(), od.size(), cudaMemcpyHostToDevice));
        }
    }

    // activations: 8 vectors, different scales per vector (one with a large range)
    Rng g(seed ^ 0xABCDEFull);
    std::vector<float> x(8 * K);
    for (int n = 0; n < 8; ++n) {
        const float scale = n == 7 ? 300.0f : 0.5f + n;
        for (int64_t k = 0; k < K; ++k) x[n * K + k] = g.normalish() * scale;
    }
    float *dx, *dy;
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dy, 8 * M * 4));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));

    // reference on sample rows
    std::vector<int64_t> sample;
    for (int i = 0; i < 48; ++i) sample.push_back((int64_t)((double)i / 47 * (M - 1)));
    for (int i = 0; i < 16; ++i) sample.push_back((int64_t)(g.next() % (uint64_t)M));
    const size_t row_bytes = file_bytes(type, K, 1);
    std::vector<double> ref(sample.size() * 8), mag(sample.size() * 8), wrow;
    for (size_t si = 0; si < sample.size(); ++si) {
        ref_row(type, K, file.data() + (size_t)sample[si] * row_bytes, wrow);
        for (int n = 0; n < 8; ++n) {
            double acc = 0, a = 0;
            for (int64_t k = 0; k < K; ++k) {
                const double p = wrow[k] * (double)x[n * K + k];
                acc += p;
                a += std::fabs(p);
            }
            ref[si * 8 + n] = acc;
            mag[si * 8 + n] = a + 1e-30;
        }
    }
    std::vector<float>().swap(x);

    std::vector<float> y(8 * M), y_first(M);
    auto check = [&](int n_vec, double tol, const char *what) -> double {
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(y.data(), dy, (size_t)n_vec * M * 4, cudaMemcpyDeviceToHost));
        int64_t unwritten = 0;
        for (int64_t i = 0; i < (int64_t)n_vec * M; ++i) unwritten += !std::isfinite(y[i]);
        double worst = 0;
        for (size_t si = 0; si < sample.size(); ++si)
            for (int n = 0; n < n_vec; ++n)
                worst = std::max(worst, std::fabs(y[(size_t)n * M + sample[si]] - ref[si * 8 + n]) / mag[si * 8 + n]);
        if (unwritten || !(worst <= tol)) {
            std::printf("FAIL %s %s %s n=%d: %lld outputs not finite, max rel err %.3e (tol %.0e)\n", type_name(type),
                        s.name, what, n_vec, (long long)unwritten, worst, tol);
            res.ok = false;
        }
        return worst;
    };

    for (int n = 1; n <= 8; ++n) {
        CK(cudaMemset(dy, 0xFF, 8 * M * 4));   // NaN
        matvec(w, dx, dy, n, false, 0);
        res.max_err = std::max(res.max_err, check(n, 1e-4, "new"));
        if (n == 1) std::memcpy(y_first.data(), y.data(), M * 4);
        else if (std::memcmp(y_first.data(), y.data(), M * 4) != 0) {
            std::printf("FAIL %s %s new: vector 0 differs between n=1 and n=%d\n", type_name(type), s.name, n);
            res.ok = false;
        }
        if (with_old) {
            CK(cudaMemset(dy, 0xFF, 8 * M * 4));
            oj_old::matvec(wo, dx, dy, n, false, 0);
            res.old_err = std::max(res.old_err, check(n, 1e-5, "old"));
        }
    }
    // int8 activations: the bound is for rounding x to int8 per 32 values (amax / 254 per value
    // at most; a numpy emulation of the kernel saw ~1e-3 of sum |w x| at K 512, less at larger
    // K); the same n-independence as above
    matvec_force_path(1);
    for (int n = 1; n <= 8; ++n) {
        CK(cudaMemset(dy, 0xFF, 8 * M * 4));
        matvec(w, dx, dy, n, false, 0);
        res.i8_err = std::max(res.i8_err, check(n, 1e-2, "int8"));
        if (n == 1) std::memcpy(y_first.data(), y.data(), M * 4);
        else if (std::memcmp(y_first.data(), y.data(), M * 4) != 0) {
            std::printf("FAIL %s %s int8: vector 0 differs between n=1 and n=%d\n", type_name(type), s.name, n);
            res.ok = false;
        }
    }
    matvec_force_path(0);
    // embed_rows: 8 rows (first, last, random, one repeated) dequantised, against ref_row
    {
        std::vector<int32_t> tok(8);
        for (auto &r : tok) r = (int32_t)(g.next() % (uint64_t)M);
        tok[0] = 0;
        tok[1] = (int32_t)(M - 1);
        tok[2] = tok[3];
        int32_t *dtok;
        float *de;
        CK(cudaMalloc(&dtok, 8 * 4));
        CK(cudaMalloc(&de, (size_t)8 * K * 4));
        CK(cudaMemcpy(dtok, tok.data(), 8 * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(de, 0xFF, (size_t)8 * K * 4));
        embed_rows(w, dtok, de, 8, 0);
        CK(cudaDeviceSynchronize());
        std::vector<float> e((size_t)8 * K);
        CK(cudaMemcpy(e.data(), de, e.size() * 4, cudaMemcpyDeviceToHost));
        double worst = 0;
        int64_t unwritten = 0;
        for (int n = 0; n < 8; ++n) {
            ref_row(type, K, file.data() + (size_t)tok[n] * row_bytes, wrow);
            double scale = 1e-30;
            for (int64_t k = 0; k < K; ++k) scale = std::max(scale, std::fabs(wrow[k]));
            for (int64_t k = 0; k < K; ++k) {
                const float v = e[(size_t)n * K + k];
                unwritten += !std::isfinite(v);
                worst = std::max(worst, std::fabs(v - wrow[k]) / scale);
            }
        }
        res.embed_err = worst;
        if (unwritten || !(worst <= 1e-6)) {
            std::printf("FAIL %s %s embed_rows: %lld values not finite, max err / row max %.3e (tol 1e-6)\n",
                        type_name(type), s.name, (long long)unwritten, worst);
            res.ok = false;
        }
        CK(cudaFree(dtok));
        CK(cudaFree(de));
    }
    for (int path = 0; path < 2; ++path) {
        matvec_force_path(path);
        const char *pname = path ? "int8" : "bf16";
        const double acc_tol = path ? 1e-2 : 1e-4;
        // accumulate: y = previous + W x
        {
            std::vector<float> prev(3 * M);
            for (auto &v : prev) v = g.normalish();
            CK(cudaMemcpy(dy, prev.data(), prev.size() * 4, cudaMemcpyHostToDevice));
            matvec(w, dx, dy, 3, true, 0);
            CK(cudaMemcpy(y.data(), dy, prev.size() * 4, cudaMemcpyDeviceToHost));
            double worst = 0;
            for (size_t si = 0; si < sample.size(); ++si)
                for (int n = 0; n < 3; ++n) {
                    const size_t i = (size_t)n * M + sample[si];
                    worst = std::max(worst, std::fabs(y[i] - prev[i] - ref[si * 8 + n]) / (mag[si * 8 + n] + std::fabs(prev[i])));
                }
            if (!(worst <= acc_tol)) { std::printf("FAIL %s %s %s accumulate: %.3e\n", type_name(type), s.name, pname, worst); res.ok = false; }
        }
        // matvec_rows: a random subset (with repeats) equals the full matvec's rows bit for bit
        {
            const int n_rows = (int)std::min<int64_t>(M, 32768);
            std::vector<int32_t> rows(n_rows);
            for (auto &r : rows) r = (int32_t)(g.next() % (uint64_t)M);
            rows[0] = (int32_t)(M - 1);
            int32_t *drows;
            float *dyr;
            CK(cudaMalloc(&drows, n_rows * 4));
            CK(cudaMalloc(&dyr, (size_t)8 * n_rows * 4));
            CK(cudaMemcpy(drows, rows.data(), n_rows * 4, cudaMemcpyHostToDevice));
            for (int n = 1; n <= 8; ++n) {
                CK(cudaMemset(dy, 0xFF, 8 * M * 4));
                CK(cudaMemset(dyr, 0xFF, (size_t)8 * n_rows * 4));
                matvec(w, dx, dy, n, false, 0);
                matvec_rows(w, drows, n_rows, dx, dyr, n, 0);
                CK(cudaDeviceSynchronize());
                std::vector<float> yr((size_t)n * n_rows);
                CK(cudaMemcpy(y.data(), dy, (size_t)n * M * 4, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(yr.data(), dyr, yr.size() * 4, cudaMemcpyDeviceToHost));
                int64_t bad = 0;
                for (int v = 0; v < n; ++v)
                    for (int i = 0; i < n_rows; ++i) {
                        const float a = yr[(size_t)v * n_rows + i], b = y[(size_t)v * M + rows[i]];
                        bad += !(std::isfinite(a) && std::memcmp(&a, &b, 4) == 0);
                    }
                if (bad) { std::printf("FAIL %s %s %s matvec_rows n=%d: %lld rows differ\n", type_name(type), s.name, pname, n, (long long)bad); res.ok = false; }
            }
            if (s.M >= 100000) {   // the MTP head: time it
                const double ms = median_ms([&] { matvec_rows(w, drows, n_rows, dx, dyr, 1, 0); });
                const double gb = (double)res.bytes * n_rows / M;
                std::printf("  matvec_rows %s %s %s %d rows n=1: %.4f ms, %.0f GB/s\n", pname, type_name(type), s.name, n_rows, ms, gb / (ms * 1e-3) / 1e9);
            }
            CK(cudaFree(drows));
            CK(cudaFree(dyr));
        }
    }
    matvec_force_path(0);
    // timing
    for (int n = 1; n <= 8; ++n) {
        res.new_ms[n] = median_ms([&] { matvec(w, dx, dy, n, false, 0); });
        const bool sampled = n == 1 || n == 2 || n == 3 || n == 5 || n == 8;
        if (with_old && sampled) res.old_ms[n] = median_ms([&] { oj_old::matvec(wo, dx, dy, n, false, 0); });
        if (sampled) {
            matvec_force_path(1);
            res.i8_ms[n] = median_ms([&] { matvec(w, dx, dy, n, false, 0); });
            matvec_force_path(0);
        }
    }
    for (int n = 1; n <= 8; ++n) {
        for (int which = 0; which < 3; ++which) {
            const double ms = which == 0 ? res.new_ms[n] : which == 1 ? res.old_ms[n] : res.i8_ms[n];
            const char *label = which == 0 ? "new" : which == 1 ? "old" : "i8";
            if (ms <= 0) continue;
            const double gbs = res.bytes / (ms * 1e-3) / 1e9;
            const char *fmt = "%-5s %-10s %6lld %7lld %-3s n=%d %9.4f ms %7.0f GB/s %5.1f%% of copy\n";
            std::printf(fmt, type_name(type), s.name, (long long)K, (long long)M, label, n, ms, gbs, 100 * gbs / g_copy);
            if (g_table) std::fprintf(g_table, fmt, type_name(type), s.name, (long long)K, (long long)M, label, n, ms, gbs, 100 * gbs / g_copy);
        }
    }
    if (wo.data != w.data) CK(cudaFree(wo.data));
    CK(cudaFree(w.data));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    if (!res.ok) ++g_failures;
    return res;
}

int main(int argc, char **argv) {
    bool quick = false;
    const char *table_path = nullptr;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        else if (!std::strcmp(argv[i], "--table") && i + 1 < argc) table_path = argv[++i];
    }
    if (const char *r = std::getenv("MB_RUNS")) RUNS = std::max(5, std::atoi(r));
    if (table_path) g_table = std::fopen(table_path, "w");
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    CK(cudaMalloc(&g_flush, FLUSH_BYTES));
    g_copy = copy_gbs();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", g_copy);

    // the 27B's matrices (K = ne0 inputs, M = ne1 outputs) and how many a pass reads
    const Shape qkv{"attn_qkv", 5120, 10240}, gate{"attn_gate", 5120, 6144}, q{"attn_q", 5120, 12288},
        kv{"attn_k/v", 5120, 1024}, out5{"ssm_out", 6144, 5120}, ffn_gu{"ffn_gate", 5120, 17408},
        down{"ffn_down", 17408, 5120}, ab{"ssm_a/b", 5120, 48}, eh{"eh_proj", 10240, 5120},
        head{"output", 5120, 248320};
    struct Use { int type; Shape s; int count; };
    // Q4_K_M type map (openjet_plugin.testing.synth.q4_k_m_type_map for q27b); MTP block included
    const std::vector<Use> model = {
        {TYPE_Q4_K, gate, 48}, {TYPE_Q4_K, kv, 17 + 8}, {TYPE_Q6_K, kv, 9}, {TYPE_Q4_K, out5, 17 + 48},
        {TYPE_Q4_K, q, 17}, {TYPE_Q4_K, qkv, 24}, {TYPE_Q6_K, qkv, 24}, {TYPE_Q4_K, down, 32},
        {TYPE_Q6_K, down, 33}, {TYPE_Q4_K, ffn_gu, 130}, {TYPE_Q4_K, eh, 1}, {TYPE_Q6_K, head, 1},
        {TYPE_Q4_K, ab, 96},
    };
    struct Case { int type; Shape s; };
    std::vector<Case> cases;
    for (const Use &u : model) cases.push_back({u.type, u.s});
    // Q8_0 with K a multiple of 32 only (a partial last 128-column unit, fp16 scales not 8-byte
    // aligned for 1056), and the trained default model's ffn_down (K 1024, M 384) and output
    // (K 384, n_vocab 4096)
    const Shape k384{"k384", 384, 4096}, k640{"k640", 640, 1000}, k1056{"k1056", 1056, 4097},
        dflt_down{"dflt_down", 1024, 384};
    for (const Shape &s : {k384, k640, k1056, dflt_down}) cases.push_back({TYPE_Q8_0, s});
    if (!quick) {
        for (int t : {TYPE_Q5_K, TYPE_Q8_0, TYPE_F16, TYPE_BF16, TYPE_F32})
            for (const Shape &s : {qkv, ffn_gu, down}) cases.push_back({t, s});
        cases.push_back({TYPE_Q4_K, head});   // token_embd's shape, as a big Q4_K
    }
    std::map<std::string, Result> results;
    uint64_t seed = 1;
    for (const Case &c : cases) {
        // old needs K % 256 == 0 (Q8_0 too); --quick skips it (the time goes to the int8 path)
        const bool k256 = c.s.K % QK_K == 0 && !quick;
        const Result r = run_case(c.type, c.s, seed++, k256);
        results[std::string(type_name(c.type)) + " " + c.s.name] = r;
        std::printf("  -> %s %s: max rel err new %.2e int8 %.2e old %.2e, embed %.1e %s\n",
                    type_name(c.type), c.s.name, r.max_err, r.i8_err, r.old_err, r.embed_err, r.ok ? "ok" : "FAILED");
        std::fflush(stdout);
    }

    // summary
    std::printf("\n%-16s %9s | %-32s | %-32s | %-32s | %s\n", "case", "MB", "new % of copy n=1 2 3 5 8",
                "int8 % of copy n=1 2 3 5 8", "old % of copy n=1 2 3 5 8",
                "new n5/n1  err  int8 err");
    for (const Case &c : cases) {
        const std::string key = std::string(type_name(c.type)) + " " + c.s.name;
        const Result &r = results[key];
        auto pct = [&](double ms) { return ms > 0 ? 100.0 * (r.bytes / (ms * 1e-3) / 1e9) / g_copy : 0.0; };
        std::printf("%-16s %9.1f | %5.1f %5.1f %5.1f %5.1f %5.1f    | %5.1f %5.1f %5.1f %5.1f %5.1f    | %5.1f %5.1f %5.1f %5.1f %5.1f    | %5.2f  %.1e  %.1e%s\n",
                    key.c_str(), r.bytes / 1e6, pct(r.new_ms[1]), pct(r.new_ms[2]), pct(r.new_ms[3]), pct(r.new_ms[5]),
                    pct(r.new_ms[8]), pct(r.i8_ms[1]), pct(r.i8_ms[2]), pct(r.i8_ms[3]), pct(r.i8_ms[5]), pct(r.i8_ms[8]),
                    pct(r.old_ms[1]), pct(r.old_ms[2]), pct(r.old_ms[3]), pct(r.old_ms[5]),
                    pct(r.old_ms[8]), r.new_ms[5] / r.new_ms[1], r.max_err, r.i8_err, r.ok ? "" : " FAIL");
    }
    // one decode pass's matvecs (27B Q4_K_M, MTP included), new vs old vs int8
    for (int which = 0; which < 3; ++which) {
        double pass[9] = {0}, bytes = 0;
        for (const Use &u : model) {
            const Result &r = results[std::string(type_name(u.type)) + " " + u.s.name];
            for (int n = 1; n <= 8; ++n)
                pass[n] += u.count * (which == 0 ? r.new_ms[n] : which == 1 ? r.old_ms[n] : r.i8_ms[n]);
            bytes += (double)u.count * r.bytes;
        }
        if (pass[1] <= 0) continue;   // old not run (--quick)
        const char *label = which == 0 ? "new" : which == 1 ? "old" : "int8";
        std::printf("27B pass matvecs (%s, %.2f GB, kernel time only, flushed L2): n=1 %.2f ms (%.0f GB/s, %.0f%% of copy)"
                    "  n=2 %.2f  n=3 %.2f  n=5 %.2f  n=8 %.2f ms  n5/n1 %.2f\n",
                    label, bytes / 1e9, pass[1], bytes / (pass[1] * 1e-3) / 1e9,
                    100 * bytes / (pass[1] * 1e-3) / 1e9 / g_copy, pass[2], pass[3], pass[5], pass[8], pass[5] / pass[1]);
    }
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    if (g_table) std::fclose(g_table);
    return g_failures ? 1 : 0;
}
