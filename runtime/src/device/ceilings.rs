//! The host's arithmetic and memory ceilings, measured: the two rates a
//! roofline floor of a Plan divides by (docs/architecture.md §10 judges fused kernels
//! against the memory bandwidth; on the Cpu device a step mixes
//! compute-bound GEMMs and memory-bound kernels, so both rates are needed).
//!
//! - Arithmetic: every thread runs independent chains of fused multiply-adds
//!   in the widest vectors the host has (AVX-512, else AVX2 + FMA, else
//!   scalar multiply and add). Enough chains to cover the FMA latency, so
//!   the rate is the cores' issue limit, not a chain's latency.
//! - Memory: every thread streams its share of four read buffers into two
//!   written ones (`o0 = a + b + c + d`, `o1 = o0 / 2`), the mix of a fused
//!   kernel, over buffers several times the last-level cache. Bytes read
//!   plus bytes written over the time.
//!
//! Each probe runs a few times and keeps its best rate: a ceiling is what
//! the machine reaches, and a shared machine only ever subtracts from it.

use std::time::Instant;

/// Measured ceilings of this host on `threads` threads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuCeilings {
    /// Floating-point operations per second (a fused multiply-add counts 2).
    pub flops_per_s: f64,
    /// Bytes read plus bytes written per second, streaming through memory.
    pub bytes_per_s: f64,
    /// Threads both probes ran on.
    pub threads: usize,
    /// Which vector instructions the arithmetic probe used.
    pub vector: &'static str,
}

impl CpuCeilings {
    /// The roofline floor of work that does `flops` operations and moves
    /// `bytes`: the larger of its arithmetic time and its memory time, in
    /// seconds. Summed over a Plan's steps it is the step time no schedule of
    /// those steps can beat on this host.
    pub fn floor_seconds(&self, flops: u64, bytes: u64) -> f64 {
        (flops as f64 / self.flops_per_s).max(bytes as f64 / self.bytes_per_s)
    }

    /// The roofline floor of a sequence of steps, each `(flops, bytes)`:
    /// their [`CpuCeilings::floor_seconds`] summed. No schedule of those
    /// steps runs faster on this host.
    pub fn roofline_seconds(&self, steps: &[(u64, u64)]) -> f64 {
        steps.iter().map(|&(flops, bytes)| self.floor_seconds(flops, bytes)).sum()
    }

    /// The higher of each rate: two measurements of one host, either of which
    /// a busy neighbour may have slowed.
    pub fn best(self, other: CpuCeilings) -> CpuCeilings {
        CpuCeilings {
            flops_per_s: self.flops_per_s.max(other.flops_per_s),
            bytes_per_s: self.bytes_per_s.max(other.bytes_per_s),
            ..self
        }
    }
}

/// The probes with their memory, for measuring again during a long run (a
/// shared machine's ceilings move; the best measured is the host's).
pub struct Probe {
    threads: usize,
    stream: StreamBuffers,
}

impl Probe {
    /// Probes for `threads` threads; allocates the memory probe's buffers
    /// (eight times the last-level cache, at most 1 GiB).
    pub fn new(threads: usize) -> Probe {
        Probe { threads: threads.max(1), stream: StreamBuffers::new(stream_len()) }
    }

    /// Bytes the memory probe holds for as long as it lives (six buffers; a
    /// process's peak memory counts them, `super::memory`).
    pub fn bytes(&self) -> usize {
        self.stream.bytes()
    }

