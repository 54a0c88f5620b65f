"""Whole-training-step benchmark of the PyTorch counterparts (docs/architecture.md §10).

For each residual scheme and the plain-residual baseline of the same backbone, times
full training steps (forward, backward, global-norm clip, AdamW step) on random byte
windows, in eager mode and under `torch.compile` where it works. Steps of all models
are interleaved round-robin, so that load drift on a shared machine hits every model
alike; the median is reported, with tokens/s and the overhead ratio against the
residual baseline of the same mode.

    python benches/pytorch/bench.py --json bench_torch.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from models import SCHEMES, Config, Model, count_params, param_groups  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=256, help="vocabulary V (256: bytes; 50304: GPT-2's, padded)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence T")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model (compilation happens here)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (fp32, TF32 off, as widen's Cuda device)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma list; the residual baseline is always run")
    p.add_argument("--no-baseline", action="store_true",
                   help="run only the listed schemes (one scheme per process: the peak resident set is its own)")
    p.add_argument("--modes", default="eager,compile", help="comma list of eager, compile")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default, reduce-overhead, ...)")
    p.add_argument("--vwn-m", type=int, default=4)
    p.add_argument("--vwn-n", type=int, default=16)
    p.add_argument("--mhc-n", type=int, default=4)
    p.add_argument("--xhc-n", type=int, default=16)
    p.add_argument("--xhc-k", type=int, default=4)
    p.add_argument("--xhc-fixed", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip; 0 disables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return p.parse_args(argv)


def config_from(args) -> Config:
    return Config(
        vocab=args.vocab,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        vwn_m=args.vwn_m,
        vwn_n=args.vwn_n,
        mhc_n=args.mhc_n,
        xhc_n=args.xhc_n,
        xhc_k=args.xhc_k,
        xhc_fixed=args.xhc_fixed,
    )


class Runner:
    """One model, its optimizer and its (eager or compiled) loss function."""

    def __init__(self, scheme: str, mode: str, cfg: Config, args):
        torch.manual_seed(args.seed)
        self.scheme, self.mode = scheme, mode
        self.model = Model(cfg, scheme).to(args.device)
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(
            param_groups(self.model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8
        )
        self.clip = args.clip
        self.loss_fn = self.model if mode == "eager" else torch.compile(self.model, mode=args.compile_mode)
        self.times: list[float] = []
        self.losses: list[float] = []
        self.first_step_s: float | None = None
        self.error: str | None = None

    def step(self, window: torch.Tensor) -> float:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(window)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        value = loss.item()
        elapsed = time.perf_counter() - start
        self.losses.append(value)
        return elapsed


def run_mode(mode: str, schemes: list[str], cfg: Config, args, windows: list[torch.Tensor]) -> list[dict]:
    runners = []
    for scheme in schemes:
        try:
            runners.append(Runner(scheme, mode, cfg, args))
        except Exception as e:  # a scheme that cannot be built is reported, not fatal
            r = {"scheme": scheme, "mode": mode, "error": f"{type(e).__name__}: {e}"}
            print(f"[{mode}] {scheme}: build failed: {r['error']}", file=sys.stderr)
            runners.append(r)
    live = [r for r in runners if isinstance(r, Runner)]

    for r in live:
        for i in range(args.warmup):
            try:
                elapsed = r.step(windows[i % len(windows)])
            except Exception as e:
                r.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                print(f"[{mode}] {r.scheme}: step failed: {r.error}", file=sys.stderr)
                traceback.print_exc(limit=3, file=sys.stderr)
                break
            if i == 0:
                r.first_step_s = elapsed
        print(f"[{mode}] {r.scheme}: warmed up" + (f" (first step {r.first_step_s:.1f} s)" if r.first_step_s else ""),
              file=sys.stderr)

    ok = [r for r in live if r.error is None]
    for i in range(args.steps):
        window = windows[(args.warmup + i) % len(windows)]
        for r in ok:
            if r.error is None:
                try:
                    r.times.append(r.step(window))
                except Exception as e:
                    r.error = f"{type(e).__name__}: {e}"

    rows = []
    for r in runners:
        if not isinstance(r, Runner):
            rows.append(r)
            continue
        row = {
            "scheme": r.scheme,
            "mode": mode,
            "params": count_params(r.model),
            "first_step_s": r.first_step_s,
        }
        if r.error is not None or not r.times:
            row["error"] = r.error or "no timed steps"
        else:
            med = statistics.median(r.times)
            row.update(
                ms_per_step=1e3 * med,
                ms_min=1e3 * min(r.times),
                ms_max=1e3 * max(r.times),
                tokens_per_s=args.batch * args.seq_len / med,
                loss_first=r.losses[0],
                loss_last=r.losses[-1],
            )
        rows.append(row)
    base = next((x for x in rows if x["scheme"] == "residual" and "ms_per_step" in x), None)
    for row in rows:
        if base is not None and "ms_per_step" in row:
            row["vs_residual"] = row["ms_per_step"] / base["ms_per_step"]
    return rows


def table(rows: list[dict]) -> str:
    eager = {r["scheme"]: r for r in rows if r["mode"] == "eager" and "ms_per_step" in r}
    head = "| scheme | mode | params | ms/step (median) | min–max ms | tokens/s | × residual | eager/compiled |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "ms_per_step" not in r:
            lines.append(f"| {r['scheme']} | {r['mode']} | {r.get('params', '')} | failed: {r['error']} | | | | |")
            continue
        speedup = ""
        if r["mode"] != "eager" and r["scheme"] in eager:
            speedup = f"{eager[r['scheme']]['ms_per_step'] / r['ms_per_step']:.2f}×"
        vs = f"{r['vs_residual']:.3f}" if "vs_residual" in r else ""
        lines.append(
            f"| {r['scheme']} | {r['mode']} | {r['params']:,} | {r['ms_per_step']:.1f} | "
            f"{r['ms_min']:.0f}–{r['ms_max']:.0f} | {r['tokens_per_s']:,.0f} | {vs} | {speedup} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # True fp32 matrix products on the GPU, as widen's cuBLAS sgemm calls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = config_from(args)
    listed = [s for s in args.schemes.split(",") if s]
    schemes = listed if args.no_baseline else ["residual"] + [s for s in listed if s != "residual"]
    unknown = [s for s in schemes if s not in SCHEMES]
    modes = [m for m in args.modes.split(",") if m]
    bad_modes = [m for m in modes if m not in ("eager", "compile")]
    if unknown or bad_modes:
        print(f"unknown schemes {unknown} / modes {bad_modes}; schemes: {SCHEMES}, modes: eager, compile",
              file=sys.stderr)
        return 2

    gen = torch.Generator().manual_seed(args.seed)
    n_windows = args.warmup + args.steps
    windows = [
        torch.randint(0, cfg.vocab, (args.batch, args.seq_len + 1), generator=gen).to(args.device)
        for _ in range(n_windows)
    ]

    rows = []
    for mode in modes:
        rows += run_mode(mode, schemes, cfg, args, windows)

    print(table(rows))
    # ru_maxrss is in KiB on Linux: the whole process, every model it built.
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    print(f"peak memory: {peak_gib:.2f} GiB resident (ru_maxrss) for {', '.join(schemes)}")
    if args.json:
        report = {
            "config": {
                "vocab": cfg.vocab, "d_model": cfg.d_model, "layers": cfg.layers, "heads": cfg.heads,
                "ffn_hidden": cfg.hidden, "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
                "warmup": args.warmup, "vwn": {"m": cfg.vwn_m, "n": cfg.vwn_n},
                "mhc": {"n": cfg.mhc_n, "sinkhorn_iters": cfg.sinkhorn_iters},
                "xhc": {"n": cfg.xhc_n, "k": cfg.xhc_k, "fixed": cfg.xhc_fixed, "kernels": list(cfg.xhc_kernels)},
                "optimizer": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay,
                              "clip": args.clip},
                "compile_mode": args.compile_mode,
            },
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "nproc": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "peak_rss_gib": peak_gib,
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
