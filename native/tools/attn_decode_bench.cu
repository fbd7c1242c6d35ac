// attn_decode_bench.cu: the chunked decode-attention partial kernel (attention.cu,
// attention_partial_chunked_kernel, OJ_ATTN_CHUNK=1) and the KV-group kernel (attention_partial_
// group_kernel, OJ_ATTN_CHUNK=group: K/V tiles in shared memory shared by a group's query heads and
// positions) against the one-position kernel (attention_partial_kernel) and a float64 CPU
// reference, then all timed.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -Xptxas -v -Inative native/tools/attn_decode_bench.cu \
//        native/attention.cu -o attn_decode_bench
//   ./attn_decode_bench [--quick]          (scripts/gpu_attn_decode.sh builds and runs it)
//
// Each case (head_dim D, n_head, n_head_kv, KV type, n new positions at depth pos0) goes through
// attention_by_decode (split-K partials + combine + sigmoid gate), the same entry the engine's
// decode uses, once per partial kernel: "old" (chunk 0), "c4" and "c8" (the chunked kernel at
// chunk 4 and 8), "grp" (the group kernel; 16), chosen with attention_force_chunk. Inputs: cache rows [0, pos0 + n) random fp16
// (or q8_0 quants + scales), rows past them NaN (a read past a position's causal length shows);
// q_rot and qg random. Before every run the outputs (plus one guard row past n) and the split-K
// partials are poisoned with NaN. Checks, each failure counted and the exit status 1:
//   - every output finite, the guard row still NaN;
//   - c4, c8 and grp against old, every output: max |new - old| / rms(old) <= 1e-4;
//   - old, c4, c8 and grp against a float64 CPU reference (softmax over exactly len = pos0 + i + 1
//     rows) on a few heads of every KV group, all n positions: max |x - ref| / rms(ref) <= 1e-4.
// Then (27B shape: n_head 24, n_head_kv 4, D 256) the kernels are timed at depths 1024, 8192 and
// 30000 for n = 1 and 5, fp16 and q8_0: CUDA events around attention_by_decode, median of 20 after
// 3 warm-ups, L2 flushed (a memset of twice its size) before every run as the weights of the
// rest of a decode step would; GB/s of the K+V bytes the positions read, and old / new ratios.
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

#include "tools/attn_fills.cuh"
#include "tools/harness.cuh"

namespace oj {
// attention.cu: the decode partial kernel, 0 one position per warp step, 4 / 8 the chunked
// kernel at that chunk, 16 the group kernel, -1 back to OJ_ATTN_CHUNK.
void attention_force_chunk(int c);
}  // namespace oj

using namespace oj;

static int g_failures = 0;
static const double BAR = 1e-4;   // of the rms of the output compared with
constexpr int NP = 4;
static const int PATHS[NP] = {0, 4, 8, 16};
static const char *PATH_NAME[NP] = {"old", "c4", "c8", "grp"};

// ---- one case's buffers ---------------------------------------------------------------------
struct Case {
    int D, H, Hkv, kv, n, pos0;
};

struct Buffers {
    ModelDims md{};
    Layer L;
    Scratch s;
    float *q_rot = nullptr, *qg = nullptr, *out = nullptr;
    int n_ctx = 0;
    size_t cache_bytes = 0, n_out = 0, part_ml_bytes = 0, part_acc_bytes = 0;
};

static std::string case_name(const Case &c) {
    char b[96];
    std::snprintf(b, sizeof b, "D=%d H=%d/%d %s n=%d depth=%d", c.D, c.H, c.Hkv, c.kv == OJ_KV_Q8_0 ? "q8_0" : "f16",
                  c.n, c.pos0);
    return b;
}

