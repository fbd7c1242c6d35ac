"""scripts/phase_breakdown.py on synthetic Nsight Compute raw CSVs (CPU only).

The CSVs are written as ncu writes `--csv --page raw`: a header, a units row, quoted values with
thousands separators, ==PROF== lines around them. The launch order is the one engine.cu has for
the tiny preset (3 DeltaNet layers, 1 attention layer, an MTP block); the model file gives the
weight bytes the floors use.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("phase_breakdown", REPO / "scripts" / "phase_breakdown.py")
pb = importlib.util.module_from_spec(_spec)
sys.modules["phase_breakdown"] = pb
_spec.loader.exec_module(pb)

HEADER = ['ID', 'Process ID', 'Process Name', 'Host Name', 'Kernel Name', 'Context', 'Stream', 'Block Size',
          'Grid Size', 'Device', 'CC', 'dram__bytes_read.sum', 'dram__bytes_write.sum', 'gpu__time_duration.sum',
          'launch__block_size', 'launch__grid_size']
UNITS = ['', '', '', '', '', '', '', '', '', '', '', 'byte', 'byte', 'nsecond', '', '']

# demangled names as ncu prints them (template arguments included)
NAMES = {
    "embed": "embed_kernel(oj::Matrix, const int *, float *)",
    "rms_norm": "rms_norm_kernel(const float *, const float *, float *, int, float, int)",
    "matvec": "void oj::<unnamed>::mma_matvec_kernel<8>(oj::Matrix, const float *, float *, int, bool, const int *, long)",
    "quantize_x": "void oj::<unnamed>::quantize_x_kernel<false>(const float *, long, int, signed char *, float2 *)",
    "conv": "void oj::<unnamed>::deltanet_conv_kernel<4>(const float *, int, const float *, int, const float *, float *, float *, int, bool)",
    "qk_norm": "oj::<unnamed>::deltanet_qk_norm_kernel(float *, int, int, float, float)",
    "recurrence": "void oj::<unnamed>::deltanet_recurrence_kernel<64>(const float *, ...)",
    "gated_norm": "oj::<unnamed>::deltanet_gated_norm_kernel(float *, const float *, const float *, float)",
    "attn_prepare": "void oj::<unnamed>::attention_prepare_kernel<false>(const float *, ...)",
    "attn_partial": "void oj::<unnamed>::attention_partial_kernel<64, false>(const float *, ...)",
    "attn_combine": "oj::<unnamed>::attention_combine_kernel(const float *, const float *, const float *, float *, int, int)",
    "swiglu": "swiglu_kernel(float *, const float *, long)",
    "argmax": "argmax_kernel(const float *, int *, int)",
    "map_ids": "map_ids_kernel(int *, const int *, int)",
}
# per kind: (time ns, bytes read, bytes written) of one launch
COST = {"embed": (2100, 4096, 1024), "rms_norm": (1500, 2048, 1024), "matvec": (12345, 1_234_567, 4096),
        "quantize_x": (900, 1024, 512), "conv": (2500, 30000, 10000), "qk_norm": (1800, 4000, 4000),
        "recurrence": (7000, 800_000, 400_000), "gated_norm": (1700, 3000, 1500), "attn_prepare": (2200, 5000, 5000),
        "attn_partial": (6000, 200_000, 8000), "attn_combine": (1900, 8000, 2000), "swiglu": (1600, 4096, 2048),
        "argmax": (3000, 16384, 0), "map_ids": (800, 64, 4)}


# per unit ncu may print: how many of it make the base unit's 1 (ns for time, byte for bytes)
PER_BASE = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "byte": 1, "Kbyte": 1e3, "KB": 1e3,
            "Mbyte": 1e6, "MB": 1e6, "GB": 1e9}


def fmt(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:.15g}"       # ncu's thousands separators on whole numbers


def csv_text(passes: list[tuple[list[pb.Slot], int]], int8: bool = False,
             time_unit: str = "nsecond", byte_unit: str = "byte") -> str:
    """A raw CSV of the given passes (program, positions); with int8, each matvec is preceded by
    its quantize_x launch as the OPENJET_MATVEC=int8 path does. Times and bytes are written in
    the given units (ncu's --print-units auto scales them)."""
    units = [{"nsecond": time_unit, "byte": byte_unit}.get(u, u) for u in UNITS]
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3)",
             ",".join(f'"{h}"' for h in HEADER), ",".join(f'"{u}"' for u in units)]
    i = 0
    for prog, n in passes:
        for s in prog:
            if s.optional:
                continue
            kinds = (["quantize_x"] if int8 and s.kind == "matvec" else []) + [s.kind]
            for kind in kinds:
                t, r, w = COST[kind]
                grid = n if kind == "embed" else 96
                row = [str(i), "4242", "python3", "gpu", NAMES[kind], "1", "13", "(256, 1, 1)", f"({grid}, 1, 1)",
                       "0", "9.0", fmt(r / PER_BASE[byte_unit]), fmt(w / PER_BASE[byte_unit]),
                       fmt(t / PER_BASE[time_unit]), "256", fmt(grid)]
                lines.append(",".join(f'"{v}"' for v in row))
                i += 1
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def model(synth_path):
    return pb.Model.open(synth_path("tiny", "Q8_0"))


