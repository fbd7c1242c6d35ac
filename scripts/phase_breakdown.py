"""Per-phase time of one native-engine pass from Nsight Compute's raw CSV (issue 8).

Input: `ncu --csv --page raw --metrics gpu__time_duration.sum,dram__bytes_read.sum,
dram__bytes_write.sum,launch__grid_size,launch__block_size` over scripts/phase_probe.py (one CSV
per group, or one CSV holding several), the model file, and optionally the probe's timing JSON
(wall time per pass without ncu).

How kernels become phases: the rows are cut into passes at each `embed_kernel` (every verify and
every MTP step starts with the embedding lookup). A pass whose first kernels are
embed, rms_norm, matvec (after its x-preparing kernel, if any) is a verify of the main model;
embed, rms_norm, rms_norm is an MTP step (enorm, hnorm). The pass's positions n are the embedding's grid (one block a position). Each
pass is then aligned with the launch order of native/engine.cu (`engine_verify`,
`engine_mtp_eval`), built here from the model's config and tensor types, so every matvec gets its
matrices (blk.N.attn_qkv.weight, ...) and the kernel that prepares its x (the fp16 path's prep,
the int8 path's quantize_x) is charged to the matvec it feeds. The order depends on the decode
matvec path the probe ran (OPENJET_MATVEC; --matvec, by default the timing JSON's matvec_path,
else f16): on the fp16 path engine.cu's matvec_group runs a layer's projections of one normed
input (attn_qkv, attn_gate, ssm_beta, ssm_alpha; attn_q, attn_k, attn_v; ffn_gate, ffn_up) as
ONE prep + ONE matvec per run of up to 4 Q4_K or Q6_K matrices of one type (native/matvec.cu
matvec_group). Such a launch is one phase named after all its matrices
("projections: attn_gate+ssm_beta+ssm_alpha"), with their summed weights and floors: ncu times
the launch, not its members, so its time is not split among them. With the 27B's Q4_K_M map a
layer whose attn_qkv is Q6_K shows "attn_qkv" alone and "attn_gate+ssm_beta+ssm_alpha", the
others "attn_qkv+attn_gate+ssm_beta+ssm_alpha". On the bf16 and int8 paths every matrix is its
own launch (pair). When a pass does not follow the order (the engine changed, or the path given
is not the one that ran), the kernels are classified by name alone and the table says so.

Per phase and pass: kernels, time, DRAM bytes (read + written, as ncu counted them) and the
achieved rate; the phase's own floor: the fewest bytes it must move (weights of its matrices,
the recurrent state read and written, the KV cache read, activations) over the streaming rate,
or its multiply-adds over the matrix rate when that is larger; % of floor = floor / time. Last
rows: the sum of kernel times against the wall time of a pass measured without ncu (the rest is
launch and host time; when ncu's serialised kernels add up to more than the wall, the table says
the gaps cannot be measured) and the tokens per second that wall time implies.

    python scripts/phase_breakdown.py --model q27b.gguf --csv decode1.csv --csv verify5.csv \
        --csv mtp.csv [--timing timing.json] [--matvec f16] [--depth 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

STREAM_GBPS = 4470.0        # H200 streaming read rate measured in this project (bytes read / s)
MATRIX_TFLOPS = 790.0       # bf16 matrix rate measured on the H200 (KINDS.md: 769..798 TFLOP/s)

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"
GRID = "launch__grid_size"
REQUIRED = ("Kernel Name", TIME, READ, WRITE)

# ncu's units, by name: (factor to the base unit, quantity). ncu writes them in the row under the
# header: long names in older releases (nsecond, usecond, Kbyte, Gbyte/second), short ones in newer
# ones (ns, us, KB, GB/s); 2025.3 with --print-units base still writes "ns" for durations. Names
# are matched without case (ncu prints no bits, so "Mb" cannot mean megabits). Byte prefixes are
# decimal (ncu's Kbyte is 1000 bytes); KiB/MiB/GiB are binary as written. A rate is two known
# units around a "/" (Gbyte/second, cycle/nsecond).
SECOND, BYTE, COUNT = "second", "byte", "count"
_UNITS: dict[str, tuple[float, str]] = {
    **{u: (f, SECOND) for u, f in {
        "nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6,
        "msecond": 1e-3, "ms": 1e-3, "second": 1.0, "s": 1.0, "sec": 1.0}.items()},
    **{u: (f, BYTE) for u, f in {
        "byte": 1.0, "b": 1.0, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9, "gb": 1e9,
        "tbyte": 1e12, "tb": 1e12, "kib": 1024.0, "mib": 1024.0 ** 2, "gib": 1024.0 ** 3,
        "tib": 1024.0 ** 4}.items()},
    # grid and block sizes: no unit in the base units row; auto scaling may prefix them (Kblock)
    **{u: (f, COUNT) for u, f in {
        "": 1.0, "block": 1.0, "kblock": 1e3, "mblock": 1e6, "thread": 1.0, "kthread": 1e3,
        "mthread": 1e6}.items()},
    # units of other metrics ncu prints: known, but never what a column here needs
    **{u: (1.0, u) for u in ("cycle", "inst", "warp", "sector", "request", "pass", "register", "sm",
                             "cluster", "%")},
}


def parse_unit(unit: str) -> tuple[float, str] | None:
    """(factor to the base unit, quantity) of one of ncu's unit names; None when not known."""
    key = unit.strip().lower()
    if key in _UNITS:
        return _UNITS[key]
    parts = [x.strip() for x in key.split("/")]
    if len(parts) == 2 and all(parts):
        num, den = _UNITS.get(parts[0]), _UNITS.get(parts[1])
        if num and den:
            return num[0] / den[0], f"{num[1]}/{den[1]}"
    return None


