"""The chunked (WY / UT-transform) gated delta rule against the plain sequential recurrence.

The reference is the loop below, written out here (the order of native/deltanet.cu's
deltanet_recurrence_kernel: decay, then the delta update, then the read-out).
"""

import numpy as np
import pytest

from openjet_plugin.testing.chunked_deltanet import (
    chunked_gated_delta, round_bf16, round_fp16, sequential_gated_delta)

D = 128   # d_state of the 27B model


def recurrence(q, k, v, g_log, beta, S0, decay_first=True):
    """S = g S; S += outer((v - S k) beta, k); o = S q   (decay_first=False: the broken order)."""
    S = S0.astype(np.float64).copy()
    o = np.empty(v.shape)
    for t in range(q.shape[-2]):
        if decay_first:
            S = S * np.exp(g_log[..., t])[..., None, None]
        d = (v[..., t, :] - np.einsum("...ji,...i->...j", S, k[..., t, :])) * beta[..., t, None]
        S = S + d[..., :, None] * k[..., t, None, :]
        if not decay_first:
            S = S * np.exp(g_log[..., t])[..., None, None]
        o[..., t, :] = np.einsum("...ji,...i->...j", S, q[..., t, :])
    return o, S


def inputs(rng, H, T, g_kind="mixed", d=D):
    """Inputs at the model's scales: q, k from SiLU (all-positive-leaning, so keys are strongly
    correlated: the hard case of the UT transform), L2-normed, q / sqrt(d); beta in (0, 1)."""
    silu = lambda x: x / (1 + np.exp(-x))
    q = silu(rng.normal(size=(H, T, d)) * 1.5)
    k = silu(rng.normal(size=(H, T, d)) * 1.5)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(d)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = silu(rng.normal(size=(H, T, d)) * 2.0)
    beta = 1 / (1 + np.exp(-2 * rng.normal(size=(H, T))))
    if g_kind == "mixed":     # decays from ~1 - 2e-3 down to ~e^-20, and a few exactly-forgetting ones
        g_log = -np.exp(rng.uniform(-6, 3, size=(H, T)))
        g_log[:, ::37] = -60.0            # g ~ 1e-26: the state is wiped
        g_log[:, 5::41] = -1e-7           # g ~ 1: nothing forgotten
    elif g_kind == "near1":
        g_log = -np.abs(rng.normal(size=(H, T))) * 1e-3
    else:
        raise ValueError(g_kind)
    S0 = rng.normal(size=(H, d, d)) * 0.5
    return q, k, v, g_log, beta, S0


def rel_max(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (63, 64), (64, 64), (64 * 3 + 17, 64), (100, 16)])
@pytest.mark.parametrize("g_kind", ["mixed", "near1"])
def test_chunked_matches_recurrence(T, chunk, g_kind):
    rng = np.random.default_rng(T * 7 + chunk)
    a = inputs(rng, 2, T, g_kind)
    o_ref, S_ref = recurrence(*a)
    o, S = chunked_gated_delta(*a, chunk=chunk)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    eo, es = rel_max(o, o_ref), rel_max(S, S_ref)
    assert eo <= 1e-10 and es <= 1e-10, f"float64: output {eo:.2e}, state {es:.2e}"
    o32, S32 = chunked_gated_delta(*a, chunk=chunk, dtype=np.float32)
    assert o32.dtype == np.float32
    eo, es = rel_max(o32, o_ref), rel_max(S32, S_ref)
    assert eo <= 1e-4 and es <= 1e-4, f"float32: output {eo:.2e}, state {es:.2e}"


def test_per_head_and_module_sequential_agree():
    """Unbatched [T, d] inputs work, and the module's sequential helper is this loop."""
    rng = np.random.default_rng(3)
    q, k, v, g_log, beta, S0 = (x[0] for x in inputs(rng, 1, 70))
    o_ref, S_ref = recurrence(q, k, v, g_log, beta, S0)
    o, S = chunked_gated_delta(q, k, v, g_log, beta, S0)
    assert rel_max(o, o_ref) <= 1e-10 and rel_max(S, S_ref) <= 1e-10
    o2, S2 = sequential_gated_delta(q, k, v, g_log, beta, S0)
    assert rel_max(o2, o_ref) <= 1e-13 and rel_max(S2, S_ref) <= 1e-13