def test_parse_units_separators_and_order():
    text = "\n".join([
        "some program output",
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","launch__grid_size"',
        '"","","","","","","","","","","","Kbyte","byte","usecond",""',
        '"1","7","python3","h","argmax_kernel(const float *, int *, int)","1","13","(1024, 1, 1)","(2, 1, 1)","0","9.0",'
        '"1,024.5","2,000","3.5","2"',
        '"0","7","python3","h","embed_kernel(oj::Matrix, const int *, float *)","1","13","(256, 1, 1)","(2, 1, 1)",'
        '"0","9.0","10","0","1,234.25","2"',
    ])
    ks = pb.parse_ncu_csv(text, "fixture.csv")
    assert [k.index for k in ks] == [0, 1]                 # launch order by ID, not by row
    assert [k.kind for k in ks] == ["embed", "argmax"]
    assert ks[0].time_s == pytest.approx(1234.25e-6)
    assert ks[1].dram_bytes == pytest.approx(1024.5e3 + 2000)
    assert ks[1].grid == 2


def test_missing_column_is_named():
    text = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_write.sum"\n'
            '"","","nsecond","byte"\n"0","embed_kernel","1,000","10"\n')
    with pytest.raises(pb.BreakdownError, match=r"'dram__bytes_read\.sum' is missing.*x\.csv|x\.csv.*'dram__bytes_read\.sum' is missing"):
        pb.parse_ncu_csv(text, "x.csv")


def test_bad_unit_and_no_header():
    with pytest.raises(pb.BreakdownError, match="no ncu raw CSV header"):
        pb.parse_ncu_csv("==PROF== nothing profiled\n", "empty.csv")
    text = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum"\n'
            '"","","cycle","byte","byte"\n"0","embed_kernel","1,000","10","0"\n')
    with pytest.raises(pb.BreakdownError, match="'gpu__time_duration.sum' has unit 'cycle'"):
        pb.parse_ncu_csv(text, "u.csv")


# ncu 2025.3.1's `--csv --page raw --print-units base` on the H200, cut to a few of its 273 columns
# (the order kept): durations come out in "ns" even with base units, bytes in "byte", and the
# launch__ columns carry units of their own. The rows are the first four kernels of a real MTP pass.
REAL_HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
               "Grid Size", "Device", "CC", "c2clink__enabled_mask", "c2clink__present", "dram__bytes_read.sum",
               "dram__bytes_write.sum", "gpu__time_duration.avg", "gpu__time_duration.sum", "launch__block_dim_x",
               "launch__block_size", "launch__grid_size", "launch__registers_per_thread",
               "launch__shared_mem_per_block", "launch__sm_count", "profiler__replayer_passes",
               "sm__maximum_warps_per_active_cycle_pct"]
REAL_UNITS = ["", "", "", "", "", "", "", "", "", "", "", "", "", "byte", "byte", "ns", "ns", "block", "", "",
              "register/thread", "byte/block", "SM", "pass", "%"]
