//! One test per validation rule of `ModelSpec::validate` (docs/math.md §10, §5.1–5.2, §6.1).
//!
//! Each test breaks one rule and checks that an error names the field path, the
//! bad value and the valid range; then it moves the value to the edge of the valid
//! range and checks that the spec passes, so a rule can be neither missing nor
//! stricter than documented.

use ir::spec::{
    AuxLossSpec, BiasUpdateSpec, DataSpec, FcSpec, FfnSpec, FieldError, Flash, GhcSpec, HcSpec, MhcSpec,
    ModelSpec, MoeBalance, MoeDispatch, MoeSpec, MuonSpec, MupSpec, OptimizerSpec, Parametrization,
    Recompute, ReduceNorm, ResidualSpec, ScheduleSpec, SwiGluSpec, WsdSpec, XhcSpec,
};

fn errors(spec: &ModelSpec) -> Vec<FieldError> {
    spec.validate().err().unwrap_or_default()
}

/// Asserts that some error has `path` and a message containing every part.
fn assert_error(spec: &ModelSpec, path: &str, parts: &[&str]) {
    let found = errors(spec);
    let error = found
        .iter()
        .find(|e| e.path == path)
        .unwrap_or_else(|| panic!("no error at `{path}`; got {found:#?}"));
    for part in parts {
        assert!(error.message.contains(part), "`{}` does not contain `{part}`", error.message);
    }
}

fn ghc(m: usize, n: usize) -> GhcSpec {
    GhcSpec { m, n, ..GhcSpec::default() }
}

fn xhc(n: usize, k: usize, fixed: usize) -> XhcSpec {
    XhcSpec { n, k, fixed, ..XhcSpec::default() }
}

/// `rule!(test_name, bad, ok, path, [message parts])`: `bad` and `ok` edit the default spec.
macro_rules! rule {
    ($name:ident, $bad:expr, $ok:expr, $path:literal, [$($part:literal),* $(,)?]) => {
        #[test]
        fn $name() {
            let mut spec = ModelSpec::default();
            let bad: fn(&mut ModelSpec) = $bad;
            bad(&mut spec);
            assert_error(&spec, $path, &[$($part),*]);
            let mut spec = ModelSpec::default();
            let ok: fn(&mut ModelSpec) = $ok;
            ok(&mut spec);
            assert_eq!(spec.validate(), Ok(()), "the edge of the valid range must pass");
        }
    };
}

// Recompute blocks count sublayers, two per layer (docs/math.md §4.5).
rule!(
    recompute_block_at_least_1,
    |s| s.train.recompute = Recompute::Block(0),
    |s| s.train.recompute = Recompute::Block(1),
    "train.recompute",
    ["Block(0)", "1 ..= 4 sublayers"]
);
rule!(
    recompute_block_at_most_the_sublayers,
    |s| s.train.recompute = Recompute::Block(5),
    |s| s.train.recompute = Recompute::Block(4),
    "train.recompute",
    ["Block(5)", "2 x layers = 4"]
);

#[test]
fn default_spec_is_valid() {
    assert_eq!(ModelSpec::default().validate(), Ok(()));
}

