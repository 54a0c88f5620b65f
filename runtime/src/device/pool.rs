//! A persistent pool of worker threads that runs one compiled kernel over
//! contiguous item ranges (DESIGN.md §6: "the runtime splits each kernel's
//! grid across threads").
//!
//! A Plan launches hundreds of kernels per training step; spawning threads
//! per launch would cost tens of microseconds each, so the workers live as
//! long as the device and are woken per launch through a condition variable.
//! The calling thread always runs the first range itself.

use codegen::cc::EntryFn;
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// One launch: the entry, its argument array and the split of `[0, n)`.
#[derive(Clone, Copy)]
struct Job {
    f: EntryFn,
    args: *const *mut c_void,
    n: i64,
    parts: usize,
}

// SAFETY: a `Job` is only read by workers while `Pool::run` blocks its caller,
// which keeps the argument array and every buffer it points to alive and
// unmoved; the ranges handed out are disjoint (see `Pool::run`).
unsafe impl Send for Job {}

impl Job {
    /// The items of part `i`: `[n * i / parts, n * (i + 1) / parts)`.
    fn range(&self, i: usize) -> (i64, i64) {
        let (n, parts) = (self.n as i128, self.parts as i128);
        let at = |i: usize| (n * i as i128 / parts) as i64;
        (at(i), at(i + 1))
    }

    /// # Safety
    /// The invariants of [`Pool::run`] hold for this job.
    unsafe fn run_part(&self, i: usize) {
        let (start, end) = self.range(i);
        if start < end {
            (self.f)(self.args, start, end);
        }
    }
}

struct State {
    /// Incremented per launch, so a worker never runs one launch twice.
    epoch: u64,
    job: Option<Job>,
    /// Parts not yet finished by workers (the caller's part is not counted).
    pending: usize,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
}

impl Shared {
    /// The state, even if a worker panicked while holding the lock (the
    /// state stays consistent: every update is a single assignment).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
            state: Mutex::new(State { epoch: 0, job: None, pending: 0, shutdown: false }),
            wake: Condvar::new(),
            done: Condvar::new(),
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
        let job = Job { f, args, n, parts };
        if parts == 1 {
            job.run_part(0);
            return;
        }
        {
            let mut st = self.shared.lock();
            st.epoch += 1;
            st.job = Some(job);
            st.pending = parts - 1;
        }
        self.shared.wake.notify_all();
        job.run_part(0);
        let mut st = self.shared.lock();
        while st.pending > 0 {
            st = self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.job = None;
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let job = {
            let mut st = shared.lock();
            while st.epoch == seen && !st.shutdown {
                st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
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
        // SAFETY: `Pool::run` blocks until this part is counted done, which
        // keeps the job's invariants in force; part `index` is ours alone.
        unsafe { job.run_part(index) };
        let mut st = shared.lock();
        st.pending -= 1;
        if st.pending == 0 {
            shared.done.notify_one();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            // A worker cannot panic outside the C call, which cannot unwind.
            let _ = w.join();
        }
    }
}
