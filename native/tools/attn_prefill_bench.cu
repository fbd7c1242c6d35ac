// attn_prefill_bench.cu: correctness and speed of attention_prefill.cu (causal flash attention on
// the fp16 tensor cores) against the engine's decode path and a plain fp32 reference.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -lineinfo -Xptxas -v -Inative native/tools/attn_prefill_bench.cu \
//        native/attention_prefill.cu native/attention.cu -o attn_bench
//   ./attn_bench [--quick]          (scripts/gpu.sh attn builds and runs it)
//
// Per case (head_dim D, n_head, n_head_kv, KV type, n new positions at pos0):
//   "engine" cases: random qg / k / v (fp32) for positions [0, pos0 + n), q_norm / k_norm random
//     in [0.6, 1.6]; attention_prepare over all pos0 + n positions (attention.cu: norms, RoPE, the
//     KV append as fp16 or q8_0) writes the cache and q_rot, then attention_by_decode (the decode
//     kernels, OJ_MAX_POSITIONS positions a call: split-K, gate) the decode outputs (one
//     attention_mix call over all positions did both until the decode kernels took at most
//     OJ_MAX_POSITIONS); then attention_prefill on q_rot / qg of positions [pos0, pos0 + n) is compared with
//     (a) the decode outputs of those positions, every output: max |prefill - decode| / max |decode|
//         <= 2e-3 (Q and P rounded to fp16 vs the decode path's fp32);
//     (b) the fp32 reference kernel below on sampled positions (all heads): the same bar.
//   "direct" cases (the deep timing cases, where a decode fill would take too long): the cache rows
//     [0, pos0 + n) random fp16 (or q8_0 quants + scales), q_rot and qg random; check (b) only.
//   Always: the cache rows past pos0 + n poisoned with NaN (a read of them shows), `out` poisoned
//   with NaN and one guard row past n that must stay NaN, every output finite. The reference
//   against the decode path is itself checked (<= 1e-4: both fp32).
//   (c) the same bits from the whole kernel, the split blocks (2 or more key segments) and the
//     positions in pieces of 64: memcmp of every output.
// Timing: CUDA events, median of 10 after 2 warm-ups; TFLOP/s = 4 n avg_kv D n_head / time with
// avg_kv = pos0 + (n + 1) / 2 (the causal average); for engine cases also the decode path
// (attention_by_decode on the same n positions) and the speed-up.
// Exit status 1 on any failed check.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "engine.cuh"
#include "reduce.cuh"

#include "tools/attn_fills.cuh"
#include "tools/harness.cuh"

using namespace oj;

static int g_failures = 0;
static const double BAR = 2e-3;        // prefill vs fp32 paths, of max |out|
static const double REF_BAR = 1e-4;    // fp32 reference vs the decode path

// ---- device random fills: tools/attn_fills.cuh ----------------------------------------------
static void launch_fill(float *p, int64_t count, uint64_t seed, float scale) {
    fill_normal<<<1024, 256>>>(p, count, seed, scale);
    check_launch("fill_normal");
}

// ---- fp32 reference: one block per (sampled position, head) ---------------------------------
__device__ __forceinline__ float kv_value(const void *cache, const __half *scale, bool q8, int64_t row, int D,
                                          int d) {
    if (q8) return (float)static_cast<const int8_t *>(cache)[row * D + d] * __half2float(scale[row * (D / 32) + d / 32]);
    return __half2float(static_cast<const __half *>(cache)[row * D + d]);
}

constexpr int REF_THREADS = 256, REF_CHUNK = 1024;