// Backbone (docs/math.md §10 "Model / backbone").
rule!(
    name_non_empty,
    |s| s.name = String::new(),
    |s| s.name = "x".into(),
    "name",
    ["name = \"\"", "non-empty"]
);
rule!(vocab_at_least_256, |s| s.vocab = 255, |s| s.vocab = 256, "vocab", ["vocab = 255", ">= 256"]);
rule!(
    d_model_at_least_1,
    |s| {
        s.d_model = 0;
        s.head_dim = Some(16);
    },
    |s| {
        s.d_model = 1;
        s.head_dim = Some(16);
    },
    "d_model",
    ["d_model = 0", ">= 1"]
);
rule!(layers_at_least_1, |s| s.layers = 0, |s| s.layers = 1, "layers", ["layers = 0", ">= 1"]);
rule!(heads_at_least_1, |s| s.heads = 0, |s| s.heads = 1, "heads", ["heads = 0", ">= 1"]);
rule!(
    kv_heads_at_most_heads,
    |s| s.kv_heads = Some(8),
    |s| s.kv_heads = Some(4),
    "kv_heads",
    ["kv_heads = 8", "1..=heads", "heads = 4"]
);
rule!(
    kv_heads_at_least_1,
    |s| s.kv_heads = Some(0),
    |s| s.kv_heads = Some(1),
    "kv_heads",
    ["kv_heads = 0", "1..=heads"]
);
rule!(
    heads_multiple_of_kv_heads,
    |s| {
        s.d_model = 96;
        s.heads = 6;
        s.kv_heads = Some(4);
    },
    |s| {
        s.d_model = 96;
        s.heads = 6;
        s.kv_heads = Some(3);
    },
    "kv_heads",
    ["heads = 6 is not a multiple of kv_heads = 4"]
);
rule!(
    head_dim_even,
    |s| s.head_dim = Some(7),
    |s| s.head_dim = Some(2),
    "head_dim",
    ["head_dim = 7", "even and >= 2"]
);
rule!(
    head_dim_at_least_2,
    |s| s.head_dim = Some(0),
    |s| s.head_dim = Some(2),
    "head_dim",
    ["head_dim = 0", "even and >= 2"]
);
rule!(
    default_head_dim_needs_divisible_d_model,
    |s| s.d_model = 250,
    |s| {
        s.d_model = 250;
        s.head_dim = Some(64);
    },
    "d_model",
    ["d_model = 250 is not divisible by heads = 4", "set head_dim"]
);
rule!(
    default_head_dim_even,
    |s| s.d_model = 12,
    |s| s.d_model = 16,
    "head_dim",
    ["head_dim = 3", "d_model / heads", "even"]
);
rule!(norm_eps_positive, |s| s.norm_eps = 0.0, |s| s.norm_eps = 1e-30, "norm_eps", ["norm_eps = 0.0", "> 0"]);
rule!(
    norm_eps_finite,
    |s| s.norm_eps = f64::NAN,
    |s| s.norm_eps = 1e-6,
    "norm_eps",
    ["norm_eps = NaN", "finite"]
);
rule!(
    rope_base_positive,
    |s| s.rope_base = -1.0,
    |s| s.rope_base = 1.0,
    "rope_base",
    ["rope_base = -1.0", "> 0"]
);
rule!(init_std_positive, |s| s.init_std = 0.0, |s| s.init_std = 1e-4, "init_std", ["init_std = 0.0", "> 0"]);

