//! The embedded form of a [`Plan`]: JSON written by `widen build` and read back
//! by the standalone binary before it loads the Plan on a device.
//!
//! The Plan and the kernel IR are serializable where they are defined
//! (`codegen`'s `serde` feature, which this crate turns on), so a field or
//! variant added there travels without a second description here. Float
//! literals and constants travel as their IEEE bit patterns
//! (`codegen::kernel`), because JSON has no infinities or NaNs (masking
//! constants are `-inf`) and because the binary must run bit for bit the Plan
//! that was compiled.

use codegen::plan::Plan;

/// Failures of encoding or decoding an embedded Plan.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("cannot encode the plan: {0}")]
    Encode(serde_json::Error),
    #[error("the embedded plan is not readable: {0}")]
    Decode(serde_json::Error),
}

/// The Plan as compact JSON.
pub fn encode_plan(plan: &Plan) -> Result<String, CodecError> {
    serde_json::to_string(plan).map_err(CodecError::Encode)
}

/// The Plan written by [`encode_plan`].
pub fn decode_plan(json: &str) -> Result<Plan, CodecError> {
    serde_json::from_str(json).map_err(CodecError::Decode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use codegen::kernel::{f32 as lit_f32, item, Access, Grid, KernelBuilder};
    use codegen::plan::{
        BufferDecl, BufferId, BufferRole, Chain, Gemm, GroupedForm, GroupedGemm, MoeRoute, Step,
    };
    use ir::DType;

    /// A Plan touching every kind of step and role, with a chain and with
    /// literals JSON cannot spell (infinities, NaN, negative zero).
    fn sample_plan() -> Plan {
        let mut k = KernelBuilder::new("mask", Grid::block_per_item(4, 32));
        let x = k.param("x", DType::F32, Access::Read, 4);
        let y = k.param("y", DType::F32, Access::Write, 4);
        let v = k.let_("v", x.at(item()).max(lit_f32(f32::NEG_INFINITY)) * lit_f32(-0.0));
        let w = k.let_("w", codegen::kernel::select(v.clone().lt(lit_f32(f32::NAN)), v, lit_f32(1.5)));
        k.store(&y, item(), w);
        let kernel = k.finish();
        let decl = |id: usize, role: BufferRole| BufferDecl {
            id: BufferId(id),
            len: 4,
            dtype: DType::F32,
            role,
            node: Some(id),
        };
        Plan {
            kernels: vec![kernel],
            steps: vec![
                Step::Zero { buffer: BufferId(1) },
                Step::Kernel { kernel: 0, args: vec![BufferId(0), BufferId(1)] },
                Step::Gemm(Gemm {
                    a: BufferId(0),
                    b: BufferId(2),
                    c: BufferId(3),
                    batch: 1,
                    m: 2,
                    n: 2,
                    k: 2,
                    trans_a: false,
                    trans_b: true,
                    stride_a: 0,
                    stride_b: 0,
                    stride_c: 4,
                    offsets: [0, 0, 0],
                    accumulate: true,
                }),
                Step::MoeRoute(MoeRoute {
                    idx: BufferId(5),
                    rows: BufferId(6),
                    tokens: BufferId(7),
                    counts: BufferId(8),
                    assignments: 4,
                    k: 2,
                    experts: 3,
                    capacity: Some(2),
                }),
                Step::GroupedGemm(GroupedGemm {
                    form: GroupedForm::WeightGrad,
                    a: BufferId(0),
                    b: BufferId(2),
                    c: BufferId(3),
                    counts: BufferId(8),
                    groups: 3,
                    m: 4,
                    routed: 4,
                    k: 1,
                    n: 1,
                    trans_b: true,
                }),
            ],
            buffers: vec![
                decl(0, BufferRole::Param { name: "w".into() }),
                decl(1, BufferRole::Scratch { offset: 8 }),
                decl(2, BufferRole::Constant { value: f64::NEG_INFINITY }),
                decl(3, BufferRole::Output { name: "loss".into() }),
                decl(4, BufferRole::OptState { name: "opt.w.m".into() }),
                BufferDecl { dtype: DType::I32, ..decl(5, BufferRole::Scratch { offset: 0 }) },
                BufferDecl { dtype: DType::I32, ..decl(6, BufferRole::Scratch { offset: 16 }) },
                BufferDecl { dtype: DType::I32, ..decl(7, BufferRole::Scratch { offset: 32 }) },
                BufferDecl { dtype: DType::I32, ..decl(8, BufferRole::Scratch { offset: 48 }) },
            ],
            arena_len: 12,
            update_start: Some(1),
            chains: vec![Chain { start: 1, end: 3, entries: 1 }],
        }
    }

    #[test]
    fn plans_round_trip_bit_for_bit() {
        let plan = sample_plan();
        let json = encode_plan(&plan).unwrap();
        let back = decode_plan(&json).unwrap();
        assert_eq!(back.steps, plan.steps);
        assert_eq!(back.buffers, plan.buffers);
        assert_eq!(back.arena_len, plan.arena_len);
        assert_eq!(back.chains, plan.chains);
        // `PartialEq` says NaN != NaN and -0.0 == 0.0; the debug form tells them apart.
        let shown = format!("{:?}", plan.kernels);
        assert!(shown.contains("NaN") && shown.contains("-0.0") && shown.contains("-inf"), "{shown}");
        assert_eq!(format!("{:?}", back.kernels), shown);
    }

    /// The JSON of a package generated before the Plan was serializable in
    /// `codegen` (the Plan's fields in another order) reads back as the same Plan.
    #[test]
    fn plans_in_the_earlier_field_order_read_back_alike() {
        let plan = sample_plan();
        fn field<T: serde::Serialize>(v: &T) -> String {
            serde_json::to_string(v).unwrap()
        }
        let earlier = format!(
            "{{\"kernels\":{},\"steps\":{},\"buffers\":{},\"arena_len\":{},\"update_start\":{},\"chains\":{}}}",
            field(&plan.kernels),
            field(&plan.steps),
            field(&plan.buffers),
            field(&plan.arena_len),
            field(&plan.update_start),
            field(&plan.chains),
        );
        assert_ne!(earlier, encode_plan(&plan).unwrap(), "the test must exercise another order");
        let back = decode_plan(&earlier).unwrap();
        assert_eq!(format!("{back:?}"), format!("{plan:?}"));
    }

    /// Floats are written as their bit patterns, as the earlier embedded form
    /// wrote them: `-inf` and NaN, which JSON cannot spell, survive.
    #[test]
    fn floats_are_written_as_bit_patterns() {
        let json = encode_plan(&sample_plan()).unwrap();
        assert!(json.contains(&format!("{{\"F32\":{}}}", f32::NEG_INFINITY.to_bits())), "{json}");
        assert!(json.contains(&format!("{{\"F32\":{}}}", f32::NAN.to_bits())), "{json}");
        assert!(
            json.contains(&format!("{{\"Constant\":{{\"value\":{}}}}}", f64::NEG_INFINITY.to_bits())),
            "{json}"
        );
    }

    #[test]
    fn truncated_json_is_a_decode_error() {
        let json = encode_plan(&sample_plan()).unwrap();
        let err = decode_plan(&json[..json.len() / 2]).unwrap_err();
        assert!(matches!(err, CodecError::Decode(_)), "{err}");
    }
}
