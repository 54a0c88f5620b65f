//! Spec validation: every rule of docs/math.md §10, plus the structural constraints of
//! §5.1–5.2 (VWN widths and the reduce GroupNorm) and §6.1 (xHC stream counts).
//!
//! All problems are collected, never just the first, so one run of the compiler
//! (or one `cargo build` through the derive macro) shows everything to fix. Each
//! [`FieldError`] names the field by its RON path (`residual.k`,
//! `train.optimizer.lr`), the bad value, and what would be valid.

use std::fmt;

use super::limits::{integer_limit, MAX_CONV_KERNELS, MAX_NAME_LEN, MAX_PATH_LEN, MAX_TRAINING_BYTES};
use super::{
    AdamWSpec, CoefInit, Coefficient, CollapseRule, ConnectionSpec, Constraint, Create, DataSpec, Entries,
    FfnSpec, Flash, Form, Generator, History, ModelSpec, MoeBalance, MoeDispatch, OptimizerSpec,
    Parametrization, Recompute, ReduceNorm, ResidualSpec, ScheduleSpec, SyntheticCorpus,
    MAX_PERMUTATION_STREAMS,
};
use crate::cost::{gib, training_memory};

/// One validation problem: the field path and a message naming the bad value and what is valid.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FieldError {
    /// RON field path, e.g. `residual.k` or `train.schedule.warmup`.
    pub path: String,
    /// Names the field, its value and the valid range, e.g. `residual.k = 5 must be <= residual.n = 4`.
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FieldError {}

