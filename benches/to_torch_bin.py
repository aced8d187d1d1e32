#!/usr/bin/env python3
"""Saves a safetensors model folder as transformers saves one without safetensors: each shard's
state dict through torch.save, as `pytorch_model.bin` or `pytorch_model-0000i-of-0000N.bin` with
`pytorch_model.bin.index.json`; config, tokenizer and other files copied. Needs torch and
safetensors (benches/end_to_end.sh with BENCH_SET=bin runs it with $BENCH_PYTHON).

    benches/to_torch_bin.py SRC DST
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def main(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    weight_map = {}
    for i, shard in enumerate(shards):
        name = "pytorch_model.bin" if len(shards) == 1 else \
            f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        state = load_file(shard)
        torch.save(state, dst / name)
        weight_map.update({k: name for k in state})
        del state
    if len(shards) > 1:
        (dst / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, dst / f.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
