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
    "prep": "void oj::<unnamed>::mvf16::prep_kernel<12>(const float *, long, int, unsigned char *)",
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
# the matvec kernel each path launches after its x-preparing kernel (none: the bf16 path's mma)
MATVEC_AFTER = {"prep": "void oj::<unnamed>::mvf16::matvec_kernel<12, 8, 3>(oj::<unnamed>::mvf16::Args)",
                "quantize_x": "void oj::<unnamed>::i8_matvec_kernel<12, 8>(oj::Matrix, const signed char *, "
                              "const float2 *, float *, int, bool, const int *, long)"}
# per kind: (time ns, bytes read, bytes written) of one launch
COST = {"embed": (2100, 4096, 1024), "rms_norm": (1500, 2048, 1024), "matvec": (12345, 1_234_567, 4096),
        "quantize_x": (900, 1024, 512), "prep": (1100, 2048, 4608), "conv": (2500, 30000, 10000), "qk_norm": (1800, 4000, 4000),
        "recurrence": (7000, 800_000, 400_000), "gated_norm": (1700, 3000, 1500), "attn_prepare": (2200, 5000, 5000),
        "attn_partial": (6000, 200_000, 8000), "attn_combine": (1900, 8000, 2000), "swiglu": (1600, 4096, 2048),
        "argmax": (3000, 16384, 0), "map_ids": (800, 64, 4)}


# per unit ncu may print: how many of it make the base unit's 1 (ns for time, byte for bytes)
PER_BASE = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "byte": 1, "Kbyte": 1e3, "KB": 1e3,
            "Mbyte": 1e6, "MB": 1e6, "GB": 1e9}


def fmt(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:.15g}"       # ncu's thousands separators on whole numbers


def kinds_of(prog: list[pb.Slot]) -> list[str]:
    """The kernels a program launches: each matvec after the x-preparing kernel its path launches."""
    return [k for s in prog if not s.optional for k in ([s.pre] if s.pre else []) + [s.kind]]


def csv_of_kinds(passes: list[tuple[list[str], int]], time_unit: str = "nsecond", byte_unit: str = "byte") -> str:
    """A raw CSV of the given passes (kernel kinds in launch order, positions). A matvec after a
    prep / quantize_x gets the fp16 / int8 path's kernel name. Times and bytes are written in the
    given units (ncu's --print-units auto scales them)."""
    units = [{"nsecond": time_unit, "byte": byte_unit}.get(u, u) for u in UNITS]
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3)",
             ",".join(f'"{h}"' for h in HEADER), ",".join(f'"{u}"' for u in units)]
    i = 0
    for kinds, n in passes:
        prev = ""
        for kind in kinds:
            t, r, w = COST[kind]
            grid = n if kind == "embed" else 96
            name = MATVEC_AFTER.get(prev, NAMES[kind]) if kind == "matvec" else NAMES[kind]
            row = [str(i), "4242", "python3", "gpu", name, "1", "13", "(256, 1, 1)", f"({grid}, 1, 1)",
                   "0", "9.0", fmt(r / PER_BASE[byte_unit]), fmt(w / PER_BASE[byte_unit]),
                   fmt(t / PER_BASE[time_unit]), "256", fmt(grid)]
            lines.append(",".join(f'"{v}"' for v in row))
            i += 1
            prev = kind
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


