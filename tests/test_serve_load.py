"""A reduced run of scripts/load_test.py against `openjet serve` with a small queue: concurrent
streaming clients, some timing out and some hanging up mid-stream. No reply is lost or garbled,
every refusal is a 503 with Retry-After, memory and threads stay bounded, and the server is healthy
afterwards. (The full run, 64 clients x 5 requests, is `python scripts/load_test.py`.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLIENTS, REQUESTS, MAX_QUEUE = 16, 2, 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def load_test():
    spec = importlib.util.spec_from_file_location("openjet_load_test_serve", REPO / "scripts" / "load_test.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up while being made
    spec.loader.exec_module(mod)
    return mod


def test_bounded_queue_under_load_with_timeouts_and_hang_ups(load_test, tmp_path):
    import openjet_plugin

    openjet_plugin.default_model_path()
    expected = load_test.expected_replies(16)
    proc, base = load_test.start_server(tmp_path / "server.log", threads="1", max_queue=MAX_QUEUE)
    try:
        assert load_test.healthy_after(base, expected, 16) == []   # one request: the engine is loaded
        threads_before = load_test.thread_count(proc.pid)
        res = load_test.run_load(base, expected, CLIENTS, REQUESTS, 16, proc.pid, timeout=120, log=lambda *_: None,
                                 abort_every=4, client_timeout=0.2)
        print(load_test.summary(res, CLIENTS, REQUESTS))
        assert not res.failures, res.failures[:3]        # includes any refusal that is not 429/503 + Retry-After
        assert not res.wrong, res.wrong[:3]
        assert res.ok + res.refused + res.aborted == CLIENTS * REQUESTS
        assert res.refused > 0 and res.ok >= REQUESTS        # the queue bound was reached, and work was done
        # bounded by what the server admits, not by the clients: 4 as with one request running, plus
        # one per admitted request (a slot's or the queue's): each that ends at once, finished or
        # hung up on, runs LiteLLM's success or failure handler on a thread of its logging
        # executor (seen: +3 to +9 with 4 slots and a queue of 3; 16 clients leaking one each
        # would be +16)
        from openjet_plugin.backends.llama_cpp import DEFAULT_SERVE_SEQUENCES
        admitted = DEFAULT_SERVE_SEQUENCES + MAX_QUEUE
        assert max(res.threads) <= threads_before + 4 + admitted < threads_before + CLIENTS, (threads_before, res.threads)
        assert res.rss[-1] - res.rss[0] < 64 << 20, res.rss
        assert load_test.healthy_after(base, expected, 16) == []
    finally:
        assert load_test.stop_server(proc) == 0
