//! The sweep as data: a RON sweep file, or the same thing built from the CLI shorthand.
//!
//! A sweep is a base spec, axes (spec field paths with the values to try), how the
//! axes combine, the seeds every point is trained with, and a budget that fixes how
//! long each point trains. Keeping it as data means a sweep can be checked whole
//! (every point validated, [`crate::point`]) before anything trains, and re-read to
//! resume.
//!
//! ```ron
//! Sweep(
//!     base: "ghc.ron",                    // a path relative to this file, or inline: Model(...)
//!     axes: {
//!         "residual.n": [4, 8, 16],        // any spec field path, in RON values
//!         "mtp.depth": [0, 1],
//!     },
//!     combine: Product,                   // or Zip: the i-th values of every axis together
//!     seeds: 3,                           // seeds 0, 1, 2; or a list: [1, 7]
//!     budget: Tokens(1000000),            // or Flops(2e14), Steps(300), Time(600)
//!     baseline: true,                     // also train each point's plain-residual twin
//!     on_invalid: Skip,                   // or Refuse (the default)
//! )
//! ```
//!
//! Axis values are kept as RON text and typed only against the field they set, so
//! enum fields take their RON form (`"residual.reduce_norm": [GroupNorm, Off]`,
//! `"residual": [Residual, Ghc(m: 4, n: 8)]`) exactly as a spec writes them. Keys are
//! applied in the order written.
//!
//! The CLI shorthand builds the same [`Sweep`]: `--set residual.n=4,8,16` (one axis per
//! `--set`; values split at top-level commas), `--seeds 3` (or `--seeds 1,7`) and
//! `--budget flops=2e14 | tokens=1e6 | steps=300 | time=600`.
//!
//! **Limits** (docs/sweeps.md, Limits), checked before anything is built, so no input
//! can make a sweep allocate or loop without bound: at most [`MAX_AXES`] axes,
//! [`MAX_SEEDS`] seeds, [`MAX_POINTS`] points and [`MAX_RUNS`] runs (points x seeds,
//! baseline twins included). Step counts, given or from a budget, are at most the
//! spec's own limit on `train.steps` (1e8, [`ir::spec::limits`]).

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ir::spec::{parse_spec, ModelSpec, SpecLoadError};
use ron_raw::error::Error as RonError;
use ron_raw::value::RawValue;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::budget::{max_steps, Budget};
use crate::point::RATIO_AXIS;

/// Most axes in one sweep: far more than a comparison can read, and it bounds the
/// work of naming and building every point.
pub const MAX_AXES: usize = 32;

/// Most seeds per point: every seed is one more training run of every point.
pub const MAX_SEEDS: usize = 1000;

/// Most points (combinations of axis values) in one sweep, before baseline twins.
pub const MAX_POINTS: usize = 10_000;

/// Most runs (points, baseline twins included, times seeds) in one sweep: each is a
/// training run with its own folder, and the plan holds a spec for each.
pub const MAX_RUNS: usize = 10_000;

/// A whole sweep. Build one with [`Sweep::load`], [`Sweep::parse`] or
/// [`Sweep::from_cli`]; [`Sweep::check`] states the rules every constructor enforces.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    /// The spec every point starts from (parsed, not validated: only points are).
    pub base: ModelSpec,
    /// Where the base came from, for messages: its file, or `<sweep file> (inline base)`.
    pub base_source: String,
    /// The axes, applied to the base in this order.
    pub axes: Vec<Axis>,
    /// How the axes' values combine into points.
    pub combine: Combine,
    /// Seeds every point is trained with (each sets `train.seed`).
    pub seeds: Vec<u64>,
    /// How long each point trains.
    pub budget: Budget,
    /// Also train each point's plain-residual twin, the baseline its overhead is measured against.
    pub baseline: bool,
    /// What to do with points the spec validator rejects.
    pub on_invalid: OnInvalid,
}

/// One axis: a spec field path and the values it takes, each as RON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Axis {
    /// A spec field path such as `residual.n`, `train.optimizer.lr` or `d_model`; see
    /// [`crate::point`] for how paths reach enum variants and for the derived `residual.r`.
    pub path: String,
    /// The values, as RON text (`8`, `3e-3`, `GroupNorm`, `Ghc(m: 4, n: 8)`).
    pub values: Vec<String>,
}

/// How axis values combine into points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum Combine {
    /// Every combination; the first axis varies slowest.
    #[default]
    Product,
    /// The i-th value of every axis together; all axes must have the same length.
    Zip,
}