_REAL_ROW = ["5815", "python3.12", "127.0.0.1"]
REAL_ROWS = [
    ["0", *_REAL_ROW, "unnamed>::embed_kernel(Matrix, const int *, float *)", "1", "13", "(256, 1, 1)", "(1, 1, 1)",
     "0", "9.0", "0", "0", "10,496", "0", "11,808", "11,808", "256", "256", "1", "32", "1,024", "132", "1", "100"],
    ["1", *_REAL_ROW, "unnamed>::rms_norm_kernel(const float *, const float *, float *, int, float, int)", "1", "13",
     "(256, 1, 1)", "(1, 1, 1)", "0", "9.0", "0", "0", "49,408", "0", "17,120", "17,120", "256", "256", "1", "16",
     "1,152", "132", "1", "100"],
    ["2", *_REAL_ROW, "unnamed>::rms_norm_kernel(const float *, const float *, float *, int, float, int)", "1", "13",
     "(256, 1, 1)", "(1, 1, 1)", "0", "9.0", "0", "0", "52,992", "0", "17,312", "17,312", "256", "256", "1", "16",
     "1,152", "132", "1", "100"],
    ["3", *_REAL_ROW, "void unnamed>::mma_matvec_kernel<12>(Matrix, const float *, float *, int, bool, const int *, long)",
     "1", "13", "(128, 1, 1)", "(320, 1, 1)", "0", "9.0", "0", "0", "29,551,360", "0", "40,736", "40,736", "128",
     "128", "320", "85", "3,072", "132", "1", "31.25"],
]


def real_csv(units: dict[str, str] | None = None, values: dict[str, list[str]] | None = None) -> str:
    """The real rows, with some columns' units (and then their values) replaced."""
    u = [(units or {}).get(h, x) for h, x in zip(REAL_HEADER, REAL_UNITS)]
    rows = [list(r) for r in REAL_ROWS]
    for col, vals in (values or {}).items():
        for r, v in zip(rows, vals):
            r[REAL_HEADER.index(col)] = v
    q = lambda xs: ",".join(f'"{x}"' for x in xs)
    return "\n".join(["==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, "
                      "profiling results may be inconsistent.",
                      "==PROF== Connected to process 5815 (/usr/bin/python3.12)",
                      "==PROF== Disconnected from process 5815",
                      q(REAL_HEADER), q(u), *(q(r) for r in rows)]) + "\n"


def test_real_ncu_2025_layout_ns_and_bytes():
    ks = pb.parse_ncu_csv(real_csv(), "ncu_mtp.csv")
    assert [k.kind for k in ks] == ["embed", "rms_norm", "rms_norm", "matvec"]
    assert [k.time_s for k in ks] == pytest.approx([11_808e-9, 17_120e-9, 17_312e-9, 40_736e-9])
    assert [k.dram_bytes for k in ks] == pytest.approx([10_496, 49_408, 52_992, 29_551_360])
    assert [k.grid for k in ks] == [1, 1, 1, 320]


def test_real_layout_scaled_units_convert_to_the_same_numbers():
    """ncu's auto units (older long names, newer short ones) give the base-unit numbers back."""
    scaled = pb.parse_ncu_csv(real_csv(
        units={"gpu__time_duration.sum": "usecond", "dram__bytes_read.sum": "Kbyte",
               "dram__bytes_write.sum": "Mbyte"},
        values={"gpu__time_duration.sum": ["11.81", "17.12", "17.31", "40.74"],
                "dram__bytes_read.sum": ["10.50", "49.41", "52.99", "29,551.36"],
                "dram__bytes_write.sum": ["0", "0.25", "0", "1.5"]}), "auto.csv")
    assert [k.time_s for k in scaled] == pytest.approx([11.81e-6, 17.12e-6, 17.31e-6, 40.74e-6])
    assert [k.dram_bytes for k in scaled] == pytest.approx([10_500, 49_410 + 250_000, 52_990, 29_551_360 + 1_500_000])
    short = pb.parse_ncu_csv(real_csv(
        units={"gpu__time_duration.sum": "us", "dram__bytes_read.sum": "MB", "dram__bytes_write.sum": "KB"},
        values={"gpu__time_duration.sum": ["1", "2", "3", "4"], "dram__bytes_read.sum": ["0.5", "1", "2", "29.55"],
                "dram__bytes_write.sum": ["1", "0", "0", "2,000"]}), "short.csv")
    assert [k.time_s for k in short] == pytest.approx([1e-6, 2e-6, 3e-6, 4e-6])
    assert [k.dram_bytes for k in short] == pytest.approx([501_000, 1e6, 2e6, 29.55e6 + 2e6])


