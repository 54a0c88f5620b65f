//! Builds an `ir::spec::ModelSpec` from parsed `#[widen(...)]` arguments.
//!
//! Every key is the RON field name (docs/architecture.md §3, docs/math.md §10) and every
//! unlisted field keeps the same default the RON path gives it, so a derive and
//! a RON file with the same values produce equal specs. While building, the
//! source range of every key is recorded under its field path (`residual.k`),
//! so a `FieldError` from `ModelSpec::validate` can be reported at the key
//! the user wrote.

use crate::suggest;
use crate::syntax::{Arg, Range, Value};
use ir::spec::*;
use syn::ext::IdentExt;

/// Accumulated errors and the path -> source-range map of one expansion.
#[derive(Default)]
pub struct Cx {
    errors: Vec<syn::Error>,
    spans: Vec<(String, Range)>,
}

impl Cx {
    pub fn error(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    pub fn has_errors(&self) -> bool {
        !self.errors.is_empty()
    }

    fn record(&mut self, path: &str, range: Range) {
        self.spans.push((path.to_string(), range));
    }

    /// The range of the longest recorded prefix of `path`: `residual.k` falls
    /// back to `residual` when `k` was left at its default, and
    /// `residual.conv_kernels[1]` to `residual.conv_kernels`.
    pub fn locate(&self, path: &str) -> Option<Range> {
        let mut path = path;
        loop {
            if let Some((_, range)) = self.spans.iter().find(|(p, _)| p == path) {
                return Some(*range);
            }
            path = &path[..path.rfind(['.', '['])?];
        }
    }

    /// All errors combined into one, so that every one is reported.
    pub fn into_error(self) -> Option<syn::Error> {
        self.errors.into_iter().reduce(|mut all, e| {
            all.combine(e);
            all
        })
    }
}

/// Conversion of one attribute value into a spec field of type `Self`.
///
/// Struct-valued conversions report bad members to `cx` and still return the
/// struct, so that one expansion reports every mistake; `Err` means the value
/// has the wrong shape altogether.
pub trait FromValue: Sized {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self>;
}

/// A spec struct whose fields can be set by key.
pub trait Fields: Default {
    /// The RON field names, i.e. the accepted keys.
    const KEYS: &'static [&'static str];
    fn set(&mut self, key: &str, value: &Value, path: &str, cx: &mut Cx) -> syn::Result<()>;
}

fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Applies `key = value` arguments to `target`. Arguments whose key is in
/// `extra` are returned to the caller (derived conveniences such as GHC's `r`).
pub fn apply<'a, T: Fields>(
    target: &mut T,
    args: &'a [Arg],
    path: &str,
    cx: &mut Cx,
    extra: &[&str],
) -> Vec<&'a Arg> {
    let mut seen: Vec<String> = Vec::new();
    let mut returned = Vec::new();
    for arg in args {
        let Some(key) = &arg.key else {
            cx.error(arg.range().error("expected `key = value`"));
            continue;
        };
        let name = key.unraw().to_string();
        let known = T::KEYS.contains(&name.as_str());
        if !known && !extra.contains(&name.as_str()) {
            let mut candidates = T::KEYS.to_vec();
            candidates.extend_from_slice(extra);
            cx.error(syn::Error::new(key.span(), suggest::unknown("key", &name, &candidates)));
            continue;
        }
        if seen.contains(&name) {
            cx.error(arg.range().error(format!("`{name}` is set more than once")));
            continue;
        }
        seen.push(name.clone());
        let path = child(path, &name);
        cx.record(&path, arg.range());
        if !known {
            returned.push(arg);
        } else if let Err(e) = target.set(&name, &arg.value, &path, cx) {
            cx.error(e);
        }
    }
    returned
}

/// Implements [`Fields`] (and struct-valued [`FromValue`], written `key(a = 1)`
/// or `key = (a = 1)`) for a spec struct from its list of field names.
macro_rules! fields {
    ($ty:ty { $($field:ident),* $(,)? }) => {
        impl Fields for $ty {
            const KEYS: &'static [&'static str] = &[$(stringify!($field)),*];
            fn set(&mut self, key: &str, value: &Value, path: &str, cx: &mut Cx) -> syn::Result<()> {
                match key {
                    $(stringify!($field) => self.$field = FromValue::from_value(value, path, cx)?,)*
                    _ => return Err(value.range().error(format!("unknown key `{key}`"))),
                }
                Ok(())
            }
        }

        impl FromValue for $ty {
            fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
                match value {
                    Value::Group { args, .. } => {
                        let mut s = <$ty>::default();
                        apply(&mut s, args, path, cx, &[]);
                        Ok(s)
                    }
                    other => Err(other.range().error(format!(
                        "expected `({} = ..., ...)`, found {}",
                        <$ty as Fields>::KEYS.first().copied().unwrap_or("key"),
                        other.describe()
                    ))),
                }
            }
        }
    };
}

