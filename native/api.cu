// api.cu: the C API of openjet.h. Every entry point catches oj::Error (and anything else) and
// turns it into a status code plus a message; no exception, abort or print crosses this file.
#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "engine.cuh"

struct oj_engine {
    oj::Engine e;
};

namespace {

thread_local std::string g_error;   // errors of calls without an engine

int32_t set_error(oj_engine *h, int code, const std::string &message) {
    if (h) h->e.error = message;
    else g_error = message;
    return code;
}

// A sticky CUDA error (illegal address, launch failure) poisons the context for good: remember
// it so later calls fail fast with a clear message instead of an unrelated one.
void note_sticky(oj_engine *h) {
    if (!h) return;
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess && err != cudaErrorMemoryAllocation) h->e.failed = true;
}

template <typename F>
int32_t guarded(oj_engine *h, F &&body) {
    if (h && h->e.failed)
        return set_error(h, OJ_ERR_FAILED_STATE, "an earlier CUDA fault poisoned this engine's context (" + h->e.error +
                                                     "); free it and create a new process");
    try {
        body();
        return OJ_OK;
    } catch (const oj::Error &err) {
        if (err.code == OJ_ERR_CUDA) note_sticky(h);
        return set_error(h, err.code, err.message);
    } catch (const std::bad_alloc &) {
        return set_error(h, OJ_ERR_OUT_OF_MEMORY, "host memory exhausted");
    } catch (...) {
        return set_error(h, OJ_ERR_CUDA, "unexpected internal error");
    }
}

// guarded, for a call that reads or changes the selected sequence: refused while a state copy of
// it is not waited for (oj_state_copy_wait) or a prompt piece of it is in flight (oj_prefill_layers).
template <typename F>
int32_t on_sequence(oj_engine *h, const char *what, F &&body) {
    return guarded(h, [&] {
        oj::check_not_copying(h->e, h->e.cur_seq, what);
        oj::check_no_piece(h->e, h->e.cur_seq, what);
        body();
    });
}

void check_index(const oj::Engine &e, int32_t index, int32_t have, const char *what) {
    if (index < 0 || index >= have)
        oj::fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + " index " + std::to_string(index) + " is outside [0, " +
                                              std::to_string(have) + ")");
}

void check_out(const void *out, uint64_t have, uint64_t need, const char *what) {
    if (!out) oj::fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": out is NULL");
    if (have < need)
        oj::fail(OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": out holds " + std::to_string(have) + " values, " +
                                              std::to_string(need) + " needed");
}

void copy_to_host(oj::Engine &e, void *dst, const void *src, size_t bytes, const char *what) {
    oj::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, e.stream), what);
    oj::check_cuda(cudaStreamSynchronize(e.stream), what);
}

const oj::Layer &layer_at(const oj::Engine &e, int32_t layer) {
    if (layer == e.dims.hp.n_layer && e.has_mtp) return e.mtp.block;
    if (layer < 0 || layer >= e.dims.hp.n_layer)
        oj::fail(OJ_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + " does not exist");
    return e.layers[layer];
}

}  // namespace

// A copy object the caller frees by waiting for it: the engine's StateCopy of the copy.
struct oj_state_copy {
    oj::StateCopy c;
};

namespace {

template <typename F>
int32_t start_copy(oj_engine *engine, oj_state_copy **copy, const char *what, F &&start) {
    if (!engine || !copy) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, std::string(what) + ": engine or copy is NULL");
    *copy = nullptr;
    oj_state_copy *c = new (std::nothrow) oj_state_copy();
    if (!c) return set_error(engine, OJ_ERR_OUT_OF_MEMORY, "host memory exhausted");
    const int32_t rc = on_sequence(engine, what, [&] { start(c->c); });
    if (rc != OJ_OK) {
        oj::state_copy_release(c->c);
        delete c;
        return rc;
    }
    *copy = c;
    return OJ_OK;
}

}  // namespace

