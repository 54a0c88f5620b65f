#!/usr/bin/env bash
# A GPT-2-small-class training step (V = 50304, D = 768, L = 12, H = 12, T = 1024,
# B = 8) for residual, mHC (n = 4) and VWN (r = 4) on the CPU: widen's Cpu device
# against PyTorch eager at the same shape (benches/pytorch/bench.py), one model per
# process so each peak resident set is that model's own, the two systems alternating
# scheme by scheme (docs/performance.md "GPT-2 small against PyTorch").
#
#   scripts/bench_gpt2_pytorch.sh [-s STEPS] [-o DIR] [SCHEME...]
#
# SCHEME is residual, mhc or vwn-r4 (default: all three). widen runs STEPS + 1 steps
# (default STEPS = 2) and the step time is the median of steps 2.. (step 1 allocates);
# PyTorch runs one warm-up step and STEPS timed ones. Needs `cargo build --release`
# and `pip install torch numpy`. Logs and JSON go to DIR (default bench-gpt2).
set -euo pipefail
steps=2
out=bench-gpt2
while getopts "s:o:" opt; do
    case "$opt" in
        s) steps="$OPTARG" ;;
        o) out="$OPTARG" ;;
        *) echo "usage: $0 [-s STEPS] [-o DIR] [SCHEME...]" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
root="$(cd "$(dirname "$0")/.." && pwd)"
widen="$root/target/release/widen"
[ -x "$widen" ] || { echo "$widen: build it first with cargo build --release" >&2; exit 2; }
schemes=("$@")
[ "${#schemes[@]}" -gt 0 ] || schemes=(residual mhc vwn-r4)
mkdir -p "$out"
shape=(--set vocab=50304 --set d_model=768 --set layers=12 --set heads=12
       --set train.seq_len=1024 --set train.batch=8)
for scheme in "${schemes[@]}"; do
    case "$scheme" in
        residual) torch_scheme=residual ;;
        mhc) torch_scheme=mhc ;;
        vwn-r4) torch_scheme=vwn ;;
        *) echo "unknown scheme $scheme: residual, mhc or vwn-r4" >&2; exit 2 ;;
    esac
    rm -rf "$out/run-$scheme"
    "$widen" train "$root/specs/$scheme.ron" "${shape[@]}" --steps $((steps + 1)) \
        --set train.eval_every=100000 --set train.eval_batches=1 --out "$out/run-$scheme" \
        > "$out/widen-$scheme.log" 2>&1 || echo "widen $scheme failed (see $out/widen-$scheme.log)"
    python3 - "$out/run-$scheme/metrics.jsonl" "$out/widen-$scheme.log" "$scheme" <<'PY' || true
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms = [1e3 * r["tokens"] / r["tokens_per_s"] for r in rows if r.get("step", 0) >= 2 and r.get("tokens_per_s")]
peak = [l.strip() for l in open(sys.argv[2]) if l.startswith("peak memory")]
print(f"widen {sys.argv[3]}: {statistics.median(ms):.0f} ms/step (steps 2..), {peak[-1] if peak else 'no peak line'}")
PY
    python3 "$root/benches/pytorch/bench.py" --vocab 50304 --d-model 768 --layers 12 --heads 12 \
        --seq-len 1024 --batch 8 --steps "$steps" --warmup 1 --modes eager --schemes "$torch_scheme" \
        --no-baseline --json "$out/torch-$scheme.json" > "$out/torch-$scheme.log" 2>&1 \
        || echo "pytorch $scheme failed (see $out/torch-$scheme.log)"
    grep -E "^\| $torch_scheme|^peak memory" "$out/torch-$scheme.log" | sed "s/^/pytorch $scheme: /" || true
done
