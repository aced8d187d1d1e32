#!/usr/bin/env bash
# A/B timing of two rlmerge binaries on the same synthetic base + 3 agents: runs alternate
# (A, B, A, B, …) so a noisy machine slows both alike; prints each method's median wall time for
# both and the ratio B/A. For checking that a change is not slower (benches/same_bytes.sh checks
# that it writes the same bytes).
#
#   benches/ab.sh OLD_BIN NEW_BIN [MODEL_SIZE=1GiB] [RUNS=3] [DIR=target/bench-models]
#
# BENCH_METHODS="ram ties" runs only those (labels as printed: ram+tensor, ram/t4096, ram/consensus).
set -euo pipefail
a=$(realpath "$1")
b=$(realpath "$2")
size=${3:-1GiB}
runs=${4:-3}
dir=${5:-target/bench-models}
cd "$(dirname "$0")/.."
if [ ! -f "$dir/.size-$size" ]; then
    rm -rf "$dir"
    "$b" demo "$dir" --model-size "$size" --write-only --quiet >/dev/null
    touch "$dir/.size-$size"
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
seconds() {
    rm -rf "$out/m"
    sync
    /usr/bin/time -f "%e" "$@" 2>&1 >/dev/null | tail -1
}
cat "$dir"/*/*.safetensors >/dev/null
printf '%-12s %8s %8s %7s\n' method "A s" "B s" "B/A"
for method in "ram" "ram+" "ram+ --scope tensor" "ties --param weight=1 --param density=0.5" \
    "dare_ties --param weight=1 --param density=0.5" "della --param weight=1 --param density=0.5" \
    "breadcrumbs --param weight=1 --param density=0.9" "ram --tile-elems 4096" \
    "ram --shared consensus"; do
    name=${method%% *}
    [[ "$method" == *"--scope tensor"* ]] && name="ram+tensor"
    [[ "$method" == *"--tile-elems 4096"* ]] && name="ram/t4096"
    [[ "$method" == *"--shared consensus"* ]] && name="ram/consensus"
    if [ -n "${BENCH_METHODS:-}" ] && [[ " $BENCH_METHODS " != *" ${method%% *} "* ]] &&
        [[ " $BENCH_METHODS " != *" $name "* ]]; then
        continue
    fi
    ta=()
    tb=()
    for _ in $(seq "$runs"); do
        for bin in "$a" "$b"; do
            # shellcheck disable=SC2086
            t=$(seconds "$bin" merge -q --device cpu --base "$dir/base" --model "$dir/coding-agent" \
                --model "$dir/tool-agent" --model "$dir/memory-agent" --method $method -o "$out/m")
            if [ "$bin" = "$a" ]; then ta+=("$t"); else tb+=("$t"); fi
        done
    done
    ma=$(printf '%s\n' "${ta[@]}" | median)
    mb=$(printf '%s\n' "${tb[@]}" | median)
    printf '%-12s %8.2f %8.2f %7.3f\n' "$name" "$ma" "$mb" "$(echo "$mb / $ma" | bc -l)"
done
