"""Several sequences in one native engine (issue 29): oj_seq_select and oj_eval_seqs.

Needs an NVIDIA GPU and a library with oj_eval_seqs (ABI 9); skips with the reason otherwise.
`scripts/gpu.sh check` runs it on the GPU machine; rows go to `$OPENJET_GPU_REPORT`. Generated
models (test_native_gpu.model_path), fresh random histories, host buffers NaN before every read:

(a) a pass of n sequences, one token each, gives every sequence the logits, argmax, hidden, conv /
    ssm state and K/V rows of its own one-token oj_eval on an engine of one sequence, bit for bit
    (f16 and q8_0 KV, the 27B's head shapes too), over many passes whose sequences, order and
    count change, with single-sequence evaluations (oj_eval chunks, oj_verify + oj_commit) of
    other sequences between them and each sequence at its own depth;
(b) bad requests (a sequence twice, one out of range, a full context, NULL) fail by name before
    anything runs, every sequence as it was;
(c) kv_cache and recurrent_state of the memory report grow n_seq times;
(d) a copy of a sequence's state (oj_seq_state_save) loaded into another sequence or another engine
    of the same model continues bit for bit as the original; bad copies are refused by name;
(e) a prompt piece put through its layers a few at a time (oj_prefill_layers), passes of other
    sequences between the calls, equals one oj_prefill of it bit for bit; while it is in flight the
    calls that would disturb it are refused by name, and oj_reset drops it.

Run on the device: python -m pytest -q -m gpu tests/test_native_seqs_gpu.py
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_native_spec_gpu as ts  # noqa: E402
from test_native_gpu import native_at_least, report  # noqa: E402

pytestmark = pytest.mark.gpu

SEQS_ABI = 11   # oj_eval_seqs came at 9, oj_seq_state_* at 10, as copies beside passes at 11
PASSES = 24


@pytest.fixture(scope="module")
def native():
    return native_at_least(SEQS_ABI, "oj_eval_seqs")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("seq_models")


class Raw:
    """The engine's C API on one handle, the sequence chosen explicitly (no backend bookkeeping)."""

    def __init__(self, be):
        self.be = be
        self.nl = be._nl
        self.ffi, self.lib = self.nl.ffi, self.nl.lib
        self.h = be._handle()
        self.c = be.config

    def ok(self, rc: int, what: str) -> None:
        from openjet_plugin import _native

        assert rc == 0, f"{what}: {_native.last_error(self.nl, self.h)}"

    def select(self, seq: int) -> None:
        self.ok(self.lib.oj_seq_select(self.h, seq), f"select {seq}")

    def eval(self, tokens: list[int]) -> None:
        buf = self.ffi.new("int32_t[]", tokens)
        self.ok(self.lib.oj_eval(self.h, buf, len(tokens)), "oj_eval")

    def verify_commit(self, tokens: list[int], keep: int) -> None:
        buf = self.ffi.new("int32_t[]", tokens)
        self.ok(self.lib.oj_verify(self.h, buf, len(tokens)), "oj_verify")
        self.ok(self.lib.oj_commit(self.h, keep), "oj_commit")

    def eval_seqs(self, seqs: list[int], tokens: list[int]) -> int:
        s = self.ffi.new("int32_t[]", seqs)
        t = self.ffi.new("int32_t[]", tokens)
        return int(self.lib.oj_eval_seqs(self.h, s, t, len(seqs)))

    def start_copy(self, save: bool, data: np.ndarray, n: int | None = None):
        """oj_seq_state_save / load of the selected sequence: (status, the copy to wait for)."""
        copy = self.ffi.new("oj_state_copy **")
        fn = self.lib.oj_seq_state_save if save else self.lib.oj_seq_state_load
        return int(fn(self.h, self.ffi.from_buffer("char[]", data), data.size if n is None else n, copy)), copy

    def wait_copy(self, copy) -> None:
        from openjet_plugin import _native

        rc = int(self.lib.oj_state_copy_wait(copy[0]))
        assert rc == 0, f"oj_state_copy_wait: {_native.last_error(self.nl)}"

    def copy_state(self, save: bool, data: np.ndarray) -> None:
        rc, copy = self.start_copy(save, data)
        self.ok(rc, "state save" if save else "state load")
        self.wait_copy(copy)

    def n_past(self) -> int:
        out = self.ffi.new("int32_t *")
        self.ok(self.lib.oj_n_past(self.h, out), "n_past")
        return int(out[0])

    def _floats(self, fn, shape, *args) -> np.ndarray:
        a = np.full(shape, np.nan, dtype=np.float32)
        self.ok(fn(self.h, *args, self.ffi.from_buffer("float[]", a, require_writable=True), a.size), "read")
        return a

    def logits(self, row: int) -> np.ndarray:
        a = np.full(self.c.n_vocab, np.nan, dtype=np.float32)
        self.ok(self.lib.oj_get_logits(self.h, row, self.ffi.from_buffer("float[]", a, require_writable=True), a.size),
                "logits")
        return a

    def argmax(self, n: int) -> list[int]:
        out = self.ffi.new("int32_t[]", n)
        self.ok(self.lib.oj_get_argmax(self.h, out, n), "argmax")
        return [int(x) for x in out]

    def hidden(self, row: int) -> np.ndarray:
        a = np.full(self.c.n_embd, np.nan, dtype=np.float32)
        self.ok(self.lib.oj_get_hidden(self.h, row, self.ffi.from_buffer("float[]", a, require_writable=True), a.size),
                "hidden")
        return a

    def state(self) -> dict[str, np.ndarray]:
        """The selected sequence's recurrent state and K/V rows [0, n_past)."""
        c, lib = self.c, self.lib
        out = {}
        for il in c.deltanet_layers():
            out[f"blk.{il}.conv"] = self._floats(lib.oj_read_conv_state, (c.ssm_conv_dim, c.ssm_conv_kernel - 1), il)
            out[f"blk.{il}.ssm"] = self._floats(lib.oj_read_ssm_state, (c.ssm_dt_rank, c.ssm_d_state, c.ssm_d_state), il)
        n = self.n_past()
        for il in c.attention_layers():
            for which, name in ((0, "k"), (1, "v")):
                out[f"blk.{il}.{name}"] = self._floats(lib.oj_read_kv, (n, c.n_head_kv, c.head_dim), il, which, 0, n)
        m = self.ffi.new("int32_t *")
        self.ok(lib.oj_mtp_n_past(self.h, m), "mtp n_past")
        if c.mtp_layer is not None and m[0] > 0:
            for which, name in ((0, "k"), (1, "v")):
                out[f"mtp.{name}"] = self._floats(lib.oj_read_kv, (int(m[0]), c.n_head_kv, c.head_dim), c.mtp_layer,
                                                  which, 0, int(m[0]))
        return out


