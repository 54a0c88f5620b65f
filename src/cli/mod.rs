//! One module per subcommand.

mod backbone;
pub mod bench;
pub mod check;
pub mod compile;
pub mod coord_check;
pub mod data;
pub mod eval;
pub mod parity;
pub mod plot;
pub mod report;
pub mod sample;
pub mod spec;
pub mod standalone;
pub mod sweep;
pub mod train;

pub use backbone::Backbone;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Refuses a spec whose estimated training memory on the Cpu device exceeds this
/// machine's, before any buffer is allocated (`runtime::device::memory::check_fits`: the
/// closed form, then the Plan where the closed form alone would refuse). Where the
/// machine's memory cannot be read, the spec's validation ceiling is the only bound.
pub fn fits_this_machine(spec: &ir::spec::ModelSpec) -> anyhow::Result<()> {
    if let Some(bytes) = ir::spec::host_memory_bytes() {
        runtime::device::memory::check_fits(spec, bytes, runtime::device::Device::Cpu)
            .map_err(|e| anyhow::anyhow!("{}: {}", e.path, e.message))?;
    }
    Ok(())
}

/// `f` over every item on up to `workers` threads; the results in item order.
pub fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    workers: usize,
    f: impl Fn(usize, &T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..workers.clamp(1, items.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(i, item);
                results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    // Every index below `items.len()` was taken by exactly one worker, and a
    // panicking worker re-raises its panic when the scope ends.
    results.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().flatten().collect()
}
