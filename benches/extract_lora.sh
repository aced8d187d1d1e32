#!/usr/bin/env bash
# LoRA extraction at Llama-7B's shapes: `rlmerge extract-lora` against mergekit-extract-lora's
# arithmetic in torch (benches/extract_lora_vs_torch.py: a full SVD per matrix), on the same
# files and CPU. Prints each one's wall time and peak RSS.
#
#   BENCH_PYTHON=python-with-torch-and-numpy benches/extract_lora.sh [RANK=64] [DIR=target/bench-models-7b] [THREADS=0]
#
# DIR holds the base (benches/write_7b_shapes.py, 2 decoder layers) and the tool agent
# (benches/write_7b_agent.py, 25 % of each matrix moved), written here when missing.
set -euo pipefail
rank=${1:-64}
dir=${2:-target/bench-models-7b}
threads=${3:-0}
py=${BENCH_PYTHON:-python3}
cd "$(dirname "$0")/.."
cargo build --release --quiet
if [ ! -f "$dir/base/model.safetensors" ]; then
    python3 benches/write_7b_shapes.py "$dir/base" 2
fi
if [ ! -f "$dir/tool-agent/model.safetensors" ]; then
    "$py" benches/write_7b_agent.py "$dir/base" "$dir/tool-agent" 0.25 2
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "rlmerge extract-lora, rank $rank:"
/usr/bin/time -f "  %e s wall, %M KiB peak RSS" target/release/rlmerge extract-lora \
    --base "$dir/base" --model "$dir/tool-agent" --rank "$rank" --threads "$threads" \
    -o "$out/lora" | head -1
torch_threads=$threads
if [ "$torch_threads" = 0 ]; then torch_threads=$(nproc); fi
echo "mergekit-extract-lora's arithmetic in torch ($torch_threads threads):"
/usr/bin/time -f "  %e s wall, %M KiB peak RSS" "$py" benches/extract_lora_vs_torch.py \
    "$dir/base" "$dir/tool-agent" "$rank" "$torch_threads" | head -1