@pytest.mark.parametrize("unit,want", [
    ("ns", (1e-9, "second")), ("nsecond", (1e-9, "second")), ("us", (1e-6, "second")), ("usecond", (1e-6, "second")),
    ("\u00b5s", (1e-6, "second")), ("ms", (1e-3, "second")), ("msecond", (1e-3, "second")), ("second", (1.0, "second")),
    ("byte", (1.0, "byte")), ("Kbyte", (1e3, "byte")), ("KB", (1e3, "byte")), ("Mbyte", (1e6, "byte")),
    ("MB", (1e6, "byte")), ("Gbyte", (1e9, "byte")), ("GB", (1e9, "byte")), ("KiB", (1024.0, "byte")),
    ("Gbyte/second", (1e9, "byte/second")), ("GB/s", (1e9, "byte/second")), ("Kbyte/second", (1e3, "byte/second")),
    ("byte/usecond", (1e6, "byte/second")), ("cycle", (1.0, "cycle")), ("furlong", None), ("byte/", None),
])
def test_unit_table(unit, want):
    got = pb.parse_unit(unit)
    if want is None:
        assert got is None
    else:
        assert got[0] == pytest.approx(want[0]) and got[1] == want[1]


@pytest.mark.parametrize("time_unit,byte_unit", [("ns", "Kbyte"), ("usecond", "Mbyte"), ("msecond", "GB")])
def test_scaled_units_give_the_same_breakdown(model, time_unit, byte_unit):
    dec = pb.verify_program(model, 1, 10)
    base = pb.analyse([("b.csv", pb.parse_ncu_csv(csv_text([(dec, 1)]), "b.csv"))], model, 10)["decode1"]
    text = csv_text([(dec, 1)], time_unit=time_unit, byte_unit=byte_unit)
    assert f'"{time_unit}"' in text.splitlines()[2] and f'"{byte_unit}"' in text.splitlines()[2]
    g = pb.analyse([("s.csv", pb.parse_ncu_csv(text, "s.csv"))], model, 10)["decode1"]
    assert g.mapped and set(g.rows) == set(base.rows)
    for phase, r in base.rows.items():
        assert g.rows[phase].time_s == pytest.approx(r.time_s, rel=1e-9), phase
        assert g.rows[phase].dram_bytes == pytest.approx(r.dram_bytes, rel=1e-9), phase


def test_unknown_unit_is_refused_by_name():
    with pytest.raises(pb.BreakdownError,
                       match=r"odd\.csv: column 'dram__bytes_read\.sum' has unit 'Pbyte', which phase_breakdown "
                             r"does not know"):
        pb.parse_ncu_csv(real_csv(units={"dram__bytes_read.sum": "Pbyte"}), "odd.csv")
    with pytest.raises(pb.BreakdownError, match=r"odd\.csv: column 'gpu__time_duration\.sum' has unit 'tick'"):
        pb.parse_ncu_csv(real_csv(units={"gpu__time_duration.sum": "tick"}), "odd.csv")
    # known, but the wrong quantity: a rate where bytes belong, bytes where time belongs
    with pytest.raises(pb.BreakdownError, match=r"'dram__bytes_write\.sum' has unit 'Gbyte/second', which measures "
                                                r"byte/second, not byte"):
        pb.parse_ncu_csv(real_csv(units={"dram__bytes_write.sum": "Gbyte/second"}), "rate.csv")
    with pytest.raises(pb.BreakdownError, match=r"'gpu__time_duration\.sum' has unit 'Kbyte'"):
        pb.parse_ncu_csv(real_csv(units={"gpu__time_duration.sum": "Kbyte"}), "swap.csv")
    # a duration without its unit could be ns or s
    with pytest.raises(pb.BreakdownError, match=r"nounit\.csv: column 'gpu__time_duration\.sum' has no unit"):
        pb.parse_ncu_csv(real_csv(units={"gpu__time_duration.sum": ""}), "nounit.csv")


def test_cli_names_the_file_of_an_unknown_unit(tmp_path, capsys):
    p = tmp_path / "ncu_mtp.csv"
    p.write_text(real_csv(units={"gpu__time_duration.sum": "jiffy"}))
    assert pb.main(["--csv", str(p)]) == 1
    err = capsys.readouterr().err
    assert str(p) in err and "'gpu__time_duration.sum'" in err and "'jiffy'" in err


