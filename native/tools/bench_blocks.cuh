// bench_blocks.cuh: what the matvec and GEMM harnesses share (include after `using namespace oj`,
// CK and the harness's own `static int RUNS`): a seeded generator, random but valid file-layout
// blocks of every weight type, a float64 row dequantiser written from ggml-common.h (not from
// the kernels), and median timing with the L2 flushed before each run.
#pragma once

// ---- a test matrix on the device, test inputs -----------------------------------------------
// The engine's device layout (to_device_layout) of file-layout blocks, uploaded; `bytes` gets its size.
static Matrix upload_matrix(int type, int64_t K, int64_t M, const std::vector<uint8_t> &file, size_t *bytes = nullptr) {
    const std::vector<uint8_t> dev = to_device_layout(type, K, M, file.data());
    if (bytes) *bytes = dev.size();
    Matrix w;
    w.type = type; w.K = K; w.M = M;
    CK(cudaMalloc(&w.data, dev.size()));
    CK(cudaMemcpy(w.data, dev.data(), dev.size(), cudaMemcpyHostToDevice));
    return w;
}

// ---- random numbers -------------------------------------------------------------------------
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float uniform() { return (next() >> 40) * (1.0f / 16777216.0f); }   // [0, 1)
    float normalish() { return (uniform() + uniform() + uniform() - 1.5f) * 2.0f; }
};

// P positions of K inputs drawn from g with a different scale per position (every 13th 300x larger,
// position 5 all zero), so per-position scales differ across a tile: the GEMM harnesses' X.
static std::vector<float> position_inputs(Rng &g, int64_t K, int P) {
    std::vector<float> x((size_t)P * K);
    for (int p = 0; p < P; ++p) {
        const float scale = p == 5 ? 0.0f : (p % 13 == 7 ? 300.0f : 0.5f + (p % 8));
        for (int64_t k = 0; k < K; ++k) x[(size_t)p * K + k] = g.normalish() * scale;
    }
    return x;
}

static uint16_t f16_bits(float v) {
    __half h = __float2half_rn(v);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
}
static double f16_val(uint16_t b) {
    __half h;
    std::memcpy(&h, &b, 2);
    return (double)__half2float(h);
}

// ---- file-layout blocks (ggml-common.h) -----------------------------------------------------
static size_t file_bytes(int type, int64_t K, int64_t M) {
    return (size_t)(K / type_block_values(type)) * type_block_bytes(type) * (size_t)M;
}

static std::vector<uint8_t> make_matrix(int type, int64_t K, int64_t M, uint64_t seed) {
    std::vector<uint8_t> out(file_bytes(type, K, M));
    const int64_t rows_per_chunk = 64;
#pragma omp parallel for schedule(dynamic)
    for (int64_t m0 = 0; m0 < M; m0 += rows_per_chunk) {
        Rng g(seed * 1000003ull + (uint64_t)m0);
        const int64_t m1 = std::min(M, m0 + rows_per_chunk);
        const size_t row_bytes = file_bytes(type, K, 1);
        uint8_t *p = out.data() + (size_t)m0 * row_bytes;
        const size_t n_bytes = (size_t)(m1 - m0) * row_bytes;
        if (type == TYPE_F32) {
            float *f = reinterpret_cast<float *>(p);
            for (size_t i = 0; i < n_bytes / 4; ++i) f[i] = g.normalish() * 0.05f;
        } else if (type == TYPE_F16) {
            uint16_t *h = reinterpret_cast<uint16_t *>(p);
            for (size_t i = 0; i < n_bytes / 2; ++i) h[i] = f16_bits(g.normalish() * 0.05f);
        } else if (type == TYPE_BF16) {
            uint16_t *h = reinterpret_cast<uint16_t *>(p);
            for (size_t i = 0; i < n_bytes / 2; ++i) {
                const float v = g.normalish() * 0.05f;
                uint32_t u;
                std::memcpy(&u, &v, 4);
                h[i] = (uint16_t)(u >> 16);
            }
        } else {
            // random bytes everywhere, then valid finite fp16 scales
            for (size_t i = 0; i + 8 <= n_bytes; i += 8) {
                const uint64_t r = g.next();
                std::memcpy(p + i, &r, 8);
            }
            for (size_t i = n_bytes & ~size_t(7); i < n_bytes; ++i) p[i] = (uint8_t)g.next();
            const int bb = type_block_bytes(type);
            for (size_t b = 0; b < n_bytes / bb; ++b) {
                uint8_t *blk = p + b * bb;
                const float d = (0.5f + g.uniform()) * 1e-3f, dmin = (0.5f + g.uniform()) * 1e-3f;
                if (type == TYPE_Q8_0) {
                    reinterpret_cast<block_q8_0 *>(blk)->d = f16_bits(d * 8.0f);
                } else if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
                    block_q4_K *q = reinterpret_cast<block_q4_K *>(blk);   // d, dmin lead both
                    q->d = f16_bits(d);
                    q->dmin = f16_bits(dmin * 8.0f);
                } else if (type == TYPE_Q6_K) {
                    reinterpret_cast<block_q6_K *>(blk)->d = f16_bits(d * 0.2f);
                }
            }
        }
    }
    return out;
}