impl ModelSpec {
    /// Checks every rule and returns all violations (docs/math.md §10): the graph rules of
    /// [`ModelSpec::validate_graph`] plus the rules of a training run (a `name` that is
    /// safe as a folder name, a `vocab` that covers the byte-level corpus).
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut c = Checker { trainable: true, ..Checker::default() };
        self.check_run(&mut c);
        self.check_graph(&mut c);
        c.finish()
    }

    /// The rules a graph needs: every structural rule, every size and loop bound
    /// ([`super::limits`]) and the training-memory ceiling. [`crate::lower::lower`] runs
    /// these; a spec that only feeds a graph (gradient checks with a tiny `vocab`, say)
    /// need not be trainable on the byte corpora.
    pub fn validate_graph(&self) -> Result<(), Vec<FieldError>> {
        let mut c = Checker::default();
        self.check_graph(&mut c);
        c.finish()
    }

    /// Rules of a training run, beyond the graph.
    fn check_run(&self, c: &mut Checker) {
        check_name(c, &self.name);
    }

    /// `vocab` covers the training corpus when the spec is to be trained (`validate`),
    /// and is at least 2 (a softmax) for a graph alone (`validate_graph`).
    fn check_vocab(&self, c: &mut Checker) {
        if !c.trainable {
            c.at_least("vocab", self.vocab, 2);
            return;
        }
        // Every corpus widen trains on is byte-level (the synthetic grammar and text
        // files alike): token ids are the bytes 0..=255, so a smaller vocabulary would
        // index the embedding and the logits out of bounds (README, "What widen guarantees").
        let corpus = match &self.train.data {
            DataSpec::Synthetic(SyntheticCorpus::Default) => "Synthetic(Default)".to_string(),
            DataSpec::Text(path) => format!("Text({:?})", path.chars().take(80).collect::<String>()),
            // Token ids are checked against `vocab` as each window is read (docs/data.md),
            // since only the data knows its largest id; any `vocab` >= 2 is a softmax.
            DataSpec::Tokens(_) => {
                c.at_least("vocab", self.vocab, 2);
                return;
            }
        };
        if self.vocab < 256 {
            c.fail(
                "vocab",
                format!(
                    "vocab = {} must be >= 256: train.data = {corpus} is byte-level, so token ids \
                     are the bytes 0..=255",
                    self.vocab
                ),
            );
        }
    }

    fn check_graph(&self, c: &mut Checker) {
        let before = c.errors.len();
        self.check_backbone(c);
        self.check_ffn(c);
        self.check_residual(c);
        c.non_negative("mtp.lambda", self.mtp.lambda);
        if let Parametrization::MuP(mup) = &self.parametrization {
            if mup.base_width < 1 || mup.base_width > self.d_model {
                c.fail(
                    "parametrization.base_width",
                    format!(
                        "parametrization.base_width = {} must be in 1..=d_model (d_model = {})",
                        mup.base_width, self.d_model
                    ),
                );
            }
            c.positive("parametrization.attn_mult", mup.attn_mult);
            c.positive("parametrization.output_mult", mup.output_mult);
        }
        self.check_train(c);
        self.check_bounds(c);
        // The estimate reads every size; with any size already refused it would only
        // repeat that error in other words.
        if c.errors.len() == before {
            self.check_memory_ceiling(c);
        }
    }

    /// Upper bounds of every integer field ([`super::limits::INTEGER_LIMITS`]; lower
    /// bounds are the rules above, with their own messages).
    fn check_bounds(&self, c: &mut Checker) {
        for (path, value) in self.integer_fields() {
            let row = path.split('[').next().and_then(integer_limit);
            if let Some(limit) = row {
                if value > limit.max {
                    c.fail(&path, format!("{path} = {value} must be <= {} ({})", limit.max, limit.why));
                }
            }
        }
        if let ResidualSpec::Xhc(x) = &self.residual {
            if x.conv_kernels.len() > MAX_CONV_KERNELS {
                c.fail(
                    "residual.conv_kernels",
                    format!(
                        "residual.conv_kernels has {} kernels; at most {MAX_CONV_KERNELS} (each adds a \
                         component to every augmented sublayer; the paper uses 3)",
                        x.conv_kernels.len()
                    ),
                );
            }
        }
        // docs/math.md §7.1: module k predicts token t + k + 1 from the first T - k positions;
        // k = T leaves no position and the graph would have empty tensors.
        if self.mtp.depth >= self.train.seq_len && self.train.seq_len >= 2 {
            c.fail(
                "mtp.depth",
                format!(
                    "mtp.depth = {} must be < train.seq_len = {} (MTP module k trains on the first \
                     T - k positions, so every module needs at least one)",
                    self.mtp.depth, self.train.seq_len
                ),
            );
        }
    }

    /// Every integer field with its path and value (list items as `path[i]`).
    pub(crate) fn integer_fields(&self) -> Vec<(String, u64)> {
        let u = |x: usize| x as u64;
        let mut out: Vec<(String, u64)> = vec![("vocab".into(), u(self.vocab))];
        if let Some(m) = self.vocab_pad_to {
            out.push(("vocab_pad_to".into(), u(m)));
        }
        out.extend([
            ("d_model".into(), u(self.d_model)),
            ("layers".into(), u(self.layers)),
            ("heads".into(), u(self.heads)),
        ]);
        if let Some(kv) = self.kv_heads {
            out.push(("kv_heads".into(), u(kv)));
        }
        if let Some(h) = self.head_dim {
            out.push(("head_dim".into(), u(h)));
        }
        match &self.ffn {
            FfnSpec::SwiGlu(s) => out.extend(s.hidden.map(|h| ("ffn.hidden".into(), u(h)))),
            FfnSpec::Moe(m) => out.extend([
                ("ffn.experts".into(), u(m.experts)),
                ("ffn.top_k".into(), u(m.top_k)),
                ("ffn.shared".into(), u(m.shared)),
                ("ffn.hidden".into(), u(m.hidden)),
            ]),
        }
        match &self.residual {
            ResidualSpec::Residual => {}
            ResidualSpec::Hc(h) => out.push(("residual.n".into(), u(h.n))),
            ResidualSpec::Fc(f) => out.push(("residual.m".into(), u(f.m))),
            ResidualSpec::Mhc(m) => {
                out.push(("residual.n".into(), u(m.n)));
                out.push(("residual.sinkhorn_iters".into(), u(m.sinkhorn_iters)));
            }
            ResidualSpec::Ghc(g) => {
                out.push(("residual.m".into(), u(g.m)));
                out.push(("residual.n".into(), u(g.n)));
            }
            ResidualSpec::Xhc(x) => {
                out.push(("residual.n".into(), u(x.n)));
                out.push(("residual.k".into(), u(x.k)));
                out.push(("residual.fixed".into(), u(x.fixed)));
                for (i, &kernel) in x.conv_kernels.iter().enumerate() {
                    out.push((format!("residual.conv_kernels[{i}]"), u(kernel)));
                }
                out.push(("residual.sinkhorn_iters".into(), u(x.sinkhorn_iters)));
            }
            ResidualSpec::Connection(c) => {
                out.push(("residual.streams".into(), u(c.streams)));
                out.push(("residual.segments".into(), u(c.segments)));
                if let Constraint::Sinkhorn { iters, .. } = c.carry.constraint {
                    out.push(("residual.carry.constraint.iters".into(), u(iters)));
                }
                if let Some(h) = &c.history {
                    out.push(("residual.history.block".into(), u(h.block)));
                    out.push(("residual.history.dilation".into(), u(h.dilation)));
                    out.push(("residual.history.period".into(), u(h.period)));
                }
            }
        }
        out.push(("mtp.depth".into(), u(self.mtp.depth)));
        match &self.parametrization {
            Parametrization::Standard => {}
            Parametrization::MuP(m) => out.push(("parametrization.base_width".into(), u(m.base_width))),
        }
        let t = &self.train;
        out.extend([
            ("train.seq_len".into(), u(t.seq_len)),
            ("train.batch".into(), u(t.batch)),
            ("train.steps".into(), u(t.steps)),
            ("train.seed".into(), t.seed),
            ("train.eval_every".into(), u(t.eval_every)),
            ("train.eval_batches".into(), u(t.eval_batches)),
        ]);
        if let Some(v) = t.val_tokens {
            out.push(("train.val_tokens".into(), u(v)));
        }
        out.extend([("train.checkpoint_every".into(), u(t.checkpoint_every))]);
        if let Recompute::Block(l) = t.recompute {
            out.push(("train.recompute".into(), u(l)));
        }
        let warmup = match &t.schedule {
            ScheduleSpec::Constant(s) => s.warmup,
            ScheduleSpec::Cosine(s) => s.warmup,
            ScheduleSpec::Wsd(s) => s.warmup,
        };
        out.push(("train.schedule.warmup".into(), u(warmup)));
        match &t.optimizer {
            OptimizerSpec::AdamW(_) => {}
            OptimizerSpec::Muon(m) => out.push(("train.optimizer.ns_steps".into(), u(m.ns_steps))),
        }
        out
    }

    /// The training-memory estimate against the fixed ceiling no machine exceeds.
    fn check_memory_ceiling(&self, c: &mut Checker) {
        let memory = training_memory(self);
        let limit = MAX_TRAINING_BYTES as f64;
        // An estimate that overflowed to infinity is above the limit too.
        if memory.total_bytes.is_nan() || memory.total_bytes > limit {
            let (path, message) = memory_message(&memory, &format!("the {:.0} GiB ceiling", gib(limit)));
            c.fail(path, format!("{message}; no machine holds that"));
        }
    }

    fn check_backbone(&self, c: &mut Checker) {
        self.check_vocab(c);
        c.at_least("d_model", self.d_model, 1);
        c.at_least("layers", self.layers, 1);
        c.at_least("heads", self.heads, 1);
        if let Some(kv) = self.kv_heads {
            if kv < 1 || kv > self.heads {
                c.fail("kv_heads", format!("kv_heads = {kv} must be in 1..=heads (heads = {})", self.heads));
            } else if !self.heads.is_multiple_of(kv) {
                c.fail("kv_heads", format!("heads = {} is not a multiple of kv_heads = {kv}", self.heads));
            }
        }
        match self.head_dim {
            Some(h) if h < 2 || !h.is_multiple_of(2) => {
                c.fail("head_dim", format!("head_dim = {h} must be even and >= 2 (RoPE rotates pairs)"));
            }
            Some(_) => {}
            None if self.heads >= 1 => {
                if !self.d_model.is_multiple_of(self.heads) {
                    c.fail(
                        "d_model",
                        format!(
                            "d_model = {} is not divisible by heads = {} (head_dim defaults to d_model / heads; \
                             set head_dim or change d_model)",
                            self.d_model, self.heads
                        ),
                    );
                } else {
                    let h = self.d_model / self.heads;
                    if h < 2 || !h.is_multiple_of(2) {
                        c.fail(
                            "head_dim",
                            format!(
                                "head_dim = {h} (d_model / heads, the default) must be even and >= 2 \
                                 (RoPE rotates pairs); set head_dim"
                            ),
                        );
                    }
                }
            }
            None => {}
        }
        c.positive("norm_eps", self.norm_eps);
        c.positive("rope_base", self.rope_base);
        c.positive("init_std", self.init_std);
    }

    fn check_ffn(&self, c: &mut Checker) {
        match &self.ffn {
            FfnSpec::SwiGlu(s) => {
                if let Some(hidden) = s.hidden {
                    c.at_least("ffn.hidden", hidden, 1);
                }
            }
            FfnSpec::Moe(m) => {
                c.at_least("ffn.experts", m.experts, 1);
                if m.top_k < 1 {
                    c.at_least("ffn.top_k", m.top_k, 1);
                } else if m.top_k > m.experts {
                    c.fail(
                        "ffn.top_k",
                        format!("ffn.top_k = {} must be <= ffn.experts = {}", m.top_k, m.experts),
                    );
                }
                c.at_least("ffn.hidden", m.hidden, 1);
                if let Some(factor) = m.capacity_factor {
                    c.positive("ffn.capacity_factor", factor);
                    if m.dispatch == MoeDispatch::Dense {
                        c.fail(
                            "ffn.capacity_factor",
                            "ffn.capacity_factor needs ffn.dispatch: Sparse (the Dense dispatch runs every \
                             expert on every token and drops nothing); set dispatch: Sparse or remove \
                             capacity_factor"
                                .into(),
                        );
                    }
                }
                match &m.balance {
                    MoeBalance::None => {}
                    MoeBalance::AuxLoss(a) => c.positive("ffn.balance.coef", a.coef),
                    MoeBalance::BiasUpdate(b) => {
                        c.positive("ffn.balance.rate", b.rate);
                        c.non_negative("ffn.balance.seq_aux_coef", b.seq_aux_coef);
                    }
                }
            }
        }
    }

    fn check_residual(&self, c: &mut Checker) {
        match &self.residual {
            ResidualSpec::Residual => {}
            ResidualSpec::Hc(h) => {
                c.at_least("residual.n", h.n, 1);
                c.finite("residual.scale_init", h.scale_init);
            }
            ResidualSpec::Fc(f) => {
                c.at_least("residual.m", f.m, 1);
                c.divides("residual.m", self.d_model, f.m);
                c.finite("residual.scale_init", f.scale_init);
            }
            ResidualSpec::Mhc(m) => {
                c.at_least("residual.n", m.n, 1);
                c.at_least("residual.sinkhorn_iters", m.sinkhorn_iters, 1);
                c.non_negative("residual.sinkhorn_eps", m.sinkhorn_eps);
                c.non_negative("residual.pre_eps", m.pre_eps);
                c.positive("residual.post_max", m.post_max);
                c.finite("residual.alpha_init", m.alpha_init);
            }
            ResidualSpec::Ghc(g) => {
                // docs/math.md §5.1: D % m == 0 and n >= m; n need not be a multiple of m.
                c.at_least("residual.m", g.m, 1);
                c.divides("residual.m", self.d_model, g.m);
                if g.n < g.m {
                    c.fail("residual.n", format!("residual.n = {} must be >= residual.m = {}", g.n, g.m));
                }
                if let Some(tau) = g.tau {
                    c.positive("residual.tau", tau);
                }
                c.finite("residual.s_init", g.s_init);
                // docs/math.md §5.2: GroupNorm groups have size D, so D' = (n/m) D must split evenly.
                if g.reduce_norm == Some(ReduceNorm::GroupNorm) && g.m >= 1 && !g.n.is_multiple_of(g.m) {
                    c.fail(
                        "residual.reduce_norm",
                        format!(
                            "residual.reduce_norm = GroupNorm requires residual.n = {} to be a multiple of \
                             residual.m = {} (groups of size d_model); use reduce_norm: Off",
                            g.n, g.m
                        ),
                    );
                }
            }
            ResidualSpec::Connection(conn) => check_connection(c, conn, self.d_model, self.layers),
            ResidualSpec::Xhc(x) => {
                c.at_least("residual.n", x.n, 1);
                if x.k < 1 {
                    c.at_least("residual.k", x.k, 1);
                } else if x.k > x.n {
                    c.fail("residual.k", format!("residual.k = {} must be <= residual.n = {}", x.k, x.n));
                }
                if x.fixed > x.k {
                    c.fail(
                        "residual.fixed",
                        format!("residual.fixed = {} must be <= residual.k = {}", x.fixed, x.k),
                    );
                }
                for (i, &kernel) in x.conv_kernels.iter().enumerate() {
                    c.at_least(&format!("residual.conv_kernels[{i}]"), kernel, 1);
                }
                c.at_least("residual.sinkhorn_iters", x.sinkhorn_iters, 1);
                c.positive("residual.gs_eps", x.gs_eps);
                c.finite("residual.alpha_init", x.alpha_init);
                // docs/math.md §6.11: one routing decision per two blocks needs whole pairs.
                if x.flash == Flash::TwoBlock && !self.layers.is_multiple_of(2) {
                    c.fail(
                        "residual.flash",
                        format!(
                            "residual.flash = TwoBlock shares routing over pairs of blocks and needs an even \
                             number of layers, but layers = {}",
                            self.layers
                        ),
                    );
                }
            }
        }
    }

    fn check_train(&self, c: &mut Checker) {
        let t = &self.train;
        match &t.data {
            DataSpec::Text(path) => check_data_path(c, "train.data", "Text(", path, "a text file"),
            DataSpec::Tokens(tokens) => {
                check_data_path(c, "train.data.train", "Tokens(train:", &tokens.train, "token shards");
                if let Some(val) = &tokens.val {
                    check_data_path(c, "train.data.val", "Tokens(val:", val, "validation shards");
                }
                if let Some(crate::spec::TokenizerSpec::HuggingFace { path, sha256 }) = &tokens.tokenizer {
                    check_data_path(
                        c,
                        "train.data.tokenizer.path",
                        "HuggingFace(path:",
                        path,
                        "a tokenizer.json",
                    );
                    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                        c.fail(
                            "train.data.tokenizer.sha256",
                            format!("train.data.tokenizer.sha256 = {sha256:?} must be 64 hex digits"),
                        );
                    }
                }
            }
            DataSpec::Synthetic(_) => {}
        }
        if let Some(v) = t.val_tokens {
            c.at_least("train.val_tokens", v, t.seq_len + 1);
        }
        if let Some(m) = self.vocab_pad_to {
            c.at_least("vocab_pad_to", m, 1);
        }
        c.at_least("train.seq_len", t.seq_len, 2);
        c.at_least("train.batch", t.batch, 1);
        c.at_least("train.steps", t.steps, 1);
        match &t.optimizer {
            OptimizerSpec::AdamW(a) => check_adamw(c, "train.optimizer", a),
            OptimizerSpec::Muon(m) => {
                c.positive("train.optimizer.lr", m.lr);
                c.unit_interval_open_top("train.optimizer.momentum", m.momentum);
                c.at_least("train.optimizer.ns_steps", m.ns_steps, 1);
                c.non_negative("train.optimizer.weight_decay", m.weight_decay);
                check_adamw(c, "train.optimizer.adamw", &m.adamw);
            }
        }
        let warmup = match &t.schedule {
            ScheduleSpec::Constant(s) => s.warmup,
            ScheduleSpec::Cosine(s) => {
                c.unit_interval("train.schedule.min_ratio", s.min_ratio);
                s.warmup
            }
            ScheduleSpec::Wsd(s) => {
                if !(s.decay_fraction > 0.0 && s.decay_fraction <= 1.0) {
                    c.fail(
                        "train.schedule.decay_fraction",
                        format!("train.schedule.decay_fraction = {:?} must be in (0, 1]", s.decay_fraction),
                    );
                }
                c.unit_interval("train.schedule.final_ratio", s.final_ratio);
                s.warmup
            }
        };
        if warmup >= t.steps {
            c.fail(
                "train.schedule.warmup",
                format!("train.schedule.warmup = {warmup} must be < train.steps = {}", t.steps),
            );
        }
        if let Some(clip) = t.clip {
            c.positive("train.clip", clip);
        }
        if let Recompute::Block(l) = t.recompute {
            // Blocks count sublayers (two per layer), as mHC's L_r does (docs/math.md §4.5).
            let sublayers = 2 * self.layers;
            if l == 0 || l > sublayers {
                c.fail(
                    "train.recompute",
                    format!(
                        "train.recompute = Block({l}) must count 1 ..= {sublayers} sublayers (2 x layers = {sublayers})"
                    ),
                );
            }
        }
        c.at_least("train.eval_every", t.eval_every, 1);
        c.at_least("train.eval_batches", t.eval_batches, 1);
        if !(t.val_fraction > 0.0 && t.val_fraction < 1.0) {
            c.fail(
                "train.val_fraction",
                format!("train.val_fraction = {:?} must be in (0, 1)", t.val_fraction),
            );
        }
    }
}