// Feed-forward.
rule!(
    swiglu_hidden_at_least_1,
    |s| s.ffn = FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(0) }),
    |s| s.ffn = FfnSpec::SwiGlu(SwiGluSpec { hidden: Some(1) }),
    "ffn.hidden",
    ["ffn.hidden = 0", ">= 1"]
);
rule!(
    moe_experts_at_least_1,
    |s| s.ffn = FfnSpec::Moe(MoeSpec { experts: 0, top_k: 1, ..MoeSpec::default() }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec { experts: 1, top_k: 1, ..MoeSpec::default() }),
    "ffn.experts",
    ["ffn.experts = 0", ">= 1"]
);
rule!(
    moe_top_k_at_most_experts,
    |s| s.ffn = FfnSpec::Moe(MoeSpec { experts: 8, top_k: 9, ..MoeSpec::default() }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec { experts: 8, top_k: 8, ..MoeSpec::default() }),
    "ffn.top_k",
    ["ffn.top_k = 9 must be <= ffn.experts = 8"]
);
rule!(
    moe_top_k_at_least_1,
    |s| s.ffn = FfnSpec::Moe(MoeSpec { top_k: 0, ..MoeSpec::default() }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec { top_k: 1, ..MoeSpec::default() }),
    "ffn.top_k",
    ["ffn.top_k = 0", ">= 1"]
);
rule!(
    moe_hidden_at_least_1,
    |s| s.ffn = FfnSpec::Moe(MoeSpec { hidden: 0, ..MoeSpec::default() }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec { hidden: 1, ..MoeSpec::default() }),
    "ffn.hidden",
    ["ffn.hidden = 0", ">= 1"]
);
rule!(
    moe_capacity_factor_positive,
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        dispatch: MoeDispatch::Sparse,
        capacity_factor: Some(0.0),
        ..MoeSpec::default()
    }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        dispatch: MoeDispatch::Sparse,
        capacity_factor: Some(1.0),
        ..MoeSpec::default()
    }),
    "ffn.capacity_factor",
    ["ffn.capacity_factor = 0.0", "must be > 0"]
);
rule!(
    moe_capacity_factor_needs_sparse_dispatch,
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        dispatch: MoeDispatch::Dense,
        capacity_factor: Some(1.0),
        ..MoeSpec::default()
    }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        dispatch: MoeDispatch::Sparse,
        capacity_factor: Some(1.0),
        ..MoeSpec::default()
    }),
    "ffn.capacity_factor",
    ["needs ffn.dispatch: Sparse"]
);
rule!(
    moe_aux_loss_coef_positive,
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        balance: MoeBalance::AuxLoss(AuxLossSpec { coef: -0.01, ..Default::default() }),
        ..MoeSpec::default()
    }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        balance: MoeBalance::AuxLoss(AuxLossSpec { coef: 0.01, ..Default::default() }),
        ..MoeSpec::default()
    }),
    "ffn.balance.coef",
    ["ffn.balance.coef = -0.01", "must be > 0 and finite"]
);
rule!(
    moe_bias_update_rate_positive,
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        balance: MoeBalance::BiasUpdate(BiasUpdateSpec { rate: f64::INFINITY, ..Default::default() }),
        ..MoeSpec::default()
    }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        balance: MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 1e-3, ..Default::default() }),
        ..MoeSpec::default()
    }),
    "ffn.balance.rate",
    ["ffn.balance.rate = inf", "must be > 0 and finite"]
);
rule!(
    moe_seq_aux_coef_non_negative,
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        balance: MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 1e-3, seq_aux_coef: -1e-4 }),
        ..MoeSpec::default()
    }),
    |s| s.ffn = FfnSpec::Moe(MoeSpec {
        balance: MoeBalance::BiasUpdate(BiasUpdateSpec { rate: 1e-3, seq_aux_coef: 1e-4 }),
        ..MoeSpec::default()
    }),
    "ffn.balance.seq_aux_coef",
    ["ffn.balance.seq_aux_coef = -0.0001", ">= 0"]
);

