//! The last phase: scratch buffers placed in a per-dtype arena by a liveness-based
//! first fit (docs/architecture.md §7), so that buffers whose lives do not overlap
//! share memory.

use std::collections::HashMap;

use ir::DType;

use super::builder::PlanBuilder;
use crate::plan::{BufferId, BufferRole};

/// Scratch buffers start at multiples of this many elements, so that on an
/// arena whose base is cache-line aligned every buffer is too (64 bytes of f32;
/// the Cpu device's non-temporal GEMM stores need it).
const ARENA_ALIGN: usize = 16;

impl PlanBuilder {
    /// Places scratch buffers: each lives from the first to the last step that
    /// touches it; per dtype, buffers are placed in order of first use at the
    /// lowest offset not used by a buffer whose life overlaps (first fit).
    pub(super) fn plan_arena(&mut self) {
        let mut life: HashMap<BufferId, (usize, usize)> = HashMap::new();
        for (s, step) in self.steps.iter().enumerate() {
            let ids = step.buffers();
            // A chain's steps may run entry by entry, interleaved: each buffer
            // it touches lives over all of it.
            let span =
                self.chains.iter().find(|c| c.steps().contains(&s)).map_or((s, s), |c| (c.start, c.end - 1));
            for id in ids {
                let e = life.entry(id).or_insert(span);
                e.0 = e.0.min(span.0);
                e.1 = e.1.max(span.1);
            }
        }
        let mut scratch: Vec<BufferId> = self
            .buffers
            .iter()
            .filter(|d| matches!(d.role, BufferRole::Scratch { .. }))
            .map(|d| d.id)
            .collect();
        scratch.sort_by_key(|id| (life.get(id).map_or(usize::MAX, |l| l.0), id.0));
        let mut placed: Vec<(DType, usize, usize, (usize, usize))> = Vec::new();
        for id in scratch {
            let (len, dtype) = (self.buffers[id.0].len, self.buffers[id.0].dtype);
            let span = life.get(&id).copied().unwrap_or((0, 0));
            let mut busy: Vec<(usize, usize)> = placed
                .iter()
                .filter(|p| p.0 == dtype && p.3 .0 <= span.1 && span.0 <= p.3 .1)
                .map(|p| (p.1, p.1 + p.2))
                .collect();
            busy.sort_unstable();
            let mut offset = 0;
            for (lo, hi) in busy {
                if offset + len <= lo {
                    break;
                }
                offset = offset.max(hi.next_multiple_of(ARENA_ALIGN));
            }
            placed.push((dtype, offset, len, span));
            self.buffers[id.0].role = BufferRole::Scratch { offset };
            if dtype == DType::F32 {
                self.arena_len = self.arena_len.max(offset + len);
            }
        }
    }
}
