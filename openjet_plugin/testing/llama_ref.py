"""Run llama.cpp (llama-cpp-python, CPU) on a GGUF to get its logits, and compare them with ours.

llama.cpp is the numerical reference of this project; these helpers are what the agreement tests
(reference vs llama.cpp, native engine vs llama.cpp) stand on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _open(path: str | Path, **kwargs):
    import llama_cpp  # imported here: loading the shared library is slow and not always needed

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)


def llama_logits(path: str | Path, tokens, n_ctx: int | None = None, n_threads: int = 2,
                 **llama_kwargs) -> np.ndarray:
    """Teacher-forced logits `[n_tokens, n_vocab]` (float32) of llama.cpp on the CPU.

    `n_ctx` defaults to the number of tokens rounded up to 256. Extra keyword arguments go to
    `llama_cpp.Llama` (e.g. `type_k`, `type_v`, `flash_attn`, `n_batch`).
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("tokens is empty")
    if n_ctx is None:
        n_ctx = max(256, -(-len(tokens) // 256) * 256)
    if n_ctx < len(tokens):
        raise ValueError(f"n_ctx={n_ctx} is smaller than the {len(tokens)} tokens to evaluate")
    llm = _open(path, logits_all=True, n_ctx=n_ctx, n_threads=n_threads,
                n_threads_batch=n_threads, **llama_kwargs)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float32, copy=True)
    finally:
        llm.close()


def tokenize(path: str | Path, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
    """Token ids of `text` by the model's own llama.cpp tokenizer (vocab only, no weights)."""
    llm = _open(path, vocab_only=True)
    try:
        return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))
    finally:
        llm.close()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def agreement(ref_logits: np.ndarray, llama_logits: np.ndarray) -> dict:
    """Top-1 agreement and KL(llama.cpp || reference) per position, in float64.

    Returns dict(positions, top1 (fraction of positions with the same argmax), kl_mean, kl_max).
    """
    ref = np.asarray(ref_logits, dtype=np.float64)
    ll = np.asarray(llama_logits, dtype=np.float64)
    if ref.shape != ll.shape or ref.ndim != 2:
        raise ValueError(f"logits shapes differ or are not [n, vocab]: {ref.shape} vs {ll.shape}")
    lr, lq = log_softmax(ref), log_softmax(ll)
    kl = np.sum(np.exp(lq) * (lq - lr), axis=-1)
    return {
        "positions": int(ref.shape[0]),
        "top1": float(np.mean(np.argmax(ref, axis=-1) == np.argmax(ll, axis=-1))),
        "kl_mean": float(np.mean(kl)),
        "kl_max": float(np.max(kl)),
    }