// Residual schemes (docs/math.md §10 "Residual connection").
rule!(
    hc_n_at_least_1,
    |s| s.residual = ResidualSpec::Hc(HcSpec { n: 0, ..HcSpec::default() }),
    |s| s.residual = ResidualSpec::Hc(HcSpec { n: 1, ..HcSpec::default() }),
    "residual.n",
    ["residual.n = 0", ">= 1"]
);
rule!(
    hc_scale_init_finite,
    |s| s.residual = ResidualSpec::Hc(HcSpec { scale_init: f64::INFINITY, ..HcSpec::default() }),
    |s| s.residual = ResidualSpec::Hc(HcSpec { scale_init: -1.0, ..HcSpec::default() }),
    "residual.scale_init",
    ["residual.scale_init = inf", "finite"]
);
rule!(
    fc_m_at_least_1,
    |s| s.residual = ResidualSpec::Fc(FcSpec { m: 0, ..FcSpec::default() }),
    |s| s.residual = ResidualSpec::Fc(FcSpec { m: 1, ..FcSpec::default() }),
    "residual.m",
    ["residual.m = 0", ">= 1"]
);
rule!(
    fc_m_divides_d_model,
    |s| {
        s.d_model = 96;
        s.residual = ResidualSpec::Fc(FcSpec { m: 5, ..FcSpec::default() });
    },
    |s| {
        s.d_model = 96;
        s.residual = ResidualSpec::Fc(FcSpec { m: 3, ..FcSpec::default() });
    },
    "residual.m",
    ["d_model = 96 is not divisible by residual.m = 5"]
);
rule!(
    mhc_n_at_least_1,
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { n: 0, ..MhcSpec::default() }),
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { n: 1, ..MhcSpec::default() }),
    "residual.n",
    ["residual.n = 0", ">= 1"]
);
rule!(
    mhc_sinkhorn_iters_at_least_1,
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { sinkhorn_iters: 0, ..MhcSpec::default() }),
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { sinkhorn_iters: 1, ..MhcSpec::default() }),
    "residual.sinkhorn_iters",
    ["residual.sinkhorn_iters = 0", ">= 1"]
);
rule!(
    mhc_sinkhorn_eps_non_negative,
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { sinkhorn_eps: -1e-6, ..MhcSpec::default() }),
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { sinkhorn_eps: 0.0, ..MhcSpec::default() }),
    "residual.sinkhorn_eps",
    ["residual.sinkhorn_eps = -1e-6", ">= 0"]
);
rule!(
    mhc_pre_eps_non_negative,
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { pre_eps: -1.0, ..MhcSpec::default() }),
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { pre_eps: 0.0, ..MhcSpec::default() }),
    "residual.pre_eps",
    ["residual.pre_eps = -1.0", ">= 0"]
);
rule!(
    mhc_post_max_positive,
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { post_max: 0.0, ..MhcSpec::default() }),
    |s| s.residual = ResidualSpec::Mhc(MhcSpec { post_max: 0.5, ..MhcSpec::default() }),
    "residual.post_max",
    ["residual.post_max = 0.0", "> 0"]
);
rule!(
    ghc_m_at_least_1,
    |s| s.residual = ResidualSpec::Ghc(ghc(0, 4)),
    |s| s.residual = ResidualSpec::Ghc(ghc(1, 4)),
    "residual.m",
    ["residual.m = 0", ">= 1"]
);
rule!(
    ghc_n_at_least_m,
    |s| s.residual = ResidualSpec::Ghc(ghc(4, 2)),
    |s| s.residual = ResidualSpec::Ghc(ghc(4, 4)),
    "residual.n",
    ["residual.n = 2 must be >= residual.m = 4"]
);
rule!(
    ghc_m_divides_d_model,
    |s| {
        s.d_model = 250;
        s.heads = 5;
        s.residual = ResidualSpec::Ghc(ghc(4, 16));
    },
    |s| {
        s.d_model = 250;
        s.heads = 5;
        s.residual = ResidualSpec::Ghc(ghc(5, 20));
    },
    "residual.m",
    ["d_model = 250 is not divisible by residual.m = 4"]
);
rule!(
    ghc_tau_positive,
    |s| s.residual = ResidualSpec::Ghc(GhcSpec { tau: Some(0.0), ..GhcSpec::default() }),
    |s| s.residual = ResidualSpec::Ghc(GhcSpec { tau: Some(1e-3), ..GhcSpec::default() }),
    "residual.tau",
    ["residual.tau = 0.0", "> 0"]
);
rule!(
    ghc_group_norm_needs_integer_ratio,
    |s| s.residual = ResidualSpec::Ghc(GhcSpec { reduce_norm: Some(ReduceNorm::GroupNorm), ..ghc(2, 3) }),
    |s| s.residual = ResidualSpec::Ghc(GhcSpec { reduce_norm: Some(ReduceNorm::Off), ..ghc(2, 3) }),
    "residual.reduce_norm",
    ["residual.reduce_norm = GroupNorm", "residual.n = 3", "multiple of residual.m = 2", "Off"]
);
rule!(
    xhc_n_at_least_1,
    |s| s.residual = ResidualSpec::Xhc(xhc(0, 0, 0)),
    |s| s.residual = ResidualSpec::Xhc(xhc(1, 1, 0)),
    "residual.n",
    ["residual.n = 0", ">= 1"]
);
rule!(
    xhc_k_at_most_n,
    |s| s.residual = ResidualSpec::Xhc(xhc(4, 5, 2)),
    |s| s.residual = ResidualSpec::Xhc(xhc(4, 4, 2)),
    "residual.k",
    ["residual.k = 5 must be <= residual.n = 4"]
);
rule!(
    xhc_k_at_least_1,
    |s| s.residual = ResidualSpec::Xhc(xhc(4, 0, 0)),
    |s| s.residual = ResidualSpec::Xhc(xhc(4, 1, 0)),
    "residual.k",
    ["residual.k = 0", ">= 1"]
);
rule!(
    xhc_fixed_at_most_k,
    |s| s.residual = ResidualSpec::Xhc(xhc(16, 4, 5)),
    |s| s.residual = ResidualSpec::Xhc(xhc(16, 4, 4)),
    "residual.fixed",
    ["residual.fixed = 5 must be <= residual.k = 4"]
);
rule!(
    xhc_conv_kernels_at_least_1,
    |s| s.residual = ResidualSpec::Xhc(XhcSpec { conv_kernels: vec![4, 0], ..XhcSpec::default() }),
    |s| s.residual = ResidualSpec::Xhc(XhcSpec { conv_kernels: vec![4, 1], ..XhcSpec::default() }),
    "residual.conv_kernels[1]",
    ["residual.conv_kernels[1] = 0", ">= 1"]
);
rule!(
    xhc_sinkhorn_iters_at_least_1,
    |s| s.residual = ResidualSpec::Xhc(XhcSpec { sinkhorn_iters: 0, ..XhcSpec::default() }),
    |s| s.residual = ResidualSpec::Xhc(XhcSpec { sinkhorn_iters: 1, ..XhcSpec::default() }),
    "residual.sinkhorn_iters",
    ["residual.sinkhorn_iters = 0", ">= 1"]
);
rule!(
    xhc_gs_eps_positive,
    |s| s.residual = ResidualSpec::Xhc(XhcSpec { gs_eps: 0.0, ..XhcSpec::default() }),
    |s| s.residual = ResidualSpec::Xhc(XhcSpec { gs_eps: 1e-12, ..XhcSpec::default() }),
    "residual.gs_eps",
    ["residual.gs_eps = 0.0", "> 0"]
);
rule!(
    xhc_two_block_flash_needs_even_layers,
    |s| {
        s.layers = 3;
        s.residual = ResidualSpec::Xhc(XhcSpec { flash: Flash::TwoBlock, ..XhcSpec::default() });
    },
    |s| {
        s.layers = 4;
        s.residual = ResidualSpec::Xhc(XhcSpec { flash: Flash::TwoBlock, ..XhcSpec::default() });
    },
    "residual.flash",
    ["residual.flash = TwoBlock", "even number of layers", "layers = 3"]
);