def test_roles_sums_and_floors(model):
    c = model.config
    depth = 100
    dec = pb.verify_program(model, 1, depth)
    ver = pb.verify_program(model, 5, depth)
    mtp = pb.mtp_program(model, 1, depth)
    text = csv_text([(dec, 1), (dec, 1), (ver, 5), (mtp, 1), (mtp, 1), (mtp, 1)])
    groups = pb.analyse([("t.csv", pb.parse_ncu_csv(text, "t.csv"))], model, depth)
    assert set(groups) == {"decode1", "verify5", "mtp"}
    assert (groups["decode1"].passes, groups["verify5"].passes, groups["mtp"].passes) == (2, 1, 3)
    g = groups["decode1"]
    assert g.mapped and not g.note
    n_dn, n_attn = len(c.deltanet_layers()), len(c.attention_layers())
    qkv = g.rows["projections: attn_qkv"]
    assert qkv.kernels == n_dn
    assert qkv.time_s == pytest.approx(n_dn * 12345e-9)
    assert qkv.dram_bytes == pytest.approx(n_dn * (1_234_567 + 4096))
    assert qkv.weight_bytes == sum(model.tensors[f"blk.{il}.attn_qkv.weight"][0] for il in c.deltanet_layers())
    ffn = g.rows["projections: ffn_down"]
    assert ffn.kernels == c.n_layer
    assert g.rows["projections: attn_output"].kernels == n_attn
    head = g.rows["output head"]
    assert head.weight_bytes == model.tensors[model.head_name(False)][0]
    # every DeltaNet layer: conv, qk_norm, recurrence, gated_norm
    dn = g.rows[pb.DELTANET]
    assert dn.kernels == 4 * n_dn
    assert dn.time_s == pytest.approx(n_dn * (2500 + 1800 + 7000 + 1700) * 1e-9)
    # norms: attn_norm + post_norm per layer, output_norm; swiglu per layer
    el = g.rows[pb.ELEMENTWISE]
    assert el.kernels == 2 * c.n_layer + 1 + c.n_layer
    total = sum(COST[s.kind][0] for s in dec if not s.optional) * 1e-9
    assert g.kernel_time_s == pytest.approx(total)
    # floors: bytes over the rate, or flops over the matrix rate, whichever is larger
    js = pb.group_json(g, gbps=1000.0, tflops=1.0)
    row = next(r for r in js["rows"] if r["phase"] == "projections: attn_qkv")
    want = max(qkv.min_bytes / 1e12, qkv.flops / 1e12)
    assert row["floor_us"] == pytest.approx(want * 1e6)
    assert row["pct_of_floor"] == pytest.approx(want / qkv.time_s * 100)
    assert row["achieved_gbps"] == pytest.approx(qkv.dram_bytes / qkv.time_s / 1e9)
    # attention reads K and V of every position so far (f16)
    attn = g.rows[pb.ATTENTION]
    assert attn.min_bytes >= n_attn * 2 * 2 * c.kv_dim * (depth + 1)
    # the verify of 5 positions: weights are the same, flops 5x
    v = groups["verify5"].rows["projections: attn_qkv"]
    assert v.weight_bytes == qkv.weight_bytes
    assert v.flops == pytest.approx(5 * qkv.flops)
    m = groups["mtp"]
    assert m.mapped
    assert m.rows["projections: nextn.eh_proj"].kernels == 1
    assert m.rows["output head (MTP shared head)"].kernels == 1


def test_int8_quantize_goes_to_its_matvec(model):
    dec = pb.verify_program(model, 1, 10)
    groups = pb.analyse([("q.csv", pb.parse_ncu_csv(csv_text([(dec, 1)], int8=True), "q.csv"))], model, 10)
    g = groups["decode1"]
    assert g.mapped
    r = g.rows["projections: attn_qkv"]
    n_dn = len(model.config.deltanet_layers())
    assert r.kernels == 2 * n_dn
    assert r.time_s == pytest.approx(n_dn * (12345 + 900) * 1e-9)


def test_order_mismatch_falls_back_to_names(model):
    dec = pb.verify_program(model, 1, 10)
    broken = dec[:5] + dec[6:]                 # one launch missing: the order no longer holds
    groups = pb.analyse([("b.csv", pb.parse_ncu_csv(csv_text([(broken, 1)]), "b.csv"))], model, 10)
    g = groups["decode1"]
    assert not g.mapped
    assert "launch order differs" in g.note
    assert "projections (role unknown)" in g.rows
    assert g.rows[pb.DELTANET].kernels == 4 * len(model.config.deltanet_layers())


