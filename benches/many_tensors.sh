#!/usr/bin/env bash
# Peak memory and time of a merge whose models hold many tiny tensors (MoE checkpoints have 10^5):
# writes a base and 3 agents of N tensors each (default 600000; header ≈ 58 MB), then times
# `analyze` and `merge --method ram` and `ram+` with /usr/bin/time (wall seconds, peak RSS).
# Usage: benches/many_tensors.sh [N] [DIR]
set -euo pipefail
n=${1:-600000}
dir=${2:-/tmp/rlmerge-many-tensors}
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=$PWD/target/release/rlmerge
mkdir -p "$dir"
python3 - "$n" "$dir" <<'PY'
import json, os, struct, sys
n, root = int(sys.argv[1]), sys.argv[2]
def write(name, every):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    header, data = {}, bytearray()
    for i in range(n):
        header[f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w"] = {
            "dtype": "BF16", "shape": [2], "data_offsets": [4 * i, 4 * i + 4]}
        changed = every and i % every == 0
        data += b"\x80\x3f" + (b"\x90\x3f" if changed else b"\x80\x3f")
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": n // 1000}, f)
for name, every in [("base", 0), ("a", 3), ("b", 5), ("c", 7)]:
    write(name, every)
PY
cd "$dir"
run() {
    rm -rf out
    /usr/bin/time -f "%e s wall, %M KiB peak RSS" "$@" >/dev/null 2>time.txt || { cat time.txt; exit 1; }
    echo "$(tail -1 time.txt)  ← $*" | sed "s|$bin|rlmerge|"
}
echo "$n tensors per model, base + 3 agents"
run "$bin" analyze --device cpu --base base --model a --model b --model c
run "$bin" merge -q --device cpu --method ram --base base --model a --model b --model c -o out
run "$bin" merge -q --device cpu --method ram+ --base base --model a --model b --model c -o out
