// engine.cu: loading a model description onto the device, and the forward passes of the main
// model and the MTP block for 1..8 positions. api.cu wraps these into the C API.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine.cuh"
#include "pdl.cuh"

namespace oj {

void fail(int code, const std::string &message) { throw Error{code, message}; }

void check_cuda(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return;
    const int code = err == cudaErrorMemoryAllocation ? OJ_ERR_OUT_OF_MEMORY : OJ_ERR_CUDA;
    fail(code, std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

void *Engine::alloc(size_t bytes, uint64_t &counter) {
    void *p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes ? bytes : 16);
    if (err != cudaSuccess) {
        cudaGetLastError();   // a failed cudaMalloc is not sticky; clear it
        const double mib = bytes / 1048576.0;
        fail(err == cudaErrorMemoryAllocation ? OJ_ERR_OUT_OF_MEMORY : OJ_ERR_CUDA,
             "cudaMalloc of " + std::to_string(mib) + " MiB failed (" + cudaGetErrorString(err) +
                 "); already held: " + std::to_string(memory.total / 1048576.0) + " MiB");
    }
    allocations.push_back(p);
    counter += bytes;
    memory.total += bytes;
    return p;
}

void Engine::release_all() {
    for (PassGraph &g : graphs) cudaGraphExecDestroy(g.exec);
    graphs.clear();
    for (cudaEvent_t ev : prof.events) cudaEventDestroy(ev);
    prof.events.clear();
    for (void *p : allocations) cudaFree(p);
    allocations.clear();
    if (stream) cudaStreamDestroy(stream);
    stream = nullptr;
    if (copy_stream) cudaStreamDestroy(copy_stream);
    copy_stream = nullptr;
    for (cudaEvent_t &ev : staged) {
        if (ev) cudaEventDestroy(ev);
        ev = nullptr;
    }
    if (staging) cudaFreeHost(staging);
    staging = nullptr;
}

namespace {

// The phases of a verify pass (oj_profile), in pass order; a layer's phases repeat per layer.
enum Phase {
    PH_EMBED, PH_NORM, PH_DN_PROJ, PH_DN_MIX, PH_DN_OUT, PH_AT_PROJ, PH_AT_CORE, PH_AT_OUT,
    PH_FFN_UP, PH_SWIGLU, PH_FFN_DOWN, PH_HEAD, PH_ARGMAX, PH_COUNT
};
const char *const PHASE_NAMES[PH_COUNT] = {
    "embedding", "norms", "deltanet projections", "deltanet conv+recurrence", "deltanet ssm_out",
    "attention q/k/v", "attention core", "attention output", "ffn gate+up", "swiglu", "ffn down", "head", "argmax"};
static_assert((int)PH_COUNT <= (int)OJ_MAX_PHASES, "oj_phase rows");

// the matrix's bytes in the file (a tiled layout's zero rows past M are read but not counted: the floor
// is the model's weights)
uint64_t weight_bytes(const Matrix &w) {
    return w.present() ? (uint64_t)(w.K / type_block_values(w.type)) * type_block_bytes(w.type) * (uint64_t)w.M : 0;
}

// An event on the stream where phase `ph` begins (-1: the pass ends) in a profiled verify.
void stamp(Engine &e, int ph, uint64_t bytes = 0) {
    Profile &p = e.prof;
    if (!p.active) return;
    if (p.used == (int)p.events.size()) {
        cudaEvent_t ev;
        check_cuda(cudaEventCreate(&ev), "oj_profile: cudaEventCreate");
        p.events.push_back(ev);
        p.phase.push_back(0);
        p.launches.push_back(0);
        p.bytes.push_back(0);
    }
    check_cuda(cudaEventRecord(p.events[p.used], e.stream), "oj_profile: cudaEventRecord");
    p.phase[p.used] = ph;
    p.launches[p.used] = g_launches;
    p.bytes[p.used] = bytes;
    ++p.used;
}

// After the pass's stream has finished: its events into the totals.
void collect(Engine &e) {
    Profile &p = e.prof;
    for (int i = 0; i + 1 < p.used; ++i) {
        float ms = 0.0f;
        check_cuda(cudaEventElapsedTime(&ms, p.events[i], p.events[i + 1]), "oj_profile: cudaEventElapsedTime");
        Profile::Total &t = p.total[p.phase[i]];
        t.ms += ms;
        t.calls += 1;
        t.launches += (int64_t)(p.launches[i + 1] - p.launches[i]);
        t.bytes += p.bytes[i];
    }
    if (p.used > 1) {
        float ms = 0.0f;
        check_cuda(cudaEventElapsedTime(&ms, p.events[0], p.events[p.used - 1]), "oj_profile: cudaEventElapsedTime");
        p.span_ms += ms;
        ++p.passes;
    }
    p.used = 0;
}

bool is_float_type(int t) { return t == TYPE_F32 || t == TYPE_F16 || t == TYPE_BF16; }
bool is_supported_type(int t) {
    return is_float_type(t) || t == TYPE_Q8_0 || t == TYPE_Q4_K || t == TYPE_Q5_K || t == TYPE_Q6_K;
}

float half_to_float_host(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31;
    int exp = (h >> 10) & 0x1F;
    uint32_t mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {   // subnormal: normalise
            exp = 1;
            while (!(mant & 0x400)) { mant <<= 1; --exp; }
            mant &= 0x3FF;
            bits = sign | (uint32_t)(exp + 112) << 23 | mant << 13;
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | mant << 13;
    } else {
        bits = sign | (uint32_t)(exp + 112) << 23 | mant << 13;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Finds, checks and uploads the tensors of a model description.
class Loader {
public:
    Loader(Engine &e, const oj_model_desc &desc) : e_(e) {
        for (int i = 0; i < desc.n_tensors; ++i) {
            const oj_tensor &t = desc.tensors[i];
            if (!t.name) fail(OJ_ERR_INVALID_ARGUMENT, "tensor " + std::to_string(i) + " has no name");
            by_name_[t.name] = &t;
        }
    }

    bool has(const std::string &name) const { return by_name_.count(name) != 0; }

    // A 2-D weight with ne = (K, M); absent and not required -> an empty Matrix.
    Matrix matrix(const std::string &name, int64_t K, int64_t M, bool required = true) {
        const oj_tensor *t = find(name, required);
        Matrix w;
        if (!t) return w;
        if (t->n_dims != 2 || t->ne[0] != K || t->ne[1] != M)
            fail(OJ_ERR_INVALID_ARGUMENT, "tensor '" + name + "' has shape " + shape(*t) +
                                              ", expected [" + std::to_string(K) + ", " + std::to_string(M) + "]");
        if (!is_supported_type(t->type))
            fail(OJ_ERR_UNSUPPORTED, "tensor '" + name + "' has type id " + std::to_string(t->type) +
                                         ", which the native engine does not support (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)");
        const int unit = is_float_type(t->type) ? 8 : (t->type == TYPE_Q8_0 ? 32 : QK_K);
        if (K % unit != 0)
            fail(OJ_ERR_UNSUPPORTED, "tensor '" + name + "' (" + type_name(t->type) + ") has " + std::to_string(K) +
                                         " columns; the native kernels need a multiple of " + std::to_string(unit));
        check_bytes(*t, name, (uint64_t)(K / type_block_values(t->type)) * type_block_bytes(t->type) * (uint64_t)M);
        w.type = t->type;
        w.K = K;
        w.M = M;
        const std::vector<uint8_t> dev = to_device_layout(t->type, K, M, static_cast<const uint8_t *>(t->data));
        w.data = static_cast<uint8_t *>(e_.alloc(dev.size(), e_.memory.weights));
        check_cuda(cudaMemcpy(w.data, dev.data(), dev.size(), cudaMemcpyHostToDevice), "upload weights");
        return w;
    }

    // A small tensor (norm, bias, conv kernel) of `count` values, stored as fp32 on the device.
    float *vector(const std::string &name, int64_t count, bool required = true) {
        const oj_tensor *t = find(name, required);
        if (!t) return nullptr;
        int64_t elems = 1;
        for (int i = 0; i < t->n_dims; ++i) elems *= t->ne[i];
        if (elems != count)
            fail(OJ_ERR_INVALID_ARGUMENT, "tensor '" + name + "' has shape " + shape(*t) + " (" +
                                              std::to_string(elems) + " values), expected " + std::to_string(count));
        if (!is_float_type(t->type))
            fail(OJ_ERR_UNSUPPORTED, "tensor '" + name + "' has type " + type_name(t->type) +
                                         "; the native engine reads norms, biases and conv kernels as F32, F16 or BF16");
        check_bytes(*t, name, (uint64_t)count * type_block_bytes(t->type));
        std::vector<float> host(count);
        if (t->type == TYPE_F32) {
            std::memcpy(host.data(), t->data, count * 4);
        } else {
            const uint16_t *src = static_cast<const uint16_t *>(t->data);
            for (int64_t i = 0; i < count; ++i) {
                if (t->type == TYPE_F16) {
                    host[i] = half_to_float_host(src[i]);
                } else {
                    const uint32_t bits = (uint32_t)src[i] << 16;
                    std::memcpy(&host[i], &bits, 4);
                }
            }
        }
        float *d = static_cast<float *>(e_.alloc(count * sizeof(float), e_.memory.weights));
        check_cuda(cudaMemcpy(d, host.data(), count * sizeof(float), cudaMemcpyHostToDevice), "upload weights");
        return d;
    }

private:
    const oj_tensor *find(const std::string &name, bool required) const {
        auto it = by_name_.find(name);
        if (it == by_name_.end()) {
            if (required) fail(OJ_ERR_INVALID_ARGUMENT, "tensor '" + name + "' is missing from the model description");
            return nullptr;
        }
        if (!it->second->data) fail(OJ_ERR_INVALID_ARGUMENT, "tensor '" + name + "' has a NULL data pointer");
        return it->second;
    }

    static std::string shape(const oj_tensor &t) {
        std::string s = "[";
        for (int i = 0; i < t.n_dims; ++i) s += (i ? ", " : "") + std::to_string(t.ne[i]);
        return s + "]";
    }

    static void check_bytes(const oj_tensor &t, const std::string &name, uint64_t expected) {
        if (t.n_bytes != expected)
            fail(OJ_ERR_INVALID_ARGUMENT, "tensor '" + name + "' has " + std::to_string(t.n_bytes) + " bytes, its shape and type need " +
                                              std::to_string(expected));
    }

    Engine &e_;
    std::unordered_map<std::string, const oj_tensor *> by_name_;
};

void check_hparams(const oj_hparams &hp, int n_ctx) {
    auto need = [](bool ok, const std::string &what) {
        if (!ok) fail(OJ_ERR_INVALID_ARGUMENT, "hyperparameter check failed: " + what);
    };
    need(hp.n_vocab > 0 && hp.n_embd > 0 && hp.n_layer > 0 && hp.n_ff > 0, "n_vocab, n_embd, n_layer, n_ff must be positive");
    need(hp.n_head > 0 && hp.n_head_kv > 0 && hp.n_head % hp.n_head_kv == 0, "n_head must be a positive multiple of n_head_kv");
    need(hp.head_dim == 64 || hp.head_dim == 128 || hp.head_dim == 256, "head_dim must be 64, 128 or 256");
    need(hp.n_rot > 0 && hp.n_rot <= hp.head_dim && hp.n_rot % 2 == 0, "n_rot must be even and <= head_dim");
    need(hp.rope_sections[0] + hp.rope_sections[1] + hp.rope_sections[2] + hp.rope_sections[3] > 0, "rope sections are all zero");
    need(hp.ssm_d_state == 32 || hp.ssm_d_state == 64 || hp.ssm_d_state == 128, "ssm_d_state must be 32, 64 or 128");
    need(hp.ssm_n_group > 0 && hp.ssm_dt_rank % hp.ssm_n_group == 0, "ssm_dt_rank must be a multiple of ssm_n_group");
    need(hp.ssm_conv_kernel >= 2 && hp.ssm_conv_kernel <= 4, "ssm_conv_kernel must be 2..4");
    need(hp.full_attention_interval > 0, "full_attention_interval must be positive");
    need(hp.n_layer_nextn == 0 || hp.n_layer_nextn == 1, "n_layer_nextn must be 0 or 1");
    need(hp.rms_eps > 0.0f, "rms_eps must be positive");
    need(n_ctx > 0, "n_ctx must be positive");
}

void load_common(Loader &ld, Engine &e, Layer &L, int il) {
    const ModelDims &d = e.dims;
    const std::string p = "blk." + std::to_string(il) + ".";
    const int E = d.hp.n_embd, F = d.hp.n_ff;
    L.attn_norm = ld.vector(p + "attn_norm.weight", E);
    L.post_norm = ld.vector(p + "post_attention_norm.weight", E);
    L.ffn_gate = ld.matrix(p + "ffn_gate.weight", E, F);
    L.ffn_up = ld.matrix(p + "ffn_up.weight", E, F);
    L.ffn_down = ld.matrix(p + "ffn_down.weight", F, E);
}

// K and V caches of an attention layer (or the MTP block) in e.kv_type; see Layer's KV fields.
// q8_0: the int8 plane (kv_dim * n_ctx bytes, a multiple of 64) then the fp16 scales, 34 bytes per
// 32 values in all, which is what memory.kv_cache reports and estimate_device_bytes predicts.
// Sequences: one allocation each for K and V holding every sequence's, sequence i's at
// i * kv_seq_bytes (bind_sequence points the layer at the selected one's).
void alloc_kv(Engine &e, Layer &L) {
    const size_t values = (size_t)e.dims.kv_dim() * e.n_ctx;
    L.kv_type = e.kv_type;
    L.kv_seq_bytes = e.kv_type == OJ_KV_F16 ? values * sizeof(__half) : values + values / QK8_0 * sizeof(__half);
    KvPlanes &b = L.kv_base;
    b.k_cache = e.alloc(L.kv_seq_bytes * e.n_seq, e.memory.kv_cache);
    b.v_cache = e.alloc(L.kv_seq_bytes * e.n_seq, e.memory.kv_cache);
    if (e.kv_type == OJ_KV_Q8_0) {
        b.k_scale = reinterpret_cast<__half *>(static_cast<uint8_t *>(b.k_cache) + values);
        b.v_scale = reinterpret_cast<__half *>(static_cast<uint8_t *>(b.v_cache) + values);
    }
}

void load_attention(Loader &ld, Engine &e, Layer &L, int il) {
    const ModelDims &d = e.dims;
    const std::string p = "blk." + std::to_string(il) + ".";
    const int E = d.hp.n_embd, D = d.hp.head_dim;
    L.wq = ld.matrix(p + "attn_q.weight", E, 2 * d.q_dim());
    L.wk = ld.matrix(p + "attn_k.weight", E, d.kv_dim());
    L.wv = ld.matrix(p + "attn_v.weight", E, d.kv_dim());
    L.wo = ld.matrix(p + "attn_output.weight", d.q_dim(), E);
    L.q_norm = ld.vector(p + "attn_q_norm.weight", D);
    L.k_norm = ld.vector(p + "attn_k_norm.weight", D);
    alloc_kv(e, L);
}

void load_deltanet(Loader &ld, Engine &e, Layer &L, int il) {
    const ModelDims &d = e.dims;
    const std::string p = "blk." + std::to_string(il) + ".";
    const int E = d.hp.n_embd, C = d.ssm_conv_dim(), Hv = d.hp.ssm_dt_rank, S = d.hp.ssm_d_state;
    L.wqkv = ld.matrix(p + "attn_qkv.weight", E, C);
    L.wgate = ld.matrix(p + "attn_gate.weight", E, d.ssm_value_dim());
    L.wbeta = ld.matrix(p + "ssm_beta.weight", E, Hv);
    L.walpha = ld.matrix(p + "ssm_alpha.weight", E, Hv);
    L.wssm_out = ld.matrix(p + "ssm_out.weight", d.ssm_value_dim(), E);
    L.conv1d = ld.vector(p + "ssm_conv1d.weight", (int64_t)d.hp.ssm_conv_kernel * C);
    L.dt_bias = ld.vector(p + "ssm_dt.bias", Hv);
    L.ssm_a = ld.vector(p + "ssm_a", Hv);
    L.ssm_norm = ld.vector(p + "ssm_norm.weight", S);
    L.conv_floats = (size_t)C * (d.hp.ssm_conv_kernel - 1);
    L.ssm_floats = (size_t)Hv * S * S;
    L.conv_base = static_cast<float *>(e.alloc(L.conv_floats * 4 * e.n_seq, e.memory.recurrent_state));
    L.ssm_base = static_cast<float *>(e.alloc(L.ssm_floats * 4 * e.n_seq, e.memory.recurrent_state));
    const size_t N = OJ_MAX_POSITIONS;
    L.rings.resize(2 * (size_t)e.n_seq);
    for (RingSlot &r : L.rings) {
        r.qkv = static_cast<float *>(e.alloc(N * C * 4, e.memory.recurrent_state));
        r.conv = static_cast<float *>(e.alloc(N * C * 4, e.memory.recurrent_state));
        r.beta = static_cast<float *>(e.alloc(N * Hv * 4, e.memory.recurrent_state));
        r.alpha = static_cast<float *>(e.alloc(N * Hv * 4, e.memory.recurrent_state));
    }
}

size_t recurrent_floats(const ModelDims &d) {
    return (size_t)d.ssm_conv_dim() * (d.hp.ssm_conv_kernel - 1) + (size_t)d.hp.ssm_dt_rank * d.hp.ssm_d_state * d.hp.ssm_d_state;
}

size_t checkpoint_floats(const Engine &e) {
    size_t n = e.dims.hp.n_embd;
    for (const Layer &L : e.layers)
        if (L.recurrent) n += recurrent_floats(e.dims);
    return n;
}

// Copies every DeltaNet layer's conv + ssm state between the engine and checkpoint c.
void copy_recurrent(Engine &e, Checkpoint &c, bool save) {
    const ModelDims &d = e.dims;
    const size_t conv = (size_t)d.ssm_conv_dim() * (d.hp.ssm_conv_kernel - 1) * 4;
    const size_t ssm = (size_t)d.hp.ssm_dt_rank * d.hp.ssm_d_state * d.hp.ssm_d_state * 4;
    uint8_t *p = reinterpret_cast<uint8_t *>(c.data);
    for (Layer &L : e.layers) {
        if (!L.recurrent) continue;
        uint8_t *cs = reinterpret_cast<uint8_t *>(L.conv_state), *ss = reinterpret_cast<uint8_t *>(L.ssm_state);
        check_cuda(cudaMemcpyAsync(save ? p : cs, save ? cs : p, conv, cudaMemcpyDeviceToDevice, e.stream), "checkpoint");
        check_cuda(cudaMemcpyAsync(save ? p + conv : ss, save ? ss : p + conv, ssm, cudaMemcpyDeviceToDevice, e.stream), "checkpoint");
        p += conv + ssm;
    }
    const size_t E = (size_t)d.hp.n_embd * 4;
    uint8_t *row = reinterpret_cast<uint8_t *>(e.s.hidden + (size_t)e.prev_row * d.hp.n_embd);
    check_cuda(cudaMemcpyAsync(save ? p : row, save ? row : p, E, cudaMemcpyDeviceToDevice, e.stream), "checkpoint");
}

void alloc_scratch(Engine &e) {
    const ModelDims &d = e.dims;
    const int N = OJ_MAX_POSITIONS;
    const int64_t E = d.hp.n_embd, V = d.hp.n_vocab;
    Scratch &s = e.s;
    uint64_t &c = e.memory.activations;
    auto f = [&](int64_t count) { return static_cast<float *>(e.alloc(count * sizeof(float), c)); };
    static_assert(sizeof(PassArgs) % sizeof(int32_t) == 0, "PassArgs in int32 words");
    s.tokens = static_cast<int32_t *>(e.alloc(N * sizeof(int32_t) + sizeof(PassArgs), c));
    s.pass = reinterpret_cast<PassArgs *>(s.tokens + N);
    s.x = f(N * E);
    s.xn = f(N * E);
    s.ffn_gate = f((int64_t)N * d.hp.n_ff);
    s.ffn_up = f((int64_t)N * d.hp.n_ff);
    s.z = f((int64_t)N * d.ssm_value_dim());
    s.dn_out = f((int64_t)N * d.ssm_value_dim());
    s.qg = f((int64_t)N * 2 * d.q_dim());
    s.k = f((int64_t)N * d.kv_dim());
    s.v = f((int64_t)N * d.kv_dim());
    s.q_rot = f((int64_t)N * d.q_dim());
    s.attn_out = f((int64_t)N * d.q_dim());
    s.max_splits = attention_splits_for(e.n_ctx);
    s.part_ml = f((int64_t)N * d.hp.n_head * s.max_splits * 2);
    s.part_acc = f((int64_t)N * d.hp.n_head * s.max_splits * d.hp.head_dim);
    s.cat = f(N * 2 * E);
    s.h_in = f(N * E);
    s.logits = f(N * V);
    s.argmax = static_cast<int32_t *>(e.alloc(N * sizeof(int32_t), c));
    for (SeqState &q : e.seqs) q.hidden = f((N + 1) * E);   // each sequence's hidden window
    if (e.has_mtp) {
        s.draft_logits = f(N * V);
        s.draft_argmax = static_cast<int32_t *>(e.alloc(N * sizeof(int32_t), c));
        s.draft_chain = static_cast<int32_t *>(e.alloc(N * sizeof(int32_t), c));
        s.draft_hidden = f(N * E);
        s.draft_ids = static_cast<int32_t *>(e.alloc(V * sizeof(int32_t), c));
        s.tree_h = f(N * E);
        s.tree_top = static_cast<TreeTop *>(e.alloc(sizeof(TreeTop), c));
    }
    s.sample_top = static_cast<SampleTop *>(e.alloc(N * sizeof(SampleTop), c));
    s.sample_q = static_cast<SampleDist *>(e.alloc((size_t)e.n_seq * N * sizeof(SampleDist), c));
    s.sample_out = static_cast<int32_t *>(e.alloc(2 * sizeof(int32_t), c));
    if (V > ROW_CHUNK * ROW_MAX_BLOCKS)
        fail(OJ_ERR_UNSUPPORTED, "n_vocab " + std::to_string(V) + ": the engine's argmax and sampling kernels take rows of up to " +
                                     std::to_string(ROW_CHUNK * ROW_MAX_BLOCKS) + " values");
    s.rows.argmax_part = static_cast<ArgmaxPart *>(e.alloc(N * ROW_MAX_BLOCKS * sizeof(ArgmaxPart), c));
    s.rows.top_part = static_cast<SampleTop *>(e.alloc(N * ROW_MAX_BLOCKS * sizeof(SampleTop), c));
    s.rows.done = static_cast<uint32_t *>(e.alloc(2 * N * sizeof(uint32_t), c));
    check_cuda(cudaMemset(s.rows.done, 0, 2 * N * sizeof(uint32_t)), "row counters");
    s.fault_probe = static_cast<int32_t *>(e.alloc(64, c));
    // oj_commit_path's moves: 4 ring buffers per DeltaNet layer, K and V (and their q8_0 scales)
    // per KV head of each attention layer, the hidden and argmax rows
    int jobs = 2;
    for (const Layer &L : e.layers) jobs += L.recurrent ? 4 : 4 * d.hp.n_head_kv;
    e.compact_capacity = jobs;
    e.compact_jobs = static_cast<CompactJob *>(e.alloc((size_t)jobs * sizeof(CompactJob), c));
}

// Points the layers' KV caches, recurrent states and ring slots and the hidden window at sequence
// i's (the host bookkeeping is engine_seq_select's).
void bind_sequence(Engine &e, int i) {
    auto bind = [&](Layer &L) {
        if (L.recurrent) {
            L.conv_state = L.conv_base + L.conv_floats * i;
            L.ssm_state = L.ssm_base + L.ssm_floats * i;
            L.ring[0] = L.rings[2 * (size_t)i];
            L.ring[1] = L.rings[2 * (size_t)i + 1];
            return;
        }
        const size_t off = L.kv_seq_bytes * i;
        auto at = [off](void *p) { return p ? static_cast<void *>(static_cast<uint8_t *>(p) + off) : nullptr; };
        L.k_cache = at(L.kv_base.k_cache);
        L.v_cache = at(L.kv_base.v_cache);
        L.k_scale = static_cast<__half *>(at(L.kv_base.k_scale));
        L.v_scale = static_cast<__half *>(at(L.kv_base.v_scale));
    };
    for (Layer &L : e.layers) bind(L);
    if (e.has_mtp) bind(e.mtp.block);
    e.s.hidden = e.hidden;
}

// post_attention_norm(s.x) -> SwiGLU FFN, added into s.x (the FFN residual). On the fp16 path the
// norm and SwiGLU run inside the projections' preps (matvec_group_norm, matvec_swiglu).
// sums: the residual writer before left its row tiles' sums of squares (the norm prep sums those),
// and on return whether the down left them.
void ffn(Engine &e, Layer &L, int n, bool &sums) {
    Scratch &s = e.s;
    const ModelDims &d = e.dims;
    const Matrix *w[] = {&L.ffn_gate, &L.ffn_up};
    float *const y[] = {s.ffn_gate, s.ffn_up};
    stamp(e, PH_FFN_UP, weight_bytes(L.ffn_gate) + weight_bytes(L.ffn_up));
    matvec_group_norm(w, y, 2, s.x, L.post_norm, d.hp.rms_eps, s.xn, n, e.stream, sums);
    stamp(e, PH_FFN_DOWN, weight_bytes(L.ffn_down));
    sums = matvec_swiglu(L.ffn_down, s.ffn_gate, s.ffn_up, s.x, n, true, e.stream);
}

// attn_norm(s.x) -> gated attention added into s.x (`tree`: the positions' shape, oj_verify_tree;
// `seqs`: oj_eval_seqs's positions, pos0 and tree unused).
// sums: as ffn's.
void attention_layer(Engine &e, Layer &L, int n, int pos0, bool &sums, uint64_t tree = 0, const SeqBatch *seqs = nullptr,
                     const PassArgs *dyn = nullptr) {
    Scratch &s = e.s;
    const Matrix *w[] = {&L.wq, &L.wk, &L.wv};
    float *const y[] = {s.qg, s.k, s.v};
    stamp(e, PH_AT_PROJ, weight_bytes(L.wq) + weight_bytes(L.wk) + weight_bytes(L.wv));
    matvec_group_norm(w, y, 3, s.x, L.attn_norm, e.dims.hp.rms_eps, s.xn, n, e.stream, sums);
    // K and V rows read: every cached position and the new ones, fp16 or q8_0 (34 bytes per 32 values)
    uint64_t rows = (uint64_t)(pos0 + n);
    if (seqs) {
        rows = 0;
        for (int t = 0; t < n; ++t) rows += (uint64_t)seqs->pos[t] + 1;
    }
    const uint64_t kv = rows * e.dims.kv_dim() * 2;
    stamp(e, PH_AT_CORE, L.kv_type == OJ_KV_F16 ? kv * 2 : kv * 34 / 32);
    if (seqs) attention_mix_seqs(e.dims, L, s, n, *seqs, e.n_ctx, e.stream);
    else attention_mix(e.dims, L, s, n, pos0, e.n_ctx, e.stream, tree, dyn);
    stamp(e, PH_AT_OUT, weight_bytes(L.wo));
    sums = matvec_residual(L.wo, s.attn_out, s.x, n, e.stream);
}

// attn_norm(s.x) -> Gated DeltaNet added into s.x. The projections land in the layer's ring slot of
// this evaluation (kept for the replay). `seqs`: oj_eval_seqs's positions, each sequence's state
// advanced in the pass (the selected sequence's free ring slot is only scratch then).
// sums: as ffn's.
void deltanet_layer(Engine &e, Layer &L, int n, bool &sums, const SeqBatch *seqs = nullptr, const PassArgs *dyn = nullptr) {
    Scratch &s = e.s;
    const RingSlot &r = L.ring[e.slot];
    const Matrix *w[] = {&L.wqkv, &L.wgate, &L.wbeta, &L.walpha};
    float *const y[] = {r.qkv, s.z, r.beta, r.alpha};
    stamp(e, PH_DN_PROJ, weight_bytes(L.wqkv) + weight_bytes(L.wgate) + weight_bytes(L.wbeta) + weight_bytes(L.walpha));
    matvec_group_norm(w, y, 4, s.x, L.attn_norm, e.dims.hp.rms_eps, s.xn, n, e.stream, sums);
    // the recurrent and conv state, read and written once
    const ModelDims &d = e.dims;
    stamp(e, PH_DN_MIX, 2 * 4 * (recurrent_floats(d)));
    if (seqs) deltanet_mix_seqs(e.dims, L, s, n, r, *seqs, e.stream);
    else deltanet_mix(e.dims, L, s, n, e.slot, e.replay_slot, e.replay_n, e.stream, e.tree, dyn);
    stamp(e, PH_DN_OUT, weight_bytes(L.wssm_out));
    sums = matvec_gated_norm(L.wssm_out, s.dn_out, s.z, L.ssm_norm, d.hp.ssm_dt_rank, d.hp.ssm_d_state, d.hp.rms_eps, s.x, n,
                             true, e.stream);
}

void check_tokens(const Engine &e, const int32_t *tokens, int n) {
    if (!tokens) fail(OJ_ERR_INVALID_ARGUMENT, "tokens is NULL");
    if (n < 1 || n > OJ_MAX_POSITIONS)
        fail(OJ_ERR_INVALID_ARGUMENT, "n_tokens is " + std::to_string(n) + "; one call takes 1.." + std::to_string(OJ_MAX_POSITIONS));
    for (int i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= e.dims.hp.n_vocab)
            fail(OJ_ERR_INVALID_ARGUMENT, "token id " + std::to_string(tokens[i]) + " is outside the vocabulary [0, " +
                                              std::to_string(e.dims.hp.n_vocab) + ")");
}

void finish(Engine &e, const char *what) {
    check_cuda(cudaStreamSynchronize(e.stream), what);
}

}  // namespace

void engine_load(Engine &e, const oj_model_desc &desc) {
    check_hparams(desc.hparams, desc.n_ctx);
    if (desc.kv_type != OJ_KV_F16 && desc.kv_type != OJ_KV_Q8_0)
        fail(OJ_ERR_UNSUPPORTED, "kv_type " + std::to_string(desc.kv_type) + " is not an oj_kv_type (0 = f16, 1 = q8_0)");
    if (desc.n_tensors <= 0 || !desc.tensors) fail(OJ_ERR_INVALID_ARGUMENT, "the model description has no tensors");
    if (desc.n_seq < 0 || desc.n_seq > OJ_MAX_SEQUENCES)
        fail(OJ_ERR_INVALID_ARGUMENT, "n_seq is " + std::to_string(desc.n_seq) + "; an engine holds 1.." +
                                          std::to_string(OJ_MAX_SEQUENCES) + " sequences (0 counts as 1)");
    e.n_seq = desc.n_seq > 0 ? desc.n_seq : 1;
    e.seqs.assign(e.n_seq, SeqState{});
    e.cur_seq = 0;
    e.dims.hp = desc.hparams;
    e.n_ctx = desc.n_ctx;
    e.kv_type = desc.kv_type;
    e.device = desc.device;
    check_cuda(cudaSetDevice(desc.device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&e.stream, cudaStreamNonBlocking), "cudaStreamCreate");

    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd, V = d.hp.n_vocab;
    Loader ld(e, desc);
    e.tok_embd = ld.matrix("token_embd.weight", E, V);
    e.output_norm = ld.vector("output_norm.weight", E);
    e.output = ld.matrix("output.weight", E, V, false);
    e.layers.resize(d.hp.n_layer);
    for (int il = 0; il < d.hp.n_layer; ++il) {
        Layer &L = e.layers[il];
        L.recurrent = d.is_recurrent(il);
        load_common(ld, e, L, il);
        if (L.recurrent) load_deltanet(ld, e, L, il);
        else load_attention(ld, e, L, il);
    }
    e.has_mtp = d.hp.n_layer_nextn == 1 && ld.has("blk." + std::to_string(d.hp.n_layer) + ".nextn.eh_proj.weight");
    if (e.has_mtp) {
        const int il = d.hp.n_layer;
        const std::string p = "blk." + std::to_string(il) + ".";
        Mtp &m = e.mtp;
        load_common(ld, e, m.block, il);
        load_attention(ld, e, m.block, il);
        m.eh_proj = ld.matrix(p + "nextn.eh_proj.weight", 2 * E, E);
        m.enorm = ld.vector(p + "nextn.enorm.weight", E);
        m.hnorm = ld.vector(p + "nextn.hnorm.weight", E);
        m.head_norm = ld.vector(p + "nextn.shared_head_norm.weight", E, false);
        if (!m.head_norm) m.head_norm = e.output_norm;
        m.own_embed = ld.matrix(p + "nextn.embed_tokens.weight", E, V, false);
        m.own_head = ld.matrix(p + "nextn.shared_head_head.weight", E, V, false);
        m.embed = m.own_embed.present() ? &m.own_embed : &e.tok_embd;
        m.head = m.own_head.present() ? &m.own_head : (e.output.present() ? &e.output : &e.tok_embd);
    }
    alloc_scratch(e);
    alloc_prefill(e, desc.prefill_chunk);
    if (desc.n_checkpoints < 0 || desc.n_checkpoints > 64)
        fail(OJ_ERR_INVALID_ARGUMENT, "n_checkpoints is " + std::to_string(desc.n_checkpoints) + "; allowed 0..64");
    e.checkpoints.resize(desc.n_checkpoints);
    for (Checkpoint &c : e.checkpoints)
        c.data = static_cast<float *>(e.alloc(checkpoint_floats(e) * 4, e.memory.checkpoints));
    // cudaMemcpy from pageable memory may return before its DMA lands, and the engine's stream does
    // not wait for the legacy default stream: finish every upload before the first kernel.
    check_cuda(cudaDeviceSynchronize(), "upload weights");
    for (int i = e.n_seq - 1; i >= 0; --i) {   // every sequence empty; sequence 0 selected last
        static_cast<SeqState &>(e) = e.seqs[i];
        e.cur_seq = i;
        bind_sequence(e, i);
        engine_reset(e);
        e.seqs[i] = static_cast<const SeqState &>(e);
    }
}

void engine_reset(Engine &e) {
    const ModelDims &d = e.dims;
    for (Layer &L : e.layers) {
        if (!L.recurrent) continue;
        check_cuda(cudaMemsetAsync(L.conv_state, 0, (size_t)d.ssm_conv_dim() * (d.hp.ssm_conv_kernel - 1) * 4, e.stream), "reset");
        check_cuda(cudaMemsetAsync(L.ssm_state, 0, (size_t)d.hp.ssm_dt_rank * d.hp.ssm_d_state * d.hp.ssm_d_state * 4, e.stream), "reset");
    }
    check_cuda(cudaMemsetAsync(e.s.hidden, 0, (size_t)(OJ_MAX_POSITIONS + 1) * d.hp.n_embd * 4, e.stream), "reset");
    finish(e, "reset");
    e.slot = 0;
    e.replay_slot = 1;
    e.replay_n = 0;
    e.uncommitted = 0;
    e.prev_row = 0;
    e.n_past = 0;
    e.last_start = 0;
    e.last_n = 0;
    e.mtp_n_past = 0;
    e.last_mtp_n = 0;
    e.result_rows = 0;
    e.sampled_n_drafts = -1;
}

void engine_seq_select(Engine &e, int seq) {
    if (seq < 0 || seq >= e.n_seq)
        fail(OJ_ERR_INVALID_ARGUMENT, "sequence " + std::to_string(seq) + " does not exist (the engine holds " +
                                          std::to_string(e.n_seq) + "; n_seq at creation)");
    if (seq == e.cur_seq) return;
    e.seqs[e.cur_seq] = static_cast<const SeqState &>(e);
    static_cast<SeqState &>(e) = e.seqs[seq];
    e.cur_seq = seq;
    // draft results (s.draft_*) are scratch of whichever sequence drafted last: not this one's
    e.last_mtp_n = 0;
    bind_sequence(e, seq);
}

namespace {

// The tree's word (tree.cuh) from a checked parent array; 0 when it is a chain (oj_verify's code).
uint64_t tree_word(const int32_t *parent, int n) {
    uint64_t t = 0;
    bool chain = true;
    for (int i = 0; i < n; ++i) {
        chain = chain && parent[i] == i - 1;
        t |= (uint64_t)(uint8_t)(parent[i] + 1) << (8 * i);
    }
    return chain ? 0 : t;
}

// The last verify's parents (a chain for oj_verify) for oj_commit / oj_commit_path's checks.
void remember_parents(Engine &e, const int32_t *parent, int n) {
    for (int i = 0; i < OJ_MAX_POSITIONS; ++i) e.tree_parent[i] = (int8_t)(i < n ? (parent ? parent[i] : i - 1) : -2);
}

// n_accept positions of the last verify's rows 0..n_accept-1 become committed (the replay at the
// next evaluation advances the DeltaNet state by them).
void commit_rows(Engine &e, int n_accept) {
    // Attention K/V of the rejected positions stay in the cache beyond n_past and are overwritten by
    // the next evaluation; DeltaNet state advances only by replay of the accepted ones.
    e.replay_n = n_accept;
    e.n_past += n_accept;
    e.prev_row = n_accept;   // row 0 (the position before the batch) when nothing was accepted
    e.uncommitted = 0;
}


// The main model over the n positions whose tokens are in s.tokens, onto the stream: embedding,
// every layer, the output norm into `h` ([n][E]), head and argmax into s.logits / s.argmax; profiled
// when oj_profile is on. pos0 and tree place a verify's positions (oj_verify, oj_verify_tree), seqs
// oj_eval_seqs' (pos0 and tree unused then); dyn: a captured pass's (run_pass), pos0, the replay
// count and the tree word read from there.
void main_pass(Engine &e, int n, int pos0, uint64_t tree, const SeqBatch *seqs, float *h, const PassArgs *dyn = nullptr) {
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    Scratch &s = e.s;
    e.prof.active = e.prof.on;
    e.prof.used = 0;   // a pass that failed half-way left its events behind
    if (!dyn) ++e.direct_passes;
    stamp(e, PH_EMBED);
    embed_rows(e.tok_embd, s.tokens, s.x, n, e.stream);
    bool sums = false;   // the embedding leaves no row-tile sums
    for (int il = 0; il < d.hp.n_layer; ++il) {
        Layer &L = e.layers[il];
        if (L.recurrent) deltanet_layer(e, L, n, sums, seqs, dyn);
        else attention_layer(e, L, n, pos0, sums, tree, seqs, dyn);
        ffn(e, L, n, sums);
    }
    stamp(e, PH_NORM);
    rms_norm(s.x, e.output_norm, h, n, E, d.hp.rms_eps, E, e.stream);
    const Matrix &head = e.output.present() ? e.output : e.tok_embd;
    stamp(e, PH_HEAD, weight_bytes(head));
    matvec(head, h, s.logits, n, false, e.stream);
    stamp(e, PH_ARGMAX);
    argmax_rows(s.logits, s.argmax, n, d.hp.n_vocab, s.rows, e.stream);
    stamp(e, -1);
    e.prof.active = false;
}

// oj_profile's host time: from the pass's start (t0) to its last launch enqueued.
void host_time(Engine &e, std::chrono::steady_clock::time_point t0) {
    if (!e.prof.host) return;
    e.prof.host_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++e.prof.host_passes;
}

// Why verify passes are replayed from CUDA graphs (issue 25): a pass is ~700 dependent launches, and
// from a stream each costs the GPU 1-3 us beside its work even under PDL, where a graph's costs
// 0.4-0.9 us (bench/results/2026-12-05-launch-chain-*.txt: empty kernels 2.0 -> 0.5-0.8 us on an
// H100, 4.5 -> 0.4-0.9 us on an H200). The graph holds its shape's launches (positions, ring slots,
// sequence, attention splits, chain or tree kernels, the matvec workspaces' addresses) and reads the
// rest (first position, replay count, tree word) from s.pass.
// A capture that fails (GRAPH_TRIES in a row) leaves the engine on direct launches for good.
constexpr int GRAPH_TRIES = 3;

// The graph of a pass over n positions at e.n_past (tree: their shape), captured now (nullptr where the capture
// failed: nothing ran; the caller launches directly). Replaces `reuse` (the same shape with other
// splits or workspaces) in place where cudaGraphExecUpdate takes it, else the least recently used
// graph once MAX_GRAPHS are held.
Engine::PassGraph *capture_pass(Engine &e, int n, uint64_t tree, float *h, int splits, uint64_t workspaces,
                                Engine::PassGraph *reuse) {
    const auto t0 = std::chrono::steady_clock::now();
    cudaGraph_t g = nullptr;
    if (cudaStreamBeginCapture(e.stream, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
        cudaGetLastError();
        ++e.graph_failures;
        return nullptr;
    }
    bool launched = true;
    e.s.pass_splits = splits;
    try {
        main_pass(e, n, e.n_past, tree, nullptr, h, e.s.pass);
    } catch (const Error &) {   // a launch refused under capture; the direct launches report it if it is real
        launched = false;
    }
    e.s.pass_splits = 0;
    const cudaError_t ended = cudaStreamEndCapture(e.stream, &g);
    cudaGetLastError();
    if (!launched || ended != cudaSuccess || !g) {
        if (g) cudaGraphDestroy(g);
        ++e.graph_failures;
        return nullptr;
    }
    Engine::PassGraph *slot = nullptr;
    if (reuse) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(reuse->exec, g, &info) == cudaSuccess) slot = reuse;
        else {
            cudaGetLastError();
            cudaGraphExecDestroy(reuse->exec);
            reuse->exec = nullptr;
        }
    }
    if (!slot) {
        cudaGraphExec_t exec = nullptr;
        if (cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) {
            cudaGetLastError();
            cudaGraphDestroy(g);
            if (reuse) e.graphs.erase(e.graphs.begin() + (reuse - e.graphs.data()));
            ++e.graph_failures;
            return nullptr;
        }
        if (reuse) slot = reuse;
        else if ((int)e.graphs.size() < Engine::MAX_GRAPHS) {
            e.graphs.push_back({});
            slot = &e.graphs.back();
        } else {
            slot = &*std::min_element(e.graphs.begin(), e.graphs.end(),
                                      [](const Engine::PassGraph &a, const Engine::PassGraph &b) { return a.used < b.used; });
            cudaGraphExecDestroy(slot->exec);
        }
        slot->exec = exec;
    }
    cudaGraphDestroy(g);
    *slot = {n, e.slot, e.replay_slot, e.cur_seq, splits, tree != 0, workspaces, slot->exec, 0};
    e.graph_failures = 0;
    ++e.graph_captures;
    e.graph_capture_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return slot;
}

// The attention split count of a captured pass over n positions at e.n_past (its graph's key).
int pass_split_bucket(const Engine &e, int n) {
    return attention_split_bucket(attention_splits_for(e.n_past + n), e.s.max_splits);
}

// Whether a chain pass of n positions has a graph for the engine's ring slots and sequence (any
// split count or workspaces: one that is stale is updated in place at its use).
bool has_chain_graph(const Engine &e, int n) {
    for (const Engine::PassGraph &g : e.graphs)
        if (g.n == n && g.slot == e.slot && g.replay_slot == e.replay_slot && g.seq == e.cur_seq && !g.tree) return true;
    return false;
}

// Captures, at the first chain pass of n positions for these ring slots and this sequence, the
// other chain sizes that fit the context too: a speculative cycle verifies D + 1 positions, and
// fewer near a request's end, so each size's first use would pay its capture (a few ms of host
// time) in the middle of decoding; a 128-token benchmark row at D = 7 lost 4-5% to them (H100,
// bench/results/2026-12-07-session23-h100.md). Only while the graphs held leave room for all of
// them (none is replaced for it), and not past a failed capture.
// Sizes 1..8: the chain sizes of drafts up to 7, the speculative runs' (larger ones capture at their
// first use; all 16 would take half the graphs a context's split buckets share).
constexpr int EAGER_CHAIN_SIZES = 8;
void capture_chain_sizes(Engine &e, int n, float *h, uint64_t workspaces) {
    std::vector<int> sizes;
    for (int m = 1; m <= EAGER_CHAIN_SIZES; ++m)
        if (m != n && e.n_past + m <= e.n_ctx && !has_chain_graph(e, m)) sizes.push_back(m);
    if (sizes.empty() || (int)(e.graphs.size() + sizes.size()) >= Engine::MAX_GRAPHS) return;
    for (int m : sizes)
        if (!capture_pass(e, m, 0, h, pass_split_bucket(e, m), workspaces, nullptr)) return;
}

// A pass of oj_verify, oj_eval, oj_cycle or oj_verify_tree over n positions at e.n_past (`tree`:
// their shape, tree.cuh's word), the tokens and the call's PassArgs already sent to s.tokens /
// s.pass: replayed from its shape's graph (captured on first use, with a chain's other sizes:
// capture_chain_sizes), or launched directly where the pass is profiled (events at the phase
// boundaries) or graphs failed.
void run_pass(Engine &e, int n, uint64_t tree, float *h) {
    if (e.prof.on || e.graph_failures >= GRAPH_TRIES) {
        main_pass(e, n, e.n_past, tree, nullptr, h);
        return;
    }
    const int splits = pass_split_bucket(e, n);
    const uint64_t workspaces = matvec_workspace_generation();
    Engine::PassGraph *hit = nullptr, *reuse = nullptr;
    for (Engine::PassGraph &g : e.graphs)
        if (g.n == n && g.slot == e.slot && g.replay_slot == e.replay_slot && g.seq == e.cur_seq && g.tree == (tree != 0)) {
            if (g.splits == splits && g.workspaces == workspaces) hit = &g;
            else reuse = &g;
        }
    if (!hit && !reuse && !tree) capture_chain_sizes(e, n, h, workspaces);   // before: it may move e.graphs
    if (!hit) hit = capture_pass(e, n, tree, h, splits, workspaces, reuse);
    if (!hit) {
        try {
            main_pass(e, n, e.n_past, tree, nullptr, h);
        } catch (const Error &) {   // the capture failed for the launches' own error, not the graph's
            --e.graph_failures;
            throw;
        }
        return;
    }
    hit->used = ++e.graph_clock;
    check_cuda(cudaGraphLaunch(hit->exec, e.stream), "eval: the pass's graph");
    ++e.graph_replays;
}

// parent: a checked parent array (oj_verify_tree) or nullptr (a chain).
void verify(Engine &e, const int32_t *tokens, int n, const int32_t *parent = nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    check_tokens(e, tokens, n);
    const uint64_t tree = parent ? tree_word(parent, n) : 0;
    if (e.n_past + n > e.n_ctx)
        fail(OJ_ERR_CONTEXT_FULL, std::to_string(e.n_past) + " + " + std::to_string(n) + " tokens exceed n_ctx " + std::to_string(e.n_ctx));
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    Scratch &s = e.s;
    // the tokens and the pass's PassArgs in one copy (s.pass follows s.tokens)
    int32_t sent[OJ_MAX_POSITIONS + sizeof(PassArgs) / sizeof(int32_t)] = {};
    std::memcpy(sent, tokens, n * sizeof(int32_t));
    const PassArgs args{e.n_past, e.replay_n, tree};
    std::memcpy(sent + OJ_MAX_POSITIONS, &args, sizeof(args));
    check_cuda(cudaMemcpyAsync(s.tokens, sent, sizeof(sent), cudaMemcpyHostToDevice, e.stream), "copy tokens");
    // A verify that was never committed is dropped (as oj_commit(0) would).
    e.uncommitted = 0;
    e.tree = tree;
    // Row 0 of the hidden window: the position just before this batch (zeros at position 0), so
    // that the MTP block can pair every token of the batch with its predecessor's hidden state.
    if (e.n_past == 0)
        check_cuda(cudaMemsetAsync(s.hidden, 0, E * 4, e.stream), "hidden window");
    else if (e.prev_row != 0)
        check_cuda(cudaMemcpyAsync(s.hidden, s.hidden + (size_t)e.prev_row * E, E * 4, cudaMemcpyDeviceToDevice, e.stream), "hidden window");
    e.prev_row = 0;
    run_pass(e, n, tree, s.hidden + E);
    host_time(e, t0);
    finish(e, "eval");
    collect(e);
    // the replay is in the state now; this evaluation's positions wait in e.slot for oj_commit
    e.replay_n = 0;
    e.replay_slot = e.slot;
    e.slot ^= 1;
    e.last_start = e.n_past;
    e.last_n = n;
    e.result_rows = n;
    e.uncommitted = n;
    remember_parents(e, parent, n);
}

}  // namespace

void engine_verify(Engine &e, const int32_t *tokens, int n) { verify(e, tokens, n); }


void engine_verify_tree(Engine &e, const int32_t *tokens, const int32_t *parent, int n) {
    check_tokens(e, tokens, n);
    if (n > OJ_MAX_TREE_NODES)   // the kernels' tree word holds 8 nodes' parents (tree.cuh)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_verify_tree: n_tokens is " + std::to_string(n) + "; a draft tree has 1.." +
                                          std::to_string(OJ_MAX_TREE_NODES) + " nodes");
    if (!parent) fail(OJ_ERR_INVALID_ARGUMENT, "oj_verify_tree: parent is NULL");
    if (parent[0] != -1)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_verify_tree: bad parent array: node 0 is the root (the current token), its parent must be -1, got " +
                                          std::to_string(parent[0]));
    for (int i = 1; i < n; ++i)
        if (parent[i] < 0 || parent[i] >= i)
            fail(OJ_ERR_INVALID_ARGUMENT, "oj_verify_tree: bad parent array: node " + std::to_string(i) + " has parent " +
                                              std::to_string(parent[i]) + "; a draft's parent must be an earlier node (0.." +
                                              std::to_string(i - 1) + ")");
    verify(e, tokens, n, parent);
}

void engine_commit_path(Engine &e, const int32_t *path, int n_path) {
    if (e.uncommitted == 0)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit_path: no tree to commit (no uncommitted oj_verify_tree or oj_verify; each is committed once)");
    if (!path) fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit_path: path is NULL");
    const int n = e.uncommitted;
    if (n_path < 1 || n_path > n)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit_path: n_path is " + std::to_string(n_path) + "; the last tree has " +
                                          std::to_string(n) + " nodes (a path keeps 1.." + std::to_string(n) + ")");
    if (path[0] != 0)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit_path: not a path of the last tree: it starts at node " + std::to_string(path[0]) +
                                          ", not at the root (node 0)");
    bool prefix = true;   // path = 0, 1, .., n_path - 1: the rows are in place already
    uint64_t packed = 0;
    for (int i = 1; i < n_path; ++i) {
        const int b = path[i];
        if (b <= 0 || b >= n || e.tree_parent[b] != path[i - 1])
            fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit_path: not a path of the last tree: node " + std::to_string(b) +
                                              " (entry " + std::to_string(i) + ") is not a child of node " +
                                              std::to_string(path[i - 1]));
        prefix = prefix && b == i;
        if (i < OJ_MAX_TREE_NODES) packed |= (uint64_t)b << (8 * i);   // past 8: a chain's, always a prefix
    }
    if (!prefix) {
        // Move the path's rows to rows 0..n_path-1: this slot's DeltaNet intermediates (what the
        // replay reads), K/V at n_past.. (node i wrote row n_past + i, RoPE'd at its depth, which is
        // its path index), and the results (hidden window, argmax, logits) so that they read as after
        // oj_verify of the path. Then the commit is oj_commit's.
        const ModelDims &d = e.dims;
        std::vector<CompactJob> jobs;
        const int C = d.ssm_conv_dim(), Hv = d.hp.ssm_dt_rank, D = d.hp.head_dim, E = d.hp.n_embd;
        auto add = [&](void *base, int64_t words) {
            jobs.push_back(CompactJob{static_cast<uint32_t *>(base), words, (int32_t)words});
        };
        for (Layer &L : e.layers) {
            if (L.recurrent) {
                const RingSlot &r = L.ring[e.replay_slot];   // the verify's slot (verify flipped them)
                add(r.qkv, C);
                add(r.conv, C);
                add(r.beta, Hv);
                add(r.alpha, Hv);
                continue;
            }
            const size_t elem = L.kv_type == OJ_KV_F16 ? 2 : 1;
            for (int g = 0; g < d.hp.n_head_kv; ++g) {
                const int64_t row0 = (int64_t)g * e.n_ctx + e.n_past;
                add(static_cast<uint8_t *>(L.k_cache) + row0 * D * elem, D * (int64_t)elem / 4);
                add(static_cast<uint8_t *>(L.v_cache) + row0 * D * elem, D * (int64_t)elem / 4);
                if (L.kv_type == OJ_KV_Q8_0) {
                    add(L.k_scale + row0 * (D / 32), D / 32 / 2);
                    add(L.v_scale + row0 * (D / 32), D / 32 / 2);
                }
            }
        }
        add(e.s.hidden + E, E);
        add(e.s.argmax, 1);
        if ((int)jobs.size() > e.compact_capacity) fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit_path: more row moves than the table holds");
        int max_words = 0;
        for (const CompactJob &j : jobs) max_words = std::max(max_words, j.row_words);
        check_cuda(cudaMemcpyAsync(e.compact_jobs, jobs.data(), jobs.size() * sizeof(CompactJob), cudaMemcpyHostToDevice, e.stream),
                   "oj_commit_path jobs");
        compact_rows(e.compact_jobs, (int)jobs.size(), max_words, packed, n_path, e.stream);
        const size_t V = d.hp.n_vocab;
        for (int i = 1; i < n_path; ++i)   // a logits row is ~1 MB on the 27B: one copy per moved row
            if (path[i] != i)
                check_cuda(cudaMemcpyAsync(e.s.logits + (size_t)i * V, e.s.logits + (size_t)path[i] * V, V * 4,
                                           cudaMemcpyDeviceToDevice, e.stream),
                           "oj_commit_path logits");
        finish(e, "oj_commit_path");
    }
    commit_rows(e, n_path);
    e.tree = 0;
    remember_parents(e, nullptr, 0);
    e.last_n = n_path;
    e.result_rows = n_path;
}