extern "C" {

int32_t oj_abi_version(void) { return OJ_ABI_VERSION; }

const char *oj_last_error(const oj_engine *engine) {
    return engine ? engine->e.error.c_str() : g_error.c_str();
}

int32_t oj_device_info(int32_t device, int32_t *cc_major, int32_t *cc_minor, uint64_t *free_bytes,
                       uint64_t *total_bytes, char *name, int32_t name_capacity) {
    return guarded(nullptr, [&] {
        int count = 0;
        const cudaError_t err = cudaGetDeviceCount(&count);
        if (err != cudaSuccess || count == 0)
            oj::fail(OJ_ERR_NO_DEVICE, std::string("no CUDA device: ") + (err == cudaSuccess ? "device count is 0" : cudaGetErrorString(err)));
        if (device < 0 || device >= count)
            oj::fail(OJ_ERR_INVALID_ARGUMENT, "device " + std::to_string(device) + " does not exist (" + std::to_string(count) + " found)");
        cudaDeviceProp prop;
        oj::check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
        if (cc_major) *cc_major = prop.major;
        if (cc_minor) *cc_minor = prop.minor;
        if (name && name_capacity > 0) {
            std::strncpy(name, prop.name, name_capacity - 1);
            name[name_capacity - 1] = '\0';
        }
        if (free_bytes || total_bytes) {
            oj::check_cuda(cudaSetDevice(device), "cudaSetDevice");
            size_t f = 0, t = 0;
            oj::check_cuda(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
            if (free_bytes) *free_bytes = f;
            if (total_bytes) *total_bytes = t;
        }
    });
}

int32_t oj_engine_create(const oj_model_desc *desc, oj_engine **out) {
    if (!out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = nullptr;
    if (!desc) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "desc is NULL");
    oj_engine *h = new (std::nothrow) oj_engine();
    if (!h) return set_error(nullptr, OJ_ERR_OUT_OF_MEMORY, "host memory exhausted");
    const int32_t rc = guarded(nullptr, [&] { oj::engine_load(h->e, *desc); });
    if (rc != OJ_OK) {
        h->e.release_all();
        delete h;
        return rc;
    }
    *out = h;
    return OJ_OK;
}

void oj_engine_free(oj_engine *engine) {
    if (!engine) return;
    engine->e.release_all();
    delete engine;
}

int32_t oj_memory(const oj_engine *engine, oj_memory_report *out) {
    if (!engine || !out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or out is NULL");
    *out = engine->e.memory;
    return OJ_OK;
}

int32_t oj_profile(oj_engine *engine, int32_t on) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    if (on < 0 || on > 2) return set_error(engine, OJ_ERR_INVALID_ARGUMENT, "oj_profile: on must be 0, 1 or 2, got " + std::to_string(on));
    return guarded(engine, [&] { oj::engine_profile(engine->e, on); });
}

int32_t oj_profile_read(oj_engine *engine, oj_phase *out, int32_t capacity, int32_t *n_phases, int32_t *passes,
                        double *span_ms, double *host_ms) {
    if (!engine || !n_phases) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or n_phases is NULL");
    return guarded(engine, [&] {
        int p = 0;
        *n_phases = oj::engine_profile_read(engine->e, out, capacity, &p, span_ms, host_ms);
        if (passes) *passes = p;
    });
}

int32_t oj_graph_stats(const oj_engine *engine, int64_t *replayed, int64_t *direct, int32_t *held, int64_t *captures,
                       double *capture_ms) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    if (replayed) *replayed = engine->e.graph_replays;
    if (direct) *direct = engine->e.direct_passes;
    if (held) *held = (int32_t)engine->e.graphs.size();
    if (captures) *captures = engine->e.graph_captures;
    if (capture_ms) *capture_ms = engine->e.graph_capture_ms;
    return OJ_OK;
}

int32_t oj_reset(oj_engine *engine) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::check_not_copying(engine->e, engine->e.cur_seq, "oj_reset");
        if (engine->e.pf.piece_seq == engine->e.cur_seq) engine->e.pf.piece_seq = -1;   // its piece goes too
        oj::engine_reset(engine->e);
    });
}

