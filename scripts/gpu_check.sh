#!/usr/bin/env bash
# GPU check (docs/architecture.md §9 item 6, §10): one prepared run on a CUDA machine
# with no Rust toolchain and no network. Results go to $OUT as JSON + logs.
#
# Usage
#   1. On the build machine (x86-64, glibc <= the GPU image's), from the
#      repository root:
#        scripts/gpu_check.sh prepare
#      which runs
#        cargo test --release --workspace --no-run
#      (it builds target/release/widen for the integration tests) and copies target/release/widen and the cuda_device test executable
#      into gpu-bin/, plus gpu-bin/widen-mpi (built with --features mpi, for
#      the nccl section) when mpirun is here and PROFILE is release, with the sm_90 CUBIN of every spec's GPU Plan in
#      gpu-bin/cache (the GPU run points WIDEN_CACHE_DIR there). gpu-bin/ is
#      ignored locally through .git/info/exclude, so it never shows up in
#      commits. Carry that one folder to the GPU machine.
#   2. On the GPU machine, from the repository root (specs/ must be there):
#        OUT=/some/dir scripts/gpu_check.sh [smoke|full]
#      Two stages, each section with its own timeout:
#        smoke  (under 3 minutes) env, device, and parity of specs/tiny.ron and
#               specs/mhc.ron one after the other: if any of them fails, the
#               script stops there with summary.json saying what failed, so a
#               broken build costs 3 minutes, not 10.
#        full   (under 8 minutes) parity of every spec, nccl, bench + kernels, torch.
#      No argument runs smoke, then full when smoke passed. TORCH=0 skips the
#      PyTorch section (a rerun after a change to widen alone: PyTorch's
#      figures do not move). Every parity run uses --isolate: each spec in its
#      own process, so a GPU fault (a sticky context error) fails one spec only.
#      WIDEN_CUDA_SYNC=1 is set for the smoke stage's parity, so a fault there
#      names its kernel and Plan step.
#
# Sections and what each needs (timeouts add up to under 8 minutes)
#   env        nvidia-smi, the libraries found (libcuda, libcublas, libnvrtc).
#   device     gpu-bin/cuda_device: the Cuda device on a hand-built Plan
#              (thread-per-item and block-per-item kernels, arena scratch,
#              constants, zero steps, every GEMM layout incl. broadcast and
#              accumulate) against an f64 host reference, per-step profiling,
#              the device-to-device copy bandwidth, and training steps whose
#              update runs in the Plan against the same steps on the Cpu
#              device.                                               (40 s)
#   smoke      `widen parity` of tiny and mhc, one after the other (90 s).
#   parity     `widen parity specs/*.ron --device cuda`: every spec as
#              written, CUDA vs the reference executor from the same
#              parameters and batches: loss, validation loss, logits, every
#              gradient, every parameter after 5 training steps (on the GPU
#              the Plan's own AdamW update, parameters and moments resident),
#              each against its fp32 tolerance (mhc-bf16: the bf16 tolerances,
#              cuBLAS bf16 GEMMs). Specs run in parallel (Plan
#              compilation by NVRTC dominates).                       (80 s)
#   nccl       only where mpirun and gpu-bin/widen-mpi exist: specs/tiny.ron
#              for 5 steps as a plain CUDA run, then as one rank through
#              NCCL (`mpirun -n 1`, WIDEN_DIST_FORCE=1), same binary; the
#              losses must be equal, bit for bit (docs/distributed.md).  (45 s)
#   bench      `widen bench --device cuda` on a GPT-2-small backbone (D=768,
#              L=12, 12 heads, T=1024, B=8) for residual, mhc, vwn-r4, xhc,
#              each against its plain-residual baseline (bench pairs them
#              itself); the same run then profiles every Plan step
#              (--profile-kernels): per fused kernel, achieved bytes/s
#              against the measured copy bandwidth, connection kernels
#              flagged and summed. The 7 models build in parallel (NVRTC:
#              about 20 s for xHC's 97 distinct kernels), then 1 warmup and 5
#              timed steps each.                                     (240 s)
#   torch      benches/pytorch/bench.py --device cuda --modes eager at the
#              same backbone (the image's PyTorch): the same schemes in
#              fp32 with TF32 off, as widen's cuBLAS calls.          (100 s)
#
# Files under $OUT (at most 10): summary.json, env.txt, cuda_device.log,
# smoke.json, parity.json, nccl.json, bench.json, kernels.json, torch.json,
# gpu_check.log.

set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${GPU_BIN:-gpu-bin}