namespace {

// The arguments oj_cycle and oj_cycle_sampled share, refused by name (`call` names the entry point).
void check_cycle(const Engine &e, const int32_t *tokens, int n, int n_draft, const int32_t *out_tokens,
                 const int32_t *out_drafts, const std::string &call) {
    check_tokens(e, tokens, n);
    if (n_draft < 0 || n_draft > OJ_MAX_POSITIONS - 1)
        fail(OJ_ERR_INVALID_ARGUMENT, "n_draft is " + std::to_string(n_draft) + "; " + call + " drafts 0.." + std::to_string(OJ_MAX_POSITIONS - 1));
    if (!out_tokens) fail(OJ_ERR_INVALID_ARGUMENT, "out_tokens is NULL");
    if (n_draft > 0 && !out_drafts) fail(OJ_ERR_INVALID_ARGUMENT, "out_drafts is NULL with n_draft " + std::to_string(n_draft));
    if (n_draft > 0 && !e.has_mtp) fail(OJ_ERR_INVALID_ARGUMENT, "n_draft " + std::to_string(n_draft) + ": the model has no MTP block");
    if (n_draft > 0 && e.mtp_n_past <= e.n_past)
        fail(OJ_ERR_INVALID_ARGUMENT, call + " drafts from the MTP row of the current token (position " + std::to_string(e.n_past) +
                                          "), but the MTP rows end at " + std::to_string(e.mtp_n_past));
    // the verify's positions, then MTP rows up to n_past + n + n_draft - 1
    if (e.n_past + n + n_draft > e.n_ctx)
        fail(OJ_ERR_CONTEXT_FULL, call + " at n_past " + std::to_string(e.n_past) + " with " + std::to_string(n) + " tokens and " +
                                      std::to_string(n_draft) + " drafts needs positions past n_ctx " + std::to_string(e.n_ctx));
}

}  // namespace