/// What to do when the spec validator rejects a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum OnInvalid {
    /// Report the invalid points and run the others.
    Skip,
    /// Report the invalid points and run nothing (the default: a sweep is a comparison,
    /// and a silently missing point changes it).
    #[default]
    Refuse,
}

/// Errors reading or building a sweep. Each names the file, the axis or the argument.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The sweep file could not be read.
    #[error("cannot read sweep file {path}")]
    Io { path: String, source: std::io::Error },
    /// The sweep file is not RON, or a field has the wrong type or name.
    #[error("{path}:{line}:{col}: {message}")]
    Syntax { path: String, line: usize, col: usize, message: String },
    /// The base spec could not be read or parsed.
    #[error("base spec of {sweep}: {source}")]
    Base { sweep: String, source: SpecLoadError },
    /// An axis has no values.
    #[error("axis `{axis}` has no values; give at least one, e.g. `\"{axis}\": [4, 8]`")]
    EmptyAxis { axis: String },
    /// Two axes set the same path.
    #[error("axis `{axis}` is given twice; give each path once with all its values")]
    DuplicateAxis { axis: String },
    /// `Zip` over axes of different lengths.
    #[error("combine: Zip needs axes of equal length, but {}", lengths(.axes))]
    ZipLengths { axes: Vec<(String, usize)> },
    /// No seeds.
    #[error("seeds: give a count >= 1 or a non-empty list of seeds")]
    NoSeeds,
    /// A seed listed twice.
    #[error("seeds: seed {seed} is listed twice; each seed is one run per point")]
    DuplicateSeed { seed: u64 },
    /// A budget that trains nothing or is not a number.
    #[error("budget: {0}")]
    Budget(String),
    /// A `--set` argument that is not `path=v1,v2,...`.
    #[error("--set {arg}: {reason}")]
    BadSet { arg: String, reason: String },
    /// A `--budget` argument that is not `flops=F`, `tokens=N` or `steps=N`.
    #[error("--budget {arg}: {reason}; expected flops=2e14, tokens=1e6, steps=300 or time=600")]
    BadBudget { arg: String, reason: String },
    /// A `--seeds` argument that is not a count or a list.
    #[error("--seeds {arg}: expected a count (3) or a comma-separated list of seeds (1,7), each a whole number in 0..=18446744073709551615")]
    BadSeeds { arg: String },
    /// More seeds than [`MAX_SEEDS`].
    #[error("seeds: {count} seeds per point is above the limit of {MAX_SEEDS} (docs/sweeps.md, Limits)")]
    TooManySeeds { count: String },
    /// More axes than [`MAX_AXES`].
    #[error("axes: {count} axes is above the limit of {MAX_AXES} (docs/sweeps.md, Limits)")]
    TooManyAxes { count: usize },
    /// The axes combine into more than [`MAX_POINTS`] points.
    #[error(
        "axes: {} make {} points, above the limit of {MAX_POINTS} (docs/sweeps.md, Limits); use fewer values",
        product(.axes),
        .points.map_or("more than 10^38".to_string(), |p| p.to_string())
    )]
    TooManyPoints { axes: Vec<(String, usize)>, points: Option<u128> },
    /// Points x seeds above [`MAX_RUNS`].
    #[error(
        "{points} points x {seeds} seeds make {runs} runs, above the limit of {MAX_RUNS} (docs/sweeps.md, \
         Limits); use fewer axis values or seeds"
    )]
    TooManyRuns { points: usize, seeds: usize, runs: u128 },
    /// An axis whose values every point loses to something else that sets the same field.
    #[error("axis `{axis}` has no effect: {by}")]
    OverriddenAxis { axis: String, by: String },
}

fn lengths(axes: &[(String, usize)]) -> String {
    axes.iter().map(|(a, n)| format!("`{a}` has {n}")).collect::<Vec<_>>().join(", ")
}

fn product(axes: &[(String, usize)]) -> String {
    axes.iter().map(|(a, n)| format!("`{a}` ({n} values)")).collect::<Vec<_>>().join(" x ")
}

/// A ron error as a message: the code's own words, except where they give advice
/// about ron's API rather than about the file.
fn ron_message(code: &RonError) -> String {
    match code {
        RonError::ExceededRecursionLimit => {
            "values nest too deeply (more than 128 levels of brackets); no sweep or spec needs that".into()
        }
        RonError::SuggestRawIdentifier(ident) => {
            format!("`{ident}` is not a valid name or value here")
        }
        other => other.to_string(),
    }
}

