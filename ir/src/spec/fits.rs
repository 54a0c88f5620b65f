//! Whether a spec's training fits this machine (README, "What widen guarantees"): the host-dependent half of
//! the memory bound, next to the fixed ceiling that [`ModelSpec::validate`] applies.
//!
//! Validation must give the same answer everywhere (the derive macro runs it at compile
//! time), so it only refuses what no machine could hold. Commands about to build or
//! train a spec call [`ModelSpec::check_fits`] with [`host_memory_bytes`] as well.

use super::validate::memory_message;
use super::{FieldError, ModelSpec};
use crate::cost::{gib, training_memory, TrainingMemory};

impl ModelSpec {
    /// The closed-form training-memory estimate ([`crate::cost::training_memory`]) if it
    /// is at most `available_bytes`; otherwise an error at the field of the largest
    /// share, with the estimate and every share in GiB.
    pub fn check_fits(&self, available_bytes: u64) -> Result<TrainingMemory, FieldError> {
        let memory = training_memory(self);
        let available = available_bytes as f64;
        if memory.total_bytes <= available {
            return Ok(memory);
        }
        let (path, message) =
            memory_message(&memory, &format!("the {:.1} GiB of memory available", gib(available)));
        Err(FieldError { path: path.to_string(), message })
    }
}

/// This machine's physical memory in bytes (`MemTotal` of `/proc/meminfo`), or `None`
/// where that cannot be read (other systems); callers then skip the check.
pub fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_total(&text)
}

/// `MemTotal:  16318480 kB` -> bytes.
fn parse_mem_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    let scale = match words.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_total() {
        let text = "MemTotal:       16318480 kB\nMemFree:          123 kB\n";
        assert_eq!(parse_mem_total(text), Some(16318480 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: 99999999999999999999 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: 12 MB\n"), None);
    }
}