void mtp_launch(Engine &e, const int32_t *tokens, int n, int pos0, const float *h, bool device_tokens = false);
void mtp_enqueue(Engine &e, const int32_t *tokens, int n, int pos0, int h_source, const float *h_host);

int engine_cycle(Engine &e, const int32_t *tokens, int n, int n_draft, int32_t *out_tokens, int32_t *out_drafts) {
    check_cycle(e, tokens, n, n_draft, out_tokens, out_drafts, "oj_cycle");
    const int P = e.n_past;
    int32_t argmax[OJ_MAX_POSITIONS], drafts[OJ_MAX_POSITIONS];
    verify(e, tokens, n);
    check_cuda(cudaMemcpyAsync(argmax, e.s.argmax, n * sizeof(int32_t), cudaMemcpyDeviceToHost, e.stream), "oj_cycle argmax");
    finish(e, "oj_cycle argmax");
    int k = 0;
    while (k + 1 < n && tokens[k + 1] == argmax[k]) ++k;
    engine_commit(e, k + 1);
    if (n_draft > 0) {
        // The MTP rows of the accepted positions and the next token (draft 0 from the last), then
        // each further draft from the one before on the device: an argmax row is always an id in
        // range (argmax_rows; the restricted head's mapped through its ids), so the next step's
        // embedding reads it where it is, and the drafts come back in one copy, one wait a cycle
        // instead of two a draft. The same launches and operands as oj_mtp_eval step by step.
        Scratch &s = e.s;
        const int E = e.dims.hp.n_embd;
        mtp_enqueue(e, argmax, k + 1, P + 1, OJ_H_MAIN, nullptr);
        check_cuda(cudaMemcpyAsync(s.draft_chain, s.draft_argmax + k, sizeof(int32_t), cudaMemcpyDeviceToDevice, e.stream),
                   "oj_cycle draft");
        for (int j = 1; j < n_draft; ++j) {   // OJ_H_DRAFT: the last step's hidden row
            const int row = j == 1 ? k : 0;
            check_cuda(cudaMemcpyAsync(s.h_in, s.draft_hidden + (size_t)row * E, E * 4, cudaMemcpyDeviceToDevice, e.stream), "draft h");
            mtp_launch(e, s.draft_chain + j - 1, 1, P + k + 1 + j, s.h_in, true);
            check_cuda(cudaMemcpyAsync(s.draft_chain + j, s.draft_argmax, sizeof(int32_t), cudaMemcpyDeviceToDevice, e.stream),
                       "oj_cycle draft");
        }
        check_cuda(cudaMemcpyAsync(drafts, s.draft_chain, n_draft * sizeof(int32_t), cudaMemcpyDeviceToHost, e.stream), "oj_cycle drafts");
        finish(e, "oj_cycle drafts");
        e.mtp_n_past = e.n_past + 1;   // the next token's row; the draft rows past it are provisional
        e.last_mtp_n = 0;
        for (int j = 0; j < n_draft; ++j) out_drafts[j] = drafts[j];
    }
    for (int i = 0; i < k; ++i) out_tokens[i] = tokens[i + 1];
    out_tokens[k] = argmax[k];
    return k;
}

