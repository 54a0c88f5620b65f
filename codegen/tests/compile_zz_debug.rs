mod emit_support;
use codegen::compile::{compile, fused_partition, HostData, Request};
use codegen::plan::BufferRole;
use emit_support::{run_plan, rel_err, Rng, Sources};
use ir::exec::Value;
use std::path::Path;

#[test]
fn debug_xhc() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/xhc.ron");
    let mut spec = ir::spec::load_spec(&path).unwrap();
    spec.d_model = 16; spec.layers = 1;
    let vocab = spec.vocab;
    let lowered = ir::lower::lower(&spec, 2, 8).unwrap();
    let mut graph = lowered.graph;
    let params = graph.params();
    let grads = ir::autodiff::grad(&mut graph, lowered.loss, &params).unwrap();
    ir::passes::simplify(&mut graph, &grads);
    let request = Request::new(&graph, params.into_iter().zip(grads).collect());
    let mut rng = Rng::new(17);
    let src = Sources::random(&graph, &mut rng, 0.05, &|id, n| { let mut r = Rng::new(id.index() as u64 + 101); (0..n).map(|_| r.below(vocab) as i32).collect() });
    let part = fused_partition(&graph, &request).unwrap();
    let mut plan = compile(&graph, &part, &request).unwrap();
    let mut off = 0; let mut offi = 0;
    for b in plan.buffers.iter_mut() { if let BufferRole::Scratch{offset} = &mut b.role { if b.dtype == ir::DType::F32 { *offset = off; off += b.len; } else { *offset = offi; offi += b.len; } } }
    plan.arena_len = off;
    let outs = run_plan(&graph, &plan, &src);
    let nodes: Vec<_> = plan.buffers.iter().filter_map(|b| b.node).collect();
    let ids: Vec<_> = graph.node_ids().into_iter().filter(|id| nodes.contains(&id.index())).collect();
    let want = ir::exec::run::<f32>(&graph, &src.values, &ids).unwrap();
    let mut done = std::collections::HashSet::new();
    for (si, step) in plan.steps.iter().enumerate() {
        let (label, written): (String, Vec<usize>) = match step {
            codegen::plan::Step::Kernel{kernel, args} => { let k = &plan.kernels[*kernel]; (k.name.clone(), args.iter().zip(&k.params).filter(|(_, p)| p.access.writable()).map(|(a, _)| a.0).collect()) }
            codegen::plan::Step::Gemm(g) => (format!("gemm {:?}", g), vec![g.c.0]),
            _ => continue,
        };
        for a in written { let b = &plan.buffers[a]; if let Some(n) = b.node { if done.insert(a) {
            let id = ids.iter().find(|i| i.index()==n).unwrap();
            if let (HostData::F32(g), Value::Float(t)) = (&outs[a], &want[id]) {
                let e = rel_err(g, &t.data);
                if e > 1e-3 { println!("step {si} {label} buf {a} node %{n} {} err {e}", graph.node(*id).op.name()); }
            }
        }}}
    }
    let _ = part;
}
#[test]
fn debug_xhc_group() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/xhc.ron");
    let mut spec = ir::spec::load_spec(&path).unwrap();
    spec.d_model = 16; spec.layers = 1;
    let lowered = ir::lower::lower(&spec, 2, 8).unwrap();
    let mut graph = lowered.graph;
    let params = graph.params();
    let grads = ir::autodiff::grad(&mut graph, lowered.loss, &params).unwrap();
    ir::passes::simplify(&mut graph, &grads);
    let request = Request::new(&graph, params.into_iter().zip(grads).collect());
    let part = fused_partition(&graph, &request).unwrap();
    for g in &part { if g.iter().any(|i| i.index()==329) {
        for &id in g { let n = graph.node(id); println!("%{} {:?} {} <- {:?}", id.index(), n.op, n.shape, graph.inputs(id).iter().map(|i| (i.index(), graph.node(*i).shape.to_string())).collect::<Vec<_>>()); }
    }}
    let plan = compile(&graph, &part, &request).unwrap();
    let k = plan.kernels.iter().find(|k| k.name.starts_with("g034")).unwrap();
    println!("{:?} params {:?}", k.grid, k.params.iter().map(|p| (&p.name, p.len)).collect::<Vec<_>>());
}
#[test]
fn debug_xhc_steps() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/xhc.ron");
    let mut spec = ir::spec::load_spec(&path).unwrap();
    spec.d_model = 16; spec.layers = 1;
    let lowered = ir::lower::lower(&spec, 2, 8).unwrap();
    let mut graph = lowered.graph;
    let params = graph.params();
    let grads = ir::autodiff::grad(&mut graph, lowered.loss, &params).unwrap();
    ir::passes::simplify(&mut graph, &grads);
    let request = Request::new(&graph, params.into_iter().zip(grads).collect());
    let part = fused_partition(&graph, &request).unwrap();
    let plan = compile(&graph, &part, &request).unwrap();
    for i in [326usize, 327, 328] { let id = graph.node_ids().into_iter().find(|x| x.index()==i).unwrap(); let n = graph.node(id); println!("%{i} {:?} {} <- {:?}", n.op, n.shape, graph.inputs(id)); }
    for (si, s) in plan.steps.iter().enumerate().take(48).skip(38) {
        match s { codegen::plan::Step::Kernel{kernel, args} => println!("{si} {} {:?} {:?}", plan.kernels[*kernel].name, args.iter().map(|a| plan.buffers[a.0].node).collect::<Vec<_>>(), plan.kernels[*kernel].grid),
        other => println!("{si} {:?}", other) }
    }
    for b in [135usize, 137] { println!("{:?}", plan.buffers[b]); }
}
#[test]
fn debug_mhc_spill() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/vwn-r4.ron");
    let mut spec = ir::spec::load_spec(&path).unwrap();
    spec.d_model = 16; spec.layers = 1;
    let lowered = ir::lower::lower(&spec, 2, 8).unwrap();
    let mut graph = lowered.graph;
    let params = graph.params();
    let grads = ir::autodiff::grad(&mut graph, lowered.loss, &params).unwrap();
    ir::passes::simplify(&mut graph, &grads);
    let request = Request::new(&graph, params.into_iter().zip(grads).collect());
    let part = fused_partition(&graph, &request).unwrap();
    let plan = compile(&graph, &part, &request).unwrap();
    let k = plan.kernels.iter().find(|k| k.name.starts_with("g039")).unwrap();
    let src = codegen::render::render_cuda(std::slice::from_ref(k)).unwrap();
    std::fs::write("/tmp/dbg/g010.cu", &src).unwrap();
    let out = codegen::nvrtc::compile(&src, "sm_90").unwrap();
    println!("{:?}", out.resources);
}
#[test]
fn debug_compile_file() {
    for f in ["/tmp/dbg/a.cu", "/tmp/dbg/b.cu", "/tmp/dbg/c.cu"] {
        if let Ok(src) = std::fs::read_to_string(f) {
            match codegen::nvrtc::compile(&src, "sm_90") { Ok(out) => println!("{f}: {:?}", out.resources), Err(e) => println!("{f}: {e}") }
        }
    }
}
