//! The Cuda device's gradient all-reduce across ranks (docs/distributed.md,
//! "CUDA across ranks"): one NCCL communicator per run, one GPU per rank.
//!
//! It sits beside the device rather than behind [`crate::dist::Collective`]
//! because its operands are the Plan's device buffers and it runs on the
//! device's own stream: the all-reduces queue after the gradient steps and
//! before the update steps, so nothing waits on the host between them. MPI
//! still carries everything else a run exchanges (the NCCL id at setup, stop
//! requests, the divergence check).
//!
//! `cudarc` loads libnccl at run time and panics on its first NCCL call when
//! it cannot; [`NcclComm::join`] checks that the library loads first, so a
//! machine without NCCL gets [`DistError::NoNccl`].

use super::{driver, CudaDevice, CudaError};
use crate::dist::{DistError, Group};
use crate::step::StepError;
use codegen::plan::BufferId;
use cudarc::nccl::{result, sys};
use ir::DType;

/// Whether libnccl can be loaded on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen the library; runs no NCCL code.
    unsafe { sys::is_culib_present() }
}

fn nccl(what: impl Into<String>) -> impl FnOnce(result::NcclError) -> StepError {
    let what = what.into();
    move |e| DistError::Nccl { what, code: format!("{:?}", e.0) }.into()
}

/// This rank's member of the run's NCCL communicator, bound to one device.
#[derive(Debug)]
pub struct NcclComm {
    comm: sys::ncclComm_t,
    /// The device's context, kept alive and made current to release the
    /// communicator.
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

// SAFETY: a communicator may be used from any thread as long as calls on it
// do not overlap; the executor that owns it takes `&mut self` for every step.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins `group`'s ranks in one communicator on `device`'s GPU. Rank 0
    /// creates the id and broadcasts it over `group` (MPI) behind a byte that
    /// says whether it could, so that a rank 0 without an id ends the others'
    /// wait with an error instead of a hang.
    pub fn join(device: &CudaDevice, group: &Group) -> Result<NcclComm, StepError> {
        if !nccl_available() {
            return Err(DistError::NoNccl.into());
        }
        let mut message = [0u8; 129];
        if group.is_root() {
            match result::get_uniqueid() {
                Ok(id) => {
                    message[0] = 1;
                    for (b, c) in message[1..].iter_mut().zip(id.internal) {
                        *b = c as u8;
                    }
                }
                Err(e) => eprintln!("error: rank 0: NCCL could not create the communicator's id: {:?}", e.0),
            }
        }
        group.broadcast_bytes(&mut message, 0);
        if message[0] != 1 {
            return Err(DistError::NoNcclId.into());
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (c, b) in id.internal.iter_mut().zip(&message[1..]) {
            *c = *b as std::ffi::c_char;
        }
        device.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is the one
        // every rank received; the current context is the device's.
        unsafe { result::comm_init_rank(&mut comm, group.size() as i32, id, group.rank() as i32) }
            .map_err(nccl(format!("joining rank {} of {} on the GPU", group.rank(), group.size())))?;
        Ok(NcclComm { comm, ctx: device.ctx.clone() })
    }

    /// Replaces every buffer of `buffers` (f32) on `device` by its mean across
    /// the ranks, in place: one NCCL group of all-reduces with `ncclAvg`,
    /// queued on the device's stream after the work already there.
    pub fn average(&self, device: &CudaDevice, buffers: &[BufferId]) -> Result<(), StepError> {
        let mut ops = Vec::with_capacity(buffers.len());
        for &id in buffers {
            let len = device.decl(id)?.len;
            ops.push((device.checked(id, DType::F32, len)?, len));
        }
        device.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        let stream = device.stream.cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(nccl("starting a group of all-reduces"))?;
        let mut queued = Ok(());
        for (ptr, len) in ops {
            let buf = ptr as *mut std::ffi::c_void;
            // SAFETY: `buf` addresses `len` f32 elements of the device's
            // memory (checked above); in place, as NCCL allows.
            let issued = unsafe {
                result::all_reduce(
                    buf,
                    buf,
                    len,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclAvg,
                    self.comm,
                    stream,
                )
            };
            if let Err(e) = issued {
                queued = Err(nccl("queueing a gradient all-reduce")(e));
                break;
            }
        }
        // The group is closed even after a failed call, so NCCL's group state
        // is not left open.
        let closed = result::group_end().map_err(nccl("running the gradient all-reduces"));
        queued.and(closed.map(|_| ()))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is this value's alone; its work is on the
        // device's stream, which the device synchronizes before freeing memory.
        if let Err(e) = unsafe { result::comm_destroy(self.comm) } {
            eprintln!("warning: releasing the NCCL communicator failed: {:?}", e.0);
        }
    }
}

/// The rank's Cuda executor for a data-parallel run: the driver and libnccl
/// are checked first (the same error as a single process's run without a
/// driver), then the Plan is compiled and loaded on the rank's GPU
/// ([`crate::dist::gpu_for_rank`]) and the executor joins the ranks' NCCL
/// communicator.
pub fn executor_for_rank(
    lowered: ir::lower::Lowered,
    group: &Group,
) -> Result<super::CudaExecutor, StepError> {
    if !super::driver_available() {
        return Err(CudaError::NoCudaDriver.into());
    }
    if !nccl_available() {
        return Err(DistError::NoNccl.into());
    }
    let gpus = cudarc::driver::CudaContext::device_count().map_err(driver("counting the GPUs"))?;
    let gpu = crate::dist::gpu_for_rank(
        crate::dist::local_rank(),
        crate::dist::local_ranks(),
        group.rank(),
        gpus.max(0) as usize,
    )?;
    let mut exec = super::CudaExecutor::from_lowered(lowered, gpu)?;
    exec.nccl = Some(NcclComm::join(&exec.device, group)?);
    Ok(exec)
}
