"""The chunked decode-attention partial kernel (native/attention.cu, attention_partial_chunked_kernel,
OJ_ATTN_CHUNK=1; its scan, chunked_scan in attention_common.cuh, is also the persistent kernel's
partial phase with 8 warps) without a GPU.

- Its algorithm transcribed in numpy, step for step: split-K blocks of SPLIT = 256 cached positions,
  4 warps per block interleaving row by row, each warp taking its positions C at a time (positions
  at or past the causal length masked: zero rows, score -inf), the reduce-scatter butterfly that sums
  the C dots over the 32 lanes, one online-softmax step per chunk, the block's warp merge and the
  combine over splits; checked against a direct softmax for lengths around every boundary
  (chunk stride 4 C, SPLIT) and both chunks the kernel is built for.
- The GPU harness native/tools/attn_decode_bench.cu (which runs the kernel against the old one and
  a float64 reference on the GPU machine) compiles with attention.cu for sm_90 when nvcc is here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from cuda_tools import build_host_tool, find_nvcc

REPO = Path(__file__).resolve().parent.parent
SPLIT = 256          # attention.cu: cached positions per split-K block
WARPS = 4            # attention.cu: PARTIAL_WARPS
LANES = 32


# --- the butterfly ---------------------------------------------------------------------------------

def warp_sum_scatter(v: np.ndarray) -> np.ndarray:
    """attention.cu's warp_sum_scatter<C> on a warp: v is [32 lanes][C]; returns each lane's v[0]."""
    v = v.copy()
    c = v.shape[1]
    lane = np.arange(LANES)
    half, o = c // 2, 16
    while half >= 1:
        upper = (lane & o) != 0
        new = v.copy()
        for j in range(half):
            keep = np.where(upper, v[:, j + half], v[:, j])
            send = np.where(upper, v[:, j], v[:, j + half])
            new[:, j] = keep + send[lane ^ o]          # __shfl_xor_sync(send, o)
        v = new
        half //= 2
        o //= 2
    o = 16 // c
    while o >= 1:
        v[:, 0] = v[:, 0] + v[lane ^ o, 0]
        o //= 2
    return v[:, 0]


@pytest.mark.parametrize("c", [1, 2, 4, 8])
def test_butterfly_lane_holds_sum_of_its_chunk_position(c):
    rng = np.random.default_rng(c)
    v = rng.standard_normal((LANES, c))
    got = warp_sum_scatter(v)
    group = LANES // c
    want = v.sum(axis=0)[np.arange(LANES) // group]    # lanes [j * group, (j + 1) * group) hold sum j
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --- the chunked split-K online softmax ------------------------------------------------------------

def chunked_attention(scores: np.ndarray, values: np.ndarray, length: int, c: int, warps: int = WARPS):
    """One (head, position) of attention_partial_chunked_kernel + attention_combine_kernel (without
    the gate): scores [>= length] (already times 1/sqrt(D)), values [>= length][D]; rows at or past
    `length` must never be read (the caller fills them with NaN). warps: the block's warps that
    interleave row by row (chunked_scan's STEP: 4 in attention.cu, 8 in the persistent kernel)."""
    d = values.shape[1]
    n_splits = (length + SPLIT - 1) // SPLIT
    part_m, part_l, part_acc = [], [], []
    for split in range(n_splits):
        begin, end = split * SPLIT, min(split * SPLIT + SPLIT, length)
        wm, wl, wacc = [], [], []
        for warp in range(warps):
            m, l, acc = -np.inf, 0.0, np.zeros(d)
            p0 = begin + warp
            while p0 < end:
                ps = p0 + warps * np.arange(c)
                valid = ps < end
                # masked positions load nothing: zero rows, score -inf
                sc = np.where(valid, scores[np.minimum(ps, end - 1)], -np.inf)
                vr = np.where(valid[:, None], values[np.minimum(ps, end - 1)], 0.0)
                m_new = max(m, sc.max())
                assert np.isfinite(m_new), "a chunk's first position is always valid"
                corr = np.exp(m - m_new)
                w = np.exp(sc - m_new)
                acc = acc * corr + w @ vr
                l = l * corr + w.sum()
                m = m_new
                p0 += warps * c
            wm.append(m)
            wl.append(l)
            wacc.append(acc)
        big_m = max(wm)                       # the block's warp merge
        if big_m == -np.inf:
            part_m.append(-np.inf), part_l.append(0.0), part_acc.append(np.zeros(d))
            continue
        f = np.exp(np.array(wm) - big_m)
        part_m.append(big_m)
        part_l.append(float(np.dot(wl, f)))
        part_acc.append(np.array(wacc).T @ f)
    big_m = max(part_m)                       # attention_combine_kernel
    total_l, out = 0.0, np.zeros(d)
    for ms, ls, a in zip(part_m, part_l, part_acc):
        if ms == -np.inf:
            continue
        f = np.exp(ms - big_m)
        total_l += ls * f
        out += a * f
    return out / total_l


def boundary_lengths():
    ls = set()
    for edge in (1, 4, 8, 16, 32, SPLIT, 2 * SPLIT, 3 * SPLIT):
        for delta in (-2, -1, 0, 1, 2, 3, 5):
            if edge + delta >= 1:
                ls.add(edge + delta)
    rng = np.random.default_rng(7)
    ls.update(int(x) for x in rng.integers(1, 1200, size=12))
    return sorted(ls)


@pytest.mark.parametrize("c,warps", [(4, 4), (8, 4), (4, 8)])
def test_chunked_online_softmax_equals_direct_softmax(c, warps):
    """(4, 8): the persistent kernel's partial phase (chunked_scan with its 8 warps)."""
    rng = np.random.default_rng(100 + c + warps)
    d = 8
    for length in boundary_lengths():
        rows = length + 40
        scores = rng.standard_normal(rows) * 3.0
        values = rng.standard_normal((rows, d))
        scores[length:] = np.nan              # a read past the causal length would show
        values[length:] = np.nan
        got = chunked_attention(scores, values, length, c, warps)
        s = scores[:length]
        w = np.exp(s - s.max())
        want = (w / w.sum()) @ values[:length]
        assert np.all(np.isfinite(got)), f"length {length}, C {c}, {warps} warps: non-finite output"
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"length {length}, C {c}, {warps} warps")


