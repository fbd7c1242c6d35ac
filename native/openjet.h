/* openjet.h: the whole C API of the native qwen35 engine.
 *
 * The Python binding (openjet_plugin/_native.py, cffi ABI mode) feeds this file to ffi.cdef after
 * dropping preprocessor lines and the __cplusplus guard, so declarations here use plain C types
 * only: no macros inside declarations, no function-like macros, no inline code.
 *
 * Contract:
 * - Every function that can fail returns an oj_status; OJ_OK is 0. The message of the last
 *   failure is oj_last_error(engine), or oj_last_error(NULL) for calls without an engine (create,
 *   device queries). Nothing here prints, aborts or exits.
 * - The caller describes the model (hyperparameters + one oj_tensor per GGUF tensor, pointing at
 *   the memory-mapped raw bytes); oj_engine_create uploads everything it needs once and keeps no
 *   pointer into the caller's memory afterwards.
 * - oj_eval appends 1..OJ_MAX_POSITIONS tokens at n_past and computes, for every one of them,
 *   the full-vocabulary logits and their argmax on the GPU; logits are copied to the host only
 *   when asked (oj_get_logits).
 * - Speculative cycles use oj_verify + oj_commit instead: a verify evaluates like oj_eval but
 *   commits nothing (n_past stays); oj_commit(n_accept) keeps its first n_accept positions. The
 *   Gated DeltaNet state advances by replaying the accepted positions' intermediates at the start
 *   of the next evaluation (native/deltanet.cu); K/V of rejected positions are simply overwritten.
 * - Draft trees: oj_verify_tree evaluates a tree of drafts in one pass (tree attention mask,
 *   DeltaNet from each node's parent), oj_commit_path keeps one root-first path of it.
 * - The MTP (nextn) block has its own KV cache; oj_mtp_eval places token i at MTP position
 *   pos0 + i (dropping MTP positions >= pos0 first, which is how drafts are rolled back).
 * - After a CUDA fault that poisons the context (an illegal address) every call but
 *   oj_engine_free returns OJ_ERR_FAILED_STATE; oj_engine_free always releases what it can.
 */
#ifndef OPENJET_H
#define OPENJET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* OJ_MAX_POSITIONS: positions of one evaluation (oj_eval, oj_verify, oj_cycle); OJ_MAX_TREE_NODES:
   nodes of a draft tree (oj_verify_tree, oj_draft_tree, a path of oj_commit_path that is not a
   prefix), whose shape the kernels take as one 64-bit word of 8-bit parents. */
enum { OJ_ABI_VERSION = 15, OJ_MAX_POSITIONS = 16, OJ_MAX_TREE_NODES = 8, OJ_MAX_PREFILL_CHUNK = 4096, OJ_MAX_SEQUENCES = 8 };

typedef enum oj_status {
    OJ_OK = 0,
    OJ_ERR_INVALID_ARGUMENT = 1,   /* a bad parameter, a missing tensor, a shape that does not fit */
    OJ_ERR_UNSUPPORTED = 2,        /* a tensor type or model shape this engine has no kernel for */
    OJ_ERR_OUT_OF_MEMORY = 3,      /* cudaMalloc failed */
    OJ_ERR_CUDA = 4,               /* any other CUDA error (launch failure, illegal address, ...) */
    OJ_ERR_CONTEXT_FULL = 5,       /* n_past + n_tokens would exceed n_ctx */
    OJ_ERR_NO_DEVICE = 6,          /* no usable CUDA device */
    OJ_ERR_FAILED_STATE = 7        /* an earlier CUDA fault poisoned the context: only free works */
} oj_status;

/* Tensor types, numbered as ggml's GGML_TYPE_* (the GGUF file's own type ids). */
typedef enum oj_type {
    OJ_TYPE_F32 = 0,
    OJ_TYPE_F16 = 1,
    OJ_TYPE_Q8_0 = 8,
    OJ_TYPE_Q4_K = 12,
    OJ_TYPE_Q5_K = 13,
    OJ_TYPE_Q6_K = 14,
    OJ_TYPE_BF16 = 30
} oj_type;

