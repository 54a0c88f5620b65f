//! The embedded form of a [`Plan`]: JSON written by `widen build` and read back
//! by the standalone binary before it loads the Plan on a device.
//!
//! The Plan and kernel IR types belong to `codegen` and carry no serde
//! derives, so this module describes them with serde's *remote* derive: each
//! `…Def` below mirrors one codegen type field for field, and serde checks at
//! compile time that the mirror constructs and destructures the real type (a
//! field or variant added to codegen without its mirror is a compile error
//! here, never a silently dropped field).
//!
//! Float literals and constants travel as their IEEE bit patterns, because
//! JSON has no infinities or NaNs (masking constants are `-inf`) and because
//! the binary must run bit for bit the Plan that was compiled.

use codegen::kernel::{
    Access, BinOp, Buf, CmpOp, Expr, Grid, Kernel, MathFn, Param, ReduceOp, Stmt, Ty, UnOp, Unroll,
};
use codegen::plan::{
    BufferDecl, BufferId, BufferRole, Chain, Gemm, GroupedForm, GroupedGemm, MoeRoute, Plan, Step,
};
use ir::DType;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
    let mut out = Vec::new();
    PlanDef::serialize(plan, &mut serde_json::Serializer::new(&mut out)).map_err(CodecError::Encode)?;
    // serde_json writes UTF-8 only.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// The Plan written by [`encode_plan`].
pub fn decode_plan(json: &str) -> Result<Plan, CodecError> {
    PlanDef::deserialize(&mut serde_json::Deserializer::from_str(json)).map_err(CodecError::Decode)
}

/// `#[serde(with = …)]` adapters for a `Vec` of a remote type: serde's remote
/// derive covers a type itself, not containers of it.
macro_rules! remote_vec {
    ($module:ident, $ty:ty, $def:ident) => {
        mod $module {
            use super::*;

            struct Ser<'a>(&'a $ty);

            impl Serialize for Ser<'_> {
                fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    $def::serialize(self.0, s)
                }
            }

            struct De($ty);

            impl<'de> Deserialize<'de> for De {
                fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                    $def::deserialize(d).map(De)
                }
            }

            pub fn serialize<S: Serializer>(v: &[$ty], s: S) -> Result<S::Ok, S::Error> {
                s.collect_seq(v.iter().map(Ser))
            }

            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<$ty>, D::Error> {
                Ok(Vec::<De>::deserialize(d)?.into_iter().map(|x| x.0).collect())
            }
        }
    };
}

remote_vec!(vec_kernel, Kernel, KernelDef);
remote_vec!(vec_param, Param, ParamDef);
remote_vec!(vec_stmt, Stmt, StmtDef);
remote_vec!(vec_expr, Expr, ExprDef);
remote_vec!(vec_step, Step, StepDef);
remote_vec!(vec_buffer, BufferDecl, BufferDeclDef);
remote_vec!(vec_buffer_id, BufferId, BufferIdDef);
remote_vec!(vec_chain, Chain, ChainDef);

/// A boxed sub-expression.
mod boxed_expr {
    use super::*;

