"""native/gemm_wgmma.cuh's fused gate + up + SwiGLU variant (SWIGLU): its tile and exchange indices, on the CPU.

The kernel cannot run here, so this file emulates what the variant adds to the verified Q4_K kernel:
the grid over 64 output rows, the producer's two W boxes per stage (gate rows m0.. then the same rows
of up), each consumer's rows (rl0 = 64 c + 16 warp + g lands in box c), the wgmma D-fragment layout
(value 4 j + e: row g + 8 (e >> 1), position 8 j + 2 t + (e & 1)), the split epilogue (consumer 0
finishes registers i < BN/4, consumer 1 the rest; each stores the OTHER half of its accumulators to
the exchange area XCH[i][tid]), the loads and the guarded SwiGLU stores. With random gate / up
results per (row, position) standing in for the main loop (unchanged from the plain kernel and
checked by its harness), every output must be silu(gate) * up of ITS row and position, nothing
outside P x M written, every output written once; for M = 200 / 72 / 17,408-like tails and P = 77 /
64 / 130 at BN 64 and 128. The shared-memory sums (stages, exchange area, 1 KB alignment slack)
must fit the H200's 227 KB per block and the exchange area must lie past the last stage.

SOURCE_ANCHORS asserts that the transcribed lines are still in the sources, so a change to the
kernel fails here until the emulation follows it.
"""

from __future__ import annotations


import numpy as np
import pytest
from source_anchors import missing_anchors

W_ROW = 144
SMEM_OPTIN = 232_448   # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 / H200

SOURCE_ANCHORS = [
    ("gemm_wgmma.cuh", "constexpr int BM_OUT = SWIGLU ? 64 : BM;"),
    ("gemm_wgmma.cuh", "const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM_OUT;"),
    ("gemm_wgmma.cuh", "tma_4d(st + W_OFF, &tm_w, 0, 0, u, m0 / TILE_ROWS, fb);"),
    ("gemm_wgmma.cuh", "tma_4d(st + W_OFF + 64 * W_ROW, &tm_w2, 0, 0, u, m0 / TILE_ROWS, fb);"),
    ("gemm_wgmma.cuh", "constexpr uint32_t TX = stage_x(BN) + stage_xs(BN) + BM * W_ROW;"),
    ("gemm_wgmma.cuh", "const int c = wg - 1, g = lane >> 2, t = lane & 3;"),
    ("gemm_wgmma.cuh", "const int rl0 = 64 * c + 16 * warp + g;"),
    ("gemm_wgmma.cuh", "const uint4 h = *reinterpret_cast<const uint4 *>(ws + (rl0 + 8 * r) * W_ROW);"),
    ("gemm_wgmma.cuh", "float *const xch = reinterpret_cast<float *>(sbase + (size_t)STAGES * SB);"),
    ("gemm_wgmma.cuh", "const int tid = threadIdx.x & 127;"),
    ("gemm_wgmma.cuh", "constexpr int H = R / 2;"),
    ("gemm_wgmma.cuh", "if (c == 0) { #pragma unroll for (int i = H; i < R; ++i) xch[i * 128 + tid] = acc[i]; } else { "
                       "#pragma unroll for (int i = 0; i < H; ++i) xch[i * 128 + tid] = acc[i]; }"),
    ("gemm_wgmma.cuh", "named_bar_sync<1, 256>();"),
    ("gemm_wgmma.cuh", "const int rb = 16 * warp + g;"),
    ("gemm_wgmma.cuh", "const int64_t pos = n0 + 8 * jn + 2 * t + e1;"),
    ("gemm_wgmma.cuh", "const int64_t row = (int64_t)m0 + rb + 8 * e2;"),
    ("gemm_wgmma.cuh", "const int i = 4 * jn + 2 * e2 + e1;"),
    ("gemm_wgmma.cuh", "const float other = xch[i * 128 + tid];"),
    ("gemm_wgmma.cuh", "const float gate = __fmul_rn(c == 0 ? acc[i] : other, iv), up = __fmul_rn(c == 0 ? other : acc[i], iv);"),
    ("gemm_wgmma.cuh", "a.y[pos * a.M + row] = silu(gate) * up;"),
    ("gemm_wgmma.cuh", "for (int jn = 0; jn < BN / 16; ++jn) finish(jn);"),
    ("gemm_wgmma.cuh", "for (int jn = BN / 16; jn < BN / 8; ++jn) finish(jn);"),
    ("gemm_wgmma.cuh", "__host__ __device__ constexpr int xch_bytes(int bn) { return bn / 2 * 128 * 4; }"),
    ("gemm_wgmma.cuh", "return stages * stage_bytes(2, bn) + xch_bytes(bn) + 1024; }"),
    ("gemm_wgmma.cuh", "const dim3 grid((unsigned)((P + BN - 1) / BN), (unsigned)((M + 63) / 64));"),
    ("gemm_wgmma.cuh", 'encode_w_map(&tg, w_gate, 64, "Q4_K ffn gate weights");'),
    ("gemm_wgmma.cuh", 'encode_w_map(&tu, w_up, 64, "Q4_K ffn up weights");'),
    ("gemm_wgmma.cuh", "gemm_wgmma_kernel<2, BN, STAGES, true><<<grid, 128 * 3, SMEM, st>>>(tx, txs, tg, tu, a);"),
    ("gemm_wgmma.cuh", "constexpr Config SWIGLU_CONFIGS[N_SWIGLU_CONFIGS] = {{2, 128, 2}, {2, 64, 4}};"),
    # the unfused formula the epilogue must reproduce
    ("reduce.cuh", "__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }"),
    ("elementwise.cu", "gate[i] = silu(gate[i]) * up[i];"),
]