fn check_adamw(c: &mut Checker, at: &str, a: &AdamWSpec) {
    c.positive(&format!("{at}.lr"), a.lr);
    let (b1, b2) = a.betas;
    for (which, beta) in [("beta1", b1), ("beta2", b2)] {
        if !(0.0..1.0).contains(&beta) {
            c.fail(
                &format!("{at}.betas"),
                format!("{at}.betas = ({b1:?}, {b2:?}): {which} = {beta:?} must be in [0, 1)"),
            );
        }
    }
    c.positive(&format!("{at}.eps"), a.eps);
    c.non_negative(&format!("{at}.weight_decay"), a.weight_decay);
}

/// `name` becomes one folder under `runs/` and part of file names, so it must be one
/// safe path component (README, "What widen guarantees": `../../x` or `/tmp/x` wrote outside `runs/`).
fn check_name(c: &mut Checker, name: &str) {
    let valid = "1 to 64 characters from A-Z a-z 0-9 . _ -, not \".\" or \"..\" \
                 (it names the run's folder under runs/)";
    let shown: String = name.chars().take(MAX_NAME_LEN + 8).collect();
    let shown = if shown.len() < name.len() { format!("{shown:?}...") } else { format!("{shown:?}") };
    if name.is_empty() {
        c.fail("name", format!("name = \"\" must be non-empty: {valid}"));
    } else if name.chars().count() > MAX_NAME_LEN {
        c.fail(
            "name",
            format!("name = {shown} is {} characters long; it must be {valid}", name.chars().count()),
        );
    } else if name == "." || name == ".." {
        c.fail("name", format!("name = {shown} is not a folder name; it must be {valid}"));
    } else if let Some(bad) =
        name.chars().find(|ch| !(ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-')))
    {
        c.fail("name", format!("name = {shown} contains {bad:?}; it must be {valid}"));
    }
}

/// The error for an estimate above `limit`: the path of the largest share and a message
/// with the estimate and each share in GiB.
pub(crate) fn memory_message(memory: &crate::cost::TrainingMemory, limit: &str) -> (&'static str, String) {
    let shares = memory.shares();
    let top = shares[0];
    let parts: Vec<String> = shares
        .iter()
        .filter(|s| s.bytes > 0.0)
        .map(|s| format!("{} {:.1} GiB", s.what, gib(s.bytes)))
        .collect();
    let message = format!(
        "training needs about {:.1} GiB, above {limit}; the largest share is {} (reduce `{}`); all shares: {}",
        gib(memory.total_bytes),
        top.what,
        top.path,
        parts.join(", ")
    );
    (top.path, message)
}

/// Collects problems; each helper writes `path = value must be ...`.
#[derive(Default)]
struct Checker {
    errors: Vec<FieldError>,
    /// The spec is to be trained: the run's rules apply too.
    trainable: bool,
}

impl Checker {
    fn finish(self) -> Result<(), Vec<FieldError>> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(self.errors)
        }
    }

    fn fail(&mut self, path: &str, message: String) {
        self.errors.push(FieldError { path: path.to_string(), message });
    }

    fn at_least(&mut self, path: &str, value: usize, min: usize) {
        if value < min {
            self.fail(path, format!("{path} = {value} must be >= {min}"));
        }
    }

    /// `d_model % divisor == 0`, in the style `d_model = 250 is not divisible by residual.m = 4`.
    fn divides(&mut self, path: &str, d_model: usize, divisor: usize) {
        if divisor >= 1 && !d_model.is_multiple_of(divisor) {
            self.fail(path, format!("d_model = {d_model} is not divisible by {path} = {divisor}"));
        }
    }

    fn positive(&mut self, path: &str, value: f64) {
        if !(value > 0.0 && value.is_finite()) {
            self.fail(path, format!("{path} = {value:?} must be > 0 and finite"));
        }
    }

    fn non_negative(&mut self, path: &str, value: f64) {
        if !(value >= 0.0 && value.is_finite()) {
            self.fail(path, format!("{path} = {value:?} must be >= 0 and finite"));
        }
    }

    fn finite(&mut self, path: &str, value: f64) {
        if !value.is_finite() {
            self.fail(path, format!("{path} = {value:?} must be finite"));
        }
    }

    fn unit_interval(&mut self, path: &str, value: f64) {
        if !(0.0..=1.0).contains(&value) {
            self.fail(path, format!("{path} = {value:?} must be in [0, 1]"));
        }
    }

    fn unit_interval_open_top(&mut self, path: &str, value: f64) {
        if !(0.0..1.0).contains(&value) {
            self.fail(path, format!("{path} = {value:?} must be in [0, 1)"));
        }
    }
}

