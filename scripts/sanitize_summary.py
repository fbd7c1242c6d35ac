"""The table of a compute-sanitizer run over the GPU tests (scripts/gpu.sh sanitize, issue 10 item 2).

Each tool's log holds the sanitizer's own lines (prefixed `=========`) and pytest's output. Per
target process the sanitizer ends with `ERROR SUMMARY: N errors` (racecheck also, or instead,
`RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)`; memcheck's --leak-check adds
`LEAK SUMMARY: B bytes leaked in A allocations`). A log without any summary line means the run did
not finish (killed by a timeout, crashed): its errors are then unknown, never zero.

    python scripts/sanitize_summary.py --run memcheck memcheck.log 0 81 --run racecheck ... \
        [--markdown sanitize.md] [--json sanitize.json]

Exit status: 0 when every tool finished with zero errors and no failed test, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ERROR_SUMMARY = re.compile(r"^=+ ERROR SUMMARY: (\d+) errors?\b", re.M)
_RACECHECK_SUMMARY = re.compile(
    r"^=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", re.M)
_LEAK_SUMMARY = re.compile(r"^=+ LEAK SUMMARY: (\d+) bytes leaked in (\d+) allocations?", re.M)
# the first line of one reported problem, for a count when the run did not finish
_RECORD = re.compile(r"^=+ (Invalid |Uninitialized |Misaligned |Out-of-range |Program hit |Error: |"
                     r"Warning: |Barrier error|Race reported|Malloc/Free error|Leaked |"
                     r"\S.* hazard detected)", re.M)
# pytest's closing line, e.g. "3 passed, 2 skipped, 40 deselected in 81.20s"
_PYTEST_LINE = re.compile(r"^(?:=+ )?((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s", re.M)
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)")
# -rs lines of the tests the deadline plugin skipped (scripts/sanitize_deadline.py)
_BUDGET_SKIP = re.compile(r"^SKIPPED \[(\d+)\] .*time budget", re.M)
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


@dataclass
class SanitizerCounts:
    """What the sanitizer's summary lines say, summed over target processes."""
    processes: int = 0               # summary lines found (one per target process that finished)
    errors: int | None = None        # None: no summary, the run did not finish
    hazard_errors: int | None = None       # racecheck only
    hazard_warnings: int | None = None     # racecheck only
    leaked_bytes: int | None = None        # memcheck --leak-check only
    records: int = 0                 # problem records printed (a lower bound when unfinished)


@dataclass
class PytestCounts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    deselected: int = 0
    budget_skipped: int = 0          # skipped because the tool's time budget was spent
    finished: bool = False           # pytest printed its closing line
    failed_tests: list[str] = field(default_factory=list)


@dataclass
class ToolRow:
    tool: str
    rc: int | None
    wall_s: float | None
    sanitizer: SanitizerCounts
    tests: PytestCounts

    @property
    def verdict(self) -> str:
        s, t = self.sanitizer, self.tests
        if s.errors is None and self.rc is None and not t.finished and not s.records:
            return "not run"
        if s.errors is None:
            return "unfinished" + (f" (>= {s.records} errors)" if s.records else "")
        if s.errors:
            return f"{s.errors} errors"
        if t.failed or t.errors:
            return "clean, tests failed"
        if t.passed == 0:
            return "clean, no test ran"
        return "clean"

    @property
    def clean(self) -> bool:
        return self.verdict == "clean"


def parse_sanitizer(text: str) -> SanitizerCounts:
    c = SanitizerCounts(records=len(_RECORD.findall(text)))
    errs = [int(n) for n in _ERROR_SUMMARY.findall(text)]
    races = [tuple(map(int, m)) for m in _RACECHECK_SUMMARY.findall(text)]
    leaks = [int(b) for b, _ in _LEAK_SUMMARY.findall(text)]
    if races:
        c.hazard_errors = sum(r[1] for r in races)
        c.hazard_warnings = sum(r[2] for r in races)
    if errs:
        c.processes, c.errors = len(errs), sum(errs)
    elif races:     # racecheck versions that print no ERROR SUMMARY: its errors are the hazards
        c.processes, c.errors = len(races), c.hazard_errors
    if leaks:
        c.leaked_bytes = sum(leaks)
    return c


def parse_pytest(text: str) -> PytestCounts:
    t = PytestCounts()
    lines = _PYTEST_LINE.findall(text)
    if lines:
        t.finished = True
        for n, what in _PYTEST_COUNT.findall(lines[-1]):
            key = {"error": "errors", "warning": None, "warnings": None}.get(what, what)
            if key and hasattr(t, key):
                setattr(t, key, int(n))
    t.budget_skipped = sum(int(n) for n in _BUDGET_SKIP.findall(text))
    t.failed_tests = sorted(set(_FAILED.findall(text)))
    return t


def summarize(tool: str, text: str, rc: int | None = None, wall_s: float | None = None) -> ToolRow:
    return ToolRow(tool, rc, wall_s, parse_sanitizer(text), parse_pytest(text))


def _cell(v) -> str:
    return "-" if v is None else str(v)


def markdown(rows: list[ToolRow], command: str = "") -> str:
    out = ["| tool | tests run (passed / failed) | skipped (budget) | errors | racecheck hazards (err / warn) "
           "| leaked bytes | processes | wall s | exit | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, t = r.sanitizer, r.tests
        ran = t.passed + t.failed + t.errors
        hz = "-" if s.hazard_errors is None else f"{s.hazard_errors} / {s.hazard_warnings}"
        wall = "-" if r.wall_s is None else f"{r.wall_s:.0f}"
        out.append(f"| {r.tool} | {ran} ({t.passed} / {t.failed + t.errors}) | {t.skipped} ({t.budget_skipped}) | "
                   f"{_cell(s.errors)} | {hz} | {_cell(s.leaked_bytes)} | {s.processes} | {wall} | "
                   f"{_cell(r.rc)} | {r.verdict} |")
    failed = sorted({f"{r.tool}: {n}" for r in rows for n in r.tests.failed_tests})
    if failed:
        out += ["", "Failed tests: " + "; ".join(failed)]
    if command:
        out += ["", f"Command: `{command}`"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="table of compute-sanitizer logs")
    ap.add_argument("--run", nargs=4, action="append", default=[], metavar=("TOOL", "LOG", "RC", "WALL_S"),
                    help="one tool's log, its exit status and seconds ('-' when unknown)")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--command", default="", help="the command line, quoted under the table")
    args = ap.parse_args(argv)
    if not args.run:
        ap.error("give at least one --run TOOL LOG RC WALL_S")
    rows = []
    for tool, log, rc, wall in args.run:
        p = Path(log)
        if not p.is_file():
            ap.error(f"--run {tool}: log {p} not found")
        try:
            rc_v = None if rc == "-" else int(rc)
            wall_v = None if wall == "-" else float(wall)
        except ValueError:
            ap.error(f"--run {tool}: RC must be an integer and WALL_S a number (or '-'), got {rc!r} {wall!r}")
        rows.append(summarize(tool, p.read_text(errors="replace"), rc_v, wall_v))
    table = markdown(rows, args.command)
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "verdict": r.verdict} for r in rows], indent=1) + "\n")
    return 0 if all(r.clean for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
