//! [`Collective`] over MPI (the `mpi` cargo feature; Open MPI through the `mpi`
//! crate).
//!
//! **Faults.** MPI's default error handler ends the job on a failed call. A rank
//! that returns an error calls [`Collective::abort`] (`MPI_Abort`), which ends
//! every rank. A rank that dies (a crash, `kill -9`) leaves the launcher to end
//! the others: `mpirun` does so as soon as a rank exits without finalizing MPI.
//! What neither covers is a rank that stops answering while alive (a stuck
//! device, a stopped process): the others would wait in their next all-reduce
//! forever. A watchdog thread bounds that wait: a collective that has not
//! returned after [`timeout`] (`WIDEN_MPI_TIMEOUT_S`, default
//! [`DEFAULT_TIMEOUT_S`]) prints which collective and step it was waiting in
//! and exits the process, which makes the launcher end the job. The bound must
//! cover the longest a rank legitimately runs between collectives while the
//! others wait: rank 0 writing a checkpoint, and the first step, where each
//! rank compiles its Plan.

use super::{Collective, Reduce};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        let watch = Arc::new(Watch { since_ms: AtomicU64::new(0), what: AtomicU64::new(0) });
        let started = Instant::now();
        spawn_watchdog(Arc::clone(&watch), rank, timeout(), started);
        let group = super::Group::new(MpiWorld { rank, size, watch, started });
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
    watch: Arc<Watch>,
    started: Instant,
}

/// What the watchdog watches: when the running collective began (ms since the
/// session started, plus 1; 0 when none runs) and how many collectives came before it.
struct Watch {
    since_ms: AtomicU64,
    what: AtomicU64,
}

fn spawn_watchdog(watch: Arc<Watch>, rank: usize, limit: Duration, started: Instant) {
    let poll = (limit / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let spawned = std::thread::Builder::new().name("widen-mpi-watchdog".into()).spawn(move || loop {
        std::thread::sleep(poll);
        let since = watch.since_ms.load(Ordering::SeqCst);
        if since == 0 {
            continue;
        }
        let waited = started.elapsed().saturating_sub(Duration::from_millis(since - 1));
        if waited >= limit {
            eprintln!(
                "error: rank {rank}: no answer from the other ranks for {:.0} s in collective #{} \
                 (a rank is stuck or gone); ending this rank so that the launcher ends the job \
                 (the bound is {TIMEOUT_VAR}, {:.0} s)",
                waited.as_secs_f64(),
                watch.what.load(Ordering::SeqCst),
                limit.as_secs_f64()
            );
            // Not `MPI_Abort`: MPI was initialized for one thread, and this is
            // another. A rank that exits without finalizing makes the launcher
            // end the job.
            std::process::exit(124);
        }
    });
    if let Err(e) = spawned {
        eprintln!("warning: rank {rank}: cannot start the MPI watchdog ({e}); a stuck rank may hang the run");
    }
}

impl MpiWorld {
    fn guarded(&self, f: impl FnOnce(&SimpleCommunicator)) {
        let now = self.started.elapsed().as_millis() as u64 + 1;
        self.watch.what.fetch_add(1, Ordering::SeqCst);
        self.watch.since_ms.store(now, Ordering::SeqCst);
        f(&SimpleCommunicator::world());
        self.watch.since_ms.store(0, Ordering::SeqCst);
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
}
