"""PyTorch (eager) counterparts of the models widen lowers, for the docs/architecture.md §10
side-by-side benchmark.

Every model shares one backbone (docs/math.md §1): byte vocabulary, pre-norm blocks of
causal multi-head attention with half-split RoPE and a SwiGLU feed-forward, final
RMSNorm and an untied unembedding. Only the residual stream differs:

- ``residual``: the plain pre-norm residual h <- h + F(h) (docs/math.md §1.3);
- ``vwn``: Virtual Width Networks with dynamic GHC (docs/math.md §5.1-§5.6), reduced by
  GroupNorm + W_reduce before the head (§5.2);
- ``mhc``: manifold-constrained hyper-connections with Sinkhorn-Knopp mixing
  (docs/math.md §4.2-§4.4);
- ``xhc``: full expanded hyper-connections (docs/math.md §6.2-§6.7): routing, dense read,
  active-set maps, temporal augmentation with Gram-Schmidt on the MLP sublayers and a
  sparse write-back.

The code follows the papers' equations as written in docs/math.md (the per-token state is
one row per stream; the VWN matrices A and B are kept in the paper's layout, so the
read is Å^T H', the carry Â^T H' and the write B^T Z). Parameter shapes and inits
follow the DECISIONs of docs/math.md, so parameter counts match widen's for the same
configuration (``count_params``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = ("residual", "vwn", "mhc", "xhc")


def default_ffn_hidden(d: int) -> int:
    """SwiGLU width: round_up(8D/3, 256) (Llama, docs/math.md §1.2), or round_up(8D/3, 8)
    for D < 96 so that tiny models stay tiny."""
    raw = -(-8 * d // 3)
    multiple = 8 if d < 96 else 256
    return -(-raw // multiple) * multiple


@dataclass
class Config:
    """Backbone and scheme hyper-parameters (defaults: docs/math.md §1.2 and the papers'
    settings used by widen's specs)."""

    vocab: int = 256
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    ffn_hidden: int | None = None
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    init_std: float = 0.02
    # VWN (§5): m backbone segments, n over-width slots, r = n / m.
    vwn_m: int = 4
    vwn_n: int = 16
    # mHC (§4): n streams, t_max Sinkhorn iterations, alpha init (paper Table 5).
    mhc_n: int = 4
    sinkhorn_iters: int = 20
    alpha_init: float = 0.01
    # xHC (§6.1): N streams, k active, m_f fixed, MLP-side conv kernels.
    xhc_n: int = 16
    xhc_k: int = 4
    xhc_fixed: int = 2
    xhc_kernels: tuple[int, ...] = field(default=(4, 8, 12))
    gs_eps_rel: float = 1e-6

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or default_ffn_hidden(self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def rms_norm(x: torch.Tensor, eps: float, gain: torch.Tensor | None = None) -> torch.Tensor:
    """x (mean x^2 + eps)^(-1/2), times the gain (docs/math.md §1.3)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def normal(shape, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * std)


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp over the last two axes (docs/math.md §4.2, paper Eq. 9): exp, then
    `iters` rounds of column then row normalization. Subtracting each column's max
    before exp leaves the result unchanged, because a column normalization comes first.
    Autograd differentiates the finite, unrolled iteration (§4.5)."""
    m = torch.exp(logits - logits.detach().amax(dim=-2, keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def rope_tables(t: int, head_dim: int, base: float, device=None):
    """cos, sin `[T, d_h/2]` of the half-split RoPE: theta_i = base^(-2i/d_h)."""
    half = head_dim // 2
    theta = base ** (-torch.arange(half, dtype=torch.float32, device=device) * 2.0 / head_dim)
    phase = torch.arange(t, dtype=torch.float32, device=device)[:, None] * theta[None, :]
    return phase.cos(), phase.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the pairs (x_i, x_{i + d_h/2}) of `[B, H, T, d_h]` by pos * theta_i."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Attention(nn.Module):
    """Attention sublayer F(u) = MHA(RMSNorm(u)) W_o with causal mask, half-split RoPE
    and logit scale 1/sqrt(d_h) (docs/math.md §1.3). Weights in the `x @ W` convention."""

    def __init__(self, cfg: Config):
        super().__init__()
        d, std = cfg.d_model, cfg.init_std
        self.cfg = cfg
        self.norm = nn.Parameter(torch.ones(d))
        self.wq = normal((d, d), std)
        self.wk = normal((d, d), std)
        self.wv = normal((d, d), std)
        self.wo = normal((d, d), std / math.sqrt(2 * cfg.layers))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = u.shape
        a = rms_norm(u, cfg.norm_eps, self.norm)

        def heads(w):
            return (a @ w).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)

        cos, sin = rope_tables(t, cfg.head_dim, cfg.rope_base, u.device)
        q = apply_rope(heads(self.wq), cos, sin)
        k = apply_rope(heads(self.wk), cos, sin)
        o = F.scaled_dot_product_attention(q, k, heads(self.wv), is_causal=True)
        return o.transpose(1, 2).reshape(b, t, cfg.d_model) @ self.wo


class SwiGlu(nn.Module):
    """FFN sublayer F(u) = (silu(x W_1) * (x W_3)) W_2 with x = RMSNorm(u) (docs/math.md §1.3)."""

    def __init__(self, cfg: Config):
        super().__init__()
        d, f, std = cfg.d_model, cfg.hidden, cfg.init_std
        self.eps = cfg.norm_eps
        self.norm = nn.Parameter(torch.ones(d))
        self.w1 = normal((d, f), std)
        self.w3 = normal((d, f), std)
        self.w2 = normal((f, d), std / math.sqrt(2 * cfg.layers))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x = rms_norm(u, self.eps, self.norm)
        return (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2


# ---------------------------------------------------------------------------------
# Residual-stream connections. Each wraps one backbone sublayer F:
# state -> new state, where the state is `[B, T, s, d_s]` (one row per stream).
# ---------------------------------------------------------------------------------


class PlainConnection(nn.Module):
    """h <- h + F(h) on a single `[B, T, 1, D]` stream."""

    def __init__(self, cfg: Config, sublayer: int, is_ffn: bool):
        super().__init__()

    def forward(self, state, branch):
        return state + branch(state.squeeze(2)).unsqueeze(2)


class GhcConnection(nn.Module):
    """Dynamic GHC (docs/math.md §5.3, §5.5) on the over-width state H' `[B, T, n, d_b]`.

    Paper layout: A = [Å | Â] in R^{n x (m+n)} (read, carry) and B in R^{m x n} (write),
    A(H') = S_α ∘ tanh(H̄' W_α / τ) + A and B(H') = S_β ∘ tanh(H̄' W_β / τ)^T + B with
    H̄' the per-slot RMSNorm (one gain of size d_b) and τ = sqrt(d_b). Then
    X = Å^T H', z = F(vec X), H'' = B^T reshape(z) + Â^T H'.
    Init (§5.6): Å = [I_m; 0], Â = I_n, B cyclic (B[i, j] = 1 iff j = i mod m),
    W_α = W_β = 0, S_α = S_β = 1.
    """

    def __init__(self, cfg: Config, sublayer: int, is_ffn: bool):
        super().__init__()
        m, n = cfg.vwn_m, cfg.vwn_n
        db = cfg.d_model // m
        self.m, self.n, self.db, self.eps = m, n, db, cfg.norm_eps
        self.tau = math.sqrt(db)
        a = torch.zeros(n, m + n)
        a[:m, :m] = torch.eye(m)
        a[:, m:] = torch.eye(n)
        self.a_static = nn.Parameter(a)
        b = torch.zeros(m, n)
        for j in range(n):
            b[j % m, j] = 1.0
        self.b_static = nn.Parameter(b)
        self.s_alpha = nn.Parameter(torch.ones(n, m + n))
        self.s_beta = nn.Parameter(torch.ones(m, n))
        self.w_alpha = nn.Parameter(torch.zeros(db, m + n))
        self.w_beta = nn.Parameter(torch.zeros(db, m))
        self.norm = nn.Parameter(torch.ones(db))

    def forward(self, h, branch):
        m, n = self.m, self.n
        bsz, t = h.shape[:2]
        hn = rms_norm(h, self.eps, self.norm)  # [B, T, n, d_b]
        a = self.s_alpha * torch.tanh(hn @ self.w_alpha / self.tau) + self.a_static  # [B,T,n,m+n]
        bt = self.s_beta.t() * torch.tanh(hn @ self.w_beta / self.tau) + self.b_static.t()  # B^T [B,T,n,m]
        a_read, a_carry = a[..., :m], a[..., m:]
        x = a_read.transpose(-1, -2) @ h  # Å^T H'  [B, T, m, d_b]
        z = branch(x.reshape(bsz, t, m * self.db)).view(bsz, t, m, self.db)
        return bt @ z + a_carry.transpose(-1, -2) @ h


class MhcConnection(nn.Module):
    """mHC (docs/math.md §4.1-§4.2) on n streams `[B, T, n, C]`:
    x' = RMSNorm(vec X) (no gain: folded into φ), H̃ = α ⊙ (x' φ) + b split [pre | post | res],
    H_pre = σ, H_post = 2σ, H_res = Sinkhorn(mat(H̃_res)) (t_max = 20);
    X' = H_res X + H_post^T F(H_pre X).
    Init (§4.4, convention 1): φ = 0, α = 0.01, b_pre = +3 on the home stream l mod n
    and -3 elsewhere, b_post = 0, b_res = 6I - 3."""

    def __init__(self, cfg: Config, sublayer: int, is_ffn: bool):
        super().__init__()
        n, c = cfg.mhc_n, cfg.d_model
        self.n, self.eps, self.iters = n, cfg.norm_eps, cfg.sinkhorn_iters
        self.phi = nn.Parameter(torch.zeros(n * c, n * n + 2 * n))
        self.alpha = nn.Parameter(torch.full((3,), cfg.alpha_init))
        b_pre = torch.full((n,), -3.0)
        b_pre[sublayer % n] = 3.0
        b_res = 6.0 * torch.eye(n) - 3.0
        self.bias = nn.Parameter(torch.cat((b_pre, torch.zeros(n), b_res.flatten())))

    def forward(self, x, branch):
        n = self.n
        bsz, t, _, c = x.shape
        proj = rms_norm(x.reshape(bsz, t, n * c), self.eps) @ self.phi
        scale = torch.cat((self.alpha[0:1].expand(n), self.alpha[1:2].expand(n), self.alpha[2:3].expand(n * n)))
        logits = proj * scale + self.bias
        h_pre = torch.sigmoid(logits[..., :n])
        h_post = 2.0 * torch.sigmoid(logits[..., n : 2 * n])
        h_res = sinkhorn(logits[..., 2 * n :].reshape(bsz, t, n, n), self.iters)
        u = torch.einsum("bti,btic->btc", h_pre, x)
        y = branch(u)
        return h_res @ x + h_post.unsqueeze(-1) * y.unsqueeze(2)


class XhcConnection(nn.Module):
    """Full xHC (docs/math.md §6.2-§6.6) on N streams `[B, T, N, C]`, one sublayer:

    s = σ(LN(vec X) W^r); I = fixed streams 0..m_f-1, then the top k - m_f other
    streams by s in ascending stream index; p = (1 for fixed, s_I for routed).
    H_pre = σ(α_pre RMSNorm(vec X) W^pre + b_pre); u = Σ_i H_pre,i x_i; out = F(u).
    X_act = X[I]; x̃ = RMSNorm(vec X_act); H_res = rowclamp(SK(α_res mat(x̃ W^res) + b_res));
    H_post = 2σ(α_post mat(x̃ W^post) + b_post) `[k, K_r]`.
    Y = [out; GS(conv_j(out))] on MLP sublayers (K_r = 4), else [out] (§6.5).
    X[I] <- H_res X_act + diag(p) H_post Y; other rows carried unchanged (§6.6).
    Init per §6.7.
    """

    def __init__(self, cfg: Config, sublayer: int, is_ffn: bool):
        super().__init__()
        n, k, mf, c = cfg.xhc_n, cfg.xhc_k, cfg.xhc_fixed, cfg.d_model
        self.n, self.k, self.mf, self.c = n, k, mf, c
        self.eps, self.iters, self.gs_eps_rel = cfg.norm_eps, cfg.sinkhorn_iters, cfg.gs_eps_rel
        self.kernels = tuple(cfg.xhc_kernels) if is_ffn else ()
        kr = len(self.kernels) + 1
        self.kr = kr
        self.router = normal((n * c, n), 1.0 / math.sqrt(n * c)) if mf < k else None
        self.w_pre = nn.Parameter(torch.zeros(n * c, n))
        self.w_res = nn.Parameter(torch.zeros(k * c, k * k))
        self.w_post = nn.Parameter(torch.zeros(k * c, k * kr))
        self.alpha = nn.Parameter(torch.full((3,), cfg.alpha_init))  # pre, res, post
        home = sublayer % mf if mf > 0 else sublayer % n
        b_pre = torch.full((n,), math.log(0.05 / (n - 1) / (1 - 0.05 / (n - 1))) if n > 1 else 0.0)
        b_pre[home] = math.log(0.95 / 0.05)
        self.b_pre = nn.Parameter(b_pre)
        self.b_res = nn.Parameter(6.0 * torch.eye(k) - 3.0)
        b_post = torch.full((k, kr), -3.0)
        b_post[:, 0] = 0.0
        self.b_post = nn.Parameter(b_post)
        # Causal depthwise conv kernels in Conv1d layout [C, 1, κ]; PyTorch's default
        # U(±1/sqrt κ) init (§6.7 DECISION).
        self.convs = nn.ParameterList(
            nn.Parameter(torch.empty(c, 1, kap).uniform_(-1 / math.sqrt(kap), 1 / math.sqrt(kap)))
            for kap in self.kernels
        )

    def route(self, flat: torch.Tensor):
        """Active indices I `[B, T, k]` and write gates p `[B, T, k]` (§6.2)."""
        bsz, t = flat.shape[:2]
        mf, k = self.mf, self.k
        fixed = torch.arange(mf, device=flat.device).expand(bsz, t, mf)
        if self.router is None:
            return fixed, torch.ones(bsz, t, k, device=flat.device)
        s = torch.sigmoid(F.layer_norm(flat, (flat.shape[-1],), eps=self.eps) @ self.router)
        routed = s[..., mf:].topk(k - mf, dim=-1).indices.sort(dim=-1).values + mf
        idx = torch.cat((fixed, routed), dim=-1)
        p = torch.cat((torch.ones(bsz, t, mf, device=flat.device), s.gather(-1, routed)), dim=-1)
        return idx, p

    def augment(self, out: torch.Tensor) -> torch.Tensor:
        """Y `[B, T, K_r, C]`: out, then the causal depthwise convolutions of out made
        orthogonal per token by modified Gram-Schmidt with the relative guard
        <v, v> + eps_rel <out, out> + 1e-20 (docs/math.md §6.5)."""
        if not self.kernels:
            return out.unsqueeze(2)
        t = out.shape[1]
        seq = out.transpose(1, 2)  # [B, C, T]
        guard = self.gs_eps_rel * (out * out).sum(-1, keepdim=True) + 1e-20
        vs = [out]
        for w in self.convs:
            g = F.conv1d(F.pad(seq, (w.shape[-1] - 1, 0)), w, groups=self.c)[..., :t].transpose(1, 2)
            for v in vs:
                g = g - ((g * v).sum(-1, keepdim=True) / ((v * v).sum(-1, keepdim=True) + guard)) * v
            vs.append(g)
        return torch.stack(vs, dim=2)

    def forward(self, x, branch):
        n, k, c, kr = self.n, self.k, self.c, self.kr
        bsz, t = x.shape[:2]
        flat = x.reshape(bsz, t, n * c)
        idx, p = self.route(flat)
        h_pre = torch.sigmoid(self.alpha[0] * (rms_norm(flat, self.eps) @ self.w_pre) + self.b_pre)
        u = torch.einsum("bti,btic->btc", h_pre, x)

        gather_idx = idx.unsqueeze(-1).expand(bsz, t, k, c)
        x_act = x.gather(2, gather_idx)
        xa = rms_norm(x_act.reshape(bsz, t, k * c), self.eps)
        h_res = sinkhorn(self.alpha[1] * (xa @ self.w_res).view(bsz, t, k, k) + self.b_res, self.iters)
        h_res = h_res / h_res.sum(-1, keepdim=True).clamp(min=1.0)
        h_post = 2.0 * torch.sigmoid(self.alpha[2] * (xa @ self.w_post).view(bsz, t, k, kr) + self.b_post)

        y = self.augment(branch(u))
        x_new = h_res @ x_act + (p.unsqueeze(-1) * h_post) @ y
        return x.scatter(2, gather_idx, x_new)


CONNECTIONS = {
    "residual": PlainConnection,
    "vwn": GhcConnection,
    "mhc": MhcConnection,
    "xhc": XhcConnection,
}


class Model(nn.Module):
    """Byte-level language model: stream creation, L blocks of (attention, FFN), each
    sublayer wrapped by the scheme's connection, collapse, final RMSNorm, unembedding,
    mean next-token cross-entropy (docs/math.md §1.3)."""

    def __init__(self, cfg: Config, scheme: str):
        super().__init__()
        if scheme not in CONNECTIONS:
            raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
        d, std = cfg.d_model, cfg.init_std
        self.cfg, self.scheme = cfg, scheme
        if scheme == "vwn":
            if d % cfg.vwn_m != 0 or cfg.vwn_n < cfg.vwn_m:
                raise ValueError("vwn needs d_model % m == 0 and n >= m")
            self.wide = cfg.vwn_n * (d // cfg.vwn_m)
            self.embed = normal((cfg.vocab, self.wide), std)  # E_wide (§5.2)
            # GroupNorm with groups of size D (r = n/m groups) when r is an integer >= 2,
            # else no norm (§5.2 DECISION); W_reduce = [I_D | 0] in x @ W form (§5.6).
            r_int = cfg.vwn_n % cfg.vwn_m == 0 and cfg.vwn_n >= 2 * cfg.vwn_m
            self.reduce_groups = cfg.vwn_n // cfg.vwn_m if r_int else 0
            if r_int:
                self.reduce_gain = nn.Parameter(torch.ones(self.wide))
                self.reduce_bias = nn.Parameter(torch.zeros(self.wide))
            self.reduce = nn.Parameter(torch.eye(self.wide, d))
        else:
            self.embed = normal((cfg.vocab, d), std)
        self.attn = nn.ModuleList(Attention(cfg) for _ in range(cfg.layers))
        self.ffn = nn.ModuleList(SwiGlu(cfg) for _ in range(cfg.layers))
        conn = CONNECTIONS[scheme]
        self.conns = nn.ModuleList(conn(cfg, l, l % 2 == 1) for l in range(2 * cfg.layers))
        self.final_norm = nn.Parameter(torch.ones(d))
        self.unembed = normal((d, cfg.vocab), std)

    def streams(self) -> int:
        return {"residual": 1, "vwn": self.cfg.vwn_n, "mhc": self.cfg.mhc_n, "xhc": self.cfg.xhc_n}[self.scheme]

    def create(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[B, T]` to the state `[B, T, s, d_s]`: replicate (mHC, xHC, §4.4,
        §6.7) or reshape the over-width embedding into n slots (VWN, §5.2)."""
        e = self.embed[ids]
        bsz, t = ids.shape
        if self.scheme == "vwn":
            return e.view(bsz, t, self.cfg.vwn_n, -1)
        return e.unsqueeze(2).expand(bsz, t, self.streams(), e.shape[-1])

    def collapse(self, state: torch.Tensor) -> torch.Tensor:
        """The state to `[B, T, D]`: sum of the streams (HC/mHC/xHC, §0.3), or VWN's
        GroupNorm + W_reduce (§5.2)."""
        if self.scheme != "vwn":
            return state.sum(2)
        bsz, t = state.shape[:2]
        flat = state.reshape(bsz, t, self.wide)
        if self.reduce_groups:
            normed = F.group_norm(
                flat.reshape(bsz * t, self.wide), self.reduce_groups, self.reduce_gain, self.reduce_bias,
                self.cfg.norm_eps,
            )
            flat = normed.view(bsz, t, self.wide)
        return flat @ self.reduce

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of a `[B, T + 1]` byte window."""
        ids, targets = window[:, :-1], window[:, 1:]
        state = self.create(ids)
        for i in range(self.cfg.layers):
            state = self.conns[2 * i](state, self.attn[i])
            state = self.conns[2 * i + 1](state, self.ffn[i])
        h = rms_norm(self.collapse(state), self.cfg.norm_eps, self.final_norm)
        logits = h @ self.unembed
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# Parameters without weight decay: norm gains, embeddings, static connection matrices,
# scales, gates and biases (docs/math.md §1.2, §4.4, §5.6, §6.7).
NO_DECAY = (
    "norm", "embed", "a_static", "b_static", "s_alpha", "s_beta", "alpha", "bias", "b_pre", "b_res", "b_post",
    "reduce_gain", "reduce_bias",
)


def param_groups(model: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        (no_decay if leaf in NO_DECAY else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
