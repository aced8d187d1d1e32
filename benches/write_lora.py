#!/usr/bin/env python3
"""Writes a PEFT LoRA adapter for a base model folder, for benchmarks (standard library only).

    benches/write_lora.py BASE_DIR OUT_DIR [RANK=16] [SEED=0] [dora]

Every 2-D `*_proj.weight` of the base (attention and MLP projections) gets an A [r, in] and a
B [out, r] in bf16 with small random values (a trained adapter's B is not zero), lora_alpha = 2·r;
with `dora`, a DoRA adapter (`use_dora`): also a magnitude vector [out] in bf16 for each.
"""
import json
import os
import random
import struct
import sys


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def base_tensors(base):
    files = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    if not files:
        sys.exit(f"{base}: no .safetensors file")
    shapes = {}
    for f in files:
        for name, entry in header(os.path.join(base, f)).items():
            if name != "__metadata__":
                shapes[name] = entry["shape"]
    return shapes


def bf16_bytes(count, scale, rng):
    # The high half of each f32: bf16 by truncation, enough for benchmark values.
    values = struct.pack(f"<{count}f", *(rng.gauss(0.0, scale) for _ in range(count)))
    return b"".join(values[i + 2 : i + 4] for i in range(0, len(values), 4))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    base, out = sys.argv[1], sys.argv[2]
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    dora = len(sys.argv) > 5 and sys.argv[5] == "dora"
    targets = {
        name[: -len(".weight")]: shape
        for name, shape in base_tensors(base).items()
        if name.endswith("_proj.weight") and len(shape) == 2
    }
    if not targets:
        sys.exit(f"{base}: no *_proj.weight matrices to adapt")
    entries, blobs, offset = {}, [], 0
    for module in sorted(targets):
        rows, cols = targets[module]
        for kind, shape, scale in (("A", [rank, cols], 0.02), ("B", [rows, rank], 0.002)):
            data = bf16_bytes(shape[0] * shape[1], scale, rng)
            name = f"base_model.model.{module}.lora_{kind}.weight"
            entries[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
        if dora:
            # Positive magnitudes about 1: the high half of 1 + N(0, 0.05²) in f32.
            values = struct.pack(f"<{rows}f", *(1.0 + abs(rng.gauss(0.0, 0.05)) for _ in range(rows)))
            data = b"".join(values[i + 2 : i + 4] for i in range(0, len(values), 4))
            name = f"base_model.model.{module}.lora_magnitude_vector"
            entries[name] = {"dtype": "BF16", "shape": [rows], "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    modules = sorted({m.rsplit(".", 1)[-1] for m in targets})
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "use_dora": dora,
        "base_model_name_or_path": os.path.abspath(base),
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{out}: rank {rank} on {len(targets)} matrices ({offset} bytes)")


if __name__ == "__main__":
    main()