def unit_scale(unit: str, want: str, where: str) -> float:
    """The factor that turns a value in ncu's `unit` into the base unit of `want` (second, byte or
    count). A unit of another quantity (cycle, byte/second) or one not known by name is refused;
    `where` names the file and column. No unit means bytes or a count as it is, but a duration
    without its unit could be ns or s, so that is refused too."""
    u = unit.strip()
    if not u and want == BYTE:
        return 1.0
    if not u and want == SECOND:
        raise BreakdownError(f"{where} has no unit (ncu writes ns, usecond, ... in the row under the header); "
                             f"cannot tell nanoseconds from seconds")
    got = parse_unit(u)
    if got is None:
        known = ", ".join(sorted(k for k, (_, q) in _UNITS.items() if q == want and k))
        raise BreakdownError(f"{where} has unit {u!r}, which phase_breakdown does not know by name "
                             f"(a {want} column takes: {known}); run ncu with --print-units base")
    if got[1] != want:
        raise BreakdownError(f"{where} has unit {u!r}, which measures {got[1]}, not {want}; profile with "
                             f"the metrics scripts/gpu.sh phases names")
    return got[0]


# kernel kind by a substring of its name (mangled or demangled); first match wins
KINDS = (
    ("quantize_x", "quantize_x_kernel"),     # the int8 path's x quantiser
    ("prep", "prep_kernel"),                 # the fp16 path's x preparation (mvf16::prep_kernel)
    ("matvec", "matvec_kernel"),            # mma_ / i8_ / float_ / mvf16:: matvec_kernel
    ("embed", "embed_kernel"),
    ("conv", "deltanet_conv_kernel"),
    ("qk_norm", "deltanet_qk_norm_kernel"),
    ("recurrence", "deltanet_recurrence_kernel"),
    ("gated_norm", "deltanet_gated_norm_kernel"),
    ("attn_prepare", "attention_prepare_kernel"),
    ("attn_partial", "attention_partial_kernel"),
    ("attn_combine", "attention_combine_kernel"),
    ("rms_norm", "rms_norm_kernel"),
    ("swiglu", "swiglu_kernel"),
    ("argmax", "argmax_kernel"),
    ("map_ids", "map_ids_kernel"),
)
DELTANET = "deltanet recurrence+conv+norms"
ATTENTION = "attention (prepare, partial, combine)"
ELEMENTWISE = "norms/elementwise"
PHASE_OF_KIND = {
    "embed": "embedding", "conv": DELTANET, "qk_norm": DELTANET, "recurrence": DELTANET,
    "gated_norm": DELTANET, "attn_prepare": ATTENTION, "attn_partial": ATTENTION,
    "attn_combine": ATTENTION, "rms_norm": ELEMENTWISE, "swiglu": ELEMENTWISE,
    "argmax": "argmax", "map_ids": "argmax", "matvec": "projections (role unknown)",
    "quantize_x": "projections (role unknown)", "prep": "projections (role unknown)",
}


class BreakdownError(ValueError):
    """Bad input; the message names the file and column or the model tensor."""


# --- the CSV ----------------------------------------------------------------------------------

@dataclass
class Kernel:
    index: int            # ncu's ID (launch order within the profiled process)
    name: str
    time_s: float
    dram_bytes: float
    grid: int | None
    kind: str


def kernel_kind(name: str) -> str:
    for kind, sub in KINDS:
        if sub in name:
            return kind
    return "other"


def _number(text: str, where: str) -> float:
    t = text.strip().replace(",", "")        # ncu groups thousands: "10,240,000"
    try:
        return float(t)
    except ValueError:
        raise BreakdownError(f"{where}: {text!r} is not a number") from None


def _grid_of(row: dict, where: str, scale: float = 1.0) -> int | None:
    if row.get(GRID, "").strip() not in ("", "n/a"):
        return round(_number(row[GRID], where + f" column {GRID!r}") * scale)
    g = row.get("Grid Size", "").strip()          # "(5, 1, 1)"
    nums = re.findall(r"\d+", g.replace(",", " "))
    if nums:
        return math.prod(int(x) for x in nums)
    return None


