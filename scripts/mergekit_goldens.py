#!/usr/bin/env python3
"""Developer-side: (re)make the mergekit golden outputs that tests/mergekit_goldens.rs checks
rlmerge against, so CI compares with mergekit 0.1.5 without installing torch.

    python3 -m venv /tmp/mkvenv && /tmp/mkvenv/bin/pip install mergekit==0.1.5
    /tmp/mkvenv/bin/python scripts/mergekit_goldens.py [RECIPE_NAME ...]

Writes, under tests/fixtures/mergekit/:
  models/{base,coder,tools,memory}/  small Llama-shaped bf16 models (Llama: mergekit 0.1.5
                                     cannot slice Qwen2 configs, whose layer_types it leaves stale) (made once, deterministic:
                                     kept when present, so goldens stay comparable)
  expected/NAME.safetensors          mergekit's output for recipes/NAME.yml (every recipe there
                                     says `dtype: float32`), all tensors in one file
  expected/NAME.config.json          mergekit's config.json for it (layer counts of slices)
  expected/moe_NAME.safetensors      mergekit-moe's output for moe/NAME.yml (tests/moe.rs)
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "mergekit"))
MODELS = os.path.join(ROOT, "models")
VOCAB, HIDDEN, INTER, LAYERS = 48, 16, 40, 4


def shapes():
    t = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for l in range(LAYERS):
        p = f"model.layers.{l}"
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            t.append((f"{p}.self_attn.{proj}.weight", [HIDDEN, HIDDEN]))
        t.append((f"{p}.mlp.gate_proj.weight", [INTER, HIDDEN]))
        t.append((f"{p}.mlp.up_proj.weight", [INTER, HIDDEN]))
        t.append((f"{p}.mlp.down_proj.weight", [HIDDEN, INTER]))
        t.append((f"{p}.input_layernorm.weight", [HIDDEN]))
        t.append((f"{p}.post_attention_layernorm.weight", [HIDDEN]))
    t.append(("model.norm.weight", [HIDDEN]))
    t.append(("lm_head.weight", [VOCAB, HIDDEN]))
    return t


def config():
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def make_models():
    """base: norms near 1, weights ~ N(0, 0.02); agents change a share of the elements (an RL
    agent few, a dense one all) by ~ N(0, 0.01), some of them the same elements."""
    g = torch.Generator().manual_seed(20261203)
    base = {}
    for name, shape in shapes():
        if "norm" in name:
            base[name] = 1.0 + 0.05 * torch.randn(shape, generator=g)
        else:
            base[name] = 0.02 * torch.randn(shape, generator=g)
    agents = {"coder": 0.1, "tools": 0.3, "memory": 1.0}
    for name, density in [("base", None)] + list(agents.items()):
        d = os.path.join(MODELS, name)
        os.makedirs(d, exist_ok=True)
        tensors = {}
        for t, b in base.items():
            if density is None:
                x = b
            else:
                mask = torch.rand(b.shape, generator=g) < density
                x = b + mask * 0.01 * torch.randn(b.shape, generator=g)
            tensors[t] = x.to(torch.bfloat16).contiguous()
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config(), f, indent=2)


def make_adapters():
    """PEFT LoRA adapters on the base (f32, B drawn at random so the update is not zero): one with
    rank_pattern and alpha_pattern, one rsLoRA that also adapts the embeddings."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    adapters = [
        ("coder-lora", 1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                               rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 2})),
        ("tools-lora", 2, dict(r=4, lora_alpha=4, use_rslora=True,
                               target_modules=["o_proj", "up_proj", "embed_tokens"])),
    ]
    for name, seed, cfg in adapters:
        model = LlamaForCausalLM.from_pretrained(os.path.join(MODELS, "base"), dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(**cfg))
        g = torch.Generator().manual_seed(seed)
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.data = 0.05 * torch.randn(p.shape, generator=g)
        peft_model.save_pretrained(os.path.join(MODELS, name))


# Tokenizers: the base's 45 letters (a BPE vocabulary) and 3 special tokens fill its 48 rows.
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("S") + 1)]
SPECIALS = ["<s>", "</s>", "<|im_start|>"]
# Agents whose tokenizers grew, their embeddings resized: (folder, weights of, regular tokens
# added to the BPE vocabulary, special tokens added).
GROWN = [
    ("tools-tok", "tools", [], ["<tool_call>", "</tool_call>"]),
    ("coder-tok", "coder", ["ab"], ["<think>", "<tool_call>"]),
]


def save_tokenizer(d, regular, specials):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(LETTERS + regular)}
    merges = [tuple(t) for t in regular]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(d)


