#!/usr/bin/env bash
# A 3-expert MoE at Llama-7B's shapes: `rlmerge moe` (cheap_embed routers, Mixtral output) against
# its read limit and, where mergekit is installed beside $BENCH_PYTHON, mergekit-moe on the same
# config, files and CPU. Prints each one's median wall time and peak RSS (rlmerge's runs
# interleaved with the read limit's).
#
#   BENCH_PYTHON=python-with-numpy-and-tokenizers benches/moe.sh [RUNS=3] [DIR=target/bench-models-7b] [THREADS=0]
#
# DIR holds the base and the three agents of benches/7b_set.sh (the set BENCH_SET=7b
# benches/end_to_end.sh times), written here when missing, and a 32000-token word-level
# tokenizer for the base (the prompts' tokens).
# The MoE reads the base's attention, embeddings and norms and each expert's MLPs (2.4 GB) and
# writes them once: its read limit is `cat` of that many bytes (the output's weights, warm) plus
# `cp` of the output folder — reading and writing the bytes once, as a copy does.
set -euo pipefail
runs=${1:-3}
dir=${2:-target/bench-models-7b}
threads=${3:-0}
py=${BENCH_PYTHON:-python3}
cd "$(dirname "$0")/.."
cargo build --release --quiet
source benches/7b_set.sh
write_7b_set "$dir" "$py"
if [ ! -f "$dir/base/tokenizer.json" ]; then
    "$py" - "$dir/base" <<'EOF'
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {f"w{i}": i for i in range(32000)}
vocab.update({"<s>": 1, "</s>": 2})
t = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
t.pre_tokenizer = pre_tokenizers.Whitespace()
t.save(f"{sys.argv[1]}/tokenizer.json")
json.dump({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"},
          open(f"{sys.argv[1]}/tokenizer_config.json", "w"))
EOF
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
config=$out/moe.yml
abs=$(cd "$dir" && pwd)
cat >"$config" <<EOF
base_model: $abs/base
gate_mode: cheap_embed
dtype: bfloat16
experts_per_token: 2
experts:
  - source_model: $abs/coding-agent
    positive_prompts: ["w10 w11 w12 w13", "w14 w15"]
  - source_model: $abs/tool-agent
    positive_prompts: ["w200 w201 w202"]
  - source_model: $abs/memory-agent
    positive_prompts: ["w3000 w3001", "w3002 w3003 w3004"]
EOF

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# Seconds and peak RSS of one command, the outputs of earlier runs deleted and flushed first.
seconds() {
    rm -rf "$out/m" "$out/cp"
    sync
    /usr/bin/time -f "%e %M" "$@" 2>&1 >/dev/null | tail -1
}
report() {
    local label=$1
    shift
    local times=() rss=0
    for _ in $(seq "$runs"); do
        read -r t m < <(seconds "$@")
        times+=("$t")
        if [ "$m" -gt "$rss" ]; then rss=$m; fi
    done
    local med
    med=$(printf '%s\n' "${times[@]}" | median)
    printf '%-28s %7.2f s  %5.2fx the read limit  peak RSS %s MiB\n' "$label" "$med" \
        "$(echo "$med / $limit" | bc -l)" "$((rss / 1024))"
}

# Once, to have the output's size and to warm the cache with what the MoE reads.
target/release/rlmerge moe "$config" "$out/ref" --threads "$threads" >/dev/null
weights=("$out"/ref/*.safetensors)
bytes=$(cat "${weights[@]}" | wc -c)
# The read limit and rlmerge side by side, run after run (the machine's page cache and writeback
# move every figure by 2x from one minute to the next; interleaved, both see the same).
reads=() copies=() moes=() rss=0
for _ in $(seq "$runs"); do
    reads+=("$(seconds cat "${weights[@]}" | cut -d' ' -f1)")
    copies+=("$(seconds cp -r "$out/ref" "$out/cp" | cut -d' ' -f1)")
    read -r t m < <(seconds target/release/rlmerge moe "$config" "$out/m" -q --threads "$threads")
    moes+=("$t")
    if [ "$m" -gt "$rss" ]; then rss=$m; fi
done
read_s=$(printf '%s\n' "${reads[@]}" | median)
cp_s=$(printf '%s\n' "${copies[@]}" | median)
limit=$(echo "$read_s + $cp_s" | bc -l)
printf 'MoE of 3 experts at 7B shapes: %s bytes written; cat %.2f s + cp %.2f s = read limit %.2f s (median of %s)\n\n' \
    "$bytes" "$read_s" "$cp_s" "$limit" "$runs"
med=$(printf '%s\n' "${moes[@]}" | median)
printf '%-28s %7.2f s  %5.2fx the read limit  peak RSS %s MiB  (runs: %s)\n' "rlmerge moe" "$med" \
    "$(echo "$med / $limit" | bc -l)" "$((rss / 1024))" "${moes[*]}"
mergekit_moe=$(dirname "$(command -v "$py")")/mergekit-moe
if [ -x "$mergekit_moe" ]; then
    HF_HUB_OFFLINE=1 report "mergekit-moe 0.1.5" "$mergekit_moe" "$config" "$out/m"
fi