impl Sweep {
    /// Reads a sweep file; a base given as a path is read relative to the file's folder.
    pub fn load(path: &Path) -> Result<Sweep, SweepError> {
        let shown = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| SweepError::Io { path: shown.clone(), source })?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Sweep::parse(&text, &shown, &dir)
    }

    /// Parses sweep-file text. `label` names the file in messages; a base given as a
    /// path is resolved against `dir`.
    pub fn parse(text: &str, label: &str, dir: &Path) -> Result<Sweep, SweepError> {
        let file: SweepFile = ron_raw::Options::default().from_str(text).map_err(|e| SweepError::Syntax {
            path: label.to_string(),
            line: e.span.start.line,
            col: e.span.start.col,
            message: ron_message(&e.code),
        })?;
        let (base, base_source) = read_base(&file.base, text, label, dir)?;
        let sweep = Sweep {
            base,
            base_source,
            axes: file
                .axes
                .0
                .into_iter()
                .map(|(path, values)| Axis {
                    path,
                    values: values.iter().map(|v| v.get_ron().trim().to_string()).collect(),
                })
                .collect(),
            combine: file.combine,
            seeds: file.seeds.0,
            budget: file_budget(file.budget.get_ron())?,
            baseline: file.baseline,
            on_invalid: file.on_invalid,
        };
        sweep.check()?;
        Ok(sweep)
    }

    /// Builds a sweep from the CLI shorthand: `sets` are `--set` arguments
    /// (`residual.n=4,8,16`), `seeds` the `--seeds` argument (`3` or `1,7`), `budget`
    /// the `--budget` argument. The rest takes the sweep-file defaults (product, no
    /// baseline, refuse invalid points); set the public fields to change them.
    pub fn from_cli(
        base: ModelSpec,
        base_source: &str,
        sets: &[impl AsRef<str>],
        seeds: &str,
        budget: &str,
    ) -> Result<Sweep, SweepError> {
        let sweep = Sweep {
            base,
            base_source: base_source.to_string(),
            axes: sets.iter().map(|s| s.as_ref().parse()).collect::<Result<_, _>>()?,
            combine: Combine::Product,
            seeds: parse_seeds(seeds)?,
            budget: budget.parse()?,
            baseline: false,
            on_invalid: OnInvalid::Refuse,
        };
        sweep.check()?;
        Ok(sweep)
    }

    /// The rules of a well-formed sweep: every axis has values and a distinct path and
    /// changes the points (no other axis, nor the budget or the seeds, overrides it),
    /// `Zip` axes have equal lengths, the seeds are a non-empty set, the budget is a
    /// positive finite amount within the step limit, and the axes, seeds, points and
    /// runs are within their limits ([`MAX_AXES`], [`MAX_SEEDS`], [`MAX_POINTS`],
    /// [`MAX_RUNS`]), counted without building anything. (Whether each point is a
    /// valid spec is [`crate::point`]'s question.)
    pub fn check(&self) -> Result<(), SweepError> {
        if self.axes.len() > MAX_AXES {
            return Err(SweepError::TooManyAxes { count: self.axes.len() });
        }
        let mut paths: HashSet<&str> = HashSet::new();
        for axis in &self.axes {
            if axis.values.is_empty() {
                return Err(SweepError::EmptyAxis { axis: axis.path.clone() });
            }
            if !paths.insert(axis.path.as_str()) {
                return Err(SweepError::DuplicateAxis { axis: axis.path.clone() });
            }
        }
        for (i, axis) in self.axes.iter().enumerate() {
            if let Some(by) = self.overridden_by(i) {
                return Err(SweepError::OverriddenAxis { axis: axis.path.clone(), by });
            }
        }
        let lengths = || self.axes.iter().map(|a| (a.path.clone(), a.values.len())).collect::<Vec<_>>();
        let points: Option<u128> = match self.combine {
            Combine::Zip => {
                let first = self.axes.first().map_or(0, |a| a.values.len());
                if self.axes.iter().any(|a| a.values.len() != first) {
                    return Err(SweepError::ZipLengths { axes: lengths() });
                }
                Some(first.max(1) as u128)
            }
            Combine::Product => {
                self.axes.iter().try_fold(1u128, |acc, a| acc.checked_mul(a.values.len() as u128))
            }
        };
        let points = match points {
            Some(p) if p <= MAX_POINTS as u128 => p as usize,
            points => return Err(SweepError::TooManyPoints { axes: lengths(), points }),
        };
        if self.seeds.is_empty() {
            return Err(SweepError::NoSeeds);
        }
        if self.seeds.len() > MAX_SEEDS {
            return Err(SweepError::TooManySeeds { count: self.seeds.len().to_string() });
        }
        let mut seen: HashSet<u64> = HashSet::with_capacity(self.seeds.len());
        for &seed in &self.seeds {
            if !seen.insert(seed) {
                return Err(SweepError::DuplicateSeed { seed });
            }
        }
        let runs = points as u128 * self.seeds.len() as u128;
        if runs > MAX_RUNS as u128 {
            return Err(SweepError::TooManyRuns { points, seeds: self.seeds.len(), runs });
        }
        self.budget.check().map_err(SweepError::Budget)
    }

    /// What makes axis `i` do nothing, if anything: the budget (it sets `train.steps`),
    /// the seeds (`train.seed`), the derived `residual.r` (it sets `residual.n`), or a
    /// later axis that sets a whole value this axis sets a field of.
    fn overridden_by(&self, i: usize) -> Option<String> {
        let path = self.axes[i].path.as_str();
        if path == "train.steps" {
            return Some(
                "the budget sets every point's train.steps; give the step count as the budget \
                 (--budget steps=N, or `budget: Steps(N)` in a sweep file), one sweep per count"
                    .into(),
            );
        }
        if path == "train.seed" {
            return Some(
                "the seeds set every run's train.seed; give them with --seeds (or `seeds:` in a sweep file)"
                    .into(),
            );
        }
        if path == "residual.n" && self.axes.iter().any(|a| a.path == RATIO_AXIS) {
            return Some(format!(
                "the derived axis `{RATIO_AXIS}` sets residual.n = r·m on every point; sweep one of the two"
            ));
        }
        if path == RATIO_AXIS {
            return None;
        }
        self.axes[i + 1..].iter().find(|a| path.starts_with(&format!("{}.", a.path))).map(|later| {
            format!(
                "the later axis `{}` sets the whole of `{}` on every point; give `{}` before `{path}`",
                later.path, later.path, later.path
            )
        })
    }
}

