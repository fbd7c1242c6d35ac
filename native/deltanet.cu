// deltanet.cu: the Gated DeltaNet mixer of one layer for 1..8 positions (llama.cpp's
// build_layer_attn_linear between the input projections and ssm_out).
//
// Order of the cycle, each a kernel below:
//   1. causal depthwise conv over [conv state | new qkv rows], SiLU; the conv state keeps the last
//      kernel-1 inputs ([conv_dim][kernel-1], oldest first, as ggml's conv_states);
//   2. L2 norm of every q and k head (x / sqrt(sum x^2 + eps)), q also times 1/sqrt(d_state);
//   3. the delta rule per value head h (key head h % n_key_heads, ggml's tiled order):
//        decay = exp(softplus(alpha + dt_bias) * ssm_a), beta = sigmoid(beta_raw)
//        S = decay * S;  S += outer((v - S k) * beta, k);  o = S q
//      with S stored [h][value j][key i], one warp per row j;
//   4. RMSNorm of o per head times ssm_norm, times SiLU(z).
// The numpy twin is ReferenceModel._deltanet (openjet_plugin/testing/reference.py).
#include "engine.cuh"
#include "reduce.cuh"

namespace oj {

namespace {

template <int KERNEL>
__global__ void deltanet_conv_kernel(const float *__restrict__ qkv, const float *__restrict__ w,
                                     float *__restrict__ state, float *__restrict__ out, int C, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[KERNEL - 1], wc[KERNEL];
#pragma unroll
    for (int j = 0; j < KERNEL - 1; ++j) win[j] = state[(int64_t)c * (KERNEL - 1) + j];
#pragma unroll
    for (int j = 0; j < KERNEL; ++j) wc[j] = w[(int64_t)c * KERNEL + j];
    for (int t = 0; t < n; ++t) {
        const float in = qkv[(int64_t)t * C + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < KERNEL - 1; ++j) acc += win[j] * wc[j];
        acc += in * wc[KERNEL - 1];
        out[(int64_t)t * C + c] = silu(acc);
#pragma unroll
        for (int j = 0; j < KERNEL - 2; ++j) win[j] = win[j + 1];
        win[KERNEL - 2] = in;
    }
#pragma unroll
    for (int j = 0; j < KERNEL - 1; ++j) state[(int64_t)c * (KERNEL - 1) + j] = win[j];
}

// grid (n, 2 * n_key_heads), block d_state: q heads first, then k heads, in the conv output.
__global__ void deltanet_qk_norm_kernel(float *__restrict__ conv_out, int C, int n_key_heads,
                                        float eps, float q_scale) {
    const int t = blockIdx.x, hh = blockIdx.y, S = blockDim.x;
    float *p = conv_out + (int64_t)t * C + (int64_t)hh * S;
    const float v = p[threadIdx.x];
    const float ss = block_sum(v * v);
    float y = v / sqrtf(ss + eps);
    if (hh < n_key_heads) y *= q_scale;
    p[threadIdx.x] = y;
}

// grid (n_v_heads, S / 4), block 128: warp w owns state row j = blockIdx.y * 4 + w.
template <int S>
__global__ void __launch_bounds__(128)
deltanet_recurrence_kernel(const float *__restrict__ conv_out, const float *__restrict__ beta_raw,
                           const float *__restrict__ alpha_raw, const float *__restrict__ dt_bias,
                           const float *__restrict__ ssm_a, float *__restrict__ state,
                           float *__restrict__ out, int C, int key_dim, int n_key_heads,
                           int n_v_heads, int n) {
    constexpr int R = S / 32;
    const int h = blockIdx.x, lane = threadIdx.x & 31;
    const int j = blockIdx.y * 4 + (threadIdx.x >> 5);
    const int kh = h % n_key_heads;
    float *row = state + ((int64_t)h * S + j) * S;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = row[r * 32 + lane];
    const float bias = dt_bias[h], a = ssm_a[h];
    for (int t = 0; t < n; ++t) {
        const float *base = conv_out + (int64_t)t * C;
        const float *q = base + kh * S;
        const float *k = base + key_dim + kh * S;
        const float v = base[2 * key_dim + h * S + j];
        const float beta = sigmoid(beta_raw[t * n_v_heads + h]);
        const float x = alpha_raw[t * n_v_heads + h] + bias;
        const float softplus = x > 20.0f ? x : log1pf(expf(x));
        const float decay = expf(softplus * a);
        float kr[R], qr[R];
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            kr[r] = k[r * 32 + lane];
            qr[r] = q[r * 32 + lane];
            kv += s[r] * kr[r];
        }
        kv = warp_sum(kv);
        const float delta = (v - decay * kv) * beta;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = decay * s[r] + kr[r] * delta;
            o += s[r] * qr[r];
        }
        o = warp_sum(o);
        if (lane == 0) out[(int64_t)t * n_v_heads * S + h * S + j] = o;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) row[r * 32 + lane] = s[r];
}

