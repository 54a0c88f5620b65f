//! Points: the base spec with the axes' values set, validated, budgeted and named.
//!
//! **Setting a field path.** The base [`ModelSpec`] is serialized to a tree that keeps
//! every value exactly and names every enum variant (`tree`: JSON would turn NaN and
//! infinities into `null`, so `clip: Some(NaN)` would read back as `None`), and the
//! path is followed through it; a step passes through the variant a field holds to
//! that variant's fields: `residual.n` reaches GHC's `n`, `train.optimizer.lr` AdamW's
//! `lr`. The value, RON text, is typed against exactly that field by reading a
//! one-field spec through [`ir::spec::parse_spec`] (`(residual: Ghc(n: 8))`), so every
//! field takes the RON a spec file would hold, enum variants included; the typed leaf
//! replaces the base's, and the whole tree is written as RON and read by
//! [`ir::spec::parse_spec`] again, as a spec file with those values would be. A path
//! that is not in the base is an error naming the path and the fields that exist
//! there; a value of the wrong type, an error naming the path, the value and what the
//! field takes (its variants, or the type and range of a number).
//!
//! **The derived axis `residual.r`** sets GHC's virtual width factor r = n/m
//! (docs/math.md §5.1) by setting n = r·m with the point's m; r·m must be a whole
//! number (r = 1.5 needs an even m). It is applied after every other axis, so it sees
//! a swept `residual.m`.
//!
//! **Point names** are folder names: for each axis in the sweep's order,
//! `path-value`, joined by `_`. The path is kept as written (field names are
//! `[a-z0-9_]`); the value's RON text is reduced to `[A-Za-z0-9.+-]` (each run of
//! other characters becomes one `+`, and a leading or trailing `+` is dropped): `residual.n=8, residual.k=4` gives `residual.n-8_residual.k-4`, and
//! `Ghc(m: 4, n: 8)` gives `Ghc+m+4+n+8`. A sweep without axes has the one point
//! `base`. A plain-residual twin is `baseline` followed by `_path-value` for each axis
//! that is not under `residual`. Names longer than 120 characters keep 100 and add
//! `~` and 16 hex digits of the full name's SHA-256, so they stay unique and stable.
//! Two points with one name (equal values, or values equal after the reduction) make
//! the sweep an error, and so do two points with one spec (`d_model` values `32` and
//! `0x20`). Each (point, seed) run lives in `<point>/seed-<seed>`.
//!
//! **Fairness.** The seed sets `train.seed`, which fixes the data order, so every
//! point trained with the same seed sees the same batches in the same order.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;

use ir::cost::cost_report;
use ir::lower::LowerError;
use ir::spec::limits::integer_limit;
use ir::spec::{host_memory_bytes, parse_spec, FieldError, ModelSpec, ResidualSpec, SpecLoadError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use runtime::standalone::{set_steps, WarmupRescale};

use crate::budget::{plan_with, Budget, BudgetError, BudgetPlan};
use crate::file::{Combine, OnInvalid, Sweep, SweepError, MAX_RUNS};

mod tree;

use tree::{leaf_shape, to_node, Node, Shape};

/// The derived axis: GHC's r = n/m.
pub const RATIO_AXIS: &str = "residual.r";

/// One point of a sweep: a valid spec and the runs (one per seed) that train it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Folder name (see the module doc for the rule).
    pub name: String,
    /// (axis path, value as RON text), in the sweep's axis order. A baseline twin
    /// lists only the axes outside `residual`.
    pub values: Vec<(String, String)>,
    /// The point's spec with the first seed and the budget's steps.
    pub spec: ModelSpec,
    /// What each run of this point trains.
    pub budget: BudgetPlan,
    /// The plain-residual point this one's overhead is measured against: its own name
    /// when it is plain residual, `None` when the sweep asks for no baseline.
    pub baseline: Option<String>,
    /// Whether the sweep added this point as another point's plain-residual twin.
    pub is_baseline_twin: bool,
    /// One run per seed.
    pub runs: Vec<Run>,
}

/// One (point, seed) run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub seed: u64,
    /// `<point>/seed-<seed>`, relative to the sweep folder.
    pub dir: PathBuf,
    /// The point's spec with `train.seed = seed`.
    pub spec: ModelSpec,
}

/// A point that could not be built or that the validator rejects.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidPoint {
    pub name: String,
    pub values: Vec<(String, String)>,
    pub error: PointError,
}

impl fmt::Display for InvalidPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "point `{}`: {}", self.name, self.error)
    }
}

/// Why a point is not runnable. Every variant names the field path.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PointError {
    /// A path step names a field the spec does not have there.
    #[error(
        "`{path}`: {} has no field `{field}`{}; its fields are {}",
        at_name(.at),
        hint(.path),
        fields.join(", ")
    )]
    UnknownField { path: String, at: String, field: String, fields: Vec<String> },
    /// A path continues past a value that has no fields (a number, a unit variant, `None`, a list).
    #[error("`{path}`: {} is {found}, which has no fields; set `{at}` itself", at_name(.at))]
    NoFields { path: String, at: String, found: String },
    /// The value does not read as the field's type: `message` says what is valid there.
    #[error("`{path}` = {value}: {message}")]
    Value { path: String, value: String, message: String },
    /// The derived `residual.r` cannot be applied.
    #[error("`{path}` = {value}: {message}")]
    Derived { path: String, value: String, message: String },
    /// The values combine into a spec the validator rejects.
    #[error("invalid spec: {}", errors.iter().map(|e| e.message.as_str()).collect::<Vec<_>>().join("; "))]
    Invalid { errors: Vec<FieldError> },
    /// The budget cannot be planned for this point.
    #[error("budget: {0}")]
    Budget(BudgetError),
}

/// ` (did you mean `train.optimizer.lr`?)` for a path the spec does not have there
/// ([`ir::spec::path_hint`]: the paths with the same last name, or the variants that
/// have this one), or nothing.
fn hint(path: &str) -> String {
    match ir::spec::path_hint(path) {
        h if h.is_empty() => h,
        h => format!(" ({h})"),
    }
}