def parse_ncu_csv(text: str, source: str = "<csv>") -> list[Kernel]:
    """Kernels of ncu's `--csv --page raw` output in launch order. Lines before the header
    (==PROF== messages, the program's own output) are skipped; the units row (ns, usecond,
    Kbyte, MB, ...) scales values to bytes and seconds, and a unit not known by name is refused;
    numbers may carry thousands separators."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise BreakdownError(f"{source}: no ncu raw CSV header (a line starting with \"ID\") found")
    rows = [r for r in csv.reader(io.StringIO("\n".join(l for l in lines[start:] if not l.startswith("==")))) if r]
    header = rows[0]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise BreakdownError(f"{source}: column {missing[0]!r} is missing from the ncu CSV "
                             f"(columns: {', '.join(header)}); run ncu with --page raw --metrics "
                             f"{TIME},{READ},{WRITE},{GRID}")
    body = rows[1:]
    units = {c: "" for c in header}
    if body and body[0] and body[0][0].strip() == "":       # the units row: "", ..., "byte", "nsecond"
        units = dict(zip(header, body[0]))
        body = body[1:]

    def scale(col: str, dim: str) -> float:
        return unit_scale(units.get(col, ""), dim, f"{source}: column {col!r}")

    s_time, s_read, s_write = scale(TIME, SECOND), scale(READ, BYTE), scale(WRITE, BYTE)
    s_grid = scale(GRID, COUNT) if GRID in header else 1.0
    out = []
    for n, r in enumerate(body):
        if len(r) != len(header):
            raise BreakdownError(f"{source}: row {n + 1} has {len(r)} fields, the header {len(header)}")
        row = dict(zip(header, r))
        where = f"{source} row {n + 1}"
        if row[TIME].strip().lower() in ("", "n/a"):
            raise BreakdownError(f"{where}: no value in column {TIME!r}")
        idx = int(_number(row["ID"], where + " column 'ID'")) if "ID" in row else n
        name = row["Kernel Name"]
        out.append(Kernel(idx, name, _number(row[TIME], f"{where} column {TIME!r}") * s_time,
                          (_number(row[READ], f"{where} column {READ!r}") * s_read
                           + _number(row[WRITE], f"{where} column {WRITE!r}") * s_write),
                          _grid_of(row, where, s_grid), kernel_kind(name)))
    out.sort(key=lambda k: k.index)
    return out


# --- the engine's launch order ------------------------------------------------------------------

@dataclass
class Slot:
    """One launch of engine.cu's order: its kind, phase, the matrices it reads, its floor terms."""
    kind: str
    phase: str
    tensors: tuple[str, ...] = ()
    min_bytes: float = 0.0
    flops: float = 0.0
    optional: bool = False
    pre: str = ""         # a matvec's preceding kernel on its path: "prep" (f16), "quantize_x" (int8), "" none


class Model:
    """What the floors and the launch order need from the model file: config, tensor bytes/shapes
    and ggml types (the decode matvec path picks its kernels by type)."""

    def __init__(self, config, tensors: dict[str, tuple[int, tuple[int, ...]]], types: dict[str, str] | None = None):
        self.config = config
        self.tensors = tensors      # name -> (n_bytes, ne)
        self.types = types or {}    # name -> ggml type name ("Q4_K", "Q6_K", "F32", ...)

    @classmethod
    def open(cls, path: Path) -> "Model":
        from openjet_plugin.model_file import open_model

        mf = open_model(path)
        try:
            return cls(mf.config, {n: (int(t.n_bytes), tuple(int(x) for x in t.ne)) for n, t in mf.tensors.items()},
                       {n: str(t.ggml_type) for n, t in mf.tensors.items()})
        finally:
            mf.close()

    def bytes_of(self, name: str) -> int:
        if name not in self.tensors:
            raise BreakdownError(f"model tensor {name!r} not found (the engine reads it in this pass)")
        return self.tensors[name][0]

    def shape_of(self, name: str) -> tuple[int, int]:
        """(K, M): the matrix's input width and output rows."""
        self.bytes_of(name)
        ne = self.tensors[name][1]
        return ne[0], (ne[1] if len(ne) > 1 else 1)

    def type_of(self, name: str) -> str:
        self.bytes_of(name)
        if name not in self.types:
            raise BreakdownError(f"model tensor {name!r}: its ggml type is not known (the matvec path's kernels "
                                 f"depend on it); open the model with Model.open")
        return self.types[name]

    def matvec(self, kind_phase: str, names: str | tuple[str, ...], n: int, pre: str = "") -> Slot:
        """One matvec launch reading the matrices `names` (several: a grouped launch), preceded by a
        `pre` kernel (prep, quantize_x) when the path launches one; the floor is the sum of the
        members' own floors (weights + x in + y out each), so a layer's floor is the same whether
        its projections run grouped or one by one."""
        names = (names,) if isinstance(names, str) else tuple(names)
        min_bytes = flops = 0.0
        for name in names:
            nb = self.bytes_of(name)
            k_in, m_out = self.shape_of(name)
            min_bytes += nb + 4.0 * n * (k_in + m_out)
            flops += 2.0 * n * k_in * m_out
        return Slot("matvec", kind_phase, names, min_bytes, flops, pre=pre)

    def head_name(self, mtp: bool) -> str:
        if mtp:
            own = f"blk.{self.config.mtp_layer}.nextn.shared_head_head.weight"
            if own in self.tensors:
                return own
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"


# The decode-matvec paths (native/matvec.cu path(), OPENJET_MATVEC): "f16" (unset, the default),
# "bf16" (bf16-split) and "int8" (int8 activations).
MATVEC_PATHS = ("f16", "bf16", "int8")
DEFAULT_MATVEC = "f16"
F16_TYPES = ("Q4_K", "Q6_K")                     # matvec_f16.cuh supports()
QUANT_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")   # the int8 path's types (others: the float kernel)
QK_K = 256
GROUP_MAX = 4                                    # matvec_f16.cuh GROUP_MAX: matrices of one grouped launch
PRE_KINDS = ("quantize_x", "prep")               # kernels that prepare x for the matvec after them


def check_path(path: str) -> str:
    if path not in MATVEC_PATHS:
        raise BreakdownError(f"matvec path {path!r} is not one of {', '.join(MATVEC_PATHS)} "
                             f"(native/matvec.cu's OPENJET_MATVEC paths)")
    return path


def f16_fits(m: Model, name: str, path: str) -> bool:
    """matvec.cu f16_fits: on the fp16 path, a Q4_K or Q6_K matrix whose K is a multiple of 256."""
    k_in, _ = m.shape_of(name)
    return path == "f16" and m.type_of(name) in F16_TYPES and k_in > 0 and k_in % QK_K == 0