    /// Both ceilings, each the best of a few runs (a few tenths of a second).
    pub fn measure(&self) -> CpuCeilings {
        let threads = self.threads;
        let kind = vector_kind();
        // Per thread: ITERS rounds of `chains` independent FMAs on `lanes` floats.
        const ITERS: usize = 2_000_000;
        let flops_per_thread = (ITERS * kind.chains * kind.lanes * 2) as f64;
        let fma_seconds = best_of(REPS, || {
            run_threads(threads, |_| {
                std::hint::black_box(fma_chains(ITERS, 1.0));
            })
        });
        let stream = &self.stream;
        let stream_seconds = best_of(REPS, || run_threads(threads, |t| stream.run(t, threads)));
        CpuCeilings {
            flops_per_s: flops_per_thread * threads as f64 / fma_seconds,
            bytes_per_s: stream.bytes() as f64 / stream_seconds,
            threads,
            vector: kind.name,
        }
    }
}

/// Timed runs of each probe (the best is kept).
const REPS: usize = 9;

/// The widest vectors this host runs FMAs in: their name, f32 lanes, and how
/// many independent chains the probe keeps in flight in them.
///
/// Chains must cover the FMA latency (4 cycles) times the FMA ports (2) of
/// current cores, so at least 8, and must all stay in registers with the
/// recurrence's two constants: a chain spilled to the stack adds a store and
/// a load to its every step and halves the rate. AVX-512 has 32 vector
/// registers (16 chains), AVX2 16 (12 chains: with 16 some spill, the probe
/// reads far below what 10 or 12 reach, and GEMMs beat the "ceiling").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct VectorKind {
    name: &'static str,
    lanes: usize,
    chains: usize,
    /// Vector registers the instruction set names.
    registers: usize,
}

const AVX512: VectorKind = VectorKind { name: "avx512", lanes: 16, chains: 16, registers: 32 };
const AVX2_FMA: VectorKind = VectorKind { name: "avx2-fma", lanes: 8, chains: 12, registers: 16 };
const SCALAR: VectorKind = VectorKind { name: "scalar", lanes: 1, chains: 16, registers: 16 };

// Every vector kind covers the latency and keeps its chains and the two
// constants in registers (see `VectorKind`).
const _: () = {
    let kinds = [AVX512, AVX2_FMA];
    let mut i = 0;
    while i < kinds.len() {
        assert!(kinds[i].chains >= 8 && kinds[i].chains + 2 <= kinds[i].registers);
        i += 1;
    }
};

fn vector_kind() -> VectorKind {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return AVX512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return AVX2_FMA;
        }
    }
    SCALAR
}

/// `vector_kind().chains` chains of `acc = acc * x + y` over `iters` rounds
/// in every lane, each chain starting at `start`; returns the first chain's
/// first lane, so the work is observable (and checkable against
/// [`fma_chain_scalar`]).
fn fma_chains(iters: usize, start: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        match vector_kind() {
            // SAFETY: the features were detected on this host.
            AVX512 => return unsafe { fma_chains_avx512(iters, start) },
            AVX2_FMA => return unsafe { fma_chains_avx2(iters, start) },
            _ => {}
        }
    }
    let mut acc = [start; SCALAR.chains];
    for _ in 0..iters {
        for a in &mut acc {
            // A separate multiply and add: the scalar probe counts 2 operations
            // per step like the others, on hosts without a fused instruction.
            *a = std::hint::black_box(*a * FMA_X) + FMA_Y;
        }
    }
    std::hint::black_box(&acc);
    acc[0]
}

/// The recurrence's constants: `x` just below 1 keeps every chain finite.
const FMA_X: f32 = 0.999_999_9;
const FMA_Y: f32 = 1.0e-7;

/// `fma_chains` in one vector kind: its `chains` vectors of chains, each
/// step one fused multiply-add per vector.
macro_rules! fma_chains_in {
    ($name:ident, $kind:expr, $features:literal, $set1:ident, $fmadd:ident, $first:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(iters: usize, start: f32) -> f32 {
            use std::arch::x86_64::{$first, $fmadd, $set1};
            let (x, y) = ($set1(FMA_X), $set1(FMA_Y));
            let mut acc = [$set1(start); $kind.chains];
            for _ in 0..iters {
                for a in &mut acc {
                    *a = $fmadd(*a, x, y);
                }
            }
            // Every chain is observed, or all but the returned one would be dropped.
            std::hint::black_box(&acc);
            $first(acc[0])
        }
    };
}

