// llama_logits: llama.cpp's teacher-forced logits for every position of a token sequence.
//
// The reference side of the native-vs-llama.cpp agreement rows of `openjet bench`
// (openjet_plugin/bench/agreement.py): loads a GGUF through llama.cpp's C API with every layer
// offloaded (on a CUDA build) and flash attention on, prefills the first --depth tokens in
// batches of --prefill-batch positions without outputs, then decodes the rest in batches of -b
// positions with an output requested at every position, and writes their full fp32 logits rows,
// [n_pos - depth][n_vocab], little endian, to -o.
//
//   llama_logits -m MODEL.gguf -t TOKENS.i32 -o LOGITS.f32|- [-b 8] [--depth 0]
//                [--prefill-batch 512] [-c N_CTX] [-ngl 999] [-fa 1] [--threads N]
//                [--require-gpu] [-v]
//
// TOKENS.i32: int32 little-endian token ids, nothing else. -o -: the rows stream to stdout as they
// are made (a reader compares them chunk by chunk instead of holding 2,000 x 248K floats), after a
// 16-byte header of four little-endian int32: the magic 0x474c4a4f ("OJLG"), the rows to follow,
// n_vocab, the depth. The summary is one JSON line: the sizes, the timings (model load; prefill;
// decode including the logits copies, without the writes) and whether the build can offload to a
// GPU; on stdout after a file, as the last line of stderr after a stream. Every failure exits
// non-zero with a message on stderr naming the file or parameter; exit codes (also in --help):
//   1 usage, 2 token file, 3 model load, 4 context, 5 decode, 6 output file, 7 token id out of
//   range, 8 --require-gpu on a build without GPU offload.
//
// Built against llama.cpp's libllama by openjet_plugin.bench.peer.compile_llama_logits.

#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

enum exit_code {
    EXIT_USAGE = 1, EXIT_TOKENS = 2, EXIT_MODEL = 3, EXIT_CONTEXT = 4, EXIT_DECODE = 5,
    EXIT_OUTPUT = 6, EXIT_TOKEN_RANGE = 7, EXIT_NO_GPU = 8,
};

const char *USAGE =
    "usage: llama_logits -m MODEL.gguf -t TOKENS.i32 -o LOGITS.f32|- [-b N_BATCH (8)] [--depth N (0)]\n"
    "                    [--prefill-batch N (512)] [-c N_CTX] [-ngl N_GPU_LAYERS (999)] [-fa 0|1 (1)]\n"
    "                    [--threads N (4)] [--require-gpu] [-v]\n"
    "prefills the first --depth tokens, then writes [n_pos - depth][n_vocab] fp32 logits (-o -: to\n"
    "stdout after a 16-byte header: 'OJLG', rows, n_vocab, depth as int32); prints one JSON line\n"
    "(to stderr with -o -).\n"
    "exit codes: 1 usage, 2 token file, 3 model load, 4 context, 5 decode, 6 output file,\n"
    "            7 token id out of range, 8 --require-gpu without GPU offload\n";

struct options {
    std::string model, tokens, out;
    int n_batch = 8;
    int depth = 0;          // tokens prefilled before the first output row
    int prefill_batch = 512;
    int n_ctx = 0;          // 0: the positions rounded up to 256
    int n_gpu_layers = 999;
    bool flash_attn = true;
    int threads = 4;
    bool require_gpu = false;
    bool verbose = false;
};

// llama.cpp logs everything to stderr by default; keep warnings and errors unless -v.
struct log_state {
    bool verbose;
    ggml_log_level last;    // GGML_LOG_LEVEL_CONT continues the previous message
};

