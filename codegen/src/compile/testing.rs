//! The codegen tests' oracle runner (docs/architecture.md §9.4), behind the
//! `testing` feature: it runs a Plan sequentially on the host, so that the
//! integration tests can check compiled Plans against the reference without the
//! runtime, and production builds do not carry it.

use std::collections::HashMap;
use std::ffi::c_void;

use ir::DType;

use super::CompileError;
use crate::cc::Compiler;
use crate::plan::{BufferId, BufferRole, Gemm, Plan, Step};

/// A [`Gemm`] of f32 operands as plain loops (the test runner's library product).
///
/// # Safety
/// Every batch entry of every operand lies inside the buffer `ptrs` gives for it.
unsafe fn naive_gemm(g: &Gemm, ptrs: &[*mut c_void]) {
    // SAFETY: the offsets lie inside the buffers (the caller's contract).
    let (pa, pb, pc) = unsafe {
        (
            (ptrs[g.a.0] as *const f32).add(g.offsets[0]),
            (ptrs[g.b.0] as *const f32).add(g.offsets[1]),
            (ptrs[g.c.0] as *mut f32).add(g.offsets[2]),
        )
    };
    for bt in 0..g.batch {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0.0f32;
                for kk in 0..g.k {
                    let ai = if g.trans_a { kk * g.m + i } else { i * g.k + kk };
                    let bi = if g.trans_b { j * g.k + kk } else { kk * g.n + j };
                    // SAFETY: indices stay within the operands' batch entries.
                    acc += unsafe { *pa.add(bt * g.stride_a + ai) * *pb.add(bt * g.stride_b + bi) };
                }
                // SAFETY: as above, for the output.
                unsafe {
                    let c = pc.add(bt * g.stride_c + i * g.n + j);
                    *c = if g.accumulate { *c + acc } else { acc };
                }
            }
        }
    }
}

/// Host data of one buffer for [`run_on_cpu_for_tests`].
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl HostData {
    fn zeros(dtype: DType, len: usize) -> Result<HostData, String> {
        match dtype {
            DType::F32 => Ok(HostData::F32(vec![0.0; len])),
            DType::I32 => Ok(HostData::I32(vec![0; len])),
            other => Err(format!("the test runner holds f32 and i32 buffers, not {other}")),
        }
    }

    fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }

    fn ptr(&mut self, offset: usize) -> *mut c_void {
        match self {
            HostData::F32(v) => v[offset..].as_mut_ptr().cast(),
            HostData::I32(v) => v[offset..].as_mut_ptr().cast(),
        }
    }

    /// The f32 values (empty for i32 data).
    pub fn as_f32(&self) -> &[f32] {
        match self {
            HostData::F32(v) => v,
            HostData::I32(_) => &[],
        }
    }
}