fields!(ModelSpec {
    name,
    vocab,
    vocab_pad_to,
    d_model,
    layers,
    heads,
    kv_heads,
    head_dim,
    ffn,
    norm_eps,
    rope_base,
    tie_embeddings,
    init_std,
    out_proj_depth_scaled,
    residual,
    mtp,
    parametrization,
    precision,
    train,
});
fields!(SwiGluSpec { hidden });
fields!(MoeSpec { experts, top_k, shared, hidden, gate, dispatch, capacity_factor, balance, renormalize });
fields!(AuxLossSpec { coef, per });
fields!(BiasUpdateSpec { rate, seq_aux_coef });
fields!(HcSpec { n, dynamic, act, gen_norm, scale_init, out_proj_std_mult });
fields!(FcSpec { m, dynamic, act, scale_init });
fields!(MhcSpec {
    n,
    sinkhorn_iters,
    sinkhorn_eps,
    pre_eps,
    post_max,
    alpha_init,
    bias_init,
    proj_init,
    collapse,
});
fields!(GhcSpec { m, n, dynamic, tau, s_init, embed_mode, reduce_norm, reduce_init });
fields!(XhcSpec {
    n,
    k,
    fixed,
    conv_kernels,
    temporal_aug,
    gram_schmidt,
    gs_eps,
    router,
    sinkhorn_iters,
    row_clamp,
    alpha_init,
    flash,
});
fields!(MtpSpec { depth, lambda, concat_order });
fields!(MupSpec { base_width, output_mult, attn_mult, readout_zero_init });
fields!(TrainSpec {
    data,
    seq_len,
    batch,
    steps,
    optimizer,
    schedule,
    clip,
    seed,
    eval_every,
    eval_batches,
    val_fraction,
    order,
    val_tokens,
    checkpoint_every,
    keep_last,
    recompute,
});
fields!(AdamWSpec { lr, betas, eps, weight_decay });
fields!(MuonSpec { lr, momentum, nesterov, ns_steps, scale, weight_decay, adamw });
fields!(ConstantSpec { warmup });
fields!(CosineSpec { warmup, min_ratio });
fields!(WsdSpec { warmup, decay_fraction, final_ratio });
fields!(ConnectionSpec {
    streams,
    segments,
    create,
    collapse,
    generator,
    read,
    carry,
    write,
    out_proj_std_mult,
    history,
});
fields!(History { entries, block, weights, dilation, period });
fields!(PerSlotGenerator { norm, temperature, act, gate, gate_init });
fields!(FlatGenerator { gain, proj_init, gate_init });
fields!(Coefficient { init, constraint, form, learned });

/// Declares the members of a struct variant (`sigmoid(scale = 2.0, offset = 0.0)`) as a
/// keyed struct of [`Member`]s, so that [`apply`] gives them the usual unknown-key, duplicate
/// and path handling; [`Variant::require`] then asks for every one, since RON has no
/// defaults for a struct variant's fields either. A missing member is reported and a
/// placeholder stands in, which is never seen: errors stop the expansion before validation.
macro_rules! members {
    ($ty:ident { $($field:ident: $inner:ty),* $(,)? }) => {
        #[derive(Default)]
        struct $ty {
            $($field: Member<$inner>),*
        }
        fields!($ty { $($field),* });
    };
}

/// A struct variant's member: unset until written. Unlike `Option`, it takes no `none`.
struct Member<T>(Option<T>);

impl<T> Default for Member<T> {
    fn default() -> Self {
        Member(None)
    }
}

impl<T: FromValue> FromValue for Member<T> {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        T::from_value(value, path, cx).map(|v| Member(Some(v)))
    }
}

members!(OnOff { on: f64, off: f64 });
members!(SigmoidMembers { scale: f64, offset: f64 });
members!(SinkhornMembers { iters: usize, eps: f64 });
members!(ReduceMembers { norm: ReduceNorm, init: ReduceInit });

/// Variant names compare case-insensitively and ignoring underscores, so the
/// documented snake_case (`two_block`) and the RON spelling (`TwoBlock`) both work.
fn normalize(name: &str) -> String {
    name.chars().filter(|c| *c != '_').map(|c| c.to_ascii_lowercase()).collect()
}

/// Index of `ident` in `names`, or an error suggesting the closest name.
fn find_variant(ident: &syn::Ident, what: &str, names: &[&str]) -> syn::Result<usize> {
    let written = ident.unraw().to_string();
    let wanted = normalize(&written);
    names
        .iter()
        .position(|n| normalize(n) == wanted)
        .ok_or_else(|| syn::Error::new(ident.span(), suggest::unknown(what, &written, names)))
}

/// Implements [`FromValue`] for a unit-only spec enum, written as a snake_case identifier.
macro_rules! unit_enum {
    ($ty:ident, $what:literal { $($variant:ident => $name:literal),* $(,)? }) => {
        impl FromValue for $ty {
            fn from_value(value: &Value, _: &str, _: &mut Cx) -> syn::Result<Self> {
                const NAMES: &[&str] = &[$($name),*];
                const VARIANTS: &[$ty] = &[$($ty::$variant),*];
                match value {
                    Value::Ident(ident) => Ok(VARIANTS[find_variant(ident, $what, NAMES)?]),
                    other => Err(other.range().error(format!(
                        "expected {} ({}), found {}",
                        $what,
                        suggest::list(NAMES),
                        other.describe()
                    ))),
                }
            }
        }
    };
}