def _backend(path: Path, n_seq: int, n_ctx: int, kv_type: str):
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    mf = open_model(path)
    kw = {"n_seq": n_seq} if n_seq > 1 else {}
    # prefill_chunk 0: every prompt through oj_eval, as the one-sequence reference evaluates it
    return mf, NativeBackend(mf, n_ctx=n_ctx, kv_type=kv_type, draft_depth=0, prefill_chunk=0, **kw)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name,kv_type,n_seq", [("tiny-F32", "f16", 4), ("tiny-Q4_K_M", "q8_0", 8),
                                                ("w256-Q4_K_M", "f16", 3), ("small-Q4_K_M", "f16", 5)])
def test_eval_seqs_is_each_sequences_own_eval(native, workdir, name, kv_type, n_seq):
    path = ts._model(name, workdir)
    rng = np.random.default_rng(abs(hash((name, kv_type, n_seq))) % 2**32)
    mf, be = _backend(path, n_seq, 512, kv_type)
    rmf, ref = _backend(path, 1, 512, kv_type)
    try:
        multi, one = Raw(be), Raw(ref)
        V = be.n_vocab
        # every sequence's history as a list of steps: ("eval", tokens) | ("verify", tokens, keep) |
        # ("seqs", token, pass index, row); replayed on the one-sequence engine at the end
        history: list[list[tuple]] = [[] for _ in range(n_seq)]
        got_logits: dict[tuple[int, int], np.ndarray] = {}
        got_argmax: dict[tuple[int, int], int] = {}
        got_hidden: dict[tuple[int, int], np.ndarray] = {}
        for q in range(n_seq):   # prompts of different lengths: each sequence at its own depth
            multi.select(q)
            toks = rng.integers(0, V, int(rng.integers(1, 40))).tolist()
            for a in range(0, len(toks), 8):
                multi.eval(toks[a:a + 8])
                history[q].append(("eval", toks[a:a + 8]))
        for p in range(PASSES):
            k = int(rng.integers(1, n_seq + 1))
            seqs = rng.permutation(n_seq)[:k].tolist()
            toks = rng.integers(0, V, k).tolist()
            multi.ok(multi.eval_seqs(seqs, toks), f"oj_eval_seqs {seqs}")
            am = multi.argmax(k)
            for t, q in enumerate(seqs):
                got_logits[(q, p)] = multi.logits(t)
                got_argmax[(q, p)] = am[t]
                history[q].append(("seqs", toks[t], p))
            for q in seqs:   # each window as after its own one-token oj_eval (the select keeps results)
                multi.select(q)
                got_hidden[(q, p)] = multi.hidden(0)
            if p % 3 == 1:   # a single-sequence evaluation of another sequence between passes
                q = int(rng.integers(0, n_seq))
                multi.select(q)
                toks = rng.integers(0, V, int(rng.integers(1, 9))).tolist()
                if p % 2:
                    multi.eval(toks)
                    history[q].append(("eval", toks))
                else:
                    keep = int(rng.integers(0, len(toks) + 1))
                    multi.verify_commit(toks, keep)
                    history[q].append(("verify", toks, keep))
        passes = sum(1 for h in history for s in h if s[0] == "seqs")
        bad: list[str] = []
        for q in range(n_seq):
            ref.reset()
            for step in history[q]:
                if step[0] == "eval":
                    one.eval(step[1])
                elif step[0] == "verify":
                    one.verify_commit(step[1], step[2])
                else:
                    _, tok, p = step
                    one.eval([tok])
                    if not _same(one.logits(0), got_logits[(q, p)]):
                        bad.append(f"seq {q} pass {p}: logits")
                    if one.argmax(1)[0] != got_argmax[(q, p)]:
                        bad.append(f"seq {q} pass {p}: argmax")
                    if not _same(one.hidden(0), got_hidden[(q, p)]):
                        bad.append(f"seq {q} pass {p}: hidden")
            multi.select(q)
            assert multi.n_past() == one.n_past()
            mine, theirs = multi.state(), one.state()
            bad += [f"seq {q}: {key}" for key in theirs if not _same(mine[key], theirs[key])]
        report({"test": "eval_seqs_bit_identical", "model": name, "kv_type": kv_type, "n_seq": n_seq,
                "positions": passes, "mismatches": len(bad)})
        assert not bad, f"{len(bad)} of {passes} positions / states differ from one-sequence evals: {bad[:8]}"
    finally:
        for b, m in ((be, mf), (ref, rmf)):
            b.close()
            m.close()