int32_t oj_n_past(const oj_engine *engine, int32_t *out) {
    if (!engine || !out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or out is NULL");
    *out = engine->e.n_past;
    return OJ_OK;
}

int32_t oj_seq_select(oj_engine *engine, int32_t seq) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] { oj::engine_seq_select(engine->e, seq); });
}

int32_t oj_seq_selected(const oj_engine *engine, int32_t *out) {
    if (!engine || !out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or out is NULL");
    *out = engine->e.cur_seq;
    return OJ_OK;
}

int32_t oj_eval_seqs(oj_engine *engine, const int32_t *seqs, const int32_t *tokens, int32_t n_seqs) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] { oj::engine_eval_seqs(engine->e, seqs, tokens, n_seqs); });
}

int32_t oj_seq_state_size(oj_engine *engine, uint64_t *out) {
    if (!engine || !out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or out is NULL");
    return on_sequence(engine, "oj_seq_state_size", [&] { *out = oj::engine_seq_state_size(engine->e); });
}

int32_t oj_seq_state_save(oj_engine *engine, void *out, uint64_t size, oj_state_copy **copy) {
    return start_copy(engine, copy, "oj_seq_state_save", [&](oj::StateCopy &c) { oj::engine_seq_state_save(engine->e, out, size, c); });
}

int32_t oj_seq_state_load(oj_engine *engine, const void *data, uint64_t size, oj_state_copy **copy) {
    return start_copy(engine, copy, "oj_seq_state_load", [&](oj::StateCopy &c) { oj::engine_seq_state_load(engine->e, data, size, c); });
}

int32_t oj_state_copy_wait(oj_state_copy *copy) {
    if (!copy) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "oj_state_copy_wait: copy is NULL");
    oj::Engine *e = copy->c.e;
    int32_t rc = OJ_OK;
    if (e && e->failed) {
        rc = set_error(nullptr, OJ_ERR_FAILED_STATE, "oj_state_copy_wait: an earlier CUDA fault poisoned the engine's context");
    } else {
        rc = guarded(nullptr, [&] { oj::state_copy_run(copy->c); });
        if (rc == OJ_ERR_CUDA && e) {   // sticky: the engine's later calls fail fast (guarded's rule)
            const cudaError_t err = cudaStreamSynchronize(e->copy_stream);
            if (err != cudaSuccess && err != cudaErrorMemoryAllocation) e->failed = true;
        }
    }
    oj::state_copy_release(copy->c);
    delete copy;
    return rc;
}

int32_t oj_eval(oj_engine *engine, const int32_t *tokens, int32_t n_tokens) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_eval", [&] { oj::engine_eval(engine->e, tokens, n_tokens); });
}

int32_t oj_prefill(oj_engine *engine, const int32_t *tokens, int32_t n_tokens) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_prefill", [&] { oj::engine_prefill(engine->e, tokens, n_tokens); });
}

int32_t oj_prefill_layers(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t layers, int32_t *done) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    if (!done) return set_error(engine, OJ_ERR_INVALID_ARGUMENT, "oj_prefill_layers: done is NULL");
    *done = 0;
    return guarded(engine, [&] {
        oj::check_not_copying(engine->e, engine->e.cur_seq, "oj_prefill_layers");
        oj::engine_prefill_layers(engine->e, tokens, n_tokens, layers, done);
    });
}

int32_t oj_verify(oj_engine *engine, const int32_t *tokens, int32_t n_tokens) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_verify", [&] { oj::engine_verify(engine->e, tokens, n_tokens); });
}

int32_t oj_commit(oj_engine *engine, int32_t n_accept) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_commit", [&] { oj::engine_commit(engine->e, n_accept); });
}

int32_t oj_verify_tree(oj_engine *engine, const int32_t *tokens, const int32_t *parent, int32_t n_tokens) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_verify_tree", [&] { oj::engine_verify_tree(engine->e, tokens, parent, n_tokens); });
}

int32_t oj_commit_path(oj_engine *engine, const int32_t *path, int32_t n_path) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_commit_path", [&] { oj::engine_commit_path(engine->e, path, n_path); });
}

