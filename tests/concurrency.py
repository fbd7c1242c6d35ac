"""What the tests of concurrent requests share: running functions in threads that start together."""

from __future__ import annotations

import threading


def run_threads(fns, timeout: float = 300) -> list:
    """Run each fn in its own thread, all released at once; their results (or exceptions) in order.
    A thread still running after `timeout` seconds leaves None in its place."""
    out: list = [None] * len(fns)
    start = threading.Barrier(len(fns))

    def run(i, fn):
        start.wait()
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out