def pre_kernel(m: Model, name: str, path: str) -> str:
    """The kernel matvec.cu launches before the matvec of `name` on `path` (launch_any): the fp16
    path's prep for the types it takes, the int8 path's quantize_x for quantised types, else none."""
    if f16_fits(m, name, path):
        return "prep"
    if path == "int8" and m.type_of(name) in QUANT_TYPES:
        return "quantize_x"
    return ""


def _role(name: str) -> str:
    """blk.3.attn_q.weight -> attn_q; blk.4.nextn.eh_proj.weight -> nextn.eh_proj."""
    parts = name.removesuffix(".weight").split(".")
    return ".".join(parts[2:]) if parts[0] == "blk" else ".".join(parts)


def matvec_group(m: Model, names: list[str], n: int, path: str) -> list[Slot]:
    """The launches of matvec.cu matvec_group over `names` (matrices reading one x), in order: for
    the first member not yet done, when it fits the fp16 path it collects every not-done member of
    its type with rows, up to GROUP_MAX, from itself on; two or more run as ONE prep + ONE matvec
    (one slot reading all of them, phase "projections: a+b+c"); otherwise it runs alone as matvec()
    would. Other paths: one launch (pair) per member. Mirrors the engine's loop as written."""
    check_path(path)
    for x in names[1:]:
        if m.shape_of(x)[0] != m.shape_of(names[0])[0]:
            raise BreakdownError(f"model tensor {x!r} has K {m.shape_of(x)[0]}, {names[0]!r} K {m.shape_of(names[0])[0]}: "
                                 f"matvec_group's matrices read one x, so share K")
    done = [False] * len(names)
    out = []
    for i, name in enumerate(names):
        if done[i] or m.shape_of(name)[1] <= 0:   # no rows: the engine skips it
            continue
        members = []
        if f16_fits(m, name, path) and 1 <= n <= 8:
            for k in range(i, len(names)):
                if len(members) == GROUP_MAX:
                    break
                if not done[k] and m.type_of(names[k]) == m.type_of(name) and m.shape_of(names[k])[1] > 0:
                    members.append(names[k])
                    done[k] = True
        if len(members) >= 2:
            out.append(m.matvec("projections: " + "+".join(_role(x) for x in members), tuple(members), n, pre="prep"))
        else:
            done[i] = True
            out.append(m.matvec(f"projections: {_role(name)}", name, n, pre=pre_kernel(m, name, path)))
    return out


def _matvec(m: Model, phase: str, name: str, n: int, path: str) -> Slot:
    """A single matvec() (matvec_rows() too: same kernels) of `name` on `path`."""
    return m.matvec(phase, name, n, pre=pre_kernel(m, name, path))


def _norm(c, n: int, width: int) -> Slot:
    return Slot("rms_norm", ELEMENTWISE, min_bytes=4.0 * (2 * n * width + width))


def _ffn(m: Model, il: int, n: int, path: str = DEFAULT_MATVEC) -> list[Slot]:
    c = m.config
    p = f"blk.{il}."
    return [_norm(c, n, c.n_embd),
            *matvec_group(m, [p + "ffn_gate.weight", p + "ffn_up.weight"], n, path),
            Slot("swiglu", ELEMENTWISE, min_bytes=4.0 * 3 * n * c.n_ff),
            _matvec(m, "projections: ffn_down", p + "ffn_down.weight", n, path)]


def _attention(m: Model, il: int, n: int, depth: int, kv_bytes: float, path: str = DEFAULT_MATVEC) -> list[Slot]:
    c = m.config
    p = f"blk.{il}."
    kv = kv_bytes * c.kv_dim * 2 * (depth + n)          # K and V of every position so far
    qk_flops = 4.0 * n * c.n_head * c.head_dim * (depth + n)
    return [*matvec_group(m, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], n, path),
            Slot("attn_prepare", ATTENTION, min_bytes=4.0 * n * (2 * c.q_dim + 2 * c.kv_dim) + kv_bytes * 2 * n * c.kv_dim),
            Slot("attn_partial", ATTENTION, min_bytes=kv, flops=qk_flops),
            Slot("attn_combine", ATTENTION, min_bytes=4.0 * n * 2 * c.q_dim),
            _matvec(m, "projections: attn_output", p + "attn_output.weight", n, path)]


def _deltanet(m: Model, il: int, n: int, path: str = DEFAULT_MATVEC) -> list[Slot]:
    c = m.config
    p = f"blk.{il}."
    state = 4.0 * c.ssm_dt_rank * c.ssm_d_state ** 2          # read, and written back after the replay
    conv_state = 4.0 * c.ssm_conv_dim * (c.ssm_conv_kernel - 1)
    return [*matvec_group(m, [p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_beta.weight",
                              p + "ssm_alpha.weight"], n, path),
            # the conv kernel also L2-norms q and k (decode-sized passes: deltanet.cu)
            Slot("conv", DELTANET, min_bytes=2 * conv_state + 4.0 * 2 * n * c.ssm_conv_dim),
            Slot("recurrence", DELTANET, min_bytes=2 * state + 4.0 * n * (c.ssm_conv_dim + c.ssm_value_dim),
                 flops=6.0 * n * c.ssm_dt_rank * c.ssm_d_state ** 2),
            Slot("gated_norm", DELTANET, min_bytes=4.0 * 3 * n * c.ssm_value_dim),
            _matvec(m, "projections: ssm_out", p + "ssm_out.weight", n, path)]


def _embed(m: Model, name: str, n: int) -> Slot:
    nb, ne = m.bytes_of(name), m.tensors[name][1]
    rows = ne[1] if len(ne) > 1 else 1
    return Slot("embed", "embedding", (), n * nb / rows + 4.0 * n * m.config.n_embd)