void log_filter(ggml_log_level level, const char *text, void *user) {
    auto *st = static_cast<log_state *>(user);
    if (level != GGML_LOG_LEVEL_CONT) st->last = level;
    if (st->verbose || st->last >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

bool parse_int(const char *s, int lo, int hi, int *out) {
    char *end = nullptr;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi) return false;
    *out = static_cast<int>(v);
    return true;
}

// Returns 0 and fills `o`, or an exit code after printing why.
int parse_args(int argc, char **argv, options *o) {
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto value = [&](const char *name) -> const char * {
            if (i + 1 >= argc) {
                fprintf(stderr, "llama_logits: %s needs a value\n%s", name, USAGE);
                return nullptr;
            }
            return argv[++i];
        };
        auto int_value = [&](const char *name, int lo, int hi, int *dst) -> bool {
            const char *v = value(name);
            if (!v) return false;
            if (!parse_int(v, lo, hi, dst)) {
                fprintf(stderr, "llama_logits: %s %s is not an integer in [%d, %d]\n", name, v, lo, hi);
                return false;
            }
            return true;
        };
        if (a == "-h" || a == "--help") {
            fputs(USAGE, stdout);
            exit(0);
        } else if (a == "-m" || a == "-t" || a == "-o") {
            const char *v = value(a.c_str());
            if (!v) return EXIT_USAGE;
            (a == "-m" ? o->model : a == "-t" ? o->tokens : o->out) = v;
        } else if (a == "-b") {
            if (!int_value("-b", 1, 1 << 16, &o->n_batch)) return EXIT_USAGE;
        } else if (a == "--depth") {
            if (!int_value("--depth", 0, 1 << 24, &o->depth)) return EXIT_USAGE;
        } else if (a == "--prefill-batch") {
            if (!int_value("--prefill-batch", 1, 1 << 16, &o->prefill_batch)) return EXIT_USAGE;
        } else if (a == "-c") {
            if (!int_value("-c", 1, 1 << 24, &o->n_ctx)) return EXIT_USAGE;
        } else if (a == "-ngl") {
            if (!int_value("-ngl", 0, 1 << 20, &o->n_gpu_layers)) return EXIT_USAGE;
        } else if (a == "-fa") {
            int fa = 1;
            if (!int_value("-fa", 0, 1, &fa)) return EXIT_USAGE;
            o->flash_attn = fa != 0;
        } else if (a == "--threads") {
            if (!int_value("--threads", 1, 1024, &o->threads)) return EXIT_USAGE;
        } else if (a == "--require-gpu") {
            o->require_gpu = true;
        } else if (a == "-v") {
            o->verbose = true;
        } else {
            fprintf(stderr, "llama_logits: unknown argument %s\n%s", a.c_str(), USAGE);
            return EXIT_USAGE;
        }
    }
    if (o->model.empty() || o->tokens.empty() || o->out.empty()) {
        fprintf(stderr, "llama_logits: -m, -t and -o are required\n%s", USAGE);
        return EXIT_USAGE;
    }
    return 0;
}