def test_broken_order_fails_the_same_check():
    """Teeth: the decay applied after the update (and a zero initial state ignored) is caught."""
    rng = np.random.default_rng(4)
    a = inputs(rng, 2, 64 * 2 + 9, "mixed")
    o, S = chunked_gated_delta(*a)
    o_bad, S_bad = recurrence(*a, decay_first=False)
    assert rel_max(o, o_bad) > 1e-3 and rel_max(S, S_bad) > 1e-3
    b = inputs(rng, 2, 30, "near1")   # (mixed wipes the state at position 0)
    o_zero, _ = chunked_gated_delta(*b[:5], np.zeros_like(b[5]))
    o_ref, _ = recurrence(*b)
    assert rel_max(o_zero, o_ref) > 1e-3


def test_fp16_operands_meet_the_gpu_bars_bf16_does_not():
    """Why deltanet_chunked.cuh feeds fp16 (not bf16) to the tensor cores: with every product's
    operands rounded to fp16 (fp32 accumulation) a 2,048-position pass stays within the GPU
    harness's bars (output max-abs / max|o| <= 2e-3, state relative L2 <= 1e-3; measured ~6e-4
    and ~4-5e-4), bf16 operands do not (~5e-3 and ~3-4e-3)."""
    rng = np.random.default_rng(5)
    a = inputs(rng, 2, 2048, "near1")   # slow decay: the state remembers the whole pass
    o_ref, S_ref = recurrence(*a)
    o16, S16 = chunked_gated_delta(*a, dtype=np.float32, operand=round_fp16)
    eo, es = rel_max(o16, o_ref), rel_l2(S16, S_ref)
    assert eo <= 2e-3 and es <= 1e-3, f"fp16 operands: output {eo:.2e}, state {es:.2e}"
    ob, Sb = chunked_gated_delta(*a, dtype=np.float32, operand=round_bf16)
    assert rel_max(ob, o_ref) > 2e-3 or rel_l2(Sb, S_ref) > 1e-3


def test_bad_inputs_name_the_parameter():
    rng = np.random.default_rng(6)
    q, k, v, g_log, beta, S0 = inputs(rng, 1, 8)
    with pytest.raises(ValueError, match="S0"):
        chunked_gated_delta(q, k, v, g_log, beta, S0[:, :4])
    with pytest.raises(ValueError, match="g_log must be <= 0"):
        chunked_gated_delta(q, k, v, -g_log, beta, S0)
    with pytest.raises(ValueError, match="beta"):
        chunked_gated_delta(q, k, v, g_log, beta[:, :3], S0)
    with pytest.raises(ValueError, match="chunk"):
        chunked_gated_delta(q, k, v, g_log, beta, S0, chunk=0)


# ---- A lane-level transliteration of native/deltanet_chunked.cuh (both kernels), the index
# arithmetic of every shared-memory access and mma.sync fragment as the kernel writes it, with
# mma.sync.m16n8k16 built from the PTX ISA fragment layout (g = lane / 4, t = lane % 4):
# A reg r, half h -> (row g + 8 (r & 1), col 2t + h + 8 (r >> 1)); B reg r, half h -> (row 2t + h + 8r,
# col g); C e -> (row g + 8 (e >> 1), col 2t + (e & 1)). Keep it in step with the kernel: it is
# what checks the kernel's indexing (fragments, heads, tails, coefficient layout) without a GPU.
# Warps run one after another inside each barrier interval, in a chosen order; a result that
# depends on the order would be a race between warps.
_C, _J = 64, 32
_LANE = np.arange(32)
_G, _T = _LANE >> 2, _LANE & 3
f16, f32 = np.float16, np.float32