def verify_program(m: Model, n: int, depth: int, kv_bytes: float = 2.0, matvec: str = DEFAULT_MATVEC) -> list[Slot]:
    """engine_verify's launches for n positions at n_past = depth, on the decode-matvec path `matvec`."""
    c = m.config
    check_path(matvec)
    prog = [_embed(m, "token_embd.weight", n)]
    for il in range(c.n_layer):
        prog.append(_norm(c, n, c.n_embd))
        prog += _deltanet(m, il, n, matvec) if c.is_recurrent(il) else _attention(m, il, n, depth, kv_bytes, matvec)
        prog += _ffn(m, il, n, matvec)
    prog.append(_norm(c, n, c.n_embd))
    head = _matvec(m, "output head", m.head_name(False), n, matvec)
    prog += [head, Slot("argmax", "argmax", min_bytes=4.0 * n * c.n_vocab)]
    return prog


def mtp_program(m: Model, n: int, depth: int, kv_bytes: float = 2.0, matvec: str = DEFAULT_MATVEC) -> list[Slot]:
    """engine_mtp_eval's launches for n positions at MTP position depth, on the path `matvec`."""
    c = m.config
    check_path(matvec)
    il = c.mtp_layer
    if il is None:
        raise BreakdownError("the model has no MTP block (nextn_predict_layers = 0), but the CSV has MTP passes")
    p = f"blk.{il}."
    own_embed = p + "nextn.embed_tokens.weight"
    prog = [_embed(m, own_embed if own_embed in m.tensors else "token_embd.weight", n),
            _norm(c, n, c.n_embd), _norm(c, n, c.n_embd),
            _matvec(m, "projections: nextn.eh_proj", p + "nextn.eh_proj.weight", n, matvec),
            _norm(c, n, c.n_embd)]
    prog += _attention(m, il, n, depth, kv_bytes, matvec)
    prog += _ffn(m, il, n, matvec)
    prog.append(_norm(c, n, c.n_embd))
    prog += [_matvec(m, "output head (MTP shared head)", m.head_name(True), n, matvec),
             Slot("argmax", "argmax", min_bytes=4.0 * n * c.n_vocab),
             Slot("map_ids", "argmax", optional=True)]
    return prog


# --- passes -------------------------------------------------------------------------------------

def split_passes(kernels: list[Kernel], source: str) -> list[list[Kernel]]:
    if not kernels:
        raise BreakdownError(f"{source}: the CSV has no kernel rows (was the profiling window empty?)")
    if kernels[0].kind != "embed":
        raise BreakdownError(f"{source}: the first kernel is {kernels[0].name!r}, not the embedding lookup "
                             f"that starts every pass (was the window opened mid-pass?)")
    passes: list[list[Kernel]] = []
    for k in kernels:
        if k.kind == "embed":
            passes.append([])
        passes[-1].append(k)
    return passes


def pass_signature(p: list[Kernel]) -> tuple[str, int]:
    """('verify' | 'mtp', positions)."""
    n = p[0].grid if p[0].grid else 0
    kinds = [k.kind for k in p[:6] if k.kind not in PRE_KINDS][:3]
    mtp = len(kinds) >= 3 and kinds[1] == "rms_norm" and kinds[2] == "rms_norm"
    return ("mtp" if mtp else "verify"), n


def group_name(kind: str, n: int) -> str:
    if kind == "mtp":
        return "mtp" if n == 1 else f"mtp{n}"
    return "decode1" if n == 1 else f"verify{n}"


def _pre_text(kinds: list[str]) -> str:
    return " + ".join(kinds) if kinds else "no x-preparing kernel"


def align(p: list[Kernel], prog: list[Slot]) -> list[tuple[Kernel, Slot]]:
    """Kernels of one pass matched to the launch order; raises BreakdownError where they part. The
    kernel that prepares a matvec's x (prep, quantize_x) belongs to the matvec after it, and must
    be the one its slot's path launches there (none, on the bf16 path)."""
    out, j, pending = [], 0, []
    for k in p:
        if k.kind in PRE_KINDS:
            pending.append(k)
            continue
        while j < len(prog) and prog[j].kind != k.kind and prog[j].optional:
            j += 1
        if j >= len(prog) or prog[j].kind != k.kind:
            want = prog[j].kind if j < len(prog) else "the end of the pass"
            raise BreakdownError(f"kernel {k.index} ({k.kind}: {k.name[:60]}) where engine.cu's order has {want} "
                                 f"(launch {j} of the pass)")
        if pending and k.kind != "matvec":
            raise BreakdownError(f"kernel {pending[0].index} {pending[0].kind} is not followed by a matvec")
        got, want = [q.kind for q in pending], ([prog[j].pre] if prog[j].pre else [])
        if got != want:
            raise BreakdownError(f"kernel {k.index} (matvec of {prog[j].phase}) comes after {_pre_text(got)} where "
                                 f"the engine's path launches {_pre_text(want)} (launch {j} of the pass)")
        out += [(q, prog[j]) for q in pending] + [(k, prog[j])]
        pending = []
        j += 1
    if pending:
        raise BreakdownError(f"kernel {pending[0].index} {pending[0].kind} is not followed by a matvec")
    rest = [s.kind for s in prog[j:] if not s.optional]
    if rest:
        raise BreakdownError(f"the pass ends {len(rest)} launches early (next expected: {rest[0]})")
    return out


