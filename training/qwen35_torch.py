"""The qwen35 architecture in PyTorch, written to equal llama.cpp's graph (src/models/qwen35.cpp).

Parameters carry their GGUF names and numpy layout (`[out, in]` for matrices), so export is a
rename-free copy; `gguf_tensors()` returns exactly the tensors `openjet_plugin.tensors` lists
(including the optional `nextn.shared_head_norm`; `output.weight` is untied, as in the 27B).

What must match llama.cpp, and where each thing is done here:
- RMSNorm: x / sqrt(mean(x^2) + eps) * w, with w a plain multiplier (GGUF stores it that way).
- Gated DeltaNet (`DeltaNetMixer`): causal depthwise conv over [q|k|v] channels + SiLU; q, k
  L2-normalised per head as x / sqrt(sum(x^2) + eps); value head h reads key head h % n_key_heads
  (ggml_repeat tiles); q scaled by 1/sqrt(d_state); decay g = softplus(alpha + dt_bias) * ssm_a,
  ssm_a = -exp(A_log); beta = sigmoid; state S (d_k x d_v): S = S*exp(g); S += k (beta (v - S^T k))^T;
  o = S^T q; then RMSNorm(ssm_norm) per head times SiLU(z), then ssm_out.
- Gated attention (`AttentionMixer`): attn_q emits, per head, [query | gate] (head_dim each);
  per-head RMSNorm on q and k; NEOX RoPE on the first n_rot dims (text positions make llama.cpp's
  IMROPE sections all the same position); query head h uses KV head h // (n_head / n_head_kv);
  softmax scale 1/sqrt(head_dim); output times sigmoid(gate), then attn_output.
- MTP block: concat(RMSNorm_e(embed(next token)), RMSNorm_h(h)) -> eh_proj -> one attention
  decoder block -> shared_head_norm -> output. h is the trunk's hidden after output_norm; for chained
  drafts the block's own normed output is fed back as h (llama.cpp's t_h_nextn).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's build_gdn_l2_norm: rms_norm(x, eps/n) / sqrt(n) == x / sqrt(sum(x^2) + eps)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# --------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------

def gated_delta_rule_recurrent(q, k, v, g, beta, state=None):
    """Token-by-token gated delta rule (the definition; used to check the chunked form).

    q, k: [B, H, T, Dk] (normalised, q already scaled); v: [B, H, T, Dv]; g (log decay, <= 0) and
    beta: [B, H, T]. state: [B, H, Dk, Dv] or None. Returns (o [B, H, T, Dv], final state).
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    S = torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=q.device) if state is None else state
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    outs = []
    for t in range(T):
        S = S * torch.exp(g[:, :, t])[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        delta = (v[:, :, t] - kv) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(outs, dim=2), S


def gated_delta_rule_chunked(q, k, v, g, beta, chunk: int = 64, state=None):
    """The same recurrence computed a chunk at a time (the WY/UT form llama.cpp's chunking uses).

    Within a chunk, with cumulative log decay G_i, A = tril(beta_i k_i.k_j exp(G_i - G_j), -1),
    T = (I + A)^-1; then u = T (beta v) and w = T (beta k exp(G)) give the chunk's corrected values
    v_new = u - w S and output o = (q exp(G)) S + tril(q.k exp(G_i - G_j)) v_new; the state moves on as
    S exp(G_last) + (k exp(G_last - G))^T v_new. All exponents are <= 0, so nothing overflows.
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    pad = (chunk - T % chunk) % chunk
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
        g = F.pad(g, (0, pad))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // chunk
    q = q.reshape(B, H, N, chunk, Dk)
    k = k.reshape(B, H, N, chunk, Dk)
    v = v.reshape(B, H, N, chunk, Dv)
    g = g.reshape(B, H, N, chunk).cumsum(-1)
    beta = beta.reshape(B, H, N, chunk)

    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    lower_incl = torch.tril(ones)
    strict_lower = torch.tril(ones, -1)
    diff = g[..., :, None] - g[..., None, :]
    decay = torch.exp(diff.masked_fill(~lower_incl, float("-inf")))      # [B,H,N,C,C]

    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay
    A = A.masked_fill(~strict_lower, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    u = Tm @ (v * beta[..., None])
    w = Tm @ (k_beta * torch.exp(g)[..., None])
    qk = ((q @ k.transpose(-1, -2)) * decay).masked_fill(~lower_incl, 0.0)
    q_g = q * torch.exp(g)[..., None]
    g_last = g[..., -1]
    k_tail = k * torch.exp(g_last[..., None] - g)[..., None]

    S = torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    outs = []
    for n in range(N):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append(q_g[:, :, n] @ S + qk[:, :, n] @ v_new)
        S = S * torch.exp(g_last[:, :, n])[..., None, None] + k_tail[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * chunk, Dv)[:, :, :T]
    return o, S


# --------------------------------------------------------------------------------------------
# Mixers and blocks
# --------------------------------------------------------------------------------------------

class DeltaNetMixer(nn.Module):
    def __init__(self, cfg, chunk: int = 64):
        super().__init__()
        self.cfg = cfg
        self.chunk = chunk
        d = cfg.n_embd
        self.attn_qkv = nn.Linear(d, cfg.ssm_conv_dim, bias=False)
        self.attn_gate = nn.Linear(d, cfg.ssm_value_dim, bias=False)
        self.ssm_conv1d = nn.Parameter(torch.empty(cfg.ssm_conv_dim, cfg.ssm_conv_kernel))
        self.ssm_dt_bias = nn.Parameter(torch.empty(cfg.ssm_dt_rank))
        self.A_log = nn.Parameter(torch.empty(cfg.ssm_dt_rank))
        self.ssm_beta = nn.Linear(d, cfg.ssm_dt_rank, bias=False)
        self.ssm_alpha = nn.Linear(d, cfg.ssm_dt_rank, bias=False)
        self.ssm_norm = RMSNorm(cfg.ssm_d_state, cfg.rms_eps)
        self.ssm_out = nn.Linear(cfg.ssm_value_dim, d, bias=False)

    def ssm_a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def forward(self, x: torch.Tensor, recurrent: bool = False) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        Hk, Hv, S = cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state
        K = cfg.ssm_conv_kernel
        qkv = self.attn_qkv(x)                                   # [B, T, conv_dim]
        z = self.attn_gate(x)
        beta = torch.sigmoid(self.ssm_beta(x).float())           # [B, T, Hv]
        g = F.softplus(self.ssm_alpha(x).float() + self.ssm_dt_bias.float()) * self.ssm_a()

        # causal depthwise conv: out[t] = sum_j w[j] * x[t - (K-1) + j] (ggml_ssm_conv on a zero state)
        xc = F.pad(qkv.transpose(1, 2), (K - 1, 0))
        conv = F.conv1d(xc, self.ssm_conv1d.to(xc.dtype)[:, None, :], groups=cfg.ssm_conv_dim)
        conv = F.silu(conv).transpose(1, 2)                     # [B, T, conv_dim]

        kd = cfg.ssm_key_dim
        q = conv[..., :kd].reshape(B, T, Hk, S)
        k = conv[..., kd:2 * kd].reshape(B, T, Hk, S)
        v = conv[..., 2 * kd:].reshape(B, T, Hv, S)
        q = l2_norm(q, cfg.rms_eps)
        k = l2_norm(k, cfg.rms_eps)
        if Hv != Hk:
            # value head h reads key head h % Hk: ggml_repeat tiles the key heads
            q = q.repeat(1, 1, Hv // Hk, 1)
            k = k.repeat(1, 1, Hv // Hk, 1)
        q = q * (1.0 / math.sqrt(S))

        args = (q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2),
                g.transpose(1, 2), beta.transpose(1, 2))
        # the recurrence runs in fp32 even under bf16 autocast: its state accumulates over the sequence
        with torch.autocast(device_type=x.device.type, enabled=False):
            if recurrent:
                o, _ = gated_delta_rule_recurrent(*args)
            else:
                o, _ = gated_delta_rule_chunked(*args, chunk=self.chunk)
        o = o.transpose(1, 2)                                    # [B, T, Hv, S]
        o = rms_norm(o, self.ssm_norm.weight, cfg.rms_eps) * F.silu(z.float().reshape(B, T, Hv, S))
        return self.ssm_out(o.reshape(B, T, Hv * S).to(x.dtype))


def rope_neox(x: torch.Tensor, positions: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """Rotate pairs (i, i + n_rot/2) of the first n_rot dims by pos * base^(-2i/n_rot); x: [B, T, H, D]."""
    half = n_rot // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / n_rot)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]          # [T, half]
    cos = torch.cos(ang).float()[None, :, None, :]
    sin = torch.sin(ang).float()[None, :, None, :]
    xf = x.float()
    x0, x1, rest = xf[..., :half], xf[..., half:n_rot], xf[..., n_rot:]
    out = torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos, rest], dim=-1)
    return out.to(x.dtype)


class AttentionMixer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg.n_embd
        self.attn_q = nn.Linear(d, 2 * cfg.q_dim, bias=False)
        self.attn_k = nn.Linear(d, cfg.kv_dim, bias=False)
        self.attn_v = nn.Linear(d, cfg.kv_dim, bias=False)
        self.attn_output = nn.Linear(cfg.q_dim, d, bias=False)
        self.attn_q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.attn_k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """-> q [B, T, H, D] (normed, roped), gate [B, T, H, D], k and v [B, T, H, D] (KV heads
        repeated so that query head h sits with KV head h // (H / Hkv), ggml_mul_mat's broadcast)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qg = self.attn_q(x).reshape(B, T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        q = self.attn_q_norm(q)
        k = self.attn_k_norm(self.attn_k(x).reshape(B, T, Hkv, D))
        v = self.attn_v(x).reshape(B, T, Hkv, D)
        q = rope_neox(q, positions, cfg.n_rot, cfg.rope_freq_base)
        k = rope_neox(k, positions, cfg.n_rot, cfg.rope_freq_base)
        if H != Hkv:
            k = k.repeat_interleave(H // Hkv, dim=2)
            v = v.repeat_interleave(H // Hkv, dim=2)
        return q, gate, k, v

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        B, T = o.shape[:2]
        return self.attn_output((o * torch.sigmoid(gate)).reshape(B, T, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, gate, k, v = self.project(x, torch.arange(x.shape[1], device=x.device))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=1.0 / math.sqrt(self.cfg.head_dim))
        return self.finish(o.transpose(1, 2), gate)


def chain_attention(q, prefix_k, prefix_v, chain_k, chain_v, scale: float) -> torch.Tensor:
    """Attention of a chained MTP draft step, as llama.cpp's draft context sees it.

    prefix_k/v [B, 1 + T, H, D]: the MTP context's own entries, row 0 for position 0 (first token,
    zero hidden) and row 1 + s for base s (step 1); the query at base t (step k, position t+k)
    reads rows 0 and 1 + s for s < t, plus the entries this draft chain wrote for base t at steps
    1..k (chain_k/v: lists of [B, T, H, D]). q is [B, T, H, D].
    """
    T = q.shape[1]
    qh = q.transpose(1, 2).float()                                           # [B, H, T, D]
    sp = (qh @ prefix_k.transpose(1, 2).float().transpose(-1, -2)) * scale    # [B, H, T, 1 + T]
    sp = sp.masked_fill(~_prefix_mask(T, q.device, strict=True), float("-inf"))
    sc = torch.stack([(q.float() * kj.float()).sum(-1) for kj in chain_k], dim=-1) * scale  # [B, T, H, k]
    p = torch.softmax(torch.cat([sp, sc.permute(0, 2, 1, 3)], dim=-1), dim=-1)
    o = p[..., :T + 1] @ prefix_v.transpose(1, 2).float()                   # [B, H, T, D]
    pc = p[..., T + 1:].permute(0, 2, 1, 3)                                  # [B, T, H, k]
    o = o.transpose(1, 2) + sum(pc[..., j, None] * vj.float() for j, vj in enumerate(chain_v))
    return o.to(q.dtype)


def _prefix_mask(T: int, device, strict: bool) -> torch.Tensor:
    """[T, 1 + T]: column 0 (position 0's entry) always visible; column 1 + s when s < t (strict)
    or s <= t."""
    m = torch.ones(T, T, dtype=torch.bool, device=device).tril(-1 if strict else 0)
    return torch.cat([torch.ones(T, 1, dtype=torch.bool, device=device), m], dim=1)


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ffn_gate = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.ffn_up = nn.Linear(cfg.n_embd, cfg.n_ff, bias=False)
        self.ffn_down = nn.Linear(cfg.n_ff, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.ffn_down(F.silu(self.ffn_gate(x)) * self.ffn_up(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, recurrent: bool):
        super().__init__()
        self.recurrent = recurrent
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.post_attention_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.mixer = DeltaNetMixer(cfg) if recurrent else AttentionMixer(cfg)
        self.ffn = FeedForward(cfg)

    def forward(self, x, recurrent_form: bool = False):
        h = self.attn_norm(x)
        h = self.mixer(h, recurrent=recurrent_form) if self.recurrent else self.mixer(h)
        x = x + h
        return x + self.ffn(self.post_attention_norm(x))


class MTPBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.enorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.hnorm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.eh_proj = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)
        self.layer = DecoderLayer(cfg, recurrent=False)
        self.shared_head_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)

    def forward(self, emb_next: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """emb_next: embedding of token t+1; h: hidden for position t. Returns the normed MTP hidden."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        return self.shared_head_norm(self.layer(x))

    def chain(self, embs, h: torch.Tensor, emb_first: torch.Tensor):
        """Chained drafting with teacher-forced tokens, attending as llama.cpp's draft context does.

        embs[k-1] [B, T, n_embd]: embedding of token t+k; h [B, T, n_embd]: the trunk's hidden at t;
        emb_first [B, n_embd]: embedding of token 0, which the context pairs with a zero hidden at
        position 0 (llama.cpp's process() on the prompt's first token). Step k feeds step k-1's
        normed output back as h. Returns the normed MTP hidden of every step.
        """
        layer, attn = self.layer, self.layer.mixer
        B, T, _ = h.shape
        base = torch.arange(T, device=h.device)
        scale = 1.0 / math.sqrt(attn.cfg.head_dim)
        x0 = self.eh_proj(torch.cat([self.enorm(emb_first[:, None]), self.hnorm(torch.zeros_like(h[:, :1]))], -1))
        _, _, k0, v0 = attn.project(layer.attn_norm(x0), base[:1] * 0)
        chain_k, chain_v, outs = [], [], []
        prefix = None
        for k, e in enumerate(embs, start=1):
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
            q, gate, kk, vv = attn.project(layer.attn_norm(x), base + k)
            chain_k.append(kk)
            chain_v.append(vv)
            if prefix is None:
                # step 1: the context's rows are exactly these entries (plus position 0's)
                prefix = (torch.cat([k0, kk], dim=1), torch.cat([v0, vv], dim=1))
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), prefix[0].transpose(1, 2), prefix[1].transpose(1, 2),
                    attn_mask=_prefix_mask(T, h.device, strict=False), scale=scale).transpose(1, 2)
            else:
                o = chain_attention(q, prefix[0], prefix[1], chain_k, chain_v, scale)
            x = x + attn.finish(o, gate)
            x = x + layer.ffn(layer.post_attention_norm(x))
            h = self.shared_head_norm(x)
            outs.append(h)
        return outs


class Qwen35(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.n_layer_nextn not in (0, 1):
            raise ValueError(f"n_layer_nextn={cfg.n_layer_nextn}: llama.cpp's qwen35 supports one MTP block")
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.is_recurrent(il)) for il in range(cfg.n_layer))
        self.output_norm = RMSNorm(cfg.n_embd, cfg.rms_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        self.mtp = MTPBlock(cfg) if cfg.n_layer_nextn else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        """GPT-style init; residual-branch outputs scaled down by depth; DeltaNet decay as in Mamba2."""
        cfg = self.cfg
        out_std = std / math.sqrt(2 * (cfg.n_layer + cfg.n_layer_nextn))
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight",)):
                p.fill_(1.0)
            elif name.endswith(("ssm_out.weight", "attn_output.weight", "ffn_down.weight")):
                p.normal_(0.0, out_std)
            elif name.endswith("ssm_conv1d"):
                p.uniform_(-1.0 / math.sqrt(cfg.ssm_conv_kernel), 1.0 / math.sqrt(cfg.ssm_conv_kernel))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("ssm_dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))          # inverse softplus
            elif p.dim() >= 2:
                p.normal_(0.0, std)

    def trunk(self, tokens: torch.Tensor, recurrent_form: bool = False) -> torch.Tensor:
        """tokens [B, T] -> hidden after output_norm [B, T, n_embd] (llama.cpp's h_nextn)."""
        x = self.tok_embd(tokens)
        for layer in self.layers:
            x = layer(x, recurrent_form)
        return self.output_norm(x)

    def forward(self, tokens: torch.Tensor, recurrent_form: bool = False):
        h = self.trunk(tokens, recurrent_form)
        return self.output(h), h

    def mtp_step(self, h: torch.Tensor, next_tokens: torch.Tensor, trunk_grad: float = 1.0):
        """One MTP application: (h at position t, token t+1) -> (logits for token t+2, normed MTP hidden).

        trunk_grad scales the gradient this step sends into the trunk and the shared embedding and
        output matrices (1 = fully joint training, 0 = the MTP block learns on frozen trunk features).
        """
        if self.mtp is None:
            raise ValueError("this config has no MTP block (n_layer_nextn = 0)")
        emb_w, out_w = self.tok_embd.weight, self.output.weight
        if trunk_grad != 1.0:
            h = _scale_grad(h, trunk_grad)
            emb_w = _scale_grad(emb_w, trunk_grad)
            out_w = _scale_grad(out_w, trunk_grad)
        h_next = self.mtp(F.embedding(next_tokens, emb_w), h)
        return F.linear(h_next, out_w), h_next

    def mtp_chain(self, h: torch.Tensor, first_tokens: torch.Tensor, next_tokens: list,
                  trunk_grad: float = 1.0) -> list:
        """Chained MTP steps over a sequence: first_tokens [B] is token 0, next_tokens[k-1] [B, T]
        holds token t+k. -> logits of every step (step k at base t predicts token t+k+1).
        trunk_grad as in `mtp_step`."""
        if self.mtp is None:
            raise ValueError("this config has no MTP block (n_layer_nextn = 0)")
        emb_w, out_w = self.tok_embd.weight, self.output.weight
        if trunk_grad != 1.0:
            h = _scale_grad(h, trunk_grad)
            emb_w = _scale_grad(emb_w, trunk_grad)
            out_w = _scale_grad(out_w, trunk_grad)
        hs = self.mtp.chain([F.embedding(t, emb_w) for t in next_tokens], h, F.embedding(first_tokens, emb_w))
        return [F.linear(x, out_w) for x in hs]

    # ----------------------------------------------------------------------------------------
    def gguf_tensors(self) -> dict:
        """name -> float32 numpy array in GGUF numpy layout (matrices [out, in])."""
        cfg = self.cfg
        out: dict = {}

        def put(name, t):
            out[name] = t.detach().float().cpu().numpy().copy()

        put("token_embd.weight", self.tok_embd.weight)
        put("output_norm.weight", self.output_norm.weight)
        put("output.weight", self.output.weight)

        def put_layer(p, layer: DecoderLayer):
            put(p + "attn_norm.weight", layer.attn_norm.weight)
            put(p + "post_attention_norm.weight", layer.post_attention_norm.weight)
            put(p + "ffn_gate.weight", layer.ffn.ffn_gate.weight)
            put(p + "ffn_up.weight", layer.ffn.ffn_up.weight)
            put(p + "ffn_down.weight", layer.ffn.ffn_down.weight)
            m = layer.mixer
            if layer.recurrent:
                put(p + "attn_qkv.weight", m.attn_qkv.weight)
                put(p + "attn_gate.weight", m.attn_gate.weight)
                put(p + "ssm_conv1d.weight", m.ssm_conv1d)
                put(p + "ssm_dt.bias", m.ssm_dt_bias)
                put(p + "ssm_a", m.ssm_a())
                put(p + "ssm_beta.weight", m.ssm_beta.weight)
                put(p + "ssm_alpha.weight", m.ssm_alpha.weight)
                put(p + "ssm_norm.weight", m.ssm_norm.weight)
                put(p + "ssm_out.weight", m.ssm_out.weight)
            else:
                put(p + "attn_q.weight", m.attn_q.weight)
                put(p + "attn_k.weight", m.attn_k.weight)
                put(p + "attn_v.weight", m.attn_v.weight)
                put(p + "attn_output.weight", m.attn_output.weight)
                put(p + "attn_q_norm.weight", m.attn_q_norm.weight)
                put(p + "attn_k_norm.weight", m.attn_k_norm.weight)

        for il, layer in enumerate(self.layers):
            put_layer(f"blk.{il}.", layer)
        if self.mtp is not None:
            p = f"blk.{cfg.n_layer}."
            put_layer(p, self.mtp.layer)
            put(p + "nextn.eh_proj.weight", self.mtp.eh_proj.weight)
            put(p + "nextn.enorm.weight", self.mtp.enorm.weight)
            put(p + "nextn.hnorm.weight", self.mtp.hnorm.weight)
            put(p + "nextn.shared_head_norm.weight", self.mtp.shared_head_norm.weight)
        return out


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    if scale == 0.0:
        return x.detach()
    return _GradScale.apply(x, scale)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
