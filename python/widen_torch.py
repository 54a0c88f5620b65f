"""Load a widen checkpoint into PyTorch and compute its logits and loss.

Needs only numpy and torch (no widen install). A checkpoint is a safetensors
file; this module parses its header (8-byte little-endian length, then JSON)
and the raw little-endian bytes itself, or uses the `safetensors` package when
it is installed. The file format, every tensor's name, shape and orientation
are documented in docs/checkpoints.md; the equations are those of docs/math.md,
implemented as widen's lowering implements them (ir/src/lower/).

Supported: the plain residual, mHC (docs/math.md §4), GHC / VWN (§5, dynamic or
static, embed_mode Full or Expand, with or without the GroupNorm before the
reduce) and full xHC (§6, flash: None), with a SwiGLU FFN, f32 precision, the
standard parametrization or muP (§8.1), tied or separate unembedding. With MTP
modules (§7) the main head's logits and next-token loss are computed; the MTP
terms are not. Other configurations (HC, FC, MoE, xHC-Flash, bf16) raise
NotImplementedError.

    import widen_torch
    model = widen_torch.load("runs/vwn-r4/final.safetensors")
    logits = model(tokens[:, :-1])              # [B, T, 256]
    loss = model.loss(tokens)                   # tokens: [B, T + 1] windows

The names every scheme reads are in TENSOR_NAMES below, one literal that a
widen test (tests/checkpoint_names.rs) checks against the names widen writes
for specs/residual.ron, specs/mhc.ron, specs/vwn-r4.ron and specs/xhc.ron.
"""

import json
import math
import struct

import numpy as np
import torch
import torch.nn.functional as F