static Buffers make_buffers(const Case &c, uint64_t seed) {
    Buffers b;
    const int D = c.D, H = c.H, Hkv = c.Hkv, n = c.n, P = c.pos0 + c.n;
    const bool q8 = c.kv == OJ_KV_Q8_0;
    b.md.hp.head_dim = D;
    b.md.hp.n_head = H;
    b.md.hp.n_head_kv = Hkv;
    b.n_ctx = P + 37;   // rows [P, n_ctx) stay NaN
    b.L.kv_type = c.kv;
    const int64_t values = (int64_t)Hkv * b.n_ctx * D;
    b.cache_bytes = q8 ? (size_t)values + (size_t)values / 32 * 2 : (size_t)values * 2;
    CK(cudaMalloc(&b.L.k_cache, b.cache_bytes));
    CK(cudaMalloc(&b.L.v_cache, b.cache_bytes));
    CK(cudaMemset(b.L.k_cache, 0xFF, b.cache_bytes));   // NaN (fp16 0xFFFF; q8_0: quant -1 x scale NaN)
    CK(cudaMemset(b.L.v_cache, 0xFF, b.cache_bytes));
    if (q8) {
        b.L.k_scale = reinterpret_cast<__half *>(static_cast<uint8_t *>(b.L.k_cache) + values);
        b.L.v_scale = reinterpret_cast<__half *>(static_cast<uint8_t *>(b.L.v_cache) + values);
        fill_cache_q8<<<2048, 256>>>(static_cast<int8_t *>(b.L.k_cache), b.L.k_scale, Hkv, b.n_ctx, P, D, seed * 11 + 7);
        fill_cache_q8<<<2048, 256>>>(static_cast<int8_t *>(b.L.v_cache), b.L.v_scale, Hkv, b.n_ctx, P, D, seed * 11 + 8);
    } else {
        fill_cache_f16<<<2048, 256>>>(static_cast<__half *>(b.L.k_cache), Hkv, b.n_ctx, P, D, seed * 11 + 7);
        fill_cache_f16<<<2048, 256>>>(static_cast<__half *>(b.L.v_cache), Hkv, b.n_ctx, P, D, seed * 11 + 8);
    }
    check_launch("fill_cache");
    CK(cudaMalloc(&b.q_rot, (size_t)n * H * D * 4));
    CK(cudaMalloc(&b.qg, (size_t)n * H * 2 * D * 4));
    fill_normal<<<256, 256>>>(b.q_rot, (int64_t)n * H * D, seed * 11 + 6, 1.5f);
    fill_normal<<<256, 256>>>(b.qg, (int64_t)n * H * 2 * D, seed * 11 + 3, 1.0f);
    check_launch("fill_normal");
    b.n_out = (size_t)n * H * D;
    CK(cudaMalloc(&b.out, b.n_out * 4 + (size_t)H * D * 4));   // + a guard row
    b.s.max_splits = attention_splits_for(b.n_ctx);
    b.part_ml_bytes = (size_t)n * H * b.s.max_splits * 2 * 4;
    b.part_acc_bytes = (size_t)n * H * b.s.max_splits * D * 4;
    CK(cudaMalloc(&b.s.part_ml, b.part_ml_bytes));
    CK(cudaMalloc(&b.s.part_acc, b.part_acc_bytes));
    CK(cudaDeviceSynchronize());
    return b;
}

static void free_buffers(Buffers &b) {
    CK(cudaFree(b.L.k_cache));
    CK(cudaFree(b.L.v_cache));
    CK(cudaFree(b.q_rot));
    CK(cudaFree(b.qg));
    CK(cudaFree(b.out));
    CK(cudaFree(b.s.part_ml));
    CK(cudaFree(b.s.part_acc));
}

static void decode(const Case &c, Buffers &b, cudaStream_t st = 0) {
    attention_by_decode(b.md, b.L, b.s, b.q_rot, b.qg, b.out, c.n, c.pos0, b.n_ctx, st);
}

// One run of partial kernel `path`, outputs and partials NaN-poisoned first; outputs + guard row.
static std::vector<float> run_path(const Case &c, Buffers &b, int path) {
    const size_t guard = (size_t)c.H * c.D;
    CK(cudaMemset(b.out, 0xFF, (b.n_out + guard) * 4));
    CK(cudaMemset(b.s.part_ml, 0xFF, b.part_ml_bytes));
    CK(cudaMemset(b.s.part_acc, 0xFF, b.part_acc_bytes));
    attention_force_chunk(path);
    decode(c, b);
    CK(cudaDeviceSynchronize());
    std::vector<float> y(b.n_out + guard);
    CK(cudaMemcpy(y.data(), b.out, y.size() * 4, cudaMemcpyDeviceToHost));
    return y;
}