unit_enum!(MoeGate, "MoE gate" { Softmax => "softmax", Sigmoid => "sigmoid" });
unit_enum!(AuxLossScope, "aux loss scope" { Batch => "batch", Sequence => "sequence" });
unit_enum!(MoeDispatch, "MoE dispatch" { Dense => "dense", Sparse => "sparse" });
unit_enum!(GateAct, "activation" { Tanh => "tanh", Identity => "identity" });
unit_enum!(GenNorm, "norm" { LayerNorm => "layer_norm", RmsNorm => "rms_norm" });
unit_enum!(OutProjStdMult, "init multiplier" {
    One => "one", InvSqrtN => "inv_sqrt_n", SqrtN => "sqrt_n",
});
unit_enum!(MhcBiasInit, "bias init" { SingleStream => "single_stream", Zero => "zero" });
unit_enum!(ProjInit, "projection init" { Zero => "zero", Xavier => "xavier" });
unit_enum!(Collapse, "collapse" { Sum => "sum", Mean => "mean" });
unit_enum!(DataOrder, "data order" { Random => "random", Sequential => "sequential" });
unit_enum!(EmbedMode, "embedding mode" { Full => "full", Expand => "expand" });
unit_enum!(ReduceNorm, "reduce norm" { GroupNorm => "group_norm", Off => "off" });
unit_enum!(ReduceInit, "reduce init" { BlockIdentity => "block_identity", Normal => "normal" });
unit_enum!(Router, "router" { Sigmoid => "sigmoid", Softmax => "softmax" });
unit_enum!(Flash, "flash variant" { None => "none", Block => "block", TwoBlock => "two_block" });
unit_enum!(AugSublayers, "sublayer set" {
    Mlp => "mlp", MlpAndAttention => "mlp_and_attention",
});
unit_enum!(ConcatOrder, "concat order" { HiddenFirst => "hidden_first", EmbFirst => "emb_first" });
unit_enum!(Precision, "precision" { F32 => "f32", Bf16 => "bf16" });
unit_enum!(SyntheticCorpus, "corpus" { Default => "default" });
unit_enum!(MuonScale, "Muon scaling" { Original => "original", MatchRmsAdamW => "match_rms_adamw" });
unit_enum!(Gate, "gate" { Paired => "paired", Entrywise => "entrywise" });
unit_enum!(Form, "coefficient form" { Matrix => "matrix", PerSlot => "per_slot" });
unit_enum!(Entries, "history entries" { Outputs => "outputs", States => "states" });
unit_enum!(DepthInit, "depth init" { Newest => "newest", Ones => "ones", Mean => "mean" });

/// A data-carrying enum value: `ghc(m = 4)`, or a bare `ghc` for all defaults.
struct Variant<'a> {
    index: usize,
    name: &'a syn::Ident,
    args: &'a [Arg],
    range: Range,
}

impl<'a> Variant<'a> {
    fn parse(value: &'a Value, what: &str, names: &[&str]) -> syn::Result<Self> {
        let (name, args): (&syn::Ident, &[Arg]) = match value {
            Value::Ident(name) => (name, &[]),
            Value::Call { name, args, .. } => (name, args),
            other => {
                return Err(other.range().error(format!(
                    "expected a {what} ({}), found {}",
                    suggest::list(names),
                    other.describe()
                )))
            }
        };
        let index = find_variant(name, what, names)?;
        Ok(Variant { index, name, args, range: value.range() })
    }

    /// A variant without data must not be given arguments.
    fn unit(&self) -> syn::Result<()> {
        if self.args.is_empty() {
            Ok(())
        } else {
            Err(self.range.error(format!("`{}` takes no arguments", self.name)))
        }
    }

    /// The struct payload, defaults overridden by the arguments.
    fn payload<S: Fields>(&self, path: &str, cx: &mut Cx) -> S {
        let mut s = S::default();
        apply(&mut s, self.args, path, cx, &[]);
        s
    }

    /// The single positional argument of a newtype variant such as `text("corpus.txt")`.
    fn positional(&self) -> syn::Result<Option<&'a Value>> {
        match self.args {
            [] => Ok(None),
            [arg] => Ok(Some(match (&arg.key, &arg.value) {
                (Some(_), Value::Flag(_)) | (None, _) => &arg.value,
                _ => return Err(arg.range().error("expected a value, not `key = value`")),
            })),
            [_, second, ..] => Err(second.range().error(format!("`{}` takes one argument", self.name))),
        }
    }

    /// The positional arguments of a tuple variant such as `linspace(-0.01, 0.01)`, exactly `N`.
    fn tuple<const N: usize>(&self, usage: &str) -> syn::Result<[&'a Value; N]> {
        let mut values = Vec::with_capacity(N);
        for arg in self.args {
            match (&arg.key, &arg.value) {
                (None, value) => values.push(value),
                _ => {
                    return Err(arg.range().error(format!("expected a value, not `key = value`: `{usage}`")))
                }
            }
        }
        let found = values.len();
        values.try_into().map_err(|_| {
            let takes = if N == 1 { "one value".to_string() } else { format!("{N} values") };
            self.range.error(format!("`{}` takes {takes}, found {found}: `{usage}`", self.name))
        })
    }

    /// One member of a struct variant (see [`members!`]): a missing one is reported at the
    /// variant, `sigmoid(scale = 2.0)` needs `offset`; one written with a bad value has been
    /// reported already.
    fn require<T>(&self, Member(member): Member<T>, key: &str, cx: &mut Cx) -> Option<T> {
        let written = self.args.iter().any(|a| a.key.as_ref().is_some_and(|k| k.unraw() == key));
        if member.is_none() && !written {
            cx.error(self.range.error(format!("`{}` needs `{key} = ..`", self.name)));
        }
        member
    }

    /// Both members of an `on`/`off` init; zeros stand in for missing ones, which are
    /// already reported.
    fn on_off(&self, path: &str, cx: &mut Cx) -> (f64, f64) {
        let m: OnOff = self.payload(path, cx);
        let on = self.require(m.on, "on", cx).unwrap_or_default();
        (on, self.require(m.off, "off", cx).unwrap_or_default())
    }
}

