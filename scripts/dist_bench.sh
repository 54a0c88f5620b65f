#!/usr/bin/env bash
# The data-parallel measurement of docs/distributed.md ("Measurements"): the README's
# bench configuration trained for STEPS steps as 1 rank x 2 threads and as 2 ranks x 1
# thread, alternating, REPEATS times each; prints ms/step (median over steps 2..STEPS-1)
# and the all-reduce's time and share of the step from metrics.jsonl.
#   scripts/dist_bench.sh [STEPS] [REPEATS]   (needs Open MPI; builds widen --release --features mpi)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-8}
REPEATS=${2:-2}
cargo build --release --features mpi --bin widen 2>&1 | tail -n 1
WIDEN=$PWD/target/release/widen
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
sed -e 's/d_model: 64,/d_model: 256,/' -e 's/layers: 2,/layers: 4,/' -e 's/seq_len: 64,/seq_len: 256,/' \
    -e "s/steps: 300,/steps: $STEPS,/" -e "s/warmup: 30/warmup: 1/" specs/residual.ron > "$WORK/bench.ron"
summary() {
    python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
rows = [r for r in rows if "tokens_per_s" in r][1:-1] or rows
tokens = 2048
ms = statistics.median(tokens / r["tokens_per_s"] * 1e3 for r in rows)
ar = [r.get("allreduce_ms") for r in rows if r.get("allreduce_ms") is not None]
if ar:
    a = statistics.median(ar)
    print(f"{ms:7.0f} ms/step   all-reduce {a:5.0f} ms/step ({100 * a / ms:.0f} %)")
else:
    print(f"{ms:7.0f} ms/step")
PY
}
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$REPEATS"); do
    (cd "$WORK" && "$WIDEN" train bench.ron --out "r1-$i" > "r1-$i.log" 2>&1) || { cat "$WORK/r1-$i.log"; exit 1; }
    printf '1 rank  x 2 threads, run %s: ' "$i"; summary "$WORK/r1-$i"
    (cd "$WORK" && mpirun --allow-run-as-root --oversubscribe -n 2 \
        "$WIDEN" train bench.ron --out "r2-$i" > "r2-$i.log" 2>&1) || { cat "$WORK/r2-$i.log"; exit 1; }
    printf '2 ranks x 1 thread,  run %s: ' "$i"; summary "$WORK/r2-$i"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