/* KV cache element type (oj_model_desc.kv_type; the main model and the MTP block alike).
   OJ_KV_F16: one fp16 per value. OJ_KV_Q8_0: ggml's q8_0 per 32 values of a head row (one fp16
   scale d = amax / 127 and 32 int8 q = roundf(x * (1 / d)), read back as q * d): 34 bytes per 32
   values, 53% of f16. oj_read_kv returns the dequantised floats either way. */
typedef enum oj_kv_type {
    OJ_KV_F16 = 0,
    OJ_KV_Q8_0 = 1
} oj_kv_type;

/* Where oj_mtp_eval takes the hidden state h for MTP position p. */
typedef enum oj_h_source {
    OJ_H_MAIN = 0,   /* the main model's final normed hidden state at position p - 1, from the
                        last oj_eval (or the position just before it); zeros for p = 0 */
    OJ_H_DRAFT = 1,  /* the MTP block's own normed output of the previous oj_mtp_eval (chained
                        drafts; n_tokens must be 1) */
    OJ_H_HOST = 2    /* h_host: n_tokens x n_embd floats given by the caller */
} oj_h_source;

/* qwen35 hyperparameters, named as openjet_plugin.config.ModelConfig names them. */
typedef struct oj_hparams {
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;          /* main layers; the MTP block is layer n_layer */
    int32_t n_ff;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_rot;
    int32_t rope_sections[4];
    float rope_freq_base;
    float rms_eps;
    int32_t ssm_conv_kernel;
    int32_t ssm_d_state;      /* key and value head dimension of the Gated DeltaNet */
    int32_t ssm_n_group;      /* key heads */
    int32_t ssm_dt_rank;      /* value heads */
    int32_t full_attention_interval;
    int32_t n_layer_nextn;    /* 0 or 1 */
} oj_hparams;

/* One GGUF tensor: name, type, ggml-order shape (ne[0] = input dimension) and its raw bytes. */
typedef struct oj_tensor {
    const char *name;
    int32_t type;             /* oj_type */
    int32_t n_dims;
    int64_t ne[4];
    const void *data;
    uint64_t n_bytes;
} oj_tensor;

typedef struct oj_model_desc {
    oj_hparams hparams;
    const oj_tensor *tensors;
    int32_t n_tensors;
    int32_t n_ctx;            /* KV cache length of the main model and of the MTP block */
    int32_t kv_type;          /* oj_kv_type */
    int32_t device;           /* CUDA device ordinal */
    int32_t n_checkpoints;    /* recurrent-state checkpoint slots (oj_checkpoint_save), 0..64 */
    int32_t prefill_chunk;    /* positions per oj_prefill pass, 0 (no oj_prefill) or 64..OJ_MAX_PREFILL_CHUNK:
                                 the prefill buffers (memory report `prefill`) scale with it */
    int32_t n_seq;            /* sequences held at once (oj_seq_select), 1..OJ_MAX_SEQUENCES (0 counts as 1):
                                 each its own n_ctx positions of KV cache (main and MTP), DeltaNet state,
                                 hidden window and n_past; kv_cache and recurrent_state scale with it */
} oj_model_desc;

/* Device memory the engine holds, by purpose (bytes). */
typedef struct oj_memory_report {
    uint64_t weights;
    uint64_t kv_cache;
    uint64_t recurrent_state;
    uint64_t activations;
    uint64_t checkpoints;
    uint64_t prefill;         /* activations of the batched prefill path (prefill_chunk positions) */
    uint64_t total;
} oj_memory_report;

typedef struct oj_engine oj_engine;

/* One phase of the main model's verify pass, summed over the passes since oj_profile (oj_profile_read). */
typedef struct oj_phase {
    char name[32];             /* "ffn gate+up", "attention core", ... (NUL-terminated) */
    int32_t calls;             /* times the phase ran (e.g. 64 per pass for an FFN phase of the 27B) */
    int32_t launches;          /* kernel launches in it */
    double ms;                 /* GPU time between the CUDA events at its start and at the next phase's */
    uint64_t bytes;            /* the fewest bytes it must move: weights, KV rows read, recurrent state
                                  read and written (activations not counted) */
} oj_phase;
enum { OJ_MAX_PHASES = 16 };