def test_chunked_softmax_with_one_dominant_score_late_in_a_chunk():
    # the running max jumps inside a chunk: the correction must rescale the earlier chunks only once
    length, d = 300, 4
    scores = np.zeros(length + 8)
    scores[261] = 40.0                        # second split, warp 1, chunk position 1 (C = 4)
    values = np.arange((length + 8) * d, dtype=float).reshape(length + 8, d)
    got = chunked_attention(scores, values, length, 4)
    w = np.exp(scores[:length] - 40.0)
    want = (w / w.sum()) @ values[:length]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert abs(got[0] - values[261, 0]) < 1e-6 * values[261, 0]


# --- the KV-group kernel (attention_partial_group_kernel, OJ_ATTN_CHUNK=group) ----------------------

GT = 32              # attention.cu: rows per shared-memory tile
GROUP_WARPS = 8


def group_attention(scores: np.ndarray, values: np.ndarray, pos0: int, n: int, c: int = 4):
    """Every query of one KV group through attention_partial_group_kernel + the combine: scores
    [n][rows] (query i's, already times 1/sqrt(D)), values [rows][D]. A block per split walks its
    tiles of GT rows (rows past the block's end, pos0 + n, zero-filled); a query's warp takes the
    tile's rows C at a time in order while the chunk's first row is inside the query's causal end
    pos0 + i + 1 (rows past it inside the chunk score -inf). Returns [n][D]."""
    d = values.shape[1]
    n_splits = (pos0 + n + SPLIT - 1) // SPLIT
    out = np.zeros((n, d))
    for i in range(n):
        parts = []
        for split in range(n_splits):
            begin = split * SPLIT
            end = min(begin + SPLIT, pos0 + n)            # the block's end (its last query's)
            qend = min(begin + SPLIT, pos0 + i + 1)
            m, l, acc = -np.inf, 0.0, np.zeros(d)
            t0 = begin
            while t0 < end:
                rows = np.arange(t0, t0 + GT)
                tile_v = np.where((rows < end)[:, None], values[np.minimum(rows, end - 1)], 0.0)   # zero-filled
                r0 = 0
                while r0 < GT and t0 + r0 < qend:
                    ps = t0 + r0 + np.arange(c)
                    sc = np.where(ps < qend, scores[i, np.minimum(ps, qend - 1)], -np.inf)
                    vr = tile_v[r0:r0 + c]
                    m_new = max(m, sc.max())
                    assert np.isfinite(m_new), "a chunk's first row is always inside the query's end"
                    corr = np.exp(m - m_new)
                    w = np.exp(sc - m_new)
                    acc = acc * corr + w @ vr
                    l = l * corr + w.sum()
                    m = m_new
                    r0 += c
                t0 += GT
            parts.append((m, l, acc))
        big_m = max(p[0] for p in parts)
        total_l, o = 0.0, np.zeros(d)
        for ms, ls, a in parts:
            if ms == -np.inf:
                continue
            f = np.exp(ms - big_m)
            total_l += ls * f
            o += a * f
        out[i] = o / total_l
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_group_kernel_algorithm_equals_direct_softmax(n):
    rng = np.random.default_rng(300 + n)
    d = 8
    for pos0 in sorted({0, 1, 3, GT - 1, GT, GT + 1, SPLIT - n, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT - 3, 700}):
        if pos0 < 0:
            continue
        rows = pos0 + n + 64
        scores = rng.standard_normal((n, rows)) * 3.0
        values = rng.standard_normal((rows, d))
        scores[:, pos0 + n:] = np.nan                  # past the block's end: never read
        values[pos0 + n:] = np.nan
        got = group_attention(scores, values, pos0, n)
        for i in range(n):
            length = pos0 + i + 1
            s = scores[i, :length]
            w = np.exp(s - s.max())
            want = (w / w.sum()) @ values[:length]
            assert np.all(np.isfinite(got[i])), f"pos0 {pos0}, query {i}: non-finite"
            np.testing.assert_allclose(got[i], want, rtol=1e-10, atol=1e-12, err_msg=f"pos0 {pos0}, n {n}, query {i}")


