"""Several conversations at once: the "concurrent" rows of `openjet bench` (issue 29), measured the
same way on our engine (a child process: `python -m openjet_plugin.bench.concurrent`) and on
llama.cpp's own server (`llama-server -np 8` on the same file, driven by the parent through
bench/peer_spec.py's LlamaServer).

- concurrent_tps (streams S, drafts 0): S greedy requests started at once, each N new tokens from
  its own prompt; one sample = all generated tokens / the wall time from the first request to the
  last token. Streams 1, 2, 4, 8 (--quick: 1 and 8); streams 1 is the single-stream rate the
  others are compared with. Ours: `load(n_slots=S, draft_depth=0)` through the Engine, one thread
  per request (as `openjet serve` runs them); llama.cpp: S concurrent POST /completion on one
  server of 8 slots.
- concurrent_tps (streams 8, drafts D): the same with MTP speculation at draft depth D. Ours loads
  the engine with draft_depth D and 8 slots; where the engine refuses that, or its backend does not
  speculate, the row is not measured and says why.
- concurrent_itl_p99_ms (streams 7, prompt_tokens L): 7 streams decode, N_lat tokens each
  (L = 0); with L > 0, once every stream has N_lat / 4 tokens, a prompt of L tokens arrives (a
  request of one new token), and the streams are long enough to decode past its return (no
  request is cut short: measure_latency sizes them from the prompt's time in a warm-up round; the
  details say whether every run's streams outlasted the prompt). One sample = the 99th percentile
  (nearest rank) of the 7 streams' inter-token gaps in one run.

Prompts are token ids from the sequence both engines' speculative rows start from
(bench/spec.py prompt_tokens): stream i reads tokens [i P, (i + 1) P), the long prompts the
L-token pieces after the streams' (a new one for every request of one, so no engine reuses a
previous one). Greedy (temperature 0), so that every request runs its N tokens: llama-server with
ignore_eos; ours with a logit bias of -inf on the end-of-generation tokens only where one of the
first requests alone ends early (details: eog_banned). Such a ban keeps the argmax on the GPU
(a step's logits row is copied off only where its argmax is a banned id; on shared passes the
greedy chains go on), not the fused speculative cycle.

Identical output: before the timed rounds each prompt runs alone (one request at a time; these
runs are the warm-up too), and every stream of every round must produce exactly those tokens; the
reference is the first engine loaded (the fewest slots), the same server for llama.cpp. A row's
details count the streams that differ.

Inter-token gaps come from the times tokens reach the caller: ours, the Engine's stream chunks;
llama.cpp, its server-sent events (stream on). A chunk or event may carry several tokens (a token
that ends inside a UTF-8 character is held back until the character is complete; llama-server then
sends no event for it): its gap is shared evenly among them, and the details count such tokens
(`tokens_sharing_a_gap`). The concurrent_tps rows of llama.cpp use plain requests (stream off,
because only those return every token id): their per-stream latency is llama.cpp's own
predicted_ms / (predicted_n - 1).

What the engine does now is what is measured: every row's details name the backend and the
sequences it served at once (`sequences`, its slots: an engine of fewer than the streams runs them
partly one after another), and where the backend counts its shared passes (llama.cpp's and the
native engine's multi-sequence schedulers, backends/passes.py) the most sequences one pass served
(`max_sequences_in_a_pass`), the passes that served several (`shared_passes`) and the median
decode-only pass by its sequences (`decode_pass_ms`: what a pass of k sequences costs as the
scheduler runs it, beside verify_ms at k positions), over the engine's life (the requests alone
included); the latency rows need streams + 1 sequences and are
not measured with fewer. The native engine holds up to 8 sequences and speculates only for a
request served alone (no verify pass over several sequences' drafts): its speculative row says so
instead of a number.

Child output: JSON lines as bench/ours.py's ({"metric"...}, {"skip"...}, {"info"...},
{"error"...}); each row's details go to info "spec_details" keyed by the row.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .peer import PeerError

TAIL_TOKENS = 16              # tokens each latency stream decodes after the long prompt's request returns
LEAD_SHARE = 4                # the long prompt arrives when every stream has N_lat / LEAD_SHARE tokens
# sizing the warm-up: the prompt among the streams takes up to this times its time alone (the pass
# budget holds its chunks to what keeps the streams' passes within 2x: 3-5x alone on a 2-core CPU)
PROMPT_SLOWDOWN = 6
# sizing the timed rounds: the tokens a stream decoded while the warm-up's prompt ran, times this
# (the prompt's time among the streams varies from round to round as the budget adapts)
DURING_MARGIN = 2.0
LATENCY_ROOM = 16             # a latency stream runs at most this times N_lat tokens (its slot's context)
# timed rounds whose streams ended before the prompt returned (a loaded host: the prompt's time
# among the streams varies more than DURING_MARGIN) are run again, longer, on spare long prompts
# (a new one each: the prefix cache would serve a repeated one)
LATENCY_RETRIES = 2
ITL_PERCENTILE = 99.0


# --- row parameters (the runner plans with these, both engines use them) ---------------------------------

def tps_params(streams: int, drafts: int = 0) -> dict:
    return {"streams": int(streams), "drafts": int(drafts)}


def itl_params(streams: int, prompt_tokens: int) -> dict:
    return {"streams": int(streams), "prompt_tokens": int(prompt_tokens)}


@dataclass(frozen=True)
class Plan:
    """What one engine measures (runner.Settings gives both engines the same)."""
    streams: tuple[int, ...]          # concurrent_tps rows, drafts 0
    tokens: int                       # N new tokens per request
    prompt_tokens: int                # P tokens of each stream's prompt
    reps: int
    spec_streams: int = 8             # concurrent_tps with speculation: streams, drafts D
    drafts: int = 3
    latency_streams: int = 7
    latency_prompt: int = 12288       # L of the latency row with the prompt
    latency_tokens: int = 128         # N_lat

    def rows(self) -> list[tuple[str, dict]]:
        return ([("concurrent_tps", tps_params(s)) for s in self.streams]
                + [("concurrent_tps", tps_params(self.spec_streams, self.drafts))]
                + [("concurrent_itl_p99_ms", itl_params(self.latency_streams, L))
                   for L in (0, self.latency_prompt)])

    def prompts(self, n_vocab: int, reps: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """(each stream's prompt, reps + 2 + LATENCY_RETRIES long prompts), from the shared sequence."""
        from .spec import prompt_tokens

        reps = self.reps if reps is None else reps
        n_streams = max(self.streams + (self.spec_streams, self.latency_streams))
        P, L = self.prompt_tokens, self.latency_prompt
        n_long = reps + 2 + LATENCY_RETRIES
        seq = prompt_tokens(n_vocab, n_streams * P + n_long * L)
        streams = [seq[i * P:(i + 1) * P] for i in range(n_streams)]
        base = n_streams * P
        # measure_latency's: the prompt alone, its warm-up round, one per timed round, the spares
        return streams, [seq[base + r * L:base + (r + 1) * L] for r in range(n_long)]


def check_plan(p: Plan) -> None:
    """ValueError naming the parameter that cannot be run."""
    if not p.streams or any(s < 1 for s in p.streams):
        raise ValueError(f"concurrent streams must be integers >= 1, got {p.streams}")
    for name in ("tokens", "prompt_tokens", "reps", "spec_streams", "latency_streams", "latency_tokens"):
        if getattr(p, name) < 1:
            raise ValueError(f"concurrent {name} must be >= 1, got {getattr(p, name)}")
    if p.latency_prompt < 1 or p.drafts < 1:
        raise ValueError(f"concurrent latency_prompt and drafts must be >= 1, got {p.latency_prompt}, {p.drafts}")
    if p.tokens < 2 or p.latency_tokens < LEAD_SHARE:
        raise ValueError(f"concurrent tokens must be >= 2 (a gap) and latency_tokens >= {LEAD_SHARE}, "
                         f"got {p.tokens}, {p.latency_tokens}")


# --- one request's record, and the statistics over them ------------------------------------------------

@dataclass
class StreamRecord:
    """One request as its caller saw it: `events` are (seconds, tokens received so far)."""
    t_request: float
    events: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] | None = None          # every token id, where the transport returns them
    itl_ms_reported: float | None = None     # the engine's own mean gap (llama.cpp's timings), if any
    on_tokens: Callable[[int], None] | None = None   # called with the count whenever tokens arrive

    def add(self, t: float, n_so_far: int) -> None:
        if not self.events or n_so_far > self.events[-1][1]:
            self.events.append((t, n_so_far))
            if self.on_tokens is not None:
                self.on_tokens(n_so_far)

    @property
    def n_tokens(self) -> int:
        return self.events[-1][1] if self.events else 0

    @property
    def t_last(self) -> float:
        return self.events[-1][0]


