#!/usr/bin/env python3
"""Saves a bf16 safetensors model folder as DeepSeek-V3 ships its base: every projection
(`*_proj.weight`) as float8_e4m3fn with a float32 `weight_scale_inv` per 128 × 128 block (scale =
the block's largest magnitude / 448), `quantization_config` with `quant_method: fp8` in
config.json; other tensors as they are. Writes DST/base-fp8 and DST/base-dequantized (the same
matrices dequantized as DeepSeek's weight_dequant writes them), to time a merge over each. Needs
torch and safetensors.

    benches/to_fp8.py SRC DST
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = 128


def quantize(w):
    rows, cols = w.shape
    r, c = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(r * BLOCK, c * BLOCK)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(r, BLOCK, c, BLOCK)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scales[:, None, :, None]).view(r * BLOCK, c * BLOCK)[:rows, :cols]
    return q.view(r * BLOCK, c * BLOCK)[:rows, :cols].contiguous(), scales, deq.to(torch.bfloat16)


def main(src: Path, dst: Path) -> None:
    fp8, deq = dst / "base-fp8", dst / "base-dequantized"
    for d in (fp8, deq):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, d / f.name)
    for shard in sorted(src.glob("*.safetensors")):
        state, quantized, dequantized = load_file(shard), {}, {}
        for k, v in state.items():
            if k.endswith("_proj.weight"):
                q, s, d = quantize(v)
                quantized[k], quantized[k + "_scale_inv"], dequantized[k] = q, s, d
            else:
                quantized[k] = dequantized[k] = v
        save_file(quantized, fp8 / shard.name, metadata={"format": "pt"})
        save_file(dequantized, deq / shard.name, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    (fp8 / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