def test_source_anchors_present():
    missing = missing_anchors(SOURCE_ANCHORS)
    assert not missing, "kernel lines this emulation transcribes have changed:\n" + "\n".join(missing)


# ---- shared memory (gemm_wgmma.cuh's constexpr sums) --------------------------------------------
def stage_bytes(nwg: int, bn: int) -> int:
    return (bn * 512 + bn * 32 + 64 * nwg * W_ROW + 1023) // 1024 * 1024


def xch_bytes(bn: int) -> int:
    return bn // 2 * 128 * 4


@pytest.mark.parametrize("bn,stages", [(128, 2), (64, 4)])
def test_shared_memory_fits(bn, stages):
    sb = stage_bytes(2, bn)
    # the two 64-row W boxes fill exactly what one 128-row box of the plain kernel fills (same TX)
    w_off = bn * 512 + bn * 32
    assert w_off % 1024 == 0 and (w_off + 64 * W_ROW) % 128 == 0   # TMA destinations stay 128-byte aligned
    assert w_off + 2 * 64 * W_ROW <= sb
    # the exchange area starts past the last stage and ends inside the allocation (+ alignment slack)
    total = stages * sb + xch_bytes(bn) + 1024
    static_smem = 2 * stages * 8   # full / empty mbarriers
    assert total + static_smem <= SMEM_OPTIN
    assert (stages * sb) % 16 == 0
    assert 1023 + stages * sb + xch_bytes(bn) <= total   # worst-case alignment offset of the base


# ---- the emulation ------------------------------------------------------------------------------
def _silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g = g.astype(np.float32)
    with np.errstate(over="ignore"):
        return (g / (np.float32(1) + np.exp(-g))) * u.astype(np.float32)