int32_t oj_abi_version(void);

/* The message of the last failure on `engine`, or of the last engine-less call on this thread
   when engine is NULL. Never NULL; "" when there was none. Valid until the next call. */
const char *oj_last_error(const oj_engine *engine);

/* Compute capability and memory of a device (for the backend's availability check). */
int32_t oj_device_info(int32_t device, int32_t *cc_major, int32_t *cc_minor,
                       uint64_t *free_bytes, uint64_t *total_bytes,
                       char *name, int32_t name_capacity);

int32_t oj_engine_create(const oj_model_desc *desc, oj_engine **out);
void oj_engine_free(oj_engine *engine);

int32_t oj_memory(const oj_engine *engine, oj_memory_report *out);
/* Per-phase profile of oj_verify / oj_eval / oj_cycle's main-model pass (issue 25): on 1 records a
   CUDA event at every phase boundary of each pass from now on (a few hundred per pass; the pass
   runs slightly slower) and the host time, 2 only the host time (no events: the pass as it runs
   unprofiled), 0 stops; each clears the totals. oj_profile_read copies up to capacity phases
   (OJ_MAX_PHASES hold all; their times are 0 under 2) in pass order, the number of passes, the
   GPU time from each pass's first event to its last (*span_ms; 0 under 2) and the host time from
   the pass's start to its last launch enqueued, before it waits for the GPU (*host_ms: where it
   nears the pass's wall time, the GPU waits on the host), each summed over the passes, then
   clears the totals. span_ms and host_ms may be NULL. */
int32_t oj_profile(oj_engine *engine, int32_t on);
int32_t oj_profile_read(oj_engine *engine, oj_phase *out, int32_t capacity, int32_t *n_phases, int32_t *passes,
                        double *span_ms, double *host_ms);
/* The main model's passes of oj_verify, oj_verify_tree, oj_eval and oj_cycle (ABI 14) replay CUDA
   graphs, one per shape (positions, ring slots, sequence, attention split bucket, chain or tree)
   captured at its first use (a chain's with its other sizes); a profiled pass (oj_profile 1) and
   oj_eval_seqs launch their kernels directly, as does every pass once captures failed 3 times in a
   row. oj_graph_stats: the passes replayed from a graph and launched directly since the engine was
   made, the graphs held, the captures made (new or updating a held graph) and the host time they
   took, ms (any pointer may be NULL). */
int32_t oj_graph_stats(const oj_engine *engine, int64_t *replayed, int64_t *direct, int32_t *held, int64_t *captures,
                       double *capture_ms);
/* Forget the conversation: n_past = 0, zero recurrent and conv state, empty KV caches; a prompt
   piece of it in flight (oj_prefill_layers) is dropped. */
int32_t oj_reset(oj_engine *engine);
int32_t oj_n_past(const oj_engine *engine, int32_t *out);

/* Main model: append tokens[0..n_tokens) at n_past (1 <= n_tokens <= OJ_MAX_POSITIONS). */
int32_t oj_eval(oj_engine *engine, const int32_t *tokens, int32_t n_tokens);
/* Prefill: append tokens[0..n_tokens) at n_past (any n_tokens >= 1 that fits n_ctx) and commit
   them, in passes of up to prefill_chunk positions through the batched kernels (quantised weights
   x many positions on the tensor cores, the DeltaNet recurrence over the pass, causal attention
   over the cache plus the pass). A pending verify counts as oj_commit(0) first. Afterwards:
   - the results read as after an oj_eval of the LAST token alone: oj_get_argmax(.., 1),
     oj_get_logits(0), oj_get_hidden(0) are the last position's; OJ_H_MAIN reaches the hidden
     states of the last two positions (as oj_mtp_eval's window after a one-token oj_eval);
   - when the model has an MTP block and its cache length was n_past on entry, the MTP cache holds
     every new position too (MTP position p from token p and the main hidden state of p - 1), so
     oj_mtp_n_past = the new n_past; otherwise the MTP cache is left as it was.
   Recurrent state, conv state and K/V equal those of evaluating the tokens one at a time up to
   the projections' arithmetic: the prefill projections round activations to fp16 under one
   power-of-two scale per position (Q4_K, Q6_K) or to int8 per 32 values (the other quantised
   types, as llama.cpp's q8_1 does). OJ_ERR_INVALID_ARGUMENT when the engine was
   created with prefill_chunk 0. */
