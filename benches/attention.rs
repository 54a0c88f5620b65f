//! Causal attention forward and backward alone on the Cpu device: the compiled
//! `CausalAttention` and its three gradients (docs/math.md §1.4) at one shape,
//! as a training step runs them (the Plan's steps in order, chains head by head).
//!
//! `cargo bench --bench attention -- T [B H DH ROUNDS]` (defaults: B 8, H 12,
//! DH 64, 10 rounds) prints one line: the median and best milliseconds of a
//! forward plus backward, the Plan's arena and the process's peak resident set.
//! One shape per process, so the peak is that shape's. `scripts/bench_attention.sh`
//! runs several shapes and builds side by side (docs/performance.md).

use std::time::Instant;

use codegen::cc::Compiler;
use codegen::compile::{compile, one_op_per_group, Request, Target};
use codegen::plan::BufferRole;
use ir::graph::{Graph, Init, Op, ParamClass, ParamInfo};
use ir::{DType, Shape};
use runtime::device::cpu::{CpuDevice, CpuOptions};
use runtime::device::memory::{host_peak_bytes, PlanMemory};
use runtime::device::Device;

fn arg(args: &[String], i: usize, default: usize) -> usize {
    args.get(i)
        .map_or(default, |a| a.parse().unwrap_or_else(|_| panic!("argument {i} `{a}`: a whole number")))
}

fn main() {
    // `cargo bench` passes `--bench` to harness-free targets; only numbers are ours.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let t = arg(&args, 0, 1024);
    let (b, h, dh, rounds) = (arg(&args, 1, 8), arg(&args, 2, 12), arg(&args, 3, 64), arg(&args, 4, 10));
    let mut g = Graph::new();
    let param = |g: &mut Graph, name: &str| {
        let info = ParamInfo { name: name.into(), init: Init::Zeros, class: ParamClass::Hidden };
        g.add_source(Op::Param(info), Shape::new([b, t, h, dh]), DType::F32, Some(name.into()))
    };
    let [q, k, v, d] = ["q", "k", "v", "d"].map(|n| param(&mut g, n));
    let scale = 1.0 / (dh as f64).sqrt();
    let y = g.add(Op::CausalAttention { scale, rope_base: Some(10000.0) }, &[q, k, v]).expect("attention");
    g.set_output("y", y);
    for (wrt, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        let op = Op::CausalAttentionGrad { scale, rope_base: Some(10000.0), wrt };
        let grad = g.add(op, &[q, k, v, d]).expect("attention gradient");
        g.set_output(name, grad);
    }
    let request = Request::new(&g, Vec::new()).for_target(Target::Cpu);
    let plan = compile(&g, &one_op_per_group(&g), &request).expect("compiles");
    let arena = PlanMemory::of(&plan, Device::Cpu).arena_bytes;
    let compiler = Compiler::from_env().expect("a C compiler");
    let mut device = CpuDevice::with_options(plan, &compiler, CpuOptions::default()).expect("loads");
    let n = b * t * h * dh;
    for (i, name) in ["q", "k", "v", "d"].into_iter().enumerate() {
        let id = device.find(&BufferRole::Param { name: name.into() }).expect("a param buffer");
        let data: Vec<f32> = (0..n).map(|j| ((j * 7919 + i * 104729) % 2001) as f32 / 1000.0 - 1.0).collect();
        device.write_f32(id, &data).expect("writes");
    }
    device.run().expect("warm-up");
    let mut ms: Vec<f64> = (0..rounds.max(1))
        .map(|_| {
            let start = Instant::now();
            device.run().expect("runs");
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    println!(
        "attention B {b} H {h} T {t} dh {dh}, {} threads: fwd+bwd median {:.2} ms (best {:.2}), arena {:.1} MiB, \
         peak resident {:.1} MiB",
        device.threads(),
        ms[ms.len() / 2],
        ms[0],
        mib(arena),
        host_peak_bytes().map_or(f64::NAN, mib)
    );
}
