mod passes_util;
use ir::passes::{fuse, simplify, GroupKind};
use passes_util::*;

#[test]
fn explore() {
    for path in spec_files() {
        let spec = load(&path);
        let (mut lowered, pairs) = training_graph(&spec, 2, 8);
        let grads: Vec<_> = pairs.iter().map(|p| p.1).collect();
        let before = lowered.graph.node_count();
        let stats = simplify(&mut lowered.graph, &grads);
        let t0 = std::time::Instant::now();
        let f = fuse(&lowered.graph, &grads).unwrap();
        let dt = t0.elapsed();
        f.check(&lowered.graph).unwrap();
        let mut counts = [0; 4];
        for g in &f.groups { counts[match g.kind { GroupKind::Source => 0, GroupKind::Heavy(_) => 1, GroupKind::TokenLocal => 2, GroupKind::TokenReduction => 3 }] += 1; }
        println!("{}: nodes {before} -> {} ({:?}) groups {} {:?} in {:?}", name(&path), lowered.graph.node_count(), stats, f.groups.len(), counts, dt);
        if name(&path) == std::env::var("SHOW").unwrap_or_default() { println!("{}", f.explain()); }
    }
}

#[test]
fn traffic() {
    for path in spec_files() {
        let spec = load(&path);
        let unfused = ir::cost::count_spec(&spec).unwrap().traffic_per_sublayer();
        let fused = ir::passes::fused_connection_traffic(&spec).unwrap();
        println!("{}: unfused {:.3} / {:.3}  fused {:.3} / {:.3}", name(&path), unfused.0, unfused.1, fused.0, fused.1);
    }
}

#[test]
fn io() {
    let spec = load(std::path::Path::new(&format!("{}/../specs/{}.ron", env!("CARGO_MANIFEST_DIR"), std::env::var("SHOW").unwrap_or("mhc".into()))));
    let lowered = ir::lower::lower(&spec, 1, 64).unwrap();
    let g = &lowered.graph;
    let f = fuse(g, &[]).unwrap();
    let axes = f.token_axes();
    for &gid in &f.order {
        let grp = f.group(gid);
        if !matches!(grp.kind, GroupKind::TokenLocal) { continue; }
        let show = |ids: &[ir::graph::NodeId]| ids.iter().filter(|&&i| axes.is_token_shaped(g, i)).map(|&i| format!("n{}:{}{:?}/{:?}", i.index(), g.node(i).op.name(), g.node(i).shape.dims(), g.node(i).role.region)).collect::<Vec<_>>().join(" ");
        println!("{gid}: IN {}\n    OUT {}", show(&grp.inputs), show(&grp.outputs));
    }
}
