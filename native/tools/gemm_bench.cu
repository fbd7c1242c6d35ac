// gemm_bench.cu: correctness and speed of gemm_prefill.cuh (quantised W x P positions on
// the integer tensor cores) on the 27B shapes.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xcompiler -fopenmp -Inative native/tools/gemm_bench.cu \
//        native/matvec.cu native/elementwise.cu native/deltanet.cu -o gb -lgomp
//   ./gb [--quick] [--table FILE]       (scripts/gpu.sh gemm builds and runs it)
//
// For each (type, shape) of the 27B Q4_K_M type map (the MTP block included, the output head
// not: prefill needs logits for its last position only) and, without --quick, Q5_K / Q8_0 /
// Q6_K on the big shapes: random valid blocks (finite fp16 scales), random X with a different
// scale per position (some positions 300x larger, one all zero), the engine's to_device_layout.
// Per P in {64, 256, 512, 2048} (plus P = 77, not a multiple of the 64-position tile, with an
// accumulate run), the output poisoned with NaN before each run, checked against
//   a float64 host dequant (ggml's dequantize_row_* written out here, not from the kernels)
//       times the unrounded X on sampled (row, position) pairs: <= 1e-2 of sum_k |w_k x_k|
//       (int8 rounding of X per 32 values);
//   every output finite (nothing left unwritten), nothing past P written (a guard row).
// Timing: CUDA events, median of RUNS (>= 10, default 15) after 3 warm-ups, L2 flushed (256 MB
// memset) before each; the quantisation of X and the GEMM timed separately; TOPS = 2 M K P /
// GEMM time; weight GB/s = device weight bytes / GEMM time (the weights are read once per
// position tile from L2; DRAM sees them ~once); "27B stack": sum over the Q4_K_M map's matrices
// (the 27B's counts: 64 layers + MTP) of (quantise + GEMM) time at each P, as
// tokens/s = P / that sum (projections only: no attention, DeltaNet, norms).
// Exit status 1 on any failed check.
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
#include "gemm_prefill.cuh"

#include "tools/harness.cuh"

using namespace oj;


static int g_failures = 0;
static int RUNS = 15;

#include "bench_blocks.cuh"

// ---- one case -------------------------------------------------------------------------------
struct Shape {
    const char *name;
    int64_t K, M;
};

static const int PS[4] = {64, 256, 512, 2048};
static const int P_ODD = 77;
static const int P_MAX = 2048;

struct Result {
    double q_ms[4] = {0}, g_ms[4] = {0};
    size_t bytes = 0;
    double err_ref = 0;
    bool ok = true;
};

static FILE *g_table = nullptr;

