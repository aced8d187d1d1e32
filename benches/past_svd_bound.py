#!/usr/bin/env python3
"""Rewrites a bf16 base + agents set (the demo's) into matrices too large for the SVD methods, for
benchmarks of their elementwise part (standard library only).

    benches/past_svd_bound.py SRC_DIR DST_DIR MODEL [MODEL ...]

Each model folder SRC_DIR/MODEL (one model.safetensors, or shards and their index) is written to
DST_DIR/MODEL as one model.safetensors holding the same bytes — every tensor's data in the base's
order (the first MODEL is the base) — declared as 6144 x 6144 matrices (37.7 M elements, past the
2^25 elements iso_c, tsv and svc decompose, so each takes their elementwise rule) and one vector
for the rest. The values are the source's, so finite wherever the source's are.
"""
import json
import os
import shutil
import struct
import sys

SIDE = 6144
EXTRAS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def tensor_places(folder):
    """name -> (file, absolute start, end, dtype)."""
    if not os.path.isdir(folder):
        sys.exit(f"{folder}: not a model folder")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    places = {}
    for name in files:
        path = os.path.join(folder, name)
        entries, data = header(path)
        for tensor, e in entries.items():
            if tensor != "__metadata__":
                a, b = e["data_offsets"]
                places[tensor] = (path, data + a, data + b, e["dtype"])
    return places


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    src, dst, models = sys.argv[1], sys.argv[2], sys.argv[3:]
    base = tensor_places(os.path.join(src, models[0]))
    order = sorted(base, key=lambda t: (base[t][0], base[t][1]))
    if any(base[t][3] != "BF16" for t in order):
        sys.exit("every tensor of the base must be BF16")
    total = sum(base[t][2] - base[t][1] for t in order)
    per = SIDE * SIDE * 2
    tensors, offset, i = {}, 0, 0
    while offset + per <= total:
        name = f"model.layers.{i}.mlp.up_proj.weight"
        tensors[name] = {"dtype": "BF16", "shape": [SIDE, SIDE], "data_offsets": [offset, offset + per]}
        offset, i = offset + per, i + 1
    rest = (total - offset) // 2
    tensors["model.norm.weight"] = {"dtype": "BF16", "shape": [rest], "data_offsets": [offset, total]}
    tensors["__metadata__"] = {"format": "pt"}
    head = json.dumps(tensors).encode()
    head += b" " * (-len(head) % 8)
    for model in models:
        places = tensor_places(os.path.join(src, model))
        out_dir = os.path.join(dst, model)
        os.makedirs(out_dir, exist_ok=True)
        for extra in EXTRAS:
            if os.path.exists(os.path.join(src, model, extra)):
                shutil.copy(os.path.join(src, model, extra), os.path.join(out_dir, extra))
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as out:
            out.write(struct.pack("<Q", len(head)))
            out.write(head)
            for t in order:
                if t not in places:
                    sys.exit(f"{model}: has no tensor {t}")
                path, a, b, dtype = places[t]
                if dtype != "BF16" or b - a != base[t][2] - base[t][1]:
                    sys.exit(f"{model}: tensor {t} is not the base's size in BF16")
                with open(path, "rb") as f:
                    f.seek(a)
                    out.write(f.read(b - a))
        print(f"{out_dir}: {i} matrices of {SIDE} x {SIDE} and {rest} elements")


if __name__ == "__main__":
    main()