# The tensor names each scheme's model reads, as templates: `{i}` is a block
# index (0..layers-1), `{j}` an xHC convolution index (0..len(conv_kernels)-1).
# Keys name the roles used below. The literal between the BEGIN and END lines is
# JSON (double quotes, no trailing commas) so that the Rust test can parse it.
# The lists are those of the configurations in specs/*.ron; optional names (a
# static GHC has no generator, a tied head no `unembed`, ...) are listed and
# skipped by the loader where the spec says they are absent.
# BEGIN TENSOR_NAMES
TENSOR_NAMES = {
    "backbone": {
        "embed": "embed",
        "final_norm": "final_norm",
        "unembed": "unembed",
        "attn.norm": "blocks.{i}.attn.norm",
        "attn.wq": "blocks.{i}.attn.wq",
        "attn.wk": "blocks.{i}.attn.wk",
        "attn.wv": "blocks.{i}.attn.wv",
        "attn.wo": "blocks.{i}.attn.wo",
        "ffn.norm": "blocks.{i}.ffn.norm",
        "ffn.w1": "blocks.{i}.ffn.w1",
        "ffn.w2": "blocks.{i}.ffn.w2",
        "ffn.w3": "blocks.{i}.ffn.w3"
    },
    "residual": {},
    "mhc": {
        "attn.phi": "blocks.{i}.attn.conn.phi",
        "attn.alpha": "blocks.{i}.attn.conn.alpha",
        "attn.bias": "blocks.{i}.attn.conn.bias",
        "ffn.phi": "blocks.{i}.ffn.conn.phi",
        "ffn.alpha": "blocks.{i}.ffn.conn.alpha",
        "ffn.bias": "blocks.{i}.ffn.conn.bias"
    },
    "ghc": {
        "embed_wide": "embed_wide",
        "attn.h_pre": "blocks.{i}.attn.conn.h_pre",
        "attn.h_res": "blocks.{i}.attn.conn.h_res",
        "attn.h_post": "blocks.{i}.attn.conn.h_post",
        "attn.norm": "blocks.{i}.attn.conn.norm",
        "attn.w_alpha": "blocks.{i}.attn.conn.w_alpha",
        "attn.w_beta": "blocks.{i}.attn.conn.w_beta",
        "attn.s_pre": "blocks.{i}.attn.conn.s_pre",
        "attn.s_res": "blocks.{i}.attn.conn.s_res",
        "attn.s_post": "blocks.{i}.attn.conn.s_post",
        "ffn.h_pre": "blocks.{i}.ffn.conn.h_pre",
        "ffn.h_res": "blocks.{i}.ffn.conn.h_res",
        "ffn.h_post": "blocks.{i}.ffn.conn.h_post",
        "ffn.norm": "blocks.{i}.ffn.conn.norm",
        "ffn.w_alpha": "blocks.{i}.ffn.conn.w_alpha",
        "ffn.w_beta": "blocks.{i}.ffn.conn.w_beta",
        "ffn.s_pre": "blocks.{i}.ffn.conn.s_pre",
        "ffn.s_res": "blocks.{i}.ffn.conn.s_res",
        "ffn.s_post": "blocks.{i}.ffn.conn.s_post",
        "reduce.norm": "reduce.norm",
        "reduce.norm_bias": "reduce.norm_bias",
        "reduce.w": "reduce.w"
    },
    "xhc": {
        "attn.router": "blocks.{i}.attn.conn.router",
        "attn.pre": "blocks.{i}.attn.conn.pre",
        "attn.b_pre": "blocks.{i}.attn.conn.b_pre",
        "attn.alpha_pre": "blocks.{i}.attn.conn.alpha_pre",
        "attn.res": "blocks.{i}.attn.conn.res",
        "attn.b_res": "blocks.{i}.attn.conn.b_res",
        "attn.alpha_res": "blocks.{i}.attn.conn.alpha_res",
        "attn.post": "blocks.{i}.attn.conn.post",
        "attn.b_post": "blocks.{i}.attn.conn.b_post",
        "attn.alpha_post": "blocks.{i}.attn.conn.alpha_post",
        "ffn.router": "blocks.{i}.ffn.conn.router",
        "ffn.pre": "blocks.{i}.ffn.conn.pre",
        "ffn.b_pre": "blocks.{i}.ffn.conn.b_pre",
        "ffn.alpha_pre": "blocks.{i}.ffn.conn.alpha_pre",
        "ffn.res": "blocks.{i}.ffn.conn.res",
        "ffn.b_res": "blocks.{i}.ffn.conn.b_res",
        "ffn.alpha_res": "blocks.{i}.ffn.conn.alpha_res",
        "ffn.post": "blocks.{i}.ffn.conn.post",
        "ffn.b_post": "blocks.{i}.ffn.conn.b_post",
        "ffn.alpha_post": "blocks.{i}.ffn.conn.alpha_post",
        "ffn.conv": "blocks.{i}.ffn.conn.conv{j}"
    }
}
# END TENSOR_NAMES

# GHC with embed_mode Expand reads these instead of `embed_wide` (docs/math.md §5.2).
GHC_EXPAND_NAMES = {"embed": "embed", "embed_expand": "embed_expand"}

_DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64, "F16": np.float16}


def read_safetensors(path):
    """(tensors as numpy arrays by name, header metadata dict) of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        dtype = entry["dtype"]
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}, which this reader does not handle")
        start, end = entry["data_offsets"]
        arr = np.frombuffer(data[base + start : base + end], dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<"))
        tensors[name] = arr.reshape(entry["shape"]).copy()
    return tensors, meta


def read_checkpoint(path):
    """(spec as a dict, parameter arrays by name, metadata) of a widen checkpoint.

    The spec is the header's `spec_json` (written since data identities were
    recorded); optimizer state (`opt.*`) is left out of the parameters."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != "widen-checkpoint":
        raise ValueError(f"{path}: not a widen checkpoint (header `format` is {meta.get('format')!r})")
    if meta.get("format_version") != "1":
        raise ValueError(f"{path}: format version {meta.get('format_version')!r}; this loader reads version 1")
    if "spec_json" not in meta:
        raise ValueError(f"{path}: no `spec_json` in the header (written by an older widen); re-save it with widen")
    spec = json.loads(meta["spec_json"])
    params = {k: v for k, v in tensors.items() if not k.startswith("opt.")}
    return spec, params, meta


