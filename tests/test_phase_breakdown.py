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


def fmt(x: float) -> str:
    return f"{int(x):,}"       # ncu's thousands separators


def csv_text(passes: list[tuple[list[pb.Slot], int]], int8: bool = False) -> str:
    """A raw CSV of the given passes (program, positions); with int8, each matvec is preceded by
    its quantize_x launch as the OPENJET_MATVEC=int8 path does."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3)",
             ",".join(f'"{h}"' for h in HEADER), ",".join(f'"{u}"' for u in UNITS)]
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
                       "0", "9.0", fmt(r), fmt(w), fmt(t), "256", fmt(grid)]
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


def test_cli_bad_csv_exit_and_message(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    p.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"","","nsecond"\n"0","embed_kernel","5"\n')
    assert pb.main(["--csv", str(p)]) == 1
    err = capsys.readouterr().err
    assert "dram__bytes_read.sum" in err and "bad.csv" in err
