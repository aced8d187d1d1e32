#!/usr/bin/env python3
"""Writes a base checkpoint of Llama-7B's shapes for benchmarks (standard library only).

    [SHAPES=qwen2.5-7b] benches/write_7b_shapes.py OUT_DIR [LAYERS=2]

Hidden 4096, intermediate 11008, vocabulary 32000 (SHAPES=qwen2.5-7b: Qwen2.5-7B's 3584, 18944
and 152064, its 28 heads without grouping): the embeddings and the head as a 7B model has
them and LAYERS decoder layers (2: 1.33 GB of bf16), each projection's values random bf16 of
magnitude 2^-7 up to 2^-3 and either sign, the norms 1.0. With benches/lora_memory.sh (BASE=OUT_DIR,
AGENT=a full agent of it, e.g. a second adapter merged in) it times LoRA agents at 7B shapes.
"""
import json
import os
import struct
import sys

SIZES = {"llama-7b": (4096, 11008, 32000, 32), "qwen2.5-7b": (3584, 18944, 152064, 28)}
HIDDEN, INTERMEDIATE, VOCAB, HEADS = SIZES.get(os.environ.get("SHAPES", "llama-7b"), (0, 0, 0, 0))


def shapes(layers):
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        out += [(p + f"self_attn.{m}_proj.weight", [HIDDEN, HIDDEN]) for m in "qkvo"]
        out += [
            (p + "mlp.gate_proj.weight", [INTERMEDIATE, HIDDEN]),
            (p + "mlp.up_proj.weight", [INTERMEDIATE, HIDDEN]),
            (p + "mlp.down_proj.weight", [HIDDEN, INTERMEDIATE]),
            (p + "input_layernorm.weight", [HIDDEN]),
            (p + "post_attention_layernorm.weight", [HIDDEN]),
        ]
    return out + [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]


def count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[2].strip())
    out = sys.argv[1]
    if not HIDDEN:
        sys.exit(f"SHAPES must be one of {', '.join(SIZES)}, not {os.environ['SHAPES']!r}")
    try:
        layers = int(sys.argv[2]) if len(sys.argv) == 3 else 2
    except ValueError:
        sys.exit(f"LAYERS must be a whole number, not {sys.argv[2]!r}")
    os.makedirs(out, exist_ok=True)
    tensors = shapes(layers)
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = 2 * count(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    # A bf16's high byte is its sign and its exponent's top 7 bits: 0x3C/0x3D give exponents
    # 120-123 with the low byte's top bit (magnitudes 2^-7 up to 2^-3), 0xBC/0xBD the same
    # negative.
    high = bytes((0x3C, 0x3D, 0xBC, 0xBD)[b & 3] for b in range(256))
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, shape in tensors:
            left = count(shape)
            if name.endswith("norm.weight"):
                f.write(b"\x80\x3f" * left)
                continue
            while left:
                n = min(left, 1 << 24)
                values = bytearray(os.urandom(2 * n))
                values[1::2] = bytes(values[1::2]).translate(high)
                f.write(values)
                left -= n
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": HEADS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {out}: {len(tensors)} tensors, {offset} bytes of bf16")


if __name__ == "__main__":
    main()