int32_t oj_cycle(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t n_draft,
                 int32_t *n_accepted, int32_t *out_tokens, int32_t *out_drafts) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    if (!n_accepted) return set_error(engine, OJ_ERR_INVALID_ARGUMENT, "n_accepted is NULL");
    return on_sequence(engine, "oj_cycle", [&] { *n_accepted = oj::engine_cycle(engine->e, tokens, n_tokens, n_draft, out_tokens, out_drafts); });
}

int32_t oj_cycle_sampled(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t n_draft,
                         const oj_sampling *sampling, int32_t *n_accepted, int32_t *out_tokens, int32_t *out_drafts) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    if (!n_accepted) return set_error(engine, OJ_ERR_INVALID_ARGUMENT, "n_accepted is NULL");
    if (!sampling) return set_error(engine, OJ_ERR_INVALID_ARGUMENT, "sampling is NULL");
    return on_sequence(engine, "oj_cycle_sampled", [&] {
        *n_accepted = oj::engine_cycle_sampled(engine->e, tokens, n_tokens, n_draft, *sampling, out_tokens, out_drafts);
    });
}

int32_t oj_checkpoint_save(oj_engine *engine, int32_t slot) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_checkpoint_save", [&] { oj::engine_checkpoint_save(engine->e, slot); });
}

int32_t oj_checkpoint_restore(oj_engine *engine, int32_t slot, int32_t *n_past_out) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_checkpoint_restore", [&] {
        const int n = oj::engine_checkpoint_restore(engine->e, slot);
        if (n_past_out) *n_past_out = n;
    });
}

int32_t oj_set_draft_vocab(oj_engine *engine, const int32_t *ids, int32_t n_ids) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] { oj::engine_set_draft_vocab(engine->e, ids, n_ids); });
}

int32_t oj_draft_vocab_size(const oj_engine *engine, int32_t *out) {
    if (!engine || !out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or out is NULL");
    *out = engine->e.n_draft_ids > 0 ? engine->e.n_draft_ids : engine->e.dims.hp.n_vocab;
    return OJ_OK;
}

int32_t oj_get_argmax(oj_engine *engine, int32_t *out, int32_t n) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::Engine &e = engine->e;
        if (n < 1 || n > e.result_rows)
            oj::fail(OJ_ERR_INVALID_ARGUMENT, "n must be 1.." + std::to_string(e.result_rows) + " (the last eval's positions)");
        check_out(out, n, n, "oj_get_argmax");
        copy_to_host(e, out, e.s.argmax, n * sizeof(int32_t), "oj_get_argmax");
    });
}

int32_t oj_get_logits(oj_engine *engine, int32_t index, float *out, int32_t n_vocab) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::Engine &e = engine->e;
        check_index(e, index, e.result_rows, "oj_get_logits");
        check_out(out, n_vocab, e.dims.hp.n_vocab, "oj_get_logits");
        copy_to_host(e, out, e.s.logits + (size_t)index * e.dims.hp.n_vocab, (size_t)e.dims.hp.n_vocab * 4, "oj_get_logits");
    });
}

int32_t oj_get_hidden(oj_engine *engine, int32_t index, float *out, int32_t n_embd) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_get_hidden", [&] {
        oj::Engine &e = engine->e;
        check_index(e, index, e.last_n, "oj_get_hidden");
        check_out(out, n_embd, e.dims.hp.n_embd, "oj_get_hidden");
        copy_to_host(e, out, e.s.hidden + (size_t)(index + 1) * e.dims.hp.n_embd, (size_t)e.dims.hp.n_embd * 4, "oj_get_hidden");
    });
}

int32_t oj_mtp_eval(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t pos0,
                    int32_t h_source, const float *h_host) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_mtp_eval", [&] { oj::engine_mtp_eval(engine->e, tokens, n_tokens, pos0, h_source, h_host); });
}

