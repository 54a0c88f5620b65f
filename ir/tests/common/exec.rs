//! Shared fixtures for the reference-executor tests: a seeded generator, a graph
//! builder that remembers the values bound to its sources, and tolerant compares.
//! Each test file uses a subset.
use ir::exec::{self, ExecError, Float, Tensor, Value};
use ir::graph::{Graph, Init, NodeId, Op, ParamClass, ParamInfo};
use ir::{DType, Shape};
use std::collections::HashMap;

/// splitmix64: small, seeded and good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.unit().max(1e-300);
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    pub fn normals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A graph plus the values bound to its sources, evaluated in either precision.
#[derive(Default)]
pub struct Case {
    pub g: Graph,
    floats: HashMap<NodeId, Vec<f64>>,
    ints: HashMap<NodeId, Vec<i32>>,
}

impl Case {
    pub fn new() -> Self {
        Case::default()
    }

    /// A float parameter bound to `data`.
    pub fn param(&mut self, dims: &[usize], data: Vec<f64>) -> NodeId {
        assert_eq!(dims.iter().product::<usize>(), data.len());
        let name = format!("p{}", self.g.node_count());
        let info = ParamInfo { name, init: Init::Zeros, class: ParamClass::Hidden };
        let id = self.g.add_source(Op::Param(info), Shape::new(dims), DType::F32, None);
        self.floats.insert(id, data);
        id
    }

    /// An i32 input bound to `data`.
    pub fn ints(&mut self, dims: &[usize], data: Vec<i32>) -> NodeId {
        assert_eq!(dims.iter().product::<usize>(), data.len());
        let name = format!("i{}", self.g.node_count());
        let id = self.g.add_source(Op::Input { name }, Shape::new(dims), DType::I32, None);
        self.ints.insert(id, data);
        id
    }

    pub fn add(&mut self, op: Op, inputs: &[NodeId]) -> NodeId {
        self.g.add(op, inputs).unwrap_or_else(|e| panic!("graph rejected the op: {e}"))
    }

    /// Rebinds a float source.
    pub fn set(&mut self, node: NodeId, data: Vec<f64>) {
        self.floats.insert(node, data);
    }

    pub fn get(&self, node: NodeId) -> &[f64] {
        &self.floats[&node]
    }

    pub fn sources<T: Float>(&self) -> HashMap<NodeId, Value<T>> {
        let mut map = HashMap::new();
        for (&id, data) in &self.floats {
            map.insert(id, Value::Float(Tensor::from_f64(self.g.node(id).shape.clone(), data)));
        }
        for (&id, data) in &self.ints {
            map.insert(id, Value::Int(Tensor::new(self.g.node(id).shape.clone(), data.clone())));
        }
        map
    }

    pub fn try_run<T: Float>(&self, outputs: &[NodeId]) -> Result<HashMap<NodeId, Value<T>>, ExecError> {
        exec::run(&self.g, &self.sources::<T>(), outputs)
    }

    /// The float value of `out`, widened to f64.
    pub fn eval<T: Float>(&self, out: NodeId) -> Vec<f64> {
        let values = self.try_run::<T>(&[out]).unwrap_or_else(|e| panic!("run failed: {e}"));
        values[&out].as_float().expect("a float output").to_f64()
    }

    /// The i32 value of `out`.
    pub fn eval_int<T: Float>(&self, out: NodeId) -> Vec<i32> {
        let values = self.try_run::<T>(&[out]).unwrap_or_else(|e| panic!("run failed: {e}"));
        values[&out].as_int().expect("an i32 output").data.clone()
    }
}

/// A relative tolerance for T: loose for f32, tight for f64.
pub fn tol<T: Float>() -> f64 {
    if std::mem::size_of::<T>() == 4 {
        2e-5
    } else {
        1e-12
    }
}

/// |got - want| <= tol · (1 + |want|) elementwise.
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}[{i}]: got {g}, want {w} (tol {tol})");
    }
}

/// Row-major offset of a multi-index.
pub fn offset(dims: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// The multi-index of a row-major offset.
pub fn unravel(dims: &[usize], mut flat: usize) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for (slot, &d) in idx.iter_mut().zip(dims).rev() {
        *slot = flat % d;
        flat /= d;
    }
    idx
}
