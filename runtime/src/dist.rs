//! Data-parallel training across processes (docs/distributed.md).
//!
//! N processes (ranks) run the same training loop on the same spec: the same
//! seed gives every rank the same initial parameters; every rank draws the same
//! global batch from the same sampler and trains on its own contiguous block of
//! `train.batch / N` rows of it; the loss and the gradients of the blocks are
//! averaged across ranks (one all-reduce over a flat buffer per step) before
//! the optimizer update, so every rank takes the same update and the
//! parameters stay identical. Because the batch a step draws depends only on
//! the step (the sampler is the global one), a checkpoint of an N-rank run
//! resumes on M ranks with the same batches.
//!
//! The collectives are behind [`Collective`]; the `mpi` cargo feature provides
//! [`mpi::MpiWorld`] over Open MPI. Without the feature, or with one rank, a run
//! takes no part of this module's path and trains exactly as a single process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "mpi")]
pub mod mpi;

/// The environment variable that makes a run of one launched rank take the
/// data-parallel path anyway (any value but empty and `0`): with `--device
/// cuda`, its step all-reduces through NCCL over a world of one, which must
/// train exactly what the plain single-GPU step trains (scripts/gpu_check.sh).
pub const FORCE_VAR: &str = "WIDEN_DIST_FORCE";

/// Whether [`FORCE_VAR`] asks for the data-parallel path with one rank.
pub fn force_requested() -> bool {
    std::env::var(FORCE_VAR).is_ok_and(|v| !v.trim().is_empty() && v.trim() != "0")
}

/// Environment variables a launcher sets to this process's rank among the
/// ranks on its machine (Open MPI, then MPICH).
pub const LOCAL_RANK_VARS: &[&str] = &["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"];

