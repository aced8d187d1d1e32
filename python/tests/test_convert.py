"""`rlmerge convert`: a checkpoint as a trainer wrote it, to a Hugging Face safetensors folder —
value for value what the official converters give: verl's converter (its rule, restated in
test_verl.py), `torch.load` for `.bin`, and for BASE+ADAPTER the adapter applied as PEFT's
`merge_and_unload()` computes it in f32. The folder carries the source's config, a record that
`verify --against` remakes it from, and a saved recipe that `run` remakes it from; a broken source
is named with nothing written."""

import json
import shutil

import pytest

from test_trainer_formats import MODELS, run, to_bin, weights
from test_verl import converted, verl, verls_rule  # noqa: F401 (verl: the fixture)

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402


def tensors(out):
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def test_a_verl_actor_converts_as_verls_converter_writes_it(verl, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    p = run("convert", verl / "actor", "-o", out)
    assert p.stdout.startswith("converted "), p.stdout
    assert "verl FSDP shards" in p.stderr and p.stderr.count("verl FSDP shards") == 1, p.stderr
    want = converted(verl / "actor", tmp_path / "verl-converted")
    got, want = weights(out), weights(want)
    assert got.pop("config.json") != want.pop("config.json")  # the dtype: bf16 written
    assert got == want
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((verl / "actor" / "huggingface" / "config.json").read_text()) | {
        k: "bfloat16" for k in ("torch_dtype", "dtype") if k in config}
    card = (out / "README.md").read_text()
    assert "# Converted with rlmerge" in card and "verl FSDP shards" in card
    assert "- converted" in card and "- merge\n" not in card
    run("verify", out, "--against")
    again = tmp_path / "again"
    run("run", out / "mergekit_config.yml", "-q", "-o", again)
    assert weights(again) == weights(out)


def test_raw_f32_keeps_verls_masters(verl, tmp_path):  # noqa: F811
    out = tmp_path / "raw"
    run("convert", verl / "actor", "--raw-f32", "-q", "-o", out)
    got = tensors(out)
    for k, v in verls_rule(verl / "actor", bf16=False).items():
        if k != "lm_head.weight":
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k


@pytest.mark.parametrize("shards", [1, 3])
def test_a_bin_folder_converts_to_what_torch_load_gives(demo, tmp_path, shards):
    root, base, agents = demo
    source = to_bin(agents[1], tmp_path / "bin", shards)
    out = tmp_path / "out"
    run("convert", source, "--shard-size", "100KB", "-q", "-o", out)
    want = {}
    for f in sorted(source.glob("*.bin")):
        want.update(torch.load(f, weights_only=True))
    got = tensors(out)
    assert set(got) == set(want) and len(list(out.glob("*.safetensors"))) > 1
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert (out / "model.safetensors.index.json").exists()
    for f in ("config.json", "tokenizer.json"):
        if (source / f).exists():
            assert (out / f).exists(), f


def peft_merged(base, adapter) -> dict:
    """PEFT's merge_and_unload() restated, in f32: W + (α/r)·B·A per target, with the rank and
    α patterns (PEFT's rule: the first pattern that matches the module's name), rounded once."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    state = load_file(base / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")

    def pattern(patterns, module, default):
        for key, value in patterns.items():
            if module.endswith(key):
                return value
        return default

    for a_name, a in lora.items():
        if ".lora_A." not in a_name:
            continue
        module = a_name.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = lora[a_name.replace(".lora_A.", ".lora_B.")]
        r = pattern(config.get("rank_pattern") or {}, module, config["r"])
        alpha = pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        w = state[module + ".weight"]
        state[module + ".weight"] = (w.float() + (alpha / r) * (b.float() @ a.float())).to(w.dtype)
    return state


def test_base_plus_adapter_converts_to_the_adapter_applied(tmp_path):
    base, adapter = MODELS / "base", MODELS / "coder-lora"
    out = tmp_path / "out"
    run("convert", f"{base}+{adapter}", "-q", "-o", out)
    got, want = tensors(out), peft_merged(base, adapter)
    assert set(got) == set(want)
    changed = 0
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        # One f32 sum of r products each: the order of the sum may move a value by one step of
        # the stored dtype, never more.
        step = (got[k].float() - v.float()).abs() <= v.float().abs() * 2 ** -7 + 1e-30
        assert bool(step.all()), k
        changed += int((got[k] != load_file(base / "model.safetensors")[k]).sum())
    assert changed > 0
    assert "the adapter applied to its base" in (out / "README.md").read_text()
    run("verify", out, "--against")


@pytest.mark.parametrize("damage, words", [
    ("missing rank", ["model_world_size_2_rank_1.pt is missing"]),
    ("nan in a rank", ["model_world_size_2_rank_1.pt", "non-finite value (NaN)"]),
    ("no source", ["cannot open the model", "no-such-folder does not exist"]),
])
def test_a_broken_source_is_named_and_nothing_is_written(verl, tmp_path, damage, words):  # noqa: F811
    actor = tmp_path / "actor"
    shutil.copytree(verl / "actor", actor)
    rank1 = actor / "model_world_size_2_rank_1.pt"
    if damage == "missing rank":
        rank1.unlink()
    elif damage == "nan in a rank":
        state = torch.load(rank1, weights_only=False)
        state["model.layers.0.mlp.up_proj.weight"]._local_tensor.view(-1)[3] = float("nan")
        torch.save(state, rank1)
    elif damage == "no source":
        actor = tmp_path / "no-such-folder"
    out = tmp_path / "out"
    p = run("convert", actor, "-q", "-o", out, code=2 if damage == "no source" else 1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()
    if damage == "nan in a rank":
        run("convert", actor, "--allow-nonfinite", "-q", "-o", out)
        assert torch.isnan(tensors(out)["model.layers.0.mlp.up_proj.weight"]).any()


def test_the_python_api_converts_as_the_command_does(verl, tmp_path):  # noqa: F811
    import rlmerge
    command, api = tmp_path / "command", tmp_path / "api"
    run("convert", verl / "actor", "-q", "-o", command)
    summary = rlmerge.convert(verl / "actor", api)
    assert weights(api) == weights(command)
    assert summary["out"] == str(api) and summary["shards"]
    with pytest.raises(rlmerge.UsageError, match="out_dtype"):
        rlmerge.convert(verl / "actor", tmp_path / "bad", out_dtype="int4")
    assert not (tmp_path / "bad").exists()