fn at_name(at: &str) -> String {
    if at.is_empty() {
        "the spec".into()
    } else {
        format!("`{at}`")
    }
}

/// The expanded sweep: every runnable point and every rejected one.
#[derive(Debug, Clone, PartialEq)]
pub struct Expansion {
    /// Runnable points: the swept ones in order, then the baseline twins.
    pub points: Vec<Point>,
    /// Points that were skipped (`on_invalid: Skip`); empty under `Refuse`, which fails instead.
    pub invalid: Vec<InvalidPoint>,
    /// Points whose budget gives fewer steps than their spec's warmup, which was
    /// scaled to its fraction of the spec's steps by the rule `widen train --steps`
    /// follows ([`runtime::standalone::set_steps`]): (point, how).
    pub warmup_scaled: Vec<(String, WarmupRescale)>,
}

impl Expansion {
    /// One note for every point whose warmup the budget scaled (said once, not per
    /// point), or `None` when no warmup was.
    pub fn warmup_note(&self) -> Option<String> {
        warmup_note(&self.warmup_scaled, self.points.len())
    }

    /// Every run of every point, in point order.
    pub fn runs(&self) -> impl Iterator<Item = (&Point, &Run)> {
        self.points.iter().flat_map(|p| p.runs.iter().map(move |r| (p, r)))
    }
}

/// Errors expanding a sweep.
#[derive(Debug, thiserror::Error)]
pub enum ExpandError {
    /// The sweep itself breaks a rule ([`Sweep::check`]).
    #[error(transparent)]
    Sweep(#[from] SweepError),
    /// Some points are invalid and the sweep says `on_invalid: Refuse`.
    #[error("{} of {total} points are invalid and on_invalid is Refuse (use Skip to run the rest):{}", invalid.len(), list(.invalid))]
    Refused { total: usize, invalid: Vec<InvalidPoint> },
    /// Every point is invalid.
    #[error("no point of the sweep is valid:{}", list(.invalid))]
    NothingValid { invalid: Vec<InvalidPoint> },
    /// Two points have the same folder name.
    #[error("two points are both named `{name}` ({first} and {second}); give each axis distinct values")]
    DuplicateName { name: String, first: String, second: String },
    /// Two points train the same spec: their values differ only in spelling (`32` and
    /// `0x20`), or a later value overrides an earlier one.
    #[error(
        "points `{first}` ({first_values}) and `{second}` ({second_values}) train the same spec; \
         give each axis values that make different models"
    )]
    DuplicatePoint { first: String, first_values: String, second: String, second_values: String },
    /// The baseline twins take the runs past the limit.
    #[error(
        "the sweep has {runs} runs with its baseline twins ({points} points x {seeds} seeds); at most \
         {MAX_RUNS} are allowed (docs/sweeps.md, Limits): use fewer axis values or seeds"
    )]
    TooManyRuns { runs: usize, points: usize, seeds: usize },
}

/// The note for the points whose warmup a budget scaled: one line whatever their
/// number, each distinct change once.
fn warmup_note(scaled: &[(String, WarmupRescale)], points: usize) -> Option<String> {
    let mut seen: Vec<WarmupRescale> = Vec::new();
    for (_, w) in scaled {
        if !seen.contains(w) {
            seen.push(*w);
        }
    }
    let first = seen.first()?;
    let changes = if seen.len() == 1 {
        format!(
            "the budget's {} steps are shorter than the spec's warmup of {}; warmup scaled to {} \
             (its fraction of the spec's {} steps)",
            first.steps, first.from, first.to, first.planned
        )
    } else {
        let each: Vec<String> = seen
            .iter()
            .map(|w| format!("{} -> {} at {} of {} steps", w.from, w.to, w.steps, w.planned))
            .collect();
        format!(
            "the budget gives fewer steps than the spec's warmup; warmup scaled to its fraction of \
             the spec's steps ({})",
            each.join(", ")
        )
    };
    let n = scaled.len();
    Some(format!(
        "{changes}, in {n} of {points} point{}, as `widen train --steps` does",
        if points == 1 { "" } else { "s" }
    ))
}

/// The invalid points, one line per distinct error: an error every point shares (a
/// mistyped path) is said once, naming how many points it applies to.
fn list(invalid: &[InvalidPoint]) -> String {
    let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
    for p in invalid {
        let error = p.error.to_string();
        match groups.iter_mut().find(|(e, _)| *e == error) {
            Some((_, names)) => names.push(&p.name),
            None => groups.push((error, vec![&p.name])),
        }
    }
    groups
        .iter()
        .map(|(error, names)| match names.as_slice() {
            [one] => format!("\n  - point `{one}`: {error}"),
            more => {
                const SHOWN: usize = 3;
                let mut shown: Vec<String> = more.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
                if more.len() > SHOWN {
                    shown.push(format!("{} more", more.len() - SHOWN));
                }
                format!("\n  - {} points ({}): {error}", more.len(), shown.join(", "))
            }
        })
        .collect()
}

/// Expands a sweep into points and runs: combines the axes, sets each point's values,
/// validates it, plans its budget, adds the baseline twins when asked, and names
/// every point and run. Invalid points are skipped or refuse the sweep, as
/// `on_invalid` says; a sweep with no valid point is always an error, and so are two
/// points with one name or one spec. Each point must fit this machine's memory, as
/// `widen check` requires ([`expand_within`]).
pub fn expand(sweep: &Sweep) -> Result<Expansion, ExpandError> {
    expand_within(sweep, host_memory_bytes())
}

