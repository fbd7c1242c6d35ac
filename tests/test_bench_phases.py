"""openjet bench's projection_gbps row and per-phase table (issue 25) without a GPU: the numbers
bench/ours.py derives from the engine's profile reads (NativeBackend.profile_read), and the table
report.py renders from them, with floors from the card's read rate and the gap to the wall time
of an unprofiled pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from openjet_plugin.bench import ours, report


def _read(ms_scale: float = 1.0) -> dict:
    """One pass as oj_profile_read reports it: a 2-layer toy with a DeltaNet and an attention layer."""
    rows = [("embedding", 1, 1, 0.010, 0), ("norms", 5, 5, 0.020, 0),
            ("deltanet projections", 1, 2, 0.500, 1_000_000_000), ("deltanet conv+recurrence", 1, 4, 0.100, 50_000_000),
            ("deltanet ssm_out", 1, 2, 0.200, 400_000_000), ("attention q/k/v", 1, 2, 0.150, 300_000_000),
            ("attention core", 1, 3, 0.050, 10_000_000), ("attention output", 1, 2, 0.100, 150_000_000),
            ("ffn gate+up", 2, 4, 1.000, 3_000_000_000), ("swiglu", 2, 2, 0.010, 0),
            ("ffn down", 2, 4, 0.600, 1_500_000_000), ("head", 1, 2, 0.300, 1_000_000_000), ("argmax", 1, 1, 0.020, 0)]
    return {"passes": 1, "span_ms": 3.2 * ms_scale, "host_ms": 1.5 * ms_scale,
            "phases": [{"name": n, "calls": c, "launches": la, "ms": ms * ms_scale, "bytes": b} for n, c, la, ms, b in rows]}


def test_projection_gbps_is_projection_bytes_over_projection_time():
    r = _read()
    proj_bytes = 1e9 + 4e8 + 3e8 + 1.5e8 + 3e9 + 1.5e9 + 1e9
    proj_ms = 0.5 + 0.2 + 0.15 + 0.1 + 1.0 + 0.6 + 0.3
    assert ours.projection_gbps(r) == pytest.approx(proj_bytes / (proj_ms * 1e-3) / 1e9)
    # the non-projection phases (norms, recurrence, attention core, ...) do not count
    slow = _read()
    for ph in slow["phases"]:
        if ph["name"] in ("norms", "attention core", "deltanet conv+recurrence"):
            ph["ms"] *= 100
    assert ours.projection_gbps(slow) == pytest.approx(ours.projection_gbps(r))


def test_projection_gbps_refuses_a_read_without_projection_time():
    r = _read(0.0)
    with pytest.raises(ValueError, match="projection phases took 0"):
        ours.projection_gbps(r)


def test_phase_table_is_the_mean_per_pass():
    t = ours.phase_table([_read(1.0), _read(3.0)])
    assert t["passes"] == 2 and t["span_ms"] == pytest.approx(6.4) and t["host_ms"] == pytest.approx(3.0)
    by = {p["name"]: p for p in t["phases"]}
    assert by["ffn gate+up"]["ms"] == pytest.approx(2.0) and by["ffn gate+up"]["bytes"] == 3_000_000_000
    assert by["norms"]["launches"] == 5 and by["ffn down"]["calls"] == 2
    assert [p["name"] for p in t["phases"]] == [p["name"] for p in _read()["phases"]]


def test_phase_section_floors_percentages_and_the_gap_to_the_wall():
    params = {"positions": 1, "depth": 1024}
    key = report.row_key("projection_gbps", "openjet", params)
    rng = np.random.default_rng(3)
    results = [report.result("read_gbps", "openjet", {}, [5000.0] * 5),
               report.result("verify_ms", "openjet", params, [4.0] * 6),
               report.result("projection_gbps", "openjet", params, rng.normal(3000, 10, 6))]
    table = ours.phase_table([_read()])
    table.update(host_ms_unprofiled=1.25, wall_ms_unprofiled=3.5)    # what profiled_samples adds
    man = {"gpu": {"name": "H200"}, "info": {report.PHASES_KEY: {key: table}}}
    md = report.markdown({"manifest": man, "results": results})
    assert "## One verify pass, phase by phase (depth 1024, positions 1; mean of 1 profiled passes)" in md
    assert "| host: the profiled pass enqueued (start to its last launch) | 1.500 |" in md
    assert "| host: an unprofiled pass enqueued / its wall time | 1.250 / 3.500 |" in md
    # ffn gate+up: 3 GB at 5,000 GB/s = 0.6 ms floor, 1.0 ms taken: 60 %
    assert "| ffn gate+up | 1.000 | 3,000.0 | 0.600 | 60% | 4 | 2 |" in md
    # phases without bytes have no floor
    assert "| swiglu | 0.010 | 0.0 |  |  | 2 | 2 |" in md
    total_ms = sum(p["ms"] for p in _read()["phases"])
    assert f"| **sum of phases** | **{total_ms:.3f}** |" in md
    assert f"| wall − sum of phases (host, launch before the first kernel, copy back) | {4.0 - total_ms:.3f} |" in md
    assert 4.0 > total_ms and "(negative:" not in md
    # a profiled pass slower than the wall: the gap is negative and the table says why
    results[1] = report.result("verify_ms", "openjet", params, [total_ms / 1.25] * 6)
    md = report.markdown({"manifest": man, "results": results})
    assert f"| wall − sum of phases (host, launch before the first kernel, copy back) | {total_ms / 1.25 - total_ms:.3f} |" in md
    assert "| (negative: the profiled pass took 25% longer than the unprofiled one; its phase times include" in md
    # the main table's projection_gbps row shows its share of the read rate
    row = next(line for line in md.splitlines() if line.startswith("| projection_gbps |"))
    assert "60%" in row


def test_phase_section_without_a_read_rate_says_so():
    params = {"positions": 5, "depth": 1024}
    key = report.row_key("projection_gbps", "openjet", params)
    man = {"gpu": {"name": "H200"}, "info": {report.PHASES_KEY: {key: ours.phase_table([_read()])}}}
    md = report.markdown({"manifest": man, "results": []})
    assert "read rate (not measured)" in md
    assert "| ffn gate+up | 1.000 | 3,000.0 |  |  | 4 | 2 |" in md


def test_launch_fit_recovers_the_cost_of_a_launch_and_the_streaming_rate():
    """launch_fit on phases made from a known per-launch cost and rate gives them back; with fewer
    than three projection phases, or a fit that is not positive, there is none; the phase section
    prints it under the table."""
    rng = np.random.default_rng(7)
    a_us, gbps = 6.5, 2600.0
    names = ours.PROJECTION_PHASES
    phases = []
    for name in names:
        launches, b = int(rng.integers(2, 150)), float(rng.uniform(2e8, 7e9))
        phases.append({"name": name, "ms": launches * a_us / 1e3 + b / (gbps * 1e6), "bytes": b,
                       "launches": launches, "calls": 1})
    phases.append({"name": "attention core", "ms": 5.0, "bytes": 1e6, "launches": 3, "calls": 1})   # not a projection
    a, g = report.launch_fit(phases)
    assert a == pytest.approx(a_us, rel=1e-9) and g == pytest.approx(gbps, rel=1e-9)
    assert report.launch_fit(phases[:2]) is None
    # more launches, less time: a negative cost per launch is no fit
    falling = [{"name": n, "ms": ms, "bytes": 1e9, "launches": l, "calls": 1}
               for n, l, ms in zip(names, (1, 2, 3), (1.0, 0.5, 0.1))]
    assert report.launch_fit(falling) is None
    params = {"positions": 1, "depth": 1024}
    key = report.row_key("projection_gbps", "openjet", params)
    man = {"gpu": {"name": "H200"}, "info": {report.PHASES_KEY: {key: {"passes": 1, "span_ms": 10.0, "phases": phases}}}}
    md = report.markdown({"manifest": man, "results": [report.result("read_gbps", "openjet", {}, [3000.0] * 5)]})
    assert f"a = {a_us:.1f} µs a launch, B = {gbps:,.0f} GB/s" in md