def csv_text(passes: list[tuple[list[pb.Slot], int]], time_unit: str = "nsecond", byte_unit: str = "byte") -> str:
    """A raw CSV of the given passes (program, positions), each matvec preceded by the kernel its
    slot's path launches there (prep on the fp16 path, quantize_x on the int8 path)."""
    return csv_of_kinds([(kinds_of(prog), n) for prog, n in passes], time_unit, byte_unit)


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
    # every DeltaNet layer: conv (q / k norms inside), recurrence, gated_norm
    dn = g.rows[pb.DELTANET]
    assert dn.kernels == 3 * n_dn
    assert dn.time_s == pytest.approx(n_dn * (2500 + 7000 + 1700) * 1e-9)
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
    dec = pb.verify_program(model, 1, 10, matvec="int8")
    assert all(s.pre == "quantize_x" for s in dec if s.kind == "matvec")        # every Q8_0 matrix
    text = csv_text([(dec, 1)])
    assert "i8_matvec_kernel" in text
    groups = pb.analyse([("q.csv", pb.parse_ncu_csv(text, "q.csv"))], model, 10, matvec="int8")
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
    assert g.rows[pb.DELTANET].kernels == 3 * len(model.config.deltanet_layers())


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


# --- the fp16 path's grouped launches (engine.cu matvec_group) ---------------------------------------

@pytest.fixture(scope="module")
def q4km_file(tmp_path_factory) -> Path:
    """The tiny preset with llama.cpp's Q4_K_M type map (written directly): blk.2.attn_qkv and the
    MTP block's attn_v are Q6_K, the other projections of one normed input Q4_K."""
    from openjet_plugin.testing.synth import synth_model

    return synth_model(tmp_path_factory.mktemp("pb") / "tiny-q4km.gguf", preset="tiny", quant="Q4_K_M", direct=True)


@pytest.fixture(scope="module")
def q4km(q4km_file):
    m = pb.Model.open(q4km_file)
    # the premise of the hand-written launch lists below
    t = m.types
    assert [t[f"blk.{il}.attn_qkv.weight"] for il in (0, 1, 2)] == ["Q4_K", "Q4_K", "Q6_K"]
    assert {t[f"blk.{il}.{r}.weight"] for il in (0, 1, 2) for r in ("attn_gate", "ssm_beta", "ssm_alpha")} == {"Q4_K"}
    assert [t[f"blk.3.{r}.weight"] for r in ("attn_q", "attn_k", "attn_v")] == ["Q4_K"] * 3
    assert [t[f"blk.4.{r}.weight"] for r in ("attn_q", "attn_k", "attn_v")] == ["Q4_K", "Q4_K", "Q6_K"]
    assert m.config.deltanet_layers() == [0, 1, 2] and m.config.attention_layers() == [3] and m.config.mtp_layer == 4
    return m


PM = ["prep", "matvec"]                                   # one fp16-path launch pair
DN_MIX = ["conv", "recurrence", "gated_norm"]
ATTN_MIX = ["attn_prepare", "attn_partial", "attn_combine"]
FFN_F16 = ["rms_norm", *PM, "swiglu", *PM]                # post_norm, gate+up grouped, swiglu, down


def f16_decode_kinds() -> list[str]:
    """engine_verify on the fp16 path for the tiny Q4_K_M map, written out by hand from
    matvec_group's rule: Q4_K qkv layers group all four, the Q6_K qkv layer runs qkv alone and
    gate + beta + alpha together; every matrix here fits (K a multiple of 256)."""
    grouped4 = ["rms_norm", *PM, *DN_MIX, *PM, *FFN_F16]
    split = ["rms_norm", *PM, *PM, *DN_MIX, *PM, *FFN_F16]
    attn = ["rms_norm", *PM, *ATTN_MIX, *PM, *FFN_F16]
    return ["embed", *grouped4, *grouped4, *split, *attn, "rms_norm", *PM, "argmax"]


def f16_mtp_kinds() -> list[str]:
    """engine_mtp_eval on the fp16 path: the MTP block's attn_q + attn_k (Q4_K) grouped, attn_v (Q6_K) alone."""
    return ["embed", "rms_norm", "rms_norm", *PM, "rms_norm", *PM, *PM, *ATTN_MIX, *PM, *FFN_F16,
            "rms_norm", *PM, "argmax"]