def _mma(acc, a, b):
    """acc [32, 4] f32 += A (regs a [32, 4, 2] f16) @ B (regs b [32, 2, 2] f16)."""
    A, B, Cm = np.zeros((16, 16), f32), np.zeros((16, 8), f32), np.zeros((16, 8), f32)
    for r in range(4):
        for h in range(2):
            A[_G + 8 * (r & 1), 2 * _T + h + 8 * (r >> 1)] = a[:, r, h]
    for r in range(2):
        for h in range(2):
            B[2 * _T + h + 8 * r, _G] = b[:, r, h]
    rows, cols = _G[:, None] + 8 * (np.arange(4) >> 1), 2 * _T[:, None] + (np.arange(4) & 1)
    Cm[rows, cols] = acc
    return (A @ B + Cm)[rows, cols]


def _ld32(sm, i):   # two consecutive halves at an even index (lower index in the low 16 bits)
    assert (i % 2 == 0).all(), "misaligned 32-bit shared load"
    return np.stack([sm[i], sm[i + 1]], -1)


def _pk(lo, hi):
    return np.stack([np.asarray(lo, f32).astype(f16), np.asarray(hi, f32).astype(f16)], -1)


def _regs(*r):
    return np.stack(r, 1)


_COEF_BYTES = 2 * _C * _C * 2 + 3 * _C * 4   # ChunkCoef::bytes


def _coef(buf, index):   # ChunkCoef: T, M (fp16 [C][C]), gamma, tail, beta (fp32 [C])
    p = index * _COEF_BYTES
    T, M = buf[p:p + 2 * _C * _C].view(f16), buf[p + 2 * _C * _C:p + 4 * _C * _C].view(f16)
    p += 4 * _C * _C
    return T, M, buf[p:p + 4 * _C].view(f32), buf[p + 4 * _C:p + 8 * _C].view(f32), buf[p + 8 * _C:p + 12 * _C].view(f32)


def _load_rows_half(D, sld, src, ld, col0, c0, n):
    dst = np.full(_C * sld, np.nan, f16)
    for r in range(_C):
        row = src[(c0 + r) * ld + col0:(c0 + r) * ld + col0 + D] if c0 + r < n else np.zeros(D, f32)
        dst[r * sld:r * sld + D] = row.astype(f16)
    return dst


def _a_frag(sm, base, ld):   # a0..a3 of rows base (per lane: row g), row stride ld
    return _regs(_ld32(sm, base), _ld32(sm, base + 8 * ld), _ld32(sm, base + 8), _ld32(sm, base + 8 * ld + 8))