/// Runs a Plan sequentially on the host: kernels through the system C compiler
/// (each over its whole grid in one call), GEMMs as plain loops, scratch
/// buffers inside per-dtype arenas laid out as the Plan says (so an arena
/// placement error shows up as wrong values). `inputs` fill buffers before the
/// run (parameters, the token window); constants are filled from their role.
/// Returns every buffer's final contents (scratch buffers: their arena range).
///
/// This is the oracle runner of the codegen tests; the runtime's Cpu device
/// executes Plans with threads and an optimized GEMM.
pub fn run_on_cpu_for_tests(
    plan: &Plan,
    compiler: &Compiler,
    inputs: &[(BufferId, HostData)],
) -> Result<Vec<HostData>, CompileError> {
    let err = |id: usize, message: String| CompileError::Buffer { id, message };
    let lib = compiler.compile_kernels(&plan.kernels)?;
    let mut owned: Vec<Option<HostData>> = Vec::with_capacity(plan.buffers.len());
    let mut arena_len: HashMap<DType, usize> = HashMap::new();
    for d in &plan.buffers {
        match d.role {
            BufferRole::Scratch { offset } => {
                let e = arena_len.entry(d.dtype).or_default();
                *e = (*e).max(offset + d.len);
                owned.push(None);
            }
            BufferRole::Constant { value } => owned.push(Some(match d.dtype {
                DType::I32 => HostData::I32(vec![value as i32; d.len]),
                _ => HostData::F32(vec![value as f32; d.len]),
            })),
            _ => owned.push(Some(HostData::zeros(d.dtype, d.len).map_err(|m| err(d.id.0, m))?)),
        }
    }
    let mut arenas: HashMap<DType, HostData> = HashMap::new();
    for (&dtype, &len) in &arena_len {
        arenas.insert(dtype, HostData::zeros(dtype, len).map_err(|m| err(usize::MAX, m))?);
    }
    for (id, data) in inputs {
        let d = plan.buffers.get(id.0).ok_or_else(|| err(id.0, "no such buffer".into()))?;
        if data.len() != d.len
            || HostData::zeros(d.dtype, 0).map(|z| std::mem::discriminant(&z))
                != Ok(std::mem::discriminant(data))
        {
            return Err(err(id.0, format!("expected {} {} values", d.len, d.dtype)));
        }
        match &mut owned[id.0] {
            Some(slot) => *slot = data.clone(),
            None => return Err(err(id.0, "is scratch and cannot be an input".into())),
        }
    }
    let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(plan.buffers.len());
    for (d, o) in plan.buffers.iter().zip(owned.iter_mut()) {
        ptrs.push(match (o, &d.role) {
            (Some(data), _) => data.ptr(0),
            (None, BufferRole::Scratch { offset }) => {
                arenas.get_mut(&d.dtype).expect("arena sized above").ptr(*offset)
            }
            (None, _) => unreachable!("only scratch buffers live in arenas"),
        });
    }
    for step in &plan.steps {
        match step {
            Step::Kernel { kernel, args } => {
                let k = &plan.kernels[*kernel];
                let entry = lib.entry(&k.name)?;
                let a: Vec<*mut c_void> = args.iter().map(|id| ptrs[id.0]).collect();
                // SAFETY: every argument points to a live allocation of at least the
                // parameter's length and element type (sizes come from the same Plan),
                // and the call covers the whole grid on this thread only.
                unsafe { entry.call(&a, 0, k.grid.items() as i64) };
            }
            // SAFETY: the operands lie inside the buffers (checked by the devices' Plan check).
            Step::Gemm(g) => unsafe { naive_gemm(g, &ptrs) },
            Step::Zero { buffer } => {
                let d = &plan.buffers[buffer.0];
                // SAFETY: the buffer holds `len` elements of its dtype; zero bits are zero.
                unsafe {
                    std::ptr::write_bytes(ptrs[buffer.0].cast::<u8>(), 0, d.len * d.dtype.size_bytes())
                };
            }
            Step::MoeRoute(r) => {
                let lens = [r.assignments, r.assignments, r.assignments, r.experts];
                for (id, len) in [r.idx, r.rows, r.tokens, r.counts].into_iter().zip(lens) {
                    let d = &plan.buffers[id.0];
                    if d.dtype != DType::I32 || d.len < len {
                        return Err(err(id.0, format!("routing needs {len} i32 values")));
                    }
                }
                // SAFETY: i32 buffers of at least these lengths (checked above); the input is
                // copied first, and the arena keeps the outputs, alive at once, apart.
                let i32s = |id: BufferId, len| unsafe {
                    std::slice::from_raw_parts_mut(ptrs[id.0].cast::<i32>(), len)
                };
                let idx = i32s(r.idx, r.assignments).to_vec();
                let (rows, tokens, counts) =
                    (i32s(r.rows, r.assignments), i32s(r.tokens, r.assignments), i32s(r.counts, r.experts));
                ir::exec::moe::route_into(&idx, r.k, r.experts, r.capacity, rows, tokens, counts)
                    .map_err(|m| err(r.idx.0, m))?;
            }
            Step::GroupedGemm(g) => {
                let d = &plan.buffers[g.counts.0];
                if d.dtype != DType::I32 || d.len < g.groups {
                    return Err(err(g.counts.0, format!("group sizes need {} i32 values", g.groups)));
                }
                // SAFETY: checked above.
                let counts = unsafe { std::slice::from_raw_parts(ptrs[g.counts.0].cast::<i32>(), g.groups) };
                let (products, zeroed) = g.products(counts).map_err(|m| err(g.counts.0, m))?;
                for r in zeroed {
                    // SAFETY: the ranges lie inside c's extent (`GroupedGemm::products`).
                    unsafe { std::ptr::write_bytes(ptrs[g.c.0].cast::<f32>().add(r.start), 0, r.len()) };
                }
                for p in &products {
                    // SAFETY: each product lies inside the grouped product's extents.
                    unsafe { naive_gemm(p, &ptrs) };
                }
            }
        }
    }
    let mut out = Vec::with_capacity(plan.buffers.len());
    for (d, o) in plan.buffers.iter().zip(owned) {
        out.push(match (o, &d.role) {
            (Some(data), _) => data,
            (None, BufferRole::Scratch { offset }) => match &arenas[&d.dtype] {
                HostData::F32(v) => HostData::F32(v[*offset..offset + d.len].to_vec()),
                HostData::I32(v) => HostData::I32(v[*offset..offset + d.len].to_vec()),
            },
            (None, _) => unreachable!("only scratch buffers live in arenas"),
        });
    }
    Ok(out)
}
