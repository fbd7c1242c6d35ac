"""The gated delta rule in chunks (WY / UT transform): the numpy twin of native/deltanet_chunked.cuh.

The recurrence (native/deltanet.cu, ReferenceModel._deltanet), per value head, state S [d_v (j), d_k (i)]:

    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,      o_t = S_t q_t

(the decay is applied before the update). Take one chunk of positions r = 1..C starting from the
state S_0 left by the previous chunk. With the cumulative log-decay G_r = sum_{m<=r} log g_m,
gamma_r = exp(G_r) and the ratios Gamma[r, s] = exp(G_r - G_s) (<= 1 for s <= r), unrolling gives

    S_r = gamma_r S_0 + sum_{s<=r} Gamma[r, s] u_s k_s^T,      u_r = beta_r (v_r - g_r S_{r-1} k_r),

and g_r S_{r-1} k_r = gamma_r S_0 k_r + sum_{s<r} Gamma[r, s] (k_s . k_r) u_s, so the rows u_r of U
[C, d_v] solve the unit lower-triangular system (the UT transform)

    (I + A) U = diag(beta) V - diag(beta * gamma) K S_0^T,   A[r, s] = beta_r Gamma[r, s] (k_r . k_s) for s < r, else 0.

T = (I + A)^-1 comes by forward substitution (T[r] = e_r - sum_{s<r} A[r, s] T[s]); then

    U   = T (diag(beta) V - diag(beta * gamma) K S_0^T)          (W = T diag(beta gamma) K, U~ = T diag(beta) V)
    O   = diag(gamma) Q S_0^T + (tril(Q K^T) * Gamma) U           (the diagonal included: o_r sees u_r)
    S_C = gamma_C S_0 + U^T diag(Gamma[C, :]) K.

Only Q S_0^T, K S_0^T and U^T K touch the state: a chunk costs a few C x d x d_v products instead of C
dependent steps. G is kept in float64 even in the float32 path (the CUDA kernel does the same): a
prefix sum of large log-decays loses the small differences G_r - G_s in float32.

`operand` (optional) rounds every matrix-product operand, emulating the tensor-core inputs of the
CUDA kernel (e.g. `round_fp16`, `split_fp16`); the triangular solve and the accumulations stay in
`dtype`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Rounding = Callable[[np.ndarray], np.ndarray]


def round_fp16(x: np.ndarray) -> np.ndarray:
    """One fp16 tensor-core operand (round to nearest even), back in the input's dtype."""
    return x.astype(np.float16).astype(x.dtype)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """One bf16 operand: float32 rounded to nearest even at 8 mantissa bits."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(x.dtype)


def split_fp16(x: np.ndarray) -> np.ndarray:
    """hi + lo in fp16 (the kernel's two-term operands): about 22 mantissa bits where lo is normal."""
    hi = round_fp16(x)
    return hi + round_fp16(x - hi)


def sequential_gated_delta(q, k, v, g_log, beta, S0, dtype=np.float64):
    """The plain recurrence, one position at a time (deltanet_recurrence_kernel's order): -> (o, S)."""
    q, k, v, g_log, beta = (np.asarray(a, dtype) for a in (q, k, v, g_log, beta))
    S = np.array(S0, dtype)
    o = np.empty(v.shape, dtype)
    g = np.exp(g_log)
    for t in range(q.shape[-2]):
        S = S * g[..., t, None, None]
        delta = (v[..., t, :] - np.einsum("...ji,...i->...j", S, k[..., t, :])) * beta[..., t, None]
        S = S + delta[..., :, None] * k[..., t, None, :]
        o[..., t, :] = np.einsum("...ji,...i->...j", S, q[..., t, :])
    return o, S


def _check(q, k, v, g_log, beta, S0, chunk):
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    T, dk = q.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(f"k has shape {k.shape}, q {q.shape}: they must match")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v has shape {v.shape}: its leading axes must be q's {q.shape[:-1]}")
    for name, a in (("g_log", g_log), ("beta", beta)):
        if a.shape != q.shape[:-1]:
            raise ValueError(f"{name} has shape {a.shape}, expected {q.shape[:-1]}")
    want = q.shape[:-2] + (v.shape[-1], dk)
    if S0.shape != want:
        raise ValueError(f"S0 has shape {S0.shape}, expected {want} ([..., d_v (j), d_k (i)])")
    if np.any(g_log > 0):
        raise ValueError("g_log must be <= 0 (a decay in (0, 1])")


def chunked_gated_delta(q, k, v, g_log, beta, S0, chunk: int = 64, dtype=np.float64,
                        operand: Rounding | None = None):
    """The recurrence in chunks of `chunk` positions -> (o [..., T, d_v], S_final [..., d_v, d_k]).

    q, k: [..., T, d_k]; v: [..., T, d_v]; g_log (log of the decay, <= 0), beta: [..., T];
    S0: [..., d_v, d_k]. Leading axes (e.g. heads) are batched. `dtype` is float64 or float32.
    """
    q, k, v, g_log, beta, S0 = (np.asarray(a) for a in (q, k, v, g_log, beta, S0))
    _check(q, k, v, g_log, beta, S0, chunk)
    rnd = operand or (lambda x: x)
    q, k, v, beta = (a.astype(dtype) for a in (q, k, v, beta))
    g_log = g_log.astype(np.float64)
    S = S0.astype(dtype)
    T = q.shape[-2]
    o = np.empty(v.shape, dtype)

    def mm(a, b):   # one tensor-core product: operands rounded, accumulated in dtype
        return np.matmul(rnd(a), rnd(b))

    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        n = c1 - c0
        Q, K, V, b = q[..., c0:c1, :], k[..., c0:c1, :], v[..., c0:c1, :], beta[..., c0:c1]
        G = np.cumsum(g_log[..., c0:c1], axis=-1)                        # float64
        gamma = np.exp(G).astype(dtype)
        below = np.tril(np.ones((n, n), bool))
        diff = np.where(below, G[..., :, None] - G[..., None, :], -np.inf)
        Gam = np.exp(diff).astype(dtype)                                 # Gamma[r, s], 0 above the diagonal
        KT = np.swapaxes(K, -1, -2)
        A = np.tril(b[..., :, None] * mm(K, KT) * Gam, -1)
        Tm = np.zeros_like(A)                                            # (I + A)^-1 by forward substitution
        for r in range(n):
            Tm[..., r, :] = -np.einsum("...s,...sc->...c", A[..., r, :r], Tm[..., :r, :])
            Tm[..., r, r] = 1.0
        ST = np.swapaxes(S, -1, -2)
        U = mm(Tm, b[..., :, None] * V - (b * gamma)[..., :, None] * mm(K, ST))
        o[..., c0:c1, :] = gamma[..., :, None] * mm(Q, ST) + mm(mm(Q, KT) * Gam, U)
        tail = np.exp(G[..., -1:] - G).astype(dtype)                    # Gamma[C, s]
        S = gamma[..., -1, None, None] * S + mm(np.swapaxes(U, -1, -2), tail[..., :, None] * K)
    return o, S