int32_t oj_draft_tree(oj_engine *engine, const oj_tree_request *request, int32_t *tokens, int32_t *parent,
                      double *prob, double *score, int32_t *n_nodes, int32_t *steps) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    if (!request || !n_nodes) return set_error(engine, OJ_ERR_INVALID_ARGUMENT, "oj_draft_tree: request or n_nodes is NULL");
    return on_sequence(engine, "oj_draft_tree", [&] {
        int st = 0;
        *n_nodes = oj::engine_draft_tree(engine->e, *request, tokens, parent, prob, score, &st);
        if (steps) *steps = st;
    });
}

int32_t oj_mtp_n_past(const oj_engine *engine, int32_t *out) {
    if (!engine || !out) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine or out is NULL");
    *out = engine->e.mtp_n_past;
    return OJ_OK;
}

int32_t oj_get_draft_argmax(oj_engine *engine, int32_t *out, int32_t n) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::Engine &e = engine->e;
        if (n < 1 || n > e.last_mtp_n) oj::fail(OJ_ERR_INVALID_ARGUMENT, "n must be 1.." + std::to_string(e.last_mtp_n) + " (the last MTP eval's positions)");
        check_out(out, n, n, "oj_get_draft_argmax");
        copy_to_host(e, out, e.s.draft_argmax, n * sizeof(int32_t), "oj_get_draft_argmax");
    });
}

int32_t oj_get_draft_logits(oj_engine *engine, int32_t index, float *out, int32_t n) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::Engine &e = engine->e;
        check_index(e, index, e.last_mtp_n, "oj_get_draft_logits");
        const int width = e.n_draft_ids > 0 ? e.n_draft_ids : e.dims.hp.n_vocab;
        check_out(out, n, width, "oj_get_draft_logits");
        copy_to_host(e, out, e.s.draft_logits + (size_t)index * width, (size_t)width * 4, "oj_get_draft_logits");
    });
}

int32_t oj_get_draft_hidden(oj_engine *engine, int32_t index, float *out, int32_t n_embd) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::Engine &e = engine->e;
        check_index(e, index, e.last_mtp_n, "oj_get_draft_hidden");
        check_out(out, n_embd, e.dims.hp.n_embd, "oj_get_draft_hidden");
        copy_to_host(e, out, e.s.draft_hidden + (size_t)index * e.dims.hp.n_embd, (size_t)e.dims.hp.n_embd * 4, "oj_get_draft_hidden");
    });
}

int32_t oj_read_conv_state(oj_engine *engine, int32_t layer, float *out, uint64_t n) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_read_conv_state", [&] {
        oj::Engine &e = engine->e;
        const oj::Layer &L = layer_at(e, layer);
        if (!L.recurrent) oj::fail(OJ_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + " is not a DeltaNet layer");
        const uint64_t count = (uint64_t)e.dims.ssm_conv_dim() * (e.dims.hp.ssm_conv_kernel - 1);
        check_out(out, n, count, "oj_read_conv_state");
        oj::engine_flush(e);
        copy_to_host(e, out, L.conv_state, count * 4, "oj_read_conv_state");
    });
}

int32_t oj_read_ssm_state(oj_engine *engine, int32_t layer, float *out, uint64_t n) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_read_ssm_state", [&] {
        oj::Engine &e = engine->e;
        const oj::Layer &L = layer_at(e, layer);
        if (!L.recurrent) oj::fail(OJ_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + " is not a DeltaNet layer");
        const uint64_t S = e.dims.hp.ssm_d_state;
        const uint64_t count = (uint64_t)e.dims.hp.ssm_dt_rank * S * S;
        check_out(out, n, count, "oj_read_ssm_state");
        oj::engine_flush(e);
        copy_to_host(e, out, L.ssm_state, count * 4, "oj_read_ssm_state");
    });
}