/// This process's rank among the ranks on its machine, if a launcher said.
pub fn local_rank() -> Option<usize> {
    LOCAL_RANK_VARS.iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// The GPU a rank trains on: its local rank (the launcher's numbering of
/// the ranks on one machine), else its world rank, modulo the machine's
/// `gpus`. The local rank is what keeps two ranks off one GPU when ranks span
/// machines; NCCL refuses a communicator in which two ranks share a GPU, so
/// more ranks on a machine than it has GPUs is refused here, by name.
pub fn gpu_for_rank(
    local_rank: Option<usize>,
    local_ranks: usize,
    rank: usize,
    gpus: usize,
) -> Result<usize, DistError> {
    if gpus == 0 || local_ranks > gpus {
        return Err(DistError::TooFewGpus { ranks: local_ranks, gpus });
    }
    Ok(local_rank.unwrap_or(rank) % gpus)
}

/// Environment variables a process launcher sets to the number of ranks
/// (Open MPI's `mpirun`, then MPICH/Slurm's PMI).
pub const WORLD_SIZE_VARS: &[&str] = &["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];

/// The number of ranks a launcher started this process among, if it was
/// started by one ([`WORLD_SIZE_VARS`]).
pub fn launcher_world_size() -> Option<usize> {
    WORLD_SIZE_VARS.iter().find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// Environment variables a launcher sets to the number of ranks it started on
/// this machine (Open MPI, then MPICH).
pub const LOCAL_SIZE_VARS: &[&str] = &["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"];

/// The number of ranks sharing this machine: 1 outside a launcher.
pub fn local_ranks() -> usize {
    LOCAL_SIZE_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        .unwrap_or(1)
        .max(1)
}

/// What enables data-parallel training in a build without it.
pub const ENABLE_HINT: &str =
    "rebuild widen with MPI support (`cargo build --release --features mpi`, which needs Open MPI and \
     libclang: `apt-get install libopenmpi-dev openmpi-bin libclang-dev`)";

/// This process's place in a launcher's job: MPI initialized for the run when
/// an MPI launcher started it (in a build with the `mpi` feature), nothing
/// otherwise. Dropping it at the end of the run finalizes MPI. `widen train`
/// and the standalone trainers of `widen build` join the same way.
pub struct Ranks {
    #[cfg(feature = "mpi")]
    session: Option<mpi::MpiSession>,
}

impl Ranks {
    /// Joins the launcher's ranks. Not under a launcher, there is no MPI at
    /// all and the run is exactly a single process's. A build without MPI
    /// under a launcher of several processes is refused: each would train its
    /// own copy of the model into one folder.
    pub fn join() -> Result<Ranks, DistError> {
        #[cfg(feature = "mpi")]
        {
            if launcher_world_size().is_none() {
                return Ok(Ranks { session: None });
            }
            let session = mpi::MpiSession::init().ok_or(DistError::MpiInitialized)?;
            Ok(Ranks { session: Some(session) })
        }
        #[cfg(not(feature = "mpi"))]
        {
            match launcher_world_size().filter(|&n| n > 1) {
                Some(world) => Err(DistError::MpiNotBuilt { world }),
                None => Ok(Ranks {}),
            }
        }
    }

    /// The ranks to train across: more than one, or one with [`FORCE_VAR`] set,
    /// which takes the data-parallel path (NCCL, with `--device cuda`) alone.
    /// `None`: a single process's run.
    pub fn group(&self) -> Option<Group> {
        #[cfg(feature = "mpi")]
        {
            let forced = force_requested();
            self.session
                .as_ref()
                .map(|s| if forced { s.group().clone().forced() } else { s.group().clone() })
                .filter(Group::data_parallel)
        }
        #[cfg(not(feature = "mpi"))]
        {
            None
        }
    }
}

/// Errors of a data-parallel run.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    #[error(
        "this process is one of {world} that an MPI launcher started (OMPI_COMM_WORLD_SIZE or \
         PMI_SIZE is {world}), but it is built without MPI: the {world} processes would train \
         {world} independent copies of the model into one folder; to train one model across \
         them, {ENABLE_HINT}"
    )]
    MpiNotBuilt { world: usize },
    #[error("MPI was initialized already in this process")]
    MpiInitialized,
    #[error(
        "train.batch = {batch} does not split evenly among {world} ranks: it is the global batch, \
         divided into equal shards; use a multiple of {world} (e.g. {}) or run another number of ranks",
        (batch / world).max(1) * world
    )]
    Batch { batch: usize, world: usize },
    #[error(
        "--device cuda with {world} ranks all-reduces through NCCL, which is built only with the \
         `mpi` feature (the NCCL id travels over MPI); {ENABLE_HINT}"
    )]
    NcclNotBuilt { world: usize },
    #[error(
        "{ranks} ranks run on this machine but it has {gpus} GPUs: --device cuda trains one rank \
         per GPU (NCCL refuses two ranks on one GPU); start at most {gpus} ranks per machine \
         (`mpirun -n {gpus}`, or --map-by ppr:{gpus}:node across machines)"
    )]
    TooFewGpus { ranks: usize, gpus: usize },
    #[error(
        "NCCL is not available: libnccl.so.2 could not be loaded, and --device cuda across ranks \
         all-reduces the gradients through it. Install it (`pip install nvidia-nccl-cu13`, or \
         `apt-get install libnccl2` from NVIDIA's CUDA repository) and put the folder holding \
         libnccl.so.2 on LD_LIBRARY_PATH"
    )]
    NoNccl,
    #[error(
        "this Cuda executor is not part of the ranks' NCCL communicator; a data-parallel run \
         builds it with `runtime::device::cuda::nccl::executor_for_rank`"
    )]
    NcclNotJoined,
    #[error("NCCL call failed while {what}: {code}")]
    Nccl { what: String, code: String },
    #[error(
        "rank 0 could not create the NCCL communicator's id, so no rank can join it; rank 0's \
         error names the cause"
    )]
    NoNcclId,
    #[error(
        "the parameters differ between ranks after step {step}: the ranks no longer train one \
         model (a rank's all-reduce result differed from the others')"
    )]
    Diverged { step: u64 },
}

/// How partial values combine across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

/// Bounds how long a rank waits on the others. A rank that stops answering while
/// alive (a stuck device, a stopped process) would leave its peers waiting in their
/// next collective forever, and neither MPI's error handler nor the launcher sees it:
/// a thread polls the running wait and calls `on_expiry` with a message once it has
/// lasted `limit` (docs/distributed.md, "Faults"). The MPI world's action ends the
/// process, which makes the launcher end the job.
///
/// A wait is whatever [`Watchdog::guard`] wraps: the world's own collectives, and
/// the waits outside them, such as a device stream's NCCL all-reduces
/// ([`Group::waiting_on_peers`]).
pub struct Watchdog {
    /// When the running wait began (ms since `started`, plus 1; 0 when none runs).
    since_ms: Arc<AtomicU64>,
    /// How many waits came before the running one.
    count: Arc<AtomicU64>,
    started: std::time::Instant,
}

