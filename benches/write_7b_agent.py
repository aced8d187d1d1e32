#!/usr/bin/env python3
"""Writes an RL-like agent of a base that benches/write_7b_shapes.py wrote (needs numpy).

    benches/write_7b_agent.py BASE_DIR OUT_DIR DENSITY SEED

Every matrix of the base with DENSITY of its elements moved by 1-4 bf16 steps (either way),
the norms as they are: the sparse, small updates RL leaves (as benches/spectral_vs_torch.py's
agents), at the base's 7B shapes. config.json is the base's.
"""
import json
import os
import shutil
import struct
import sys

import numpy as np

CHUNK = 1 << 24


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    base, out, density, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    if not 0.0 <= density <= 1.0:
        sys.exit(f"DENSITY must be in [0, 1], not {density}")
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(base, "config.json"), os.path.join(out, "config.json"))
    src = os.path.join(base, "model.safetensors")
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start = 8 + n
    rng = np.random.default_rng(seed)
    data = np.memmap(src, dtype=np.uint16, mode="r", offset=start)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        with open(src, "rb") as head:
            f.write(head.read(start))
        for name, info in sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        ):
            lo, hi = (o // 2 for o in info["data_offsets"])
            for at in range(lo, hi, CHUNK):
                bits = np.array(data[at:min(hi, at + CHUNK)])
                if not name.endswith("norm.weight"):
                    moved = rng.random(bits.size) < density
                    steps = rng.integers(1, 5, bits.size, dtype=np.int32)
                    signs = np.where(rng.random(bits.size) < 0.5, -1, 1)
                    bits = np.where(moved, (bits.astype(np.int32) + steps * signs), bits)
                    bits = bits.astype(np.uint16)
                f.write(bits.tobytes())
    print(f"wrote {out}: density {density}, seed {seed}")


if __name__ == "__main__":
    main()