__global__ void __launch_bounds__(REF_THREADS)
reference_kernel(const float *__restrict__ q_rot, const float *__restrict__ qg, const void *k_cache,
                 const void *v_cache, const __half *k_scale, const __half *v_scale, bool q8,
                 const int *__restrict__ rows, float *__restrict__ ref, int H, int Hkv, int D, int n_ctx, int pos0) {
    __shared__ float qv[256], w[REF_CHUNK], red[32];
    const int si = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int i = rows[si];
    const int64_t row0 = (int64_t)(h / (H / Hkv)) * n_ctx;
    const int len = pos0 + i + 1;
    const float scale = 1.0f / sqrtf((float)D);
    for (int d = tid; d < D; d += REF_THREADS) qv[d] = q_rot[((int64_t)i * H + h) * D + d];
    __syncthreads();
    float m = -INFINITY;
    for (int j = tid; j < len; j += REF_THREADS) {
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qv[d] * kv_value(k_cache, k_scale, q8, row0 + j, D, d);
        m = fmaxf(m, dot * scale);
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    m = -INFINITY;
    for (int k = 0; k < REF_THREADS / 32; ++k) m = fmaxf(m, red[k]);
    float l = 0.0f, acc = 0.0f;
    for (int c0 = 0; c0 < len; c0 += REF_CHUNK) {
        const int cnt = min(REF_CHUNK, len - c0);
        __syncthreads();   // w of the previous chunk consumed
        for (int jj = tid; jj < cnt; jj += REF_THREADS) {
            float dot = 0.0f;
            for (int d = 0; d < D; ++d) dot += qv[d] * kv_value(k_cache, k_scale, q8, row0 + c0 + jj, D, d);
            w[jj] = expf(dot * scale - m);
            l += w[jj];
        }
        __syncthreads();
        if (tid < D)
            for (int jj = 0; jj < cnt; ++jj) acc += w[jj] * kv_value(v_cache, v_scale, q8, row0 + c0 + jj, D, tid);
    }
    l = block_sum(l);
    if (tid < D) {
        const float gate = qg[((int64_t)i * H * 2 + h * 2 + 1) * D + tid];
        ref[((int64_t)si * H + h) * D + tid] = acc / l * sigmoid(gate);
    }
}

// ---- one case -------------------------------------------------------------------------------
struct Case {
    int D, H, Hkv, kv, n, pos0;
    bool engine;   // fill through attention_prepare and compare with the decode outputs
};

template <class F>
static double median_ms(F &&f, int warm = 2, int runs = 10) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warm; ++i) f();
    std::vector<float> t;
    for (int i = 0; i < runs; ++i) {
        CK(cudaEventRecord(a));
        f();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static std::vector<int> sample_rows(int n, uint64_t seed) {
    std::set<int> s;
    for (int r : {0, 1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 95, 96, 97, 127, 128})
        if (r < n) s.insert(r);
    for (int r : {n / 2, n / 2 + 1, n - 17, n - 16, n - 15, n - 2, n - 1})
        if (r >= 0 && r < n) s.insert(r);
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + 7;
    while ((int)s.size() < std::min(n, 64)) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        s.insert((int)((z >> 33) % (uint64_t)n));
    }
    return std::vector<int>(s.begin(), s.end());
}