impl Watchdog {
    /// Starts the polling thread. `on_expiry` runs at most once, with a message that
    /// names the rank, how long it waited, in which wait and the bound `limit`
    /// (`bound_name` says where it is set); the thread stops after it.
    pub fn start(
        rank: usize,
        limit: Duration,
        bound_name: &'static str,
        on_expiry: impl FnOnce(String) + Send + 'static,
    ) -> Watchdog {
        let dog = Watchdog {
            since_ms: Arc::new(AtomicU64::new(0)),
            count: Arc::new(AtomicU64::new(0)),
            started: std::time::Instant::now(),
        };
        let (since_ms, count, started) = (Arc::clone(&dog.since_ms), Arc::clone(&dog.count), dog.started);
        let poll = (limit / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let spawned = std::thread::Builder::new().name("widen-rank-watchdog".into()).spawn(move || loop {
            std::thread::sleep(poll);
            let since = since_ms.load(Ordering::SeqCst);
            if since == 0 {
                continue;
            }
            let waited = started.elapsed().saturating_sub(Duration::from_millis(since - 1));
            if waited >= limit {
                on_expiry(format!(
                    "rank {rank}: no answer from the other ranks for {:.0} s in wait #{} (a rank \
                     is stuck or gone); the bound is {bound_name}, {:.0} s",
                    waited.as_secs_f64(),
                    count.load(Ordering::SeqCst),
                    limit.as_secs_f64()
                ));
                return;
            }
        });
        if let Err(e) = spawned {
            eprintln!("warning: rank {rank}: cannot start the watchdog ({e}); a stuck rank may hang the run");
        }
        dog
    }

    /// Runs `f`, a wait on the other ranks, under the bound.
    pub fn guard<T>(&self, f: impl FnOnce() -> T) -> T {
        let now = self.started.elapsed().as_millis() as u64 + 1;
        self.count.fetch_add(1, Ordering::SeqCst);
        self.since_ms.store(now, Ordering::SeqCst);
        let out = f();
        self.since_ms.store(0, Ordering::SeqCst);
        out
    }
}

/// The collectives a data-parallel run needs. Every rank calls them in the same
/// order with buffers of the same length; each returns on every rank with the
/// same result. An implementation ends the whole job, on every rank, when one
/// fails or a peer dies; the call never returns an error and never hangs past
/// its watchdog's bound ([`Watchdog`]).
pub trait Collective {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Combines `buf` elementwise across ranks, in place.
    fn all_reduce_f32(&self, buf: &mut [f32], op: Reduce);
    /// Combines `buf` elementwise across ranks, in place.
    fn all_reduce_f64(&self, buf: &mut [f64], op: Reduce);
    /// Ends every rank's process with `code` (this rank failed; the others
    /// must not wait for it).
    fn abort(&self, code: i32) -> !;
    /// The watchdog that bounds this world's waits, if it has one; the waits of a
    /// device's own collectives run under it too ([`Group::waiting_on_peers`]).
    fn watchdog(&self) -> Option<&Watchdog> {
        None
    }
    /// Replaces `buf` on every rank by rank `root`'s (a setup message such as
    /// NCCL's id). This default sends each byte as a small whole number
    /// through a sum all-reduce (the other ranks add zeros), which is exact; an
    /// implementation with a broadcast of its own overrides it.
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) {
        let mine = self.rank() == root;
        let mut values: Vec<f64> = buf.iter().map(|&b| if mine { f64::from(b) } else { 0.0 }).collect();
        self.all_reduce_f64(&mut values, Reduce::Sum);
        for (b, v) in buf.iter_mut().zip(values) {
            *b = v as u8;
        }
    }
}

/// A handle on the ranks of a run, shared by the training loop and the
/// executor; it also counts the time spent in collectives.
#[derive(Clone)]
pub struct Group {
    inner: Arc<dyn Collective + Send + Sync>,
    /// Nanoseconds spent in all-reduces, for the metrics.
    reduce_nanos: Arc<AtomicU64>,
    /// Take the data-parallel path with one rank too ([`FORCE_VAR`]).
    forced: bool,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank(), self.size())
    }
}