int engine_cycle_sampled(Engine &e, const int32_t *tokens, int n, int n_draft, const oj_sampling &p, int32_t *out_tokens,
                         int32_t *out_drafts) {
    check_cycle(e, tokens, n, n_draft, out_tokens, out_drafts, "oj_cycle_sampled");
    if (!(p.temperature > 0.0f) || !std::isfinite(p.temperature))
        fail(OJ_ERR_INVALID_ARGUMENT, "sampling temperature is " + std::to_string(p.temperature) +
                                          "; oj_cycle_sampled takes a finite temperature > 0 (greedy requests: oj_cycle)");
    if (p.top_k < 1 || p.top_k > OJ_SAMPLE_TOP_MAX)
        fail(OJ_ERR_INVALID_ARGUMENT, "sampling top_k is " + std::to_string(p.top_k) + "; oj_cycle_sampled takes 1.." +
                                          std::to_string(OJ_SAMPLE_TOP_MAX));
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
        fail(OJ_ERR_INVALID_ARGUMENT, "sampling top_p is " + std::to_string(p.top_p) + "; it must be in (0, 1]");
    if (!(p.min_p >= 0.0f && p.min_p < 1.0f))
        fail(OJ_ERR_INVALID_ARGUMENT, "sampling min_p is " + std::to_string(p.min_p) + "; it must be in [0, 1)");
    if (n > 1) {
        // the drafts must be the ones whose distributions the last call kept, for this token here
        bool ours = e.sampled_n_drafts >= n - 1 && e.sampled_n_past == e.n_past && e.sampled_token == tokens[0];
        for (int i = 1; ours && i < n; ++i) ours = tokens[i] == e.sampled_drafts[i - 1];
        if (!ours)
            fail(OJ_ERR_INVALID_ARGUMENT, "oj_cycle_sampled: tokens[1.." + std::to_string(n) + ") are not drafts the last "
                                          "oj_cycle_sampled of this sequence drew for token " + std::to_string(tokens[0]) +
                                          " at position " + std::to_string(e.n_past) + " (their distributions are needed to accept them)");
    }
    e.sampled_n_drafts = -1;   // used once, whatever happens next
    const int P = e.n_past;
    Scratch &s = e.s;
    SampleDist *q = s.sample_q + (size_t)e.cur_seq * OJ_MAX_POSITIONS;
    int32_t got[2];
    verify(e, tokens, n);
    sample_top(s.logits, e.dims.hp.n_vocab, e.dims.hp.n_vocab, nullptr, p.top_k, n, s.sample_top, s.rows, e.stream);
    sample_verify(s.sample_top, s.tokens, q, n, p, s.sample_out, e.stream);
    check_cuda(cudaMemcpyAsync(got, s.sample_out, sizeof got, cudaMemcpyDeviceToHost, e.stream), "oj_cycle_sampled verdict");
    finish(e, "oj_cycle_sampled verdict");
    const int k = got[0];
    if (got[1] < 0) fail(OJ_ERR_INVALID_ARGUMENT, "oj_cycle_sampled: the main model's row " + std::to_string(k) + " has no finite logit");
    int32_t emitted[OJ_MAX_POSITIONS];
    for (int i = 0; i < k; ++i) emitted[i] = tokens[i + 1];
    emitted[k] = got[1];
    engine_commit(e, k + 1);
    if (n_draft > 0) {
        const int width = e.n_draft_ids > 0 ? e.n_draft_ids : e.dims.hp.n_vocab;
        const int32_t *ids = e.n_draft_ids > 0 ? s.draft_ids : nullptr;
        int32_t drafts[OJ_MAX_POSITIONS];
        engine_mtp_eval(e, emitted, k + 1, P + 1, OJ_H_MAIN, nullptr);
        for (int j = 0; j < n_draft; ++j) {
            if (j > 0) engine_mtp_eval(e, drafts + j - 1, 1, P + k + 1 + j, OJ_H_DRAFT, nullptr);
            // the next token's row is row k of the first call's, then row 0 of each chained one
            sample_top(s.draft_logits + (size_t)(j == 0 ? k : 0) * width, width, width, ids, p.top_k, 1, s.sample_top, s.rows,
                       e.stream);
            sample_draft(s.sample_top, p, 32 + j, q + j, s.sample_out, e.stream);
            check_cuda(cudaMemcpyAsync(drafts + j, s.sample_out, sizeof(int32_t), cudaMemcpyDeviceToHost, e.stream), "oj_cycle_sampled draft");
            finish(e, "oj_cycle_sampled draft");
            if (drafts[j] < 0)
                fail(OJ_ERR_INVALID_ARGUMENT, "oj_cycle_sampled: the draft head's row has no finite logit");
        }
        e.mtp_n_past = e.n_past + 1;   // the next token's row; the draft rows past it are provisional
        e.last_mtp_n = 0;
        for (int j = 0; j < n_draft; ++j) out_drafts[j] = e.sampled_drafts[j] = drafts[j];
        e.sampled_n_drafts = n_draft;
        e.sampled_n_past = e.n_past;
        e.sampled_token = emitted[k];
    }
    for (int i = 0; i <= k; ++i) out_tokens[i] = emitted[i];
    return k;
}

