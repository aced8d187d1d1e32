"""Full PEFT adapters: `modules_to_save` (a trained head saved whole) and `lora_bias` (lora_B's
bias), as PEFT 0.21 saves them. `rlmerge convert BASE+ADAPTER` equals PEFT's
`merge_and_unload()` computed in f32 (the whole module and the biases exactly; s·B·A within one
bf16 step, its sum order being PEFT's matmul's), and a merge takes such an adapter as an agent;
adapters that do not match their config or their base are named, nothing written."""

import json
import shutil

import pytest

from test_trainer_formats import merges_alike, run, weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402


def config():
    return transformers.AutoConfig.for_model(
        "qwen2", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config()).to(torch.bfloat16)
    base.save_pretrained(root / "base")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           modules_to_save=["lm_head"], lora_bias=True)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(root / "base"),
                                lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.05)  # trained: lora_B and its bias leave zero
    model.save_pretrained(root / "adapter")
    other = transformers.AutoModelForCausalLM.from_pretrained(root / "base")
    with torch.no_grad():
        for p in other.parameters():
            p.add_((torch.rand_like(p.float()) < 0.2) * 0.01)
    other.save_pretrained(root / "other")
    return root


def merged_by_peft(root) -> dict:
    """PEFT's merge_and_unload() of the adapter over the base held in f32, then stored as the
    base's bf16."""
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, root / "adapter").merge_and_unload()
    return {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}


def test_base_plus_a_full_adapter_converts_as_peft_merges_it(models, tmp_path):
    out = tmp_path / "out"
    run("convert", f"{models / 'base'}+{models / 'adapter'}", "-q", "-o", out)
    got, want = load_file(out / "model.safetensors"), merged_by_peft(models)
    base = load_file(models / "base" / "model.safetensors")
    assert set(got) == set(want)
    assert not torch.equal(got["lm_head.weight"], base["lm_head.weight"])
    saved = load_file(models / "adapter" / "adapter_model.safetensors")
    assert torch.equal(got["lm_head.weight"], saved["base_model.model.lm_head.weight"].to(torch.bfloat16))
    for k, v in want.items():
        if k.endswith(".bias") and ("q_proj" in k or "v_proj" in k):
            assert not torch.equal(got[k], base[k]), k
            assert torch.equal(got[k], v), k  # b + s·lora_B.bias: one f32 sum, rounded once
        elif k.endswith(".weight") and any(m in k for m in ("q_proj", "v_proj")):
            step = (got[k].float() - v.float()).abs() <= v.float().abs() * 2 ** -7 + 1e-30
            assert bool(step.all()), k
        else:
            assert torch.equal(got[k], v), k
    run("verify", out, "--against")


def test_a_full_adapter_merges_as_an_agent(models, tmp_path):
    converted, merged, via = tmp_path / "converted", tmp_path / "merged", tmp_path / "via"
    run("convert", f"{models / 'base'}+{models / 'adapter'}", "-q", "-o", converted)
    run("merge", "--base", models / "base", "--model", models / "adapter", "--method",
        "passthrough", "-q", "-o", via)
    assert weights(via) == weights(converted)
    run("merge", "--base", models / "base", "--model", models / "adapter", "--model",
        models / "other", "--method", "ram", "-q", "--allow-dense-agents", "-o", merged)
    # RAM keeps each agent's unique changes: where the other agent left the head as the base's,
    # the merged head is the adapter's saved one.
    got = load_file(merged / "model.safetensors")["lm_head.weight"]
    head = load_file(converted / "model.safetensors")["lm_head.weight"]
    untouched = load_file(models / "other" / "model.safetensors")["lm_head.weight"] == \
        load_file(models / "base" / "model.safetensors")["lm_head.weight"]
    assert untouched.sum() > 100 and torch.equal(got[untouched], head[untouched])


@pytest.mark.parametrize("damage, words", [
    ("bias without lora_bias", ["lora_B biases", "does not set lora_bias"]),
    ("whole module of another shape", ["saves 'lm_head.weight' as [100, 32]", "[101, 32]"]),
    ("whole module the base lacks", ["saves 'extra.weight' whole", "does not have"]),
    ("bias of a layer without one", ["o_proj.bias", "does not have"]),
])
def test_adapters_that_do_not_fit_are_named_and_nothing_is_written(models, tmp_path, damage, words):
    adapter = tmp_path / "adapter"
    shutil.copytree(models / "adapter", adapter)
    state = load_file(adapter / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    prefix = "base_model.model.model.layers.0.self_attn."
    if damage == "bias without lora_bias":
        config["lora_bias"] = False
    elif damage == "whole module of another shape":
        state["base_model.model.lm_head.weight"] = state["base_model.model.lm_head.weight"][:100]
    elif damage == "whole module the base lacks":
        state["base_model.model.extra.weight"] = torch.zeros(2, 2)
    else:
        state[prefix + "o_proj.lora_A.weight"] = torch.zeros(4, 32)
        state[prefix + "o_proj.lora_B.weight"] = torch.zeros(32, 4)
        state[prefix + "o_proj.lora_B.bias"] = torch.zeros(32)
    save_file(state, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    p = run("convert", f"{models / 'base'}+{adapter}", "-q", "-o", out, code=1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()


def test_a_one_file_save_with_the_base_layers_reads_as_the_adapter(models, tmp_path):
    """A trainer's one-file LoRA save: the pairs beside each adapted layer's own weight
    (`base_layer.weight`) and the other modules whole — the same agent as the adapter alone."""
    adapter = tmp_path / "one-file"
    shutil.copytree(models / "adapter", adapter)
    state = load_file(adapter / "adapter_model.safetensors")
    base = load_file(models / "base" / "model.safetensors")
    for k, v in base.items():
        adapted = k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        if "q_proj." in k or "v_proj." in k:
            state["base_model.model." + adapted] = v
        elif k != "lm_head.weight":
            state["base_model.model." + k] = v
    save_file(state, adapter / "adapter_model.safetensors")
    want, got = tmp_path / "want", tmp_path / "got"
    run("convert", f"{models / 'base'}+{models / 'adapter'}", "-q", "-o", want)
    run("convert", f"{models / 'base'}+{adapter}", "-q", "-o", got)
    assert weights(got) == weights(want)


def test_every_method_merges_the_adapter_as_its_f32_conversion(models, tmp_path):
    """A LoRA agent is θ₀ + s·B·A in f32 (SPEC §5): every method merges the full adapter to the
    same bytes as the folder `convert --out-dtype f32` writes of it, read as stored."""
    folder = tmp_path / "f32"
    run("convert", f"{models / 'base'}+{models / 'adapter'}", "--out-dtype", "f32", "-q",
        "-o", folder)
    merges_alike(tmp_path, (models / "base", [folder, models / "other"]),
                 (models / "base", [models / "adapter", models / "other"]),
                 extra=["--allow-dense-agents", "--raw-f32-agents"])
