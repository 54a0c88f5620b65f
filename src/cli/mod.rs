//! One module per subcommand.

pub mod bench;
pub mod build;
pub mod check;
pub mod compile;
pub mod coord_check;
pub mod eval;
pub mod parity;
pub mod plot;
pub mod report;
pub mod sample;
pub mod spec;
pub mod sweep;
pub mod train;

/// Refuses a spec whose estimated training memory exceeds this machine's, before
/// any graph is lowered or buffer allocated (`ModelSpec::check_fits`). Where the
/// machine's memory cannot be read, the spec's validation ceiling is the only bound.
pub fn fits_this_machine(spec: &ir::spec::ModelSpec) -> anyhow::Result<()> {
    if let Some(bytes) = ir::spec::host_memory_bytes() {
        spec.check_fits(bytes).map_err(|e| anyhow::anyhow!("{}: {}", e.path, e.message))?;
    }
    Ok(())
}