// ggml's get_scale_min_k4, written out again here (not shared with the kernel file).
static void ref_scale_min(int j, const uint8_t *q, int &d, int &m) {
    if (j < 4) {
        d = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

// One row of the file layout, dequantised in float64 (ggml's dequantize_row_* order).
static void ref_row(int type, int64_t K, const uint8_t *row, std::vector<double> &y) {
    y.assign(K, 0.0);
    if (type == TYPE_F32) {
        for (int64_t k = 0; k < K; ++k) { float v; std::memcpy(&v, row + 4 * k, 4); y[k] = v; }
    } else if (type == TYPE_F16) {
        for (int64_t k = 0; k < K; ++k) { uint16_t b; std::memcpy(&b, row + 2 * k, 2); y[k] = f16_val(b); }
    } else if (type == TYPE_BF16) {
        for (int64_t k = 0; k < K; ++k) {
            uint16_t b; std::memcpy(&b, row + 2 * k, 2);
            const uint32_t u = (uint32_t)b << 16; float v; std::memcpy(&v, &u, 4); y[k] = v;
        }
    } else if (type == TYPE_Q8_0) {
        for (int64_t b = 0; b < K / 32; ++b) {
            const uint8_t *blk = row + b * 34;
            uint16_t db; std::memcpy(&db, blk, 2);
            for (int i = 0; i < 32; ++i) y[b * 32 + i] = f16_val(db) * (double)(int8_t)blk[2 + i];
        }
    } else if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
        const bool q5 = type == TYPE_Q5_K;
        const int bb = q5 ? 176 : 144;
        for (int64_t b = 0; b < K / 256; ++b) {
            const uint8_t *blk = row + b * bb;
            uint16_t db, mb; std::memcpy(&db, blk, 2); std::memcpy(&mb, blk + 2, 2);
            const double d = f16_val(db), dmin = f16_val(mb);
            const uint8_t *scales = blk + 4, *qh = blk + 16, *ql = blk + (q5 ? 48 : 16);
            double *out = y.data() + b * 256;
            int is = 0;
            unsigned u1 = 1, u2 = 2;
            for (int j = 0; j < 256; j += 64) {
                int sc, m;
                ref_scale_min(is + 0, scales, sc, m);
                const double d1 = d * sc, m1 = dmin * m;
                ref_scale_min(is + 1, scales, sc, m);
                const double d2 = d * sc, m2 = dmin * m;
                for (int l = 0; l < 32; ++l)
                    *out++ = d1 * ((ql[l] & 0xF) + (q5 && (qh[l] & u1) ? 16 : 0)) - m1;
                for (int l = 0; l < 32; ++l)
                    *out++ = d2 * ((ql[l] >> 4) + (q5 && (qh[l] & u2) ? 16 : 0)) - m2;
                ql += 32; is += 2; u1 <<= 2; u2 <<= 2;
            }
        }
    } else if (type == TYPE_Q6_K) {
        for (int64_t b = 0; b < K / 256; ++b) {
            const uint8_t *blk = row + b * 210;
            const uint8_t *ql = blk, *qh = blk + 128;
            const int8_t *sc = reinterpret_cast<const int8_t *>(blk + 192);
            uint16_t db; std::memcpy(&db, blk + 208, 2);
            const double d = f16_val(db);
            double *out = y.data() + b * 256;
            for (int n = 0; n < 256; n += 128) {
                for (int l = 0; l < 32; ++l) {
                    const int is = l / 16;
                    const int q1 = ((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    out[l + 0] = d * sc[is + 0] * q1;
                    out[l + 32] = d * sc[is + 2] * q2;
                    out[l + 64] = d * sc[is + 4] * q3;
                    out[l + 96] = d * sc[is + 6] * q4;
                }
                out += 128; ql += 64; qh += 32; sc += 8;
            }
        }
    }
}

// ---- timing ---------------------------------------------------------------------------------
// float64 W x on sampled (row, position) pairs: ref = sum_k w_k x_k and mag = sum_k |w_k x_k| for
// rows srows x positions spos (row-major [row][position]); W in the file layout, x [P][K].
static void sampled_reference(int type, int64_t K, const std::vector<uint8_t> &file, const std::vector<float> &x,
                              const std::vector<int64_t> &srows, const std::vector<int> &spos,
                              std::vector<double> &ref, std::vector<double> &mag) {
    const size_t row_bytes = file_bytes(type, K, 1);
    const size_t NR = srows.size(), NP = spos.size();
    ref.assign(NR * NP, 0.0);
    mag.assign(NR * NP, 0.0);
#pragma omp parallel for schedule(dynamic)
    for (int64_t ri = 0; ri < (int64_t)NR; ++ri) {
        std::vector<double> wrow;
        ref_row(type, K, file.data() + (size_t)srows[ri] * row_bytes, wrow);
        for (size_t pi = 0; pi < NP; ++pi) {
            double acc = 0, a = 0;
            const float *xp = x.data() + (size_t)spos[pi] * K;
            for (int64_t k = 0; k < K; ++k) {
                const double pr = wrow[k] * (double)xp[k];
                acc += pr;
                a += std::fabs(pr);
            }
            ref[ri * NP + pi] = acc;
            mag[ri * NP + pi] = a + 1e-30;
        }
    }
}

static uint8_t *g_flush = nullptr;
static const size_t FLUSH_BYTES = 256ull << 20;

template <class F>
static double median_ms(F &&launch) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) launch();
    std::vector<float> t;
    for (int i = 0; i < RUNS; ++i) {
        CK(cudaMemsetAsync(g_flush, i & 0xFF, FLUSH_BYTES, 0));
        CK(cudaEventRecord(a, 0));
        launch();
        CK(cudaEventRecord(b, 0));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[t.size() / 2];
}