impl FromValue for ResidualSpec {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        const NAMES: &[&str] = &["residual", "hc", "fc", "mhc", "ghc", "xhc", "connection"];
        let v = Variant::parse(value, "residual scheme", NAMES)?;
        Ok(match NAMES[v.index] {
            "residual" => {
                v.unit()?;
                ResidualSpec::Residual
            }
            "hc" => ResidualSpec::Hc(v.payload(path, cx)),
            "fc" => ResidualSpec::Fc(v.payload(path, cx)),
            "mhc" => ResidualSpec::Mhc(v.payload(path, cx)),
            "ghc" => ResidualSpec::Ghc(ghc(&v, path, cx)),
            "xhc" => ResidualSpec::Xhc(v.payload(path, cx)),
            _ => ResidualSpec::Connection(v.payload(path, cx)),
        })
    }
}

impl FromValue for Create {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "stream creation", &["replicate", "split", "wide"])?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                Create::Replicate
            }
            1 => {
                v.unit()?;
                Create::Split
            }
            _ => match v.positional()? {
                Some(mode) => Create::Wide(named(mode, path, cx)?),
                None => {
                    return Err(v.range.error("expected the embedding mode: `wide(full)` or `wide(expand)`"))
                }
            },
        })
    }
}

impl FromValue for CollapseRule {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        const NAMES: &[&str] = &["sum", "mean", "concat", "reduce", "readout"];
        let v = Variant::parse(value, "collapse rule", NAMES)?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                CollapseRule::Sum
            }
            1 => {
                v.unit()?;
                CollapseRule::Mean
            }
            2 => {
                v.unit()?;
                CollapseRule::Concat
            }
            3 => {
                let m: ReduceMembers = v.payload(path, cx);
                let norm = v.require(m.norm, "norm", cx);
                match (norm, v.require(m.init, "init", cx)) {
                    (Some(norm), Some(init)) => CollapseRule::Reduce { norm, init },
                    _ => CollapseRule::Sum,
                }
            }
            _ => CollapseRule::Readout(v.payload(path, cx)),
        })
    }
}

impl FromValue for Generator {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "generator", &["none", "per_slot", "flat"])?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                Generator::None
            }
            1 => Generator::PerSlot(v.payload(path, cx)),
            _ => Generator::Flat(v.payload(path, cx)),
        })
    }
}

impl FromValue for CoefInit {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        const NAMES: &[&str] =
            &["identity", "constant", "logit", "home", "eye", "first", "cyclic", "linspace", "values"];
        let v = Variant::parse(value, "coefficient init", NAMES)?;
        let number = |usage: &str, cx: &mut Cx| -> syn::Result<f64> {
            let [x] = v.tuple::<1>(usage)?;
            f64::from_value(x, path, cx)
        };
        Ok(match NAMES[v.index] {
            "identity" => {
                v.unit()?;
                CoefInit::Identity
            }
            "cyclic" => {
                v.unit()?;
                CoefInit::Cyclic
            }
            "constant" => CoefInit::Constant(number("constant(1.0)", cx)?),
            "logit" => CoefInit::Logit(number("logit(0.25)", cx)?),
            "home" => {
                let (on, off) = v.on_off(path, cx);
                CoefInit::Home { on, off }
            }
            "eye" => {
                let (on, off) = v.on_off(path, cx);
                CoefInit::Eye { on, off }
            }
            "first" => {
                let (on, off) = v.on_off(path, cx);
                CoefInit::First { on, off }
            }
            "linspace" => {
                let [lo, hi] = v.tuple::<2>("linspace(-0.01, 0.01)")?;
                cx.record(&child(path, "lo"), lo.range());
                cx.record(&child(path, "hi"), hi.range());
                CoefInit::Linspace(f64::from_value(lo, path, cx)?, f64::from_value(hi, path, cx)?)
            }
            _ => {
                let [list] = v.tuple::<1>("values([1.0, 0.0, ...])")?;
                CoefInit::Values(Vec::from_value(list, path, cx)?)
            }
        })
    }
}

impl FromValue for Constraint {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        const NAMES: &[&str] =
            &["none", "sigmoid", "tanh", "softmax", "sinkhorn", "permutations", "kronecker"];
        let v = Variant::parse(value, "constraint", NAMES)?;
        Ok(match NAMES[v.index] {
            "sigmoid" => {
                let m: SigmoidMembers = v.payload(path, cx);
                let scale = v.require(m.scale, "scale", cx).unwrap_or_default();
                Constraint::Sigmoid { scale, offset: v.require(m.offset, "offset", cx).unwrap_or_default() }
            }
            "sinkhorn" => {
                let m: SinkhornMembers = v.payload(path, cx);
                let iters = v.require(m.iters, "iters", cx).unwrap_or_default();
                Constraint::Sinkhorn { iters, eps: v.require(m.eps, "eps", cx).unwrap_or_default() }
            }
            unit => {
                v.unit()?;
                match unit {
                    "none" => Constraint::None,
                    "tanh" => Constraint::Tanh,
                    "softmax" => Constraint::Softmax,
                    "permutations" => Constraint::Permutations,
                    _ => Constraint::Kronecker,
                }
            }
        })
    }
}

impl FromValue for DepthWeights {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "depth weights", &["attention", "static"])?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                DepthWeights::Attention
            }
            _ => match v.positional()? {
                Some(init) => DepthWeights::Static(named(init, path, cx)?),
                None => {
                    return Err(v
                        .range
                        .error("expected the init: `static(newest)`, `static(ones)` or `static(mean)`"))
                }
            },
        })
    }
}

