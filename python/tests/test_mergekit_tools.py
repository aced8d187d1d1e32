"""mergekit's other tools, against mergekit 0.1.5 itself (issue #54): ``rlmerge moe`` writes the
expert tensors mergekit-moe writes byte for byte and its cheap_embed routers to f32 rounding,
for Mixtral, Qwen2-MoE and Qwen3-MoE outputs, and transformers loads every output with no
missing or unexpected key and runs it; a MoE whose experts are all the base computes what the
base computes. ``rlmerge extract-lora``'s adapter reconstructs each module's update at least as
well as mergekit-extract-lora's at the same rank, and mergekit merges it.

Needs torch, transformers and mergekit (README's test command installs them); without them the
module is skipped, unless RLMERGE_REQUIRE_MERGEKIT=1 says they must be there."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rlmerge
from conftest import REPO, cargo_binary

if os.environ.get("RLMERGE_REQUIRE_MERGEKIT") == "1":
    import mergekit  # noqa: F401
    import torch
    import transformers
else:
    pytest.importorskip("mergekit", reason="the comparison with mergekit needs mergekit")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

MODELS = REPO / "tests" / "fixtures" / "mergekit" / "models"
PROMPTS = {
    "coder": (["write code for a parser", "fix the bug in this function"], ["call the tool"]),
    "tools": (["call the tool with JSON arguments"], []),
    "memory": (["Remember the long story", "what did I say before"], []),
}


def _mergekit(tool, *args):
    """Runs mergekit's `tool` command (beside this interpreter) offline; its output on failure."""
    command = Path(sys.executable).parent / tool
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([str(command), *map(str, args)], capture_output=True, text=True, env=env)
    assert done.returncode == 0 or (Path(args[-1]).exists() and "OfflineModeIsEnabled" in done.stderr), \
        done.stderr[-3000:]
    return done


def _tensors(folder):
    out = {}
    for f in sorted(glob.glob(str(Path(folder) / "*.safetensors"))):
        out.update(load_file(f))
    return out


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.float32 else t.view(torch.int32)


def _config(base, experts, gate_mode="cheap_embed", **extra):
    config = {"base_model": str(base), "gate_mode": gate_mode, "experts": experts}
    config.update(extra)
    return config


def _expert(folder, name, **extra):
    positive, negative = PROMPTS[name]
    e = {"source_model": str(folder), "positive_prompts": positive}
    if negative:
        e["negative_prompts"] = negative
    e.update(extra)
    return e


def _both(tmp_path, config, name):
    """The MoE of `config` by mergekit-moe and by rlmerge.moe: their folders."""
    path = tmp_path / f"{name}.yml"
    path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")  # JSON is YAML
    mk, rl = tmp_path / f"{name}-mergekit", tmp_path / f"{name}-rlmerge"
    _mergekit("mergekit-moe", path, mk)
    rlmerge.moe(path, rl)
    return mk, rl


