//! Parity harness of the emit / compile tests: compile a graph for a
//! partition, run the Plan with `codegen::compile::run_on_cpu_for_tests`, and
//! compare every requested value with the f32 reference executor.

use std::collections::HashMap;
use std::path::PathBuf;

use codegen::cc::Compiler;
use codegen::compile::{compile, run_on_cpu_for_tests, HostData, Partition, Request};
use codegen::plan::{BufferRole, Plan};
use ir::exec::{Tensor, Value};
use ir::graph::{Graph, Init, NodeId, Op, ParamClass, ParamInfo};
use ir::{DType, Shape};

/// A deterministic xorshift generator for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub fn compiler() -> Compiler {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("widen-emit-tests");
    Compiler::new("cc", dir).expect("a C compiler `cc` on PATH")
}

pub fn param(g: &mut Graph, name: &str, dims: &[usize]) -> NodeId {
    let info = ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Hidden };
    g.add_source(Op::Param(info), Shape::new(dims), DType::F32, Some(name.into()))
}

pub fn input(g: &mut Graph, name: &str, dims: &[usize]) -> NodeId {
    g.add_source(Op::Input { name: name.into() }, Shape::new(dims), DType::I32, Some(name.into()))
}

/// Values for every source of a graph: floats from the parameter's init rule
/// plus noise (`noise` = 1: plain uniform values), ints from `ints`.
pub struct Sources {
    pub values: HashMap<NodeId, Value<f32>>,
}

impl Sources {
    pub fn random(
        graph: &Graph,
        rng: &mut Rng,
        noise: f32,
        ints: &dyn Fn(NodeId, usize) -> Vec<i32>,
    ) -> Sources {
        let mut values = HashMap::new();
        for id in graph.node_ids() {
            let node = graph.node(id);
            let n = node.shape.numel();
            match &node.op {
                Op::Param(p) => {
                    let dims = node.shape.dims();
                    let base: Vec<f32> = (0..n)
                        .map(|i| match &p.init {
                            Init::Ones => 1.0,
                            Init::Constant(c) => *c as f32,
                            Init::Values(v) => v[i] as f32,
                            Init::Eye => {
                                let cols = dims.last().copied().unwrap_or(1);
                                f32::from(u8::from(i / cols == i % cols))
                            }
                            Init::Normal { std } => *std as f32 * rng.uniform() * 1.7,
                            Init::Uniform { bound } => *bound as f32 * rng.uniform(),
                            Init::Zeros => 0.0,
                        })
                        .collect();
                    let data = base.into_iter().map(|v| v + noise * rng.uniform()).collect();
                    values.insert(id, Value::Float(Tensor::new(node.shape.clone(), data)));
                }
                Op::Input { .. } => {
                    values.insert(id, Value::Int(Tensor::new(node.shape.clone(), ints(id, n))));
                }
                _ => {}
            }
        }
        Sources { values }
    }
}

/// Largest |a − b| / (|b| + scale) over a tensor, with scale = max |ref| · 1e-2:
/// relative error that does not blow up on near-zero entries of a large tensor.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) * 1e-2 + 1e-6;
    got.iter().zip(want).fold(0.0f32, |m, (&a, &b)| {
        let e = if a.is_nan() || b.is_nan() {
            if a.is_nan() && b.is_nan() {
                0.0
            } else {
                f32::INFINITY
            }
        } else {
            (a - b).abs() / (b.abs() + scale)
        };
        m.max(e)
    })
}

/// Runs `plan` with the sources' values bound by role; returns every buffer.
pub fn run_plan(graph: &Graph, plan: &Plan, sources: &Sources) -> Vec<HostData> {
    let mut inputs = Vec::new();
    for (id, v) in &sources.values {
        let role = match &graph.node(*id).op {
            Op::Param(p) => BufferRole::Param { name: p.name.clone() },
            Op::Input { name } => BufferRole::Input { name: name.clone() },
            _ => continue,
        };
        let buf = plan.find(&role).expect("every source has a buffer");
        let data = match v {
            Value::Float(t) => HostData::F32(t.data.clone()),
            Value::Int(t) => HostData::I32(t.data.clone()),
        };
        inputs.push((buf, data));
    }
    run_on_cpu_for_tests(plan, &compiler(), &inputs).expect("plan runs")
}

/// Compiles for `partition`, runs, and checks every output and gradient of
/// `request` against the reference within `tol`; returns the Plan.
pub fn check(
    graph: &Graph,
    sources: &Sources,
    request: &Request,
    partition: &Partition,
    tol: f32,
    what: &str,
) -> Plan {
    let plan = compile(graph, partition, request).unwrap_or_else(|e| panic!("{what}: compile: {e}"));
    let outs = run_plan(graph, &plan, sources);
    let roots: Vec<NodeId> =
        request.outputs.iter().map(|o| o.1).chain(request.grads.iter().map(|g| g.1)).collect();
    let want = ir::exec::run::<f32>(graph, &sources.values, &roots)
        .unwrap_or_else(|e| panic!("{what}: reference: {e}"));
    let mut named: Vec<(String, BufferRole, NodeId)> = request
        .outputs
        .iter()
        .map(|(n, id)| (n.clone(), BufferRole::Output { name: n.clone() }, *id))
        .collect();
    for &(p, g) in &request.grads {
        let Op::Param(info) = &graph.node(p).op else { panic!("grads pair params") };
        named.push((format!("d {}", info.name), BufferRole::Grad { name: info.name.clone() }, g));
    }
    for (name, role, id) in named {
        let buf = plan.find(&role).unwrap_or_else(|| panic!("{what}: no buffer for {name}"));
        match (&outs[buf.0], &want[&id]) {
            (HostData::F32(got), Value::Float(t)) => {
                let e = rel_err(got, &t.data);
                assert!(
                    e <= tol,
                    "{what}: {name}: relative error {e} > {tol}\n got {:?}\nwant {:?}",
                    &got[..got.len().min(8)],
                    &t.data[..t.data.len().min(8)]
                );
            }
            (HostData::I32(got), Value::Int(t)) => assert_eq!(got, &t.data, "{what}: {name}"),
            _ => panic!("{what}: {name}: kinds differ"),
        }
    }
    plan
}

/// Every non-source node in one group: the compiler must split it where the
/// ops cannot share an item split.
pub fn one_group(graph: &Graph) -> Partition {
    vec![graph.topo_order().into_iter().filter(|&id| !graph.node(id).op.is_source()).collect()]
}

/// `specs/{name}.ron` after `edit`, lowered at `batch` × `seq_len`, differentiated
/// and simplified, with the Request for its outputs and every parameter gradient;
/// also its vocabulary size.
pub fn spec_training_graph(
    name: &str,
    batch: usize,
    seq_len: usize,
    edit: impl FnOnce(&mut ir::spec::ModelSpec),
) -> (Graph, Request, usize) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs").join(format!("{name}.ron"));
    let mut spec = ir::spec::load_spec(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    edit(&mut spec);
    let lowered = ir::lower::lower(&spec, batch, seq_len).unwrap_or_else(|e| panic!("{name}: {e}"));
    // The runtime's training graph: the vocabulary losses fused, autodiff, the passes
    // before fusion.
    let training = codegen::training::TrainingGraph::new(lowered).unwrap_or_else(|e| panic!("{name}: {e}"));
    let request = Request::new(&training.graph, training.request.grads);
    (training.graph, request, spec.vocab)
}