int32_t oj_prefill(oj_engine *engine, const int32_t *tokens, int32_t n_tokens);
/* One prefill pass (a piece of 1..prefill_chunk tokens) over several calls, `layers` (>= 1) of the
   main model's layers a call, so that passes of other sequences (oj_eval_seqs) run in between: a
   piece in layers costs its decoders a share of it per pass instead of all of it (issue 29). The
   first call on the selected sequence starts the piece (the checks and effects of oj_prefill of
   those tokens); the next ones name the same tokens and go on. The call that runs the last layer
   finishes the piece as oj_prefill of those tokens does (the MTP block's pass, the hidden window,
   the logits), bit for bit: the same kernels in the same order. *done: 1 finished; 0 in flight
   (or refused with nothing changed); -1 failed on the way, the sequence reset (its state was part
   piece). While a piece is in flight it holds the prefill buffers: oj_prefill, another
   sequence's oj_prefill_layers and every call on its sequence (oj_eval_seqs naming it included)
   are refused by name, except oj_prefill_layers with its tokens and oj_reset, which drops it. */
int32_t oj_prefill_layers(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t layers, int32_t *done);
/* Evaluate tokens at n_past..n_past+n_tokens-1 provisionally (the results are read as after
   oj_eval); a verify not committed before the next evaluation counts as oj_commit(0). */
int32_t oj_verify(oj_engine *engine, const int32_t *tokens, int32_t n_tokens);
/* Keep the first n_accept (0..n_tokens) positions of the last oj_verify: n_past += n_accept.
   After oj_verify_tree, nodes 0..n_accept-1 must form a chain (else oj_commit_path). */
int32_t oj_commit(oj_engine *engine, int32_t n_accept);
/* Draft-tree verification (issue 28). Evaluate a tree of n_tokens (1..OJ_MAX_TREE_NODES) nodes
   provisionally, as oj_verify evaluates a chain: node 0 is the current token at n_past (parent[0]
   = -1), node i > 0 a child of parent[i] (0 <= parent[i] < i) at position n_past + depth(i). Node i
   sees what decoding its root-to-node path one token at a time would see: attention over the
   committed positions, its ancestors and itself (RoPE at n_past + depth(i)); the DeltaNet conv
   window and recurrence continue from its parent. Results (oj_get_argmax / logits / hidden) are
   read per node as after oj_verify; node i's K/V sit at cache row n_past + i until a commit.
   A chain (parent[i] = i - 1) runs exactly oj_verify. An uncommitted earlier verify is dropped. */
int32_t oj_verify_tree(oj_engine *engine, const int32_t *tokens, const int32_t *parent, int32_t n_tokens);
/* Keep one root-first path of the last oj_verify_tree (or oj_verify): path[0] = 0 and each
   path[i] a child of path[i - 1]; n_path 1..its node count. The path's nodes become positions
   n_past..n_past + n_path - 1 and n_past += n_path: recurrent state, conv state and K/V end as
   after evaluating the path's tokens one at a time (the DeltaNet intermediates and K/V rows of
   the path are moved to rows 0..n_path-1 and committed by replay, as oj_commit does). Afterwards
   oj_get_argmax / logits / hidden read the path's positions in path order (n_path of them), and
   OJ_H_MAIN reaches their hidden states, as after oj_verify of the path's tokens + oj_commit. */