/// [`expand`] with each point's training-memory estimate checked against
/// `memory_bytes` ([`ModelSpec::check_fits`]) before the cost model lowers it (the
/// lowering allocates some parameter inits, so a spec far too large for the machine
/// must not reach it); `None` skips that check, as `widen check` does where the
/// memory cannot be read.
pub fn expand_within(sweep: &Sweep, memory_bytes: Option<u64>) -> Result<Expansion, ExpandError> {
    // The checks bound the number of points and runs before any is built.
    sweep.check()?;
    let mut applier = Applier::new(&sweep.base);
    let mut points: Vec<Point> = Vec::new();
    let mut invalid: Vec<InvalidPoint> = Vec::new();
    let mut warmup_scaled: Vec<(String, WarmupRescale)> = Vec::new();
    // Point name -> the values shown for it, and spec (as RON) -> point index.
    let mut names: HashMap<String, String> = HashMap::new();
    let mut specs: HashMap<String, usize> = HashMap::new();
    let mut claim = |name: &str, values: &[(String, String)]| -> Result<(), ExpandError> {
        let shown = show_values(values);
        if let Some(first) = names.get(name) {
            return Err(ExpandError::DuplicateName {
                name: name.to_string(),
                first: first.clone(),
                second: shown,
            });
        }
        names.insert(name.to_string(), shown);
        Ok(())
    };
    // Every point is compared with the seed every run overrides set alike.
    let spec_key = |spec: &ModelSpec| {
        let mut spec = spec.clone();
        spec.train.seed = sweep.seeds[0];
        to_node(&spec).map(|n| n.to_ron()).unwrap_or_default()
    };

    for values in combinations(sweep) {
        let name = point_name(&values);
        claim(&name, &values)?;
        match build_point(&mut applier, &values, &sweep.budget, memory_bytes) {
            Ok((spec, budget, scaled)) => {
                if let Some(w) = scaled {
                    warmup_scaled.push((name.clone(), w));
                }
                let key = spec_key(&spec);
                if let Some(&i) = specs.get(&key) {
                    let first: &Point = &points[i];
                    return Err(ExpandError::DuplicatePoint {
                        first: first.name.clone(),
                        first_values: show_values(&first.values),
                        second: name,
                        second_values: show_values(&values),
                    });
                }
                specs.insert(key, points.len());
                points.push(Point {
                    name,
                    values,
                    spec,
                    budget,
                    baseline: None,
                    is_baseline_twin: false,
                    runs: Vec::new(),
                })
            }
            Err(error) => invalid.push(InvalidPoint { name, values, error }),
        }
    }
    if sweep.baseline {
        let mut invalid_names: HashSet<String> = invalid.iter().map(|p| p.name.clone()).collect();
        let swept = points.len();
        for i in 0..swept {
            if points[i].spec.residual == ResidualSpec::Residual {
                points[i].baseline = Some(points[i].name.clone());
                continue;
            }
            let values: Vec<(String, String)> =
                points[i].values.iter().filter(|(p, _)| !is_residual_path(p)).cloned().collect();
            let mut twin = points[i].spec.with_plain_residual();
            let found = match plan_and_validate(&mut twin, &sweep.budget, memory_bytes) {
                Ok((budget, _)) => {
                    let key = spec_key(&twin);
                    match specs.get(&key) {
                        Some(&same) => Ok(points[same].name.clone()),
                        None => {
                            let name = twin_name(&values);
                            claim(&name, &values)?;
                            specs.insert(key, points.len());
                            points.push(Point {
                                name: name.clone(),
                                values,
                                spec: twin,
                                budget,
                                baseline: Some(name.clone()),
                                is_baseline_twin: true,
                                runs: Vec::new(),
                            });
                            Ok(name)
                        }
                    }
                }
                Err(error) => Err(InvalidPoint { name: twin_name(&values), values, error }),
            };
            match found {
                Ok(name) => points[i].baseline = Some(name),
                Err(bad) => {
                    if invalid_names.insert(bad.name.clone()) {
                        invalid.push(bad);
                    }
                }
            }
        }
    }

    if points.is_empty() {
        return Err(ExpandError::NothingValid { invalid });
    }
    let total = points.len() + invalid.len();
    if !invalid.is_empty() {
        match sweep.on_invalid {
            OnInvalid::Refuse => return Err(ExpandError::Refused { total, invalid }),
            OnInvalid::Skip => {}
        }
    }
    let seeds = sweep.seeds.len();
    // `Sweep::check` bounded points x seeds without the twins.
    let runs = points.len().saturating_mul(seeds);
    if runs > MAX_RUNS {
        return Err(ExpandError::TooManyRuns { runs, points: points.len(), seeds });
    }
    for p in &mut points {
        p.spec.train.seed = sweep.seeds[0];
        p.runs = sweep
            .seeds
            .iter()
            .map(|&seed| {
                let mut spec = p.spec.clone();
                spec.train.seed = seed;
                Run { seed, dir: PathBuf::from(&p.name).join(format!("seed-{seed}")), spec }
            })
            .collect();
    }
    warmup_scaled.retain(|(name, _)| points.iter().any(|p| p.name == *name));
    Ok(Expansion { points, invalid, warmup_scaled })
}

/// The points' (path, value) lists, in order: a product (first axis slowest) or a zip.
/// [`Sweep::check`] has bounded their number.
fn combinations(sweep: &Sweep) -> Vec<Vec<(String, String)>> {
    let axes = &sweep.axes;
    match sweep.combine {
        Combine::Product => {
            let mut out: Vec<Vec<(String, String)>> = vec![Vec::new()];
            for axis in axes {
                out = out
                    .into_iter()
                    .flat_map(|prefix| {
                        axis.values.iter().map(move |v| {
                            let mut next = prefix.clone();
                            next.push((axis.path.clone(), v.clone()));
                            next
                        })
                    })
                    .collect();
            }
            out
        }
        Combine::Zip => {
            let n = axes.first().map_or(1, |a| a.values.len());
            (0..n).map(|i| axes.iter().map(|a| (a.path.clone(), a.values[i].clone())).collect()).collect()
        }
    }
}

fn is_residual_path(path: &str) -> bool {
    path == "residual" || path.starts_with("residual.")
}

fn show_values(values: &[(String, String)]) -> String {
    if values.is_empty() {
        return "the base".into();
    }
    values.iter().map(|(p, v)| format!("{p} = {v}")).collect::<Vec<_>>().join(", ")
}