// MTP and muP.
rule!(
    mtp_lambda_non_negative,
    |s| s.mtp.lambda = -0.1,
    |s| s.mtp.lambda = 0.0,
    "mtp.lambda",
    ["mtp.lambda = -0.1", ">= 0"]
);
rule!(
    mtp_lambda_finite,
    |s| s.mtp.lambda = f64::INFINITY,
    |s| s.mtp.lambda = 1e9,
    "mtp.lambda",
    ["mtp.lambda = inf", "finite"]
);
rule!(
    mup_base_width_at_most_d_model,
    |s| s.parametrization = Parametrization::MuP(MupSpec { base_width: 65, ..MupSpec::default() }),
    |s| s.parametrization = Parametrization::MuP(MupSpec { base_width: 64, ..MupSpec::default() }),
    "parametrization.base_width",
    ["parametrization.base_width = 65", "1..=d_model", "d_model = 64"]
);
rule!(
    mup_base_width_at_least_1,
    |s| s.parametrization = Parametrization::MuP(MupSpec { base_width: 0, ..MupSpec::default() }),
    |s| s.parametrization = Parametrization::MuP(MupSpec { base_width: 1, ..MupSpec::default() }),
    "parametrization.base_width",
    ["parametrization.base_width = 0", "1..=d_model"]
);
rule!(
    mup_attn_mult_positive,
    |s| s.parametrization = Parametrization::MuP(MupSpec { attn_mult: 0.0, ..MupSpec::default() }),
    |s| s.parametrization = Parametrization::MuP(MupSpec { attn_mult: 0.1, ..MupSpec::default() }),
    "parametrization.attn_mult",
    ["parametrization.attn_mult = 0.0", "> 0"]
);
rule!(
    mup_output_mult_positive,
    |s| s.parametrization = Parametrization::MuP(MupSpec { output_mult: -1.0, ..MupSpec::default() }),
    |s| s.parametrization = Parametrization::MuP(MupSpec { output_mult: 0.1, ..MupSpec::default() }),
    "parametrization.output_mult",
    ["parametrization.output_mult = -1.0", "> 0"]
);