int32_t oj_commit_path(oj_engine *engine, const int32_t *path, int32_t n_path);
/* One greedy speculative cycle (issue 8). tokens[0..n_tokens) are the current token and its
   n_tokens - 1 drafts, placed at n_past as oj_verify places them. The cycle accepts the leading
   drafts equal to the main model's argmax at the position before them, commits the current token
   and the accepted drafts (as oj_commit(1 + accepted)), and takes the main model's argmax after the
   last accepted position as the next token. With n_draft > 0 it then makes the MTP rows of the
   accepted drafts and of the next token (OJ_H_MAIN) and drafts n_draft tokens from the next token
   (chained on the MTP block's own output, the draft head's argmax; the draft vocabulary applies).
   Needs, for n_draft > 0, an MTP block whose rows reach the current token's position
   (oj_mtp_n_past > n_past on entry). Outputs: *n_accepted (0..n_tokens - 1); out_tokens[0..
   *n_accepted] the accepted drafts then the next token (room for n_tokens); out_drafts[0..n_draft)
   (may be NULL when n_draft is 0). Afterwards n_past grows by 1 + *n_accepted; oj_get_argmax /
   logits / hidden read the verify's positions; oj_mtp_n_past is the new n_past + 1 when n_draft > 0
   (the next token's row; the draft rows past it are provisional), else as before; the draft results
   (oj_get_draft_*) are not readable. */
int32_t oj_cycle(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t n_draft,
                 int32_t *n_accepted, int32_t *out_tokens, int32_t *out_drafts);
/* The sampled cycle (issue 28, ABI 13): oj_cycle for a request drawn at temperature > 0 with top-k
   on, every draw made on the GPU. A row's distribution is openjet_plugin.sampling's
   candidate_distribution: the top_k largest logits (ties: the smaller id), those within min_p of
   the largest (min_p 0: all), the shortest prefix whose temperature-1 mass over the pool reaches
   top_p (1: all), softmax(logit / temperature) over what is left. Drafts are drawn from the MTP head's
   row under the same settings (the draft vocabulary applies); the main model's row at each
   position accepts draft d with probability min(1, p(d) / q(d)), q the distribution d was drawn
   from, else draws from max(0, p - q) normalised and stops; after every draft accepted it draws the
   next token from the last row. The output follows the main model's distribution whatever the
   drafts are. Uniforms come from a counter-based stream of `sampling->seed` (one call, one seed).
   tokens[1..n_tokens) must be the leading drafts that the previous oj_cycle_sampled on this
   sequence returned with tokens[0] as its next token at this n_past (their distributions stay on
   the device until then, one use); with n_tokens 1 there are none. Outputs, bookkeeping and the
   MTP rows as oj_cycle's. Refused by name: settings out of range (temperature > 0 and finite,
   top_k 1..OJ_SAMPLE_TOP_MAX, top_p in (0, 1], min_p in [0, 1)), drafts that are not that call's,
   a row with no finite logit. */
enum { OJ_SAMPLE_TOP_MAX = 64 };
typedef struct oj_sampling {
    float temperature;
    int32_t top_k;
    float top_p;
    float min_p;
    uint64_t seed;
} oj_sampling;
int32_t oj_cycle_sampled(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t n_draft,
                         const oj_sampling *sampling, int32_t *n_accepted, int32_t *out_tokens, int32_t *out_drafts);
/* Sequences (issue 29): an engine holds n_seq conversations. Every call that evaluates, commits,
   drafts, checkpoints or reads state applies to the selected sequence (0 after creation), as if it
   were the engine's only one; oj_reset resets only it. oj_seq_select switches in constant time (no
   copy). The results of the last pass (oj_get_argmax / oj_get_logits rows, draft results) belong to
   the engine and stay readable across a select; oj_get_hidden reads the selected sequence's own
   window. Checkpoint slots are the engine's: a slot restored into a sequence gives it the saved
   recurrent state, hidden and n_past (the KV rows are that sequence's own). */