/// The connection language's rules (docs/connections.md, docs/math.md §12): every field
/// named by its path, with what would be valid.
fn check_connection(c: &mut Checker, conn: &ConnectionSpec, d_model: usize, layers: usize) {
    if let Some(history) = &conn.history {
        check_history(c, conn, history, layers);
    }
    let (s, m) = (conn.streams, conn.segments);
    c.at_least("residual.streams", s, 1);
    c.at_least("residual.segments", m, 1);
    c.divides("residual.segments", d_model, m);
    if m > s {
        c.fail("residual.segments", format!("residual.segments = {m} must be <= residual.streams = {s}"));
    }
    match conn.create {
        Create::Replicate if m != 1 => c.fail(
            "residual.create",
            format!("create: Replicate copies the d_model-wide embedding into every slot, so it needs segments = 1 (got {m}); use Split or Wide(Full)"),
        ),
        Create::Split if s != m => c.fail(
            "residual.create",
            format!("create: Split cuts the embedding into segments, so it needs streams = segments (got {s} and {m}); use Wide(Full) or Wide(Expand)"),
        ),
        _ => {}
    }
    match &conn.collapse {
        CollapseRule::Sum | CollapseRule::Mean | CollapseRule::Readout(_) if m != 1 => c.fail(
            "residual.collapse",
            format!("collapse: Sum, Mean and Readout add d_model-wide slots, so they need segments = 1 (got {m}); use Concat or Reduce"),
        ),
        CollapseRule::Concat if s != m => c.fail(
            "residual.collapse",
            format!("collapse: Concat puts the slots side by side, so it needs streams = segments (got {s} and {m}); use Reduce"),
        ),
        CollapseRule::Reduce { norm: ReduceNorm::GroupNorm, .. } if m >= 1 && !s.is_multiple_of(m) => c.fail(
            "residual.collapse.norm",
            format!("GroupNorm has groups of size d_model, so it needs streams = {s} to be a multiple of segments = {m}; use norm: Off"),
        ),
        CollapseRule::Readout(coef) => {
            check_coefficient(c, "residual.collapse", coef, s, (1, s), true);
            if coef.form != Form::Matrix {
                c.fail(
                    "residual.collapse.form",
                    "collapse: Readout weighs the slots with one [1, streams] row; leave form out (Matrix)".into(),
                );
            }
        }
        _ => {}
    }
    match &conn.generator {
        Generator::None => {}
        Generator::PerSlot(g) => {
            if let Some(tau) = g.temperature {
                c.positive("residual.generator.temperature", tau);
            }
            c.finite("residual.generator.gate_init", g.gate_init);
        }
        Generator::Flat(g) => {
            c.finite("residual.generator.gate_init", g.gate_init);
            // One bias holds the three static parts (docs/math.md §4.3, §12.1).
            if !(conn.read.learned == conn.carry.learned && conn.carry.learned == conn.write.learned) {
                c.fail(
                    "residual.read.learned",
                    "with generator: Flat one bias holds the static parts of read, carry and write, so learned must be the same for all three".into(),
                );
            }
        }
    }
    let per_slot = matches!(conn.generator, Generator::PerSlot(_));
    check_coefficient(c, "residual.read", &conn.read, s, (m, s), per_slot);
    if conn.read.form != Form::Matrix {
        c.fail(
            "residual.read.form",
            "read.form must be Matrix: the read is always [segments, streams]".into(),
        );
    }
    let carry_shape = if conn.carry.form == Form::PerSlot { (s, 1) } else { (s, s) };
    check_coefficient(c, "residual.carry", &conn.carry, s, carry_shape, per_slot);
    let write_shape = if conn.write.form == Form::PerSlot { (s, 1) } else { (s, m) };
    if conn.write.form == Form::PerSlot && s != m {
        c.fail(
            "residual.write.form",
            format!("write.form: PerSlot sends segment i to slot i, so it needs streams = segments (got {s} and {m}); use Matrix"),
        );
    }
    check_coefficient(c, "residual.write", &conn.write, s, write_shape, per_slot);
}