/// GHC with the convenience key `r` (docs/math.md §5.1: r = n/m), so `ghc(m = 4, r = 4)`
/// means n = 16. Giving both `n` and `r` is an error rather than a silent override.
fn ghc(v: &Variant, path: &str, cx: &mut Cx) -> GhcSpec {
    let mut spec = GhcSpec::default();
    let extra = apply(&mut spec, v.args, path, cx, &["r"]);
    if let Some(r_arg) = extra.first() {
        if v.args.iter().any(|a| a.key.as_ref().is_some_and(|k| k == "n")) {
            cx.error(r_arg.range().error("give either `n` or `r` (n = r * m), not both"));
            return spec;
        }
        let r_path = child(path, "r");
        match usize::from_value(&r_arg.value, &r_path, cx) {
            Ok(r) => match r.checked_mul(spec.m) {
                Some(n) => {
                    spec.n = n;
                    cx.record(&child(path, "n"), r_arg.range());
                }
                None => cx.error(r_arg.range().error(format!("r * m overflows ({r} * {})", spec.m))),
            },
            Err(e) => cx.error(e),
        }
    }
    spec
}

impl FromValue for FfnSpec {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "feed-forward kind", &["swiglu", "moe"])?;
        Ok(match v.index {
            0 => FfnSpec::SwiGlu(v.payload(path, cx)),
            _ => FfnSpec::Moe(v.payload(path, cx)),
        })
    }
}

impl FromValue for MoeBalance {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "MoE balancing", &["none", "aux_loss", "bias_update"])?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                MoeBalance::None
            }
            1 => MoeBalance::AuxLoss(v.payload(path, cx)),
            _ => MoeBalance::BiasUpdate(v.payload(path, cx)),
        })
    }
}

impl FromValue for Parametrization {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "parametrization", &["standard", "mup"])?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                Parametrization::Standard
            }
            _ => Parametrization::MuP(v.payload(path, cx)),
        })
    }
}

impl FromValue for OptimizerSpec {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "optimizer", &["adamw", "muon"])?;
        Ok(match v.index {
            0 => OptimizerSpec::AdamW(v.payload(path, cx)),
            _ => OptimizerSpec::Muon(v.payload(path, cx)),
        })
    }
}

impl FromValue for ScheduleSpec {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "schedule", &["constant", "cosine", "wsd"])?;
        Ok(match v.index {
            0 => ScheduleSpec::Constant(v.payload(path, cx)),
            1 => ScheduleSpec::Cosine(v.payload(path, cx)),
            _ => ScheduleSpec::Wsd(v.payload(path, cx)),
        })
    }
}

impl FromValue for DataSpec {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "data source", &["synthetic", "text"])?;
        let arg = v.positional()?;
        Ok(match (v.index, arg) {
            (0, None) => DataSpec::Synthetic(SyntheticCorpus::Default),
            (0, Some(corpus)) => DataSpec::Synthetic(named(corpus, path, cx)?),
            (_, Some(file)) => DataSpec::Text(String::from_value(file, path, cx)?),
            (_, None) => return Err(v.range.error("expected a file: `text(\"corpus.txt\")`")),
        })
    }
}

impl FromValue for Recompute {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let v = Variant::parse(value, "recompute schedule", &["none", "stream", "block"])?;
        Ok(match v.index {
            0 => {
                v.unit()?;
                Recompute::None
            }
            1 => {
                v.unit()?;
                Recompute::Stream
            }
            _ => match v.positional()? {
                Some(l) => Recompute::Block(usize::from_value(l, path, cx)?),
                None => return Err(v.range.error("expected the sublayers per block: `block(4)`")),
            },
        })
    }
}

/// A variant name given as a variant's only argument arrives as a bare flag
/// (`synthetic(default)` and `wide(full)` parse `default` and `full` as keys).
fn named<T: FromValue>(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<T> {
    match value {
        Value::Flag(ident) => T::from_value(&Value::Ident(ident.clone()), path, cx),
        other => T::from_value(other, path, cx),
    }
}

fn expected(what: &str, value: &Value) -> syn::Error {
    match value {
        Value::Flag(key) => value.range().error(format!("`{key}` needs a value: `{key} = {what}`")),
        other => other.range().error(format!("expected {what}, found {}", other.describe())),
    }
}

impl FromValue for usize {
    fn from_value(value: &Value, _: &str, _: &mut Cx) -> syn::Result<Self> {
        match value {
            Value::Number(n) if !n.negative => match &n.lit {
                syn::Lit::Int(i) => i.base10_parse(),
                _ => Err(expected("a non-negative integer", value)),
            },
            _ => Err(expected("a non-negative integer", value)),
        }
    }
}

impl FromValue for u64 {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let n = usize::from_value(value, path, cx)?;
        u64::try_from(n).map_err(|_| expected("a 64-bit integer", value))
    }
}

impl FromValue for f64 {
    fn from_value(value: &Value, _: &str, _: &mut Cx) -> syn::Result<Self> {
        let Value::Number(n) = value else {
            return Err(expected("a number", value));
        };
        let magnitude: f64 = match &n.lit {
            syn::Lit::Int(i) => i.base10_parse()?,
            syn::Lit::Float(f) => f.base10_parse()?,
            _ => return Err(expected("a number", value)),
        };
        Ok(if n.negative { -magnitude } else { magnitude })
    }
}

impl FromValue for bool {
    fn from_value(value: &Value, _: &str, _: &mut Cx) -> syn::Result<Self> {
        match value {
            Value::Bool(b) => Ok(b.value),
            Value::Flag(_) => Ok(true),
            other => Err(expected("`true` or `false`", other)),
        }
    }
}

impl FromValue for String {
    fn from_value(value: &Value, _: &str, _: &mut Cx) -> syn::Result<Self> {
        match value {
            Value::Str(s) => Ok(s.value()),
            other => Err(expected("a string", other)),
        }
    }
}