// ---- float64 CPU reference on a few heads ---------------------------------------------------
// Heads checked: the first and last of the first and last KV group, and one inside every group.
static std::vector<int> check_heads(int H, int Hkv) {
    std::vector<int> hs;
    const int group = H / Hkv;
    for (int g = 0; g < Hkv; ++g) hs.push_back(g * group + (g * 3 + 1) % group);
    hs.push_back(0);
    hs.push_back(H - 1);
    std::sort(hs.begin(), hs.end());
    hs.erase(std::unique(hs.begin(), hs.end()), hs.end());
    return hs;
}

// The cache rows [0, rows) of every KV head as floats (q8_0 dequantised: quant x block scale; the
// scale plane follows the quant plane in the allocation, as make_buffers lays it).
static std::vector<float> host_cache(const Case &c, const Buffers &b, const void *cache, int rows) {
    const int D = c.D, Hkv = c.Hkv;
    const bool q8 = c.kv == OJ_KV_Q8_0;
    std::vector<uint8_t> raw(b.cache_bytes);
    CK(cudaMemcpy(raw.data(), cache, raw.size(), cudaMemcpyDeviceToHost));
    const int64_t values = (int64_t)Hkv * b.n_ctx * D;
    std::vector<float> f((size_t)Hkv * rows * D);
    for (int g = 0; g < Hkv; ++g)
        for (int64_t r = 0; r < rows; ++r)
            for (int d = 0; d < D; ++d) {
                const int64_t at = ((int64_t)g * b.n_ctx + r) * D + d;
                float v;
                if (q8) {
                    const __half sc = reinterpret_cast<const __half *>(raw.data() + values)[at / 32];
                    v = (float)reinterpret_cast<const int8_t *>(raw.data())[at] * __half2float(sc);
                } else {
                    v = __half2float(reinterpret_cast<const __half *>(raw.data())[at]);
                }
                f[((size_t)g * rows + r) * D + d] = v;
            }
    return f;
}