void engine_commit(Engine &e, int n_accept) {
    if (e.uncommitted == 0)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit without an uncommitted oj_verify (each verify is committed once)");
    if (n_accept < 0 || n_accept > e.uncommitted)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit(" + std::to_string(n_accept) + "): the last oj_verify evaluated " +
                                          std::to_string(e.uncommitted) + " positions");
    for (int i = 1; i < n_accept; ++i)
        if (e.tree_parent[i] != i - 1)
            fail(OJ_ERR_INVALID_ARGUMENT, "oj_commit(" + std::to_string(n_accept) + "): nodes 0.." + std::to_string(n_accept - 1) +
                                              " of the last oj_verify_tree are not a chain (node " + std::to_string(i) +
                                              " is a child of node " + std::to_string(e.tree_parent[i]) + "); use oj_commit_path");
    commit_rows(e, n_accept);
}

void engine_eval(Engine &e, const int32_t *tokens, int n) {
    engine_verify(e, tokens, n);
    engine_commit(e, n);
}

void engine_eval_seqs(Engine &e, const int32_t *seqs, const int32_t *tokens, int n) {
    check_tokens(e, tokens, n);
    if (!seqs) fail(OJ_ERR_INVALID_ARGUMENT, "oj_eval_seqs: seqs is NULL");
    for (int t = 0; t < n; ++t) {
        if (seqs[t] < 0 || seqs[t] >= e.n_seq)
            fail(OJ_ERR_INVALID_ARGUMENT, "oj_eval_seqs: sequence " + std::to_string(seqs[t]) + " (entry " + std::to_string(t) +
                                              ") does not exist (the engine holds " + std::to_string(e.n_seq) + ")");
        for (int u = 0; u < t; ++u)
            if (seqs[u] == seqs[t])
                fail(OJ_ERR_INVALID_ARGUMENT, "oj_eval_seqs: sequence " + std::to_string(seqs[t]) + " appears twice (entries " +
                                                  std::to_string(u) + " and " + std::to_string(t) + "); one token each");
        check_not_copying(e, seqs[t], "oj_eval_seqs");
        check_no_piece(e, seqs[t], "oj_eval_seqs");
        const int n_past = seqs[t] == e.cur_seq ? e.n_past : e.seqs[seqs[t]].n_past;
        if (n_past + 1 > e.n_ctx)
            fail(OJ_ERR_CONTEXT_FULL, "oj_eval_seqs: sequence " + std::to_string(seqs[t]) + " holds " + std::to_string(n_past) +
                                          " positions, n_ctx " + std::to_string(e.n_ctx) + ": no room for one more");
    }
    const int home = e.cur_seq;
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    Scratch &s = e.s;
    // Every sequence as before its own oj_eval: a pending verify dropped, accepted positions
    // replayed into its state (the pass then advances the state itself).
    SeqBatch b{};
    for (int t = 0; t < n; ++t) {
        engine_seq_select(e, seqs[t]);
        e.uncommitted = 0;
        e.tree = 0;
        engine_flush(e);
        b.seq[t] = seqs[t];
        b.pos[t] = e.n_past;
    }
    // the DeltaNet projections go to the last one's free ring slot (nothing pending there now);
    // the pass is profiled as a verify's is (oj_profile)
    const auto t0 = std::chrono::steady_clock::now();
    check_cuda(cudaMemcpyAsync(s.tokens, tokens, n * sizeof(int32_t), cudaMemcpyHostToDevice, e.stream), "copy tokens");
    float *h = s.h_in;   // the pass's hidden rows (the MTP block's input buffer, free here)
    main_pass(e, n, 0, 0, &b, h);
    host_time(e, t0);
    // each sequence's hidden window as after its own one-token oj_eval: row 0 = h of the position
    // before (zeros at position 0), row 1 = the new one's
    for (int t = 0; t < n; ++t) {
        engine_seq_select(e, seqs[t]);
        if (e.n_past == 0)
            check_cuda(cudaMemsetAsync(s.hidden, 0, E * 4, e.stream), "hidden window");
        else if (e.prev_row != 0)
            check_cuda(cudaMemcpyAsync(s.hidden, s.hidden + (size_t)e.prev_row * E, E * 4, cudaMemcpyDeviceToDevice, e.stream),
                       "hidden window");
        check_cuda(cudaMemcpyAsync(s.hidden + E, h + (size_t)t * E, E * 4, cudaMemcpyDeviceToDevice, e.stream), "hidden window");
        e.last_start = e.n_past;
        e.last_n = 1;
        e.n_past += 1;
        e.prev_row = 1;
        e.replay_n = 0;
        e.uncommitted = 0;
        remember_parents(e, nullptr, 0);
    }
    finish(e, "oj_eval_seqs");
    collect(e);
    e.result_rows = n;
    engine_seq_select(e, home);
}