/// A depth history's rules (docs/math.md §12.5). A history of outputs replaces the fixed
/// state, so the fields that shape one must keep their one-slot defaults.
fn check_history(c: &mut Checker, conn: &ConnectionSpec, history: &History, layers: usize) {
    c.at_least("residual.history.block", history.block, 1);
    c.at_least("residual.history.dilation", history.dilation, 1);
    c.at_least("residual.history.period", history.period, 1);
    let sublayers = layers.saturating_mul(2);
    if layers >= 1 && history.block > sublayers {
        c.fail(
            "residual.history.block",
            format!(
                "residual.history.block = {} must be <= 2 x layers = {sublayers}: an entry holds `block` consecutive sublayers",
                history.block
            ),
        );
    }
    if history.entries != Entries::Outputs {
        return;
    }
    for (path, value) in
        [("residual.history.dilation", history.dilation), ("residual.history.period", history.period)]
    {
        if value != 1 {
            c.fail(
                path,
                format!("{path} = {value}: with entries: Outputs every sublayer reads every entry; dilation and period apply to entries: States"),
            );
        }
    }
    let plain = ConnectionSpec::default();
    let fixed = |path: &str, ok: bool, what: &str| (path.to_string(), ok, what.to_string());
    for (path, ok, what) in [
        fixed("residual.streams", conn.streams == 1, "streams: 1"),
        fixed("residual.segments", conn.segments == 1, "segments: 1 (or leave it out)"),
        fixed("residual.create", conn.create == Create::Replicate, "create: Replicate (or leave it out)"),
        fixed(
            "residual.collapse",
            conn.collapse == CollapseRule::Sum,
            "collapse: Sum (or leave it out); the head reads the history",
        ),
        fixed("residual.generator", conn.generator == Generator::None, "generator: None (or leave it out)"),
        fixed("residual.read", conn.read == plain.read, "read left out"),
        fixed("residual.carry", conn.carry == plain.carry, "carry left out"),
        fixed("residual.write", conn.write == plain.write, "write left out"),
    ] {
        if !ok {
            c.fail(
                &path,
                format!("residual.history with entries: Outputs replaces the fixed state (every sublayer reads the history, nothing is carried), so it needs {what}; for a history beside a fixed state use entries: States"),
            );
        }
    }
}