def member_floor(m: pb.Model, names: list[str], n: int) -> tuple[float, float, float]:
    """(weight bytes, floor bytes, flops) of matrices each read once, x in and y out per matrix."""
    wb = sum(m.tensors[x][0] for x in names)
    mb = sum(m.tensors[x][0] + 4.0 * n * (m.tensors[x][1][0] + m.tensors[x][1][1]) for x in names)
    fl = sum(2.0 * n * m.tensors[x][1][0] * m.tensors[x][1][1] for x in names)
    return wb, mb, fl


def test_f16_grouped_launches_align_with_summed_floors(q4km):
    depth = 32
    text = csv_of_kinds([(f16_decode_kinds(), 1), (f16_decode_kinds(), 1), (f16_mtp_kinds(), 1)])
    assert "mvf16::prep_kernel" in text and "mvf16::matvec_kernel" in text
    groups = pb.analyse([("f16.csv", pb.parse_ncu_csv(text, "f16.csv"))], q4km, depth)    # f16: the default
    g = groups["decode1"]
    assert g.mapped and not g.note and g.passes == 2
    one_pair_ns = COST["prep"][0] + COST["matvec"][0]
    expect = {   # phase -> (launch pairs per pass, member matrices of each)
        "projections: attn_qkv+attn_gate+ssm_beta+ssm_alpha":
            (2, [[f"blk.{il}.{r}.weight" for r in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")] for il in (0, 1)]),
        "projections: attn_qkv": (1, [["blk.2.attn_qkv.weight"]]),
        "projections: attn_gate+ssm_beta+ssm_alpha": (1, [[f"blk.2.{r}.weight" for r in ("attn_gate", "ssm_beta", "ssm_alpha")]]),
        "projections: attn_q+attn_k+attn_v": (1, [[f"blk.3.{r}.weight" for r in ("attn_q", "attn_k", "attn_v")]]),
        "projections: ffn_gate+ffn_up": (4, [[f"blk.{il}.ffn_gate.weight", f"blk.{il}.ffn_up.weight"] for il in range(4)]),
        "projections: ffn_down": (4, [[f"blk.{il}.ffn_down.weight"] for il in range(4)]),
        "projections: ssm_out": (3, [[f"blk.{il}.ssm_out.weight"] for il in (0, 1, 2)]),
    }
    for phase, (pairs, members) in expect.items():
        r = g.rows[phase]
        assert r.kernels == 2 * pairs, phase                              # prep + matvec each
        assert r.time_s == pytest.approx(pairs * one_pair_ns * 1e-9), phase
        wb, mb, fl = (sum(x) for x in zip(*(member_floor(q4km, ms, 1) for ms in members)))
        assert r.weight_bytes == wb, phase
        assert r.min_bytes == pytest.approx(mb), phase
        assert r.flops == pytest.approx(fl), phase
    # no per-matrix rows for matrices that ran grouped
    for gone in ("projections: attn_gate", "projections: ssm_beta", "projections: attn_q", "projections: ffn_gate"):
        assert gone not in g.rows
    # the grouped slot of a layer is one launch reading all four matrices, its floor their floors' sum
    prog = pb.verify_program(q4km, 1, depth)
    slot = next(s for s in prog if "blk.0.attn_qkv.weight" in s.tensors)
    assert slot.tensors == tuple(f"blk.0.{r}.weight" for r in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"))
    assert slot.pre == "prep"
    singles = [q4km.matvec("x", t, 1) for t in slot.tensors]
    assert slot.min_bytes == pytest.approx(sum(s.min_bytes for s in singles))
    assert slot.flops == pytest.approx(sum(s.flops for s in singles))
    # every kernel of the pass is counted once
    assert g.kernel_time_s == pytest.approx(sum(COST[k][0] for k in f16_decode_kinds()) * 1e-9)
    m = groups["mtp"]
    assert m.mapped
    assert m.rows["projections: attn_q+attn_k"].kernels == 2
    assert m.rows["projections: attn_v"].kernels == 2
    assert m.rows["projections: attn_v"].weight_bytes == q4km.tensors["blk.4.attn_v.weight"][0]


def test_group_caps_at_four_of_one_type_in_order(q4km):
    """matvec_group's loop: from the first not-done fitting member, collect same-type members in
    order (skipping others, which run alone in their turn), at most GROUP_MAX."""
    c = q4km.config
    names = ["blk.2.attn_qkv.weight", "blk.0.attn_gate.weight", "output.weight", "blk.0.ssm_beta.weight",
             "blk.0.ssm_alpha.weight", "blk.1.attn_gate.weight", "blk.1.ssm_beta.weight"]
    types = [q4km.types[x] for x in names]
    assert types == ["Q6_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q4_K"]
    assert {q4km.tensors[x][1][0] for x in names} == {c.n_embd}        # one x: one K, a multiple of 256
    slots = pb.matvec_group(q4km, names, 1, "f16")
    assert [s.tensors for s in slots] == [
        ("blk.2.attn_qkv.weight", "output.weight"),                               # the two Q6_K
        ("blk.0.attn_gate.weight", "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.1.attn_gate.weight"),
        ("blk.1.ssm_beta.weight",),                                               # the fifth Q4_K, alone
    ]
    assert all(s.pre == "prep" for s in slots)
    # other paths: one launch per matrix, in order
    assert [s.tensors for s in pb.matvec_group(q4km, names, 1, "bf16")] == [(x,) for x in names]
    assert {s.pre for s in pb.matvec_group(q4km, names, 1, "int8")} == {"quantize_x"}
    # the engine refuses matrices of different K in one group (they cannot read one x)
    with pytest.raises(pb.BreakdownError, match=r"blk\.0\.ffn_down\.weight.*K 512.*blk\.0\.ffn_up\.weight.*K 256"):
        pb.matvec_group(q4km, ["blk.0.ffn_up.weight", "blk.0.ffn_down.weight"], 1, "f16")


def test_bf16_path_expects_one_launch_per_matrix(q4km):
    depth = 16
    dec = pb.verify_program(q4km, 1, depth, matvec="bf16")
    mv = [s for s in dec if s.kind == "matvec"]
    assert all(len(s.tensors) == 1 and s.pre == "" for s in mv)
    il0 = [s.phase for s in mv if s.tensors[0].startswith("blk.0.")]
    assert il0 == ["projections: attn_qkv", "projections: attn_gate", "projections: ssm_beta",
                   "projections: ssm_alpha", "projections: ssm_out", "projections: ffn_gate", "projections: ffn_up",
                   "projections: ffn_down"]
    c = q4km.config
    assert len(mv) == 5 * len(c.deltanet_layers()) + 4 * len(c.attention_layers()) + 3 * c.n_layer + 1
    # a bf16 profile: every matrix its own mma matvec, no prep
    bf = kinds_of(dec)
    assert "prep" not in bf and bf.count("matvec") == len(mv)
    text = csv_of_kinds([(bf, 1)])
    g = pb.analyse([("bf.csv", pb.parse_ncu_csv(text, "bf.csv"))], q4km, depth, matvec="bf16")["decode1"]
    assert g.mapped
    assert g.rows["projections: attn_qkv"].kernels == len(c.deltanet_layers())
    assert g.rows["projections: ssm_beta"].weight_bytes == sum(q4km.tensors[f"blk.{il}.ssm_beta.weight"][0]
                                                               for il in c.deltanet_layers())
    assert not any("+" in p for p in g.rows if p.startswith("projections"))
    # the f16 profile read as bf16 no longer aligns: it falls back, and says which path it looks like
    f16 = pb.analyse([("f.csv", pb.parse_ncu_csv(csv_of_kinds([(f16_decode_kinds(), 1)]), "f.csv"))], q4km, depth,
                     matvec="bf16")["decode1"]
    assert not f16.mapped
    assert "bf16 matvec path" in f16.note and "try --matvec f16" in f16.note
    assert f16.rows["projections (role unknown)"].kernels == f16_decode_kinds().count("matvec") * 2
    # and the bf16 profile read as f16 (the default) falls back too: f16 groups the Q4_K runs
    g16 = pb.analyse([("bf.csv", pb.parse_ncu_csv(text, "bf.csv"))], q4km, depth)["decode1"]
    assert not g16.mapped and "f16 matvec path" in g16.note


def test_prep_kernel_must_be_where_the_path_launches_it(q4km):
    kinds = f16_decode_kinds()
    # a prep dropped before the first grouped matvec
    i = kinds.index("prep")
    bad = kinds[:i] + kinds[i + 1:]
    with pytest.raises(pb.BreakdownError, match=r"comes after no x-preparing kernel where the engine's path launches prep"):
        pb.align(pb.parse_ncu_csv(csv_of_kinds([(bad, 1)]), "b.csv"), pb.verify_program(q4km, 1, 8))
    # int8 kernels read as the f16 path
    int8 = kinds_of(pb.verify_program(q4km, 1, 8, matvec="int8"))
    with pytest.raises(pb.BreakdownError, match=r"comes after quantize_x where the engine's path launches prep"):
        pb.align(pb.parse_ncu_csv(csv_of_kinds([(int8, 1)]), "i.csv"), pb.verify_program(q4km, 1, 8, matvec="f16"))
    g = pb.analyse([("i.csv", pb.parse_ncu_csv(csv_of_kinds([(int8, 1)]), "i.csv"))], q4km, 8, matvec="int8")
    assert g["decode1"].mapped
    assert g["decode1"].rows["projections: attn_qkv"].kernels == 2 * len(q4km.config.deltanet_layers())


def test_unknown_matvec_path_is_refused(q4km):
    with pytest.raises(pb.BreakdownError, match=r"matvec path 'fp8' is not one of f16, bf16, int8"):
        pb.verify_program(q4km, 1, 8, matvec="fp8")


def test_cli_matvec_path_from_timing_json_or_option(q4km, q4km_file, tmp_path, capsys):
    depth = 16
    bf = kinds_of(pb.verify_program(q4km, 1, depth, matvec="bf16"))
    (tmp_path / "d.csv").write_text(csv_of_kinds([(bf, 1)] * 2))
    (tmp_path / "t.json").write_text(json.dumps({"matvec_path": "bf16", "groups": {"decode1": {"wall_us": [500.0]}}}))
    args = ["--model", str(q4km_file), "--csv", str(tmp_path / "d.csv"), "--depth", str(depth)]
    out = tmp_path / "r.json"
    # the timing JSON says bf16: the per-matrix order is expected and found
    assert pb.main(args + ["--timing", str(tmp_path / "t.json"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"Decode matvec path: bf16 (from {tmp_path / 't.json'})" in text
    res = json.loads(out.read_text())
    assert res["matvec_path"] == "bf16" and res["groups"]["decode1"]["roles_mapped"]
    # no timing JSON: the engine's default, f16, which groups; this bf16 profile then falls back
    assert pb.main(args + ["--json", str(out)]) == 0
    capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["matvec_path"] == "f16" and not res["groups"]["decode1"]["roles_mapped"]
    # --matvec wins over the JSON
    assert pb.main(args + ["--timing", str(tmp_path / "t.json"), "--matvec", "f16", "--json", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["matvec_path"] == "f16"
    # a path the engine does not have, in the JSON, is named
    (tmp_path / "bad.json").write_text(json.dumps({"matvec_path": "fp8", "groups": {}}))
    assert pb.main(args + ["--timing", str(tmp_path / "bad.json")]) == 1
    err = capsys.readouterr().err
    assert "bad.json" in err and "'matvec_path'" in err and "'fp8'" in err