/// Sets the values on the base, then plans the budget and validates.
fn build_point(
    applier: &mut Applier,
    values: &[(String, String)],
    budget: &Budget,
    memory_bytes: Option<u64>,
) -> Result<(ModelSpec, BudgetPlan, Option<WarmupRescale>), PointError> {
    let mut spec = applier.apply(values)?;
    let (plan, scaled) = plan_and_validate(&mut spec, budget, memory_bytes)?;
    Ok((spec, plan, scaled))
}

/// Validates `spec` as `widen check` does (the validator, the memory check against
/// `memory_bytes`, the cost model's lowering), plans its budget and sets
/// `train.steps`, validating again with the final step count. A warmup longer than
/// the budget's steps keeps its fraction of the spec's steps, by the rule of `widen
/// train --steps` ([`runtime::standalone::set_steps`], docs/sweeps.md "Budgets"); how it
/// changed is returned.
fn plan_and_validate(
    spec: &mut ModelSpec,
    budget: &Budget,
    memory_bytes: Option<u64>,
) -> Result<(BudgetPlan, Option<WarmupRescale>), PointError> {
    let invalid = |errors| PointError::Invalid { errors };
    let mut scaled = None;
    // Token and step budgets fix the steps without the cost model, so the first
    // validation already sees them; a FLOP budget needs a valid spec to count.
    match budget {
        Budget::Tokens(_) | Budget::Steps(_) | Budget::Time(_) => {
            let pre =
                plan_with(budget, spec.train.batch, spec.train.seq_len, 0).map_err(PointError::Budget)?;
            scaled = set_steps(spec, pre.steps);
        }
        Budget::Flops(_) => {}
    }
    spec.validate().map_err(invalid)?;
    if let Some(bytes) = memory_bytes {
        spec.check_fits(bytes).map_err(|e| invalid(vec![e]))?;
    }
    let report = cost_report(spec).map_err(|e| match e {
        LowerError::Invalid(errors) => PointError::Invalid { errors },
        other => PointError::Budget(BudgetError::Cost(other.to_string())),
    })?;
    let plan = plan_with(budget, spec.train.batch, spec.train.seq_len, report.flops_per_token.train)
        .map_err(PointError::Budget)?;
    scaled = set_steps(spec, plan.steps).or(scaled);
    spec.validate().map_err(invalid)?;
    Ok((plan, scaled))
}

/// One `--set PATH=VALUE` of `widen train` or `widen check`: a sweep axis
/// (`Axis`'s syntax, so the paths and RON values are exactly a sweep's) with one value.
pub fn parse_set(arg: &str) -> Result<(String, String), SweepError> {
    let axis: crate::file::Axis = arg.parse()?;
    match <[String; 1]>::try_from(axis.values) {
        Ok([value]) => Ok((axis.path, value)),
        Err(values) => Err(SweepError::BadSet {
            arg: arg.to_string(),
            reason: format!(
                "{} values; a run takes one value per field (`widen sweep --set` trains one point per value)",
                values.len()
            ),
        }),
    }
}

/// `base` with every `--set` value set ([`apply`], as a sweep point's) and then
/// validated as a spec file holding those values would be.
pub fn apply_sets(base: &ModelSpec, sets: &[(String, String)]) -> Result<ModelSpec, PointError> {
    let spec = apply(base, sets)?;
    spec.validate().map_err(|errors| PointError::Invalid { errors })?;
    Ok(spec)
}

/// Sets every (path, value) on `base` in order, the derived `residual.r` last. Does not validate.
pub fn apply(base: &ModelSpec, values: &[(String, String)]) -> Result<ModelSpec, PointError> {
    Applier::new(base).apply(values)
}

/// Sets field paths on one base spec, reading each distinct value once.
struct Applier {
    /// The base as a tree; `None` if it could not be serialized (a message says so).
    base: Result<Node, String>,
    /// Leaves already typed, by the one-field spec text that typed them.
    typed: HashMap<String, Result<Node, PointError>>,
}

impl Applier {
    fn new(base: &ModelSpec) -> Applier {
        Applier { base: to_node(base).map_err(|e| e.to_string()), typed: HashMap::new() }
    }

    fn apply(&mut self, values: &[(String, String)]) -> Result<ModelSpec, PointError> {
        let all = |message: String| PointError::Value {
            path: values.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>().join(", "),
            value: show_values(values),
            message,
        };
        let mut tree = self.base.clone().map_err(all)?;
        for (path, value) in values.iter().filter(|(p, _)| p != RATIO_AXIS) {
            self.set_path(&mut tree, path, value)?;
        }
        // The tree holds only values the spec's types gave, so this reads back; it is
        // the spec parser's reading, as of a spec file with these values.
        let mut spec = parse_spec(&tree.to_ron(), "the point's spec")
            .map_err(|e| all(format!("the values do not combine into a spec: {e}")))?;
        for (path, value) in values.iter().filter(|(p, _)| p == RATIO_AXIS) {
            set_ratio(&mut spec, path, value)?;
        }
        Ok(spec)
    }

    /// Sets `path` in `tree` to `value`, RON text typed against that field by reading
    /// the one-field spec that sets it (`(residual: Ghc(n: 8))`) as a spec file.
    fn set_path(&mut self, tree: &mut Node, path: &str, value: &str) -> Result<(), PointError> {
        let segs: Vec<&str> = path.split('.').collect();
        let mut open = String::new();
        let mut close = String::new();
        let mut cur: &Node = tree;
        for (i, seg) in segs.iter().enumerate() {
            let at = segs[..i].join(".");
            let (tag, fields) = cur.fields().ok_or_else(|| PointError::NoFields {
                path: path.into(),
                at: at.clone(),
                found: describe(cur),
            })?;
            if let Some(tag) = tag {
                open.push_str(tag);
            }
            open.push('(');
            close.insert(0, ')');
            cur = fields.iter().find(|(n, _)| n == seg).map(|(_, v)| v).ok_or_else(|| {
                PointError::UnknownField {
                    path: path.into(),
                    at,
                    field: seg.to_string(),
                    fields: fields.iter().map(|(n, _)| n.to_string()).collect(),
                }
            })?;
            open.push_str(seg);
            open.push_str(": ");
        }
        let one_field = format!("{open}{value}{close}");
        let leaf = match self.typed.get(&one_field) {
            Some(known) => known.clone(),
            None => {
                let typed = type_value(tree, &segs, path, value, &one_field);
                self.typed.insert(one_field, typed.clone());
                typed
            }
        }?;
        // The walk above found this path in `tree`.
        if let Some(slot) = tree.at_mut(&segs) {
            *slot = leaf;
        }
        Ok(())
    }
}

