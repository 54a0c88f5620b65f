#!/usr/bin/env bash
# Causal attention forward + backward on the Cpu device at several sequence lengths,
# for one or more builds side by side: each round runs every build once per length,
# so a noisy machine slows them alike (docs/performance.md "attention in query blocks").
#
#   scripts/bench_attention.sh [-r ROUNDS] [-t "256 1024 2048"] [-p] BENCH_BINARY...
#
# A BENCH_BINARY is a built `attention` bench (`cargo bench --bench attention --no-run`
# prints its path), e.g. one from this checkout and one from an older commit. With -p,
# every round also runs PyTorch's scaled_dot_product_attention at the same shape
# (benches/pytorch/attention.py; needs `pip install torch`).
set -euo pipefail
rounds=3
lengths="256 1024 2048"
torch=0
here="$(cd "$(dirname "$0")" && pwd)"
while getopts "r:t:p" opt; do
    case "$opt" in
        r) rounds="$OPTARG" ;;
        t) lengths="$OPTARG" ;;
        p) torch=1 ;;
        *) echo "usage: $0 [-r ROUNDS] [-t LENGTHS] [-p] BENCH_BINARY..." >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ "$#" -eq 0 ]; then
    echo "usage: $0 [-r ROUNDS] [-t LENGTHS] [-p] BENCH_BINARY..." >&2
    exit 2
fi
for bin in "$@"; do
    [ -x "$bin" ] || { echo "$bin: not an executable bench binary" >&2; exit 2; }
done
for round in $(seq 1 "$rounds"); do
    for t in $lengths; do
        for bin in "$@"; do
            echo "round $round $(basename "$(dirname "$(dirname "$(dirname "$(dirname "$bin")")")")"): $("$bin" "$t" 8 12 64 5)"
        done
        if [ "$torch" -eq 1 ]; then
            echo "round $round pytorch: $(python3 "$here/../benches/pytorch/attention.py" "$t" 8 12 64 5)"
        fi
    done
done
