// matvec_f16_bench.cu: checks and times matvec_f16.cuh (fp16-activation decode matvec)
// beside matvec.cu's bf16-split reference kernels on the 27B Q4_K_M map's (type, shape) pairs.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Inative -Xcompiler -fopenmp native/tools/matvec_f16_bench.cu \
//        native/matvec.cu native/elementwise.cu native/deltanet.cu -o mvf -lgomp        (scripts/gpu.sh matvec-f16 builds and runs it)
//
// Per case: random valid blocks (bench_blocks.cuh), 16 random activation vectors (per-vector scales,
// two with a 300x range), the engine's to_device_layout. Checks (each failure prints FAIL, exit 1):
//   - every output written: y NaN-poisoned before every run, no NaN left for n = 1..16 (9..16: the
//     two-vector-tile instance, where the configuration has the 4 warps it needs);
//   - against a float64 host dequant (ggml-common.h definitions) times the UNROUNDED x on 64
//     sampled rows: |y - ref| <= 2e-3 * sum_k |w_k x_k| (the measured maximum is printed);
//   - against the bf16-split path (matvec_force_path(0)) on every output of all 8 vectors:
//     max |y - y_bf16| <= 3e-2 * rms(y_bf16) of that vector (printed: max and rms of the difference);
//   - vector v of every n-vector call (n = 1..16) bit-identical to a 1-vector call on x[v]; the
//     outputs of vectors n..15 left untouched (still the poison);
//   - accumulate adds: y == prev + W x exactly (one fp32 add onto the same W x);
//   - prep once, then the matvec alone three times on that prepared x (y poisoned before each):
//     every run bit-identical to matvec_f16 (the split-K counters are back at 0 after each call
//     without a prep re-zeroing them);
//   - the engine's entry points with the f16 path forced (matvec.cu's launch_any): matvec
//     bit-identical to matvec_f16; matvec_rows (an odd row subset with repeats) within 1e-4 rms;
//   - edge shapes (K = 256, 768, 4096 with 77 rows; K = 4608 with 1001 rows) under each forced
//     configuration (OJ_MVF16_CFG = 4,2 4,3 8,2 8,3, and none) times each forced split-K
//     (OJ_MVF16_SPLIT = 1, 2, 3, 7, clamped to the super-block count): the same checks, no timing;
//   - the workspace is NaN-poisoned once when allocated (the split-K counters must be zeroed by the
//     prep, and reset by each call's last blocks: every check runs many calls on one workspace);
//   - split sweep (model shapes): the matvec alone under OJ_MVF16_SPLIT = 1..8 at n = 1 and 5,
//     each forced split's 5-vector outputs within 1e-5 of the vector's rms of the picked split's.
// Timing: CUDA events, median of RUNS after warm-up, L2 flushed (256 MB memset) before each run:
// "f16" = prep + matvec (what one call costs), "f16run" =
// matvec alone on an already prepared x (the engine can prep once per x for several matrices),
// "bf16" = matvec.cu's reference kernels. The 27B pass sums count x median over the map; the split
// sweep's pass lines: the matvec alone with the picked split, with split 1 forced (the kernel before
// split-K) and with each shape's fastest split (what a perfect pick would give).
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
#include "matvec_f16.cuh"

#include "tools/harness.cuh"

using namespace oj;


static int g_failures = 0;
static int RUNS = 15;

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

struct Shape { const char *name; int64_t K, M; };
enum Path { F16 = 0, F16RUN, BF16, NPATH };
static const char *path_name[NPATH] = {"f16", "f16run", "bf16"};
static const int TIMED_N[] = {1, 2, 5, 8, 16};
constexpr int NV = 16;   // vectors of the checks (mvf16::MAX_VEC)
static const int SWEEP_S[] = {1, 2, 3, 4, 5, 6, 8};
constexpr int NSWEEP = sizeof(SWEEP_S) / sizeof(SWEEP_S[0]);