fma_chains_in!(fma_chains_avx512, AVX512, "avx512f", _mm512_set1_ps, _mm512_fmadd_ps, _mm512_cvtss_f32);
fma_chains_in!(fma_chains_avx2, AVX2_FMA, "avx2,fma", _mm256_set1_ps, _mm256_fmadd_ps, _mm256_cvtss_f32);

/// Floats per stream buffer: together the six buffers span eight times the
/// last-level cache (from sysfs where the host says, else 32 MiB), so every
/// pass streams from memory, and at most 1 GiB, whatever the cache claims.
fn stream_len() -> usize {
    let llc = last_level_cache_bytes().unwrap_or(32 << 20);
    let total = (8 * llc).min(1 << 30);
    (total / 6 / std::mem::size_of::<f32>()).next_multiple_of(16)
}

/// The largest data or unified cache of cpu0, as sysfs reports it.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|entry| {
        let path = entry.ok()?.path();
        let kind = std::fs::read_to_string(path.join("type")).ok()?;
        if kind.trim() == "Instruction" {
            return None;
        }
        parse_cache_size(&std::fs::read_to_string(path.join("size")).ok()?)
    })
    .max()
}

/// `"32768K"`, `"1M"` or `"512"` as bytes.
fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: usize = digits.parse().ok()?;
    match unit {
        "" => Some(n),
        "K" => Some(n << 10),
        "M" => Some(n << 20),
        "G" => Some(n << 30),
        _ => None,
    }
}

/// The memory probe's buffers: four read, two written.
struct StreamBuffers {
    reads: [Vec<f32>; 4],
    writes: [SharedOut; 2],
    len: usize,
}

/// A written buffer that threads fill in disjoint ranges through its pointer.
struct SharedOut {
    ptr: *mut f32,
    /// Owns the memory `ptr` addresses; never touched while a probe runs.
    storage: Vec<f32>,
}

// SAFETY: threads write disjoint ranges (`StreamBuffers::run`), and nobody
// reads while a probe runs.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn zeroed(len: usize) -> SharedOut {
        let mut storage = vec![0.0; len];
        SharedOut { ptr: storage.as_mut_ptr(), storage }
    }

    /// Elements `lo..hi`.
    ///
    /// # Safety
    /// `lo <= hi <= len`, and no other live slice overlaps them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, lo: usize, hi: usize) -> &mut [f32] {
        debug_assert!(lo <= hi && hi <= self.storage.len());
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(lo), hi - lo) }
    }
}

impl StreamBuffers {
    fn new(len: usize) -> StreamBuffers {
        // Distinct, non-zero contents, written now so the pages exist before
        // any timed pass.
        let fill = |k: usize| (0..len).map(|i| ((i * 7 + k) % 13) as f32 * 0.25).collect::<Vec<f32>>();
        StreamBuffers {
            reads: [fill(1), fill(2), fill(3), fill(4)],
            writes: [SharedOut::zeroed(len), SharedOut::zeroed(len)],
            len,
        }
    }

    /// Bytes one pass moves: six buffers of `len` floats.
    fn bytes(&self) -> usize {
        6 * self.len * std::mem::size_of::<f32>()
    }

    /// Thread `t` of `threads` streams its contiguous share.
    fn run(&self, t: usize, threads: usize) {
        let (lo, hi) = (self.len * t / threads, self.len * (t + 1) / threads);
        let [a, b, c, d] = &self.reads;
        // SAFETY: thread t alone writes lo..hi of each output.
        let (o0, o1) = unsafe { (self.writes[0].range(lo, hi), self.writes[1].range(lo, hi)) };
        let rows = a[lo..hi].iter().zip(&b[lo..hi]).zip(&c[lo..hi]).zip(&d[lo..hi]);
        for ((((&a, &b), &c), &d), (w0, w1)) in rows.zip(o0.iter_mut().zip(o1.iter_mut())) {
            let s = a + b + c + d;
            *w0 = s;
            *w1 = s * 0.5;
        }
    }