def path_of_kernels(passes: list[list[Kernel]]) -> str | None:
    """The decode-matvec path the kernels show, where they show one: quantize_x only runs on the
    int8 path, prep only on the fp16 path; neither (bf16, or no Q4_K/Q6_K matrix) tells nothing."""
    kinds = {k.kind for p in passes for k in p}
    if "quantize_x" in kinds:
        return "int8"
    if "prep" in kinds:
        return "f16"
    return None


@dataclass
class PhaseRow:
    phase: str
    kernels: float = 0.0
    time_s: float = 0.0
    dram_bytes: float = 0.0
    min_bytes: float = 0.0
    weight_bytes: float = 0.0
    flops: float = 0.0


@dataclass
class GroupResult:
    name: str
    kind: str
    positions: int
    passes: int
    mapped: bool
    note: str
    rows: dict[str, PhaseRow] = field(default_factory=dict)
    wall_s: float | None = None

    @property
    def kernel_time_s(self) -> float:
        return sum(r.time_s for r in self.rows.values())


def summarize_group(name: str, kind: str, n: int, passes: list[list[Kernel]], model: Model | None,
                    depth: int, kv_bytes: float, matvec: str = DEFAULT_MATVEC) -> GroupResult:
    prog = None
    note = ""
    if model is not None:
        prog = (mtp_program if kind == "mtp" else verify_program)(model, n, depth, kv_bytes, matvec)
    pairs_per_pass = []
    if prog is not None:
        try:
            pairs_per_pass = [align(p, prog) for p in passes]
        except BreakdownError as e:
            note = f"roles by kernel name only: launch order differs from engine.cu on the {matvec} matvec path ({e})"
            seen = path_of_kernels(passes)
            if seen and seen != matvec:
                note += f"; the kernels look like the {seen} path: try --matvec {seen}"
            pairs_per_pass = []
    else:
        note = "roles by kernel name only: no model file given"
    mapped = bool(pairs_per_pass)
    g = GroupResult(name, kind, n, len(passes), mapped, note)

    def row(phase: str) -> PhaseRow:
        return g.rows.setdefault(phase, PhaseRow(phase))

    if mapped:
        for pairs in pairs_per_pass:
            for k, s in pairs:
                r = row(s.phase)
                r.kernels += 1
                r.time_s += k.time_s
                r.dram_bytes += k.dram_bytes
        for s in prog:       # floors once per pass (a slot's bytes do not depend on its kernels)
            if s.phase in g.rows:
                r = g.rows[s.phase]
                r.min_bytes += s.min_bytes * len(passes)
                r.flops += s.flops * len(passes)
                r.weight_bytes += sum(model.bytes_of(t) for t in s.tensors) * len(passes)
    else:
        for p in passes:
            for k in p:
                r = row(PHASE_OF_KIND.get(k.kind, f"other: {k.name[:40]}"))
                r.kernels += 1
                r.time_s += k.time_s
                r.dram_bytes += k.dram_bytes
    for r in g.rows.values():      # per pass
        for f in ("kernels", "time_s", "dram_bytes", "min_bytes", "weight_bytes", "flops"):
            setattr(r, f, getattr(r, f) / len(passes))
    return g


def analyse(kernels_by_source: list[tuple[str, list[Kernel]]], model: Model | None, depth: int,
            kv_bytes: float = 2.0, matvec: str = DEFAULT_MATVEC) -> dict[str, GroupResult]:
    """Every pass of every CSV, grouped by signature (decode1, verify5, mtp, ...); `matvec` is the
    decode-matvec path the profiled process ran (f16, bf16, int8)."""
    check_path(matvec)
    groups: dict[str, tuple[str, int, list]] = {}
    for source, kernels in kernels_by_source:
        for p in split_passes(kernels, source):
            kind, n = pass_signature(p)
            if n < 1:
                raise BreakdownError(f"{source}: pass at kernel {p[0].index} has no grid size for its embedding "
                                     f"launch (add {GRID} to ncu's --metrics)")
            gname = group_name(kind, n)
            groups.setdefault(gname, (kind, n, []))[2].append(p)
    return {name: summarize_group(name, kind, n, ps, model, depth, kv_bytes, matvec)
            for name, (kind, n, ps) in groups.items()}


# --- the table ----------------------------------------------------------------------------------

def floor_s(r: PhaseRow, gbps: float, tflops: float) -> float:
    return max(r.min_bytes / (gbps * 1e9), r.flops / (tflops * 1e12))


def _is_projection(name: str) -> bool:
    return name.startswith("projections") or name.startswith("output head")


