//! [`Collective`] over MPI (the `mpi` cargo feature; Open MPI through the `mpi`
//! crate).
//!
//! **Faults.** MPI's default error handler ends the job on a failed call. A rank
//! that returns an error calls [`Collective::abort`] (`MPI_Abort`), which ends
//! every rank. A rank that dies (a crash, `kill -9`) leaves the launcher to end
//! the others: `mpirun` does so as soon as a rank exits without finalizing MPI.
//! What neither covers is a rank that stops answering while alive (a stuck
//! device, a stopped process): the others would wait in their next all-reduce
//! forever. A [`Watchdog`] bounds that wait: a collective (or a device's
//! NCCL all-reduces, [`super::Group::waiting_on_peers`]) that has not returned
//! after [`timeout`] (`WIDEN_MPI_TIMEOUT_S`, default [`DEFAULT_TIMEOUT_S`])
//! prints which wait it was and exits the process, which makes the launcher
//! end the job. The bound must
//! cover the longest a rank legitimately runs between collectives while the
//! others wait: rank 0 writing a checkpoint, and the first step, where each
//! rank compiles its Plan.

use super::{Collective, Reduce, Watchdog};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use std::time::Duration;

/// The watchdog's bound on one collective when `WIDEN_MPI_TIMEOUT_S` is unset.
pub const DEFAULT_TIMEOUT_S: u64 = 300;

/// The environment variable that sets the watchdog's bound, in seconds.
pub const TIMEOUT_VAR: &str = "WIDEN_MPI_TIMEOUT_S";

/// The watchdog's bound from the environment.
pub fn timeout() -> Duration {
    let secs = std::env::var(TIMEOUT_VAR).ok().and_then(|v| v.trim().parse::<f64>().ok());
    Duration::from_secs_f64(secs.filter(|s| *s > 0.0).unwrap_or(DEFAULT_TIMEOUT_S as f64))
}

/// MPI, initialized, and this process's place in its world. Dropping it
/// finalizes MPI.
pub struct MpiSession {
    /// Finalizes MPI when dropped, after the group's last use.
    _universe: mpi::environment::Universe,
    group: super::Group,
}

impl MpiSession {
    /// Initializes MPI and starts the watchdog. `None` when MPI was initialized
    /// already.
    pub fn init() -> Option<MpiSession> {
        let universe = mpi::initialize()?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let watchdog = Watchdog::start(rank, timeout(), TIMEOUT_VAR, |message| {
            eprintln!("error: {message}; ending this rank so that the launcher ends the job");
            // Not `MPI_Abort`: MPI was initialized for one thread, and this is
            // another. A rank that exits without finalizing makes the launcher
            // end the job.
            std::process::exit(124);
        });
        let group = super::Group::new(MpiWorld { rank, size, watchdog });
        Some(MpiSession { _universe: universe, group })
    }

    pub fn group(&self) -> &super::Group {
        &self.group
    }
}

/// The world communicator as a [`Collective`].
pub struct MpiWorld {
    rank: usize,
    size: usize,
    watchdog: Watchdog,
}

impl MpiWorld {
    fn guarded(&self, f: impl FnOnce(&SimpleCommunicator)) {
        self.watchdog.guard(|| f(&SimpleCommunicator::world()));
    }
}

fn op(op: Reduce) -> SystemOperation {
    match op {
        Reduce::Sum => SystemOperation::sum(),
        Reduce::Max => SystemOperation::max(),
    }
}

/// Elements per MPI call: MPI counts are C ints.
const CHUNK: usize = 1 << 28;

impl Collective for MpiWorld {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_f32(&self, buf: &mut [f32], how: Reduce) {
        self.guarded(|world| {
            for chunk in buf.chunks_mut(CHUNK) {
                let send = chunk.to_vec();
                world.all_reduce_into(&send[..], chunk, op(how));
            }
        });
    }

    fn all_reduce_f64(&self, buf: &mut [f64], how: Reduce) {
        self.guarded(|world| {
            for chunk in buf.chunks_mut(CHUNK) {
                let send = chunk.to_vec();
                world.all_reduce_into(&send[..], chunk, op(how));
            }
        });
    }

    fn abort(&self, code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) {
        self.guarded(|world| world.process_at_rank(root as i32).broadcast_into(buf));
    }

    fn watchdog(&self) -> Option<&Watchdog> {
        Some(&self.watchdog)
    }
}