int32_t oj_read_kv(oj_engine *engine, int32_t layer, int32_t which, int32_t pos0, int32_t n_pos, float *out, uint64_t n) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return on_sequence(engine, "oj_read_kv", [&] {
        oj::Engine &e = engine->e;
        const oj::Layer &L = layer_at(e, layer);
        if (L.recurrent) oj::fail(OJ_ERR_INVALID_ARGUMENT, "layer " + std::to_string(layer) + " has no KV cache (DeltaNet)");
        if (which != 0 && which != 1) oj::fail(OJ_ERR_INVALID_ARGUMENT, "which must be 0 (K) or 1 (V)");
        const bool mtp = layer == e.dims.hp.n_layer;
        const int have = mtp ? e.mtp_n_past : e.n_past;
        if (pos0 < 0 || n_pos < 0 || pos0 + n_pos > have)
            oj::fail(OJ_ERR_INVALID_ARGUMENT, "positions [" + std::to_string(pos0) + ", " + std::to_string(pos0 + n_pos) +
                                                  ") are outside the cache's [0, " + std::to_string(have) + ")");
        const int Hkv = e.dims.hp.n_head_kv, D = e.dims.hp.head_dim;
        const uint64_t count = (uint64_t)n_pos * Hkv * D;
        check_out(out, n, count, "oj_read_kv");
        // per KV head, rows [pos0, pos0 + n_pos) of the value plane (and for q8_0 of the scale plane)
        const bool q8 = L.kv_type == OJ_KV_Q8_0;
        const size_t elem = q8 ? 1 : sizeof(__half), nb = D / 32;   // nb: q8_0 blocks per row
        const uint8_t *cache = static_cast<const uint8_t *>(which == 0 ? L.k_cache : L.v_cache);
        const __half *scales = which == 0 ? L.k_scale : L.v_scale;
        std::vector<uint8_t> buf((size_t)Hkv * n_pos * D * elem);
        std::vector<__half> sbuf(q8 ? (size_t)Hkv * n_pos * nb : 0);
        for (int g = 0; g < Hkv; ++g) {
            const size_t row = (size_t)g * e.n_ctx + pos0;
            oj::check_cuda(cudaMemcpyAsync(buf.data() + (size_t)g * n_pos * D * elem, cache + row * D * elem,
                                           (size_t)n_pos * D * elem, cudaMemcpyDeviceToHost, e.stream), "oj_read_kv");
            if (q8)
                oj::check_cuda(cudaMemcpyAsync(sbuf.data() + (size_t)g * n_pos * nb, scales + row * nb,
                                               (size_t)n_pos * nb * sizeof(__half), cudaMemcpyDeviceToHost, e.stream),
                               "oj_read_kv");
        }
        oj::check_cuda(cudaStreamSynchronize(e.stream), "oj_read_kv");
        const __half *h16 = reinterpret_cast<const __half *>(buf.data());
        const int8_t *i8 = reinterpret_cast<const int8_t *>(buf.data());
        for (int p = 0; p < n_pos; ++p)
            for (int g = 0; g < Hkv; ++g) {
                const size_t src = ((size_t)g * n_pos + p) * D;
                float *dst = out + ((size_t)p * Hkv + g) * D;
                for (int d = 0; d < D; ++d)
                    dst[d] = q8 ? (float)i8[src + d] * __half2float(sbuf[src / 32 + d / 32]) : __half2float(h16[src + d]);
            }
    });
}

int32_t oj_debug_fault(oj_engine *engine, int32_t kind) {
    if (!engine) return set_error(nullptr, OJ_ERR_INVALID_ARGUMENT, "engine is NULL");
    return guarded(engine, [&] {
        oj::Engine &e = engine->e;
        if (kind == 1) {
            oj::fault_probe(e.s.fault_probe, e.stream);
            oj::check_cuda(cudaStreamSynchronize(e.stream), "fault probe kernel");
        } else if (kind == 2) {
            size_t f = 0, t = 0;
            oj::check_cuda(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
            uint64_t scratch = 0;
            void *p = e.alloc(t * 2, scratch);   // throws OJ_ERR_OUT_OF_MEMORY
            (void)p;
        } else {
            oj::fail(OJ_ERR_INVALID_ARGUMENT, "fault kind must be 1 (illegal address) or 2 (out of memory)");
        }
    });
}

}  // extern "C"