def _prep(D, conv, beta_raw, alpha_raw, dt_bias, ssm_a, coef, n, conv_dim, key_dim, Hk, Hv, order):
    KLD, ALD, chunks = D + 8, _C + 1, (n + _C - 1) // _C
    for h in range(Hv):
        for chunk in range(chunks):
            kh, c0 = h % Hk, chunk * _C
            T, M, gamma, tail, bet = _coef(coef, h * chunks + chunk)
            sk = _load_rows_half(D, KLD, conv, conv_dim, key_dim + kh * D, c0, n)
            sq = _load_rows_half(D, KLD, conv, conv_dim, kh * D, c0, n)
            sb, lg = np.zeros(_C, f32), np.zeros(_C, f32)
            for r in range(min(_C, n - c0)):
                p = (c0 + r) * Hv + h
                sb[r] = f32(1) / (f32(1) + np.exp(-beta_raw[p]))
                x = f32(alpha_raw[p] + dt_bias[h])
                lg[r] = (x if x > 20 else np.log1p(np.exp(x))) * ssm_a[h]
            sG = np.cumsum(lg.astype(np.float64))
            gamma[:] = np.exp(sG.astype(f32))
            tail[:] = np.exp((sG[-1] - sG).astype(f32))
            bet[:] = sb
            sa = np.full(_C * ALD, np.nan, f32)
            for w in order:
                m0 = 16 * w
                kk, qk = np.zeros((_C // 8, 32, 4), f32), np.zeros((_C // 8, 32, 4), f32)
                for k0 in range(0, D, 16):
                    ka = (m0 + _G) * KLD + k0 + 2 * _T
                    a, q = _a_frag(sk, ka, KLD), _a_frag(sq, ka, KLD)
                    for nt in range(_C // 8):
                        kb = (8 * nt + _G) * KLD + k0 + 2 * _T
                        b = _regs(_ld32(sk, kb), _ld32(sk, kb + 8))
                        kk[nt], qk[nt] = _mma(kk[nt], a, b), _mma(qk[nt], q, b)
                for nt in range(_C // 8):
                    for hi in range(2):
                        r, s = m0 + _G + 8 * hi, 8 * nt + 2 * _T
                        mv = []
                        for e in range(2):
                            ratio = np.where(s + e <= r, np.exp(np.minimum(sG[r] - sG[s + e], 0).astype(f32)), f32(0))
                            sa[r * ALD + s + e] = np.where(s + e < r, sb[r] * ratio * kk[nt][:, 2 * hi + e], f32(0))
                            mv.append(ratio * qk[nt][:, 2 * hi + e])
                        M[r * _C + s], M[r * _C + s + 1] = mv[0].astype(f16), mv[1].astype(f16)
            st = np.full(_C * ALD, np.nan, f32)
            for c in range(_C):   # thread c: column c of (I + A)^-1 by forward substitution
                st[np.arange(c) * ALD + c] = 0
                st[c * ALD + c] = 1
                for r in range(c + 1, _C):
                    s = np.arange(c, r)
                    st[r * ALD + c] = -np.dot(sa[r * ALD + s], st[s * ALD + c])
            for e in range(_C * _C // 2):
                r, s = (2 * e) // _C, (2 * e) % _C
                T[r * _C + s:r * _C + s + 2] = st[r * ALD + s:r * ALD + s + 2].astype(f16)


def _scan(D, conv, coef, state, out, n, conv_dim, key_dim, Hk, Hv, order):
    KLD, SLD, YLD, TLD, chunks = D + 8, D + 4, _J + 4, _C + 8, (n + _C - 1) // _C
    for h in range(Hv):
        for j0 in range(0, D, _J):
            kh, srow = h % Hk, (h * D + j0) * D
            ss = np.full(_J * SLD, np.nan, f32)
            for j in range(_J):
                ss[j * SLD:j * SLD + D] = state[srow + j * D:srow + (j + 1) * D]
            for chunk in range(chunks):
                c0 = chunk * _C
                T, M, gamma, tail, bet = _coef(coef, h * chunks + chunk)
                sk = _load_rows_half(D, KLD, conv, conv_dim, key_dim + kh * D, c0, n)
                sq = _load_rows_half(D, KLD, conv, conv_dim, kh * D, c0, n)
                sy, stm, smm = np.full(_C * YLD, np.nan, f32), np.full(_C * TLD, np.nan, f16), np.full(_C * TLD, np.nan, f16)
                for r in range(_C):
                    v0 = (c0 + r) * conv_dim + 2 * key_dim + h * D + j0
                    sy[r * YLD:r * YLD + _J] = conv[v0:v0 + _J] if c0 + r < n else 0
                    stm[r * TLD:r * TLD + _C], smm[r * TLD:r * TLD + _C] = T[r * _C:(r + 1) * _C], M[r * _C:(r + 1) * _C]
                O, U = {}, {}
                for w in order:   # 2. K S^T, Q S^T -> Y, gamma Q S^T
                    m0 = 16 * w
                    x, o = np.zeros((_J // 8, 32, 4), f32), np.zeros((_J // 8, 32, 4), f32)
                    for k0 in range(0, D, 16):
                        ka = (m0 + _G) * KLD + k0 + 2 * _T
                        a, q = _a_frag(sk, ka, KLD), _a_frag(sq, ka, KLD)
                        for nt in range(_J // 8):
                            sb = (8 * nt + _G) * SLD + k0 + 2 * _T
                            b = _regs(_pk(ss[sb], ss[sb + 1]), _pk(ss[sb + 8], ss[sb + 9]))
                            x[nt], o[nt] = _mma(x[nt], a, b), _mma(o[nt], q, b)
                    for nt in range(_J // 8):
                        for e in range(4):
                            r, i = m0 + _G + 8 * (e >> 1), (m0 + _G + 8 * (e >> 1)) * YLD + 8 * nt + 2 * _T + (e & 1)
                            sy[i] = bet[r] * (sy[i] - gamma[r] * x[nt][:, e])
                            o[nt][:, e] *= gamma[r]
                    O[w] = o
                for w in order:   # 3. U = T Y
                    m0, u = 16 * w, np.zeros((_J // 8, 32, 4), f32)
                    for k0 in range(0, _C, 16):
                        a = _a_frag(stm, (m0 + _G) * TLD + k0 + 2 * _T, TLD)
                        for nt in range(_J // 8):
                            yb = (k0 + 2 * _T) * YLD + 8 * nt + _G
                            u[nt] = _mma(u[nt], a, _regs(_pk(sy[yb], sy[yb + YLD]), _pk(sy[yb + 8 * YLD], sy[yb + 9 * YLD])))
                    U[w] = u
                for w in order:
                    for nt in range(_J // 8):
                        for e in range(4):
                            sy[(16 * w + _G + 8 * (e >> 1)) * YLD + 8 * nt + 2 * _T + (e & 1)] = U[w][nt][:, e]
                for w in order:   # 4. O += M U (written for positions < n); 5. the state slice
                    m0, o = 16 * w, O[w]
                    for k0 in range(0, _C, 16):
                        a = _a_frag(smm, (m0 + _G) * TLD + k0 + 2 * _T, TLD)
                        for nt in range(_J // 8):
                            ub = (k0 + 2 * _T) * YLD + 8 * nt + _G
                            o[nt] = _mma(o[nt], a, _regs(_pk(sy[ub], sy[ub + YLD]), _pk(sy[ub + 8 * YLD], sy[ub + 9 * YLD])))
                    for nt in range(_J // 8):
                        for hi in range(2):
                            for lane in range(32):
                                r = m0 + (lane >> 2) + 8 * hi
                                if c0 + r < n:
                                    p = (c0 + r) * Hv * D + h * D + j0 + 8 * nt + 2 * (lane & 3)
                                    out[p:p + 2] = o[nt][lane, 2 * hi:2 * hi + 2]
                for w in order:
                    NT5, i0 = D // 32, w * (D // 4)
                    idx = [[(16 * mt + _G + 8 * (e >> 1)) * SLD + i0 + 8 * nt + 2 * _T + (e & 1) for e in range(4)]
                           for mt in range(_J // 16) for nt in range(NT5)]
                    sa = [np.stack([gamma[_C - 1] * ss[i] for i in ix], 1) for ix in idx]
                    for k0 in range(0, _C, 16):
                        s0 = k0 + 2 * _T
                        t0, t1, t8, t9 = tail[s0], tail[s0 + 1], tail[s0 + 8], tail[s0 + 9]
                        for mt in range(_J // 16):
                            ua = s0 * YLD + 16 * mt + _G
                            a = _regs(_pk(t0 * sy[ua], t1 * sy[ua + YLD]), _pk(t0 * sy[ua + 8], t1 * sy[ua + YLD + 8]),
                                      _pk(t8 * sy[ua + 8 * YLD], t9 * sy[ua + 9 * YLD]),
                                      _pk(t8 * sy[ua + 8 * YLD + 8], t9 * sy[ua + 9 * YLD + 8]))
                            for nt in range(NT5):
                                kb = s0 * KLD + i0 + 8 * nt + _G
                                b = _regs(np.stack([sk[kb], sk[kb + KLD]], -1), np.stack([sk[kb + 8 * KLD], sk[kb + 9 * KLD]], -1))
                                sa[mt * NT5 + nt] = _mma(sa[mt * NT5 + nt], a, b)
                    for ix, acc in zip(idx, sa):
                        for e in range(4):
                            ss[ix[e]] = acc[:, e]
            for j in range(_J):
                state[srow + j * D:srow + (j + 1) * D] = ss[j * SLD:j * SLD + D]


def _engine_inputs(rng, D, Hk, Hv, n):
    """The engine's buffers: conv [n][q heads | k heads | v heads] (q, k L2-normed, q / sqrt(d)),
    raw beta and alpha [n][Hv], dt_bias, ssm_a [Hv] from slow to fast heads, state [Hv][j][i]."""
    silu = lambda x: x / (1 + np.exp(-x))
    key_dim = Hk * D
    conv = silu(rng.normal(size=(n, 2 * key_dim + Hv * D)) * 1.5)
    qk = conv[:, :2 * key_dim].reshape(n, 2 * Hk, D)
    qk /= np.linalg.norm(qk, axis=-1, keepdims=True)
    qk[:, :Hk] /= np.sqrt(D)
    conv[:, :2 * key_dim] = qk.reshape(n, -1)
    out = (conv, 2 * rng.normal(size=(n, Hv)), rng.normal(size=(n, Hv)), rng.uniform(-1, 1, Hv),
           -np.exp(np.linspace(-6, 1.5, Hv)), 0.5 * rng.normal(size=(Hv, D, D)))
    return [a.astype(f32).reshape(-1) for a in out]


def _engine_sequential(D, Hk, Hv, n, conv, beta_raw, alpha_raw, dt_bias, ssm_a, state):
    """deltanet_recurrence_kernel (decay, delta update, read-out) in float64 on the engine's buffers."""
    key_dim = Hk * D
    cv = conv.reshape(n, -1).astype(np.float64)
    kh = np.arange(Hv) % Hk
    q = cv[:, :key_dim].reshape(n, Hk, D)[:, kh]
    k = cv[:, key_dim:2 * key_dim].reshape(n, Hk, D)[:, kh]
    v = cv[:, 2 * key_dim:].reshape(n, Hv, D)
    x = alpha_raw.reshape(n, Hv).astype(np.float64) + dt_bias
    g_log = np.where(x > 20, x, np.log1p(np.exp(x))) * ssm_a
    beta = 1 / (1 + np.exp(-beta_raw.reshape(n, Hv).astype(np.float64)))
    sw = lambda a: np.swapaxes(a, 0, 1)
    o, S = recurrence(sw(q), sw(k), sw(v), sw(g_log), sw(beta), state.reshape(Hv, D, D))
    return sw(o).reshape(-1), S.reshape(-1)


@pytest.mark.parametrize("D,n", [(32, 1), (64, 70)])
def test_kernel_transliteration_matches_the_engine_recurrence(D, n):
    """The CUDA kernels' own index arithmetic (above) on the engine's buffer layouts, GQA (4 value
    heads on 2 key heads), a ragged last chunk: within the GPU harness's bars of the float64
    recurrence; nothing written past position n or past deltanet_chunked_coef_bytes; no race."""
    Hk, Hv, extra = 2, 4, 3
    rng = np.random.default_rng(D + n)
    conv, beta, alpha, dt_bias, ssm_a, state0 = _engine_inputs(rng, D, Hk, Hv, n)
    key_dim, conv_dim = Hk * D, 2 * Hk * D + Hv * D
    need = (n + _C - 1) // _C * Hv * _COEF_BYTES   # deltanet_chunked_coef_bytes
    results = []
    for order in ((0, 1, 2, 3), (3, 1, 0, 2)):
        coef = np.full(need + 4096, 0xA5, np.uint8)
        out = np.full((n + extra) * Hv * D, np.nan, f32)
        state = state0.copy()
        _prep(D, conv, beta, alpha, dt_bias, ssm_a, coef, n, conv_dim, key_dim, Hk, Hv, order)
        _scan(D, conv, coef, state, out, n, conv_dim, key_dim, Hk, Hv, order)
        assert (coef[need:] == 0xA5).all(), "coefficients written past deltanet_chunked_coef_bytes"
        assert np.isnan(out[n * Hv * D:]).all(), "output written past position n"
        results.append((out[:n * Hv * D], state))
    (o, S), (o2, S2) = results
    assert np.array_equal(o, o2) and np.array_equal(S, S2), "the result depends on the order of the warps"
    o_ref, S_ref = _engine_sequential(D, Hk, Hv, n, conv, beta, alpha, dt_bias, ssm_a, state0)
    assert np.isfinite(o).all() and np.isfinite(S).all()
    eo, es = rel_max(o, o_ref), rel_l2(S, S_ref)
    assert eo <= 2e-3 and es <= 1e-3, f"transliterated kernel: output {eo:.2e}, state {es:.2e}"