def make_tokenizer_models():
    """The base and memory get the base's tokenizer; tools-tok and coder-tok are tools and coder
    with tokens added and their embedding and lm_head rows grown (new rows ~ N(0, 0.02))."""
    for name in ["base", "memory"]:
        save_tokenizer(os.path.join(MODELS, name), [], SPECIALS)
    g = torch.Generator().manual_seed(7)
    for name, weights_of, regular, specials in GROWN:
        d = os.path.join(MODELS, name)
        os.makedirs(d, exist_ok=True)
        tensors = load_file(os.path.join(MODELS, weights_of, "model.safetensors"))
        rows = VOCAB + len(regular) + len(specials)
        for t in ["model.embed_tokens.weight", "lm_head.weight"]:
            extra = 0.02 * torch.randn([rows - VOCAB, HIDDEN], generator=g)
            tensors[t] = torch.cat([tensors[t].float(), extra]).to(torch.bfloat16).contiguous()
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(config(), vocab_size=rows), f, indent=2)
        # The regular tokens after the letters, then the base's specials and the new ones.
        save_tokenizer(d, regular, SPECIALS + specials)


def moe_goldens():
    """mergekit-moe's output for each config in moe/, as expected/moe_NAME.*."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for file in sorted(os.listdir(os.path.join(ROOT, "moe"))):
        name = file[:-4]
        text = open(os.path.join(ROOT, "moe", file)).read()
        for m in sorted(os.listdir(MODELS), key=len, reverse=True):
            text = re.sub(rf"((?:base_model|source_model): ){m}(?![\w-])", rf"\g<1>{MODELS}/{m}", text)
        out = tempfile.mkdtemp(prefix="golden-moe-")
        shutil.rmtree(out)
        config = out + ".yml"
        with open(config, "w") as f:
            f.write(text)
        command = [os.path.join(os.path.dirname(sys.executable), "mergekit-moe"), config, out]
        subprocess.run(command, check=True, cwd=MODELS, env=env)
        tensors = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(out, f)))
        save_file(tensors, os.path.join(ROOT, "expected", f"moe_{name}.safetensors"))
        shutil.copy(os.path.join(out, "config.json"), os.path.join(ROOT, "expected", f"moe_{name}.config.json"))
        shutil.rmtree(out)
        os.remove(config)
        print(f"moe_{name}: {len(tensors)} tensors")


def main():
    if not os.path.isdir(os.path.join(MODELS, "base")):
        make_models()
    if not os.path.isdir(os.path.join(MODELS, "coder-lora")):
        make_adapters()
    if not os.path.isdir(os.path.join(MODELS, "tools-tok")):
        make_tokenizer_models()
    recipes = sorted(n[:-4] for n in os.listdir(os.path.join(ROOT, "recipes")) if n.endswith(".yml"))
    wanted = sys.argv[1:] or recipes + ["moe"]
    if "moe" in wanted:
        wanted.remove("moe")
        moe_goldens()
    os.makedirs(os.path.join(ROOT, "expected"), exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for name in wanted:
        out = tempfile.mkdtemp(prefix="golden-")
        shutil.rmtree(out)
        # Absolute model folders: mergekit looks a bare name such as `tools` up on the Hub.
        text = open(os.path.join(ROOT, "recipes", name + ".yml")).read()
        # (`source: base` / `tokenizer_source: base` are keywords, not the folder.)
        for m in sorted(os.listdir(MODELS), key=len, reverse=True):
            keys = "model|base_model|source_model" + ("" if m == "base" else "|source|tokenizer_source")
            text = re.sub(rf"((?:{keys}): |\+){m}(?![\w-])", rf"\g<1>{MODELS}/{m}", text)
        recipe = out + ".yml"
        with open(recipe, "w") as f:
            f.write(text)
        # LoRA agents (BASE+ADAPTER) applied in f32 by PEFT, as rlmerge applies them.
        command = [os.path.join(os.path.dirname(sys.executable), "mergekit-yaml"), recipe, out, "--quiet",
                   "--lora-merge-dtype", "float32", "--lora-merge-cache", out + "-lora"]
        subprocess.run(command, check=True, cwd=MODELS, env=env)
        tensors = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(out, f)))
        save_file(tensors, os.path.join(ROOT, "expected", name + ".safetensors"))
        shutil.copy(os.path.join(out, "config.json"), os.path.join(ROOT, "expected", name + ".config.json"))
        # The vocabulary, where the recipe sets a tokenizer (token ids of a union vary by run).
        if os.path.exists(os.path.join(out, "tokenizer.json")) and "tokenizer" in text:
            shutil.copy(os.path.join(out, "tokenizer.json"), os.path.join(ROOT, "expected", name + ".tokenizer.json"))
        shutil.rmtree(out)
        shutil.rmtree(out + "-lora", ignore_errors=True)
        os.remove(recipe)
        print(f"{name}: {len(tensors)} tensors, {sum(t.numel() for t in tensors.values())} elements")


if __name__ == "__main__":
    main()