def group_json(g: GroupResult, gbps: float, tflops: float) -> dict:
    rows = []
    first = {name: i for i, name in enumerate(g.rows)}     # launch order of the phases' first kernels
    for r in sorted(g.rows.values(), key=lambda r: (not _is_projection(r.phase), first[r.phase])):
        fl = floor_s(r, gbps, tflops) if g.mapped else None
        rows.append({
            "phase": r.phase, "kernels": r.kernels, "time_us": r.time_s * 1e6,
            "share": r.time_s / g.kernel_time_s if g.kernel_time_s else None,
            "dram_bytes": r.dram_bytes, "achieved_gbps": r.dram_bytes / r.time_s / 1e9 if r.time_s else None,
            "dram_floor_us": r.dram_bytes / (gbps * 1e9) * 1e6,
            "weight_bytes": r.weight_bytes if g.mapped else None,
            "min_bytes": r.min_bytes if g.mapped else None, "flops": r.flops if g.mapped else None,
            "floor_us": fl * 1e6 if fl is not None else None,
            "bound": (("flops" if r.flops / (tflops * 1e12) > r.min_bytes / (gbps * 1e9) else "bytes")
                      if g.mapped else None),
            "pct_of_floor": fl / r.time_s * 100 if fl is not None and r.time_s else None,
        })
    kt = g.kernel_time_s
    proj = [r for r in rows if _is_projection(r["phase"])]
    pt = sum(r["time_us"] for r in proj)
    projections = {"kernels": sum(r["kernels"] for r in proj), "time_us": pt,
                   "share": pt / (kt * 1e6) if kt else None,
                   "dram_bytes": sum(r["dram_bytes"] for r in proj),
                   "weight_bytes": sum(r["weight_bytes"] for r in proj) if g.mapped else None,
                   "floor_us": sum(r["floor_us"] for r in proj) if g.mapped else None}
    projections["achieved_gbps"] = projections["dram_bytes"] / pt / 1e3 if pt else None
    projections["pct_of_floor"] = (projections["floor_us"] / pt * 100
                                   if projections["floor_us"] is not None and pt else None)
    out = {"projections_total": projections, "group": g.name, "kind": g.kind, "positions": g.positions, "passes": g.passes,
           "roles_mapped": g.mapped, "note": g.note, "rows": rows, "kernel_time_us": kt * 1e6,
           "kernels_per_pass": sum(r.kernels for r in g.rows.values()),
           "floor_us": sum(r["floor_us"] or 0 for r in rows) if g.mapped else None}
    if g.wall_s:
        out["wall_us"] = g.wall_s * 1e6
        out["host_and_launch_us"] = (g.wall_s - kt) * 1e6
        out["kernel_share_of_wall"] = kt / g.wall_s
        if g.kind == "verify":
            out["tokens_per_s_all_accepted"] = g.positions / g.wall_s
    return out


