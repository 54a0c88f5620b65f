"""Causal attention forward + backward alone in PyTorch: the counterpart of widen's
`cargo bench --bench attention` (docs/performance.md "attention against PyTorch").

The same work as widen's compiled `CausalAttention` and its three gradients: q, k, v
and the incoming gradient in widen's `[B, T, H, dh]` layout, half-split RoPE on q and
k (docs/math.md §1.3), `F.scaled_dot_product_attention(..., is_causal=True)` with the
logit scale 1/sqrt(dh), and the gradients of q, k and v from one backward.

    python benches/pytorch/attention.py T [B H DH ROUNDS] [--threads 2] [--no-rope]

prints one line in the format of widen's bench: the median and best milliseconds of a
forward plus backward and the process's peak resident set (with the resident set
after `import torch`, before any input exists, which is the library's own). One shape per process, so
the peak is that shape's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models import apply_rope, rope_tables  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("t", type=int, help="sequence length T")
    p.add_argument("b", type=int, nargs="?", default=8, help="batch B")
    p.add_argument("h", type=int, nargs="?", default=12, help="heads H")
    p.add_argument("dh", type=int, nargs="?", default=64, help="head width dh")
    p.add_argument("rounds", type=int, nargs="?", default=10, help="timed rounds")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--no-rope", action="store_true", help="leave RoPE out (widen's bench always applies it)")
    return p.parse_args(argv)


def fill(shape, salt: int) -> torch.Tensor:
    """The deterministic inputs of widen's bench: ((j * 7919 + salt * 104729) mod 2001) / 1000 - 1."""
    n = 1
    for s in shape:
        n *= s
    j = torch.arange(n, dtype=torch.int64)
    return (((j * 7919 + salt * 104729) % 2001).to(torch.float32) / 1000.0 - 1.0).view(shape)


def resident_mib() -> float:
    """The current resident set (VmRSS), to tell the library's own footprint from the shape's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    at_start = resident_mib()
    torch.set_num_threads(args.threads)
    shape = (args.b, args.t, args.h, args.dh)
    q, k, v, d = (fill(shape, i) for i in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    cos, sin = rope_tables(args.t, args.dh, 10000.0)
    scale = 1.0 / args.dh**0.5

    def step():
        for x in (q, k, v):
            x.grad = None
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        if not args.no_rope:
            qh, kh = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
        y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        y.transpose(1, 2).backward(d)

    step()  # warm-up, as widen's bench
    ms = []
    for _ in range(max(args.rounds, 1)):
        start = time.perf_counter()
        step()
        ms.append(1e3 * (time.perf_counter() - start))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    rope = "" if not args.no_rope else ", no RoPE"
    print(
        f"torch {torch.__version__} sdpa B {args.b} H {args.h} T {args.t} dh {args.dh}, "
        f"{torch.get_num_threads()} threads{rope}: fwd+bwd median {statistics.median(ms):.2f} ms "
        f"(best {min(ms):.2f}), peak resident {peak_mib:.1f} MiB ({at_start:.1f} MiB before the inputs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