if [[ "${1:-}" == "prepare" ]]; then
    set -e
    # PROFILE=debug reuses a test build (CI checks the preparation that way);
    # the GPU machine gets the release build.
    case "${PROFILE:-release}" in
        release) cargo_profile=(--release); dir=release ;;
        debug) cargo_profile=(); dir=debug ;;
        *) echo "PROFILE must be release or debug" >&2; exit 2 ;;
    esac
    # --workspace, as CI's test run: the same feature set, so a build CI has just made is
    # reused as it is; the integration tests need target/$dir/widen, so this builds it too.
    test_exe=$(cargo test "${cargo_profile[@]}" --workspace --no-run 2>&1 \
        | sed -n "s/.*(\(target\/$dir\/deps\/cuda_device-[0-9a-f]*\)).*/\1/p" | tail -n 1)
    [[ -n "$test_exe" && -x "$test_exe" ]] || { echo "cuda_device test executable not found" >&2; exit 1; }
    mkdir -p "$BIN"
    cp "target/$dir/widen" "$BIN/widen"
    cp "$test_exe" "$BIN/cuda_device"
    # The NCCL check's binary: MPI is a feature, off in the test build above.
    rm -f "$BIN/widen-mpi"
    if [[ "$dir" == release ]] && command -v mpirun > /dev/null; then
        cargo build --release --features mpi --bin widen
        cp target/release/widen "$BIN/widen-mpi"
    fi
    # The sm_90 CUBIN of every spec's GPU Plan (as parity builds it), so the GPU
    # machine loads them from $BIN/cache instead of compiling (needs NVRTC here).
    rm -rf "$BIN/cache" "$BIN/compile-tmp"
    # PREPARE_SPECS narrows the list (CI checks the mechanism on two specs).
    read -r -a specs <<< "${PREPARE_SPECS:-$(echo specs/*.ron)}"
    for spec in "${specs[@]}"; do
        WIDEN_CACHE_DIR="$BIN/cache" "$BIN/widen" compile "$spec" -o "$BIN/compile-tmp" --force > /dev/null
    done
    rm -rf "$BIN/compile-tmp"
    # (No cache folder at all when NVRTC was missing: count zero, then say so.)
    cubins=$( (find "$BIN/cache" -name '*.cubin' 2>/dev/null || true) | wc -l)
    echo "cached CUBINs: $cubins for ${#specs[@]} specs"
    (( cubins == ${#specs[@]} )) || { echo "NVRTC must be loadable here to build the CUBINs (LD_LIBRARY_PATH)" >&2; exit 1; }
    # Keep gpu-bin/ out of `git status` (a clone without .git/info, as in CI, has nothing to keep).
    if [[ -d .git/info ]] && ! grep -qx '/gpu-bin/' .git/info/exclude 2>/dev/null; then
        echo '/gpu-bin/' >> .git/info/exclude
    fi
    du -sh "$BIN"
    exit 0
fi

STAGE=${1:-all}
case "$STAGE" in
    smoke|full|all) ;;
    *) echo "usage: scripts/gpu_check.sh [prepare|smoke|full]" >&2; exit 2 ;;
esac
OUT=${OUT:?set OUT to the folder for results}
# The CUBINs prepare built here: a Plan found there is not compiled again.
[[ -d "$BIN/cache" ]] && export WIDEN_CACHE_DIR="$PWD/$BIN/cache"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }

# ---------------------------------------------------------------- libraries
# libcuda comes with the driver; cuBLAS and NVRTC 13 from the CUDA toolkit or
# the pip wheels (nvidia-cublas, nvidia-cuda-nvrtc) of the image's python.
# The loader must see them before our processes start (codegen::nvrtc, cudarc).
lib_dirs=()
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -d "$d" ]] && lib_dirs+=("$d")
done
# The pip wheels' folders, found by globbing (no Python needed to look).
shopt -s nullglob
for d in /usr/lib/python3*/{site,dist}-packages/nvidia/{cu13,*}/lib \
         /usr/local/lib/python3*/{site,dist}-packages/nvidia/{cu13,*}/lib \
         "$HOME"/.local/lib/python3*/site-packages/nvidia/{cu13,*}/lib \
         /opt/conda/lib/python3*/site-packages/nvidia/{cu13,*}/lib; do
    libs=("$d"/libcublas.so.13* "$d"/libnvrtc.so.13*)
    (( ${#libs[@]} > 0 )) && lib_dirs+=("$d")
done
shopt -u nullglob
LD_LIBRARY_PATH="$(IFS=:; echo "${lib_dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH

find_lib() {
    local name=$1 d
    for d in "${lib_dirs[@]}"; do
        [[ -e "$d/$name" ]] && { echo "$d/$name"; return; }
    done
    ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n { print $NF; exit }'
}

# ---------------------------------------------------------------- env
log "env"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    for l in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libnvrtc.so.13; do
        echo "$l: $(find_lib $l)"
    done
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" | tee -a "$LOG"

status_device=missing
status_smoke=missing
status_parity=missing
status_bench=missing
status_kernels=missing
status_torch=missing
status_nccl=missing

# "passed"/"ran" for exit 0, else what the exit code means.
outcome() {
    case $1 in
        0) echo "$2" ;;
        124) echo "timed out" ;;
        *) echo "failed (exit $1)" ;;
    esac
}

# ---------------------------------------------------------------- device
if [[ "$STAGE" == full ]]; then
    status_device="not run (full stage: it runs in smoke)"
elif [[ -x "$BIN/cuda_device" ]]; then
    log "device: $BIN/cuda_device"
    timeout 40 "$BIN/cuda_device" --test-threads=1 > "$OUT/cuda_device.log" 2>&1
    status_device=$(outcome $? passed)
    tail -n 5 "$OUT/cuda_device.log" | tee -a "$LOG"
    # Without a driver the gpu_* tests pass vacuously; make that visible.
    [[ -z "$(find_lib libcuda.so.1)" ]] && status_device="$status_device, but no libcuda: GPU tests skipped"
else
    log "device: $BIN/cuda_device missing (run 'scripts/gpu_check.sh prepare' and carry $BIN)"
fi

WIDEN="$BIN/widen"

# ---------------------------------------------------------------- smoke
if [[ "$STAGE" != full ]]; then
    if [[ -x "$WIDEN" ]]; then
        log "smoke: parity of specs/tiny.ron and specs/mhc.ron, one after the other"
        WIDEN_CUDA_SYNC=1 timeout 90 "$WIDEN" parity specs/tiny.ron specs/mhc.ron --device cuda --steps 5 \
            --isolate --json "$OUT/smoke.json" 2>&1 | tee -a "$LOG"
        status_smoke=$(outcome "${PIPESTATUS[0]}" passed)
    else
        log "smoke: $WIDEN missing (run 'scripts/gpu_check.sh prepare' and carry $BIN)"
    fi
    if [[ "$status_device" != passed || "$status_smoke" != passed ]]; then
        log "smoke stage failed (device: $status_device, parity: $status_smoke): stopping before the full stage"
        STAGE=stopped
    fi
fi

if [[ "$STAGE" == smoke || "$STAGE" == stopped ]]; then
    status_parity="not run ($STAGE)"; status_bench="not run ($STAGE)"
    status_kernels="not run ($STAGE)"; status_torch="not run ($STAGE)"
    status_nccl="not run ($STAGE)"
elif [[ -x "$WIDEN" ]]; then
    # ------------------------------------------------------------ parity
    # Exits non-zero when any spec is out of tolerance or cannot run;
    # parity.json is rewritten after every spec, so a timeout keeps the rest.
    log "parity: every spec in specs/"
    timeout 150 "$WIDEN" parity specs/*.ron --device cuda --steps 5 --isolate --json "$OUT/parity.json" 2>&1 \
        | tee -a "$LOG"
    status_parity=$(outcome "${PIPESTATUS[0]}" passed)

    # ------------------------------------------------------------ nccl
    # One rank through NCCL must train what the plain CUDA step trains.
    if ! command -v mpirun > /dev/null; then
        status_nccl="skipped (no mpirun here)"
    elif [[ ! -x "$BIN/widen-mpi" ]]; then
        status_nccl="skipped ($BIN/widen-mpi missing: prepare builds it where mpirun is)"
    else
        log "nccl: specs/tiny.ron, plain CUDA vs one rank through NCCL"
        runs=$(mktemp -d)
        timeout 20 "$BIN/widen-mpi" train specs/tiny.ron --device cuda --steps 5 --out "$runs/plain" 2>&1 \
            | tee -a "$LOG"
        code=${PIPESTATUS[0]}
        if [[ $code == 0 ]]; then
            WIDEN_DIST_FORCE=1 timeout 25 mpirun --allow-run-as-root -n 1 -x WIDEN_DIST_FORCE \
                "$BIN/widen-mpi" train specs/tiny.ron --device cuda --steps 5 --out "$runs/nccl" 2>&1 | tee -a "$LOG"
            code=${PIPESTATUS[0]}
        fi
        python3 - "$runs" "$OUT/nccl.json" "$(outcome "$code" ran)" <<'PY'
import json, sys
runs, out, ran = sys.argv[1:4]
def losses(name):
    try:
        return [json.loads(l).get("loss") for l in open(f"{runs}/{name}/metrics.jsonl")]
    except OSError:
        return []
plain, nccl = losses("plain"), losses("nccl")
equal = ran == "ran" and len(plain) > 0 and plain == nccl
json.dump({"status": "passed" if equal else ("differ" if ran == "ran" else ran),
           "plain_losses": plain, "nccl_losses": nccl}, open(out, "w"), indent=2)
PY
        status_nccl=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["status"])' "$OUT/nccl.json")
        rm -rf "$runs"
    fi

    # ------------------------------------------------------------ bench + kernels
    GPT2=(--d-model 768 --layers 12 --heads 12 --seq-len 1024 --batch 8)
    BENCH_SPECS=(specs/residual.ron specs/mhc.ron specs/vwn-r4.ron specs/xhc.ron)
    log "bench: ${BENCH_SPECS[*]} at ${GPT2[*]}, then per-kernel bandwidth"
    timeout 240 "$WIDEN" bench "${BENCH_SPECS[@]}" --device cuda "${GPT2[@]}" --steps 5 --warmup 1 \
        --json "$OUT/bench.json" --profile-kernels "$OUT/kernels.json" 2>&1 | tee -a "$LOG"
    code=${PIPESTATUS[0]}
    # bench.json is written before profiling starts: each file has its own status.
    if [[ -s "$OUT/bench.json" ]]; then status_bench=ran; else status_bench=$(outcome "$code" ran); fi
    if [[ -s "$OUT/kernels.json" ]]; then status_kernels=ran; else status_kernels=$(outcome "$code" ran); fi
else
    log "parity, bench, kernels: $WIDEN missing (run 'scripts/gpu_check.sh prepare' and carry $BIN)"
fi

# ---------------------------------------------------------------- torch
if [[ "$STAGE" == smoke || "$STAGE" == stopped ]]; then
    :
elif [[ "${TORCH:-1}" == 0 ]]; then
    log "torch: skipped (TORCH=0)"
    status_torch=skipped
else
    log "torch: PyTorch eager on the GPU at the bench backbone"
    timeout 100 python3 benches/pytorch/bench.py --device cuda --modes eager --schemes vwn,mhc,xhc \
        --d-model 768 --layers 12 --heads 12 --seq-len 1024 --batch 8 --steps 5 --warmup 1 \
        --json "$OUT/torch.json" 2>&1 | tee -a "$LOG"
    code=${PIPESTATUS[0]}
    if [[ -s "$OUT/torch.json" ]]; then status_torch=ran; else status_torch=$(outcome "$code" ran); fi
fi

# ---------------------------------------------------------------- summary
python3 - "$OUT" "$status_device" "$status_parity" "$status_bench" "$status_kernels" "$status_torch" \
    "$status_smoke" "$STAGE" "$status_nccl" <<'EOF'
import json, os, re, sys
out, device, parity, bench, kernels, torch_status, smoke, stage, nccl = sys.argv[1:10]
tests = {}
try:
    for line in open(f"{out}/cuda_device.log"):
        m = re.match(r"test (\S+) \.\.\. (\w+)", line)
        if m:
            tests[m.group(1)] = m.group(2)
except OSError:
    pass
summary = {
    "stage": stage,
    "device": {"status": device, "tests": tests},
    "smoke": {"status": smoke, "file": "smoke.json" if os.path.exists(f"{out}/smoke.json") else None},
    "parity": {"status": parity, "file": "parity.json" if os.path.exists(f"{out}/parity.json") else None},
    "nccl": {"status": nccl, "file": "nccl.json" if os.path.exists(f"{out}/nccl.json") else None},
    "bench": {"status": bench, "file": "bench.json" if bench == "ran" else None},
    "kernels": {"status": kernels, "file": "kernels.json" if kernels == "ran" else None},
    "torch": {"status": torch_status, "file": "torch.json" if torch_status == "ran" else None},
}
try:
    doc = json.load(open(f"{out}/parity.json"))
    summary["parity"]["failed_specs"] = [
        s["path"] for s in doc["specs"] if "error" in s or not s["report"]["passed"]
    ]
    summary["parity"]["specs_checked"] = len(doc["specs"])
except (OSError, ValueError, KeyError):
    pass
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
EOF

# A stopped smoke stage is a failed check.
[[ "$STAGE" == stopped ]] && exit 1
exit 0