int32_t oj_seq_select(oj_engine *engine, int32_t seq);
int32_t oj_seq_selected(const oj_engine *engine, int32_t *out);
/* One pass for n_seqs (1..OJ_MAX_POSITIONS) different sequences, one token each: tokens[t] is
   appended at sequence seqs[t]'s n_past and committed, as oj_eval of that one token on it would
   (a pending verify counts as oj_commit(0)); the weights are read once for all of them, and each
   sequence's results and state are bit for bit those of its own one-token oj_eval. Afterwards
   oj_get_argmax(.., n_seqs) and oj_get_logits(t) read row t for seqs[t]; each sequence's hidden
   window and OJ_H_MAIN read as after its own oj_eval; MTP caches are left as they were. The
   selected sequence does not change. Checked before anything runs: ids in range and distinct,
   every sequence with room for one more position (else OJ_ERR_CONTEXT_FULL naming it). */
int32_t oj_eval_seqs(oj_engine *engine, const int32_t *seqs, const int32_t *tokens, int32_t n_seqs);

/* A copy of the selected sequence's whole state at its n_past, loadable into any sequence of an
   engine of the same model and KV type (the prefix cache: a system prompt or agent scaffold
   evaluated once, reused by later conversations): every DeltaNet layer's conv and ssm state, the
   hidden of position n_past - 1, the K/V rows [0, n_past) of every attention layer and the MTP
   block's rows [0, min(oj_mtp_n_past, n_past)). oj_seq_state_size: the bytes of that copy now.
   oj_seq_state_save starts writing it to host memory `out` (size bytes at least), after putting
   accepted positions into the state (a pending verify counts as oj_commit(0)). oj_seq_state_load
   starts replacing the selected sequence's state by a copy (its n_past and MTP rows become the
   copy's; a pending verify is dropped; the hidden window then holds only h of n_past - 1, as after
   a checkpoint restore). A buffer of another model or KV type, a size that is not the copy's, or
   more positions than n_ctx is refused by name, the sequence as it was.
   Both hand back *copy; oj_state_copy_wait carries it out and frees it. The bytes move on the
   engine's copy stream through pinned staging buffers (the host side in the calling thread), so
   passes of other sequences go on meanwhile: oj_state_copy_wait is the one call that may run while
   another thread calls into the same engine. Until it returns, the sequence is busy: calls that
   read or change it (oj_eval_seqs naming it included) are refused with OJ_ERR_INVALID_ARGUMENT,
   and `out` / `data` must stay allocated. Every copy must be waited for before oj_engine_free.
   A failed wait after a load leaves the sequence's state undefined: oj_reset it. Errors of the
   wait are oj_last_error(NULL)'s, of the calling thread. */
typedef struct oj_state_copy oj_state_copy;
int32_t oj_seq_state_size(oj_engine *engine, uint64_t *out);
int32_t oj_seq_state_save(oj_engine *engine, void *out, uint64_t size, oj_state_copy **copy);
int32_t oj_seq_state_load(oj_engine *engine, const void *data, uint64_t size, oj_state_copy **copy);
int32_t oj_state_copy_wait(oj_state_copy *copy);

/* Results of the last oj_eval: argmax per position, one position's logits or final hidden
   state (after output_norm). */
int32_t oj_get_argmax(oj_engine *engine, int32_t *out, int32_t n);
int32_t oj_get_logits(oj_engine *engine, int32_t index, float *out, int32_t n_vocab);
int32_t oj_get_hidden(oj_engine *engine, int32_t index, float *out, int32_t n_embd);

/* MTP block: token i at MTP position pos0 + i (pos0 <= the MTP cache length, which is cut to
   pos0 first); h from h_source (oj_h_source). Draft logits/argmax/hidden per position after. */
int32_t oj_mtp_eval(oj_engine *engine, const int32_t *tokens, int32_t n_tokens, int32_t pos0,
                    int32_t h_source, const float *h_host);
int32_t oj_mtp_n_past(const oj_engine *engine, int32_t *out);
/* Restrict the draft head to ids[0..n_ids) (n_ids = 0: the whole vocabulary again). Draft logits
   are then n_ids values in the order of ids; the draft argmax is a token id. */
int32_t oj_set_draft_vocab(oj_engine *engine, const int32_t *ids, int32_t n_ids);
int32_t oj_draft_vocab_size(const oj_engine *engine, int32_t *out);
int32_t oj_get_draft_argmax(oj_engine *engine, int32_t *out, int32_t n);
int32_t oj_get_draft_logits(oj_engine *engine, int32_t index, float *out, int32_t n);
int32_t oj_get_draft_hidden(oj_engine *engine, int32_t index, float *out, int32_t n_embd);