static void run_case(const Case &c, uint64_t seed, bool print_header) {
    const int D = c.D, H = c.H, Hkv = c.Hkv, n = c.n, pos0 = c.pos0;
    const int P = pos0 + n;
    const int n_ctx = P + 37;   // odd: KV head planes start at rows that are not tile aligned
    const bool q8 = c.kv == OJ_KV_Q8_0;
    char name[128];
    std::snprintf(name, sizeof name, "D=%d H=%d/%d %s n=%d pos0=%d", D, H, Hkv, q8 ? "q8_0" : "f16", n, pos0);
    if (print_header)
        std::printf("%-40s %9s %8s %10s %8s %11s %11s %11s %9s  %s\n", "case", "ms", "TFLOP/s", "decode ms", "speedup",
                    "err/decode", "err/ref", "ref/decode", "split ms", "status");

    ModelDims md{};
    md.hp.head_dim = D;
    md.hp.n_head = H;
    md.hp.n_head_kv = Hkv;
    md.hp.n_rot = D / 4;
    const int half = D / 8;   // rope sections sum to n_rot / 2, in the 27B's 11:11:10 proportion
    md.hp.rope_sections[0] = (half * 11 + 31) / 32;
    md.hp.rope_sections[1] = (half * 11 + 31) / 32;
    md.hp.rope_sections[2] = half - 2 * md.hp.rope_sections[0];
    md.hp.rope_sections[3] = 0;
    md.hp.rope_freq_base = 10000000.0f;
    md.hp.rms_eps = 1e-6f;

    Layer L;
    L.kv_type = c.kv;
    const int64_t values = (int64_t)Hkv * n_ctx * D;
    const size_t cache_bytes = q8 ? (size_t)values + (size_t)values / 32 * 2 : (size_t)values * 2;
    CK(cudaMalloc(&L.k_cache, cache_bytes));
    CK(cudaMalloc(&L.v_cache, cache_bytes));
    CK(cudaMemset(L.k_cache, 0xFF, cache_bytes));   // NaN (fp16 0xFFFF; q8_0: quant -1 x scale NaN)
    CK(cudaMemset(L.v_cache, 0xFF, cache_bytes));
    if (q8) {
        L.k_scale = reinterpret_cast<__half *>(static_cast<uint8_t *>(L.k_cache) + values);
        L.v_scale = reinterpret_cast<__half *>(static_cast<uint8_t *>(L.v_cache) + values);
    }
    float *qg, *q_rot, *dec_out = nullptr, *out;
    CK(cudaMalloc(&qg, (size_t)P * H * 2 * D * 4));
    CK(cudaMalloc(&q_rot, (size_t)P * H * D * 4));
    CK(cudaMalloc(&out, (size_t)(n + 1) * H * D * 4));   // + a guard row
    Scratch s;
    if (c.engine) {
        CK(cudaMalloc(&L.q_norm, D * 4));
        CK(cudaMalloc(&L.k_norm, D * 4));
        fill_uniform<<<4, 256>>>(L.q_norm, D, seed * 11 + 1, 0.6f, 1.6f);
        fill_uniform<<<4, 256>>>(L.k_norm, D, seed * 11 + 2, 0.6f, 1.6f);
        check_launch("fill_uniform");
        CK(cudaMalloc(&s.k, (size_t)P * Hkv * D * 4));
        CK(cudaMalloc(&s.v, (size_t)P * Hkv * D * 4));
        CK(cudaMalloc(&dec_out, (size_t)P * H * D * 4));
        s.max_splits = attention_splits_for(n_ctx);
        CK(cudaMalloc(&s.part_ml, (size_t)P * H * s.max_splits * 2 * 4));
        CK(cudaMalloc(&s.part_acc, (size_t)P * H * s.max_splits * D * 4));
        launch_fill(qg, (int64_t)P * H * 2 * D, seed * 11 + 3, 1.0f);
        launch_fill(s.k, (int64_t)P * Hkv * D, seed * 11 + 4, 1.0f);
        launch_fill(s.v, (int64_t)P * Hkv * D, seed * 11 + 5, 1.0f);
        s.qg = qg;
        s.q_rot = q_rot;
        s.attn_out = dec_out;
        attention_prepare(md, L, qg, s.k, s.v, q_rot, P, 0, n_ctx, 0);        // cache rows [0, P), q_rot
        attention_by_decode(md, L, s, q_rot, qg, dec_out, P, 0, n_ctx, 0);   // the decode outputs
    } else {
        launch_fill(qg, (int64_t)P * H * 2 * D, seed * 11 + 3, 1.0f);
        launch_fill(q_rot, (int64_t)P * H * D, seed * 11 + 6, 1.5f);
        if (q8) {
            fill_cache_q8<<<2048, 256>>>(static_cast<int8_t *>(L.k_cache), L.k_scale, Hkv, n_ctx, P, D, seed * 11 + 7);
            fill_cache_q8<<<2048, 256>>>(static_cast<int8_t *>(L.v_cache), L.v_scale, Hkv, n_ctx, P, D, seed * 11 + 8);
        } else {
            fill_cache_f16<<<2048, 256>>>(static_cast<__half *>(L.k_cache), Hkv, n_ctx, P, D, seed * 11 + 7);
            fill_cache_f16<<<2048, 256>>>(static_cast<__half *>(L.v_cache), Hkv, n_ctx, P, D, seed * 11 + 8);
        }
        check_launch("fill_cache");
    }
    CK(cudaDeviceSynchronize());

    const float *q_new = q_rot + (size_t)pos0 * H * D;
    const float *qg_new = qg + (size_t)pos0 * H * 2 * D;
    const size_t n_out = (size_t)n * H * D;
    CK(cudaMemset(out, 0xFF, (n_out + (size_t)H * D) * 4));   // NaN, guard row included
    attention_prefill(md, L, q_new, qg_new, out, n, pos0, n_ctx, 0);
    CK(cudaDeviceSynchronize());
    std::vector<float> y(n_out + (size_t)H * D);
    CK(cudaMemcpy(y.data(), out, y.size() * 4, cudaMemcpyDeviceToHost));

    bool ok = true;
    std::string why;
    size_t bad = 0, guard = 0;
    for (size_t i = 0; i < n_out; ++i) bad += !std::isfinite(y[i]);
    for (size_t i = n_out; i < y.size(); ++i) guard += !std::isnan(y[i]);
    if (bad || guard) {
        ok = false;
        why += " " + std::to_string(bad) + " outputs not finite, " + std::to_string(guard) + " written past n;";
    }

    // (a) against the decode path, every output
    double err_dec = -1, err_ref = -1, err_ref_dec = -1;
    std::vector<float> dec;
    if (c.engine) {
        dec.resize(n_out);
        CK(cudaMemcpy(dec.data(), dec_out + (size_t)pos0 * H * D, n_out * 4, cudaMemcpyDeviceToHost));
        double mx = 0, e = 0;
        for (size_t i = 0; i < n_out; ++i) {
            mx = std::max(mx, (double)std::fabs(dec[i]));
            const double d = std::fabs((double)y[i] - dec[i]);
            e = std::isnan(d) ? INFINITY : std::max(e, d);
        }
        err_dec = e / (mx + 1e-30);
        if (!(err_dec <= BAR)) {
            ok = false;
            why += " vs decode " + std::to_string(err_dec) + ";";
        }
    }
    // (b) against the fp32 reference on sampled positions, all heads
    {
        const std::vector<int> rows = sample_rows(n, seed);
        int *drows;
        float *dref;
        CK(cudaMalloc(&drows, rows.size() * 4));
        CK(cudaMalloc(&dref, rows.size() * H * D * 4));
        CK(cudaMemcpy(drows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
        reference_kernel<<<dim3((unsigned)rows.size(), H), REF_THREADS>>>(q_new, qg_new, L.k_cache, L.v_cache,
                                                                         L.k_scale, L.v_scale, q8, drows, dref, H,
                                                                         Hkv, D, n_ctx, pos0);
        check_launch("reference_kernel");
        std::vector<float> ref(rows.size() * H * D);
        CK(cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaFree(drows));
        CK(cudaFree(dref));
        double mx = 0, e = 0, erd = 0;
        for (size_t r = 0; r < rows.size(); ++r)
            for (size_t k = 0; k < (size_t)H * D; ++k) {
                const float rv = ref[r * H * D + k];
                const size_t at = (size_t)rows[r] * H * D + k;
                mx = std::max(mx, (double)std::fabs(rv));
                const double d = std::fabs((double)y[at] - rv);
                e = std::isnan(d) ? INFINITY : std::max(e, d);
                if (c.engine) {
                    const double dd = std::fabs((double)dec[at] - rv);
                    erd = std::isnan(dd) ? INFINITY : std::max(erd, dd);
                }
            }
        err_ref = e / (mx + 1e-30);
        if (!(err_ref <= BAR)) {
            ok = false;
            why += " vs fp32 reference " + std::to_string(err_ref) + ";";
        }
        if (c.engine) {
            err_ref_dec = erd / (mx + 1e-30);
            if (!(err_ref_dec <= REF_BAR)) {
                ok = false;
                why += " harness: reference vs decode " + std::to_string(err_ref_dec) + ";";
            }
        }
    }

    // (c) the same bits from the whole kernel (split 0), the split blocks (split 1, where there are
    // 2 or more segments) and the positions in pieces of 64 (each piece decides for itself), every
    // output compared bit for bit; each run's output poisoned with NaN first
    const int n_seg = (pos0 + n - 1) / 512 + 1;   // attention_prefill.cu's PREFILL_SEGMENT
    const size_t part_bytes = (size_t)n_seg * n * H * (D + 2) * 4;
    float *part, *out2;
    CK(cudaMalloc(&part, part_bytes));
    CK(cudaMalloc(&out2, n_out * 4));
    auto run_bits = [&](const char *what, auto &&launch) {
        CK(cudaMemset(out2, 0xFF, n_out * 4));
        launch();
        CK(cudaDeviceSynchronize());
        std::vector<float> z(n_out);
        CK(cudaMemcpy(z.data(), out2, n_out * 4, cudaMemcpyDeviceToHost));
        if (std::memcmp(z.data(), y.data(), n_out * 4) != 0) {
            size_t diff = 0;
            for (size_t i = 0; i < n_out; ++i) diff += std::memcmp(&z[i], &y[i], 4) != 0;
            ok = false;
            why += std::string(" ") + what + ": " + std::to_string(diff) + " outputs differ from the whole kernel's bits;";
        }
    };
    run_bits("auto", [&] { attention_prefill(md, L, q_new, qg_new, out2, n, pos0, n_ctx, 0, part, part_bytes, -1); });
    if (n_seg >= 2)
        run_bits("split", [&] { attention_prefill(md, L, q_new, qg_new, out2, n, pos0, n_ctx, 0, part, part_bytes, 1); });
    run_bits("pieces of 64", [&] {
        for (int i = 0; i < n; i += 64) {
            const int len = std::min(64, n - i);
            attention_prefill(md, L, q_new + (size_t)i * H * D, qg_new + (size_t)i * H * 2 * D, out2 + (size_t)i * H * D,
                              len, pos0 + i, n_ctx, 0, part, part_bytes, -1);
        }
    });

    // timing (the whole kernel; the split blocks beside it where there are 2 or more segments)
    const double ms = median_ms([&] { attention_prefill(md, L, q_new, qg_new, out, n, pos0, n_ctx, 0); });
    const double split_ms = n_seg < 2 ? -1 : median_ms([&] {
        attention_prefill(md, L, q_new, qg_new, out2, n, pos0, n_ctx, 0, part, part_bytes, 1);
    });
    CK(cudaFree(part));
    CK(cudaFree(out2));
    const double avg_kv = pos0 + (n + 1) / 2.0;
    const double tflops = 4.0 * n * avg_kv * D * H / (ms * 1e-3) / 1e12;
    double dec_ms = -1;
    if (c.engine) {
        // the same n positions through the decode kernels
        dec_ms = median_ms([&] { attention_by_decode(md, L, s, q_new, qg_new, dec_out + (size_t)pos0 * H * D, n, pos0, n_ctx, 0); });
    }
    CK(cudaDeviceSynchronize());

    char dbuf[32] = "-", sbuf[32] = "-", edbuf[32] = "-", rdbuf[32] = "-";
    if (dec_ms > 0) {
        std::snprintf(dbuf, sizeof dbuf, "%.3f", dec_ms);
        std::snprintf(sbuf, sizeof sbuf, "%.1fx", dec_ms / ms);
        std::snprintf(edbuf, sizeof edbuf, "%.2e", err_dec);
        std::snprintf(rdbuf, sizeof rdbuf, "%.2e", err_ref_dec);
    }
    char spbuf[32] = "-";
    if (split_ms > 0) std::snprintf(spbuf, sizeof spbuf, "%.3f", split_ms);
    std::printf("%-40s %9.3f %8.1f %10s %8s %11s %11.2e %11s %9s  %s\n", name, ms, tflops, dbuf, sbuf, edbuf, err_ref,
                rdbuf, spbuf, ok ? "ok" : "FAIL");
    if (!ok) {
        std::printf("FAIL %s:%s\n", name, why.c_str());
        ++g_failures;
    }
    std::fflush(stdout);

    CK(cudaFree(L.k_cache));
    CK(cudaFree(L.v_cache));
    CK(cudaFree(qg));
    CK(cudaFree(q_rot));
    CK(cudaFree(out));
    if (c.engine) {
        CK(cudaFree(L.q_norm));
        CK(cudaFree(L.k_norm));
        CK(cudaFree(s.k));
        CK(cudaFree(s.v));
        CK(cudaFree(dec_out));
        CK(cudaFree(s.part_ml));
        CK(cudaFree(s.part_acc));
    }
}

int main(int argc, char **argv) {
    bool quick = false;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        else { std::fprintf(stderr, "attn_prefill_bench: unknown argument %s\n", argv[i]); return 2; }
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int optin = 0;
    CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB, %d KB shared per block\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount, prop.l2CacheSize >> 20, optin >> 10);

    const int F16 = OJ_KV_F16, Q8 = OJ_KV_Q8_0;
    std::vector<Case> cases = {
        // the brief's correctness cases (engine fill: decode path + fp32 reference)
        {256, 24, 4, F16, 2048, 0, true},
        {256, 24, 4, F16, 512, 1800, true},
        {256, 24, 4, Q8, 256, 3000, true},
        {128, 8, 2, F16, 77, 5, true},
        {64, 4, 2, F16, 300, 0, true},
        {64, 4, 2, Q8, 33, 100, true},
        // edges: one position, group 1, a group split into chunks (8 -> 2 x 4; 6 -> 2 x 3 at D=128)
        {256, 24, 4, Q8, 1, 0, true},
        {64, 4, 4, F16, 1, 37, true},
        {256, 16, 2, F16, 100, 64, true},
        {128, 12, 2, Q8, 130, 63, true},
        {64, 8, 1, F16, 200, 17, true},
        // split blocks at the 27B's shape: a piece of 64 beside decoding streams, across a segment
        // boundary, and q8_0
        {256, 24, 4, F16, 64, 4096, false},
        {256, 24, 4, F16, 100, 1000, true},
        {256, 24, 4, Q8, 64, 2000, true},
        {128, 8, 2, Q8, 70, 1100, true},
        // deep timing cases (direct fill, fp32 reference on sampled positions)
        {256, 24, 4, F16, 2048, 8000, false},
        {256, 24, 4, F16, 64, 12224, false},
    };
    if (!quick) {
        cases.push_back({256, 24, 4, F16, 4096, 0, true});
        cases.push_back({256, 24, 4, F16, 2048, 29500, false});
        cases.push_back({256, 24, 4, Q8, 2048, 29500, false});
        cases.push_back({256, 24, 4, F16, 512, 29500, false});
        cases.push_back({128, 32, 8, F16, 2048, 8000, false});
    }
    uint64_t seed = 1;
    bool header = true;
    for (const Case &c : cases) {
        run_case(c, seed++, header);
        header = false;
    }
    std::printf("%s (%d failing cases)\n", g_failures ? "FAILED" : "all checks passed", g_failures);
    return g_failures ? 1 : 0;
}
