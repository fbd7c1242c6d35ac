"""The decode-attention partial kernel (native/attention.cu, attention_partial_chunked_kernel; its scan
is chunked_scan in attention_common.cuh) without a GPU.

- Its algorithm transcribed in numpy, step for step: split-K blocks of SPLIT = 256 cached positions,
  4 warps per block interleaving row by row, each warp taking its positions C at a time (positions
  at or past the causal length masked: zero rows, score -inf), the reduce-scatter butterfly that sums
  the C dots over the 32 lanes, one online-softmax step per chunk, the block's warp merge and the
  combine over splits; checked against a direct softmax for lengths around every boundary
  (chunk stride 4 C, SPLIT) and the chunk the kernel is built with (C = 4; 8 as well, the same
  algorithm at twice the stride). The GPU suite checks the kernel itself against the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

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
    interleave row by row (chunked_scan's STEP: 4 in attention.cu)."""
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


@pytest.mark.parametrize("c,warps", [(4, 4), (8, 4)])
def test_chunked_online_softmax_equals_direct_softmax(c, warps):
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
