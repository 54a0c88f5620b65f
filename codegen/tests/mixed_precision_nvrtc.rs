//! bf16 mixed precision in the CUDA dialect (docs/math.md §6.12): every kernel of
//! `specs/mhc-bf16.ron` (tiny, differentiated, fused and one op per group) compiles
//! under NVRTC for sm_90 with no warnings and no spills, and the Plan really holds bf16
//! buffers and rounds in registers.

mod common;

use codegen::compile::{compile, fused_partition, one_op_per_group, Target};
use codegen::render::render_cuda;
use common::emit::spec_training_graph;

#[test]
fn bf16_spec_kernels_compile_under_nvrtc() {
    let (graph, request, _) = spec_training_graph("mhc-bf16", 2, 8, |spec| {
        spec.d_model = 16;
        spec.layers = 1;
    });
    // Kernels sized for the GPU, as the Cuda device compiles them.
    let request = request.for_target(Target::Cuda);
    let partitions =
        [("one op", one_op_per_group(&graph)), ("fused", fused_partition(&graph, &request).expect("fuses"))];
    let plans: Vec<_> = partitions
        .iter()
        .map(|(label, p)| (label, compile(&graph, p, &request).unwrap_or_else(|e| panic!("{label}: {e}"))))
        .collect();
    for (label, plan) in &plans {
        assert!(plan.buffers.iter().any(|d| d.dtype == ir::DType::Bf16), "{label}: no bf16 buffer");
        let src = render_cuda(&plan.kernels).expect("renders");
        assert!(src.contains("widen_f32_to_bf16("), "{label}: no bf16 conversion in the source");
        assert!(src.contains("widen_round_bf16("), "{label}: no cast to bf16 in registers");
    }
    if !codegen::nvrtc::is_available() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "NVRTC is required when CI=true");
        eprintln!("skipped: NVRTC is not loadable (put its lib folder on LD_LIBRARY_PATH)");
        return;
    }
    for (label, plan) in &plans {
        let src = render_cuda(&plan.kernels).expect("renders");
        let out = codegen::nvrtc::compile(&src, "sm_90").unwrap_or_else(|e| panic!("{label}: {e}"));
        assert!(out.warnings().is_empty(), "{label}: warnings {:?}", out.warnings());
        for k in &plan.kernels {
            let r =
                out.resources_of(&k.symbol()).unwrap_or_else(|| panic!("{label}: no report for {}", k.name));
            assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "{label}: {} spills", k.name);
        }
    }
}