def test_eval_seqs_bad_requests_fail_by_name(native, workdir):
    path = ts._model("tiny-F32", workdir)
    mf, be = _backend(path, 3, 32, "f16")
    try:
        r = Raw(be)
        lib = r.lib
        for q in range(3):
            r.select(q)
            r.eval(list(range(1, 1 + 8 * (q + 1)))[:8])
        r.select(2)
        r.eval(list(range(20, 28)) * 1)
        r.eval(list(range(30, 38)))
        r.eval(list(range(40, 47)))   # sequence 2: 31 of 32 positions
        r.eval([5])                   # full
        before = []
        for q in range(3):
            r.select(q)
            before.append((r.n_past(), r.state()))
        r.select(1)

        def err() -> str:
            return r.ffi.string(lib.oj_last_error(r.h)).decode()

        assert r.eval_seqs([0, 0], [1, 2]) != 0 and "appears twice" in err()
        assert r.eval_seqs([0, 3], [1, 2]) != 0 and "sequence 3" in err() and "does not exist" in err()
        assert r.eval_seqs([0, 2], [1, 2]) != 0 and "sequence 2" in err() and "no room" in err()
        assert r.eval_seqs([0], [be.n_vocab]) != 0 and "outside the vocabulary" in err()
        assert lib.oj_eval_seqs(r.h, r.ffi.NULL, r.ffi.new("int32_t[]", [1]), 1) != 0 and "seqs is NULL" in err()
        assert r.eval_seqs([], []) != 0
        assert lib.oj_seq_select(r.h, 3) != 0 and "does not exist" in err()
        assert lib.oj_seq_select(r.h, -1) != 0
        out = r.ffi.new("int32_t *")
        assert lib.oj_seq_selected(r.h, out) == 0 and out[0] == 1   # nothing moved the selection
        for q in range(3):
            r.select(q)
            n, st = before[q]
            assert r.n_past() == n
            now = r.state()
            assert all(_same(now[k], st[k]) for k in st), f"sequence {q} changed by a refused call"
        # and the engine still works: a pass of the two with room
        assert r.eval_seqs([1, 0], [7, 9]) == 0
        r.select(0)
        assert r.n_past() == before[0][0] + 1
    finally:
        be.close()
        mf.close()