/// The sweep file's `budget`: `Tokens(N)`, `Flops(F)` or `Steps(N)`, the amount read
/// as the CLI's `--budget` reads it (whole numbers exactly, scientific notation allowed).
fn file_budget(raw: &str) -> Result<Budget, SweepError> {
    let raw = raw.trim();
    let bad = |reason: String| {
        SweepError::Budget(format!(
            "{raw}: {reason}; expected Tokens(1000000), Flops(2e14), Steps(300) or Time(600)"
        ))
    };
    let (kind, rest) =
        raw.split_at(raw.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(raw.len()));
    let amount = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| bad("not a budget".into()))?;
    let kind = match kind {
        "Tokens" => "tokens",
        "Flops" => "flops",
        "Steps" => "steps",
        "Time" => "time",
        _ => return Err(bad(format!("unknown budget kind `{kind}`"))),
    };
    parse_budget(kind, amount.trim()).map_err(bad)
}

/// Reads the `base` field: a string is a spec file path (relative to `dir`), anything
/// else an inline `Model(...)` whose error positions are shifted to the sweep file's.
fn read_base(raw: &RawValue, text: &str, label: &str, dir: &Path) -> Result<(ModelSpec, String), SweepError> {
    let raw = raw.trim();
    let base_err = |source| SweepError::Base { sweep: label.to_string(), source };
    if raw.get_ron().starts_with('"') {
        let rel: String = raw.into_rust().map_err(|e| SweepError::Syntax {
            path: label.to_string(),
            line: e.span.start.line,
            col: e.span.start.col,
            message: format!("in `base`: {}", ron_message(&e.code)),
        })?;
        let path: PathBuf = dir.join(&rel);
        let shown = path.display().to_string();
        let spec_text = std::fs::read_to_string(&path)
            .map_err(|source| base_err(SpecLoadError::Io { path: shown.clone(), source }))?;
        let spec = parse_spec(&spec_text, &shown).map_err(base_err)?;
        return Ok((spec, shown));
    }
    let inline = raw.get_ron();
    let shown = format!("{label} (inline base)");
    // The raw value is a slice of the file's text, so its offset gives line numbers
    // in the sweep file rather than in the snippet.
    let (line0, col0) = match text.find(inline) {
        Some(at) => {
            let before = &text[..at];
            let line = before.matches('\n').count();
            let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count());
            (line, col)
        }
        None => (0, 0),
    };
    let shift = |line: usize, col: usize| (line + line0, if line == 1 { col + col0 } else { col });
    let spec = parse_spec(inline, &shown).map_err(|e| {
        base_err(match e {
            SpecLoadError::Syntax { path, line, col, message } => {
                let (line, col) = shift(line, col);
                SpecLoadError::Syntax { path, line, col, message }
            }
            SpecLoadError::UnknownNames { path, mut names } => {
                for n in &mut names {
                    (n.line, n.col) = shift(n.line, n.col);
                }
                SpecLoadError::UnknownNames { path, names }
            }
            other @ (SpecLoadError::Io { .. } | SpecLoadError::Invalid { .. }) => other,
        })
    })?;
    Ok((spec, shown))
}