void engine_flush(Engine &e) {
    if (e.replay_n == 0) return;
    for (Layer &L : e.layers)
        if (L.recurrent) deltanet_replay(e.dims, L, e.replay_slot, e.replay_n, e.stream);
    finish(e, "replay");
    e.replay_n = 0;
}

Checkpoint &checkpoint_at(Engine &e, int slot) {
    if (slot < 0 || slot >= (int)e.checkpoints.size())
        fail(OJ_ERR_INVALID_ARGUMENT, "checkpoint slot " + std::to_string(slot) + " does not exist (the engine has " +
                                          std::to_string(e.checkpoints.size()) + "; n_checkpoints at creation)");
    return e.checkpoints[slot];
}

void engine_checkpoint_save(Engine &e, int slot) {
    Checkpoint &c = checkpoint_at(e, slot);
    engine_flush(e);
    e.uncommitted = 0;
    copy_recurrent(e, c, true);
    finish(e, "checkpoint save");
    c.n_past = e.n_past;
}

int engine_checkpoint_restore(Engine &e, int slot) {
    Checkpoint &c = checkpoint_at(e, slot);
    if (c.n_past < 0) fail(OJ_ERR_INVALID_ARGUMENT, "checkpoint slot " + std::to_string(slot) + " was never saved");
    e.replay_n = 0;
    e.uncommitted = 0;
    e.prev_row = 0;            // the saved hidden goes to row 0: the position before the next batch
    copy_recurrent(e, c, false);
    finish(e, "checkpoint restore");
    e.n_past = c.n_past;
    e.last_start = e.n_past;   // only h_{n_past-1} (row 0) is in the window now
    e.last_n = 0;
    e.result_rows = 0;
    if (e.mtp_n_past > e.n_past) e.mtp_n_past = e.n_past;
    e.last_mtp_n = 0;
    return e.n_past;
}

namespace {

// oj_seq_state_save's layout: this header, then every DeltaNet layer's conv then ssm state (fp32),
// h of n_past - 1 (fp32), then per attention layer in order and the MTP block last: K then V rows
// [0, rows) of each KV head, the quant / value plane then (q8_0) the scale plane.
struct SeqStateHeader {
    uint32_t magic;           // SEQ_STATE_MAGIC
    uint32_t version;         // SEQ_STATE_VERSION
    uint64_t fingerprint;     // model_fingerprint of the engine that saved it
    int32_t n_past;
    int32_t mtp_rows;         // MTP block rows copied: min(mtp_n_past, n_past)
};
constexpr uint32_t SEQ_STATE_MAGIC = 0x4f4a5351;   // "QSJO"
constexpr uint32_t SEQ_STATE_VERSION = 1;

// FNV-1a over the hyperparameters and the KV type: what the copy's layout and meaning depend on
// (n_ctx does not: a copy of n_past positions loads into any context that holds them).
uint64_t model_fingerprint(const Engine &e) {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](const void *p, size_t n) {
        const uint8_t *b = static_cast<const uint8_t *>(p);
        for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
    };
    const oj_hparams &hp = e.dims.hp;
    const int32_t ints[] = {hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot,
                            hp.ssm_conv_kernel, hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank, hp.full_attention_interval,
                            hp.n_layer_nextn, e.kv_type, e.has_mtp ? 1 : 0};
    mix(ints, sizeof(ints));
    mix(hp.rope_sections, sizeof(hp.rope_sections));
    mix(&hp.rope_freq_base, sizeof(hp.rope_freq_base));
    mix(&hp.rms_eps, sizeof(hp.rms_eps));
    return h;
}

// One position's bytes of one plane set (K or V) of an attention layer: the values (fp16) or the
// quants then the scales (q8_0), over every KV head.
size_t kv_position_bytes(const Engine &e) {
    const size_t values = (size_t)e.dims.kv_dim();
    return e.kv_type == OJ_KV_F16 ? values * 2 : values + values / QK8_0 * sizeof(__half);
}