int read_tokens(const std::string &path, std::vector<llama_token> *out) {
    FILE *f = fopen(path.c_str(), "rb");
    if (!f) {
        fprintf(stderr, "llama_logits: cannot open token file %s: %s\n", path.c_str(), strerror(errno));
        return EXIT_TOKENS;
    }
    std::vector<char> bytes;
    char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
    bool err = ferror(f);
    fclose(f);
    if (err) {
        fprintf(stderr, "llama_logits: error reading token file %s\n", path.c_str());
        return EXIT_TOKENS;
    }
    if (bytes.empty() || bytes.size() % 4) {
        fprintf(stderr, "llama_logits: token file %s has %zu bytes; expected a positive multiple of 4 "
                        "(int32 little-endian ids)\n", path.c_str(), bytes.size());
        return EXIT_TOKENS;
    }
    out->resize(bytes.size() / 4);
    for (size_t i = 0; i < out->size(); ++i) {   // explicit little-endian decode
        const auto *b = reinterpret_cast<const unsigned char *>(&bytes[4 * i]);
        uint32_t v = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24;
        (*out)[i] = static_cast<llama_token>(static_cast<int32_t>(v));
    }
    return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Owns what llama.cpp hands out, so every early return frees it.
struct llama_session {
    llama_model *model = nullptr;
    llama_context *ctx = nullptr;
    llama_batch batch{};
    bool have_batch = false;
    FILE *out = nullptr;    // a file being written (not stdout)
    std::string tmp_path;

    ~llama_session() {
        if (out) {
            fclose(out);
            remove(tmp_path.c_str());   // an unfinished output never looks complete
        }
        if (have_batch) llama_batch_free(batch);
        if (ctx) llama_free(ctx);
        if (model) llama_model_free(model);
        llama_backend_free();
    }
};

// Decodes tokens[a, b) from position a, `step` positions per llama_decode, an output row at every
// position when `outputs`; with `rows`, each batch's rows are handed to it. Returns 0 or an exit code.
template <typename Rows>
int decode_span(llama_session &s, const std::vector<llama_token> &tokens, int a, int b, int step,
                bool outputs, const char *model_path, int n_vocab, std::vector<float> *buf, double *seconds,
                Rows rows) {
    for (int p = a; p < b; p += step) {
        const int n = std::min(step, b - p);
        s.batch.n_tokens = n;
        for (int i = 0; i < n; ++i) {
            s.batch.token[i] = tokens[p + i];
            s.batch.pos[i] = p + i;
            s.batch.n_seq_id[i] = 1;
            s.batch.seq_id[i][0] = 0;
            s.batch.logits[i] = outputs;   // teacher forcing: an output row at every position
        }
        auto td = std::chrono::steady_clock::now();
        const int32_t rc = llama_decode(s.ctx, s.batch);
        if (rc != 0) {
            fprintf(stderr, "llama_logits: llama_decode returned %d at positions [%d, %d) of %s\n", rc, p,
                    p + n, model_path);
            return EXIT_DECODE;
        }
        if (!outputs) {
            llama_synchronize(s.ctx);
            *seconds += seconds_since(td);
            continue;
        }
        buf->resize(static_cast<size_t>(n) * n_vocab);
        for (int i = 0; i < n; ++i) {
            const float *l = llama_get_logits_ith(s.ctx, i);   // synchronises with the device
            if (!l) {
                fprintf(stderr, "llama_logits: llama.cpp returned no logits for position %d\n", p + i);
                return EXIT_DECODE;
            }
            memcpy(&(*buf)[static_cast<size_t>(i) * n_vocab], l, sizeof(float) * n_vocab);
        }
        *seconds += seconds_since(td);
        if (int rc2 = rows(*buf)) return rc2;
    }
    return 0;
}

int run(const options &o) {
    std::vector<llama_token> tokens;
    if (int rc = read_tokens(o.tokens, &tokens)) return rc;
    const int n_pos = static_cast<int>(tokens.size());
    if (o.depth >= n_pos) {
        fprintf(stderr, "llama_logits: --depth %d leaves no position to output: %s holds %d tokens\n", o.depth,
                o.tokens.c_str(), n_pos);
        return EXIT_USAGE;
    }
    const bool stream = o.out == "-";
    // a stream owns the process's stdout: the rows go to a duplicate of it, and anything a library
    // prints to fd 1 lands on stderr instead of inside the rows
    FILE *data_out = stdout;
    if (stream) {
        fflush(stdout);
        const int fd = dup(1);
        data_out = fd >= 0 && dup2(2, 1) >= 0 ? fdopen(fd, "wb") : nullptr;
        if (!data_out) {
            fprintf(stderr, "llama_logits: cannot take over stdout for -o -: %s\n", strerror(errno));
            return EXIT_OUTPUT;
        }
    }

    static log_state logs;
    logs = {o.verbose, GGML_LOG_LEVEL_INFO};
    llama_log_set(log_filter, &logs);
    llama_backend_init();
    llama_session s;

    const bool gpu = llama_supports_gpu_offload();
    if (o.require_gpu && !gpu) {
        fprintf(stderr, "llama_logits: --require-gpu, but this libllama cannot offload to a GPU "
                        "(a CPU-only build?)\n");
        return EXIT_NO_GPU;
    }

    auto t0 = std::chrono::steady_clock::now();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = o.n_gpu_layers;
    s.model = llama_model_load_from_file(o.model.c_str(), mp);
    if (!s.model) {
        fprintf(stderr, "llama_logits: llama.cpp could not load the model %s (see its messages above)\n",
                o.model.c_str());
        return EXIT_MODEL;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(s.model));
    for (int i = 0; i < n_pos; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            fprintf(stderr, "llama_logits: token %d at position %d of %s is outside the vocabulary [0, %d)\n",
                    tokens[i], i, o.tokens.c_str(), n_vocab);
            return EXIT_TOKEN_RANGE;
        }
    }

    const int n_ctx = o.n_ctx > 0 ? o.n_ctx : (n_pos + 255) / 256 * 256;
    if (n_ctx < n_pos) {
        fprintf(stderr, "llama_logits: -c %d is smaller than the %d positions in %s\n", n_ctx, n_pos,
                o.tokens.c_str());
        return EXIT_USAGE;
    }
    // one llama_decode takes up to n_batch positions; the prefill's batches are the larger ones
    const int max_batch = o.depth > 0 ? std::max(o.n_batch, o.prefill_batch) : o.n_batch;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(n_ctx);
    cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(max_batch);
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = o.threads;
    cp.flash_attn_type = o.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    s.ctx = llama_init_from_model(s.model, cp);
    if (!s.ctx) {
        fprintf(stderr, "llama_logits: llama.cpp could not create a context (n_ctx %d, n_batch %d, "
                        "flash attention %s) for %s\n", n_ctx, max_batch, o.flash_attn ? "on" : "off",
                o.model.c_str());
        return EXIT_CONTEXT;
    }
    const double load_s = seconds_since(t0);

    FILE *dst = data_out;
    const char *dst_name = "stdout";
    if (!stream) {
        s.tmp_path = o.out + ".tmp";
        s.out = fopen(s.tmp_path.c_str(), "wb");
        if (!s.out) {
            fprintf(stderr, "llama_logits: cannot create %s: %s\n", s.tmp_path.c_str(), strerror(errno));
            return EXIT_OUTPUT;
        }
        dst = s.out;
        dst_name = s.tmp_path.c_str();
    }
    // the output is fp32 / int32 little endian; so is every machine this runs on (x86-64, aarch64)
    auto write_rows = [&](const std::vector<float> &rows) -> int {
        if (fwrite(rows.data(), sizeof(float), rows.size(), dst) != rows.size() || (stream && fflush(dst) != 0)) {
            fprintf(stderr, "llama_logits: writing %s failed: %s\n", dst_name, strerror(errno));
            return EXIT_OUTPUT;
        }
        return 0;
    };
    const int n_rows = n_pos - o.depth;
    if (stream) {
        const int32_t header[4] = {0x474c4a4f, n_rows, n_vocab, o.depth};
        if (fwrite(header, sizeof header, 1, dst) != 1) {
            fprintf(stderr, "llama_logits: writing stdout failed: %s\n", strerror(errno));
            return EXIT_OUTPUT;
        }
    }

    s.batch = llama_batch_init(max_batch, 0, 1);
    s.have_batch = true;
    std::vector<float> rows;
    double prefill_s = 0.0, decode_s = 0.0;
    if (int rc = decode_span(s, tokens, 0, o.depth, o.prefill_batch, false, o.model.c_str(), n_vocab, &rows,
                             &prefill_s, [](const std::vector<float> &) { return 0; })) {
        return rc;
    }
    if (int rc = decode_span(s, tokens, o.depth, n_pos, o.n_batch, true, o.model.c_str(), n_vocab, &rows,
                             &decode_s, write_rows)) {
        return rc;
    }
    FILE *summary = stdout;
    if (stream) {
        if (fclose(data_out) != 0) {
            fprintf(stderr, "llama_logits: writing stdout failed: %s\n", strerror(errno));
            return EXIT_OUTPUT;
        }
        summary = stderr;
    } else {
        FILE *f = s.out;
        s.out = nullptr;
        if (fclose(f) != 0 || rename(s.tmp_path.c_str(), o.out.c_str()) != 0) {
            fprintf(stderr, "llama_logits: finishing %s failed: %s\n", o.out.c_str(), strerror(errno));
            remove(s.tmp_path.c_str());
            return EXIT_OUTPUT;
        }
    }
    fprintf(summary, "{\"n_pos\": %d, \"depth\": %d, \"n_rows\": %d, \"n_vocab\": %d, \"n_batch\": %d, "
            "\"prefill_batch\": %d, \"n_ctx\": %d, \"n_gpu_layers\": %d, \"flash_attn\": %s, "
            "\"gpu_offload\": %s, \"load_s\": %.3f, \"prefill_s\": %.3f, \"decode_s\": %.3f}\n",
            n_pos, o.depth, n_rows, n_vocab, o.n_batch, o.prefill_batch, n_ctx, o.n_gpu_layers,
            o.flash_attn ? "true" : "false", gpu ? "true" : "false", load_s, prefill_s, decode_s);
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    options o;
    if (int rc = parse_args(argc, argv, &o)) return rc;
    try {
        return run(o);
    } catch (const std::exception &e) {   // e.g. std::bad_alloc for a huge token file
        fprintf(stderr, "llama_logits: %s\n", e.what());
        return EXIT_DECODE;
    }
}