/// The sweep file's fields, as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename = "Sweep")]
struct SweepFile {
    base: Box<RawValue>,
    #[serde(default)]
    axes: AxesField,
    #[serde(default)]
    combine: Combine,
    #[serde(default)]
    seeds: SeedsField,
    budget: Box<RawValue>,
    #[serde(default)]
    baseline: bool,
    #[serde(default)]
    on_invalid: OnInvalid,
}

/// `axes: {"path": [values], ...}` in the order written; a repeated path is an error
/// (a map type would silently keep only the last).
#[derive(Default)]
struct AxesField(Vec<(String, Vec<Box<RawValue>>)>);

impl<'de> Deserialize<'de> for AxesField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = AxesField;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map from spec field paths to lists of values, e.g. {\"residual.n\": [4, 8]}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<AxesField, A::Error> {
                let mut axes: Vec<(String, Vec<Box<RawValue>>)> = Vec::new();
                let mut seen: HashSet<String> = HashSet::new();
                while let Some(path) = map.next_key::<String>()? {
                    if !seen.insert(path.clone()) {
                        return Err(de::Error::custom(format!("axis `{path}` is given twice")));
                    }
                    if axes.len() == MAX_AXES {
                        return Err(de::Error::custom(SweepError::TooManyAxes { count: MAX_AXES + 1 }));
                    }
                    let values = map.next_value()?;
                    axes.push((path, values));
                }
                Ok(AxesField(axes))
            }
        }
        d.deserialize_map(V)
    }
}

/// `seeds: 3` (seeds 0, 1, 2) or `seeds: [1, 7]`; default one seed, 0.
struct SeedsField(Vec<u64>);

impl Default for SeedsField {
    fn default() -> Self {
        SeedsField(vec![0])
    }
}

impl<'de> Deserialize<'de> for SeedsField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SeedsField;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a seed count (3) or a list of seeds ([1, 7])")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<SeedsField, E> {
                // Bounded before the list is built.
                if n > MAX_SEEDS as u64 {
                    return Err(E::custom(SweepError::TooManySeeds { count: n.to_string() }));
                }
                Ok(SeedsField((0..n).collect()))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<SeedsField, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "seeds: {n} is negative; give a count in 1..={MAX_SEEDS} or a list of seeds"
                    ))),
                }
            }
            fn visit_f64<E: de::Error>(self, x: f64) -> Result<SeedsField, E> {
                Err(E::custom(format!(
                    "seeds: {x} is a float; give a count written as digits, in 1..={MAX_SEEDS}, or a list of seeds"
                )))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SeedsField, A::Error> {
                let mut seeds = Vec::new();
                while let Some(s) = seq.next_element::<u64>()? {
                    if seeds.len() == MAX_SEEDS {
                        return Err(de::Error::custom(SweepError::TooManySeeds {
                            count: format!("more than {MAX_SEEDS}"),
                        }));
                    }
                    seeds.push(s);
                }
                Ok(SeedsField(seeds))
            }
        }
        d.deserialize_any(V)
    }
}

impl FromStr for Axis {
    type Err = SweepError;

    /// `path=v1,v2,...`; values split at commas outside brackets and strings, so
    /// `residual=Residual,Ghc(m: 4, n: 8)` gives two values.
    fn from_str(arg: &str) -> Result<Axis, SweepError> {
        let bad = |reason: &str| SweepError::BadSet { arg: arg.to_string(), reason: reason.to_string() };
        let (path, values) =
            arg.split_once('=').ok_or_else(|| bad("expected path=v1,v2 (e.g. residual.n=4,8,16)"))?;
        let path = path.trim();
        if path.is_empty() || !path.split('.').all(|seg| !seg.is_empty()) {
            return Err(bad("the field path is empty or has an empty segment (e.g. residual.n)"));
        }
        let values = split_top_level(values);
        if values.iter().any(|v| v.is_empty()) {
            return Err(bad("a value is empty; give values separated by single commas"));
        }
        for v in &values {
            RawValue::from_ron(v).map_err(|e| SweepError::BadSet {
                arg: arg.to_string(),
                reason: format!(
                    "value `{v}` is not RON ({}); values are written as in a spec file: 8, 3e-3, GroupNorm, \
                     Ghc(m: 4, n: 8), \"text\"",
                    ron_message(&e.code)
                ),
            })?;
        }
        Ok(Axis { path: path.to_string(), values })
    }
}