uint64_t seq_state_bytes(const Engine &e, int n_past, int mtp_rows) {
    const ModelDims &d = e.dims;
    uint64_t n = sizeof(SeqStateHeader) + (uint64_t)d.hp.n_embd * 4;
    int attention = 0;
    for (const Layer &L : e.layers) {
        if (L.recurrent) n += (uint64_t)recurrent_floats(d) * 4;
        else ++attention;
    }
    n += (uint64_t)attention * 2 * n_past * kv_position_bytes(e);
    if (e.has_mtp) n += (uint64_t)2 * mtp_rows * kv_position_bytes(e);
    return n;
}

// K and V rows [0, rows) of layer L (the selected sequence's planes): one segment per plane and
// KV head ([Hkv][n_ctx][row bytes] on the device, the rows of a head contiguous).
void kv_segments(Engine &e, Layer &L, int rows, std::vector<StateCopy::Segment> &out) {
    if (rows == 0) return;
    const ModelDims &d = e.dims;
    const int Hkv = d.hp.n_head_kv, D = d.hp.head_dim;
    const size_t elem = e.kv_type == OJ_KV_F16 ? 2 : 1;
    auto plane = [&](void *dev, size_t row_bytes) {
        for (int h = 0; h < Hkv; ++h)
            out.push_back({static_cast<uint8_t *>(dev) + (size_t)h * e.n_ctx * row_bytes, (size_t)rows * row_bytes});
    };
    plane(L.k_cache, D * elem);
    if (e.kv_type == OJ_KV_Q8_0) plane(L.k_scale, D / QK8_0 * sizeof(__half));
    plane(L.v_cache, D * elem);
    if (e.kv_type == OJ_KV_Q8_0) plane(L.v_scale, D / QK8_0 * sizeof(__half));
}

// The selected sequence's device memory in the copy's order (after the header): the recurrent
// state, h of n_past - 1 (hidden-window row `hidden_row`), the KV rows of every layer.
std::vector<StateCopy::Segment> seq_state_segments(Engine &e, int n_past, int mtp_rows, int hidden_row) {
    const ModelDims &d = e.dims;
    const size_t conv = (size_t)d.ssm_conv_dim() * (d.hp.ssm_conv_kernel - 1) * 4;
    const size_t ssm = (size_t)d.hp.ssm_dt_rank * d.hp.ssm_d_state * d.hp.ssm_d_state * 4;
    std::vector<StateCopy::Segment> out;
    for (Layer &L : e.layers) {
        if (!L.recurrent) continue;
        out.push_back({reinterpret_cast<uint8_t *>(L.conv_state), conv});
        out.push_back({reinterpret_cast<uint8_t *>(L.ssm_state), ssm});
    }
    out.push_back({reinterpret_cast<uint8_t *>(e.s.hidden + (size_t)hidden_row * d.hp.n_embd), (size_t)d.hp.n_embd * 4});
    for (Layer &L : e.layers)
        if (!L.recurrent) kv_segments(e, L, n_past, out);
    if (e.has_mtp) kv_segments(e, e.mtp.block, mtp_rows, out);
    return out;
}

// Each staging buffer's bytes: a piece of a copy in flight while the host moves the other one.
constexpr size_t STATE_STAGING_BYTES = 8u << 20;

// The copy stream, staging buffers and their events, made at the first copy; the event that
// orders the copy after the work already on the engine's stream; the sequence marked busy.
void start_copy(Engine &e, StateCopy &c, bool save, uint8_t *host, std::vector<StateCopy::Segment> segments) {
    if (!e.copy_stream) check_cuda(cudaStreamCreateWithFlags(&e.copy_stream, cudaStreamNonBlocking), "state copy stream");
    if (!e.staging) {
        void *p = nullptr;
        check_cuda(cudaHostAlloc(&p, 2 * STATE_STAGING_BYTES, cudaHostAllocDefault), "state copy staging (pinned host memory)");
        e.staging = static_cast<uint8_t *>(p);
        for (cudaEvent_t &ev : e.staged) check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "state copy event");
    }
    check_cuda(cudaEventCreateWithFlags(&c.start, cudaEventDisableTiming), "state copy event");
    check_cuda(cudaEventRecord(c.start, e.stream), "state copy event");
    c.e = &e;
    c.save = save;
    c.seq = e.cur_seq;
    c.host = host;
    c.segments = std::move(segments);
    e.copy_busy.fetch_or(1u << e.cur_seq);
}

}  // namespace

uint64_t engine_seq_state_size(const Engine &e) {
    return seq_state_bytes(e, e.n_past, std::min(e.mtp_n_past, e.n_past));
}

void check_not_copying(const Engine &e, int seq, const char *what) {
    if (e.copy_busy.load() & (1u << seq))
        fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": sequence " + std::to_string(seq) +
                                          " has a state copy in progress (oj_state_copy_wait first)");
}

void engine_seq_state_save(Engine &e, void *out, uint64_t size, StateCopy &c) {
    if (!out) fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_save: out is NULL");
    const uint64_t need = engine_seq_state_size(e);
    if (size < need)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_save: out holds " + std::to_string(size) + " bytes, the state of sequence " +
                                          std::to_string(e.cur_seq) + " needs " + std::to_string(need) + " (oj_seq_state_size)");
    e.uncommitted = 0;
    engine_flush(e);
    SeqStateHeader h{SEQ_STATE_MAGIC, SEQ_STATE_VERSION, model_fingerprint(e), e.n_past, std::min(e.mtp_n_past, e.n_past)};
    std::memcpy(out, &h, sizeof(h));
    start_copy(e, c, true, static_cast<uint8_t *>(out) + sizeof(h), seq_state_segments(e, h.n_past, h.mtp_rows, e.prev_row));
}

void engine_seq_state_load(Engine &e, const void *data, uint64_t size, StateCopy &c) {
    if (!data) fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_load: data is NULL");
    SeqStateHeader h{};
    if (size < sizeof(h)) fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_load: " + std::to_string(size) + " bytes is no sequence state");
    std::memcpy(&h, data, sizeof(h));
    if (h.magic != SEQ_STATE_MAGIC || h.version != SEQ_STATE_VERSION)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_load: not a sequence state of this engine's format (magic / version)");
    if (h.fingerprint != model_fingerprint(e))
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_load: the state was saved by an engine of another model or KV type");
    if (h.n_past < 0 || h.n_past > e.n_ctx || h.mtp_rows < 0 || h.mtp_rows > h.n_past)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_load: the state holds " + std::to_string(h.n_past) + " positions (" +
                                          std::to_string(h.mtp_rows) + " MTP rows); this engine's n_ctx is " + std::to_string(e.n_ctx));
    const uint64_t need = seq_state_bytes(e, h.n_past, h.mtp_rows);
    if (size != need)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_seq_state_load: " + std::to_string(size) + " bytes, but a state of " + std::to_string(h.n_past) +
                                          " positions is " + std::to_string(need));
    uint8_t *p = const_cast<uint8_t *>(static_cast<const uint8_t *>(data)) + sizeof(h);   // read only (save = false)
    start_copy(e, c, false, p, seq_state_segments(e, h.n_past, h.mtp_rows, 0));
    e.n_past = h.n_past;
    e.replay_n = 0;
    e.uncommitted = 0;
    e.tree = 0;
    e.prev_row = 0;            // the loaded hidden is row 0: the position before the next batch
    e.last_start = e.n_past;   // only h_{n_past-1} (row 0) is in the window now
    e.last_n = 0;
    e.mtp_n_past = h.mtp_rows;
    e.last_mtp_n = 0;
}

// The copy in pieces of STATE_STAGING_BYTES, alternating between the two staging buffers: while
// the copy engine moves piece k between the device and one buffer, the host moves piece k - 1
// between the other and the caller's memory. The engine's stream is never waited on by it.
void state_copy_run(StateCopy &c) {
    Engine &e = *c.e;
    std::lock_guard<std::mutex> lock(e.copy_mutex);
    check_cuda(cudaSetDevice(e.device), "state copy: cudaSetDevice");
    check_cuda(cudaStreamWaitEvent(e.copy_stream, c.start, 0), "state copy");
    uint64_t total = 0;
    for (const StateCopy::Segment &g : c.segments) total += g.bytes;
    const cudaMemcpyKind kind = c.save ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    uint8_t *host_at[2] = {}, *buf[2] = {e.staging, e.staging + STATE_STAGING_BYTES};
    size_t len_at[2] = {};
    auto drain = [&](int b) {   // piece in buffer b is through: a save's bytes go to the caller
        check_cuda(cudaEventSynchronize(e.staged[b]), "state copy");
        if (c.save && len_at[b]) std::memcpy(host_at[b], buf[b], len_at[b]);
        len_at[b] = 0;
    };
    size_t seg = 0, seg_off = 0;
    uint8_t *host = c.host;
    for (int k = 0; total > 0; ++k) {
        const int b = k & 1;
        if (k >= 2) drain(b);
        const size_t len = (size_t)std::min<uint64_t>(STATE_STAGING_BYTES, total);
        if (!c.save) std::memcpy(buf[b], host, len);
        for (size_t done = 0; done < len;) {
            const StateCopy::Segment &g = c.segments[seg];
            const size_t piece = std::min(g.bytes - seg_off, len - done);
            uint8_t *dev = g.dev + seg_off;
            check_cuda(c.save ? cudaMemcpyAsync(buf[b] + done, dev, piece, kind, e.copy_stream)
                              : cudaMemcpyAsync(dev, buf[b] + done, piece, kind, e.copy_stream),
                       "state copy");
            done += piece;
            seg_off += piece;
            if (seg_off == g.bytes) ++seg, seg_off = 0;
        }
        check_cuda(cudaEventRecord(e.staged[b], e.copy_stream), "state copy");
        host_at[b] = host;
        len_at[b] = len;
        host += len;
        total -= len;
        if (total == 0) {   // the other buffer's piece is older: it goes first
            drain(b ^ 1);
            drain(b);
        }
    }
}

void state_copy_release(StateCopy &c) {
    if (c.start) cudaEventDestroy(c.start);
    c.start = nullptr;
    if (c.e) c.e->copy_busy.fetch_and(~(1u << c.seq));
    c.e = nullptr;
}

void engine_set_draft_vocab(Engine &e, const int32_t *ids, int n) {
    if (!e.has_mtp) fail(OJ_ERR_INVALID_ARGUMENT, "the model has no MTP block: there is no draft head to restrict");
    const int V = e.dims.hp.n_vocab;
    if (n < 0 || n > V) fail(OJ_ERR_INVALID_ARGUMENT, "draft vocabulary of " + std::to_string(n) + " ids; the model has " + std::to_string(V));
    if (n > 0 && !ids) fail(OJ_ERR_INVALID_ARGUMENT, "draft vocabulary ids is NULL");
    for (int i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= V)
            fail(OJ_ERR_INVALID_ARGUMENT, "draft vocabulary id " + std::to_string(ids[i]) + " (entry " + std::to_string(i) +
                                              ") is outside the vocabulary [0, " + std::to_string(V) + ")");
    if (n > 0) {
        check_cuda(cudaMemcpyAsync(e.s.draft_ids, ids, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, e.stream), "draft vocabulary");
        finish(e, "draft vocabulary");
    }
    e.n_draft_ids = n;
    e.last_mtp_n = 0;   // draft results of the old vocabulary are gone
}

