#!/usr/bin/env python3
"""Writes an MXFP4 checkpoint at gpt-oss-20b's expert shapes for benchmarks: one layer's
`mlp.experts.gate_up_proj` (32 experts, 2880 → 5760) and `down_proj` (32, 2880 → 2880) as
gpt-oss stores them (`*_blocks` with random FP4 nibbles, `*_scales` random exponents 118–126),
a norm beside them, `quant_method: mxfp4` in config.json — into OUT/base-mxfp4; the same
dequantized by transformers' convert_moe_packed_tensors into OUT/base-bf16; and an agent of it
with 5 % of each tensor changed into OUT/agent. Needs torch, safetensors and transformers.

    benches/to_mxfp4.py OUT
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

E, HIDDEN, INTER = 32, 2880, 2880


def main(out: Path) -> None:
    g = torch.Generator().manual_seed(0)
    quantized, dequantized = {}, {}
    prefix = "model.layers.0.mlp.experts."
    for name, rows, cols in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 127, (E, rows, cols // 32), dtype=torch.uint8, generator=g)
        quantized[prefix + name + "_blocks"], quantized[prefix + name + "_scales"] = blocks, scales
        dequantized[prefix + name] = convert_moe_packed_tensors(blocks, scales)
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16)
    quantized["model.norm.weight"] = dequantized["model.norm.weight"] = norm
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_local_experts": E,
              "num_hidden_layers": 1, "torch_dtype": "bfloat16"}
    for name, state, quant in (("base-mxfp4", quantized, True), ("base-bf16", dequantized, False)):
        (out / name).mkdir(parents=True, exist_ok=True)
        save_file(state, out / name / "model.safetensors", metadata={"format": "pt"})
        c = dict(config, **({"quantization_config": {"quant_method": "mxfp4"}} if quant else {}))
        (out / name / "config.json").write_text(json.dumps(c))
    agent = {}
    for k, v in dequantized.items():
        changed = torch.rand(v.shape, generator=g) < 0.05
        agent[k] = torch.where(changed, v + 0.001, v)
    (out / "agent").mkdir(parents=True, exist_ok=True)
    save_file(agent, out / "agent" / "model.safetensors", metadata={"format": "pt"})
    (out / "agent" / "config.json").write_text(json.dumps(config))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
