#!/usr/bin/env bash
# LoRA extraction at Llama-7B's shapes: `rlmerge extract-lora` against mergekit-extract-lora's
# arithmetic in torch (benches/extract_lora_vs_torch.py: a full SVD per matrix), on the same
# files and CPU, and mergekit-extract-lora itself where mergekit is installed beside
# $BENCH_PYTHON (then also each module's relative error in both adapters). Prints each one's wall
# time and peak RSS.
#
#   BENCH_PYTHON=python-with-torch-and-numpy benches/extract_lora.sh [RANK=64] [DIR=target/bench-models-7b] [THREADS=0]
#
# DIR holds the base and the tool agent (25 % of each matrix moved) of benches/7b_set.sh, written
# here when missing.
set -euo pipefail
rank=${1:-64}
dir=${2:-target/bench-models-7b}
threads=${3:-0}
py=${BENCH_PYTHON:-python3}
cd "$(dirname "$0")/.."
cargo build --release --quiet
source benches/7b_set.sh
write_7b_set "$dir" "$py" tool-agent
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
mergekit_extract=$(dirname "$(command -v "$py")")/mergekit-extract-lora
if [ -x "$mergekit_extract" ]; then
    abs=$(cd "$dir" && pwd)
    echo "mergekit-extract-lora 0.1.5 itself:"
    HF_HUB_OFFLINE=1 /usr/bin/time -f "  %e s wall, %M KiB peak RSS" "$mergekit_extract" \
        --base-model "$abs/base" --model "$abs/tool-agent" --max-rank "$rank" --quiet \
        --out-path "$out/mergekit-lora" >/dev/null 2>"$out/mergekit.log" || true
    tail -1 "$out/mergekit.log"
    if [ -f "$out/mergekit-lora/adapter_model.safetensors" ]; then
        "$py" - "$dir" "$out/lora" "$out/mergekit-lora" <<'PY'
# Each module's relative error ‖Δ − B·A‖/‖Δ‖ in both adapters (Δ from the bf16 files).
import sys
import torch
from safetensors.torch import load_file
d, mine, theirs = sys.argv[1:]
b, a = load_file(f"{d}/base/model.safetensors"), load_file(f"{d}/tool-agent/model.safetensors")
m, t = load_file(f"{mine}/adapter_model.safetensors"), load_file(f"{theirs}/adapter_model.safetensors")
worse = []
for k in sorted(m):
    if k.endswith("lora_A.weight") and k in t:
        name = k[len("base_model.model."):-len(".lora_A.weight")] + ".weight"
        delta = a[name].float() - b[name].float()
        err = lambda s: ((delta - s[k.replace("lora_A", "lora_B")].float() @ s[k].float()).norm() / delta.norm()).item()
        worse.append((err(m) - err(t), name, err(m), err(t)))
worst = max(worse)
print(f"  relative error per module, rlmerge − mergekit: at most {worst[0]:+.2e} ({worst[1]}: {worst[2]:.4f} vs {worst[3]:.4f}) over {len(worse)} modules")
PY
    fi
fi