// oj_mtp_eval's checks and launches, without the wait (oj_cycle enqueues its drafts after it).
void mtp_enqueue(Engine &e, const int32_t *tokens, int n, int pos0, int h_source, const float *h_host) {
    if (!e.has_mtp) fail(OJ_ERR_INVALID_ARGUMENT, "the model has no MTP block (nextn_predict_layers = 0 or nextn tensors absent)");
    check_tokens(e, tokens, n);
    if (pos0 < 0 || pos0 > e.mtp_n_past)
        fail(OJ_ERR_INVALID_ARGUMENT, "MTP pos0 " + std::to_string(pos0) + " must be in [0, " + std::to_string(e.mtp_n_past) +
                                          "] (the MTP cache is contiguous from position 0)");
    if (pos0 + n > e.n_ctx) fail(OJ_ERR_CONTEXT_FULL, "MTP positions exceed n_ctx " + std::to_string(e.n_ctx));
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    Scratch &s = e.s;
    const float *h = nullptr;
    if (h_source == OJ_H_MAIN) {
        const int first = pos0 - e.last_start;   // row of h_{pos0-1} in the hidden window
        if (first < 0 || first + n - 1 > e.last_n)
            fail(OJ_ERR_INVALID_ARGUMENT, "OJ_H_MAIN needs the main hidden states of positions " + std::to_string(pos0 - 1) + ".." +
                                              std::to_string(pos0 + n - 2) + ", but the last eval kept " + std::to_string(e.last_start - 1) +
                                              ".." + std::to_string(e.last_start + e.last_n - 1));
        h = s.hidden + (size_t)first * E;
    } else if (h_source == OJ_H_DRAFT) {
        if (n != 1 || e.last_mtp_n < 1) fail(OJ_ERR_INVALID_ARGUMENT, "OJ_H_DRAFT chains one position after an earlier oj_mtp_eval");
        check_cuda(cudaMemcpyAsync(s.h_in, s.draft_hidden + (size_t)(e.last_mtp_n - 1) * E, E * 4, cudaMemcpyDeviceToDevice, e.stream), "draft h");
        h = s.h_in;
    } else if (h_source == OJ_H_HOST) {
        if (!h_host) fail(OJ_ERR_INVALID_ARGUMENT, "OJ_H_HOST with a NULL h_host");
        check_cuda(cudaMemcpyAsync(s.h_in, h_host, (size_t)n * E * 4, cudaMemcpyHostToDevice, e.stream), "host h");
        h = s.h_in;
    } else {
        fail(OJ_ERR_INVALID_ARGUMENT, "h_source " + std::to_string(h_source) + " is not an oj_h_source");
    }
    mtp_launch(e, tokens, n, pos0, h);
    e.mtp_n_past = pos0 + n;
    e.last_mtp_n = n;
}

void engine_mtp_eval(Engine &e, const int32_t *tokens, int n, int pos0, int h_source, const float *h_host) {
    mtp_enqueue(e, tokens, n, pos0, h_source, h_host);
    finish(e, "mtp_eval");
}

// The MTP block and its head over n positions at pos0.. from `h` (n device rows) onto the stream:
// the draft results land in s.draft_logits / draft_argmax / draft_hidden.
// device_tokens: `tokens` are in device memory (oj_cycle's chained drafts), read where they are.
void mtp_launch(Engine &e, const int32_t *tokens, int n, int pos0, const float *h, bool device_tokens) {
    const ModelDims &d = e.dims;
    const int E = d.hp.n_embd;
    Scratch &s = e.s;
    Mtp &m = e.mtp;
    if (!device_tokens)
        check_cuda(cudaMemcpyAsync(s.tokens, tokens, n * sizeof(int32_t), cudaMemcpyHostToDevice, e.stream), "copy tokens");
    embed_rows(*m.embed, device_tokens ? tokens : s.tokens, s.x, n, e.stream);
    rms_norm(s.x, m.enorm, s.cat, n, E, d.hp.rms_eps, 2 * E, e.stream);
    rms_norm(h, m.hnorm, s.cat + E, n, E, d.hp.rms_eps, 2 * E, e.stream);
    matvec(m.eh_proj, s.cat, s.x, n, false, e.stream);
    bool sums = false;   // the block's input comes from eh_proj
    attention_layer(e, m.block, n, pos0, sums);
    ffn(e, m.block, n, sums);
    rms_norm(s.x, m.head_norm, s.draft_hidden, n, E, d.hp.rms_eps, E, e.stream);
    if (e.n_draft_ids > 0) {
        matvec_rows(*m.head, s.draft_ids, e.n_draft_ids, s.draft_hidden, s.draft_logits, n, e.stream);
        argmax_rows(s.draft_logits, s.draft_argmax, n, e.n_draft_ids, s.rows, e.stream);
        map_ids(s.draft_argmax, s.draft_ids, n, e.stream);
    } else {
        matvec(*m.head, s.draft_hidden, s.draft_logits, n, false, e.stream);
        argmax_rows(s.draft_logits, s.draft_argmax, n, d.hp.n_vocab, s.rows, e.stream);
    }
}

namespace {

// One draft-tree node's MTP step (n positions at pos0 from the device rows h, the node the last),
// then its k best candidates and their probabilities under its whole (restricted) head
// distribution: one wait on the GPU.
struct NodeTop {
    int32_t id[OJ_TREE_MAX_CHILDREN];
    double prob[OJ_TREE_MAX_CHILDREN];
    int n = 0;
};
NodeTop tree_step(Engine &e, const int32_t *tokens, int n, int pos0, const float *h, int k, float *hidden_out) {
    Scratch &s = e.s;
    const int E = e.dims.hp.n_embd;
    const int width = e.n_draft_ids > 0 ? e.n_draft_ids : e.dims.hp.n_vocab;
    mtp_launch(e, tokens, n, pos0, h);
    const int32_t *ids = e.n_draft_ids > 0 ? s.draft_ids : nullptr;
    row_top(s.draft_logits + (size_t)(n - 1) * width, width, ids, k, s.tree_top, e.stream);
    check_cuda(cudaMemcpyAsync(hidden_out, s.draft_hidden + (size_t)(n - 1) * E, (size_t)E * 4, cudaMemcpyDeviceToDevice,
                               e.stream), "draft tree hidden");
    TreeTop got;
    check_cuda(cudaMemcpyAsync(&got, s.tree_top, sizeof got, cudaMemcpyDeviceToHost, e.stream), "draft tree candidates");
    finish(e, "oj_draft_tree");
    e.mtp_n_past = pos0 + n;
    e.last_mtp_n = n;
    NodeTop t;
    for (int j = 0; j < k; ++j) {
        if (got.id[j] < 0 || !(got.sum > 0)) break;
        t.id[t.n] = got.id[j];
        t.prob[t.n] = std::exp((double)got.val[j] - got.max) / got.sum;
        ++t.n;
    }
    return t;
}

}  // namespace

int engine_draft_tree(Engine &e, const oj_tree_request &rq, int32_t *tokens, int32_t *parent, double *prob, double *score,
                      int *steps_out) {
    if (!e.has_mtp) fail(OJ_ERR_INVALID_ARGUMENT, "the model has no MTP block (nextn_predict_layers = 0 or nextn tensors absent)");
    if (!tokens || !parent || !prob || !score) fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: an output array is NULL");
    if (!rq.root_h) fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: root_h is NULL");
    if (rq.budget < 1 || rq.budget > OJ_MAX_TREE_NODES)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: budget " + std::to_string(rq.budget) + " is outside 1.." +
                                          std::to_string(OJ_MAX_TREE_NODES));
    if (rq.max_children < 1 || rq.max_children > OJ_TREE_MAX_CHILDREN)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: max_children " + std::to_string(rq.max_children) + " is outside 1.." +
                                          std::to_string(OJ_TREE_MAX_CHILDREN));
    if (rq.max_depth < 0) fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: max_depth is negative");
    if (rq.n_bins < 1 || rq.n_bins > OJ_TREE_MAX_BINS || !rq.edges || !rq.accept_a || !rq.accept_c)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: 1.." + std::to_string(OJ_TREE_MAX_BINS) +
                                          " acceptance bins with their edges and coefficients are needed");
    check_tokens(e, &rq.root, 1);
    const int pos = rq.pos;
    if (pos < 0 || pos > e.mtp_n_past)
        fail(OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: pos " + std::to_string(pos) + " must be in [0, " +
                                          std::to_string(e.mtp_n_past) + "] (the MTP cache is contiguous from position 0)");
    const int max_depth = std::min(rq.max_depth, rq.budget - 1);
    if (pos + 1 + max_depth > e.n_ctx) fail(OJ_ERR_CONTEXT_FULL, "oj_draft_tree: positions exceed n_ctx " + std::to_string(e.n_ctx));
    Scratch &s = e.s;
    const int E = e.dims.hp.n_embd;
    // the acceptance estimate of a draft probability q: a + c q in q's bin (TreePolicy.estimate)
    auto estimate = [&](double q) {
        int b = 0;
        while (b + 1 < rq.n_bins && q >= rq.edges[b + 1]) ++b;
        return rq.accept_a[b] + rq.accept_c[b] * q;
    };
    int n = 1, steps = 0;
    int depth[OJ_MAX_POSITIONS] = {0};
    tokens[0] = rq.root, parent[0] = -1, prob[0] = 1.0, score[0] = 1.0;
    NodeTop top[OJ_MAX_POSITIONS];
    if (max_depth < 1 || rq.budget < 2) {
        if (steps_out) *steps_out = 0;
        return 1;
    }
    // the root's step: its row (x_pos, h_{pos-1}) from the host
    check_cuda(cudaMemcpyAsync(s.h_in, rq.root_h, (size_t)E * 4, cudaMemcpyHostToDevice, e.stream), "draft tree root h");
    top[0] = tree_step(e, &rq.root, 1, pos, s.h_in, rq.max_children, s.tree_h);
    ++steps;
    // best-first over the slots (grow_tree's order: score, then shallower, then the order pushed)
    struct Slot { double score; int depth; int order; int node, j; };
    std::vector<Slot> heap;
    int order = 0;
    auto worse = [](const Slot &a, const Slot &b) {   // a below b in the max-heap
        if (a.score != b.score) return a.score < b.score;
        if (a.depth != b.depth) return a.depth > b.depth;
        return a.order > b.order;
    };
    auto push = [&](int i, int j) {
        if (j < top[i].n) {
            heap.push_back({score[i] * estimate(top[i].prob[j]), depth[i] + 1, order++, i, j});
            std::push_heap(heap.begin(), heap.end(), worse);
        }
    };
    push(0, 0);
    while (n < rq.budget && !heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), worse);
        const Slot sl = heap.back();
        heap.pop_back();
        const int i = n++;
        tokens[i] = top[sl.node].id[sl.j];
        parent[i] = sl.node;
        depth[i] = sl.depth;
        prob[i] = top[sl.node].prob[sl.j];
        score[i] = sl.score;
        push(sl.node, sl.j + 1);
        if (n < rq.budget && sl.depth < max_depth) {
            // its step on its own branch: the path's rows (token, the MTP hidden of its parent) at pos + 1..
            int path[OJ_MAX_POSITIONS], len = 0;
            for (int v = i; v > 0; v = parent[v]) path[len++] = v;
            int32_t ptok[OJ_MAX_POSITIONS];
            for (int r = 0; r < len; ++r) {
                const int v = path[len - 1 - r];
                ptok[r] = tokens[v];
                check_cuda(cudaMemcpyAsync(s.h_in + (size_t)r * E, s.tree_h + (size_t)parent[v] * E, (size_t)E * 4,
                                           cudaMemcpyDeviceToDevice, e.stream), "draft tree path h");
            }
            top[i] = tree_step(e, ptok, len, pos + 1, s.h_in, rq.max_children, s.tree_h + (size_t)i * E);
            ++steps;
            push(i, 0);
        } else {
            top[i].n = 0;
        }
    }
    if (steps_out) *steps_out = steps;
    return n;
}

void engine_profile(Engine &e, int on) {
    Profile &p = e.prof;
    p.on = on == 1;
    p.host = on != 0;
    p.used = 0;
    for (Profile::Total &t : p.total) t = Profile::Total{};
    p.passes = 0;
    p.span_ms = 0;
    p.host_passes = 0;
    p.host_ms = 0;
}

int engine_profile_read(Engine &e, oj_phase *out, int capacity, int *passes, double *span_ms, double *host_ms) {
    if (capacity < 0 || (capacity > 0 && !out)) fail(OJ_ERR_INVALID_ARGUMENT, "oj_profile_read: out is NULL or capacity negative");
    Profile &p = e.prof;
    const int n = capacity < PH_COUNT ? capacity : PH_COUNT;
    for (int i = 0; i < n; ++i) {
        oj_phase &o = out[i];
        std::memset(o.name, 0, sizeof o.name);
        std::strncpy(o.name, PHASE_NAMES[i], sizeof o.name - 1);
        o.calls = (int32_t)p.total[i].calls;
        o.launches = (int32_t)p.total[i].launches;
        o.ms = p.total[i].ms;
        o.bytes = p.total[i].bytes;
    }
    if (passes) *passes = p.on ? p.passes : p.host_passes;
    if (span_ms) *span_ms = p.span_ms;
    if (host_ms) *host_ms = p.host_ms;
    engine_profile(e, p.on ? 1 : p.host ? 2 : 0);
    return n;
}

}  // namespace oj