struct Result {
    double ms[NPATH][NV + 1] = {{0}};
    size_t bytes = 0;
    double ref_err = 0, bf_max = 0, bf_rms = 0;
    bool ok = true;
    mvf16::Config cfg1 = {0, 0, 0}, cfg8 = {0, 0, 0};   // picked at n = 1 and 8
    int sweep_s[NSWEEP] = {0}, sweep_w[NSWEEP] = {0};   // the split (and warps) each forced value ran
    double sweep_ms[NSWEEP][2] = {{0}};                 // matvec alone, n = 1 and 5
};

static void set_env(const char *name, const char *value) {
    if (value) setenv(name, value, 1);
    else unsetenv(name);
}

static double g_copy = 0;

// timed: the model's shapes (checks under the picked configuration, then timing); else an edge
// shape, checked under each forced configuration (OJ_MVF16_CFG), no timing.
static Result run_case(int type, const Shape &s, uint64_t seed, bool timed = true) {
    Result res;
    const int64_t K = s.K, M = s.M;
    std::vector<uint8_t> file = make_matrix(type, K, M, seed);
    const Matrix w = upload_matrix(type, K, M, file, &res.bytes);

    Rng g(seed ^ 0xABCDEFull);
    std::vector<float> x(NV * K);
    for (int n = 0; n < NV; ++n) {
        const float scale = n % 8 == 7 ? 300.0f : 0.5f + n;
        for (int64_t k = 0; k < K; ++k) x[n * K + k] = g.normalish() * scale;
    }
    // matvec_rows (the draft head's subset): an odd count, both ends, a repeat, descending runs
    const int64_t n_rows = M < 64 ? M + 5 : 333;
    std::vector<int32_t> rows(n_rows);
    for (int64_t o = 0; o < n_rows; ++o) rows[o] = (int32_t)(g.next() % (uint64_t)M);
    rows[0] = (int32_t)(M - 1);
    rows[n_rows - 1] = 0;
    rows[n_rows / 2] = rows[1];
    float *dx, *dy, *dy1, *dyb, *dyr;
    int32_t *drows;
    void *ws;
    CK(cudaMalloc(&dx, x.size() * 4));
    CK(cudaMalloc(&dy, NV * M * 4));
    CK(cudaMalloc(&dy1, NV * M * 4));
    CK(cudaMalloc(&dyb, 8 * M * 4));
    CK(cudaMalloc(&dyr, 8 * n_rows * 4));
    CK(cudaMalloc(&drows, n_rows * 4));
    CK(cudaMalloc(&ws, matvec_f16_workspace_bytes(K)));
    CK(cudaMemset(ws, 0xFF, matvec_f16_workspace_bytes(K)));   // garbage counters: the prep must zero them
    CK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(drows, rows.data(), n_rows * 4, cudaMemcpyHostToDevice));

    std::vector<int64_t> sample;
    for (int i = 0; i < 48; ++i) sample.push_back((int64_t)((double)i / 47 * (M - 1)));
    for (int i = 0; i < 16; ++i) sample.push_back((int64_t)(g.next() % (uint64_t)M));
    const size_t row_bytes = file_bytes(type, K, 1);
    std::vector<double> ref(sample.size() * NV), mag(sample.size() * NV), wrow;
    for (size_t si = 0; si < sample.size(); ++si) {
        ref_row(type, K, file.data() + (size_t)sample[si] * row_bytes, wrow);
        for (int n = 0; n < NV; ++n) {
            double acc = 0, a = 0;
            for (int64_t k = 0; k < K; ++k) {
                const double p = wrow[k] * (double)x[n * K + k];
                acc += p;
                a += std::fabs(p);
            }
            ref[si * NV + n] = acc;
            mag[si * NV + n] = a + 1e-30;
        }
    }
    std::vector<uint8_t>().swap(file);

    auto fetch = [&](float *d, int64_t count) {
        std::vector<float> h((size_t)count);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost));
        return h;
    };
    const char *cfg = nullptr, *split = nullptr;   // the forced configuration / split of the checks in progress
    auto fail_case = [&](const char *what, int n, double v) {
        const mvf16::Config c = mvf16::config_for(type, M, K, n);
        std::printf("FAIL %s %s cfg %s split %s (ran %d warps, %d stages, split %d) %s n=%d: %.3e\n", type_name(type), s.name,
                    cfg ? cfg : "picked", split ? split : "picked", c.warps, c.stages, c.split, what, n, v);
        res.ok = false;
    };
    const uint32_t POISON = 0xFFFFFFFFu;   // a NaN
    std::vector<float> y1;
    auto checks = [&]() {
        // 1-vector results on each x[v]
        CK(cudaMemset(dy1, 0xFF, NV * M * 4));
        for (int v = 0; v < NV; ++v) matvec_f16(w, dx + (size_t)v * K, dy1 + (size_t)v * M, 1, false, ws, 0);
        CK(cudaGetLastError());
        y1 = fetch(dy1, NV * M);
        // 9..16 vectors take 4 warps; a forced 8-warp configuration refuses them (decide)
        const int n_max = mvf16::config_for(type, M, K, 8).warps == 4 ? NV : 8;
        for (int n = 1; n <= n_max; ++n) {
            CK(cudaMemset(dy, 0xFF, NV * M * 4));   // NaN
            matvec_f16(w, dx, dy, n, false, ws, 0);
            CK(cudaGetLastError());
            const std::vector<float> y = fetch(dy, NV * M);
            int64_t unwritten = 0, differ = 0, past = 0;
            for (size_t i = 0; i < (size_t)n * M; ++i) {
                unwritten += !std::isfinite(y[i]);
                differ += std::memcmp(&y[i], &y1[i], 4) != 0;
            }
            for (size_t i = (size_t)n * M; i < y.size(); ++i) past += std::memcmp(&y[i], &POISON, 4) != 0;
            if (unwritten) fail_case("outputs not finite (count)", n, (double)unwritten);
            if (differ) fail_case("outputs differing from the 1-vector calls (count)", n, (double)differ);
            if (past) fail_case("outputs of vectors past n written (count)", n, (double)past);
            double worst = 0;
            for (size_t si = 0; si < sample.size(); ++si)
                for (int v = 0; v < n; ++v)
                    worst = std::max(worst, std::fabs(y[(size_t)v * M + sample[si]] - ref[si * NV + v]) / mag[si * NV + v]);
            res.ref_err = std::max(res.ref_err, worst);
            if (!(worst <= 2e-3)) fail_case("error / sum|w x| vs float64 (tol 2e-3)", n, worst);
        }
        // accumulate: y = prev + (the same W x), one fp32 add, so exactly prev + y1
        {
            std::vector<float> prev(3 * M);
            for (auto &v : prev) v = g.normalish();
            CK(cudaMemcpy(dy, prev.data(), prev.size() * 4, cudaMemcpyHostToDevice));
            matvec_f16(w, dx, dy, 3, true, ws, 0);
            const std::vector<float> y = fetch(dy, 3 * M);
            int64_t differ = 0;
            for (size_t i = 0; i < y.size(); ++i) {
                const float e = prev[i] + y1[i];
                differ += std::memcmp(&y[i], &e, 4) != 0;
            }
            if (differ) fail_case("accumulate: outputs differing from prev + W x (count)", 3, (double)differ);
        }
        // the matvec run again on an already prepared x (no prep in between, as the f16run timing
        // and the sweep do): only the last blocks' counter reset brings the split-K counters back to
        // 0 here (every matvec_f16 call above re-zeroes them in its prep, so none of its checks can
        // see a missing reset). y poisoned before each run: a run in which no block of a tile sees
        // itself last (counter not back at 0) leaves NaN. (Partials read too early would be the
        // previous run's, equal here: the 1-vector calls on 8 different x above are what shows those.)
        {
            CK(cudaMemset(dy, 0xFF, 8 * M * 4));
            mvf16::prep(type, dx, K, 8, ws, 0);
            for (int rep = 0; rep < 3; ++rep) {
                if (rep) CK(cudaMemset(dy, 0xFF, 8 * M * 4));
                mvf16::run(w, ws, dy, 8, false, nullptr, M, rep == 0, 0);   // rep 0: as matvec_f16 (PDL after the prep)
                CK(cudaGetLastError());
                const std::vector<float> y = fetch(dy, 8 * M);
                int64_t differ = 0;
                for (size_t i = 0; i < y.size(); ++i) differ += std::memcmp(&y[i], &y1[i], 4) != 0;
                if (differ) fail_case(rep ? "run again without a prep: outputs differing from matvec_f16's (count)"
                                          : "prep + run: outputs differing from matvec_f16's (count)",
                                      8, (double)differ);
            }
        }
        // the engine's entry points (matvec.cu's launch_any -> launch_f16)
        {
            matvec_force_path(2);
            CK(cudaMemset(dy, 0xFF, 8 * M * 4));
            matvec(w, dx, dy, 8, false, 0);
            const std::vector<float> y = fetch(dy, 8 * M);
            int64_t differ = 0;
            for (size_t i = 0; i < y.size(); ++i) differ += std::memcmp(&y[i], &y1[i], 4) != 0;
            if (differ) fail_case("engine matvec (f16 path) differing from matvec_f16 (count)", 8, (double)differ);
            // rows subset: another grid (maybe another split-K), so not bit-identical: 1e-4 of the
            // vector's rms (a wrong row is off by ~1 rms)
            CK(cudaMemset(dyr, 0xFF, 8 * n_rows * 4));
            matvec_rows(w, drows, (int)n_rows, dx, dyr, 8, 0);
            const std::vector<float> yr = fetch(dyr, 8 * n_rows);
            double worst = 0;
            for (int v = 0; v < 8; ++v) {
                double ss = 0;
                for (int64_t m = 0; m < M; ++m) ss += (double)y1[(size_t)v * M + m] * y1[(size_t)v * M + m];
                const double rms = std::sqrt(ss / M) + 1e-30;
                for (int64_t o = 0; o < n_rows; ++o) {
                    const double d = std::fabs((double)yr[(size_t)v * n_rows + o] - y1[(size_t)v * M + rows[o]]) / rms;
                    worst = std::max(worst, std::isfinite(d) ? d : 1e30);
                }
            }
            if (!(worst <= 1e-4)) fail_case("engine matvec_rows (f16 path) vs matvec_f16 / rms (tol 1e-4)", 8, worst);
            matvec_force_path(0);
        }
    };
    if (timed) {
        checks();
    } else {
        static const char *cfgs[] = {"4,2", "4,3", "8,2", "8,3", nullptr};
        static const char *splits[] = {"1", "2", "3", "7"};
        for (const char *c : cfgs)
            for (const char *sp : splits) {
                cfg = c;
                split = sp;
                set_env("OJ_MVF16_CFG", c);
                set_env("OJ_MVF16_SPLIT", sp);
                checks();
            }
        // last: the picked configuration, so that y1 below is the picked one's
        cfg = split = nullptr;
        set_env("OJ_MVF16_CFG", nullptr);
        set_env("OJ_MVF16_SPLIT", nullptr);
        checks();
    }
    res.cfg1 = mvf16::config_for(type, M, K, 1);
    res.cfg8 = mvf16::config_for(type, M, K, 8);
    if (res.cfg1.warps != res.cfg8.warps || res.cfg1.split != res.cfg8.split)   // the summation order must not follow n
        fail_case("picked warps / split differ between 1 and 8 vectors (split at 8)", 8, res.cfg8.split);
    // against the bf16-split path, all outputs of 8 vectors (y1: the last configuration's)
    {
        matvec_force_path(0);
        CK(cudaMemset(dyb, 0xFF, 8 * M * 4));
        matvec(w, dx, dyb, 8, false, 0);
        const std::vector<float> yb = fetch(dyb, 8 * M), y = y1;
        for (int v = 0; v < 8; ++v) {
            double ss = 0, dd = 0, mx = 0;
            for (int64_t m = 0; m < M; ++m) {
                const double b = yb[(size_t)v * M + m], d = y[(size_t)v * M + m] - b;
                ss += b * b;
                dd += d * d;
                mx = std::max(mx, std::fabs(d));
            }
            const double rms = std::sqrt(ss / M) + 1e-30;
            res.bf_max = std::max(res.bf_max, mx / rms);
            res.bf_rms = std::max(res.bf_rms, std::sqrt(dd / M) / rms);
        }
        if (!(res.bf_max <= 3e-2)) fail_case("max |f16 - bf16| / rms(bf16) (tol 3e-2)", 8, res.bf_max);
    }
    if (!timed) {
        CK(cudaFree(w.data));
        CK(cudaFree(dx));
        CK(cudaFree(dy));
        CK(cudaFree(dy1));
        CK(cudaFree(dyb));
        CK(cudaFree(dyr));
        CK(cudaFree(drows));
        CK(cudaFree(ws));
        if (!res.ok) ++g_failures;
        return res;
    }
    // timing
    for (int n : TIMED_N) {
        res.ms[F16][n] = median_ms([&] { matvec_f16(w, dx, dy, n, false, ws, 0); });
        mvf16::prep(type, dx, K, n, ws, 0);
        res.ms[F16RUN][n] = median_ms([&] { mvf16::run(w, ws, dy, n, false, nullptr, M, false, 0); });
        if (n == 1 || n == 5) {
            matvec_force_path(0);
            res.ms[BF16][n] = median_ms([&] { matvec(w, dx, dy, n, false, 0); });
            matvec_force_path(2);
        }
    }
    for (int p = 0; p < NPATH; ++p)
        for (int n : TIMED_N) {
            const double ms = res.ms[p][n];
            if (ms <= 0) continue;
            const double gbs = res.bytes / (ms * 1e-3) / 1e9;
            std::printf("%-5s %-10s %6lld %7lld %-6s n=%d %9.4f ms %7.0f GB/s %5.1f%% of copy\n", type_name(type), s.name,
                        (long long)K, (long long)M, path_name[p], n, ms, gbs, 100 * gbs / g_copy);
        }
    // split sweep: the matvec alone, each forced split (clamped as run() clamps it), n = 1 and 5;
    // the 5-vector outputs against the picked split's (y1: another summation grouping, so 1e-5 rms)
    for (int i = 0; i < NSWEEP; ++i) {
        char sv[8];
        std::snprintf(sv, sizeof sv, "%d", SWEEP_S[i]);
        split = sv;
        set_env("OJ_MVF16_SPLIT", sv);
        res.sweep_s[i] = mvf16::config_for(type, M, K, 1).split;
        res.sweep_w[i] = mvf16::config_for(type, M, K, 1).warps;
        for (int j = 0; j < 2; ++j) {
            const int n = j ? 5 : 1;
            mvf16::prep(type, dx, K, n, ws, 0);
            res.sweep_ms[i][j] = median_ms([&] { mvf16::run(w, ws, dy, n, false, nullptr, M, false, 0); });
        }
        const std::vector<float> y = fetch(dy, 5 * M);
        double worst = 0;
        for (int v = 0; v < 5; ++v) {
            double ss = 0;
            for (int64_t m = 0; m < M; ++m) ss += (double)y1[(size_t)v * M + m] * y1[(size_t)v * M + m];
            const double rms = std::sqrt(ss / M) + 1e-30;
            for (int64_t m = 0; m < M; ++m) {
                const double d = std::fabs((double)y[(size_t)v * M + m] - y1[(size_t)v * M + m]) / rms;
                worst = std::max(worst, std::isfinite(d) ? d : 1e30);
            }
        }
        if (!(worst <= 1e-5)) fail_case("split sweep: 5-vector outputs vs the picked split's / rms (tol 1e-5)", 5, worst);
    }
    split = nullptr;
    set_env("OJ_MVF16_SPLIT", nullptr);
    CK(cudaFree(w.data));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaFree(dy1));
    CK(cudaFree(dyb));
    CK(cudaFree(dyr));
    CK(cudaFree(drows));
    CK(cudaFree(ws));
    if (!res.ok) ++g_failures;
    return res;
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    if (const char *r = std::getenv("MB_RUNS")) RUNS = std::max(5, std::atoi(r));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    CK(cudaMalloc(&g_flush, FLUSH_BYTES));
    g_copy = copy_gbs();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", g_copy);

    const Shape qkv{"attn_qkv", 5120, 10240}, gate{"attn_gate", 5120, 6144}, q{"attn_q", 5120, 12288},
        kv{"attn_k/v", 5120, 1024}, out5{"ssm_out", 6144, 5120}, ffn_gu{"ffn_gate", 5120, 17408},
        down{"ffn_down", 17408, 5120}, ab{"ssm_a/b", 5120, 48}, eh{"eh_proj", 10240, 5120},
        head{"output", 5120, 248320};
    struct Use { int type; Shape s; int count; };
    // the 27B Q4_K_M map as tools/matvec_bench.cu has it (MTP block included)
    const std::vector<Use> model = {
        {TYPE_Q4_K, gate, 48}, {TYPE_Q4_K, kv, 17 + 8}, {TYPE_Q6_K, kv, 9}, {TYPE_Q4_K, out5, 17 + 48},
        {TYPE_Q4_K, q, 17}, {TYPE_Q4_K, qkv, 24}, {TYPE_Q6_K, qkv, 24}, {TYPE_Q4_K, down, 32},
        {TYPE_Q6_K, down, 33}, {TYPE_Q4_K, ffn_gu, 130}, {TYPE_Q4_K, eh, 1}, {TYPE_Q6_K, head, 1},
        {TYPE_Q4_K, ab, 96},
    };
    // edge shapes, every configuration: one super-block (warps with no work, a warp with fewer
    // super-blocks than stages), 3 super-blocks, 16 (8 warps, 2 each); 77 rows (a partial
    // row tile; Q6_K: an odd block count, so the d plane's last entry sits alone in its word);
    // 1001 rows x 18 super-blocks: 32 row tiles (32 split counters), splits of 2..3 super-blocks
    // under split 7 (warps with nothing to do inside a split)
    const Shape e1{"edge_k256", 256, 77}, e3{"edge_k768", 768, 77}, e16{"edge_k4096", 4096, 77},
        e18{"edge_k4608", 4608, 1001};
    uint64_t seed = 11;
    for (int type : {TYPE_Q4_K, TYPE_Q6_K})
        for (const Shape &sh : {e1, e3, e16, e18}) {
            const Result r = run_case(type, sh, seed++, false);
            std::printf("  -> %s %s (configs 4,2 4,3 8,2 8,3 picked x splits 1 2 3 7, picked split %d): err/sum|wx| vs "
                        "float64 %.2e, vs bf16-split max %.2e %s\n",
                        type_name(type), sh.name, r.cfg1.split, r.ref_err, r.bf_max, r.ok ? "ok" : "FAILED");
            std::fflush(stdout);
        }
    std::map<std::string, Result> results;
    for (const Use &u : model) {
        const Result r = run_case(u.type, u.s, seed++);
        results[std::string(type_name(u.type)) + " " + u.s.name] = r;
        std::printf("  -> %s %s (picked: %d warps, split %d, stages %d at n=1 / %d at n=8): err/sum|wx| vs float64 %.2e, "
                    "vs bf16-split max %.2e rms %.2e of rms %s\n",
                    type_name(u.type), u.s.name, r.cfg1.warps, r.cfg1.split, r.cfg1.stages, r.cfg8.stages, r.ref_err, r.bf_max,
                    r.bf_rms, r.ok ? "ok" : "FAILED");
        std::fflush(stdout);
    }
    std::printf("\n%-16s %8s %5s | %-35s | %-17s | %-17s | %s\n", "case", "MB", "W/S", "f16 (prep+mv) % copy n=1 2 5 8 16",
                "f16run n=1 5", "bf16 n=1 5", "err f64  vs bf16");
    for (const Use &u : model) {
        const Result &r = results[std::string(type_name(u.type)) + " " + u.s.name];
        auto pct = [&](double ms) { return ms > 0 ? 100.0 * (r.bytes / (ms * 1e-3) / 1e9) / g_copy : 0.0; };
        std::printf("%-5s %-10s %8.1f %2d/%-2d | %5.1f %5.1f %5.1f %5.1f %5.1f       | %5.1f %5.1f       | %5.1f %5.1f       | %.1e %.1e%s\n",
                    type_name(u.type), u.s.name, r.bytes / 1e6, r.cfg1.warps, r.cfg1.split, pct(r.ms[F16][1]), pct(r.ms[F16][2]),
                    pct(r.ms[F16][5]), pct(r.ms[F16][8]), pct(r.ms[F16][16]), pct(r.ms[F16RUN][1]), pct(r.ms[F16RUN][5]), pct(r.ms[BF16][1]),
                    pct(r.ms[BF16][5]), r.ref_err, r.bf_max, r.ok ? "" : " FAIL");
    }
    // split sweep: the matvec alone (f16run) in us per forced split; * marks the fastest, [] the picked
    std::printf("\nsplit sweep (matvec alone, us, flushed L2; forced OJ_MVF16_SPLIT -> split run; * fastest, [] picked)\n");
    double pass_pick[2] = {0}, pass_one[2] = {0}, pass_best[2] = {0};
    for (const Use &u : model) {
        const Result &r = results[std::string(type_name(u.type)) + " " + u.s.name];
        for (int j = 0; j < 2; ++j) {
            int best = 0, pk = -1;
            for (int i = 0; i < NSWEEP; ++i) {
                if (r.sweep_ms[i][j] < r.sweep_ms[best][j]) best = i;
                if (pk < 0 && r.sweep_s[i] == r.cfg1.split && r.sweep_w[i] == r.cfg1.warps) pk = i;
            }
            std::printf("%-5s %-10s n=%d |", type_name(u.type), u.s.name, j ? 5 : 1);
            for (int i = 0; i < NSWEEP; ++i)
                std::printf(" %c%d->%d%s %7.1f%c%c", i == pk ? '[' : ' ', SWEEP_S[i], r.sweep_s[i], r.sweep_w[i] == 8 ? "w8" : "",
                            1e3 * r.sweep_ms[i][j], i == pk ? ']' : ' ', i == best ? '*' : ' ');
            std::printf("\n");
            pass_best[j] += u.count * r.sweep_ms[best][j];
            pass_one[j] += u.count * r.sweep_ms[0][j];   // SWEEP_S[0] == 1: the unsplit kernel and warp rule
            pass_pick[j] += u.count * (pk >= 0 ? r.sweep_ms[pk][j] : r.ms[F16RUN][j ? 5 : 1]);
        }
    }
    std::printf("27B pass, matvec alone: picked split n=1 %6.2f ms n=5 %6.2f | split 1 (before split-K) n=1 %6.2f n=5 %6.2f | "
                "fastest split per shape n=1 %6.2f n=5 %6.2f\n",
                pass_pick[0], pass_pick[1], pass_one[0], pass_one[1], pass_best[0], pass_best[1]);
    for (int p = 0; p < NPATH; ++p) {
        double pass[NV + 1] = {0}, bytes = 0;
        for (const Use &u : model) {
            const Result &r = results[std::string(type_name(u.type)) + " " + u.s.name];
            for (int n : TIMED_N) pass[n] += u.count * r.ms[p][n];
            bytes += (double)u.count * r.bytes;
        }
        std::printf("27B pass (%-6s, %.2f GB, kernel time, flushed L2): n=1 %6.2f ms (%5.0f GB/s, %4.1f%% of copy)  n=5 %6.2f ms",
                    path_name[p], bytes / 1e9, pass[1], bytes / (pass[1] * 1e-3) / 1e9, 100 * bytes / (pass[1] * 1e-3) / 1e9 / g_copy,
                    pass[5]);
        if (pass[2] > 0) std::printf("  n=2 %6.2f  n=8 %6.2f  n=16 %6.2f (16 / 8: %.3f)", pass[2], pass[8], pass[16], pass[16] / pass[8]);
        std::printf("\n");
    }
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    return g_failures ? 1 : 0;
}