    #[cfg(test)]
    fn outputs(&self) -> (&[f32], &[f32]) {
        (&self.writes[0].storage, &self.writes[1].storage)
    }
}

/// `work(t)` on `threads` threads at once; the wall time in seconds.
fn run_threads(threads: usize, work: impl Fn(usize) + Sync) -> f64 {
    let started = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..threads {
            let work = &work;
            scope.spawn(move || work(t));
        }
    });
    started.elapsed().as_secs_f64()
}

/// The shortest of `reps` runs of `f` (seconds), after one untimed run.
fn best_of(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    f();
    (0..reps).map(|_| f()).fold(f64::INFINITY, f64::min)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recurrence each chain runs, one fused (or, on the scalar path,
    /// separate) multiply-add at a time.
    fn fma_chain_scalar(iters: usize, start: f32) -> f32 {
        let vector = vector_kind() != SCALAR;
        (0..iters).fold(start, |a, _| if vector { a.mul_add(FMA_X, FMA_Y) } else { a * FMA_X + FMA_Y })
    }

    #[test]
    fn the_arithmetic_probe_runs_every_step_it_counts() {
        // Bitwise: each lane's chain is exactly rounded step by step, so any
        // skipped or merged step changes the result.
        for iters in [1, 2, 1000, 12_345] {
            let start = 3.5;
            assert_eq!(fma_chains(iters, start), fma_chain_scalar(iters, start), "{iters} steps");
        }
        assert_ne!(fma_chains(12_345, 3.5), fma_chains(12_344, 3.5), "the step count is observable");
    }

    #[test]
    fn the_memory_probe_writes_every_element_from_every_thread() {
        let len = 1000;
        let stream = StreamBuffers::new(len);
        for t in 0..3 {
            stream.run(t, 3);
        }
        let (o0, o1) = stream.outputs();
        let [a, b, c, d] = &stream.reads;
        for i in 0..len {
            let want = a[i] + b[i] + c[i] + d[i];
            assert_eq!((o0[i], o1[i]), (want, want * 0.5), "element {i}");
        }
        assert!(o0.iter().any(|&v| v != 0.0), "non-zero contents");
        assert_eq!(stream.bytes(), 6 * 4 * len);
    }

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn the_floor_is_the_slower_of_arithmetic_and_memory() {
        let c = CpuCeilings { flops_per_s: 1e12, bytes_per_s: 1e11, threads: 2, vector: "avx512" };
        // Compute-bound: 2e12 FLOP take 2 s; 1e10 bytes 0.1 s.
        assert_eq!(c.floor_seconds(2_000_000_000_000, 10_000_000_000), 2.0);
        // Memory-bound: 1e9 FLOP 1 ms; 5e11 bytes 5 s.
        assert_eq!(c.floor_seconds(1_000_000_000, 500_000_000_000), 5.0);
        // A sequence: each step at its own bound, summed.
        assert_eq!(
            c.roofline_seconds(&[(2_000_000_000_000, 10_000_000_000), (1_000_000_000, 500_000_000_000)]),
            7.0
        );
        // Two measurements: the better of each rate.
        let other = CpuCeilings { flops_per_s: 5e11, bytes_per_s: 2e11, ..c };
        let best = c.best(other);
        assert_eq!((best.flops_per_s, best.bytes_per_s), (1e12, 2e11));
    }

    #[test]
    fn measured_ceilings_are_positive_rates() {
        let c = Probe::new(2).measure();
        assert_eq!(c.threads, 2);
        assert!(c.flops_per_s.is_finite() && c.flops_per_s > 1e8, "{c:?}");
        assert!(c.bytes_per_s.is_finite() && c.bytes_per_s > 1e8, "{c:?}");
    }
}