/// The value of the field at `segs` in the one-field spec `one_field`.
fn type_value(
    tree: &Node,
    segs: &[&str],
    path: &str,
    value: &str,
    one_field: &str,
) -> Result<Node, PointError> {
    let value_err = |message: String| PointError::Value { path: path.into(), value: value.into(), message };
    let typed = parse_spec(one_field, path).map_err(|e| value_err(value_message(tree, path, value, e)))?;
    let typed = to_node(&typed).map_err(|e| value_err(e.to_string()))?;
    typed.at(segs).cloned().ok_or_else(|| value_err("the value sets no field".into()))
}

/// What is wrong with a value that does not read as its field's type: the spec
/// reader's unknown-name messages (they list the valid names), or what the field
/// (or the field inside the value that went wrong) accepts.
fn value_message(tree: &Node, path: &str, value: &str, e: SpecLoadError) -> String {
    match e {
        SpecLoadError::UnknownNames { names, .. } => {
            names.iter().map(|n| n.message.clone()).collect::<Vec<_>>().join("; ")
        }
        SpecLoadError::Syntax { message, .. } => {
            // The reader names the field whose value it could not read as `in `F`: ...`.
            let inner = message
                .strip_prefix("in `")
                .and_then(|rest| rest.split_once('`'))
                .map(|(field, _)| field.split('[').next().unwrap_or(field).to_string())
                .filter(|f| f.starts_with(&format!("{path}.")));
            let field = inner.as_deref().unwrap_or(path);
            let segs: Vec<&str> = field.split('.').collect();
            let hints = variant_hints(value);
            match leaf_shape::<ModelSpec>(&segs, Some(tree), &hints) {
                Some(shape) if inner.is_some() => {
                    format!("in `{field}`: expected {}", describe_shape(&shape, field))
                }
                Some(shape) => format!("expected {}", describe_shape(&shape, field)),
                None => message,
            }
        }
        other @ (SpecLoadError::Io { .. } | SpecLoadError::Invalid { .. }) => other.to_string(),
    }
}

/// Capitalized identifiers in a value: the enum variants it names, which a path into
/// the value passes through.
fn variant_hints(value: &str) -> Vec<&str> {
    value
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with(|c: char| c.is_ascii_uppercase()))
        .collect()
}

/// What a field of this shape accepts, in words; integer fields quote their range
/// from the spec's limits ([`ir::spec::limits`]).
fn describe_shape(shape: &Shape, path: &str) -> String {
    match shape {
        Shape::Bool => "`true` or `false`".into(),
        Shape::Int { min, max } => match integer_limit(path) {
            Some(limit) => limit.describe(),
            None if *max == i128::from(u64::MAX) && *min == 0 => "a whole number >= 0".into(),
            None => format!("a whole number in {min}..={max}"),
        },
        Shape::Float => "a number (64-bit floating point, such as 0.5 or 3e-4)".into(),
        Shape::Char => "a character in single quotes".into(),
        Shape::Str => "a string in double quotes, such as \"text\"".into(),
        Shape::Unit => "`()`".into(),
        Shape::Option(inner) => format!("{}, or None", describe_shape(inner, path)),
        Shape::Seq(inner) => format!("a list [..] whose items are each {}", describe_shape(inner, path)),
        Shape::Tuple(n, inner) => format!("a tuple of {n} values (..), each {}", describe_shape(inner, path)),
        Shape::Map => "a map {key: value, ..}".into(),
        Shape::Struct(fields) => format!("a struct (field: value, ..) with the fields {}", fields.join(", ")),
        Shape::Enum(variants) => format!("one of the variants {}", variants.join(", ")),
        Shape::Any => "a RON value".into(),
    }
}

/// How a value without fields reads in a message.
fn describe(v: &Node) -> String {
    match v {
        Node::Seq(_) | Node::Tuple(_) | Node::Bytes(_) => "a list or tuple".into(),
        Node::Map(_) => "a map".into(),
        Node::Str(s) => format!("`{s:?}`"),
        Node::NewtypeVariant(tag, _) | Node::TupleVariant(tag, _) => format!("`{tag}(..)`"),
        other => {
            let text = other.to_ron();
            if text.chars().count() > 60 {
                format!("`{}..`", text.chars().take(60).collect::<String>())
            } else {
                format!("`{text}`")
            }
        }
    }
}

/// The derived axis: n = r·m for GHC.
fn set_ratio(spec: &mut ModelSpec, path: &str, value: &str) -> Result<(), PointError> {
    let err = |message: String| PointError::Derived { path: path.into(), value: value.into(), message };
    let r: f64 = ron_raw::from_str(value)
        .map_err(|_| err("r must be a number > 0 that makes n = r·m whole, e.g. 1.5 or 4".into()))?;
    let ResidualSpec::Ghc(g) = &mut spec.residual else {
        return Err(err(format!(
            "r = n/m is defined for `residual: Ghc(..)`, but residual is {}",
            spec.residual.kind_name()
        )));
    };
    let n = r * g.m as f64;
    if !(r.is_finite() && r > 0.0 && (n - n.round()).abs() < 1e-9 && n.round() >= 1.0) {
        return Err(err(format!(
            "n = r·m = {r}·{} = {n} must be a whole number >= 1; choose r so that r·m is whole",
            g.m
        )));
    }
    // The stream limit bounds n before the cast, so a huge r is refused, not saturated.
    if let Some(limit) = integer_limit("residual.n") {
        if n.round() > limit.max as f64 {
            return Err(err(format!(
                "n = r·m = {r}·{} = {n} must be {} (residual.n's limit: {})",
                g.m,
                limit.describe(),
                limit.why
            )));
        }
    }
    g.n = n.round() as usize;
    Ok(())
}