/// Splits at commas that are not inside `()`, `[]`, `{}` or a string.
fn split_top_level(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut depth = 0i32;
    let mut in_str = false;
    let mut escaped = false;
    for c in s.chars() {
        if in_str {
            cur.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur.trim().to_string());
    out
}

/// Whether RON text is a sweep file: its first token after comments is `Sweep`.
pub fn is_sweep_file(text: &str) -> bool {
    let mut rest = text.trim_start_matches('\u{feff}');
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.split_once('\n').map_or("", |(_, r)| r);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.split_once("*/").map_or("", |(_, r)| r);
        } else {
            break;
        }
    }
    rest.strip_prefix("Sweep").is_some_and(|r| r.trim_start().starts_with('('))
}

/// `--seeds 3` (seeds 0, 1, 2) or `--seeds 1,7`.
/// At most [`MAX_SEEDS`], counted before the list is built.
pub fn parse_seeds(arg: &str) -> Result<Vec<u64>, SweepError> {
    let bad = || SweepError::BadSeeds { arg: arg.to_string() };
    let arg_t = arg.trim();
    if arg_t.contains(',') {
        let count = arg_t.split(',').count();
        if count > MAX_SEEDS {
            return Err(SweepError::TooManySeeds { count: count.to_string() });
        }
        arg_t.split(',').map(|s| s.trim().parse::<u64>().map_err(|_| bad())).collect()
    } else {
        let n: u64 = arg_t.parse().map_err(|_| bad())?;
        if n > MAX_SEEDS as u64 {
            return Err(SweepError::TooManySeeds { count: n.to_string() });
        }
        Ok((0..n).collect())
    }
}

impl FromStr for Budget {
    type Err = SweepError;

    /// `flops=2e14`, `tokens=1e6` or `steps=300`: token and step counts are whole
    /// numbers read exactly (digits, or scientific notation that is a whole number), in
    /// range (steps at most the spec's limit on `train.steps`).
    fn from_str(arg: &str) -> Result<Budget, SweepError> {
        let bad = |reason: String| SweepError::BadBudget { arg: arg.to_string(), reason };
        let (kind, amount) = arg.split_once('=').ok_or_else(|| bad("no `=`".into()))?;
        parse_budget(kind.trim(), amount.trim()).map_err(bad)
    }
}

/// A budget from its kind (`tokens`, `flops`, `steps`) and amount; the error is the reason.
fn parse_budget(kind: &str, amount: &str) -> Result<Budget, String> {
    let budget = match kind {
        "flops" => Budget::Flops(amount.parse().map_err(|_| format!("`{amount}` is not a number"))?),
        "tokens" => Budget::Tokens(whole(amount, "tokens", u64::MAX)?),
        "steps" => Budget::Steps(whole(amount, "steps", max_steps())?),
        "time" => Budget::Time(amount.parse().map_err(|_| format!("`{amount}` is not a number of seconds"))?),
        other => return Err(format!("unknown budget kind `{other}`")),
    };
    budget.check()?;
    Ok(budget)
}

