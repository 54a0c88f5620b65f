//! The Cpu device maps every page of its storage when it loads a Plan, so the
//! first run pays no page fault for them. Its own test binary: page faults
//! are counted for the whole process, and no other test may run beside it.

// The shared helpers; this binary needs only some of them.
mod common;

use codegen::cc::Compiler;
use codegen::kernel::Grid;
use codegen::plan::{BufferId, BufferRole, Plan, Step};
use common::plan::{data, decl, scale_bias};
use ir::DType;
use runtime::device::cpu::{CpuDevice, CpuOptions};

/// Minor page faults of this process so far (`/proc/self/stat`, field 10),
/// or `None` where there is no such file.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(7)?.parse().ok()
}

const PAGE_BYTES: usize = 4096;

#[test]
fn the_first_run_does_not_fault_in_the_arena_or_the_gradients() {
    if minor_faults().is_none() {
        println!("skipped: no /proc/self/stat to count page faults on this system");
        return;
    }
    // 32 MiB in the arena (a kernel's output) and 32 MiB of gradient (zeroed
    // by the run): 16384 pages the first run would fault in one by one.
    let (rows, d) = (8192, 1024);
    let len = rows * d;
    let x = BufferId(0);
    let (scale, bias, h, grad) = (BufferId(1), BufferId(2), BufferId(3), BufferId(4));
    let plan = Plan {
        kernels: vec![scale_bias(rows, d, Grid::DEFAULT_BLOCK)],
        steps: vec![Step::Kernel { kernel: 0, args: vec![x, scale, bias, h] }, Step::Zero { buffer: grad }],
        buffers: vec![
            decl(0, len, DType::F32, BufferRole::Input { name: "x".into() }),
            decl(1, 1, DType::F32, BufferRole::Constant { value: 0.5 }),
            decl(2, d, DType::F32, BufferRole::Param { name: "bias".into() }),
            decl(3, len, DType::F32, BufferRole::Scratch { offset: 0 }),
            decl(4, len, DType::F32, BufferRole::Grad { name: "bias".into() }),
        ],
        arena_len: len,
        update_start: None,
        chains: vec![],
    };
    let cache = std::env::temp_dir().join(format!("widen-first-run-{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let compiler = Compiler::new(&cc, cache.clone()).expect("a C compiler is installed");
    let mut dev = CpuDevice::with_options(plan, &compiler, CpuOptions { threads: 2 }).expect("plan loads");
    dev.write_f32(x, &data(len, 1, 1.0)).unwrap();
    dev.write_f32(bias, &data(d, 2, 1.0)).unwrap();

    let pages = 2 * len * 4 / PAGE_BYTES;
    let before = minor_faults().unwrap();
    dev.run().unwrap();
    let faults = minor_faults().unwrap() - before;
    let _ = std::fs::remove_dir_all(&cache);
    assert!(
        faults < pages as u64 / 16,
        "the first run faulted {faults} pages of the {pages} its arena and gradient span: \
         loading should have mapped them"
    );
    // The run did write them: the kernel's output is there.
    let out = dev.read_f32(h).unwrap();
    assert_eq!(out[len - 1], data(len, 1, 1.0)[len - 1] * 0.5 + data(d, 2, 1.0)[d - 1]);
}