// out[i][h][:] for h in heads: softmax(q k^T / sqrt(D)) over rows [0, pos0 + i + 1), times V,
// times sigmoid(gate), in float64. Indexed [i][heads index][d].
static std::vector<double> reference(const Case &c, const Buffers &b, const std::vector<int> &heads) {
    const int D = c.D, H = c.H, n = c.n, rows = c.pos0 + c.n, group = c.H / c.Hkv;
    const std::vector<float> K = host_cache(c, b, b.L.k_cache, rows);
    const std::vector<float> V = host_cache(c, b, b.L.v_cache, rows);
    std::vector<float> q((size_t)n * H * D), qg((size_t)n * H * 2 * D);
    CK(cudaMemcpy(q.data(), b.q_rot, q.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(qg.data(), b.qg, qg.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<double> ref((size_t)n * heads.size() * D);
    std::vector<double> sc(rows), acc(D);
    const double scale = 1.0 / std::sqrt((double)D);
    for (int i = 0; i < n; ++i)
        for (size_t hi = 0; hi < heads.size(); ++hi) {
            const int h = heads[hi], g = h / group, len = c.pos0 + i + 1;
            const float *qh = &q[((size_t)i * H + h) * D];
            double m = -INFINITY;
            for (int j = 0; j < len; ++j) {
                const float *kr = &K[((size_t)g * rows + j) * D];
                double dot = 0;
                for (int d = 0; d < D; ++d) dot += (double)qh[d] * kr[d];
                sc[j] = dot * scale;
                m = std::max(m, sc[j]);
            }
            double l = 0;
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int j = 0; j < len; ++j) {
                const double w = std::exp(sc[j] - m);
                l += w;
                const float *vr = &V[((size_t)g * rows + j) * D];
                for (int d = 0; d < D; ++d) acc[d] += w * vr[d];
            }
            for (int d = 0; d < D; ++d) {
                const double gate = qg[((size_t)i * H * 2 + h * 2 + 1) * D + d];
                ref[((size_t)i * heads.size() + hi) * D + d] = acc[d] / l / (1.0 + std::exp(-gate));
            }
        }
    return ref;
}

// ---- the checks -----------------------------------------------------------------------------
static double rms(const std::vector<float> &y, size_t count) {
    double s = 0;
    for (size_t i = 0; i < count; ++i) s += (double)y[i] * y[i];
    return std::sqrt(s / std::max<size_t>(count, 1));
}

static void check_case(const Case &c, uint64_t seed, bool header) {
    if (header)
        std::printf("%-36s %10s %10s %10s %10s %10s %10s %10s  %s\n", "check", "c4/old", "c8/old", "grp/old", "old/ref",
                    "c4/ref", "c8/ref", "grp/ref", "status");
    Buffers b = make_buffers(c, seed);
    std::vector<float> y[NP];
    for (int k = 0; k < NP; ++k) y[k] = run_path(c, b, PATHS[k]);
    attention_force_chunk(-1);
    bool ok = true;
    std::string why;
    for (int k = 0; k < NP; ++k) {
        size_t bad = 0, guard = 0;
        for (size_t i = 0; i < b.n_out; ++i) bad += !std::isfinite(y[k][i]);
        for (size_t i = b.n_out; i < y[k].size(); ++i) guard += !std::isnan(y[k][i]);
        if (bad || guard) {
            ok = false;
            why += std::string(" ") + PATH_NAME[k] + ": " + std::to_string(bad) + " outputs not finite, " +
                   std::to_string(guard) + " written past n;";
        }
    }
    // new against old, every output
    double vs_old[NP] = {0, 0, 0, 0};
    const double r_old = rms(y[0], b.n_out);
    for (int k = 1; k < NP; ++k) {
        double e = 0;
        for (size_t i = 0; i < b.n_out; ++i) {
            const double d = std::fabs((double)y[k][i] - y[0][i]);
            e = std::isnan(d) ? INFINITY : std::max(e, d);
        }
        vs_old[k] = e / (r_old + 1e-30);
        if (!(vs_old[k] <= BAR)) {
            ok = false;
            why += std::string(" ") + PATH_NAME[k] + " vs old " + std::to_string(vs_old[k]) + ";";
        }
    }
    // all three against the float64 reference on the checked heads
    const std::vector<int> heads = check_heads(c.H, c.Hkv);
    const std::vector<double> ref = reference(c, b, heads);
    double r_ref = 0;
    for (double v : ref) r_ref += v * v;
    r_ref = std::sqrt(r_ref / ref.size());
    double vs_ref[NP];
    for (int k = 0; k < NP; ++k) {
        double e = 0;
        for (int i = 0; i < c.n; ++i)
            for (size_t hi = 0; hi < heads.size(); ++hi)
                for (int d = 0; d < c.D; ++d) {
                    const double x = y[k][((size_t)i * c.H + heads[hi]) * c.D + d];
                    const double dd = std::fabs(x - ref[((size_t)i * heads.size() + hi) * c.D + d]);
                    e = std::isnan(dd) ? INFINITY : std::max(e, dd);
                }
        vs_ref[k] = e / (r_ref + 1e-30);
        if (!(vs_ref[k] <= BAR)) {
            ok = false;
            why += std::string(" ") + PATH_NAME[k] + " vs float64 reference " + std::to_string(vs_ref[k]) + ";";
        }
    }
    std::printf("%-36s %10.2e %10.2e %10.2e %10.2e %10.2e %10.2e %10.2e  %s\n", case_name(c).c_str(), vs_old[1], vs_old[2],
                vs_old[3], vs_ref[0], vs_ref[1], vs_ref[2], vs_ref[3], ok ? "ok" : "FAIL");
    if (!ok) {
        std::printf("FAIL %s:%s\n", case_name(c).c_str(), why.c_str());
        ++g_failures;
    }
    std::fflush(stdout);
    free_buffers(b);
}

// ---- timing ---------------------------------------------------------------------------------
static void *g_flush = nullptr;
static size_t g_flush_bytes = 0;

static double median_ms(const Case &c, Buffers &b, int path, int warm = 3, int runs = 20) {
    attention_force_chunk(path);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < warm; ++i) decode(c, b);
    std::vector<float> t;
    for (int i = 0; i < runs; ++i) {
        CK(cudaMemsetAsync(g_flush, i & 0xFF, g_flush_bytes));   // evict the cache rows from L2
        CK(cudaEventRecord(e0));
        decode(c, b);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    attention_force_chunk(-1);
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static void time_case(const Case &c, uint64_t seed, bool header) {
    if (header)
        std::printf("%-36s %9s %9s %9s %9s %8s %8s %8s %8s %8s %8s %8s\n", "timing (partial + combine)", "old us",
                    "c4 us", "c8 us", "grp us", "old GB/s", "c4 GB/s", "c8 GB/s", "grp GB/s", "old/c4", "old/c8", "c4/grp");
    Buffers b = make_buffers(c, seed);
    const bool q8 = c.kv == OJ_KV_Q8_0;
    // K and V rows of the deepest position, read once per query head group (L2 serves the rest)
    const double row_bytes = q8 ? c.D + c.D / 32 * 2 : c.D * 2;
    const double bytes = 2.0 * c.Hkv * (c.pos0 + c.n) * row_bytes;
    double ms[NP];
    for (int k = 0; k < NP; ++k) ms[k] = median_ms(c, b, PATHS[k]);
    std::printf("%-36s %9.1f %9.1f %9.1f %9.1f %8.0f %8.0f %8.0f %8.0f %7.2fx %7.2fx %7.2fx\n", case_name(c).c_str(),
                ms[0] * 1e3, ms[1] * 1e3, ms[2] * 1e3, ms[3] * 1e3, bytes / (ms[0] * 1e-3) / 1e9,
                bytes / (ms[1] * 1e-3) / 1e9, bytes / (ms[2] * 1e-3) / 1e9, bytes / (ms[3] * 1e-3) / 1e9,
                ms[0] / ms[1], ms[0] / ms[2], ms[1] / ms[3]);
    std::fflush(stdout);
    free_buffers(b);
}

int main(int argc, char **argv) {
    bool quick = false;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        else { std::fprintf(stderr, "attn_decode_bench: unknown argument %s\n", argv[i]); return 2; }
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    g_flush_bytes = std::max<size_t>((size_t)prop.l2CacheSize * 2, 64u << 20);
    CK(cudaMalloc(&g_flush, g_flush_bytes));

    const int F16 = OJ_KV_F16, Q8 = OJ_KV_Q8_0;
    // the 27B's attention shapes (openjet_plugin/config.py PRESETS["q27b"]), then narrower heads
    struct Shape { int D, H, Hkv; };
    const Shape q27b{256, 24, 4};
    std::vector<Case> checks;
    std::vector<int> depths = {0, 1, 255, 256, 257, 1024, 8192, 30000};
    if (quick) depths = {0, 1, 255, 256, 257, 1024};
    for (int kv : {F16, Q8})
        for (int depth : depths)
            for (int n : {1, 2, 5, 8}) checks.push_back({q27b.D, q27b.H, q27b.Hkv, kv, n, depth});
    for (const Shape sh : {Shape{128, 8, 2}, Shape{64, 4, 2}, Shape{64, 6, 2}})
        for (int kv : {F16, Q8})
            for (int depth : {0, 1, 30, 255, 256, 257, 700})
                for (int n : {1, 3, 8}) checks.push_back({sh.D, sh.H, sh.Hkv, kv, n, depth});
    uint64_t seed = 1;
    bool header = true;
    for (const Case &c : checks) {
        check_case(c, seed++, header);
        header = false;
    }

    header = true;
    for (int kv : {F16, Q8})
        for (int depth : {1024, 8192, 30000})
            for (int n : {1, 5}) {
                if (quick && depth == 30000) continue;
                time_case({q27b.D, q27b.H, q27b.Hkv, kv, n, depth}, seed++, header);
                header = false;
            }
    CK(cudaFree(g_flush));
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    return g_failures ? 1 : 0;
}