/* A greedy draft tree from the MTP head in one call (issue 28; speculative_tree.grow_tree's
   best-first rule): the root `root` at MTP position pos (its row from root_h, the main hidden of
   pos - 1, n_embd floats on the host); every node taken is expanded by one MTP step on its own
   branch (its ancestors' rows, each (token, the MTP hidden after its parent), at pos + 1..) into
   its max_children most probable tokens of the (restricted) head, slot j of node i scored
   score(i) x (accept_a[b] + accept_c[b] q_j), b the bin of q_j (the last b with edges[b] <= q_j),
   and slots are taken best score first (then shallower, then first pushed) until `budget` nodes
   or no slot is left; a node at max_depth or the last taken is not expanded. Out (budget entries):
   the nodes in the order taken (tokens, parent, the probability q their slot had, the score),
   *n_nodes, and *steps the MTP steps made. The MTP cache holds the root's row at pos after it
   (positions beyond are scratch), as after the same oj_mtp_eval calls. */
enum { OJ_TREE_MAX_BINS = 32, OJ_TREE_MAX_CHILDREN = 8 };
typedef struct oj_tree_request {
    int32_t root;
    int32_t pos;
    const float *root_h;
    int32_t budget;            /* 1..OJ_MAX_TREE_NODES nodes, the root included */
    int32_t max_children;      /* 1..OJ_TREE_MAX_CHILDREN */
    int32_t max_depth;         /* >= 0 */
    int32_t n_bins;            /* 1..OJ_TREE_MAX_BINS */
    const double *edges;       /* [n_bins] lower edges, ascending */
    const double *accept_a;    /* [n_bins] */
    const double *accept_c;    /* [n_bins] */
} oj_tree_request;
int32_t oj_draft_tree(oj_engine *engine, const oj_tree_request *request, int32_t *tokens, int32_t *parent,
                      double *prob, double *score, int32_t *n_nodes, int32_t *steps);

/* Checkpoints: the recurrent state (DeltaNet conv + ssm state) and the hidden state at n_past,
   copied on the device into slot `slot` (< n_checkpoints). Restoring returns the conversation to
   that n_past: K/V beyond it are ignored, the MTP cache is cut to it. A slot never saved gives
   OJ_ERR_INVALID_ARGUMENT. `n_past_out` (may be NULL) receives the restored n_past. */
int32_t oj_checkpoint_save(oj_engine *engine, int32_t slot);
int32_t oj_checkpoint_restore(oj_engine *engine, int32_t slot, int32_t *n_past_out);

/* State read-back for tests, in the numpy reference's layouts (openjet_plugin.testing.reference):
   conv state of DeltaNet layer `layer`: [conv_dim][kernel-1] (oldest input first);
   recurrent state: [n_v_heads][d_state (value j)][d_state (key i)];
   K or V (which = 0 / 1) of attention layer `layer` (n_layer = the MTP block) for positions
   [pos0, pos0 + n_pos): [n_pos][n_head_kv][head_dim], converted to float. `n` = floats in out. */
int32_t oj_read_conv_state(oj_engine *engine, int32_t layer, float *out, uint64_t n);
int32_t oj_read_ssm_state(oj_engine *engine, int32_t layer, float *out, uint64_t n);
int32_t oj_read_kv(oj_engine *engine, int32_t layer, int32_t which, int32_t pos0, int32_t n_pos,
                   float *out, uint64_t n);

/* Test hook: kind 1 launches a kernel that reads an invalid device address (the CUDA context is
   poisoned afterwards: only oj_engine_free works); kind 2 asks cudaMalloc for more memory than
   the device has (returns OJ_ERR_OUT_OF_MEMORY and the engine stays usable). */
int32_t oj_debug_fault(oj_engine *engine, int32_t kind);

#ifdef __cplusplus
}
#endif

#endif /* OPENJET_H */