/// A point's folder name from its values (see the module doc).
pub fn point_name(values: &[(String, String)]) -> String {
    if values.is_empty() {
        return "base".into();
    }
    cap(values
        .iter()
        .map(|(p, v)| format!("{}-{}", clean(p, true), clean(v, false)))
        .collect::<Vec<_>>()
        .join("_"))
}

/// The plain-residual twin's name: `baseline` and the axes outside `residual`.
fn twin_name(values: &[(String, String)]) -> String {
    cap(std::iter::once("baseline".to_string())
        .chain(values.iter().map(|(p, v)| format!("{}-{}", clean(p, true), clean(v, false))))
        .collect::<Vec<_>>()
        .join("_"))
}

/// Keeps `[A-Za-z0-9.+-]` (and `_` in paths); each run of other characters becomes
/// one `+`; no `+` at the ends.
fn clean(s: &str, path: bool) -> String {
    let mut out = String::new();
    let mut pending = false;
    for c in s.chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '+' | '-') || (path && c == '_') {
            if pending && !out.is_empty() {
                out.push('+');
            }
            pending = false;
            out.push(c);
        } else {
            pending = true;
        }
    }
    out
}

/// Long names keep 100 characters and a hash of the whole, so they stay unique.
fn cap(name: String) -> String {
    const MAX: usize = 120;
    if name.len() <= MAX {
        return name;
    }
    let digest = Sha256::digest(name.as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{}~{hex}", &name[..100])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::Axis;
    use ir::spec::{GhcSpec, OptimizerSpec, ReduceNorm, XhcSpec};

    fn v(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(p, v)| (p.to_string(), v.to_string())).collect()
    }

    fn ghc_base() -> ModelSpec {
        let mut s = ModelSpec {
            d_model: 32,
            residual: ResidualSpec::Ghc(GhcSpec { m: 2, n: 4, ..GhcSpec::default() }),
            ..ModelSpec::default()
        };
        s.train.batch = 2;
        s.train.seq_len = 16;
        s.train.schedule = ir::spec::ScheduleSpec::Constant(Default::default());
        s
    }

    fn sweep(axes: &[(&str, &[&str])], budget: Budget) -> Sweep {
        Sweep {
            base: ghc_base(),
            base_source: "test".into(),
            axes: axes
                .iter()
                .map(|(p, vs)| Axis {
                    path: p.to_string(),
                    values: vs.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
            combine: Combine::Product,
            seeds: vec![0],
            budget,
            baseline: false,
            on_invalid: OnInvalid::Refuse,
        }
    }

    fn ghc(s: &ModelSpec) -> &GhcSpec {
        match &s.residual {
            ResidualSpec::Ghc(g) => g,
            other => panic!("expected Ghc, got {other:?}"),
        }
    }

    #[test]
    fn paths_reach_variant_fields_and_plain_fields() {
        let s = apply(
            &ghc_base(),
            &v(&[
                ("residual.n", "8"),
                ("d_model", "64"),
                ("train.optimizer.lr", "1e-3"),
                ("mtp.depth", "2"),
                ("kv_heads", "2"),
                ("residual.reduce_norm", "Off"),
            ]),
        )
        .unwrap();
        assert_eq!(ghc(&s).n, 8);
        assert_eq!(ghc(&s).m, 2, "other variant fields are kept");
        assert_eq!(ghc(&s).reduce_norm, Some(ReduceNorm::Off), "Option<enum> takes the RON variant name");
        assert_eq!(s.d_model, 64);
        assert_eq!(s.mtp.depth, 2);
        assert_eq!(s.kv_heads, Some(2), "implicit Some, as in spec files");
        let OptimizerSpec::AdamW(adam) = &s.train.optimizer else { panic!() };
        assert_eq!(adam.lr, 1e-3);
        assert_eq!(adam.betas, (0.9, 0.95), "the rest of the optimizer is kept");
    }

    #[test]
    fn whole_enum_values_switch_variants_and_later_paths_follow() {
        let s = apply(&ghc_base(), &v(&[("residual", "Xhc(n: 8, k: 2)"), ("residual.fixed", "1")])).unwrap();
        let ResidualSpec::Xhc(x) = &s.residual else { panic!("{:?}", s.residual) };
        assert_eq!((x.n, x.k, x.fixed), (8, 2, 1));
        assert_eq!(x.conv_kernels, XhcSpec::default().conv_kernels);
        let s = apply(&ghc_base(), &v(&[("residual", "Residual")])).unwrap();
        assert_eq!(s.residual, ResidualSpec::Residual);
        let s = apply(&ghc_base(), &v(&[("train.data", "Text(\"a.txt\")"), ("name", "\"x\"")])).unwrap();
        assert_eq!(s.train.data, ir::spec::DataSpec::Text("a.txt".into()));
        assert_eq!(s.name, "x");
    }

    #[test]
    fn unknown_paths_name_the_path_and_the_fields_there() {
        let e = apply(&ghc_base(), &v(&[("residual.k", "4")])).unwrap_err();
        let PointError::UnknownField { path, at, field, fields } = &e else { panic!("{e:?}") };
        assert_eq!((path.as_str(), at.as_str(), field.as_str()), ("residual.k", "residual", "k"));
        assert!(fields.contains(&"m".to_string()) && fields.contains(&"n".to_string()), "{fields:?}");
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "`residual.k`: `residual` has no field `k` (`residual.k` is a field of `Xhc`, not of the \
                 variant written there); its fields are "
            ),
            "{msg}"
        );

        let e = apply(&ghc_base(), &v(&[("d_modle", "4")])).unwrap_err().to_string();
        assert!(e.contains("the spec has no field `d_modle`") && e.contains("d_model"), "{e}");

        let plain = ModelSpec::default();
        let e = apply(&plain, &v(&[("residual.n", "4")])).unwrap_err().to_string();
        assert_eq!(e, "`residual.n`: `residual` is `Residual`, which has no fields; set `residual` itself");
        let e = apply(&plain, &v(&[("d_model.x", "4")])).unwrap_err().to_string();
        assert!(e.contains("`d_model` is `64`, which has no fields"), "{e}");
        let e = apply(&plain, &v(&[("train.optimizer.betas.0", "0.8")])).unwrap_err().to_string();
        assert!(e.contains("is a list or tuple"), "{e}");
    }

    #[test]
    fn values_of_the_wrong_type_name_the_field() {
        let e = apply(&ghc_base(), &v(&[("residual.n", "\"eight\"")])).unwrap_err();
        assert!(matches!(&e, PointError::Value { path, .. } if path == "residual.n"), "{e:?}");
        assert!(e.to_string().starts_with("`residual.n` = \"eight\": "), "{e}");
        let e = apply(&ghc_base(), &v(&[("residual", "Ghc(mm: 2)")])).unwrap_err().to_string();
        assert!(e.contains("mm"), "{e}");
    }

    #[test]
    fn derived_ratio_sets_n_from_m() {
        let s = apply(&ghc_base(), &v(&[("residual.r", "1.5")])).unwrap();
        assert_eq!((ghc(&s).m, ghc(&s).n), (2, 3));
        // r is applied after residual.m, whatever the axis order.
        let s = apply(&ghc_base(), &v(&[("residual.r", "4"), ("residual.m", "4")])).unwrap();
        assert_eq!((ghc(&s).m, ghc(&s).n), (4, 16));
        let e = apply(&ghc_base(), &v(&[("residual.r", "1.25")])).unwrap_err().to_string();
        assert!(e.contains("n = r·m = 1.25·2 = 2.5 must be a whole number"), "{e}");
        let e = apply(&ModelSpec::default(), &v(&[("residual.r", "2")])).unwrap_err().to_string();
        assert!(e.contains("defined for `residual: Ghc(..)`, but residual is Residual"), "{e}");
        let e = apply(&ghc_base(), &v(&[("residual.r", "-1")])).unwrap_err().to_string();
        assert!(e.contains("whole number >= 1"), "{e}");
    }

    #[test]
    fn names_follow_the_documented_rule() {
        assert_eq!(point_name(&v(&[("residual.n", "8"), ("residual.k", "4")])), "residual.n-8_residual.k-4");
        assert_eq!(point_name(&v(&[("residual", "Ghc(m: 4, n: 8)")])), "residual-Ghc+m+4+n+8");
        assert_eq!(point_name(&v(&[("train.optimizer.lr", "1e-3")])), "train.optimizer.lr-1e-3");
        assert_eq!(point_name(&v(&[("name", "\"../x y\"")])), "name-..+x+y");
        assert_eq!(point_name(&[]), "base");
        let long = point_name(&v(&[("conv", &"[4, 8, 12, ".repeat(30)), ("x", "1")]));
        assert!(long.len() <= 120 && long.contains('~'), "{long}");
        let other = point_name(&v(&[("conv", &"[4, 8, 12, ".repeat(30)), ("x", "2")]));
        assert_ne!(long, other, "the hash keeps capped names distinct");
        for name in [long, other] {
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || "._+-~".contains(c)), "{name}");
        }
    }

    #[test]
    fn product_zip_seeds_and_run_folders() {
        let mut s = sweep(&[("residual.n", &["4", "8"]), ("mtp.depth", &["0", "1"])], Budget::Steps(30));
        s.seeds = vec![3, 5];
        let plan = expand(&s).unwrap();
        let names: Vec<&str> = plan.points.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "residual.n-4_mtp.depth-0",
                "residual.n-4_mtp.depth-1",
                "residual.n-8_mtp.depth-0",
                "residual.n-8_mtp.depth-1"
            ]
        );
        let runs: Vec<(String, u64, u64, usize)> = plan
            .runs()
            .map(|(_, r)| (r.dir.display().to_string(), r.seed, r.spec.train.seed, r.spec.train.steps))
            .collect();
        assert_eq!(runs.len(), 8);
        assert_eq!(runs[0], ("residual.n-4_mtp.depth-0/seed-3".to_string(), 3, 3, 30));
        assert_eq!(runs[1], ("residual.n-4_mtp.depth-0/seed-5".to_string(), 5, 5, 30));
        // Same seed, same data order: runs differ only in the swept fields.
        let (a, b) = (&plan.points[0].runs[0].spec, &plan.points[3].runs[0].spec);
        assert_eq!(a.train, b.train);

        s.combine = Combine::Zip;
        let plan = expand(&s).unwrap();
        let names: Vec<&str> = plan.points.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["residual.n-4_mtp.depth-0", "residual.n-8_mtp.depth-1"]);
    }

    #[test]
    fn invalid_points_are_skipped_or_refuse_the_sweep() {
        // n = 1 < m = 2 breaks the GHC rule n >= m.
        let mut s = sweep(&[("residual.n", &["4", "1", "8"])], Budget::Steps(30));
        let err = expand(&s).unwrap_err();
        let ExpandError::Refused { total, invalid } = &err else { panic!("{err:?}") };
        assert_eq!((*total, invalid.len()), (3, 1));
        assert_eq!(invalid[0].name, "residual.n-1");
        let PointError::Invalid { errors } = &invalid[0].error else { panic!("{:?}", invalid[0].error) };
        assert!(errors.iter().any(|e| e.path.starts_with("residual")), "{errors:?}");
        let msg = err.to_string();
        assert!(msg.contains("1 of 3 points are invalid") && msg.contains("point `residual.n-1`"), "{msg}");

        s.on_invalid = OnInvalid::Skip;
        let plan = expand(&s).unwrap();
        assert_eq!(
            plan.points.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["residual.n-4", "residual.n-8"]
        );
        assert_eq!(plan.invalid.len(), 1);

        // A typo makes every point invalid: an error even under Skip.
        let mut s = sweep(&[("residual.nn", &["4", "8"])], Budget::Steps(30));
        s.on_invalid = OnInvalid::Skip;
        let err = expand(&s).unwrap_err();
        assert!(matches!(err, ExpandError::NothingValid { .. }), "{err:?}");
        assert!(err.to_string().contains("has no field `nn`"), "{err}");
    }

    /// A path that names a field elsewhere in the spec gets that path suggested, and
    /// an error every point shares is said once, with how many points it applies to.
    #[test]
    fn a_misplaced_path_is_suggested_and_said_once_for_every_point() {
        let s = sweep(&[("train.lr", &["1e-3", "2e-3", "3e-3", "4e-3"])], Budget::Steps(30));
        let err = expand(&s).unwrap_err().to_string();
        assert!(err.contains("has no field `lr` (did you mean `train.optimizer.lr`"), "{err}");
        assert_eq!(err.matches("has no field `lr`").count(), 1, "{err}");
        assert!(
            err.contains("4 points (`train.lr-1e-3`, `train.lr-2e-3`, `train.lr-3e-3`, 1 more)"),
            "{err}"
        );
        // Different errors stay apart, one line each.
        let s = sweep(&[("residual.n", &["4", "eight", "nine"])], Budget::Steps(30));
        let err = expand(&s).unwrap_err().to_string();
        assert_eq!(err.lines().filter(|l| l.starts_with("  - ")).count(), 2, "{err}");
    }

    /// `Vwn` is what the VWN paper calls the scheme widen names `Ghc`.
    #[test]
    fn a_vwn_value_points_at_ghc() {
        let err = apply(&ghc_base(), &v(&[("residual", "Vwn(m: 2, n: 4)")])).unwrap_err().to_string();
        assert!(err.contains("did you mean `Ghc`?"), "{err}");
    }

    #[test]
    fn the_budget_sets_steps_and_a_short_budget_is_validated() {
        // 32 tokens per step: 3200 tokens = 100 steps.
        let plan = expand(&sweep(&[("residual.n", &["4"])], Budget::Tokens(3200))).unwrap();
        assert_eq!(plan.points[0].spec.train.steps, 100);
        assert_eq!(plan.points[0].budget.tokens, 3200);
    }

    /// A budget shorter than the warmup scales it as `widen train --steps` does (the
    /// same function), and the note is one line for every point.
    #[test]
    fn a_budget_shorter_than_the_warmup_scales_it_with_one_note() {
        let mut s = sweep(&[("residual.n", &["4", "8"])], Budget::Steps(5));
        s.base.train.steps = 300;
        s.base.train.schedule = ir::spec::ScheduleSpec::Cosine(Default::default());
        let plan = expand(&s).unwrap();
        let mut by_train = s.base.clone();
        let rule = set_steps(&mut by_train, 5).expect("the warmup of 20 is longer than 5 steps");
        for p in &plan.points {
            assert_eq!(p.spec.train.steps, 5);
            assert_eq!(p.spec.train.schedule, by_train.train.schedule, "{}", p.name);
        }
        assert_eq!(plan.warmup_scaled.len(), 2);
        let note = plan.warmup_note().unwrap();
        assert!(!note.contains('\n'), "{note}");
        assert!(
            note.contains(&format!("warmup of {}; warmup scaled to {}", rule.from, rule.to))
                && note.contains("in 2 of 2 points"),
            "{note}"
        );
        // A budget longer than the warmup changes nothing.
        let mut long = s.clone();
        long.budget = Budget::Steps(100);
        let plan = expand(&long).unwrap();
        assert!(plan.warmup_scaled.is_empty() && plan.warmup_note().is_none());
        assert_eq!(plan.points[0].spec.train.schedule, s.base.train.schedule);
    }

    #[test]
    fn baseline_twins_are_added_once_and_linked() {
        let mut s = sweep(&[("residual.n", &["4", "8"]), ("d_model", &["32", "64"])], Budget::Flops(1e10));
        s.baseline = true;
        let plan = expand(&s).unwrap();
        let names: Vec<&str> = plan.points.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "residual.n-4_d_model-32",
                "residual.n-4_d_model-64",
                "residual.n-8_d_model-32",
                "residual.n-8_d_model-64",
                "baseline_d_model-32",
                "baseline_d_model-64"
            ]
        );
        assert_eq!(plan.points[2].baseline.as_deref(), Some("baseline_d_model-32"));
        assert_eq!(plan.points[3].baseline.as_deref(), Some("baseline_d_model-64"));
        let twin = &plan.points[4];
        assert!(twin.is_baseline_twin);
        assert_eq!(twin.spec.residual, ResidualSpec::Residual);
        assert_eq!(twin.values, v(&[("d_model", "32")]));
        // Equal FLOPs: the cheaper plain twin trains more steps.
        assert!(twin.budget.steps > plan.points[0].budget.steps);

        // A swept plain-residual point is its own baseline and is reused as the twin.
        let mut s = sweep(&[("residual", &["Residual", "Ghc(m: 2, n: 8)"])], Budget::Steps(30));
        s.baseline = true;
        let plan = expand(&s).unwrap();
        assert_eq!(plan.points.len(), 2);
        assert_eq!(plan.points[0].baseline.as_deref(), Some("residual-Residual"));
        assert_eq!(plan.points[1].baseline.as_deref(), Some("residual-Residual"));
    }

    #[test]
    fn equal_names_are_an_error() {
        let s = sweep(&[("residual.n", &["4", "4"])], Budget::Steps(30));
        let err = expand(&s).unwrap_err().to_string();
        assert!(err.contains("two points are both named `residual.n-4`"), "{err}");
    }
}