/// `amount` as a whole number in 1..=max, read exactly: digits (`_` allowed between
/// them), or a decimal with an exponent whose value is whole (`1e6`, `2.5e3`). No
/// float is involved, so `18446744073709551616` is out of range rather than rounded
/// to `u64::MAX`.
fn whole(amount: &str, what: &str, max: u64) -> Result<u64, String> {
    let range = || format!("{what} must be a whole number in 1..={max}, got {amount}");
    let not_a_number = || format!("`{amount}` is not a number; {}", range());
    let text = amount.strip_prefix('+').unwrap_or(amount);
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(at) => (&text[..at], Some(&text[at + 1..])),
        None => (text, None),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits_ok = |s: &str| s.chars().all(|c| c.is_ascii_digit() || c == '_');
    if !mantissa.contains(|c: char| c.is_ascii_digit()) || !digits_ok(int_part) || !digits_ok(frac_part) {
        return Err(not_a_number());
    }
    let exponent: i64 = match exponent {
        None => 0,
        Some(e) => {
            let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
            if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
                return Err(not_a_number());
            }
            // An exponent beyond i64 is far out of range (or far from whole) either way.
            e.strip_prefix('+').unwrap_or(e).parse::<i64>().map_err(|_| range())?
        }
    };
    // value = digits · 10^(exponent - fraction length); trailing zeros of the digits
    // move into the exponent, so the test for a whole number is exact.
    let frac_len = frac_part.chars().filter(|c| *c != '_').count() as i64;
    let mut digits: String =
        int_part.chars().chain(frac_part.chars()).filter(|c| *c != '_').skip_while(|c| *c == '0').collect();
    let mut exp = exponent.saturating_sub(frac_len);
    if digits.is_empty() {
        return Err(range());
    }
    while digits.ends_with('0') {
        digits.pop();
        exp = exp.saturating_add(1);
    }
    // Not whole, or more digits than a u64 holds.
    if !(0..=19).contains(&exp) || digits.len() > 20 {
        return Err(range());
    }
    digits
        .parse::<u64>()
        .ok()
        .and_then(|d| d.checked_mul(10u64.pow(exp as u32)))
        .filter(|&v| v <= max)
        .ok_or_else(range)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::spec::ResidualSpec;

    #[test]
    fn sweep_files_are_told_from_specs() {
        assert!(is_sweep_file("// a sweep\n/* of r */ Sweep(base: \"a.ron\")"));
        assert!(is_sweep_file("\u{feff}Sweep (base: \"a.ron\")"));
        assert!(!is_sweep_file("Model(name: \"sweep\")"));
        assert!(!is_sweep_file("(name: \"Sweep\")"));
        assert!(!is_sweep_file("Sweeping(x: 1)"));
    }

    fn parse(text: &str) -> Result<Sweep, SweepError> {
        Sweep::parse(text, "sweep.ron", Path::new("."))
    }

    const INLINE: &str = r#"Sweep(
    base: Model(d_model: 32, residual: Ghc(m: 2, n: 4)),
    axes: {"residual": [Residual, Ghc(m: 4, n: 8)], "mtp.depth": [0, 1], "residual.n": [4, 8, 16]},
    combine: Product,
    seeds: [3, 5],
    budget: Flops(2e14),
    baseline: true,
    on_invalid: Skip,
)"#;

    #[test]
    fn inline_base_and_every_field() {
        let s = parse(INLINE).unwrap();
        assert_eq!(s.base.d_model, 32);
        assert!(matches!(s.base.residual, ResidualSpec::Ghc(ref g) if g.m == 2 && g.n == 4));
        assert_eq!(s.base_source, "sweep.ron (inline base)");
        let paths: Vec<&str> = s.axes.iter().map(|a| a.path.as_str()).collect();
        assert_eq!(paths, ["residual", "mtp.depth", "residual.n"], "axes keep the written order");
        assert_eq!(s.axes[2].values, ["4", "8", "16"]);
        assert_eq!(s.axes[0].values, ["Residual", "Ghc(m: 4, n: 8)"], "enum values keep their RON text");
        assert_eq!(s.combine, Combine::Product);
        assert_eq!(s.seeds, [3, 5]);
        assert_eq!(s.budget, Budget::Flops(2e14));
        assert!(s.baseline);
        assert_eq!(s.on_invalid, OnInvalid::Skip);
    }

    #[test]
    fn defaults_and_seed_count() {
        let s = parse(r#"Sweep(base: Model(), axes: {"d_model": [32, 64]}, seeds: 3, budget: Steps(10))"#)
            .unwrap();
        assert_eq!(s.seeds, [0, 1, 2]);
        assert_eq!(s.combine, Combine::Product);
        assert_eq!(s.on_invalid, OnInvalid::Refuse);
        assert!(!s.baseline);
        let s = parse("Sweep(base: Model(), budget: Tokens(1000))").unwrap();
        assert_eq!(s.seeds, [0]);
        assert!(s.axes.is_empty());
    }

    #[test]
    fn base_path_is_relative_to_the_sweep_file() {
        let dir = std::env::temp_dir().join(format!("widen-sweep-file-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("specs")).unwrap();
        std::fs::write(dir.join("specs/base.ron"), "Model(d_model: 48, heads: 4)").unwrap();
        let sweep_path = dir.join("sweep.ron");
        std::fs::write(&sweep_path, r#"Sweep(base: "specs/base.ron", budget: Steps(5))"#).unwrap();
        let s = Sweep::load(&sweep_path).unwrap();
        assert_eq!(s.base.d_model, 48);
        assert!(s.base_source.ends_with("base.ron"));

        std::fs::write(&sweep_path, r#"Sweep(base: "specs/missing.ron", budget: Steps(5))"#).unwrap();
        let err = Sweep::load(&sweep_path).unwrap_err().to_string();
        assert!(err.contains("missing.ron"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_file_field_or_axis() {
        let err = parse("Sweep(base: Model(), budget: Steps(5), seed: 3)").unwrap_err();
        assert!(matches!(err, SweepError::Syntax { .. }), "{err:?}");
        assert!(err.to_string().starts_with("sweep.ron:1:"), "{err}");
        assert!(err.to_string().contains("seed"), "{err}");

        let err =
            parse("Sweep(base: Model(), axes: {\"a\": [1], \"a\": [2]}, budget: Steps(5))").unwrap_err();
        assert!(err.to_string().contains("axis `a` is given twice"), "{err}");

        let err = parse("Sweep(base: Model(), axes: {\"residual.n\": []}, budget: Steps(5))").unwrap_err();
        assert!(matches!(err, SweepError::EmptyAxis { ref axis } if axis == "residual.n"), "{err:?}");

        let err =
            parse("Sweep(base: Model(), axes: {\"a\": [1, 2], \"b\": [1]}, combine: Zip, budget: Steps(5))")
                .unwrap_err();
        assert!(err.to_string().contains("`a` has 2, `b` has 1"), "{err}");

        let err = parse("Sweep(base: Model(), seeds: [1, 1], budget: Steps(5))").unwrap_err();
        assert!(matches!(err, SweepError::DuplicateSeed { seed: 1 }), "{err:?}");
        let err = parse("Sweep(base: Model(), seeds: 0, budget: Steps(5))").unwrap_err();
        assert!(matches!(err, SweepError::NoSeeds), "{err:?}");
        let err = parse("Sweep(base: Model(), budget: Flops(0.0))").unwrap_err();
        assert!(err.to_string().starts_with("budget:"), "{err}");
    }

    #[test]
    fn inline_base_errors_point_into_the_sweep_file() {
        let text =
            "Sweep(\n    budget: Steps(5),\n    base: Model(d_model: 32,\n        residual: Ghc(mm: 2)),\n)";
        let err = parse(text).unwrap_err();
        let SweepError::Base { source: SpecLoadError::UnknownNames { names, .. }, .. } = &err else {
            panic!("expected unknown names, got {err:?}");
        };
        assert_eq!(names[0].path, "residual.mm");
        assert_eq!(names[0].line, 4, "line in the sweep file, not in the snippet");
    }

    #[test]
    fn cli_shorthand_builds_the_same_sweep() {
        let base = ModelSpec::default();
        let s = Sweep::from_cli(
            base.clone(),
            "base.ron",
            &["residual=Residual,Ghc(m: 4, n: 8)", "residual.n=4,8,16"],
            "3",
            "flops=2e14",
        )
        .unwrap();
        assert_eq!(
            s.axes[1],
            Axis { path: "residual.n".into(), values: vec!["4".into(), "8".into(), "16".into()] }
        );
        assert_eq!(s.axes[0].values, ["Residual", "Ghc(m: 4, n: 8)"]);
        assert_eq!(s.seeds, [0, 1, 2]);
        assert_eq!(s.budget, Budget::Flops(2e14));

        let file = parse(
            r#"Sweep(base: Model(), axes: {"residual": [Residual, Ghc(m: 4, n: 8)], "residual.n": [4, 8, 16]},
               seeds: 3, budget: Flops(2e14))"#,
        )
        .unwrap();
        assert_eq!(file.axes, s.axes);
        assert_eq!(file.seeds, s.seeds);

        assert_eq!("tokens=1e6".parse::<Budget>().unwrap(), Budget::Tokens(1_000_000));
        assert_eq!("steps=300".parse::<Budget>().unwrap(), Budget::Steps(300));
        assert_eq!(parse_seeds("1,7").unwrap(), [1, 7]);
    }

    #[test]
    fn cli_shorthand_errors_name_the_argument() {
        let e = |sets: &[&str], seeds: &str, budget: &str| {
            Sweep::from_cli(ModelSpec::default(), "b", sets, seeds, budget).unwrap_err().to_string()
        };
        assert!(e(&["residual.n"], "1", "steps=5").starts_with("--set residual.n: expected path=v1,v2"));
        assert!(e(&["residual.n=4,,8"], "1", "steps=5").contains("a value is empty"));
        assert!(e(&["residual.n=4,(8"], "1", "steps=5").contains("value `(8` is not RON"));
        assert!(e(&[".n=4"], "1", "steps=5").contains("empty segment"));
        assert!(e(&["d_model=32", "d_model=64"], "1", "steps=5").contains("axis `d_model` is given twice"));
        assert!(e(&[], "x", "steps=5").starts_with("--seeds x"));
        assert!(e(&[], "1", "flop=5").contains("unknown budget kind `flop`"));
        assert!(e(&[], "1", "tokens=1.5").contains("whole number"));
        assert!(e(&[], "1", "steps").contains("no `=`"));
        assert!(e(&[], "1", "flops=-1").starts_with("--budget flops=-1"));
        assert!(e(&[], "1", "flops=inf").starts_with("--budget flops=inf"));
    }
}
