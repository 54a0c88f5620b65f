//! A persistent pool of worker threads that runs one compiled kernel over
//! contiguous item ranges (docs/architecture.md §6: "the runtime splits each kernel's
//! grid across threads").
//!
//! A Plan launches hundreds of kernels per training step; spawning threads
//! per launch would cost tens of microseconds each, so the workers live as
//! long as the device. Launches follow each other within microseconds, and a
//! sleeping thread takes longer than that to wake, so both sides first spin
//! for a short while (a worker for the next launch, the caller for the last
//! part to finish) and only then sleep on a condition variable. The calling
//! thread always runs the first range itself.

use codegen::cc::EntryFn;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// The work of one launch: a function of the part index.
type Work<'a> = dyn Fn(usize) + Sync + 'a;

/// One launch: the work and how many parts it has.
#[derive(Clone, Copy)]
struct Job {
    /// Points to the caller's closure; lifetime erased (see the `Send` impl).
    work: *const Work<'static>,
    parts: usize,
}

// SAFETY: a `Job` is only read by workers while `Pool::run_parts` blocks its
// caller, which keeps the closure (and everything it borrows) alive and
// unmoved; the closure is `Sync`, so calling it from several threads is sound.
unsafe impl Send for Job {}

impl Job {
    /// # Safety
    /// The closure behind `work` is still alive.
    unsafe fn run_part(&self, i: usize) {
        (*self.work)(i);
    }
}

/// The items of part `i` of `[0, n)` split into `parts`: `[n·i/parts, n·(i+1)/parts)`.
pub(crate) fn part_range(n: i64, parts: usize, i: usize) -> (i64, i64) {
    let (n, parts) = (i128::from(n), parts as i128);
    let at = |i: usize| (n * i as i128 / parts) as i64;
    (at(i), at(i + 1))
}

/// A kernel's argument array, shareable with the workers of one launch.
#[derive(Clone, Copy)]
struct Args(*const *mut c_void);

impl Args {
    fn get(self) -> *const *mut c_void {
        self.0
    }
}

// SAFETY: only used inside `Pool::run`, whose contract keeps the array and the
// buffers alive for the launch and makes the parts write disjoint elements.
unsafe impl Sync for Args {}
unsafe impl Send for Args {}

struct State {
    /// Incremented per launch, so a worker never runs one launch twice.
    epoch: u64,
    job: Option<Job>,
    /// Parts not yet finished by workers (the caller's part is not counted).
    pending: usize,
    shutdown: bool,
    /// Workers asleep on `Shared::wake`, and whether the caller is asleep on
    /// `Shared::done`: a notification (a system call) only when someone sleeps.
    asleep: usize,
    caller_asleep: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
    /// `State::epoch` and `State::pending`, mirrored for spinning without the lock.
    epoch: AtomicU64,
    pending: AtomicUsize,
}

impl Shared {
    /// The state, even if a worker panicked while holding the lock (the
    /// state stays consistent: every update is a single assignment).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How long a thread spins before sleeping: longer than the gap between two
/// launches of a step (a few microseconds, more after a run of single-part
/// launches), much shorter than a scheduler tick.
const SPIN_TIME: std::time::Duration = std::time::Duration::from_micros(100);

/// Spins until `ready()` or [`SPIN_TIME`] has passed; whether it became ready.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let start = std::time::Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= SPIN_TIME {
            return ready();
        }
    }
}

/// Worker threads plus the calling thread: `threads()` ranges at most per launch.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("threads", &self.threads()).finish()
    }
}

impl Pool {
    /// A pool running launches on `threads` threads in total (the caller
    /// plus `threads - 1` workers); `threads` is at least 1.
    pub(crate) fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                epoch: 0,
                job: None,
                pending: 0,
                shutdown: false,
                asleep: 0,
                caller_asleep: false,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
        });
        let workers = (1..threads.max(1))
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("widen-cpu-{index}"))
                    .spawn(move || worker(&shared, index))
                    .expect("the OS refused to start a worker thread")
            })
            .collect();
        Pool { shared, workers }
    }

    /// Threads available to one launch (workers plus the caller).
    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(args, start, end)` over `[0, n)` split into `parts` contiguous
    /// ranges (clamped to `1..=threads()`), one per thread, and returns when
    /// all are done.
    ///
    /// # Safety
    /// `args` must satisfy [`codegen::cc::Entry::call`]'s contract for the
    /// whole grid `[0, n)`, and the kernel must write disjoint elements for
    /// disjoint item ranges; `args` and the buffers stay valid until return.
    pub(crate) unsafe fn run(&self, f: EntryFn, args: *const *mut c_void, n: i64, parts: usize) {
        let parts = parts.clamp(1, self.threads());
        let args = Args(args);
        let work = move |i: usize| {
            let (start, end) = part_range(n, parts, i);
            if start < end {
                // SAFETY: the caller's contract: `args` is valid for the whole grid
                // and disjoint ranges write disjoint elements.
                unsafe { f(args.get(), start, end) };
            }
        };
        self.run_parts(parts, &work);
    }

    /// Calls `work(i)` for every `i` in `0..parts` (clamped to
    /// `1..=threads()`), part `i` on thread `i` (the caller runs part 0), and
    /// returns when all are done.
    pub(crate) fn run_parts(&self, parts: usize, work: &Work<'_>) {
        let parts = parts.clamp(1, self.threads());
        if parts == 1 {
            work(0);
            return;
        }
        // SAFETY (lifetime erasure): this function blocks until every worker has
        // finished its part, so the closure outlives every use of the pointer.
        let work: *const Work<'static> = unsafe { std::mem::transmute::<&Work<'_>, &Work<'static>>(work) };
        let job = Job { work, parts };
        let wake = {
            let mut st = self.shared.lock();
            st.epoch += 1;
            st.job = Some(job);
            st.pending = parts - 1;
            self.shared.pending.store(parts - 1, Ordering::Release);
            self.shared.epoch.store(st.epoch, Ordering::Release);
            st.asleep > 0
        };
        if wake {
            self.shared.wake.notify_all();
        }
        // SAFETY: the closure is alive for the whole call.
        unsafe { job.run_part(0) };
        spin_until(|| self.shared.pending.load(Ordering::Acquire) == 0);
        let mut st = self.shared.lock();
        while st.pending > 0 {
            st.caller_asleep = true;
            st = self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner());
            st.caller_asleep = false;
        }
        st.job = None;
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let job = {
            spin_until(|| shared.epoch.load(Ordering::Acquire) != seen);
            let mut st = shared.lock();
            while st.epoch == seen && !st.shutdown {
                st.asleep += 1;
                st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                st.asleep -= 1;
            }
            if st.shutdown {
                return;
            }
            seen = st.epoch;
            match st.job {
                Some(job) if index < job.parts => job,
                _ => continue,
            }
        };
        // SAFETY: `Pool::run_parts` blocks until this part is counted done,
        // which keeps the closure alive; part `index` is ours alone.
        unsafe { job.run_part(index) };
        let mut st = shared.lock();
        st.pending -= 1;
        shared.pending.store(st.pending, Ordering::Release);
        if st.pending == 0 && st.caller_asleep {
            shared.done.notify_one();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            // A worker only panics if its closure does; the pool is going away anyway.
            let _ = w.join();
        }
    }
}