// Training.
rule!(
    train_seq_len_at_least_2,
    |s| s.train.seq_len = 1,
    |s| s.train.seq_len = 2,
    "train.seq_len",
    ["train.seq_len = 1", ">= 2"]
);
rule!(
    train_batch_at_least_1,
    |s| s.train.batch = 0,
    |s| s.train.batch = 1,
    "train.batch",
    ["train.batch = 0", ">= 1"]
);
rule!(
    train_steps_at_least_1,
    |s| {
        s.train.steps = 0;
        s.train.schedule = ScheduleSpec::Constant(Default::default());
    },
    |s| {
        s.train.steps = 1;
        s.train.schedule = ScheduleSpec::Constant(Default::default());
    },
    "train.steps",
    ["train.steps = 0", ">= 1"]
);
rule!(
    adamw_lr_positive,
    |s| s.train.optimizer = adamw(|a| a.lr = 0.0),
    |s| s.train.optimizer = adamw(|a| a.lr = 1e-9),
    "train.optimizer.lr",
    ["train.optimizer.lr = 0.0", "> 0"]
);
rule!(
    adamw_betas_below_1,
    |s| s.train.optimizer = adamw(|a| a.betas = (0.9, 1.0)),
    |s| s.train.optimizer = adamw(|a| a.betas = (0.0, 0.999)),
    "train.optimizer.betas",
    ["train.optimizer.betas = (0.9, 1.0)", "beta2 = 1.0", "[0, 1)"]
);
rule!(
    adamw_betas_non_negative,
    |s| s.train.optimizer = adamw(|a| a.betas = (-0.1, 0.95)),
    |s| s.train.optimizer = adamw(|a| a.betas = (0.0, 0.0)),
    "train.optimizer.betas",
    ["beta1 = -0.1", "[0, 1)"]
);
rule!(
    adamw_eps_positive,
    |s| s.train.optimizer = adamw(|a| a.eps = 0.0),
    |s| s.train.optimizer = adamw(|a| a.eps = 1e-20),
    "train.optimizer.eps",
    ["train.optimizer.eps = 0.0", "> 0"]
);
rule!(
    adamw_weight_decay_non_negative,
    |s| s.train.optimizer = adamw(|a| a.weight_decay = -0.1),
    |s| s.train.optimizer = adamw(|a| a.weight_decay = 0.0),
    "train.optimizer.weight_decay",
    ["train.optimizer.weight_decay = -0.1", ">= 0"]
);
rule!(
    muon_momentum_below_1,
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec { momentum: 1.0, ..MuonSpec::default() }),
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec { momentum: 0.0, ..MuonSpec::default() }),
    "train.optimizer.momentum",
    ["train.optimizer.momentum = 1.0", "[0, 1)"]
);
rule!(
    muon_ns_steps_at_least_1,
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec { ns_steps: 0, ..MuonSpec::default() }),
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec { ns_steps: 1, ..MuonSpec::default() }),
    "train.optimizer.ns_steps",
    ["train.optimizer.ns_steps = 0", ">= 1"]
);
rule!(
    muon_lr_positive,
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec { lr: -0.02, ..MuonSpec::default() }),
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec { lr: 0.02, ..MuonSpec::default() }),
    "train.optimizer.lr",
    ["train.optimizer.lr = -0.02", "> 0"]
);
rule!(
    muon_inner_adamw_is_checked,
    |s| {
        let mut muon = MuonSpec::default();
        muon.adamw.lr = 0.0;
        s.train.optimizer = OptimizerSpec::Muon(muon);
    },
    |s| s.train.optimizer = OptimizerSpec::Muon(MuonSpec::default()),
    "train.optimizer.adamw.lr",
    ["train.optimizer.adamw.lr = 0.0", "> 0"]
);
rule!(
    warmup_below_steps,
    |s| {
        s.train.steps = 200;
        set_warmup(s, 200);
    },
    |s| {
        s.train.steps = 200;
        set_warmup(s, 199);
    },
    "train.schedule.warmup",
    ["train.schedule.warmup = 200 must be < train.steps = 200"]
);
rule!(
    cosine_min_ratio_in_unit_interval,
    |s| cosine(s, 1.5),
    |s| cosine(s, 1.0),
    "train.schedule.min_ratio",
    ["train.schedule.min_ratio = 1.5", "[0, 1]"]
);
rule!(
    wsd_decay_fraction_in_half_open_interval,
    |s| s.train.schedule = ScheduleSpec::Wsd(WsdSpec { decay_fraction: 0.0, ..WsdSpec::default() }),
    |s| s.train.schedule = ScheduleSpec::Wsd(WsdSpec { decay_fraction: 1.0, ..WsdSpec::default() }),
    "train.schedule.decay_fraction",
    ["train.schedule.decay_fraction = 0.0", "(0, 1]"]
);
rule!(
    wsd_final_ratio_in_unit_interval,
    |s| s.train.schedule = ScheduleSpec::Wsd(WsdSpec { final_ratio: -0.1, ..WsdSpec::default() }),
    |s| s.train.schedule = ScheduleSpec::Wsd(WsdSpec { final_ratio: 0.0, ..WsdSpec::default() }),
    "train.schedule.final_ratio",
    ["train.schedule.final_ratio = -0.1", "[0, 1]"]
);
rule!(
    clip_positive,
    |s| s.train.clip = Some(0.0),
    |s| s.train.clip = None,
    "train.clip",
    ["train.clip = 0.0", "> 0"]
);
rule!(
    eval_every_at_least_1,
    |s| s.train.eval_every = 0,
    |s| s.train.eval_every = 1,
    "train.eval_every",
    ["train.eval_every = 0", ">= 1"]
);
rule!(
    eval_batches_at_least_1,
    |s| s.train.eval_batches = 0,
    |s| s.train.eval_batches = 1,
    "train.eval_batches",
    ["train.eval_batches = 0", ">= 1"]
);
rule!(
    val_fraction_in_open_interval,
    |s| s.train.val_fraction = 1.0,
    |s| s.train.val_fraction = 0.999,
    "train.val_fraction",
    ["train.val_fraction = 1.0", "(0, 1)"]
);
rule!(
    text_data_path_non_empty,
    |s| s.train.data = DataSpec::Text(String::new()),
    // Existence is checked when training starts, not here.
    |s| s.train.data = DataSpec::Text("no/such/file.txt".into()),
    "train.data",
    ["train.data = Text(\"\")", "must name a text file"]
);