def cycle_json(groups: dict[str, dict], draft_depth: int) -> dict | None:
    """One speculative cycle at draft depth D: the verify of D + 1 positions and D MTP steps."""
    v, m = groups.get(f"verify{draft_depth + 1}"), groups.get("mtp")
    if not v or not m:
        return None
    rows = [dict(r) for r in v["rows"]]
    mt = {"phase": f"MTP block ({draft_depth} draft steps)", "kernels": draft_depth * m["kernels_per_pass"],
          "time_us": draft_depth * m["kernel_time_us"],
          "dram_bytes": draft_depth * sum(r["dram_bytes"] for r in m["rows"]),
          "floor_us": draft_depth * m["floor_us"] if m["floor_us"] is not None else None}
    mt["achieved_gbps"] = mt["dram_bytes"] / mt["time_us"] / 1e3 if mt["time_us"] else None
    mt["pct_of_floor"] = mt["floor_us"] / mt["time_us"] * 100 if mt["floor_us"] is not None and mt["time_us"] else None
    mt["dram_floor_us"] = draft_depth * sum(r["dram_floor_us"] for r in m["rows"])
    rows.append(mt)
    kt = v["kernel_time_us"] + mt["time_us"]
    for r in rows:
        r["share"] = r["time_us"] / kt if kt else None
    out = {"group": f"cycle D={draft_depth}", "kind": "cycle", "positions": draft_depth + 1, "rows": rows,
           "kernel_time_us": kt, "roles_mapped": v["roles_mapped"] and m["roles_mapped"], "note": "",
           "floor_us": (v["floor_us"] + mt["floor_us"]) if v["floor_us"] is not None and mt["floor_us"] is not None else None}
    if "wall_us" in v and "wall_us" in m:
        wall = v["wall_us"] + draft_depth * m["wall_us"]
        out["wall_us"] = wall
        out["host_and_launch_us"] = wall - kt
        out["kernel_share_of_wall"] = kt / wall
        out["tokens_per_s_by_accepted"] = {a: a / wall * 1e6 for a in range(1, draft_depth + 2)}
    return out


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def markdown(g: dict, gbps: float) -> str:
    lines = [f"### {g['group']} ({g['positions']} position{'s' if g['positions'] != 1 else ''} per pass"
             + (f", mean of {g['passes']} passes" if g.get("passes") else "") + ")", ""]
    if g.get("note"):
        lines += [f"_{g['note']}_", ""]
    lines += ["| phase | kernels | time µs | share | DRAM MB | GB/s | weights MB | floor µs | bound | % of floor |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in g["rows"]:
        lines.append(f"| {r['phase']} | {r['kernels']:.0f} | {r['time_us']:.1f} | {_f(r.get('share') and r['share'] * 100, '.1f')}% "
                     f"| {r['dram_bytes'] / 1e6:.2f} | {_f(r.get('achieved_gbps'), '.0f')} "
                     f"| {_f(r.get('weight_bytes') and r['weight_bytes'] / 1e6, '.1f')} | {_f(r.get('floor_us'), '.1f')} "
                     f"| {r.get('bound') or '–'} | {_f(r.get('pct_of_floor'), '.1f')} |")
    kt = g["kernel_time_us"]
    p = g.get("projections_total")
    if p:
        lines.append(f"| *all projections + head* | {p['kernels']:.0f} | *{p['time_us']:.1f}* | {_f(p['share'] and p['share'] * 100, '.1f')}% "
                     f"| {p['dram_bytes'] / 1e6:.2f} | {_f(p['achieved_gbps'], '.0f')} "
                     f"| {_f(p['weight_bytes'] and p['weight_bytes'] / 1e6, '.1f')} | {_f(p['floor_us'], '.1f')} | "
                     f"| {_f(p['pct_of_floor'], '.1f')} |")
    lines.append(f"| **sum of kernels** | {sum(r['kernels'] for r in g['rows']):.0f} | **{kt:.1f}** | 100% "
                 f"| {sum(r['dram_bytes'] for r in g['rows']) / 1e6:.1f} | | | {_f(g.get('floor_us'), '.1f')} | "
                 f"| {_f(g.get('floor_us') and g['floor_us'] / kt * 100, '.1f')} |")
    if "wall_us" in g:
        rest = g["host_and_launch_us"]
        # under ncu each kernel runs alone (serialised, caches flushed, its own timing), so the sum can
        # exceed the wall time of the same pass run freely; then no launch gap can be read off
        rest_text = (f"host+launch {rest:.1f} µs" if rest >= 0 else
                     f"kernels under ncu exceed the wall by {-rest:.1f} µs: gaps not measurable")
        lines.append(f"| **wall per pass (no ncu)** | | **{g['wall_us']:.1f}** | kernels {g['kernel_share_of_wall'] * 100:.1f}% "
                     f"| | | | | | {rest_text} |")
        if "tokens_per_s_all_accepted" in g:
            lines.append(f"| implied tokens/s | | {g['tokens_per_s_all_accepted']:.1f} | "
                         f"({g['positions']} accepted per pass) | | | | | | |")
        if "tokens_per_s_by_accepted" in g:
            tps = ", ".join(f"{a}: {t:.1f}" for a, t in g["tokens_per_s_by_accepted"].items())
            lines.append(f"| implied tokens/s by accepted per cycle | | | {tps} | | | | | | |")
    lines.append("")
    return "\n".join(lines)


def _timing_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BreakdownError(f"{path}: cannot read the timing JSON ({e})") from None
    if not isinstance(d, dict):
        raise BreakdownError(f"{path}: the timing JSON is not an object")
    return d


def timing_matvec_path(path: Path) -> str | None:
    """The decode-matvec path phase_probe.py recorded ("matvec_path"), None when it has none."""
    d = _timing_json(path)
    if "matvec_path" not in d:
        return None
    if d["matvec_path"] not in MATVEC_PATHS:
        raise BreakdownError(f"{path}: 'matvec_path' is {d['matvec_path']!r}, not one of {', '.join(MATVEC_PATHS)}")
    return d["matvec_path"]


def load_timing(path: Path) -> dict[str, float]:
    """group -> median wall seconds per pass, from phase_probe.py --time's JSON."""
    d = _timing_json(path)
    out = {}
    for name, g in d.get("groups", {}).items():
        if "wall_us" not in g:
            raise BreakdownError(f"{path}: group {name!r} has no 'wall_us'")
        out[name] = statistics.median(g["wall_us"]) / 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, action="append", required=True, help="ncu raw CSV (repeatable)")
    ap.add_argument("--model", type=Path, help="the GGUF the probe ran (weight bytes, launch order)")
    ap.add_argument("--timing", type=Path, help="phase_probe.py --time JSON (wall time per pass without ncu)")
    ap.add_argument("--depth", type=int, default=512, help="n_past at the profiled passes (KV read floor)")
    ap.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per KV value (f16 2; q8_0 34/32)")
    ap.add_argument("--draft-depth", type=int, default=4, help="D of the cycle table (verify D+1 + D MTP steps)")
    ap.add_argument("--gbps", type=float, default=STREAM_GBPS, help=f"streaming rate (default {STREAM_GBPS})")
    ap.add_argument("--tflops", type=float, default=MATRIX_TFLOPS, help=f"matrix rate (default {MATRIX_TFLOPS})")
    ap.add_argument("--matvec", choices=MATVEC_PATHS,
                    help="the decode-matvec path the probe ran (OPENJET_MATVEC; it sets which projections run as "
                         "one grouped launch); default: the timing JSON's matvec_path, else f16")
    ap.add_argument("--json", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    try:
        matvec, matvec_from = args.matvec, "--matvec"
        if matvec is None and args.timing:
            matvec, matvec_from = timing_matvec_path(args.timing), f"{args.timing}"
        if matvec is None:
            matvec, matvec_from = DEFAULT_MATVEC, "the engine's default"
        sources = []
        for p in args.csv:
            try:
                text = p.read_text(errors="replace")
            except OSError as e:
                raise BreakdownError(f"{p}: cannot read ({e})") from None
            sources.append((str(p), parse_ncu_csv(text, str(p))))
        model = Model.open(args.model) if args.model else None
        groups = analyse(sources, model, args.depth, args.kv_bytes, matvec)
        if args.timing:
            for name, wall in load_timing(args.timing).items():
                if name in groups:
                    groups[name].wall_s = wall
    except BreakdownError as e:
        print(f"phase_breakdown: {e}", file=sys.stderr)
        return 1
    order = sorted(groups, key=lambda n: (n != "decode1", groups[n].kind == "mtp", n))
    js = {n: group_json(groups[n], args.gbps, args.tflops) for n in order}
    cyc = cycle_json(js, args.draft_depth)
    result = {"gbps": args.gbps, "tflops": args.tflops, "depth": args.depth, "matvec_path": matvec,
              "groups": js, "cycle": cyc}
    print(f"Floors: bytes / {args.gbps:.0f} GB/s or multiply-adds / {args.tflops:.0f} TFLOP/s, whichever is "
          f"larger; DRAM bytes as ncu counted them (caches flushed per kernel unless --cache-control none). "
          f"Decode matvec path: {matvec} (from {matvec_from}); a phase \"projections: a+b\" is one grouped "
          f"launch reading those matrices.\n")
    for n in order:
        print(markdown(js[n], args.gbps))
    if cyc:
        print(markdown(cyc, args.gbps))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