class LlamaMTP:
    """llama.cpp's own MTP (nextn) drafting, driven through llama-cpp-python's low-level API.

    One model loaded with `load_mtp`, a target context that also returns the `h_nextn` hidden
    states (after output_norm) and an MTP context (`LLAMA_CONTEXT_TYPE_MTP`) fed with
    (token, hidden) pairs at chosen positions, as common/speculative.cpp's draft-mtp does.
    `llama_set_embeddings_nextn` / `llama_get_embeddings_nextn` live in llama.cpp's staging
    header (not wrapped by llama-cpp-python), so they are called by their C++ symbol names.

    `exact=True` keeps the KV caches in F32 and turns flash attention off, which takes llama.cpp's
    own rounding (F16 K/V) out of a comparison.
    """

    _SYMBOLS = {
        "set_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
        "get_nextn": "_Z26llama_get_embeddings_nextnP13llama_context",
    }

    def __init__(self, path: str | Path, n_ctx: int = 512, n_threads: int = 2, exact: bool = False,
                 verbose: bool = False):
        import ctypes

        from ..backends.llama_cpp import import_llama_cpp

        import_llama_cpp()
        from llama_cpp import llama_cpp as L
        from llama_cpp._logger import set_verbose

        set_verbose(verbose)   # what llama_cpp.Llama(verbose=...) does: llama.cpp's log level

        self._c, self._L = ctypes, L
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model file not found: {path}")
        lib = L._lib
        try:
            self._set_nextn = getattr(lib, self._SYMBOLS["set_nextn"])
            self._get_nextn = getattr(lib, self._SYMBOLS["get_nextn"])
        except AttributeError as e:
            raise RuntimeError(f"this libllama does not export llama.cpp's nextn staging API: {e}") from e
        self._set_nextn.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]
        self._set_nextn.restype = None
        self._get_nextn.argtypes = [ctypes.c_void_p]
        self._get_nextn.restype = ctypes.POINTER(ctypes.c_float)

        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.load_mtp = True
        self.model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path} with its MTP block")
        if L.llama_model_n_layer_nextn(self.model) < 1:
            raise ValueError(f"{path}: model has no MTP block (nextn_predict_layers = 0)")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_embd = L.llama_model_n_embd(self.model)
        self._ctx = {}
        self._batch = {}
        for kind, ctx_type, masked in (("main", L.LLAMA_CONTEXT_TYPE_DEFAULT, False),
                                       ("mtp", L.LLAMA_CONTEXT_TYPE_MTP, True)):
            cp = L.llama_context_default_params()
            cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
            cp.n_threads = cp.n_threads_batch = n_threads
            cp.ctx_type = ctx_type
            if exact:
                cp.type_k = cp.type_v = 0          # GGML_TYPE_F32
                cp.flash_attn_type = 0             # LLAMA_FLASH_ATTN_TYPE_DISABLED
            ctx = L.llama_init_from_model(self.model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create its {kind} context for {path}")
            self._set_nextn(ctx, True, masked)
            self._ctx[kind] = ctx
            self._batch[kind] = L.llama_batch_ext_init(ctx)

    def _run(self, kind: str, tokens, positions, hs=None):
        L, c = self._L, self._c
        b = self._batch[kind]
        L.llama_batch_ext_clear(b)
        keep = []
        for k, (tok, pos) in enumerate(zip(tokens, positions)):
            idx = L.llama_batch_ext_add_token(b, 0, int(tok))
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add_token failed ({idx}) at batch row {k}")
            p = c.c_int32(int(pos))
            L.llama_batch_ext_set_pos(b, idx, c.byref(p))
            if hs is not None:
                row = np.ascontiguousarray(hs[k], dtype=np.float32)
                keep.append(row)
                emb = L.llama_embd(row.ctypes.data_as(c.POINTER(c.c_float)), 1, self.n_embd)
                if not L.llama_batch_ext_set_embd_token(b, idx, emb):
                    raise RuntimeError(f"llama_batch_ext_set_embd_token failed at batch row {k}")
            L.llama_batch_ext_set_output_logits(b, idx, True)
        rc = L.llama_process(self._ctx[kind], L.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise RuntimeError(f"llama_process({kind}) returned {rc}")
        n = len(tokens)
        ctx = self._ctx[kind]
        logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                           for i in range(n)]).astype(np.float32)
        hidden = np.ctypeslib.as_array(self._get_nextn(ctx), shape=(n * self.n_embd,))
        return logits, hidden.reshape(n, self.n_embd).astype(np.float32)

    def eval(self, tokens, start: int = 0):
        """Main model on tokens at positions start.. -> (logits [n, vocab], hidden [n, n_embd])."""
        return self._run("main", tokens, range(start, start + len(tokens)))

    def mtp(self, tokens, hs, positions):
        """MTP block on (token, h) pairs at positions -> (logits [n, vocab], h_mtp [n, n_embd])."""
        if len(tokens) != len(hs) or len(tokens) != len(positions):
            raise ValueError("tokens, hs and positions must have the same length")
        return self._run("mtp", tokens, positions, hs)

    def close(self) -> None:
        L = self._L
        for kind in list(self._ctx):
            L.llama_batch_ext_free(self._batch.pop(kind))
            L.llama_free(self._ctx.pop(kind))
        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def llama_tensors(path: str | Path, tokens, names, n_ctx: int | None = None, n_threads: int = 2,
                  verbose: bool = False) -> dict[str, np.ndarray]:
    """Intermediate F32 tensors of llama.cpp's graph on the CPU, by graph name, `[n_tokens, width]`.

    Names are llama.cpp's callback names: `model.input_embed`, `l_out-{il}`, `attn_norm-{il}`,
    `result_norm`, `result_output`, ... The tokens run as one batch at positions 0..n-1 with
    llama.cpp's default context settings (F16 KV cache, no flash attention), through the
    scheduler's eval callback (`cb_eval`), which sees each tensor right after it is computed.
    """
    import ctypes

    from ..backends.llama_cpp import import_llama_cpp

    import_llama_cpp()
    from llama_cpp import llama_cpp as L
    from llama_cpp._logger import set_verbose

    set_verbose(verbose)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    tokens = [int(t) for t in tokens]
    wanted = set(names)
    got: dict[str, np.ndarray] = {}

    class _Tensor(ctypes.Structure):   # struct ggml_tensor (ggml.h), up to the name
        _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                    ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                    ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                    ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                    ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                    ("name", ctypes.c_char * 64)]

    def observe(ptr, ask, _user):
        t = _Tensor.from_address(ptr)
        name = t.name.decode(errors="replace")
        if ask:
            return name in wanted
        if name in wanted and t.type == 0:   # GGML_TYPE_F32, in host memory on the CPU backend
            ne, nb = list(t.ne), list(t.nb)
            span = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
            raw = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype=np.uint8)
            a = np.lib.stride_tricks.as_strided(raw.view(np.float32) if span % 4 == 0 else
                                                raw[:span - span % 4].view(np.float32),
                                                shape=ne[::-1], strides=nb[::-1])
            got[name] = np.array(a, dtype=np.float32).reshape(-1, ne[0])
        return True

    callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)(observe)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    if not model:
        raise ValueError(f"llama.cpp could not load {path}")
    ctx = batch = None
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx or max(256, -(-len(tokens) // 256) * 256)
        cp.n_batch = cp.n_ubatch = cp.n_ctx
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.flash_attn_type = 0                  # as llama_cpp.Llama's default
        cp.cb_eval = callback
        cp.cb_eval_user_data = None
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        batch = L.llama_batch_init(len(tokens), 0, 1)
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True
        batch.n_tokens = len(tokens)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
    finally:
        if batch is not None:
            L.llama_batch_free(batch)
        if ctx:
            L.llama_free(ctx)
        L.llama_model_free(model)
    missing = wanted - got.keys()
    if missing:
        raise KeyError(f"llama.cpp's graph for {path} has no F32 tensor named {sorted(missing)}")
    return got


def dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """Write `dst`: `src` with every tensor dequantised to F32 (same metadata, same values).

    llama.cpp's CPU backend rounds each matrix product's input to the weight's dot-product type
    (Q8_0 / Q8_K for quantised weights), and on random test models that rounding noise compounds
    through the layers (see tests/test_reference.py). Run on this twin, llama.cpp multiplies the
    very same weight values in F32, so a teacher-forced comparison sees the model's math alone.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    src, dst = Path(src), Path(dst)
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), GGUFValueType.ARRAY, field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape),
                                                       dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