def test_memory_grows_with_sequences(native, workdir):
    path = ts._model("tiny-Q4_K_M", workdir)
    mf1, one = _backend(path, 1, 256, "f16")
    mf4, four = _backend(path, 4, 256, "f16")
    try:
        m1, m4 = one.memory(), four.memory()
        assert m4["kv_cache"] == 4 * m1["kv_cache"]
        assert m4["recurrent_state"] == 4 * m1["recurrent_state"]
        assert m4["weights"] == m1["weights"]
        report({"test": "seqs_memory", "kv_1": m1["kv_cache"], "kv_4": m4["kv_cache"],
                "recurrent_1": m1["recurrent_state"], "recurrent_4": m4["recurrent_state"]})
    finally:
        for b, m in ((one, mf1), (four, mf4)):
            b.close()
            m.close()


@pytest.mark.parametrize("name,kv_type", [("tiny-Q4_K_M", "f16"), ("w256-Q4_K_M", "q8_0")])
def test_a_sequence_state_copy_continues_bit_for_bit_in_any_sequence(native, workdir, name, kv_type):
    """(d) oj_seq_state_save at p (with a replay pending and a verify uncommitted), loaded into
    another sequence of the engine and into another engine of the same model: the state and every
    later result equal the original sequence's, bit for bit; bad copies are refused by name."""
    path = ts._model(name, workdir)
    rng = np.random.default_rng()
    mf, be = _backend(path, 3, 256, kv_type)
    omf, other = _backend(path, 1, 256, kv_type)
    xmf, wrong_kv = _backend(path, 1, 256, "q8_0" if kv_type == "f16" else "f16")
    try:
        r, o, w = Raw(be), Raw(other), Raw(wrong_kv)
        V = be.n_vocab
        r.select(0)
        first = rng.integers(0, V, 8).tolist()
        r.eval(first)
        if be.has_mtp:   # MTP rows of positions 0..7 from the main hiddens: the copy carries them
            r.ok(r.lib.oj_mtp_eval(r.h, r.ffi.new("int32_t[]", first), 8, 0, 0, r.ffi.NULL), "mtp rows")
        for _ in range(4):
            r.eval(rng.integers(0, V, 8).tolist())
        r.verify_commit(rng.integers(0, V, 5).tolist(), 3)   # accepted positions waiting for their replay
        buf = r.ffi.new("int32_t[]", rng.integers(0, V, 4).tolist())
        r.ok(r.lib.oj_verify(r.h, buf, 4), "a verify left uncommitted")
        size = r.ffi.new("uint64_t *")
        r.ok(r.lib.oj_seq_state_size(r.h, size), "state size")
        data = np.full(int(size[0]), 0xAB, dtype=np.uint8)
        small, _ = r.start_copy(True, data, data.size - 1)
        assert small != 0 and "needs" in r.ffi.string(r.lib.oj_last_error(r.h)).decode()
        # no copy object to hand back, no copy to wait for: refused by name
        assert r.lib.oj_seq_state_save(r.h, r.ffi.from_buffer("char[]", data), data.size, r.ffi.NULL) != 0
        assert "copy is NULL" in r.ffi.string(r.lib.oj_last_error(r.ffi.NULL)).decode()
        assert r.lib.oj_state_copy_wait(r.ffi.NULL) != 0
        assert "copy is NULL" in r.ffi.string(r.lib.oj_last_error(r.ffi.NULL)).decode()
        # the save waited for on another thread while sequence 1 is served beside it (the one
        # call that runs beside others); sequence 0 is refused until the wait returns
        rc, copy = r.start_copy(True, data)
        r.ok(rc, "state save")
        refused = r.lib.oj_eval(r.h, r.ffi.new("int32_t[]", [1]), 1)
        assert refused != 0 and "state copy in progress" in r.ffi.string(r.lib.oj_last_error(r.h)).decode()
        assert r.eval_seqs([1, 0], [2, 3]) != 0                # naming it in a pass is refused too
        waiter = threading.Thread(target=r.wait_copy, args=(copy,))
        waiter.start()
        r.select(1)
        for _ in range(4):
            r.eval(rng.integers(0, V, 8).tolist())
        waiter.join()
        r.select(0)
        saved_n = r.n_past()
        original = r.state()
        r.select(2)
        r.eval(rng.integers(0, V, 6).tolist())               # sequence 2 held something else
        r.copy_state(False, data)
        o.copy_state(False, data)
        assert r.n_past() == o.n_past() == saved_n
        bad = []
        for who, raw in (("sequence 2", r), ("another engine", o)):
            got = raw.state()
            bad += [f"{who}: {k}" for k in original if not _same(got[k], original[k])]
        # the three continue with the same tokens: the same results
        for _ in range(6):
            toks = rng.integers(0, V, int(rng.integers(1, 9))).tolist()
            rows = []
            for raw, seq in ((r, 0), (r, 2), (o, 0)):
                raw.select(seq)
                raw.eval(toks)
                rows.append([raw.logits(i) for i in range(len(toks))])
            bad += [f"continuation row {i}" for i in range(len(toks))
                    if not (_same(rows[0][i], rows[1][i]) and _same(rows[0][i], rows[2][i]))]
        # refused copies: another KV type, a truncated or damaged buffer; the sequence stays
        w.eval([1, 2, 3])
        for label, (raw, blob, n) in {"other kv type": (w, data, data.size), "truncated": (r, data, data.size - 8),
                                      "damaged": (r, np.zeros_like(data), data.size)}.items():
            raw.select(1 if raw is r else 0)
            before = raw.n_past()
            rc, _ = raw.start_copy(False, blob, n)
            msg = raw.ffi.string(raw.lib.oj_last_error(raw.h)).decode()
            assert rc != 0 and "oj_seq_state_load" in msg, (label, msg)
            assert raw.n_past() == before, label
        assert not be.has_mtp or "mtp.k" in original
        report({"test": "seq_state_copy", "model": name, "kv_type": kv_type, "bytes": int(size[0]),
                "n_past": saved_n, "mtp_rows": int(original["mtp.k"].shape[0]) if "mtp.k" in original else 0,
                "mismatches": len(bad)})
        assert not bad, bad[:8]
    finally:
        for b, m in ((be, mf), (other, omf), (wrong_kv, xmf)):
            b.close()
            m.close()