static Result run_case(int type, const Shape &s, uint64_t seed) {
    Result res;
    const int64_t K = s.K, M = s.M;
    std::vector<uint8_t> file = make_matrix(type, K, M, seed);
    const Matrix w = upload_matrix(type, K, M, file, &res.bytes);

    // X: P_MAX positions; scales vary by position (every 13th 300x, position 5 all zero) so the
    // per-block int8 scales differ across the tile
    Rng g(seed ^ 0xABCDEFull);
    std::vector<float> x = position_inputs(g, K, P_MAX);
    float *dx, *dy;
    void *ws;
    const size_t ws_bytes = gemm::workspace_bytes(K, P_MAX);
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dy, ((size_t)P_MAX + 1) * M * 4));   // + a guard row past P
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));

    // float64 reference on sampled rows x sampled positions
    std::vector<int64_t> srows;
    for (int i = 0; i < 12; ++i) srows.push_back((int64_t)((double)i / 11 * (M - 1)));
    for (int i = 0; i < 8; ++i) srows.push_back((int64_t)(g.next() % (uint64_t)M));
    std::vector<int> spos = {0, 1, 5, 7, 63, 64, 76};
    for (int i = 0; i < 9; ++i) spos.push_back((int)(g.next() % (uint64_t)P_MAX));
    spos.push_back(P_MAX - 1);
    const size_t row_bytes = file_bytes(type, K, 1);
    std::vector<double> ref(srows.size() * spos.size()), mag(srows.size() * spos.size()), wrow;
    for (size_t ri = 0; ri < srows.size(); ++ri) {
        ref_row(type, K, file.data() + (size_t)srows[ri] * row_bytes, wrow);
        for (size_t pi = 0; pi < spos.size(); ++pi) {
            double acc = 0, a = 0;
            const float *xp = x.data() + (size_t)spos[pi] * K;
            for (int64_t k = 0; k < K; ++k) {
                const double p = wrow[k] * (double)xp[k];
                acc += p;
                a += std::fabs(p);
            }
            ref[ri * spos.size() + pi] = acc;
            mag[ri * spos.size() + pi] = a + 1e-30;
        }
    }
    std::vector<float>().swap(x);
    std::vector<uint8_t>().swap(file);

    std::vector<float> y((size_t)(P_MAX + 1) * M);

    auto fail_msg = [&](const char *what, int P, const char *detail) {
        std::printf("FAIL %s %s P=%d %s: %s\n", type_name(type), s.name, P, what, detail);
        res.ok = false;
    };
    // checks of y [P][M] (+ prev when accumulating)
    auto check = [&](int P, const std::vector<float> *prev) {
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(y.data(), dy, ((size_t)P + 1) * M * 4, cudaMemcpyDeviceToHost));
        char buf[256];
        int64_t unwritten = 0, guard = 0;
        for (size_t i = 0; i < (size_t)P * M; ++i) unwritten += !std::isfinite(y[i]);
        for (int64_t m = 0; m < M; ++m) {   // the guard row was NaN-poisoned: must stay NaN
            const float v = y[(size_t)P * M + m];
            guard += !std::isnan(v);
        }
        if (unwritten || guard) {
            std::snprintf(buf, sizeof buf, "%lld outputs not finite, %lld written past P", (long long)unwritten,
                          (long long)guard);
            fail_msg("coverage", P, buf);
        }
        // against float64 on sampled pairs, relative to sum |w x|
        double worst_ref = 0;
        for (size_t ri = 0; ri < srows.size(); ++ri)
            for (size_t pi = 0; pi < spos.size(); ++pi) {
                const int p = spos[pi];
                if (p >= P) continue;
                const size_t i = (size_t)p * M + srows[ri];
                const double base = prev ? (*prev)[i] : 0.0;
                const double m = mag[ri * spos.size() + pi] + std::fabs(base);
                worst_ref = std::max(worst_ref, std::fabs((y[i] - base) - ref[ri * spos.size() + pi]) / m);
            }
        if (!(worst_ref <= 1e-2)) { std::snprintf(buf, sizeof buf, "vs float64 %.3e of sum|w x| (bar 1e-2)", worst_ref); fail_msg("float64", P, buf); }
        res.err_ref = std::max(res.err_ref, worst_ref);
    };

    for (int P : {PS[0], PS[1], PS[2], PS[3], P_ODD}) {
        CK(cudaMemset(dy, 0xFF, ((size_t)P + 1) * M * 4));   // NaN
        gemm::gemm_prefill(w, dx, P, dy, false, ws, ws_bytes, 0);
        check(P, nullptr);
    }
    {   // accumulate: y = prev + W x, at the odd P
        const int P = P_ODD;
        std::vector<float> prev((size_t)(P + 1) * M);
        for (auto &v : prev) v = g.normalish();
        for (int64_t m = 0; m < M; ++m) prev[(size_t)P * M + m] = NAN;   // guard row
        CK(cudaMemcpy(dy, prev.data(), prev.size() * 4, cudaMemcpyHostToDevice));
        gemm::gemm_prefill(w, dx, P, dy, true, ws, ws_bytes, 0);
        check(P, &prev);
    }

    // timing
    for (int pi = 0; pi < 4; ++pi) {
        const int P = PS[pi];
        res.q_ms[pi] = median_ms([&] { gemm::quantize_x(dx, K, P, type, ws, 0); });
        gemm::quantize_x(dx, K, P, type, ws, 0);
        res.g_ms[pi] = median_ms([&] { gemm::gemm_run(w, ws, P, dy, false, 0); });
        const double tops = 2.0 * M * K * P / (res.g_ms[pi] * 1e-3) / 1e12;
        const double gbs = res.bytes / (res.g_ms[pi] * 1e-3) / 1e9;
        const char *fmt = "%-5s %-10s %6lld %6lld P=%-5d gemm %8.4f ms  quantise %7.4f ms  %7.1f TOPS  %7.0f GB/s weights\n";
        std::printf(fmt, type_name(type), s.name, (long long)K, (long long)M, P, res.g_ms[pi], res.q_ms[pi], tops, gbs);
        if (g_table) std::fprintf(g_table, fmt, type_name(type), s.name, (long long)K, (long long)M, P, res.g_ms[pi], res.q_ms[pi], tops, gbs);
    }
    CK(cudaFree(w.data));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaFree(ws));
    if (!res.ok) ++g_failures;
    return res;
}