def emulate(gate: np.ndarray, up: np.ndarray, inv: np.ndarray, M: int, P: int, bn: int) -> tuple[np.ndarray, np.ndarray]:
    """gate / up: [M][P] float32 accumulators (before the 2^-e_p scale); returns y [P + 1][M] (NaN
    where never written; row P the guard) and the write count per output."""
    y = np.full((P + 1, M), np.nan, dtype=np.float32)
    writes = np.zeros((P + 1, M), dtype=np.int32)
    R = bn // 2
    grid_x, grid_y = (P + bn - 1) // bn, (M + 63) // 64
    for by in range(grid_y):
        m0 = by * 64
        # the stage's W region: box 0 = gate rows m0.., box 1 = up rows m0.. (TMA zero-fills past M);
        # a slot holds (matrix, global row) or None for the zero fill
        slots = [("gate", m0 + r) if m0 + r < M else None for r in range(64)] + [
            ("up", m0 + r) if m0 + r < M else None for r in range(64)
        ]
        for bx in range(grid_x):
            n0 = bx * bn
            acc = {}   # (c, tid) -> [R] accumulators
            for c in (0, 1):
                for warp in range(4):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        rl0 = 64 * c + 16 * warp + g
                        regs = np.zeros(R, dtype=np.float32)
                        for i in range(R):
                            j, e = i >> 2, i & 3
                            slot = slots[rl0 + 8 * (e >> 1)]
                            pos = n0 + 8 * j + 2 * t + (e & 1)
                            if slot is None or pos >= P:
                                regs[i] = 0.0   # zero-filled rows / positions past P_pad give 0 (past P: unread)
                                continue
                            name, row = slot
                            assert name == ("gate" if c == 0 else "up"), "consumer reads the other matrix's box"
                            regs[i] = (gate if name == "gate" else up)[row, pos]
                        acc[(c, 32 * warp + lane)] = regs
            # each consumer stores the OTHER half to XCH[i][tid] (consumer 0: i >= H, its gate;
            # consumer 1: i < H, its up); barrier; each finishes its own half
            H = R // 2
            xch = np.full(R * 128, np.nan, dtype=np.float32)
            owner = np.full(R * 128, -1)
            for c, irange in ((0, range(H, R)), (1, range(0, H))):
                for tid in range(128):
                    for i in irange:
                        assert owner[i * 128 + tid] == -1, "two stores to one exchange slot"
                        xch[i * 128 + tid] = acc[(c, tid)][i]
                        owner[i * 128 + tid] = c
            assert not np.isnan(xch).any()
            for c, jrange in ((0, range(0, bn // 16)), (1, range(bn // 16, bn // 8))):
                for tid in range(128):
                    warp, lane = tid >> 5, tid & 31
                    g, t = lane >> 2, lane & 3
                    rb = 16 * warp + g
                    for jn in jrange:
                        for e1 in range(2):
                            pos = n0 + 8 * jn + 2 * t + e1
                            if pos >= P:
                                continue
                            iv = inv[pos]
                            for e2 in range(2):
                                row = m0 + rb + 8 * e2
                                if row >= M:
                                    continue
                                i = 4 * jn + 2 * e2 + e1
                                other = xch[i * 128 + tid]
                                assert owner[i * 128 + tid] == 1 - c, "a consumer read its own exchange slot"
                                gv = np.float32((acc[(c, tid)][i] if c == 0 else other) * iv)
                                uv = np.float32((other if c == 0 else acc[(c, tid)][i]) * iv)
                                y[pos, row] = _silu_mul(np.array([gv]), np.array([uv]))[0]
                                writes[pos, row] += 1
    return y, writes


@pytest.mark.parametrize("M,P,bn", [(200, 77, 128), (200, 77, 64), (72, 64, 128), (136, 130, 64), (64, 1, 128), (200, 109, 64)])   # 109: consumer 1's half partly past P at BN 64
def test_epilogue_exchange_matches_unfused(M, P, bn):
    rng = np.random.default_rng(M * 1000 + P + bn)
    gate = (rng.standard_normal((M, P)) * 4).astype(np.float32)
    up = rng.standard_normal((M, P)).astype(np.float32)
    inv = np.exp2(rng.integers(-6, 3, size=P)).astype(np.float32)
    y, writes = emulate(gate, up, inv, M, P, bn)
    # the unfused path: gate and up stored as acc * inv (rounded to float), then the swiglu kernel
    want = _silu_mul((gate * inv[None, :]).astype(np.float32), (up * inv[None, :]).astype(np.float32)).T
    assert (writes[:P] == 1).all(), "every output written exactly once"
    assert np.isnan(y[P]).all() and (writes[P] == 0).all(), "nothing written past P"
    np.testing.assert_array_equal(y[:P], want)
