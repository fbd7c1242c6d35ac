# matvec_int8_emu.py: a CPU emulation of native/matvec.cu's int8-activation kernels (one 16-row
# tile, all 32 lanes, 8 vectors), written from the PTX mma fragment layouts (m16n8k32 / m16n8k16,
# s8/u8) and the kernels' byte indexing, checked against gguf.quants' dequantisation times the
# int8-rounded x (the K-quant mins times the exact fp32 block sum, as the kernel does).
# "mapping err" must be ~1e-16 (any lane/k/scale mix-up shows as >1e-3); "int8-vs-exact" is the
# rounding of x alone. Keep in step with the kernels when their layout changes.
#
#   .venv/bin/python native/tools/matvec_int8_emu.py [Q4_K Q5_K Q6_K Q8_0]     (~1 minute)
import numpy as np, gguf
from gguf.quants import dequantize
rng = np.random.default_rng(1)
GT = gguf.GGMLQuantizationType
def w32(b, off): return int.from_bytes(bytes([int(v) for v in b[off:off+4]]), "little")
def bytes_of(w): w = int(w); return [(w >> (8*i)) & 255 for i in range(4)]
def s8(v):
    v = int(v); return v - 256 if v >= 128 else v
def mma(lanes_a, lanes_b, k, a_uns):
    A = np.zeros((16, k), np.int64); B = np.zeros((k, 8), np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = lanes_a[lane]; b = lanes_b[lane]
        conv = (lambda v: v) if a_uns else s8
        for i in range(4):
            A[g][4*t+i] = conv(bytes_of(a[0])[i]); A[g+8][4*t+i] = conv(bytes_of(a[1])[i])
            B[4*t+i][g] = s8(bytes_of(b[0])[i])
            if k == 32:
                A[g][16+4*t+i] = conv(bytes_of(a[2])[i]); A[g+8][16+4*t+i] = conv(bytes_of(a[3])[i])
                B[16+4*t+i][g] = s8(bytes_of(b[1])[i])
    C = A @ B
    return [[C[l>>2][2*(l&3)], C[l>>2][2*(l&3)+1], C[(l>>2)+8][2*(l&3)], C[(l>>2)+8][2*(l&3)+1]] for l in range(32)]
def f16(b, off): return float(np.frombuffer(bytes(b[off:off+2]), np.float16)[0])
def q6_x_pos(i): return 8*((i >> 2) & 3) + 4*(i >> 4) + (i & 3)
def quantize_x(x, q6):
    K = x.shape[1]; q = np.zeros((8, K), np.int64); ds = np.zeros((K//32, 8, 2))
    for v in range(8):
        for b in range(K//32):
            blk = x[v, 32*b:32*b+32].astype(np.float32); amax = np.abs(blk).max(); d = np.float32(amax/127)
            qq = np.zeros(32, np.int64) if amax == 0 else np.rint(blk/d).astype(np.int64)
            for i in range(32): q[v, 32*b + (q6_x_pos(i) if q6 else i)] = qq[i]
            ds[b, v] = (d, blk.astype(np.float64).sum())
    return q, ds
def xword(q, v, off):  # 4 int8 at q[v][off..] as a little-endian word
    return sum(((int(q[v, off+i]) & 255) << (8*i)) for i in range(4))
def deq_x(x, q6):
    q, ds = quantize_x(x, q6); K = x.shape[1]; xd = np.zeros((8, K))
    for v in range(8):
        for b in range(K//32):
            for i in range(32):
                xd[v, 32*b+i] = ds[b, v, 0] * q[v, 32*b + (q6_x_pos(i) if q6 else i)]
    return xd

def emu_q4q5(rows, x, Q5):
    BY = 176 if Q5 else 144; QS = 48 if Q5 else 16
    q, ds = quantize_x(x, False); acc = np.zeros((32, 4))
    nb = len(rows[0]) // BY
    for u in range(nb):
        s1 = np.zeros((32, 4)); s2 = np.zeros((32, 4))
        for j in range(4):
            for nib in range(2):
                s = 2*j + nib; la = []; lb = []; scl = []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3; a = [0]*4
                    for r in range(2):
                        blk = rows[g + 8*r][u*BY:(u+1)*BY]
                        wx, wy = w32(blk, QS+32*j+8*t), w32(blk, QS+32*j+8*t+4)
                        lo0, lo1 = (wx >> 4, wy >> 4) if nib else (wx, wy)
                        if Q5:
                            hx, hy = w32(blk, 16+8*t), w32(blk, 16+8*t+4)
                            h0 = ((hx << (4-s)) if s <= 4 else (hx >> (s-4))) & 0xFFFFFFFF
                            h1 = ((hy << (4-s)) if s <= 4 else (hy >> (s-4))) & 0xFFFFFFFF
                            a[r] = (lo0 & 0x0F0F0F0F) | (h0 & 0x10101010); a[2+r] = (lo1 & 0x0F0F0F0F) | (h1 & 0x10101010)
                        else:
                            a[r] = lo0 & 0x0F0F0F0F; a[2+r] = lo1 & 0x0F0F0F0F
                    la.append(a)
                    off = u*256 + 32*s + 8*t
                    lb.append([xword(q, g, off), xword(q, g, off+4)])
                C = mma(la, lb, 32, True)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    dsv = (ds[u*8+s, 2*t, 0], ds[u*8+s, 2*t, 1], ds[u*8+s, 2*t+1, 0], ds[u*8+s, 2*t+1, 1])
                    sc = []; mn = []
                    for r in range(2):
                        h = rows[g+8*r][u*BY+4:u*BY+16]
                        hy, hz, hw = w32(h, 0), w32(h, 4), w32(h, 8)
                        scw = [hy & 0x3F3F3F3F, (hw & 0x0F0F0F0F) | ((hy >> 2) & 0x30303030)]
                        mnw = [hz & 0x3F3F3F3F, ((hw >> 4) & 0x0F0F0F0F) | ((hz >> 2) & 0x30303030)]
                        sc.append(bytes_of(scw[s >> 2])[s & 3]); mn.append(bytes_of(mnw[s >> 2])[s & 3])
                    c = C[lane]
                    s1[lane] += [c[0]*sc[0]*dsv[0], c[1]*sc[0]*dsv[2], c[2]*sc[1]*dsv[0], c[3]*sc[1]*dsv[2]]
                    s2[lane] += [mn[0]*dsv[1], mn[0]*dsv[3], mn[1]*dsv[1], mn[1]*dsv[3]]
        for lane in range(32):
            g = lane >> 2
            for r in range(2):
                blk = rows[g+8*r][u*BY:]
                d, dmin = f16(blk, 0), f16(blk, 2)
                for cc in range(2):
                    acc[lane][2*r+cc] += d*s1[lane][2*r+cc] - dmin*s2[lane][2*r+cc]
    return acc

def q6_planar(blk):  # one 210-byte block -> 192 q bytes, 16 scales, d (quant_blocks.cuh)
    ql, qh = blk[0:128], blk[128:192]; q = [0]*192
    for half in range(2):
        for l in range(32):
            t, c, j = (l & 15) >> 2, 2*half + (l >> 4), l & 3
            off = 16*t + 4*c + j
            q[off] = ql[64*half + l]; q[64+off] = ql[64*half+32+l]; q[128+off] = qh[32*half+l]
    return q, blk[192:208], f16(blk, 208)
def shr(v, S): return (v >> S) if S >= 0 else ((v << -S) & 0xFFFFFFFF)
def emu_q6(rows, x):
    q, ds = quantize_x(x, True); acc = np.zeros((32, 4)); nb = len(rows[0]) // 210
    for u in range(nb):
        s1 = np.zeros((32, 4))
        P = [[q6_planar(rows[m][u*210:(u+1)*210]) for m in range(16)]][0]
        for HALF in range(2):
            for QQ in range(4):
                XB = 4*HALF + QQ
                for c1 in range(2):
                    C_ = 2*HALF + c1; S = 8*HALF + 2*QQ + c1; SH = 4*(QQ >> 1)
                    la = []; lb = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3; a = []
                        for r in range(2):
                        	pq = P[g+8*r][0]
                        	base = 64 if (QQ & 1) else 0
                        	A = w32(pq, base + 16*t + 4*C_); H = w32(pq, 128 + 16*t + 4*C_)
                        	v = ((A >> SH) & 0x0F0F0F0F) | (shr(H, 2*QQ-4) & 0x30303030)
                        	a.append(((v + 0x60606060) & 0xFFFFFFFF) ^ 0x80808080)
                        la.append(a)
                        off = u*256 + 32*XB + 8*t + 4*c1
                        lb.append([xword(q, g, off)])
                    Cm = mma(la, lb, 16, False)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        scg = s8(P[g][1][S]); sc8 = s8(P[g+8][1][S])
                        dx0, dx1 = ds[u*8+XB, 2*t, 0], ds[u*8+XB, 2*t+1, 0]
                        c = Cm[lane]
                        s1[lane] += [c[0]*scg*dx0, c[1]*scg*dx1, c[2]*sc8*dx0, c[3]*sc8*dx1]
        for lane in range(32):
            g = lane >> 2
            for r in range(2):
                d = P[g+8*r][2]
                for cc in range(2): acc[lane][2*r+cc] += d*s1[lane][2*r+cc]
    return acc

def emu_q8(rows, x):  # rows: planar qs [K] int8 bytes + d list
    q, ds = quantize_x(x, False); acc = np.zeros((32, 4)); K = x.shape[1]
    for u in range(K // 128):
        for s in range(4):
            la = []; lb = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3; off = u*128 + 32*s + 8*t
                qa = [rows[g+8*r][0] for r in range(2)]
                la.append([w32(qa[0], off), w32(qa[1], off), w32(qa[0], off+4), w32(qa[1], off+4)])
                lb.append([xword(q, g, off), xword(q, g, off+4)])
            Cm = mma(la, lb, 32, False)
            for lane in range(32):
                g, t = lane >> 2, lane & 3; b = u*4+s
                for r in range(2):
                    d = rows[g+8*r][1][b]
                    acc[lane][2*r] += Cm[lane][2*r] * d * ds[b, 2*t, 0]
                    acc[lane][2*r+1] += Cm[lane][2*r+1] * d * ds[b, 2*t+1, 0]
    return acc

def to_out(acc):  # lane C slots -> [16 rows][8 vectors]
    y = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        y[g][2*t] = acc[lane][0]; y[g][2*t+1] = acc[lane][1]; y[g+8][2*t] = acc[lane][2]; y[g+8][2*t+1] = acc[lane][3]
    return y

def rand_blocks(qt, K, M):
    bs, ts = gguf.GGML_QUANT_SIZES[qt]; raw = rng.integers(0, 256, size=(M, K//bs*ts), dtype=np.uint8)
    for m in range(M):
        for b in range(K//bs):
            o = b*ts
            if qt in (GT.Q4_K, GT.Q5_K):
                raw[m, o:o+2] = np.frombuffer(np.float16(rng.uniform(0.5, 1.5)*1e-3).tobytes(), np.uint8)
                raw[m, o+2:o+4] = np.frombuffer(np.float16(rng.uniform(0.5, 1.5)*8e-3).tobytes(), np.uint8)
            elif qt == GT.Q6_K:
                raw[m, o+208:o+210] = np.frombuffer(np.float16(rng.uniform(0.5, 1.5)*2e-4).tobytes(), np.uint8)
            elif qt == GT.Q8_0:
                raw[m, o:o+2] = np.frombuffer(np.float16(rng.uniform(0.5, 1.5)*8e-3).tobytes(), np.uint8)
    return raw

K = 512
x = (rng.standard_normal((8, K)) * np.array([0.5+n if n < 7 else 300 for n in range(8)])[:, None]).astype(np.float32)
import sys
for qt in [getattr(GT, a) for a in sys.argv[1:]] or (GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.Q8_0):
    raw = rand_blocks(qt, K, 16)
    W = dequantize(raw, qt).reshape(16, K).astype(np.float64)
    q6 = qt == GT.Q6_K
    xd = deq_x(x, q6)
    if qt == GT.Q8_0:
        rows = []
        for m in range(16):
            blk = raw[m].reshape(K//32, 34)
            rows.append((list(blk[:, 2:].reshape(-1)), [float(np.frombuffer(bytes(b[:2]), np.float16)[0]) for b in blk]))
        y = to_out(emu_q8(rows, x))
    elif q6:
        y = to_out(emu_q6([list(raw[m]) for m in range(16)], x))
    else:
        y = to_out(emu_q4q5([list(raw[m]) for m in range(16)], x, qt == GT.Q5_K))
    # reference: W . x_quantised, except the K-quant mins use the float sum of x (as the kernel)
    if qt in (GT.Q4_K, GT.Q5_K):
        # split W = d*sc*q - dmin*m: the min part times exact x, the rest times quantised x
        Wmin = np.zeros_like(W)
        BY = gguf.GGML_QUANT_SIZES[qt][1]
        for m in range(16):
            for u in range(K//256):
                blk = raw[m, u*BY:(u+1)*BY]; dmin = f16(blk, 2); sc = blk[4:16]
                for s in range(8):
                    sc_ = [int(v) for v in sc]; mn = (sc_[s+4] & 63) if s < 4 else ((sc_[s+4] >> 4) | ((sc_[s] >> 6) << 4))
                    Wmin[m, u*256+32*s:u*256+32*s+32] = -dmin*mn
        ref = (W - Wmin) @ xd.T + Wmin @ x.astype(np.float64).T
    else:
        ref = W @ xd.T
    exact = W @ x.astype(np.float64).T
    mag = np.abs(W) @ np.abs(x.astype(np.float64)).T
    err = np.abs(y - ref).max() / mag.max()
    print(qt.name, 'mapping err', err, ' int8-vs-exact rel err', (np.abs(y - exact) / mag).max())
    assert err < 1e-9, f'{qt.name}: the emulated kernel disagrees with the dequantised reference'