PIECE_ABI = 12   # oj_prefill_layers


def _last_error(r: Raw) -> str:
    return r.ffi.string(r.lib.oj_last_error(r.h)).decode()


@pytest.mark.parametrize("name,layers", [("tiny-Q4_K_M", 1), ("w256-Q4_K_M", 3)])
def test_a_piece_in_layers_equals_the_piece_whole(native, workdir, name, layers):
    """(e) A piece of 100 tokens (a DeltaNet chunk boundary inside) on sequence 1 after a prefix,
    `layers` layers a call, with oj_eval_seqs passes of sequences 0 and 2 between the calls: then
    sequence 1's logits, argmax, hidden window, conv / ssm state, K/V rows and MTP rows are those of
    one oj_prefill of the piece on an engine of one sequence, bit for bit, and sequences 0 and 2
    hold what their own evaluations give. While the piece is in flight, oj_eval on its sequence,
    oj_eval_seqs naming it, oj_prefill and oj_prefill_layers of another sequence, and other tokens
    for the piece are refused by name with nothing changed; oj_reset drops a piece."""
    from openjet_plugin.backends.native import NativeBackend
    from openjet_plugin.model_file import open_model

    native_at_least(PIECE_ABI, "oj_prefill_layers")
    path = ts._model(name, workdir)
    rng = np.random.default_rng()
    mf = open_model(path)
    be = NativeBackend(mf, n_ctx=512, draft_depth=0, prefill_chunk=256, n_seq=3)
    one = NativeBackend(mf, n_ctx=512, draft_depth=0, prefill_chunk=256)
    try:
        r, o = Raw(be), Raw(one)
        V, n_layer = be.n_vocab, be.config.n_layer
        ffi, lib = r.ffi, r.lib

        def prefill(raw: Raw, toks: list[int]) -> None:
            raw.ok(raw.lib.oj_prefill(raw.h, raw.ffi.new("int32_t[]", toks), len(toks)), "oj_prefill")

        prefix, piece = rng.integers(0, V, 30).tolist(), rng.integers(0, V, 100).tolist()
        others = {0: rng.integers(0, V, 70).tolist(), 2: rng.integers(0, V, 9).tolist()}
        for seq in (0, 2):
            r.select(seq)
            prefill(r, others[seq])
        r.select(1)
        prefill(r, prefix)
        buf = ffi.new("int32_t[]", piece)
        done = ffi.new("int32_t *")
        # bad arguments are refused by name before anything runs (the piece below is then the
        # first one the engine sees)
        bad = [(lambda: lib.oj_prefill_layers(r.h, buf, len(piece), 0, done), "layers is 0"),
               (lambda: lib.oj_prefill_layers(r.h, buf, len(piece), layers, ffi.NULL), "done is NULL"),
               (lambda: lib.oj_prefill_layers(r.h, ffi.new("int32_t[]", 300), 300, layers, done),
                "at most prefill_chunk (256)")]
        for call, needle in bad:
            assert call() != 0 and needle in _last_error(r), (needle, _last_error(r))
        calls, steps = 0, {0: [], 2: []}
        while True:
            r.select(1)
            r.ok(lib.oj_prefill_layers(r.h, buf, len(piece), layers, done), "oj_prefill_layers")
            calls += 1
            if done[0] == 1:
                break
            assert done[0] == 0
            if calls == 1:   # in flight: what would disturb it is refused, nothing changed
                refused = [("oj_eval", lambda: lib.oj_eval(r.h, ffi.new("int32_t[]", [1]), 1), "prompt piece in flight"),
                           ("other tokens", lambda: lib.oj_prefill_layers(r.h, ffi.new("int32_t[]", piece[::-1]),
                                                                          len(piece), layers, done), "same tokens"),
                           ("oj_eval_seqs", lambda: r.eval_seqs([0, 1], [1, 2]), "prompt piece in flight")]
                for what, call, needle in refused:
                    rc = call()
                    assert rc != 0 and needle in _last_error(r), (what, _last_error(r))
                    assert done[0] == 0
                r.select(0)
                rc = lib.oj_prefill(r.h, ffi.new("int32_t[]", [1, 2]), 2)
                assert rc != 0 and "prompt piece in flight" in _last_error(r)
                rc = lib.oj_prefill_layers(r.h, ffi.new("int32_t[]", [1, 2]), 2, 1, done)
                assert rc != 0 and "holds the prefill buffers" in _last_error(r) and done[0] == 0
            t = rng.integers(0, V, 2).tolist()
            assert r.eval_seqs([0, 2], t) == 0, _last_error(r)
            steps[0].append(t[0])
            steps[2].append(t[1])
        assert calls == -(-n_layer // layers)
        prefill(o, prefix)
        prefill(o, piece)
        r.select(1)
        assert _same(r.logits(0), o.logits(0)) and r.argmax(1) == o.argmax(1)
        assert _same(r.hidden(0), o.hidden(0))
        got, want = r.state(), o.state()
        assert got.keys() == want.keys()
        bad = [k for k in want if not _same(got[k], want[k])]
        report({"test": "seqs_piece_in_layers", "model": name, "layers_per_call": layers, "calls": calls,
                "piece": len(piece), "tensors_compared": len(want), "differing": bad})
        assert not bad
        # the others: their prompt through oj_prefill, then one token a pass, as oj_eval of each
        for seq in (0, 2):
            o.ok(lib.oj_reset(o.h), "reset")
            prefill(o, others[seq])
            for t in steps[seq]:
                o.eval([t])
            r.select(seq)
            got, want = r.state(), o.state()
            assert [k for k in want if not _same(got[k], want[k])] == [] and _same(r.hidden(0), o.hidden(0))
        # oj_reset drops a piece in flight: the buffers are free, the sequence empty
        r.select(1)
        r.ok(lib.oj_prefill_layers(r.h, buf, len(piece), 1, done), "a piece begun")
        assert done[0] == 0
        r.ok(lib.oj_reset(r.h), "oj_reset")
        assert r.n_past() == 0
        r.select(0)
        prefill(r, [1, 2, 3])
    finally:
        be.close()
        one.close()