fn adamw(edit: fn(&mut ir::spec::AdamWSpec)) -> OptimizerSpec {
    let mut a = ir::spec::AdamWSpec::default();
    edit(&mut a);
    OptimizerSpec::AdamW(a)
}

fn set_warmup(spec: &mut ModelSpec, warmup: usize) {
    match &mut spec.train.schedule {
        ScheduleSpec::Constant(s) => s.warmup = warmup,
        ScheduleSpec::Cosine(s) => s.warmup = warmup,
        ScheduleSpec::Wsd(s) => s.warmup = warmup,
    }
}

fn cosine(spec: &mut ModelSpec, min_ratio: f64) {
    spec.train.schedule = ScheduleSpec::Cosine(ir::spec::CosineSpec { min_ratio, ..Default::default() });
}

#[test]
fn every_problem_is_reported_at_once() {
    let mut spec = ModelSpec { vocab: 1, kv_heads: Some(3), ..ModelSpec::default() };
    spec.residual = ResidualSpec::Xhc(xhc(4, 5, 2));
    spec.train.optimizer = adamw(|a| a.lr = 0.0);
    spec.train.val_fraction = 0.0;
    let paths: Vec<String> = errors(&spec).into_iter().map(|e| e.path).collect();
    assert_eq!(
        paths,
        ["vocab", "kv_heads", "residual.k", "train.optimizer.lr", "train.val_fraction"],
        "every broken rule, in field order"
    );
}

#[test]
fn warmup_is_checked_for_every_schedule() {
    for schedule in [
        ScheduleSpec::Constant(Default::default()),
        ScheduleSpec::Cosine(Default::default()),
        ScheduleSpec::Wsd(Default::default()),
    ] {
        let mut spec = ModelSpec::default();
        spec.train.schedule = schedule;
        let steps = spec.train.steps;
        set_warmup(&mut spec, steps + 5);
        assert_error(&spec, "train.schedule.warmup", &["must be < train.steps"]);
    }
}