int main(int argc, char **argv) {
    bool quick = false;
    const char *table_path = nullptr;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        else if (!std::strcmp(argv[i], "--table") && i + 1 < argc) table_path = argv[++i];
        else { std::fprintf(stderr, "gemm_bench: unknown argument %s\n", argv[i]); return 2; }
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

    const Shape qkv{"attn_qkv", 5120, 10240}, gate{"attn_gate", 5120, 6144}, q{"attn_q", 5120, 12288},
        kv{"attn_k/v", 5120, 1024}, out5{"ssm_out", 6144, 5120}, ffn_gu{"ffn_gate", 5120, 17408},
        down{"ffn_down", 17408, 5120}, ab{"ssm_a/b", 5120, 48}, eh{"eh_proj", 10240, 5120};
    struct Use { int type; Shape s; int count; };
    // the 27B's Q4_K_M map (64 layers + the MTP block), without the output head
    const std::vector<Use> model = {
        {TYPE_Q4_K, ffn_gu, 130}, {TYPE_Q4_K, down, 32}, {TYPE_Q6_K, down, 33}, {TYPE_Q4_K, qkv, 24},
        {TYPE_Q6_K, qkv, 24}, {TYPE_Q4_K, q, 17}, {TYPE_Q4_K, out5, 17 + 48}, {TYPE_Q4_K, gate, 48},
        {TYPE_Q4_K, kv, 17 + 8}, {TYPE_Q6_K, kv, 9}, {TYPE_Q4_K, eh, 1}, {TYPE_Q4_K, ab, 96},
    };
    struct Case { int type; Shape s; };
    std::vector<Case> cases;
    for (const Use &u : model) cases.push_back({u.type, u.s});
    if (!quick) {
        for (const Shape &s : {qkv, ffn_gu, down}) {
            cases.push_back({TYPE_Q5_K, s});
            cases.push_back({TYPE_Q8_0, s});
        }
        cases.push_back({TYPE_Q6_K, ffn_gu});
    } else {
        cases.push_back({TYPE_Q8_0, qkv});
        cases.push_back({TYPE_Q5_K, kv});
    }
    std::map<std::string, Result> results;
    uint64_t seed = 1;
    for (const Case &c : cases) {
        const Result r = run_case(c.type, c.s, seed++);
        results[std::string(type_name(c.type)) + " " + c.s.name] = r;
        std::printf("  -> %s %s: vs float64 %.2e of sum|wx| %s\n", type_name(c.type), c.s.name, r.err_ref,
                    r.ok ? "ok" : "FAILED");
        std::fflush(stdout);
    }

    std::printf("\n%-16s %8s | %-36s | %-36s\n", "case", "MB", "TOPS at P = 64 256 512 2048", "weight GB/s at P = 64 256 512 2048");
    for (const Case &c : cases) {
        const Result &r = results[std::string(type_name(c.type)) + " " + c.s.name];
        double tops[4], gbs[4];
        for (int i = 0; i < 4; ++i) {
            tops[i] = 2.0 * c.s.M * c.s.K * PS[i] / (r.g_ms[i] * 1e-3) / 1e12;
            gbs[i] = r.bytes / (r.g_ms[i] * 1e-3) / 1e9;
        }
        std::printf("%-16s %8.1f | %8.1f %8.1f %8.1f %8.1f | %8.0f %8.0f %8.0f %8.0f%s\n",
                    (std::string(type_name(c.type)) + " " + c.s.name).c_str(), r.bytes / 1e6, tops[0], tops[1], tops[2],
                    tops[3], gbs[0], gbs[1], gbs[2], gbs[3], r.ok ? "" : " FAIL");
    }
    // the 27B stack's projections (Q4_K_M map, 64 layers + MTP) at each P
    for (int i = 0; i < 4; ++i) {
        double ms = 0, gms = 0, flop = 0, bytes = 0;
        for (const Use &u : model) {
            const Result &r = results[std::string(type_name(u.type)) + " " + u.s.name];
            ms += u.count * (r.g_ms[i] + r.q_ms[i]);
            gms += u.count * r.g_ms[i];
            flop += u.count * 2.0 * u.s.M * u.s.K * PS[i];
            bytes += (double)u.count * r.bytes;
        }
        std::printf("27B stack projections P=%-5d: %8.2f ms (GEMM %.2f, quantise %.2f)  %7.1f TOPS  %6.0f GB/s weights"
                    "  -> %7.0f tokens/s (projections only)\n",
                    PS[i], ms, gms, ms - gms, flop / (gms * 1e-3) / 1e12, bytes / (gms * 1e-3) / 1e9, PS[i] / (ms * 1e-3));
    }
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    if (g_table) std::fclose(g_table);
    return g_failures ? 1 : 0;
}