/// One coefficient at `path` with its matrix shape: its init's length and range, and a
/// constraint that fits its shape (`per_slot`: the per-slot generator, which cannot make
/// the s! logits of `Permutations`).
fn check_coefficient(
    c: &mut Checker,
    path: &str,
    coef: &Coefficient,
    s: usize,
    shape: (usize, usize),
    per_slot: bool,
) {
    let square = shape.0 == shape.1 && shape.0 == s;
    let logits = match coef.constraint {
        Constraint::Permutations => (1..=s.min(MAX_PERMUTATION_STREAMS)).product(),
        Constraint::Kronecker => 2 * crate::spec::kronecker_factors(s).unwrap_or(0),
        _ => shape.0.saturating_mul(shape.1),
    };
    match coef.constraint {
        Constraint::None | Constraint::Tanh | Constraint::Softmax => {}
        Constraint::Sigmoid { scale, offset } => {
            c.finite(&format!("{path}.constraint.scale"), scale);
            c.finite(&format!("{path}.constraint.offset"), offset);
        }
        Constraint::Sinkhorn { iters, eps } => {
            if !square || path != "residual.carry" {
                c.fail(
                    &format!("{path}.constraint"),
                    format!("{path}.constraint: Sinkhorn needs a square carry (carry with form: Matrix)"),
                );
            }
            c.at_least(&format!("{path}.constraint.iters"), iters, 1);
            c.non_negative(&format!("{path}.constraint.eps"), eps);
        }
        Constraint::Permutations => {
            if !square || path != "residual.carry" {
                c.fail(&format!("{path}.constraint"), format!("{path}.constraint: Permutations mixes s x s permutation matrices, so only a carry with form: Matrix takes it"));
            } else if s > MAX_PERMUTATION_STREAMS {
                c.fail(
                    &format!("{path}.constraint"),
                    format!("{path}.constraint: Permutations has streams! = {s}! logits; it takes streams <= {MAX_PERMUTATION_STREAMS} (use Sinkhorn)"),
                );
            } else if per_slot {
                c.fail(&format!("{path}.constraint"), format!("{path}.constraint: Permutations needs the s! logits of a Flat generator (or none); PerSlot makes one row per slot"));
            }
        }
        Constraint::Kronecker => {
            if !square || path != "residual.carry" {
                c.fail(&format!("{path}.constraint"), format!("{path}.constraint: Kronecker builds an s x s carry from 2 x 2 factors, so only a carry with form: Matrix takes it"));
            } else if crate::spec::kronecker_factors(s).is_none() {
                c.fail(
                    &format!("{path}.constraint"),
                    format!("{path}.constraint: Kronecker needs streams = 2^K for K >= 1 factors (2, 4, 8, ...), got {s}; use Sinkhorn or Permutations"),
                );
            } else if per_slot {
                c.fail(&format!("{path}.constraint"), format!("{path}.constraint: Kronecker needs the 2K logits of a Flat generator (or none); PerSlot makes one row per slot"));
            }
        }
    }
    let init = format!("{path}.init");
    match &coef.init {
        CoefInit::Identity
        | CoefInit::Cyclic
        | CoefInit::Eye { .. }
        | CoefInit::First { .. }
        | CoefInit::Home { .. } => {
            if let CoefInit::Eye { on, off } | CoefInit::First { on, off } | CoefInit::Home { on, off } =
                &coef.init
            {
                c.finite(&format!("{init}.on"), *on);
                c.finite(&format!("{init}.off"), *off);
            }
            if matches!(coef.init, CoefInit::Home { .. }) && shape.0 != 1 && shape.1 != 1 {
                c.fail(&init, format!("{init}: Home marks one slot of a [1, s] or [s, 1] coefficient; this one is [{}, {}]: use Identity or Eye", shape.0, shape.1));
            }
        }
        CoefInit::Constant(v) => c.finite(&init, *v),
        CoefInit::Logit(p) => {
            if !(*p > 0.0 && *p < 1.0) {
                c.fail(&init, format!("{init} = Logit({p:?}): p must be in (0, 1)"));
            }
        }
        CoefInit::Linspace(lo, hi) => {
            c.finite(&format!("{init}.lo"), *lo);
            c.finite(&format!("{init}.hi"), *hi);
        }
        CoefInit::Values(v) => {
            if v.len() != logits {
                c.fail(
                    &init,
                    format!("{init}: Values has {} numbers; this coefficient has {logits} logits", v.len()),
                );
            }
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                c.fail(&init, format!("{init}: Values[{i}] = {:?} must be finite", v[i]));
            }
        }
    }
}

/// A data path of the spec: not empty, bounded, without NUL (the OS would refuse it
/// later with a less helpful message). `form` opens the value as the message shows it.
fn check_data_path(c: &mut Checker, field: &str, form: &str, path: &str, what: &str) {
    if path.trim().is_empty() {
        c.fail(field, format!("{field} = {form}{path:?}) must name {what}"));
    } else if path.len() > MAX_PATH_LEN || path.contains('\0') {
        let shown: String = path.chars().take(40).collect();
        c.fail(
            field,
            format!(
                "{field} = {form}{shown:?}...) must be a file path of at most {MAX_PATH_LEN} bytes \
                 without NUL characters"
            ),
        );
    }
}