    pub fn serialize<S: Serializer>(e: &Expr, s: S) -> Result<S::Ok, S::Error> {
        ExprDef::serialize(e, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Box<Expr>, D::Error> {
        ExprDef::deserialize(d).map(Box::new)
    }
}

/// An `f32` as its bit pattern.
mod f32_bits {
    use super::*;

    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(v.to_bits())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        u32::deserialize(d).map(f32::from_bits)
    }
}

/// An `f64` as its bit pattern.
mod f64_bits {
    use super::*;

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(v.to_bits())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        u64::deserialize(d).map(f64::from_bits)
    }
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Plan")]
struct PlanDef {
    #[serde(with = "vec_kernel")]
    kernels: Vec<Kernel>,
    #[serde(with = "vec_step")]
    steps: Vec<Step>,
    #[serde(with = "vec_buffer")]
    buffers: Vec<BufferDecl>,
    arena_len: usize,
    update_start: Option<usize>,
    #[serde(with = "vec_chain")]
    chains: Vec<Chain>,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Chain")]
struct ChainDef {
    start: usize,
    end: usize,
    entries: usize,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "BufferId")]
struct BufferIdDef(usize);

#[derive(Serialize, Deserialize)]
#[serde(remote = "BufferRole")]
enum BufferRoleDef {
    Param {
        name: String,
    },
    Grad {
        name: String,
    },
    Input {
        name: String,
    },
    Output {
        name: String,
    },
    Constant {
        #[serde(with = "f64_bits")]
        value: f64,
    },
    OptState {
        name: String,
    },
    Scratch {
        offset: usize,
    },
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "BufferDecl")]
struct BufferDeclDef {
    #[serde(with = "BufferIdDef")]
    id: BufferId,
    len: usize,
    dtype: DType,
    #[serde(with = "BufferRoleDef")]
    role: BufferRole,
    node: Option<usize>,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Gemm")]
struct GemmDef {
    #[serde(with = "BufferIdDef")]
    a: BufferId,
    #[serde(with = "BufferIdDef")]
    b: BufferId,
    #[serde(with = "BufferIdDef")]
    c: BufferId,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    stride_a: usize,
    stride_b: usize,
    stride_c: usize,
    offsets: [usize; 3],
    accumulate: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Step")]
enum StepDef {
    Kernel {
        kernel: usize,
        #[serde(with = "vec_buffer_id")]
        args: Vec<BufferId>,
    },
    Gemm(#[serde(with = "GemmDef")] Gemm),
    Zero {
        #[serde(with = "BufferIdDef")]
        buffer: BufferId,
    },
    MoeRoute(#[serde(with = "MoeRouteDef")] MoeRoute),
    GroupedGemm(#[serde(with = "GroupedGemmDef")] GroupedGemm),
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "MoeRoute")]
struct MoeRouteDef {
    #[serde(with = "BufferIdDef")]
    idx: BufferId,
    #[serde(with = "BufferIdDef")]
    rows: BufferId,
    #[serde(with = "BufferIdDef")]
    tokens: BufferId,
    #[serde(with = "BufferIdDef")]
    counts: BufferId,
    assignments: usize,
    k: usize,
    experts: usize,
    capacity: Option<usize>,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "GroupedForm")]
enum GroupedFormDef {
    Rows,
    WeightGrad,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "GroupedGemm")]
struct GroupedGemmDef {
    #[serde(with = "GroupedFormDef")]
    form: GroupedForm,
    #[serde(with = "BufferIdDef")]
    a: BufferId,
    #[serde(with = "BufferIdDef")]
    b: BufferId,
    #[serde(with = "BufferIdDef")]
    c: BufferId,
    #[serde(with = "BufferIdDef")]
    counts: BufferId,
    groups: usize,
    m: usize,
    routed: usize,
    k: usize,
    n: usize,
    trans_b: bool,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Kernel")]
struct KernelDef {
    name: String,
    #[serde(with = "vec_param")]
    params: Vec<Param>,
    #[serde(with = "GridDef")]
    grid: Grid,
    #[serde(with = "vec_stmt")]
    body: Vec<Stmt>,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Param")]
struct ParamDef {
    name: String,
    dtype: DType,
    #[serde(with = "AccessDef")]
    access: Access,
    len: usize,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Access")]
enum AccessDef {
    Read,
    Write,
    ReadWrite,
    WriteThenRead,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Grid")]
enum GridDef {
    ThreadPerItem { n: usize, block: u32 },
    BlockPerItem { n: usize, threads: u32 },
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "ReduceOp")]
enum ReduceOpDef {
    Sum,
    Max,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Unroll")]
enum UnrollDef {
    Auto,
    Full,
    Never,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Stmt")]
enum StmtDef {
    Let {
        var: String,
        #[serde(with = "TyDef")]
        ty: Ty,
        #[serde(with = "ExprDef")]
        expr: Expr,
    },
    Var {
        var: String,
        #[serde(with = "TyDef")]
        ty: Ty,
        #[serde(with = "ExprDef")]
        init: Expr,
    },
    Assign {
        var: String,
        #[serde(with = "ExprDef")]
        value: Expr,
    },
    LocalArray {
        var: String,
        #[serde(with = "TyDef")]
        ty: Ty,
        len: usize,
    },
    Store {
        #[serde(with = "BufDef")]
        target: Buf,
        #[serde(with = "ExprDef")]
        index: Expr,
        #[serde(with = "ExprDef")]
        value: Expr,
    },
    AccumStore {
        #[serde(with = "BufDef")]
        target: Buf,
        #[serde(with = "ExprDef")]
        index: Expr,
        #[serde(with = "ExprDef")]
        value: Expr,
    },
    For {
        var: String,
        #[serde(with = "ExprDef")]
        start: Expr,
        #[serde(with = "ExprDef")]
        end: Expr,
        step: i64,
        #[serde(with = "UnrollDef")]
        unroll: Unroll,
        #[serde(with = "vec_stmt")]
        body: Vec<Stmt>,
    },
    If {
        #[serde(with = "ExprDef")]
        cond: Expr,
        #[serde(with = "vec_stmt")]
        then: Vec<Stmt>,
        #[serde(with = "vec_stmt")]
        else_: Vec<Stmt>,
    },
    Comment(String),
    BlockReduce {
        var: String,
        #[serde(with = "ReduceOpDef")]
        op: ReduceOp,
        #[serde(with = "ExprDef")]
        value: Expr,
    },
    Barrier,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Ty")]
enum TyDef {
    F32,
    F64,
    I32,
    I64,
    Bool,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Buf")]
enum BufDef {
    Param {
        name: String,
        dtype: DType,
    },
    Local {
        name: String,
        #[serde(with = "TyDef")]
        ty: Ty,
    },
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "UnOp")]
enum UnOpDef {
    Neg,
    Not,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "BinOp")]
enum BinOpDef {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    And,
    Or,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "CmpOp")]
enum CmpOpDef {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "MathFn")]
enum MathFnDef {
    Exp,
    Log,
    Tanh,
    Sqrt,
    Rsqrt,
    Abs,
    Sin,
    Cos,
    Pow,
    Max,
    Min,
    RoundBf16,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "Expr")]
enum ExprDef {
    F32(#[serde(with = "f32_bits")] f32),
    F64(#[serde(with = "f64_bits")] f64),
    I32(i32),
    I64(i64),
    Bool(bool),
    Var {
        name: String,
        #[serde(with = "TyDef")]
        ty: Ty,
    },
    Item,
    Lane,
    Load {
        #[serde(with = "BufDef")]
        src: Buf,
        #[serde(with = "boxed_expr")]
        index: Box<Expr>,
    },
    Unary {
        #[serde(with = "UnOpDef")]
        op: UnOp,
        #[serde(with = "boxed_expr")]
        arg: Box<Expr>,
    },
    Binary {
        #[serde(with = "BinOpDef")]
        op: BinOp,
        #[serde(with = "boxed_expr")]
        lhs: Box<Expr>,
        #[serde(with = "boxed_expr")]
        rhs: Box<Expr>,
    },
    Cmp {
        #[serde(with = "CmpOpDef")]
        op: CmpOp,
        #[serde(with = "boxed_expr")]
        lhs: Box<Expr>,
        #[serde(with = "boxed_expr")]
        rhs: Box<Expr>,
    },
    Select {
        #[serde(with = "boxed_expr")]
        cond: Box<Expr>,
        #[serde(with = "boxed_expr")]
        then: Box<Expr>,
        #[serde(with = "boxed_expr")]
        else_: Box<Expr>,
    },
    Cast {
        #[serde(with = "TyDef")]
        ty: Ty,
        #[serde(with = "boxed_expr")]
        arg: Box<Expr>,
    },
    Call {
        #[serde(with = "MathFnDef")]
        f: MathFn,
        #[serde(with = "vec_expr")]
        args: Vec<Expr>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use codegen::kernel::{f32 as lit_f32, item, KernelBuilder};

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

    #[test]
    fn truncated_json_is_a_decode_error() {
        let json = encode_plan(&sample_plan()).unwrap();
        let err = decode_plan(&json[..json.len() / 2]).unwrap_err();
        assert!(matches!(err, CodecError::Decode(_)), "{err}");
    }
}