def token_gaps(events: list[tuple[float, int]]) -> tuple[list[float], int]:
    """Inter-token gaps in ms from (time, tokens so far) events: the first event's tokens have no
    gap; an event that brings k tokens shares its gap evenly among them. Returns (gaps, tokens
    that shared a gap)."""
    gaps: list[float] = []
    shared = 0
    for (t0, n0), (t1, n1) in zip(events, events[1:]):
        k = n1 - n0
        gaps += [1e3 * (t1 - t0) / k] * k
        shared += k if k > 1 else 0
    return gaps, shared


SLOW_GAP = 2.0                # a gap this times the round's median is slow (slow_gap_breakdown)


def pass_occupancy(trace: list[tuple], t0: float, t1: float) -> dict:
    """A round's passes (PassScheduler.trace, those inside [t0, t1]): how many, the share of the
    wall time the backend ran them (the rest: the scheduler waiting for the request threads'
    next tokens, the threads' own work, passes waiting for the backend), the median gap from one
    pass's end to the next one's start, and the median decode-only pass. Where the trace has each
    pass's steps_in (when its last decode step was handed in), the gap's two parts: the median
    time from a pass's end to the next one's last step handed in (the request threads), and from
    then to the next pass's start (the scheduler composing it, its wake-up included). {} without
    a trace."""
    inside = [e for e in trace if e[0] >= t0 and e[1] <= t1]
    if not inside or t1 <= t0:
        return {}
    gaps = sorted(b[0] - a[1] for a, b in zip(inside, inside[1:]))
    decode = sorted(e[2] for e in inside if not e[4])
    out = {"passes": len(inside), "busy_share": round(sum(e[2] for e in inside) / (t1 - t0), 4),
           "gap_ms_median": round(1e3 * gaps[len(gaps) // 2], 3) if gaps else None,
           "decode_pass_ms_median": round(1e3 * decode[len(decode) // 2], 3) if decode else None}
    split = [(a, b) for a, b in zip(inside, inside[1:]) if len(b) > 5 and b[5]]
    if split:
        out["steps_in_ms_median"] = round(1e3 * percentile([max(0.0, b[5] - a[1]) for a, b in split], 50), 3)
        out["composing_ms_median"] = round(1e3 * percentile([b[0] - max(a[1], b[5]) for a, b in split], 50), 3)
    return out


def slow_gap_breakdown(recs: list, trace: list[tuple], median_ms: float) -> dict:
    """Where the slow inter-token gaps (over SLOW_GAP x the median) of the streams went, from the
    scheduler's pass trace (PassScheduler.trace: began, ended, seconds holding the backend,
    decode steps, prompt tokens): ms inside decode-only passes, inside passes with prompt tokens,
    passes waiting for the backend (another thread holding it: a state copy, a speculative
    cycle), and between passes (the scheduler gathering, the threads' own work). Summed over the
    slow gaps, each gap once (not per token of an event that brought several)."""
    limit = SLOW_GAP * median_ms / 1e3
    spans = []
    for rec in recs:
        for (t0, n0), (t1, n1) in zip(rec.events, rec.events[1:]):
            if (t1 - t0) / (n1 - n0) > limit:
                spans.append((t0, t1))
    out = {"slow_gaps": len(spans), "ms": 0.0, "decode_pass_ms": 0.0, "mixed_pass_ms": 0.0,
           "waiting_for_backend_ms": 0.0, "between_passes_ms": 0.0, "longest_mixed_pass_ms": 0.0,
           "longest_wait_ms": 0.0}
    for t0, t1 in spans:
        covered = 0.0
        for e in trace:
            began, ended, seconds, n_decode, n_prompt = e[:5]
            run_from = max(began, ended - seconds)
            wait = max(0.0, min(t1, run_from) - max(t0, began))
            run = max(0.0, min(t1, ended) - max(t0, run_from))
            if wait + run == 0:
                continue
            out["waiting_for_backend_ms"] += 1e3 * wait
            out["mixed_pass_ms" if n_prompt else "decode_pass_ms"] += 1e3 * run
            covered += wait + run
            if run and n_prompt:
                out["longest_mixed_pass_ms"] = max(out["longest_mixed_pass_ms"], 1e3 * seconds)
            if wait:
                out["longest_wait_ms"] = max(out["longest_wait_ms"], 1e3 * (run_from - began))
        out["ms"] += 1e3 * (t1 - t0)
        out["between_passes_ms"] += 1e3 * max(0.0, t1 - t0 - covered)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def mixed_passes(trace: list[tuple]) -> dict:
    """The passes that carried prompt tokens next to decode steps (PassScheduler.trace): how
    many, and the median (nearest rank) prompt tokens, ms and decode steps of one, with the median decode-only
    pass of as many steps beside them: what a prompt piece adds to the decoders' gap (the
    budget's target: at most MIXED_PASS_SLOWDOWN times that pass). {} without such a pass."""
    mixed = [e for e in trace if e[3] and e[4]]
    if not mixed:
        return {}
    steps = percentile([e[3] for e in mixed], 50)
    alone = [e[2] for e in trace if e[3] == steps and not e[4]]
    return {"passes": len(mixed), "prompt_tokens_median": percentile([e[4] for e in mixed], 50),
            "ms_median": round(1e3 * percentile([e[2] for e in mixed], 50), 3),
            "ms_max": round(1e3 * max(e[2] for e in mixed), 3), "decode_steps_median": steps,
            "decode_only_ms_median": round(1e3 * percentile(alone, 50), 3) if alone else None}


def tokens_by(events: list[tuple[float, int]], t: float) -> int:
    """Tokens received at or before time t."""
    return max((n for u, n in events if u <= t), default=0)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (the smallest x with at least q% of the values <= x)."""
    if not xs:
        raise ValueError("no values")
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100.0 * len(s)) - 1)]


def aggregate_tps(records: list[StreamRecord], t0: float) -> float:
    """All tokens received / the time from t0 (the first request) to the last token."""
    end = max(r.t_last for r in records)
    return sum(r.n_tokens for r in records) / (end - t0)


def round_details(records: list[StreamRecord]) -> dict:
    gaps, shared = [], 0
    for r in records:
        g, s = token_gaps(r.events)
        gaps += g
        shared += s
    reported = [r.itl_ms_reported for r in records if r.itl_ms_reported is not None]
    return {"itl_ms_median": round(percentile(gaps, 50), 3) if gaps else None,
            "itl_ms_p99": round(percentile(gaps, ITL_PERCENTILE), 3) if gaps else None,
            "itl_ms_reported_mean": round(sum(reported) / len(reported), 3) if reported else None,
            "first_token_s": [round(r.events[0][0] - r.t_request, 4) if r.events else None for r in records],
            "tokens_sharing_a_gap": shared}


# --- the two transports: a request run to the end, reporting tokens as they come ------------------------

class EngineClient:
    """Requests on our Engine: greedy, streamed (so the tokens' times are known); with ban_eog the
    end-of-generation tokens get a logit bias of -inf (llama-server's ignore_eos). Only where a
    request would end early (run_ours decides): a bias takes the engine off its greedy fast path
    (the argmax on the GPU, the fused speculative cycle)."""

    def __init__(self, engine, ban_eog: bool = False):
        self.engine = engine
        self.bias = {int(t): -math.inf for t in engine.eog_tokens} if ban_eog else {}

    def pass_trace(self, since: float) -> list:
        """The engine's shared passes since perf_counter time `since` (slow_gap_breakdown)."""
        trace = getattr(self.engine._backend, "pass_trace", None)
        return trace(since) if trace is not None else []

    def run(self, prompt: list[int], n_tokens: int, rec: StreamRecord, stream: bool = False) -> None:
        """One request of n_tokens; its tokens' times into rec (always streamed here)."""
        it = self.engine.generate(list(prompt), max_tokens=n_tokens, temperature=0.0, top_k=0, top_p=1.0,
                                  min_p=0.0, logit_bias=self.bias or None, stream=True)
        out: list[int] = []
        try:
            for chunk in it:
                if chunk.tokens:
                    out += chunk.tokens
                    rec.add(time.perf_counter(), len(out))
        finally:
            it.close()
        rec.tokens = out


class ServerClient:
    """Requests on a llama-server (bench/peer_spec.py LlamaServer). Plain requests return every
    token id and llama.cpp's timings; streamed ones the times tokens arrive (not their ids: the
    server sends no event for a token that ends inside a UTF-8 character). No request is cut
    short: closing several streams at once left the pinned server unable to stop (two cancelled
    tasks never released their slots, SIGTERM then hung; CPU build, default.gguf)."""

    def __init__(self, server, timeout: Callable[[], float], drafts: bool = False):
        self.server, self.timeout, self.drafts = server, timeout, drafts

    @staticmethod
    def body(prompt: list[int], n_tokens: int) -> dict:
        from .peer_spec import completion_request

        # completion_request asks for N + 1 (N timed after the free first one): here N in all; a
        # prompt sent again reuses its slot's state, as our engine's slots do
        return {**completion_request(prompt, n_tokens - 1), "cache_prompt": True}

    def run(self, prompt: list[int], n_tokens: int, rec: StreamRecord, stream: bool = False) -> None:
        """One request of n_tokens into rec: plain (token ids, llama.cpp's timings) or streamed."""
        from .peer_spec import parse_completion

        if not stream:
            obj = self.server.complete(self.body(prompt, n_tokens), self.timeout())
            if n_tokens == 1:
                # the long prompt's request: llama.cpp times no decode step (predicted_per_second 0)
                t = obj.get("timings") if isinstance(obj, dict) else None
                if not isinstance(t, dict) or t.get("predicted_n") != 1 or len(obj.get("tokens") or ()) != 1:
                    raise PeerError(f"llama-server (concurrent): a one-token request answered {str(obj)[:300]}")
                rec.add(time.perf_counter(), 1)
                rec.tokens = list(obj["tokens"])
                return
            c = parse_completion(obj, n_tokens - 1, "llama-server (concurrent)", drafts=self.drafts)
            rec.add(time.perf_counter(), c.predicted_n)
            if len(c.tokens) != n_tokens:
                raise PeerError(f"llama-server (concurrent): {len(c.tokens)} token ids returned for "
                                f"{n_tokens} generated (return_tokens)")
            rec.tokens = list(c.tokens)
            rec.itl_ms_reported = c.predicted_ms / max(c.predicted_n - 1, 1)
            return
        for ev in self.server.stream(self.body(prompt, n_tokens), self.timeout()):
            n = ev.get("tokens_predicted")
            if not isinstance(n, int):
                raise PeerError(f"llama-server (concurrent): a streamed event without tokens_predicted "
                                f"(keys: {sorted(ev)})")
            if n:
                rec.add(time.perf_counter(), n)
        if rec.n_tokens != n_tokens:
            raise PeerError(f"llama-server (concurrent): a streamed request ended after {rec.n_tokens} tokens, "
                            f"asked for {n_tokens}")


# --- the measurements, on either transport ------------------------------------------------------------

def run_concurrently(jobs: list[Callable[[], None]]) -> float:
    """Start every job in its own thread at once; returns the start time; re-raises the first
    failure after all have ended."""
    errors: list[BaseException] = []
    go = threading.Event()

    def wrap(job):
        go.wait()
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return t0


def solo_outputs(client, prompts: list[list[int]], n_tokens: int) -> list[list[int] | None]:
    """Each prompt alone, one request at a time (the identity reference, and the warm-up)."""
    out = []
    for p in prompts:
        rec = StreamRecord(time.perf_counter())
        client.run(p, n_tokens, rec)
        out.append(rec.tokens)
    return out


def measure_tps(client, prompts: list[list[int]], n_tokens: int, reps: int,
                reference: list[list[int]]) -> tuple[list[float], dict]:
    """One warm-up round and `reps` timed rounds of len(prompts) concurrent requests:
    (aggregate tokens/s per round, details). reference[i]: prompt i's tokens when run alone."""
    samples, rounds, differing, first_diff = [], [], 0, -1
    for r in range(-1, reps):
        recs = [StreamRecord(0.0) for _ in prompts]

        def job(i, rec):
            rec.t_request = time.perf_counter()
            client.run(prompts[i], n_tokens, rec)
        t0 = run_concurrently([lambda i=i, rec=rec: job(i, rec) for i, rec in enumerate(recs)])
        for i, rec in enumerate(recs):
            # fewer tokens than asked: an end of generation that the request alone did not reach
            if rec.n_tokens != n_tokens and (rec.tokens is None or len(reference[i] or ()) != n_tokens):
                raise RuntimeError(f"stream {i} generated {rec.n_tokens} tokens, asked for {n_tokens}")
            if rec.tokens != reference[i]:
                differing += 1
                d = _first_difference(rec.tokens or [], reference[i] or [])
                first_diff = d if first_diff < 0 else min(first_diff, d)
        if r < 0:
            continue
        samples.append(aggregate_tps(recs, t0))
        rounds.append(round_details(recs))
        rounds[-1]["pass_occupancy"] = pass_occupancy(_trace(client, t0), t0, max(rec.t_last for rec in recs))
    streams = len(prompts)
    return samples, {
        "streams": streams, "tokens": n_tokens, "prompt_tokens": len(prompts[0]), "reps": reps,
        # every stream of every round, the warm-up included, against its prompt run alone
        "streams_checked": streams * (reps + 1), "streams_differing_from_alone": differing,
        "first_difference": first_diff,
        "itl_ms_median": [x["itl_ms_median"] for x in rounds], "itl_ms_p99": [x["itl_ms_p99"] for x in rounds],
        "itl_ms_reported_mean": [x["itl_ms_reported_mean"] for x in rounds],
        "first_token_s_max": [max(t for t in x["first_token_s"] if t is not None) for x in rounds],
        "tokens_sharing_a_gap": sum(x["tokens_sharing_a_gap"] for x in rounds),
        # where a round's wall time went (the engine's scheduler: pass_occupancy), per round
        "pass_occupancy": [x["pass_occupancy"] for x in rounds if x["pass_occupancy"]]}


def _trace(client, since: float) -> list:
    """The client's engine's passes since `since` (EngineClient.pass_trace); [] for a client
    that sees none."""
    trace = getattr(client, "pass_trace", None)
    return trace(since) if trace is not None else []


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def latency_round(client, prompts: list[list[int]], n_tokens: int, long: list[int] | None,
                  lead: int) -> tuple[dict, list[float]]:
    """len(prompts) streamed requests of n_tokens; with `long`, a request of it (one new token)
    once every stream has `lead` tokens. (the run's facts, every gap in ms)."""
    recs = [StreamRecord(0.0) for _ in prompts]
    cv = threading.Condition()
    counts = [0] * len(prompts)
    state: dict = {}

    def seen(i: int, n: int) -> None:
        with cv:
            counts[i] = n
            cv.notify_all()

    def stream_job(i: int, rec: StreamRecord) -> None:
        rec.t_request = time.perf_counter()
        rec.on_tokens = lambda n: seen(i, n)
        try:
            client.run(prompts[i], n_tokens, rec, stream=True)
        finally:
            seen(i, max(counts[i], lead))        # a stream that ended never holds the prompt back

    def prompt_job() -> None:
        with cv:
            while min(counts) < lead:
                cv.wait()
        state["sent"] = time.perf_counter()
        client.run(long, 1, StreamRecord(state["sent"]))
        state["done"] = time.perf_counter()

    jobs = [lambda i=i, rec=rec: stream_job(i, rec) for i, rec in enumerate(recs)]
    t0 = run_concurrently(jobs + ([prompt_job] if long is not None else []))
    gaps, shared = [], 0
    for rec in recs:
        g, k = token_gaps(rec.events)
        gaps += g
        shared += k
    if len(gaps) < 2:
        raise RuntimeError(f"the latency streams produced {len(gaps)} gaps")
    run = {"p99_ms": round(percentile(gaps, ITL_PERCENTILE), 3), "median_ms": round(percentile(gaps, 50), 3),
           "tokens": n_tokens, "gaps": len(gaps), "tokens_sharing_a_gap": shared,
           "seconds": round(max(rec.t_last for rec in recs) - t0, 3)}
    trace = _trace(client, t0)
    if trace:
        run["slow_gaps"] = slow_gap_breakdown(recs, trace, percentile(gaps, 50))
        if long is not None:
            run["mixed_passes"] = mixed_passes(trace)
    if long is not None:
        sent, done = state["sent"], state["done"]
        run.update(prompt_sent_s=round(sent - t0, 3), prompt_returned_s=round(done - t0, 3),
                   # every stream still decoding when the prompt's request returned (else the row
                   # under-states what the prompt costs them)
                   streams_outlasted_prompt=all(rec.t_last > done for rec in recs),
                   tokens_during_prompt=max(tokens_by(r.events, done) - tokens_by(r.events, sent) for r in recs))
    return run, gaps


def measure_latency(client, prompts: list[list[int]], long_prompts: list[list[int]], n_tokens: int,
                    reps: int) -> dict[int, tuple[list[float], dict]]:
    """Both latency rows: {0: without, L: with the long prompt} -> (p99 gap in ms per round,
    details). Without: one warm-up and `reps` rounds of n_tokens per stream. With: the streams
    must decode until TAIL_TOKENS past the prompt's return, and no request is cut short, so their
    length is sized beforehand: the prompt alone (long_prompts[0]) gives its time, a warm-up round
    (long_prompts[1]) sized from that at PROMPT_SLOWDOWN times as long gives the tokens a stream
    decodes while it runs, and the timed rounds (long_prompts[2..]) run
    lead + DURING_MARGIN x those + TAIL_TOKENS (at least n_tokens). A timed round whose streams ended
    before the prompt returned runs again, longer, on the next spare (long_prompts[reps + 2..]) while
    any remain and the streams are below LATENCY_ROOM x n_tokens; the details keep the rounds redone."""
    if len(long_prompts) < reps + 2:
        raise ValueError(f"{reps} repetitions need {reps + 2} long prompts, got {len(long_prompts)}")
    lead = max(1, n_tokens // LEAD_SHARE)
    samples, runs, gaps = [], [], []
    for r in range(-1, reps):
        run, g = latency_round(client, prompts, n_tokens, None, lead)
        if r >= 0:
            samples.append(run["p99_ms"])
            runs.append(run)
            gaps += g
    itl = max(percentile(gaps, 50), 1e-3)      # ms; sizes the streams below
    out = {0: (samples, {"streams": len(prompts), "tokens": n_tokens, "reps": reps, "runs": runs})}

    t = time.perf_counter()
    client.run(long_prompts[0], 1, StreamRecord(t))
    alone = time.perf_counter() - t
    room = LATENCY_ROOM * n_tokens
    n = min(room, max(n_tokens, lead + math.ceil(PROMPT_SLOWDOWN * 1e3 * alone / itl) + TAIL_TOKENS))
    warm, _ = latency_round(client, prompts, n, long_prompts[1], lead)
    if warm["streams_outlasted_prompt"]:
        during = warm["tokens_during_prompt"]
    else:                       # ended before it returned: as many as the gaps without it would give
        during = 1e3 * (warm["prompt_returned_s"] - warm["prompt_sent_s"]) / itl
    n = min(room, max(n_tokens, lead + math.ceil(DURING_MARGIN * during) + TAIL_TOKENS))
    samples, runs, redone = [], [], []
    spares = iter(long_prompts[reps + 2:])
    for r in range(reps):
        run, _ = latency_round(client, prompts, n, long_prompts[r + 2], lead)
        while not run["streams_outlasted_prompt"] and n < room:
            spare = next(spares, None)
            if spare is None:
                break
            # ended before the prompt returned: longer by what this round's prompt took
            during = 1e3 * (run["prompt_returned_s"] - run["prompt_sent_s"]) / itl
            n = min(room, max(2 * n, lead + math.ceil(DURING_MARGIN * during) + TAIL_TOKENS))
            redone.append(run)
            run, _ = latency_round(client, prompts, n, spare, lead)
        samples.append(run["p99_ms"])
        runs.append(run)
    out[len(long_prompts[0])] = (samples, {
        "streams": len(prompts), "tokens": n, "lead_tokens": lead, "reps": reps, "runs": runs,
        "rounds_redone_longer": redone,
        "prompt_alone_s": round(alone, 3), "warm_up": warm, "itl_ms_median_without": round(itl, 3)})
    return out


# --- our engine (the child process) ---------------------------------------------------------------------

def _engine_facts(engine, asked: int) -> dict:
    """The engine a row ran on; read after the row, for the pass counters."""
    facts = {"backend": engine.backend_name, "backend_reason": engine.backend_reason,
             "slots_asked": asked, "sequences": engine.n_slots}
    counts = getattr(engine._backend, "pass_counts", None) or {}
    if counts:
        facts.update(max_sequences_in_a_pass=counts["max_sequences_in_a_pass"],
                     shared_passes=counts["shared_passes"], passes=counts["passes"])
        if counts.get("decode_pass_ms"):   # a decode-only pass by its sequences, median ms (native)
            facts["decode_pass_ms"] = {str(k): v for k, v in counts["decode_pass_ms"].items()}
    return facts


OUT_OF_TIME = "out of time in this run; run again with the same --resume folder to finish it"


def run_ours(model: str, plan: Plan, backend: str, out, time_left: Callable[[], float],
             todo: list[tuple[str, dict]] | None = None) -> None:
    """The rows `todo` (None: all) of the plan on our engine; `out` is a bench/ours.py Emitter
    (result, details, skip). The prompts are the plan's whichever rows are asked for."""
    from .. import load
    from ..errors import OpenJetError

    check_plan(plan)
    rows = plan.rows()
    todo = rows if todo is None else [(m, dict(p)) for m, p in todo]
    unknown = [r for r in todo if r not in rows]
    if unknown:
        raise ValueError(f"rows {unknown} are not rows of this plan ({rows})")
    P, N = plan.prompt_tokens, plan.tokens
    lat = [r for r in todo if r[0] == "concurrent_itl_p99_ms"]
    spec = ("concurrent_tps", tps_params(plan.spec_streams, plan.drafts))
    reference: list[list[int]] | None = None
    prompts, long_prompts = None, None
    streams = sorted(p["streams"] for m, p in todo if m == "concurrent_tps" and p["drafts"] == 0)
    ban: bool | None = None      # end of generation banned: decided by the first requests alone

    def solo_on(engine, which: list[list[int]]):
        """(client, each prompt's tokens alone); the first call decides `ban`."""
        nonlocal ban
        client = EngineClient(engine, ban_eog=bool(ban))
        solo = solo_outputs(client, which, N)
        if ban is None:
            ban = any(len(t) < N for t in solo)
            if ban:
                client = EngineClient(engine, ban_eog=True)
                solo = solo_outputs(client, which, N)
        return client, solo
    for k, S in enumerate(streams):
        if time_left() < 30:
            for row in [("concurrent_tps", tps_params(x)) for x in streams[k:]] + lat + [spec]:
                out.skip(*row, OUT_OF_TIME)
            return
        engine = load(model, backend=backend, n_ctx=P + N + 16, n_slots=S, draft_depth=0)
        try:
            if prompts is None:
                prompts, long_prompts = plan.prompts(engine.n_vocab)
            if reference is None:
                # every prompt alone on the first engine (the fewest slots): the reference of all rows
                client, reference = solo_on(engine, prompts)
                solo = reference[:S]
            else:
                client, solo = solo_on(engine, prompts[:S])
            samples, details = measure_tps(client, prompts[:S], N, plan.reps, reference)
            details.update(_engine_facts(engine, S), eog_banned=ban,
                           solo_differing_from_reference=sum(a != b for a, b in zip(solo, reference)))
        finally:
            engine.close()
        out.result("concurrent_tps", tps_params(S), "tokens/s", samples)
        out.details("concurrent_tps", tps_params(S), details)

    # the latency rows: streams + 1 sequences at once, each with room for the long prompt
    if not lat:
        pass
    elif time_left() < 60:
        for row in lat:
            out.skip(*row, OUT_OF_TIME)
    else:
        need = plan.latency_streams + 1
        n_ctx = max(plan.latency_prompt + 16, P + plan.latency_tokens * LATENCY_ROOM + 16)
        engine = load(model, backend=backend, n_ctx=n_ctx, n_slots=need, draft_depth=0)
        try:
            if prompts is None:
                prompts, long_prompts = plan.prompts(engine.n_vocab)
            if engine.n_slots < need:
                for row in lat:
                    out.skip(*row, f"the engine serves {engine.n_slots} sequence(s) at once on the "
                                   f"{engine.backend_name} backend; {plan.latency_streams} streams and a prompt "
                                   f"need {need}")
            else:
                client = EngineClient(engine, ban_eog=bool(ban))
                made = measure_latency(client, prompts[:plan.latency_streams], long_prompts,
                                       plan.latency_tokens, plan.reps)
                facts = {**_engine_facts(engine, need), "eog_banned": bool(ban)}
                for metric, params in lat:
                    samples, details = made[params["prompt_tokens"]]
                    out.result(metric, params, "ms", samples)
                    out.details(metric, params, {**details, **facts})
        finally:
            engine.close()

    # speculation with several streams: whether it runs is the engine's decision
    S, D = plan.spec_streams, plan.drafts
    if spec not in todo:
        return
    if time_left() < 30:
        out.skip(*spec, OUT_OF_TIME)
        return
    try:
        engine = load(model, backend=backend, n_ctx=P + N + D + 16, n_slots=S, draft_depth=D)
    except (ValueError, OpenJetError) as exc:
        out.skip(*spec, f"the engine refuses speculation with {S} slots: {exc}")
        return
    try:
        if not engine.supports_speculative:
            out.skip(*spec, f"the {engine.backend_name} backend does not speculate with {engine.n_slots} "
                            f"slot(s) ({engine.backend_reason})")
            return
        if engine.backend_name == "native" and engine.n_slots > 1:
            out.skip(*spec, f"the native engine speculates only for a request served alone: {S} concurrent "
                            f"streams decode in shared passes without drafts (no verify pass over several "
                            f"sequences' drafts yet)")
            return
        if prompts is None:
            prompts, long_prompts = plan.prompts(engine.n_vocab)
        # the warm-up, and the reference where no plain row ran in this process (then: this engine's
        # requests alone)
        client, solo = solo_on(engine, prompts[:S])
        samples, details = measure_tps(client, prompts[:S], N, plan.reps, reference or solo)
        details.update(_engine_facts(engine, S), drafts=D, eog_banned=ban, reference=(
            "plain (draft depth 0) requests alone" if reference else "this engine's requests alone"))
    finally:
        engine.close()
    out.result(*spec, "tokens/s", samples)
    out.details(*spec, details)


# --- llama.cpp's server (the parent process) -------------------------------------------------------------

def server_context(plan: Plan, slots: int) -> int:
    """-c for a server of `slots` slots: each slot room for the longest request (llama.cpp gives a
    slot -c / slots, rounded up to 256)."""
    per_slot = max(plan.prompt_tokens + max(plan.tokens, plan.latency_tokens * LATENCY_ROOM),
                   plan.latency_prompt + 1) + plan.drafts + 64
    return slots * 256 * -(-per_slot // 256)


def measure_server(server, plan: Plan, prompts, long_prompts, rows: list[tuple[str, dict]], timeout,
                   on_row, reference: list[list[int]] | None = None, drafts: int = 0) -> list[list[int]]:
    """The rows asked (of plan.rows(), engine llama.cpp) on one server; on_row(metric, params,
    samples, details) after each. Returns the solo reference outputs (made here when not given)."""
    try:
        return _measure_server(server, plan, prompts, long_prompts, rows, timeout, on_row, reference, drafts)
    except RuntimeError as exc:       # a wrong token count, a stream that differs in length: the peer's rows
        if isinstance(exc, PeerError):
            raise
        raise PeerError(f"llama-server (concurrent): {exc}") from exc


def _measure_server(server, plan: Plan, prompts, long_prompts, rows, timeout, on_row, reference, drafts):
    client = ServerClient(server, timeout, drafts=drafts > 0)
    N = plan.tokens
    facts = {"backend": "llama-server", "sequences": server_slots(server), "drafts": drafts,
             "command": list(server.cmd)}
    tps = sorted((p for m, p in rows if m == "concurrent_tps"), key=lambda p: p["streams"])
    if tps:
        # alone, one at a time: the warm-up, and on the first server the reference of every prompt
        # (a later server's rows, speculation's, compare with it)
        n = len(prompts) if reference is None else max(p["streams"] for p in tps)
        solo = solo_outputs(client, prompts[:n], N)
        if reference is None:
            reference = solo
        for p in tps:
            samples, details = measure_tps(client, prompts[:p["streams"]], N, plan.reps, reference)
            details.update(facts, solo_differing_from_reference=sum(a != b for a, b in zip(solo, reference)))
            on_row("concurrent_tps", p, samples, details)
    lat = [p for m, p in rows if m == "concurrent_itl_p99_ms"]
    if lat:
        # both rows come from one measurement (the one with the prompt is sized from the one without)
        made = measure_latency(client, prompts[:plan.latency_streams], long_prompts, plan.latency_tokens, plan.reps)
        for p in lat:
            samples, details = made[p["prompt_tokens"]]
            on_row("concurrent_itl_p99_ms", p, samples, {**details, **facts})
    return reference or []


def server_slots(server) -> int:
    cmd = list(server.cmd)
    return int(cmd[cmd.index("-np") + 1]) if "-np" in cmd else 1


# --- the child's entry point ----------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    from .ours import Emitter

    ap = argparse.ArgumentParser(prog="python -m openjet_plugin.bench.concurrent",
                                 description="our engine's concurrent rows of openjet bench (issue 29)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", default="auto", help="as load(backend=...): auto, native or llama.cpp")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--spec", default="8:3", help="STREAMS:DRAFTS of the speculative row")
    ap.add_argument("--latency", default="7:12288:128", help="STREAMS:PROMPT_TOKENS:TOKENS of the latency rows")
    ap.add_argument("--rows", default="", help="JSON list of [metric, params] to measure (default: every row)")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; 0 = none")
    args = ap.parse_args(argv)
    out = Emitter(args.out)
    try:
        spec_s, drafts = (int(x) for x in args.spec.split(":"))
        lat_s, lat_p, lat_n = (int(x) for x in args.latency.split(":"))
        plan = Plan(streams=_ints(args.streams), tokens=args.tokens, prompt_tokens=args.prompt_tokens,
                    reps=args.reps, spec_streams=spec_s, drafts=drafts, latency_streams=lat_s,
                    latency_prompt=lat_p, latency_tokens=lat_n)
        todo = [(m, p) for m, p in json.loads(args.rows)] if args.rows else None
        run_ours(args.model, plan, args.backend, out,
                 lambda: args.deadline - time.time() if args.deadline else float("inf"), todo)
        return 0
    except Exception as exc:  # noqa: BLE001 - the parent records why, then carries on
        out.emit({"error": f"{type(exc).__name__}: {exc}"})
        print(f"openjet bench (concurrent): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
