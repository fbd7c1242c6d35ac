"""pytest plugin: skip the tests not yet started once $OPENJET_TEST_DEADLINE (a Unix time) passes.

Under compute-sanitizer the GPU tests run 10-1000x slower (racecheck most). Killing pytest at a
timeout would also lose the sanitizer's summary of what did run; skipping the rest lets the
process exit normally, the summary is printed, and the skip reason ("time budget") tells
scripts/sanitize_summary.py how many tests the budget left out.

    OPENJET_TEST_DEADLINE=$(( $(date +%s) + 120 )) python -m pytest -p sanitize_deadline ...
(with scripts/ on PYTHONPATH). Without the variable the plugin does nothing.
"""

from __future__ import annotations

import os
import time

import pytest

ENV = "OPENJET_TEST_DEADLINE"
_deadline: float | None = None


def pytest_configure(config) -> None:
    global _deadline
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        _deadline = None
        return
    try:
        _deadline = float(raw)
    except ValueError:
        raise pytest.UsageError(f"${ENV} must be a Unix time in seconds, got {raw!r}") from None


def pytest_runtest_setup(item) -> None:
    if _deadline is not None and time.time() > _deadline:
        pytest.skip(f"the sanitizer's time budget for this tool is spent (${ENV})")