// grid (n, n_v_heads), block d_state: o = rms_norm(o) * ssm_norm * silu(z), in place.
__global__ void deltanet_gated_norm_kernel(float *__restrict__ o, const float *__restrict__ z,
                                           const float *__restrict__ w, float eps) {
    const int S = blockDim.x, i = threadIdx.x;
    const int64_t off = ((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * S + i;
    const float v = o[off];
    const float ss = block_sum(v * v);
    o[off] = v / sqrtf(ss / S + eps) * w[i] * silu(z[off]);
}

}  // namespace

void deltanet_mix(const ModelDims &d, Layer &L, Scratch &s, int n, cudaStream_t st) {
    const int C = d.ssm_conv_dim(), S = d.hp.ssm_d_state, Hk = d.hp.ssm_n_group, Hv = d.hp.ssm_dt_rank;
    const int key_dim = d.ssm_key_dim();
    const int threads = 128, blocks = (C + threads - 1) / threads;
    switch (d.hp.ssm_conv_kernel) {
        case 2: deltanet_conv_kernel<2><<<blocks, threads, 0, st>>>(s.qkv, L.conv1d, L.conv_state, s.conv_out, C, n); break;
        case 3: deltanet_conv_kernel<3><<<blocks, threads, 0, st>>>(s.qkv, L.conv1d, L.conv_state, s.conv_out, C, n); break;
        case 4: deltanet_conv_kernel<4><<<blocks, threads, 0, st>>>(s.qkv, L.conv1d, L.conv_state, s.conv_out, C, n); break;
        default: fail(OJ_ERR_UNSUPPORTED, "ssm.conv_kernel must be 2, 3 or 4");
    }
    check_launch("deltanet_conv");
    deltanet_qk_norm_kernel<<<dim3(n, 2 * Hk), S, 0, st>>>(s.conv_out, C, Hk, d.hp.rms_eps,
                                                          1.0f / sqrtf((float)S));
    check_launch("deltanet_qk_norm");
    const dim3 grid(Hv, S / 4);
    switch (S) {
        case 32: deltanet_recurrence_kernel<32><<<grid, 128, 0, st>>>(s.conv_out, s.beta, s.alpha, L.dt_bias, L.ssm_a, L.ssm_state, s.dn_out, C, key_dim, Hk, Hv, n); break;
        case 64: deltanet_recurrence_kernel<64><<<grid, 128, 0, st>>>(s.conv_out, s.beta, s.alpha, L.dt_bias, L.ssm_a, L.ssm_state, s.dn_out, C, key_dim, Hk, Hv, n); break;
        case 128: deltanet_recurrence_kernel<128><<<grid, 128, 0, st>>>(s.conv_out, s.beta, s.alpha, L.dt_bias, L.ssm_a, L.ssm_state, s.dn_out, C, key_dim, Hk, Hv, n); break;
        default: fail(OJ_ERR_UNSUPPORTED, "ssm.state_size must be 32, 64 or 128");
    }
    check_launch("deltanet_recurrence");
    deltanet_gated_norm_kernel<<<dim3(n, Hv), S, 0, st>>>(s.dn_out, s.z, L.ssm_norm, d.hp.rms_eps);
    check_launch("deltanet_gated_norm");
}

}  // namespace oj