def _variant(value):
    """(name, fields) of a serde enum value: "Residual" or {"Ghc": {...}}."""
    if isinstance(value, str):
        return value, {}
    ((name, fields),) = value.items()
    return name, fields


# ---- ops, exactly as the reference executor (ir/src/exec) computes them ----


def rms_norm(x, gain, eps):
    """x (mean x^2 + eps)^-1/2 [* gain] over the last axis (docs/math.md §1.3)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def group_norm(x, groups, gain, bias, eps):
    """(x - mean) (var + eps)^-1/2 over `groups` equal slices of the last axis, then gain, bias."""
    shape = x.shape
    g = x.reshape(*shape[:-1], groups, shape[-1] // groups)
    mu = g.mean(-1, keepdim=True)
    var = (g - mu).pow(2).mean(-1, keepdim=True)
    y = ((g - mu) * torch.rsqrt(var + eps)).reshape(shape)
    return y * gain + bias


def norm_project(x, w, eps, centered):
    """NormProject (docs/math.md §4.3, §6.2): the projection of the normalized x by w
    [K, M]; the first `centered` columns with LayerNorm statistics, the rest RMSNorm."""
    out = x @ w
    if centered > 0:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        head = torch.rsqrt(var + eps) * (out[..., :centered] - w[:, :centered].sum(0) * mu)
        tail = out[..., centered:] * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return torch.cat([head, tail], -1)
    return out * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def sinkhorn(x, iters, eps):
    """Sinkhorn-Knopp over the last two axes (docs/math.md §4.2): exp(x - colmax), then
    `iters` times columns / (sum + eps), rows / (sum + eps)."""
    # The column max cancels in the first column normalization, so it carries no gradient.
    m = torch.exp(x - x.max(-2, keepdim=True).values.detach())
    for _ in range(iters):
        m = m / (m.sum(-2, keepdim=True) + eps)
        m = m / (m.sum(-1, keepdim=True) + eps)
    return m


def rope(x, base):
    """Half-split RoPE on x [B, T, H, dh] (docs/math.md §1.3): position = index along T;
    the pair (x_i, x_{i + dh/2}) turns by t * base^(-2i/dh)."""
    t, dh = x.shape[1], x.shape[3]
    half = dh // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = base ** (-2.0 * i / dh)
    phi = torch.arange(t, dtype=torch.float64)[:, None] * theta[None, :]  # [T, half]
    c = torch.cos(phi).to(x.dtype)[None, :, None, :]
    s = torch.sin(phi).to(x.dtype)[None, :, None, :]
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat([lo * c - hi * s, lo * s + hi * c], -1)


def causal_attention(q, k, v, scale, rope_base):
    """q [B, T, H, dh], k, v [B, T, Hkv, dh] -> [B, T, H, dh]; query head h reads
    key/value head floor(h Hkv / H)."""
    if rope_base is not None:
        q, k = rope(q, rope_base), rope(k, rope_base)
    h, hkv = q.shape[2], k.shape[2]
    group = torch.tensor([i * hkv // h for i in range(h)], device=q.device)
    k, v = k[:, :, group], v[:, :, group]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    t = q.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def causal_depthwise_conv(x, w):
    """g[b, t, c] = sum_{i < kappa, i <= t} w[i, c] x[b, t - i, c] (docs/math.md §6.5)."""
    kappa, t = w.shape[0], x.shape[1]
    # x delayed by i positions (zeros before t = 0), times tap i.
    terms = [w[i] * F.pad(x, (0, 0, i, 0))[:, :t] for i in range(min(kappa, t))]
    return torch.stack(terms, 0).sum(0)


def gram_schmidt(out, ys, eps_rel, eps_abs=1e-20):
    """Modified Gram-Schmidt per token (docs/math.md §6.5): each y_j loses its projection
    on out, then on y_0, ..., y_{j-1} (already orthogonalized), each denominator
    <v, v> + eps_rel <out, out> + eps_abs. out [B, T, C], ys list of [B, T, C]."""
    out_sq = (out * out).sum(-1, keepdim=True)
    guard = eps_rel * out_sq + eps_abs
    done = []
    for g in ys:
        u = g - ((g * out).sum(-1, keepdim=True) / (out_sq + guard)) * out
        for v in done:
            u = u - ((u * v).sum(-1, keepdim=True) / ((v * v).sum(-1, keepdim=True) + guard)) * v
        done.append(u)
    return done


def topk_route(scores, k, fixed):
    """Indices 0..fixed, then the k - fixed highest scores among fixed..N, ascending
    (docs/math.md §6.2; ties to the lowest index). scores [B, T, N] -> long [B, T, k]."""
    b, t, n = scores.shape
    fixed_idx = torch.arange(fixed, device=scores.device).expand(b, t, fixed)
    if k == fixed:
        return fixed_idx
    rest = scores[..., fixed:]
    # A stable descending sort keeps the lower index first among equal scores.
    order = torch.sort(rest, dim=-1, descending=True, stable=True).indices[..., : k - fixed] + fixed
    routed = torch.sort(order, dim=-1).values
    return torch.cat([fixed_idx, routed], -1)


# ---- the model ----


class WidenModel(torch.nn.Module):
    """A widen model built from a checkpoint's spec and tensors (see the module doc)."""

    def __init__(self, spec, params, dtype=torch.float64):
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.scheme, self.cfg = _variant(spec["residual"])
        self._check_supported()
        self.d = spec["d_model"]
        self.layers = spec["layers"]
        self.heads = spec["heads"]
        self.kv_heads = spec["kv_heads"] or spec["heads"]
        self.head_dim = spec["head_dim"] or self.d // self.heads
        self.eps = spec["norm_eps"]
        par, mup = _variant(spec["parametrization"])
        self.width_mult = self.d / mup["base_width"] if par == "MuP" else 1.0
        self.mup = mup if par == "MuP" else None
        self.names = self._expected_names()
        missing = sorted(set(self.names) - set(params))
        # MTP modules (mtp.*) do not affect the main head: their tensors are not read.
        mtp = spec["mtp"]["depth"] > 0
        extra = sorted(n for n in set(params) - set(self.names) if not (mtp and n.startswith("mtp.")))
        if missing or extra:
            raise ValueError(
                f"checkpoint tensors do not match the {self.scheme} model: missing {missing[:8]}, unexpected {extra[:8]}"
            )
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(torch.tensor(params[n], dtype=dtype)) for n in self.names}
        )

    # -- configuration --

    def _check_supported(self):
        spec = self.spec
        if self.scheme not in ("Residual", "Mhc", "Ghc", "Xhc"):
            raise NotImplementedError(f"residual scheme {self.scheme}: this loader builds Residual, Mhc, Ghc and Xhc")
        if _variant(spec["ffn"])[0] != "SwiGlu":
            raise NotImplementedError("only the SwiGlu FFN is built (not Moe)")
        if spec["precision"] != "F32":
            raise NotImplementedError(f"precision {spec['precision']}: only F32 is built")
        if self.scheme == "Xhc" and self.cfg["flash"] != "None":
            raise NotImplementedError(f"xHC flash {self.cfg['flash']}: only full xHC (flash: None) is built")

    def _p(self, name):
        return self.params[name.replace(".", "__")]

    def _name(self, group, role, **kw):
        return TENSOR_NAMES[group][role].format(**kw)

    def _expected_names(self):
        """Every tensor this model reads, by the TENSOR_NAMES templates."""
        names = []
        tied = self.spec["tie_embeddings"]
        for role, tmpl in TENSOR_NAMES["backbone"].items():
            if role == "unembed" and tied:
                continue
            if role == "embed" and self.scheme == "Ghc":
                continue
            names += self._expand(tmpl)
        if self.scheme == "Mhc":
            for tmpl in TENSOR_NAMES["mhc"].values():
                names += self._expand(tmpl)
        elif self.scheme == "Ghc":
            g = self.cfg
            generator = {"norm", "w_alpha", "w_beta", "s_pre", "s_res", "s_post"}
            for role, tmpl in TENSOR_NAMES["ghc"].items():
                sub, _, kind = role.partition(".")
                if sub in ("attn", "ffn") and kind in generator and not g["dynamic"]:
                    continue  # static GHC: no generator
                if sub == "reduce" and kind != "w" and self._ghc_reduce_norm() != "GroupNorm":
                    continue
                if role == "embed_wide" and g["embed_mode"] != "Full":
                    continue
                names += self._expand(tmpl)
            if g["embed_mode"] == "Expand":
                names += list(GHC_EXPAND_NAMES.values())
        elif self.scheme == "Xhc":
            x = self.cfg
            for role, tmpl in TENSOR_NAMES["xhc"].items():
                kind = role.split(".", 1)[1]
                if kind == "router" and x["fixed"] >= x["k"]:
                    continue
                if kind == "conv" and not self._xhc_augmented(role.split(".")[0]):
                    continue
                names += self._expand(tmpl)
        return names

    def _expand(self, tmpl):
        if "{i}" not in tmpl:
            return [tmpl]
        out = []
        for i in range(self.layers):
            if "{j}" in tmpl:
                out += [tmpl.format(i=i, j=j) for j in range(len(self.cfg["conv_kernels"]))]
            else:
                out.append(tmpl.format(i=i))
        return out

    def _ghc_reduce_norm(self):
        g = self.cfg
        if g["reduce_norm"] is not None:
            return g["reduce_norm"]
        m, n = max(g["m"], 1), g["n"]
        return "GroupNorm" if n % m == 0 and n >= 2 * m else "Off"

    def _xhc_augmented(self, kind):
        x = self.cfg
        return len(x["conv_kernels"]) > 0 and (kind == "ffn" or x["temporal_aug"] == "MlpAndAttention")

    # -- backbone (docs/math.md §1.3) --

    def attention(self, u, i):
        b, t, _ = u.shape
        h, hkv, dh = self.heads, self.kv_heads, self.head_dim
        name = lambda r: self._p(self._name("backbone", "attn." + r, i=i))
        a = rms_norm(u, name("norm"), self.eps)
        q = (a @ name("wq")).reshape(b, t, h, dh)
        k = (a @ name("wk")).reshape(b, t, hkv, dh)
        v = (a @ name("wv")).reshape(b, t, hkv, dh)
        scale = self.mup["attn_mult"] / dh if self.mup else 1.0 / math.sqrt(dh)
        o = causal_attention(q, k, v, scale, self.spec["rope_base"])
        return o.reshape(b, t, h * dh) @ name("wo")

    def ffn(self, u, i):
        name = lambda r: self._p(self._name("backbone", "ffn." + r, i=i))
        x = rms_norm(u, name("norm"), self.eps)
        return (F.silu(x @ name("w1")) * (x @ name("w3"))) @ name("w2")

    def branch(self, kind, u, i):
        return self.attention(u, i) if kind == "attn" else self.ffn(u, i)

    # -- schemes --

    def embed(self, ids):
        if self.scheme == "Ghc":
            g = self.cfg
            b, t = ids.shape
            db = self.d // g["m"]
            if g["embed_mode"] == "Full":
                flat = self._p("embed_wide")[ids]
            else:
                flat = self._p("embed")[ids] @ self._p("embed_expand")
            return flat.reshape(b, t, g["n"], db)
        h = self._p("embed")[ids]  # [B, T, D]
        if self.scheme == "Residual":
            return h[:, :, None, :]
        n = self.cfg["n"]
        return h[:, :, None, :].expand(-1, -1, n, -1)

    def sublayer(self, state, kind, i):
        """Block i's attention (`kind` "attn", sublayer 2i) or FFN ("ffn", sublayer 2i + 1)."""
        if self.scheme == "Residual":
            u = state[:, :, 0, :]
            return state + self.branch(kind, u, i)[:, :, None, :]
        if self.scheme == "Mhc":
            return self._mhc(state, kind, i)
        if self.scheme == "Ghc":
            return self._ghc(state, kind, i)
        return self._xhc(state, kind, i)

    def _mhc(self, X, kind, i):
        """docs/math.md §4.3, as ir/src/lower/schemes/mhc.rs."""
        c = self.cfg
        n = c["n"]
        b, t, _, d = X.shape
        p = lambda r: self._p(self._name("mhc", f"{kind}.{r}", i=i))
        raw = norm_project(X.reshape(b, t, n * d), p("phi"), self.eps, 0)
        alpha = p("alpha")
        scale = torch.cat([alpha[0:1].expand(n), alpha[1:2].expand(n), alpha[2:3].expand(n * n)]) / self.width_mult
        logits = raw * scale + p("bias")
        pre = torch.sigmoid(logits[..., :n]) + c["pre_eps"]  # [B, T, n]
        post = c["post_max"] * torch.sigmoid(logits[..., n : 2 * n])  # [B, T, n]
        res = sinkhorn(logits[..., 2 * n :].reshape(b, t, n, n), c["sinkhorn_iters"], c["sinkhorn_eps"])
        u = torch.einsum("btj,btjc->btc", pre, X)
        y = self.branch(kind, u, i)
        return torch.einsum("btij,btjc->btic", res, X) + post[..., None] * y[:, :, None, :]

    def _ghc(self, H, kind, i):
        """docs/math.md §5.3-5.5, as ir/src/lower/schemes/ghc.rs: output-major Read [m, n],
        Carry [n, n], Write [n, m]."""
        g = self.cfg
        m, n = g["m"], g["n"]
        b, t, _, db = H.shape
        p = lambda r: self._p(self._name("ghc", f"{kind}.{r}", i=i))
        read, carry, write = p("h_pre"), p("h_res"), p("h_post")
        if g["dynamic"]:
            normed = rms_norm(H, p("norm"), self.eps)  # per slot, over d_b
            coef = normed @ torch.cat([p("w_alpha"), p("w_beta")], 1)  # [B, T, n, 2m + n]
            coef = torch.tanh(coef / self._ghc_tau())
            read = coef[..., :m].transpose(-1, -2) * p("s_pre") + read  # [B, T, m, n]
            carry = coef[..., m : m + n].transpose(-1, -2) * p("s_res") + carry  # [B, T, n, n]
            write = coef[..., m + n :] * p("s_post") + write  # [B, T, n, m]
        x = torch.matmul(read, H)  # [B, T, m, d_b]
        z = self.branch(kind, x.reshape(b, t, m * db), i).reshape(b, t, m, db)
        return torch.matmul(carry, H) + torch.matmul(write, z)

    def _ghc_tau(self):
        g = self.cfg
        if self.mup is None:
            return g["tau"] if g["tau"] is not None else math.sqrt(self.d // g["m"])
        base = g["tau"] if g["tau"] is not None else math.sqrt(self.mup["base_width"] // g["m"])
        return base * self.width_mult

    def _xhc(self, X, kind, i):
        """One full-xHC sublayer (docs/math.md §6.2-6.6), as ir/src/lower/schemes/xhc.rs."""
        x = self.cfg
        n, k, fixed = x["n"], x["k"], x["fixed"]
        b, t, _, c = X.shape
        p = lambda r: self._p(self._name("xhc", f"{kind}.{r}", i=i))
        w = self.width_mult
        routed = fixed < k
        # Routing pass: one NormProject over [W^r | W^pre], router columns mean-centred.
        ws = ([p("router")] if routed else []) + [p("pre")]
        proj = norm_project(X.reshape(b, t, n * c), torch.cat(ws, 1), self.eps, n if routed else 0)
        off = n if routed else 0
        pre = torch.sigmoid(proj[..., off : off + n] * (p("alpha_pre") / w) + p("b_pre"))  # [B, T, N]
        if routed:
            r = proj[..., :n] / w
            scores = torch.sigmoid(r) if x["router"] == "Sigmoid" else torch.softmax(r, -1)
            idx = topk_route(scores.detach(), k, fixed)
            gates = torch.gather(scores, 2, idx[..., fixed:])
            pgate = torch.cat([torch.ones(b, t, fixed, dtype=X.dtype, device=X.device), gates], -1)[..., None]
        else:
            idx = torch.arange(k, device=X.device).expand(b, t, k)
            pgate = None
        u = torch.einsum("btj,btjc->btc", pre, X)  # dense read
        x_act = torch.gather(X, 2, idx[..., None].expand(b, t, k, c))  # [B, T, k, C]
        # Active-set maps: one NormProject over [W^res | W^post] (RMS statistics).
        aug = self._xhc_augmented(kind)
        kr = len(x["conv_kernels"]) + 1 if aug else 1
        proj2 = norm_project(x_act.reshape(b, t, k * c), torch.cat([p("res"), p("post")], 1), self.eps, 0)
        h = (proj2[..., : k * k] * (p("alpha_res") / w)).reshape(b, t, k, k) + p("b_res")
        h_res = sinkhorn(h, x["sinkhorn_iters"], 0.0)
        if x["row_clamp"]:
            h_res = h_res / torch.clamp(h_res.sum(-1, keepdim=True), min=1.0)
        hp = (proj2[..., k * k : k * k + k * kr] * (p("alpha_post") / w)).reshape(b, t, k, kr) + p("b_post")
        post = 2.0 * torch.sigmoid(hp)
        if pgate is not None:
            post = post * pgate
        # The branch output and its temporal components Y [B, T, K_r, C].
        out = self.branch(kind, u, i)
        ys = [out]
        if aug:
            convs = [
                causal_depthwise_conv(out, self._p(TENSOR_NAMES["xhc"][f"{kind}.conv"].format(i=i, j=j)))
                for j in range(len(x["conv_kernels"]))
            ]
            gs = x["gram_schmidt"]
            if gs is None:
                gs = _variant(self.spec["train"]["optimizer"])[0] != "Muon"
            ys += gram_schmidt(out, convs, x["gs_eps"]) if gs else convs
        Y = torch.stack(ys, 2)
        x_new = torch.matmul(h_res, x_act) + torch.matmul(post, Y)
        return X.scatter(2, idx[..., None].expand(b, t, k, c), x_new)

    def collapse(self, state):
        if self.scheme == "Residual":
            return state[:, :, 0, :]
        if self.scheme == "Ghc":
            g = self.cfg
            b, t, n, db = state.shape
            flat = state.reshape(b, t, n * db)
            if self._ghc_reduce_norm() == "GroupNorm":
                flat = group_norm(flat, n // g["m"], self._p("reduce.norm"), self._p("reduce.norm_bias"), self.eps)
            return flat @ self._p("reduce.w")
        if self.scheme == "Mhc" and self.cfg["collapse"] == "Mean":
            return state.mean(2)
        return state.sum(2)

    def forward(self, ids):
        """Main-head logits [B, T, V] of token ids [B, T]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        state = self.embed(ids).to(self.dtype)
        for i in range(self.layers):
            state = self.sublayer(state, "attn", i)
            state = self.sublayer(state, "ffn", i)
        h = rms_norm(self.collapse(state), self._p("final_norm"), self.eps)
        if self.spec["tie_embeddings"]:
            table = self._p("embed_wide") if self.scheme == "Ghc" and self.cfg["embed_mode"] == "Full" else self._p("embed")
            logits = h @ table.T
        else:
            logits = h @ self._p("unembed")
        if self.mup is not None:
            logits = logits * (self.mup["output_mult"] / self.width_mult)
        return logits

    def loss(self, tokens):
        """Mean next-token cross-entropy (nats) of windows tokens [B, T + 1]."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        logits = self.forward(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def named_checkpoint_parameters(self):
        """(checkpoint name, parameter) pairs, for comparing gradients by name."""
        return [(n, self._p(n)) for n in self.names]


def load(path, dtype=torch.float64):
    """The WidenModel of a checkpoint file."""
    spec, params, _ = read_checkpoint(path)
    return WidenModel(spec, params, dtype=dtype)