impl PartialEq for Group {
    /// Two handles are equal when they are the same group.
    fn eq(&self, other: &Group) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Group {
    pub fn new(collective: impl Collective + Send + Sync + 'static) -> Group {
        Group { inner: Arc::new(collective), reduce_nanos: Arc::new(AtomicU64::new(0)), forced: false }
    }

    /// This group, taking the data-parallel path even alone ([`FORCE_VAR`]).
    pub fn forced(self) -> Group {
        Group { forced: true, ..self }
    }

    /// Whether a run on this group trains data-parallel: across more than one
    /// rank, or on one that was [`Group::forced`]. Otherwise it is exactly a
    /// single process's run.
    pub fn data_parallel(&self) -> bool {
        self.size() > 1 || self.forced
    }

    /// `buf` as rank `root` holds it, on every rank ([`Collective::broadcast_bytes`]).
    pub fn broadcast_bytes(&self, buf: &mut [u8], root: usize) {
        self.timed(|| self.inner.broadcast_bytes(buf, root));
    }

    /// Adds `elapsed` to the time spent in collectives (a device's own
    /// all-reduce, timed by its caller).
    pub fn add_reduce_time(&self, elapsed: Duration) {
        self.reduce_nanos.fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn rank(&self) -> usize {
        self.inner.rank()
    }

    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Whether this rank writes the run's files and console output (rank 0).
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    pub fn abort(&self, code: i32) -> ! {
        self.inner.abort(code)
    }

    /// Runs `f`, a wait on the other ranks outside this group's collectives (a
    /// device stream's NCCL all-reduces), under the world's watchdog, so that a
    /// stuck peer ends the run within the bound instead of hanging it.
    pub fn waiting_on_peers<T>(&self, f: impl FnOnce() -> T) -> T {
        match self.inner.watchdog() {
            Some(dog) => dog.guard(f),
            None => f(),
        }
    }

    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let started = std::time::Instant::now();
        let out = f();
        self.reduce_nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Time spent in all-reduces so far.
    pub fn reduce_time(&self) -> Duration {
        Duration::from_nanos(self.reduce_nanos.load(Ordering::Relaxed))
    }

    /// The mean across ranks of `loss` and of `grads` (in place): what one rank
    /// would compute over the whole global batch, since every rank's loss is
    /// the mean over an equal shard. The loss is summed in f64; the gradients
    /// are summed in f32 in the collective's order, then scaled.
    pub fn average(&self, loss: f32, grads: &mut [f32]) -> f32 {
        let n = self.size();
        let mut total = [f64::from(loss)];
        self.timed(|| {
            self.inner.all_reduce_f32(grads, Reduce::Sum);
            self.inner.all_reduce_f64(&mut total, Reduce::Sum);
        });
        let scale = 1.0 / n as f32;
        grads.iter_mut().for_each(|g| *g *= scale);
        (total[0] / n as f64) as f32
    }

    /// The mean across ranks of a value each rank computed over its shard.
    pub fn mean(&self, value: f64) -> f64 {
        let mut total = [value];
        self.timed(|| self.inner.all_reduce_f64(&mut total, Reduce::Sum));
        total[0] / self.size() as f64
    }

    /// Whether any rank says `yes` (a stop request that only some ranks saw).
    pub fn any(&self, yes: bool) -> bool {
        let mut flag = [if yes { 1.0 } else { 0.0 }];
        self.timed(|| self.inner.all_reduce_f64(&mut flag, Reduce::Max));
        flag[0] > 0.0
    }

    /// Whether every rank holds the same `fingerprint` (of its parameters).
    pub fn all_equal(&self, fingerprint: u64) -> bool {
        // Exact in f64: two 32-bit halves, negated for the minimum.
        let (hi, lo) = ((fingerprint >> 32) as f64, (fingerprint & 0xffff_ffff) as f64);
        let mut v = [hi, lo, -hi, -lo];
        self.timed(|| self.inner.all_reduce_f64(&mut v, Reduce::Max));
        v == [hi, lo, -hi, -lo]
    }
}

/// Which rows of a global batch a rank trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// The whole batch (one process).
    pub const WHOLE: Shard = Shard { rank: 0, world: 1 };

    pub fn of(group: Option<&Group>) -> Shard {
        group.map_or(Shard::WHOLE, |g| Shard { rank: g.rank(), world: g.size() })
    }

    /// The rows per rank of a global batch of `batch` rows.
    pub fn local_batch(self, batch: usize) -> Result<usize, DistError> {
        if self.world == 0 || !batch.is_multiple_of(self.world) {
            return Err(DistError::Batch { batch, world: self.world });
        }
        Ok(batch / self.world)
    }

    /// This rank's rows of a row-major `[batch, window]` token batch.
    pub fn rows(self, tokens: &[i32], window: usize) -> &[i32] {
        let per = tokens.len() / window.max(1) / self.world.max(1) * window;
        &tokens[self.rank * per..][..per]
    }
}

/// A fingerprint of a parameter set's values (their bits, in order): ranks that
/// took identical updates have equal ones.
pub fn fingerprint(params: &crate::params::ParamSet) -> u64 {
    // FNV-1a over the f32 bit patterns.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in params.iter() {
        for v in &p.value {
            h ^= u64::from(v.to_bits());
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// A test hook (docs/distributed.md, "Faults"): `WIDEN_MPI_TEST_FAULT=RANK:STEP:exit`
/// makes that rank's process exit with status 3 at the start of that step, as a
/// crashed rank would; `RANK:STEP:hang` makes it stop answering (sleep), as a
/// stuck one would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub step: u64,
    pub hang: bool,
}

impl Fault {
    pub const VAR: &'static str = "WIDEN_MPI_TEST_FAULT";

    pub fn from_env() -> Option<Fault> {
        Fault::parse(&std::env::var(Fault::VAR).ok()?)
    }

    fn parse(text: &str) -> Option<Fault> {
        let mut parts = text.split(':');
        let rank = parts.next()?.trim().parse().ok()?;
        let step = parts.next()?.trim().parse().ok()?;
        let hang = match parts.next().map(str::trim) {
            Some("hang") => true,
            Some("exit") | None => false,
            Some(_) => return None,
        };
        Some(Fault { rank, step, hang })
    }

    /// Acts out the fault when this is its rank and step.
    pub fn strike(&self, rank: usize, step: u64) {
        if (rank, step) != (self.rank, self.step) {
            return;
        }
        if self.hang {
            eprintln!("rank {rank}: {} stops this rank answering at step {step}", Fault::VAR);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        eprintln!("rank {rank}: {} ends this rank at step {step}", Fault::VAR);
        std::process::exit(3);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_rows_in_rank_order() {
        let tokens: Vec<i32> = (0..12).collect();
        assert_eq!(Shard { rank: 0, world: 2 }.rows(&tokens, 3), &[0, 1, 2, 3, 4, 5]);
        assert_eq!(Shard { rank: 1, world: 2 }.rows(&tokens, 3), &[6, 7, 8, 9, 10, 11]);
        assert_eq!(Shard::WHOLE.rows(&tokens, 3), &tokens[..]);
        assert_eq!(Shard { rank: 0, world: 2 }.local_batch(8).unwrap(), 4);
        let err = Shard { rank: 0, world: 3 }.local_batch(8).unwrap_err().to_string();
        assert!(
            err.contains("train.batch = 8") && err.contains("3 ranks") && err.contains("e.g. 6"),
            "{err}"
        );
    }

    #[test]
    fn each_rank_on_a_machine_gets_its_own_gpu() {
        // The local rank decides, so rank 5 of a job spread over machines is
        // GPU 1 of its machine.
        assert_eq!(gpu_for_rank(Some(1), 4, 5, 4).unwrap(), 1);
        assert_eq!(gpu_for_rank(Some(0), 1, 0, 8).unwrap(), 0);
        // Without a launcher's local rank, the world rank.
        assert_eq!(gpu_for_rank(None, 2, 1, 2).unwrap(), 1);
        assert_eq!(gpu_for_rank(None, 2, 3, 2).unwrap(), 1);
        let err = gpu_for_rank(Some(2), 3, 2, 2).unwrap_err().to_string();
        assert!(err.contains("3 ranks") && err.contains("2 GPUs") && err.contains("mpirun -n 2"), "{err}");
        assert!(gpu_for_rank(None, 1, 0, 0).is_err(), "no GPU at all");
    }

    /// The running sum of an all-reduce and how many ranks have added to it.
    type Shared = Arc<(std::sync::Mutex<(Vec<f64>, usize)>, std::sync::Condvar)>;

    /// A world of ranks in threads, summing through shared memory: enough
    /// to check that the default byte broadcast is exact.
    struct Threads {
        rank: usize,
        size: usize,
        shared: Shared,
    }

    impl Collective for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.size
        }
        fn all_reduce_f32(&self, _: &mut [f32], _: Reduce) {
            unimplemented!("not used by the broadcast")
        }
        fn all_reduce_f64(&self, buf: &mut [f64], op: Reduce) {
            assert_eq!(op, Reduce::Sum);
            let (lock, cv) = &*self.shared;
            let mut g = lock.lock().unwrap();
            if g.0.is_empty() {
                g.0 = vec![0.0; buf.len()];
            }
            g.0.iter_mut().zip(buf.iter()).for_each(|(t, v)| *t += v);
            g.1 += 1;
            cv.notify_all();
            while g.1 < self.size {
                g = cv.wait(g).unwrap();
            }
            buf.copy_from_slice(&g.0);
        }
        fn abort(&self, code: i32) -> ! {
            panic!("abort {code}")
        }
    }

    #[test]
    fn the_default_broadcast_is_exact_for_every_byte() {
        let shared: Shared = Arc::new((std::sync::Mutex::new((Vec::new(), 0)), std::sync::Condvar::new()));
        let id: Vec<u8> = (0..=255).collect();
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let shared = Arc::clone(&shared);
                let id = id.clone();
                std::thread::spawn(move || {
                    let group = Group::new(Threads { rank, size: 3, shared });
                    let mut buf = if rank == 1 { id } else { vec![7u8; 256] };
                    group.broadcast_bytes(&mut buf, 1);
                    buf
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), id);
        }
    }

    #[test]
    fn one_rank_trains_data_parallel_only_when_forced() {
        let shared: Shared = Arc::new((std::sync::Mutex::new((Vec::new(), 0)), std::sync::Condvar::new()));
        let alone = Group::new(Threads { rank: 0, size: 1, shared });
        assert!(!alone.data_parallel());
        assert!(alone.forced().data_parallel());
    }

    /// A wait past the bound fires once, naming the rank and the bound; waits within
    /// it, and time outside any wait, do not.
    #[test]
    fn the_watchdog_fires_on_a_wait_past_its_bound_only() {
        let (tx, rx) = std::sync::mpsc::channel();
        let dog = Watchdog::start(3, Duration::from_millis(200), "TEST_BOUND", move |m| tx.send(m).unwrap());
        dog.guard(|| std::thread::sleep(Duration::from_millis(20)));
        std::thread::sleep(Duration::from_millis(400));
        assert!(rx.try_recv().is_err(), "no wait ran past the bound");
        dog.guard(|| std::thread::sleep(Duration::from_millis(600)));
        let message = rx.recv_timeout(Duration::from_secs(5)).expect("the long wait fired");
        for part in ["rank 3", "wait #2", "TEST_BOUND"] {
            assert!(message.contains(part), "{message}");
        }
    }

    /// The group's waits outside its collectives run under the world's watchdog.
    #[test]
    fn waits_on_peers_run_under_the_worlds_watchdog() {
        struct Watched(Watchdog);
        impl Collective for Watched {
            fn rank(&self) -> usize {
                0
            }
            fn size(&self) -> usize {
                2
            }
            fn all_reduce_f32(&self, _: &mut [f32], _: Reduce) {}
            fn all_reduce_f64(&self, _: &mut [f64], _: Reduce) {}
            fn abort(&self, code: i32) -> ! {
                panic!("abort {code}")
            }
            fn watchdog(&self) -> Option<&Watchdog> {
                Some(&self.0)
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let group = Group::new(Watched(Watchdog::start(0, Duration::from_millis(100), "B", move |m| {
            tx.send(m).unwrap()
        })));
        assert_eq!(group.waiting_on_peers(|| 7), 7);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        group.waiting_on_peers(|| std::thread::sleep(Duration::from_millis(400)));
        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok(), "a stuck wait on peers fires");
    }

    #[test]
    fn fault_hook_parses() {
        assert_eq!(Fault::parse("1:3"), Some(Fault { rank: 1, step: 3, hang: false }));
        assert_eq!(Fault::parse("0:2:hang"), Some(Fault { rank: 0, step: 2, hang: true }));
        assert_eq!(Fault::parse("1:x"), None);
        assert_eq!(Fault::parse("1:3:sleep"), None);
    }
}