def _compare(mk, rl):
    """Same names, shapes and dtypes; every tensor byte for byte but the routers, which are equal
    to f32 rounding (their norms are summed in another order)."""
    a, b = _tensors(mk), _tensors(rl)
    assert sorted(a) == sorted(b)
    routers = 0
    for name in a:
        x, y = a[name], b[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        if name.endswith("gate.weight") or name.endswith("shared_expert_gate.weight"):
            routers += 1
            ulp = torch.finfo(x.dtype).eps
            assert torch.allclose(x.float(), y.float(), rtol=2 * ulp, atol=0), name
        else:
            assert torch.equal(_bits(x), _bits(y)), name
    return routers


def _loads_and_runs(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        logits = model(torch.tensor([[45, 3, 4, 5, 6]])).logits
    assert torch.isfinite(logits).all()
    return model


def test_mixtral_equals_mergekit_moe(tmp_path):
    experts = [_expert(MODELS / n, n) for n in ("coder", "tools", "memory")]
    experts[2]["residual_scale"] = 0.5
    mk, rl = _both(tmp_path, _config(MODELS / "base", experts, dtype="bfloat16"), "mixtral")
    assert _compare(mk, rl) == 4
    assert json.loads((rl / "config.json").read_text())["num_local_experts"] == 3
    _loads_and_runs(rl)
    found = rlmerge.verify(rl, against=True)
    assert found["ok"] and any(c.startswith("rebuilt") for c in found["checks"]), found


def test_qwen2_moe_with_a_shared_expert_equals_mergekit_moe(tmp_path):
    experts = [_expert(MODELS / n, n) for n in ("coder", "tools")]
    # mergekit-moe 0.1.5 reads a shared expert only from the base or an expert (it opens no other
    # model for it); rlmerge opens any.
    shared = [dict(_expert(MODELS / "base", "memory"), residual_scale=0.25)]
    config = _config(MODELS / "base", experts, architecture="qwen", shared_experts=shared,
                     dtype="float32", experts_per_token=1)
    mk, rl = _both(tmp_path, config, "qwen2moe")
    assert _compare(mk, rl) == 8
    _loads_and_runs(rl)


def test_the_demos_byte_level_bpe_routes_as_mergekit_routes(demo, tmp_path):
    """The demo's Qwen2 agents (q/k/v biases, a byte-level BPE tokenizer like Qwen's and
    Llama 3's) as a Qwen2-MoE: prompts with punctuation, digits, accents and an emoji encode to
    the tokens transformers encodes, so the routers agree with mergekit's."""
    root, base, agents = demo
    prompts = [["def parse(x):\n    return x  # 42"], ["call tool {\"q\": \"héllo wörld\"}"],
               ["Remember: 🍕 on 2026-12-07, ok?"]]
    experts = [{"source_model": str(a.resolve()), "positive_prompts": p} for a, p in zip(agents, prompts)]
    shared = [{"source_model": str(base.resolve()), "positive_prompts": ["Hello, world!"]}]
    config = _config(base.resolve(), experts, architecture="qwen", shared_experts=shared)
    mk, rl = _both(tmp_path, config, "demo-qwen2moe")
    assert _compare(mk, rl) == 2 * json.loads((base / "config.json").read_text())["num_hidden_layers"]
    _loads_and_runs(rl)


def _qwen3_family(root):
    """A tiny bf16 Qwen3 base and two experts (MLPs and attention changed), with the fixture's
    tokenizer."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=48, hidden_size=16, intermediate_size=40,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=4, tie_word_embeddings=False)
    base = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    folders = []
    for i, name in enumerate(("base", "coder", "tools")):
        model = base
        if i:
            model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
            model.load_state_dict(base.state_dict())
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if ".mlp." in n or "q_proj" in n:
                        p.add_(torch.randn_like(p) * 0.05)
        folder = root / f"qwen3-{name}"
        model.save_pretrained(folder)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(MODELS / "base" / f, folder / f)
        folders.append(folder)
    return folders


def test_qwen3_moe_equals_mergekit_moe(tmp_path):
    base, coder, tools = _qwen3_family(tmp_path)
    config = _config(base, [_expert(coder, "coder"), _expert(tools, "tools")])
    mk, rl = _both(tmp_path, config, "qwen3moe")
    assert _compare(mk, rl) == 2
    assert json.loads((rl / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    _loads_and_runs(rl)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_moe_of_base_copies_computes_what_the_base_computes(tmp_path, family):
    """Independent of mergekit: every expert the base, so each token's top-k experts (weights
    renormalized to 1) give the base's MLP output — the layout (gate then up rows, down) and the
    config are right, or the logits differ."""
    base = MODELS / "base" if family == "llama" else _qwen3_family(tmp_path)[0]
    experts = [{"source_model": str(base), "positive_prompts": [p]} for p in ("code", "tools", "story")]
    out = tmp_path / "copies"
    rlmerge.moe(_config(base, experts, dtype="float32"), out, allow_all_same=True)
    moe = _loads_and_runs(out)
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    ids = torch.tensor([[45, 7, 8, 9, 10, 11, 3]])
    with torch.no_grad():
        assert torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)


def test_random_routers_are_normal_and_follow_the_seed(tmp_path):
    # Models as pathlib paths, as a Python caller writes them.
    experts = [{"source_model": MODELS / n} for n in ("coder", "tools", "memory", "base")]
    config = {"base_model": MODELS / "base", "gate_mode": "random", "dtype": "float32",
              "experts": experts}
    rlmerge.moe(config, tmp_path / "a", seed=7)
    rlmerge.moe(config, tmp_path / "b", seed=7)
    rlmerge.moe(config, tmp_path / "c", seed=8)
    a, b, c = (_tensors(tmp_path / x) for x in "abc")
    gates = torch.stack([a[f"model.layers.{i}.mlp.gate.weight"] for i in range(4)])
    assert gates.shape == (4, 4, 16)
    assert abs(gates.mean().item()) < 0.2 and abs(gates.std().item() - 1) < 0.15
    assert not torch.equal(gates[0], gates[1])  # a row per layer
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.gate.weight"], c["model.layers.0.mlp.gate.weight"])
    saved = (tmp_path / "a" / "mergekit_moe_config.yml").read_text()
    assert "seed: 7" in saved


def test_the_command_and_the_library_write_the_same_bytes(tmp_path):
    experts = [_expert(MODELS / n, n) for n in ("coder", "tools")]
    path = tmp_path / "moe.yml"
    path.write_text(json.dumps(_config(MODELS / "base", experts)))
    rlmerge.moe(path, tmp_path / "lib", threads=1)
    subprocess.run([cargo_binary(), "moe", str(path), str(tmp_path / "cli"), "--threads", "2"],
                   check=True, capture_output=True)
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "lib" / f).read_bytes() == (tmp_path / "cli" / f).read_bytes(), f


def test_bad_configs_are_usage_errors_and_write_nothing(tmp_path):
    experts = [_expert(MODELS / n, n) for n in ("coder", "tools")]
    out = tmp_path / "out"
    bad = [
        _config(MODELS / "base", experts, gate_mode="hidden"),
        {k: v for k, v in _config(MODELS / "base", experts).items() if k != "gate_mode"},
        _config(MODELS / "base", experts, experts_per_token=3),
        _config(MODELS / "base", experts, routers="x"),
        _config(MODELS / "base", [{"source_model": str(MODELS / "coder")}] * 2),
        _config(MODELS / "base", experts, architecture="deepseek"),
        _config(MODELS / "base", experts, dtype="int8"),
    ]
    for config in bad:
        with pytest.raises(rlmerge.UsageError):
            rlmerge.moe(config, out)
        assert not out.exists()
    with pytest.raises(rlmerge.UsageError, match="forward pass"):
        rlmerge.moe(bad[0], out)


def test_extract_lora_reconstructs_as_well_as_mergekit_and_mergekit_merges_it(demo, tmp_path):
    root, base, agents = demo
    rank = 8
    mk, rl = tmp_path / "mk-lora", tmp_path / "rl-lora"
    _mergekit("mergekit-extract-lora", "--model", agents[0].resolve(), "--base-model",
              base.resolve(), "--max-rank", rank, "--quiet", "--out-path", mk.resolve())
    rlmerge.extract_lora(base, agents[0], rl, rank=rank)
    b, a = _tensors(base), _tensors(agents[0])
    mine, theirs = _tensors(rl), _tensors(mk)
    compared = 0
    for key in mine:
        # mergekit saves lm_head whole; rlmerge factors it (both are right).
        if not key.endswith("lora_A.weight") or key not in theirs:
            continue
        module = key[len("base_model.model."):-len(".lora_A.weight")]
        name = module + ".weight"
        truth = (a[name].double() - b[name].double()).numpy()

        def error(t):
            ba = t[key.replace("lora_A", "lora_B")].double() @ t[key].double()
            return np.linalg.norm(truth - ba.numpy()) / np.linalg.norm(truth)

        # Both are stored in bf16: rlmerge's error is mergekit's or less, to that rounding.
        assert error(mine) <= error(theirs) + 2e-3, (module, error(mine), error(theirs))
        compared += 1
    assert compared >= 10
    # mergekit applies rlmerge's adapter (BASE+ADAPTER through PEFT) in a merge of its own.
    recipe = tmp_path / "apply.yml"
    recipe.write_text(json.dumps({"merge_method": "linear", "dtype": "float32", "models": [
        {"model": f"{base.resolve()}+{rl.resolve()}", "parameters": {"weight": 1.0}}]}))
    merged = tmp_path / "mk-applied"
    _mergekit("mergekit-yaml", recipe, "--lora-merge-cache", tmp_path / "mk-cache", merged)
    got = _tensors(merged)
    for key in mine:
        if key.endswith("lora_A.weight"):
            name = key[len("base_model.model."):-len(".lora_A.weight")] + ".weight"
            ba = mine[key.replace("lora_A", "lora_B")].float() @ mine[key].float()
            assert torch.allclose(got[name], b[name].float() + ba, atol=1e-2), name


def test_a_recipe_ending_in_a_moe_from_python(demo, tmp_path):
    """rlmerge.moe of a multi-stage recipe: the merge stage kept in intermediate_dir, the MoE
    taking it as an expert; a dict config takes no intermediate_dir."""
    root, base, agents = demo
    recipe = tmp_path / "staged.yml"
    recipe.write_text(
        f"name: pair\nmerge_method: ram\nbase_model: {base.resolve()}\n"
        f"models: [{{model: {agents[1].resolve()}}}, {{model: {agents[2].resolve()}}}]\n---\n"
        f"base_model: {base.resolve()}\narchitecture: qwen\ngate_mode: random\n"
        f"shared_experts: [{{source_model: {base.resolve()}}}]\n"
        f"experts: [{{source_model: {agents[0].resolve()}}}, {{source_model: pair}}]\n")
    built = rlmerge.moe(recipe, tmp_path / "out", intermediate_dir=tmp_path / "kept")
    assert built["architecture"] == "Qwen2MoeForCausalLM"
    assert (tmp_path / "kept" / "pair" / "model.safetensors").is_file()
    _loads_and_runs(tmp_path / "out")
    with pytest.raises(rlmerge.UsageError):
        rlmerge.moe({"base_model": str(base), "experts": []}, tmp_path / "x", intermediate_dir=tmp_path / "k")