# --- the GPU harness compiles ----------------------------------------------------------------------

def test_attn_decode_bench_compiles_for_sm90(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH or /usr/local/cuda/bin): the CUDA harness compile check needs it")
    exe = tmp_path / "attn_decode_bench"
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-Xptxas", "-v", "-Inative",
           "native/tools/attn_decode_bench.cu", "native/attention.cu", "-o", str(exe)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"nvcc failed:\n{r.stdout}\n{r.stderr}"
    assert exe.exists() and exe.stat().st_size > 0
    # ptxas reports every chunked partial kernel instance (D 64/128/256 x f16/q8_0 x C 4/8),
    # none spilling: a spill would put the rows in flight in local memory
    log = r.stdout + r.stderr
    entries = [line for line in log.splitlines() if "Compiling entry" in line and "partial_chunked" in line]
    assert len(entries) == 12, f"expected 12 chunked partial kernels, ptxas compiled {len(entries)}"
    groups = [line for line in log.splitlines() if "Compiling entry" in line and "partial_group" in line]
    assert len(groups) == 12, f"expected 12 group partial kernels (D x KV type x 2 or 6 queries a warp), got {len(groups)}"
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "Compiling entry" in line and ("partial_chunked" in line or "partial_group" in line):
            spill = next(x for x in lines[i + 1:i + 4] if "spill" in x)
            assert "0 bytes spill stores, 0 bytes spill loads" in spill, f"{line}\n{spill}"


def test_gpu_attn_decode_script_parses():
    r = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_attn_decode.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_oj_attn_chunk_values_and_a_bad_one_refused_by_name(tmp_path):
    """attention.cu's attention_chunk_setting, what partial_chunk reads OJ_ATTN_CHUNK with: unset and
    "1" take the default chunk (4), "0" keeps the one-position kernel, "4" / "8" that chunk, "group"
    the KV-group kernel (16); anything else is refused with the variable and the value in the message (exit 2 from harness.cuh's fail)."""
    exe = build_host_tool(tmp_path / "acs", ["native/tools/attn_chunk_setting_check.cu", "native/attention.cu"],
                          "the setting check")
    r = subprocess.run([str(exe), "unset", "0", "1", "4", "8", "group"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["unset", "4", "0", "0", "1", "4", "4", "4", "8", "8", "group", "16"]
    for bad in ("2", "yes", ""):
        r = subprocess.run([str(exe), "1", bad], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        assert r.stdout.split() == ["1", "4"]          # the good value before it was taken
        assert f"OJ_ATTN_CHUNK must be 0, 1, 4, 8 or group, not '{bad}'" in r.stderr