def test_first_kernel_must_start_a_pass(model):
    dec = pb.verify_program(model, 1, 10)
    with pytest.raises(pb.BreakdownError, match="not the embedding lookup"):
        pb.analyse([("m.csv", pb.parse_ncu_csv(csv_text([(dec[1:], 1)]), "m.csv"))], model, 10)


def test_cli_tables_wall_and_cycle(model, synth_path, tmp_path, capsys):
    depth = 64
    dec, ver, mtp = pb.verify_program(model, 1, depth), pb.verify_program(model, 5, depth), pb.mtp_program(model, 1, depth)
    (tmp_path / "d.csv").write_text(csv_text([(dec, 1)] * 3))
    (tmp_path / "v.csv").write_text(csv_text([(ver, 5)] * 3))
    (tmp_path / "m.csv").write_text(csv_text([(mtp, 1)] * 3))
    (tmp_path / "timing.json").write_text(json.dumps({"groups": {
        "decode1": {"wall_us": [900.0, 1000.0, 5000.0]}, "verify5": {"wall_us": [1200.0, 1300.0, 1250.0]},
        "mtp": {"wall_us": [300.0, 310.0, 320.0]}}}))
    out = tmp_path / "phases.json"
    rc = pb.main(["--model", str(synth_path("tiny", "Q8_0")), "--csv", str(tmp_path / "d.csv"),
                  "--csv", str(tmp_path / "v.csv"), "--csv", str(tmp_path / "m.csv"),
                  "--timing", str(tmp_path / "timing.json"), "--depth", str(depth), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "### decode1" in text and "### verify5" in text and "### mtp" in text and "### cycle D=4" in text
    assert "projections: attn_qkv" in text and "wall per pass" in text
    res = json.loads(out.read_text())
    d = res["groups"]["decode1"]
    kt = sum(COST[s.kind][0] for s in dec if not s.optional) / 1e3
    assert d["kernel_time_us"] == pytest.approx(kt)
    assert d["wall_us"] == pytest.approx(1000.0)                 # the median
    assert d["host_and_launch_us"] == pytest.approx(1000.0 - kt)
    assert f"host+launch {1000.0 - kt:.1f} µs" in text
    assert d["tokens_per_s_all_accepted"] == pytest.approx(1000.0)
    # projections first, in engine.cu's launch order; their subtotal counts every matvec launch
    assert [r["phase"] for r in d["rows"][:2]] == ["projections: attn_qkv", "projections: attn_gate"]
    pt = d["projections_total"]
    assert pt["kernels"] == sum(1 for s in dec if s.kind == "matvec")
    assert pt["time_us"] == pytest.approx(pt["kernels"] * 12.345)
    assert pt["weight_bytes"] == sum(model.bytes_of(t) for s in dec for t in s.tensors)
    cyc = res["cycle"]
    m_kt = sum(COST[s.kind][0] for s in mtp if not s.optional) / 1e3
    assert cyc["kernel_time_us"] == pytest.approx(res["groups"]["verify5"]["kernel_time_us"] + 4 * m_kt)
    assert cyc["wall_us"] == pytest.approx(1250.0 + 4 * 310.0)
    assert cyc["tokens_per_s_by_accepted"]["3"] == pytest.approx(3 / (1250.0 + 4 * 310.0) * 1e6)


def test_cli_kernels_above_wall_say_gaps_not_measurable(model, synth_path, tmp_path, capsys):
    dec = pb.verify_program(model, 1, 8)
    (tmp_path / "d.csv").write_text(csv_text([(dec, 1)], time_unit="ns"))
    kt = sum(COST[s.kind][0] for s in dec if not s.optional) / 1e3
    (tmp_path / "t.json").write_text(json.dumps({"groups": {"decode1": {"wall_us": [kt - 50.0]}}}))
    assert pb.main(["--model", str(synth_path("tiny", "Q8_0")), "--csv", str(tmp_path / "d.csv"),
                    "--timing", str(tmp_path / "t.json"), "--depth", "8"]) == 0
    text = capsys.readouterr().out
    assert "kernels under ncu exceed the wall by 50.0 µs: gaps not measurable" in text
    assert "host+launch -" not in text


def test_cli_bad_csv_exit_and_message(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    p.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n"0","embed_kernel","5"\n')
    assert pb.main(["--csv", str(p)]) == 1
    err = capsys.readouterr().err
    assert "dram__bytes_read.sum" in err and "bad.csv" in err