/// `Option` fields take the inner value, or `none` for `None` (as in RON, "use the
/// default"; for `clip` it means no clipping).
impl<T: FromValue> FromValue for Option<T> {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        match T::from_value(value, path, cx) {
            Ok(v) => Ok(Some(v)),
            Err(_) if matches!(value, Value::Ident(i) if i == "none") => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl<T: FromValue> FromValue for Vec<T> {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        let Value::List { items, .. } = value else {
            return Err(expected("a list `[a, b, ...]`", value));
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let path = format!("{path}[{i}]");
            cx.record(&path, item.range());
            match T::from_value(item, &path, cx) {
                Ok(v) => out.push(v),
                Err(e) => cx.error(e),
            }
        }
        Ok(out)
    }
}

impl FromValue for (f64, f64) {
    fn from_value(value: &Value, path: &str, cx: &mut Cx) -> syn::Result<Self> {
        match value {
            Value::Group { args, .. } if args.len() == 2 && args.iter().all(|a| a.key.is_none()) => {
                Ok((f64::from_value(&args[0].value, path, cx)?, f64::from_value(&args[1].value, path, cx)?))
            }
            other => Err(expected("a pair `(a, b)`", other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::syntax::Args;
    use std::collections::BTreeSet;

    fn build(tokens: proc_macro2::TokenStream) -> (ModelSpec, Cx) {
        let Args(args) = syn::parse2(tokens).expect("test input parses");
        let mut cx = Cx::default();
        let mut spec = ModelSpec::default();
        apply(&mut spec, &args, "", &mut cx, &[]);
        (spec, cx)
    }

    fn messages(cx: Cx) -> Vec<String> {
        cx.into_error().map(|e| e.into_iter().map(|e| e.to_string()).collect()).unwrap_or_default()
    }

    /// The accepted keys are exactly the serialized field names, so no spec field
    /// is unreachable from the derive and no key names a missing field.
    #[test]
    fn keys_cover_every_serialized_field() {
        fn check<T: Fields + serde::Serialize>() {
            let json = serde_json::to_value(T::default()).expect("spec types serialize");
            let fields: BTreeSet<&str> =
                json.as_object().expect("a struct").keys().map(String::as_str).collect();
            let keys: BTreeSet<&str> = T::KEYS.iter().copied().collect();
            assert_eq!(keys, fields, "{}", std::any::type_name::<T>());
        }
        check::<ModelSpec>();
        check::<SwiGluSpec>();
        check::<MoeSpec>();
        check::<AuxLossSpec>();
        check::<BiasUpdateSpec>();
        check::<HcSpec>();
        check::<FcSpec>();
        check::<MhcSpec>();
        check::<GhcSpec>();
        check::<XhcSpec>();
        check::<MtpSpec>();
        check::<MupSpec>();
        check::<TrainSpec>();
        check::<AdamWSpec>();
        check::<MuonSpec>();
        check::<ConstantSpec>();
        check::<CosineSpec>();
        check::<WsdSpec>();
        check::<ConnectionSpec>();
        check::<History>();
        check::<PerSlotGenerator>();
        check::<FlatGenerator>();
        check::<Coefficient>();
    }

    fn connection(tokens: proc_macro2::TokenStream) -> ConnectionSpec {
        let (spec, cx) = build(tokens);
        assert!(!cx.has_errors(), "{:?}", messages(cx));
        match spec.residual {
            ResidualSpec::Connection(c) => c,
            other => panic!("a connection expected, got {other:?}"),
        }
    }

    #[test]
    fn builds_every_kind_of_connection_value() {
        let c = connection(quote::quote!(residual = connection(
            streams = 6,
            segments = 2,
            create = wide(expand),
            collapse = reduce(init = normal, norm = off),
            generator = per_slot(norm = layer_norm, temperature = 2.0, act = identity, gate = paired, gate_init = 0.5),
            read(init = values([1.0, -2.0, 0.0, 0.0, 0.0, 3.5]), constraint = softmax),
            carry = (init = first(on = 0.0, off = -8.0), constraint = sinkhorn(iters = 5, eps = 1e-6), form = matrix),
            write(init = linspace(-0.01, 0.01), constraint = sigmoid(offset = 0.5, scale = 2.0)),
            out_proj_std_mult = inv_sqrt_n,
            history(entries = states, block = 1, weights = static(mean), dilation = 2, period = 3),
        )));
        assert_eq!((c.streams, c.segments, c.create), (6, 2, Create::Wide(EmbedMode::Expand)));
        assert_eq!(c.collapse, CollapseRule::Reduce { norm: ReduceNorm::Off, init: ReduceInit::Normal });
        let gen = PerSlotGenerator {
            norm: GenNorm::LayerNorm,
            temperature: Some(2.0),
            act: GateAct::Identity,
            gate: Gate::Paired,
            gate_init: 0.5,
        };
        assert_eq!(c.generator, Generator::PerSlot(gen));
        assert_eq!(c.read.init, CoefInit::Values(vec![1.0, -2.0, 0.0, 0.0, 0.0, 3.5]));
        assert_eq!((c.read.constraint, c.read.form), (Constraint::Softmax, Form::Matrix));
        assert_eq!(c.carry.init, CoefInit::First { on: 0.0, off: -8.0 });
        assert_eq!(c.carry.constraint, Constraint::Sinkhorn { iters: 5, eps: 1e-6 });
        assert_eq!(c.write.init, CoefInit::Linspace(-0.01, 0.01));
        assert_eq!(c.write.constraint, Constraint::Sigmoid { scale: 2.0, offset: 0.5 });
        assert_eq!(c.out_proj_std_mult, OutProjStdMult::InvSqrtN);
        let history = History {
            entries: Entries::States,
            block: 1,
            weights: DepthWeights::Static(DepthInit::Mean),
            dilation: 2,
            period: 3,
        };
        assert_eq!(c.history, Some(history));
    }

    #[test]
    fn connection_unit_variants_and_defaults() {
        assert_eq!(connection(quote::quote!(residual = connection)), ConnectionSpec::default());
        let c = connection(quote::quote!(
            residual = connection(
                create = split,
                collapse = readout(init = logit(0.25), constraint = tanh),
                generator = flat(gain, proj_init = xavier),
                read(init = home(on = 1.0, off = -1.0), constraint = none),
                carry(init = eye(on = 2.0, off = 0.5), constraint = permutations, form = per_slot),
                write(init = constant(-1), constraint = sigmoid(scale = 1, offset = 0)),
                history = none,
            )
        ));
        assert_eq!(c.create, Create::Split);
        let readout = Coefficient { constraint: Constraint::Tanh, ..Coefficient::new(CoefInit::Logit(0.25)) };
        assert_eq!(c.collapse, CollapseRule::Readout(readout));
        assert_eq!(
            c.generator,
            Generator::Flat(FlatGenerator { gain: true, proj_init: ProjInit::Xavier, gate_init: 0.01 })
        );
        assert_eq!(c.read, Coefficient::new(CoefInit::Home { on: 1.0, off: -1.0 }));
        assert_eq!(c.carry.init, CoefInit::Eye { on: 2.0, off: 0.5 });
        assert_eq!((c.carry.constraint, c.carry.form), (Constraint::Permutations, Form::PerSlot));
        assert_eq!(c.write.init, CoefInit::Constant(-1.0));
        assert_eq!(c.write.constraint, Constraint::Sigmoid { scale: 1.0, offset: 0.0 });
        assert_eq!(c.history, None);

        for (written, collapse) in [
            (quote::quote!(sum), CollapseRule::Sum),
            (quote::quote!(mean), CollapseRule::Mean),
            (quote::quote!(concat), CollapseRule::Concat),
        ] {
            assert_eq!(
                connection(quote::quote!(residual = connection(collapse = #written))).collapse,
                collapse
            );
        }
        let c = connection(quote::quote!(
            residual = connection(write(init = cyclic), carry(init = identity), history(weights = attention))
        ));
        assert_eq!((c.write.init, c.carry.init), (CoefInit::Cyclic, CoefInit::Identity));
        assert_eq!(c.history, Some(History::default()));
        let c = connection(quote::quote!(residual = connection(history(weights = r#static(newest)))));
        assert_eq!(c.history.map(|h| h.weights), Some(DepthWeights::Static(DepthInit::Newest)));
    }

    #[test]
    fn connection_mistakes_are_reported_with_suggestions() {
        let (_, cx) = build(quote::quote!(residual = connection(
            stream = 4,
            create = wide,
            collapse = reduce(norm = off),
            generator = per_slot(temprature = 1.0),
            read(init = linspace(0.0), constraint = sigmod(scale = 1.0, offset = 0.0)),
            carry(init = home(on = 1.0), constraint = sigmoid(scale = 1.0, ofset = 0.0), form = slot),
            write(init = values(1.0, 2.0), constraint = sinkhorn(iters = 2.5, eps = 0.0)),
            history(weights = static, entries = output),
        )));
        assert_eq!(
            messages(cx),
            vec![
                "unknown key `stream`; did you mean `streams`?",
                "expected the embedding mode: `wide(full)` or `wide(expand)`",
                "`reduce` needs `init = ..`",
                "unknown key `temprature`; did you mean `temperature`?",
                "`linspace` takes 2 values, found 1: `linspace(-0.01, 0.01)`",
                "unknown constraint `sigmod`; did you mean `sigmoid`?",
                "`home` needs `off = ..`",
                "unknown key `ofset`; did you mean `offset`?",
                "`sigmoid` needs `offset = ..`",
                "unknown coefficient form `slot`; expected one of `matrix`, `per_slot`",
                "`values` takes one value, found 2: `values([1.0, 0.0, ...])`",
                "expected a non-negative integer, found `2.5`",
                "expected the init: `static(newest)`, `static(ones)` or `static(mean)`",
                "unknown history entries `output`; did you mean `outputs`?",
            ]
        );
        let (_, cx) =
            build(quote::quote!(residual = connection(read(constraint = sigmoid(scale = none, offset = 0)))));
        assert_eq!(messages(cx), vec!["expected a number, found `none`"]);
    }

    #[test]
    fn connection_validation_paths_are_recorded() {
        let (_, cx) = build(quote::quote!(
            residual = connection(
                collapse = readout(init = logit(0.5)),
                carry(constraint = sinkhorn(iters = 0, eps = 0.0)),
                write(init = linspace(-1.0, 1.0)),
            )
        ));
        assert!(!cx.has_errors());
        for path in ["residual.collapse.init", "residual.carry.constraint.iters", "residual.write.init.hi"] {
            assert!(cx.locate(path).is_some(), "{path}");
        }
        assert!(cx.locate("residual.read.init").is_some(), "falls back to `residual`");
    }

    #[test]
    fn builds_every_kind_of_value() {
        let (spec, cx) = build(quote::quote!(
            name = "t",
            vocab = 300,
            d_model = 128,
            layers = 3,
            heads = 8,
            kv_heads = 2,
            tie_embeddings,
            norm_eps = 1e-6,
            precision = bf16,
            residual =
                xhc(n = 8, k = 3, fixed = 1, conv_kernels = [2, 3], flash = two_block, gram_schmidt = false),
            ffn = moe(experts = 4, top_k = 1, gate = sigmoid, balance = bias_update(rate = 0.002)),
            mtp(depth = 2, lambda = 0.5, concat_order = emb_first),
            parametrization = mup(base_width = 32),
            train(
                data = text("corpus.txt"),
                optimizer = muon(lr = 0.01, adamw(lr = 1e-3, betas = (0.8, 0.9))),
                schedule = wsd(decay_fraction = 0.25),
                clip = none,
                seed = 7
            ),
        ));
        assert!(!cx.has_errors(), "{:?}", messages(cx));
        assert_eq!((spec.name.as_str(), spec.vocab, spec.d_model, spec.layers), ("t", 300, 128, 3));
        assert_eq!((spec.heads, spec.kv_heads, spec.tie_embeddings), (8, Some(2), true));
        assert_eq!((spec.norm_eps, spec.precision), (1e-6, Precision::Bf16));
        let ResidualSpec::Xhc(x) = &spec.residual else { panic!("xhc expected") };
        assert_eq!((x.n, x.k, x.fixed, x.conv_kernels.clone()), (8, 3, 1, vec![2, 3]));
        assert_eq!((x.flash, x.gram_schmidt), (Flash::TwoBlock, Some(false)));
        assert_eq!(x.sinkhorn_iters, XhcSpec::default().sinkhorn_iters);
        let FfnSpec::Moe(moe) = &spec.ffn else { panic!("moe expected") };
        assert_eq!((moe.experts, moe.top_k, moe.gate), (4, 1, MoeGate::Sigmoid));
        assert_eq!(moe.shared, MoeSpec::default().shared);
        assert_eq!(moe.balance, MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 0.002, ..Default::default() }));
        assert_eq!((spec.mtp.depth, spec.mtp.lambda), (2, 0.5));
        assert_eq!(spec.mtp.concat_order, ConcatOrder::EmbFirst);
        assert!(matches!(&spec.parametrization, Parametrization::MuP(m) if m.base_width == 32));
        assert_eq!(spec.train.data, DataSpec::Text("corpus.txt".into()));
        let OptimizerSpec::Muon(muon) = &spec.train.optimizer else { panic!("muon expected") };
        assert_eq!((muon.lr, muon.adamw.lr, muon.adamw.betas), (0.01, 1e-3, (0.8, 0.9)));
        assert!(matches!(&spec.train.schedule, ScheduleSpec::Wsd(w) if w.decay_fraction == 0.25));
        assert_eq!((spec.train.clip, spec.train.seed), (None, 7));
    }

    #[test]
    fn recompute_takes_a_block_size() {
        let (spec, cx) = build(quote::quote!(train(recompute = block(3))));
        assert!(!cx.has_errors());
        assert_eq!(spec.train.recompute, Recompute::Block(3));
        let (spec, cx) = build(quote::quote!(train(recompute = stream)));
        assert!(!cx.has_errors());
        assert_eq!(spec.train.recompute, Recompute::Stream);
        let (_, cx) = build(quote::quote!(train(recompute = block)));
        assert_eq!(messages(cx), vec!["expected the sublayers per block: `block(4)`"]);
    }

    #[test]
    fn ghc_r_is_a_multiple_of_m() {
        let (spec, cx) = build(quote::quote!(residual = ghc(m = 2, r = 3, reduce_norm = off)));
        assert!(!cx.has_errors());
        let ResidualSpec::Ghc(g) = &spec.residual else { panic!("ghc expected") };
        assert_eq!((g.m, g.n, g.reduce_norm), (2, 6, Some(ReduceNorm::Off)));

        let (_, cx) = build(quote::quote!(residual = ghc(m = 2, n = 8, r = 4)));
        assert_eq!(messages(cx), vec!["give either `n` or `r` (n = r * m), not both"]);
    }

    #[test]
    fn reports_every_mistake_with_suggestions() {
        let (_, cx) = build(quote::quote!(
            d_modle = 256,
            layers = 2.5,
            heads = 4,
            heads = 8,
            flash = block,
            residual = xhc(flash = blok),
            mtp = 3,
            ffn = gelu
        ));
        assert_eq!(
            messages(cx),
            vec![
                "unknown key `d_modle`; did you mean `d_model`?",
                "expected a non-negative integer, found `2.5`",
                "`heads` is set more than once",
                "unknown key `flash`; expected one of `name`, `vocab`, `vocab_pad_to`, `d_model`, `layers`, \
                 `heads`, `kv_heads`, `head_dim`, `ffn`, `norm_eps`, `rope_base`, \
                 `tie_embeddings`, `init_std`, `out_proj_depth_scaled`, `residual`, `mtp`, \
                 `parametrization`, `precision`, `train`",
                "unknown flash variant `blok`; did you mean `block`?",
                "expected `(depth = ..., ...)`, found `3`",
                "unknown feed-forward kind `gelu`; expected one of `swiglu`, `moe`",
            ]
        );
    }

    #[test]
    fn locate_falls_back_to_the_longest_written_prefix() {
        let (_, cx) = build(quote::quote!(residual = xhc(conv_kernels = [4, 0]), d_model = 8));
        assert!(cx.locate("residual.conv_kernels[1]").is_some());
        assert!(cx.locate("residual.k").is_some());
        assert!(cx.locate("d_model").is_some());
        assert!(cx.locate("train.steps").is_none());
    }

    #[test]
    fn variant_spellings_are_case_and_underscore_insensitive() {
        let (spec, cx) = build(quote::quote!(residual = Xhc(flash = TwoBlock, router = soft_max)));
        assert!(!cx.has_errors());
        let ResidualSpec::Xhc(x) = &spec.residual else { panic!("xhc expected") };
        assert_eq!((x.flash, x.router), (Flash::TwoBlock, Router::Softmax));
    }
}
