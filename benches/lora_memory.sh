#!/usr/bin/env bash
# LoRA agents against their full checkpoints: a synthetic base with a rank-RANK adapter on every
# projection (benches/write_lora.py) merged beside a full agent, next to the same merge with the
# adapter first merged into a bf16 checkpoint, then into an f32 one (the agent's exact values).
# Prints, per method, the median and range of peak RSS and the median wall time of RUNS runs.
#
#   benches/lora_memory.sh [MODEL_SIZE=512MiB] [RUNS=7] [DIR=target/bench-lora] [RANK=16]
#
# THREADS=N passes --threads N (default: every core). BASE=DIR AGENT=DIR measure on checkpoints of
# your own (any Hugging Face folders of one base, e.g. a 7B one, or benches/write_7b_shapes.py's
# with a second adapter merged in as the agent) instead of the demo's synthetic ones: the adapter
# and the full checkpoints are written under DIR. DORA=1 makes the adapter a
# DoRA one (a magnitude vector per module).
set -euo pipefail
size=${1:-512MiB}
runs=${2:-7}
dir=${3:-target/bench-lora}
rank=${4:-16}
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/rlmerge
threads=(--threads "${THREADS:-0}")
base=${BASE:-$dir/base}
agent=${AGENT:-$dir/tool-agent}
dora=${DORA:+dora}
made="$dir/.made-$rank-${BASE:+$(echo "$BASE" | tr / _)}$size$dora"
if [ ! -f "$made" ]; then
    if [ -z "${BASE:-}" ]; then
        rm -rf "$dir"
        "$bin" demo "$dir" --model-size "$size" --write-only --quiet >/dev/null
    fi
    # Only what this script writes is replaced.
    rm -rf "$dir/lora" "$dir/full-bf16" "$dir/full-f32" "$dir"/.made-*
    mkdir -p "$dir"
    python3 benches/write_lora.py "$base" "$dir/lora" "$rank" 0 $dora >/dev/null
    for dtype in bf16 f32; do
        "$bin" merge -q --device cpu --base "$base" --model "$dir/lora" \
            --method task_arithmetic --param weight=1 --out-dtype "$dtype" -o "$dir/full-$dtype" >/dev/null
    done
    touch "$made"
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# "median (min-max)" of peak RSS in MB, then the median seconds, over $runs runs. The previous
# output is deleted and dirty pages flushed first (as benches/end_to_end.sh does), so no run pays
# for the writeback of the one before.
measure() {
    local samples
    samples=$(for _ in $(seq "$runs"); do
        rm -rf "$out/m"
        sync
        /usr/bin/time -f "%M %e" "$bin" merge -q --device cpu "${threads[@]}" "$@" -o "$out/m" 2>&1 >/dev/null | tail -1
    done)
    local rss secs
    rss=$(cut -d' ' -f1 <<<"$samples" | sort -n | awk '{ a[NR] = $1 } END {
        printf "%.2f (%.2f-%.2f) MB", a[int((NR + 1) / 2)] / 1024, a[1] / 1024, a[NR] / 1024 }')
    secs=$(cut -d' ' -f2 <<<"$samples" | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
    echo "$rss $secs s"
}

printf '%-16s %-32s %-32s %-32s\n' method "LoRA agent" "bf16 full checkpoint" "f32 full checkpoint"
for method in "ram" "task_arithmetic --param weight=0.5" "ties --param weight=0.5 --param density=0.5"; do
    printf '%-16s' "${method%% *}"
    for lora in lora full-bf16 full-f32; do
        # shellcheck disable=SC2086
        printf ' %-32s' "$(measure --base "$base" --model "$dir/$lora" --model "$agent" --method $method)"
    done
    echo
done
