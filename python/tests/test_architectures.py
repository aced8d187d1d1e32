"""Every architecture in architectures.py, built with transformers from a tiny random config,
merged by the pip-installed command as a user would (base + 3 sparse agents), and loaded back
with transformers: each method family, slices and a frankenmerge, layer gradients, λ scopes,
config differences (issue #44). Needs torch and transformers (README's test command installs
them); without them the module is skipped, unless RLMERGE_REQUIRE_TRANSFORMERS=1 says they must
be there."""

import json
import os
import re
import shutil
import subprocess

import pytest

from architectures import LAYERS, configs
from conftest import pip_command

if os.environ.get("RLMERGE_REQUIRE_TRANSFORMERS") == "1":
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch", reason="the architecture suite needs torch")
    transformers = pytest.importorskip("transformers", reason="the architecture suite needs transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

ARCHS = list(configs())
# Models whose real checkpoints carry MTP layers that transformers does not build: where the
# names go (after the decoder's layers, or their own mtp.* stack).
MTP_AFTER_DECODER = {"deepseek_v3", "glm4_moe", "glm4_moe_lite"}
MTP_OWN_STACK = {"qwen3_5_text", "qwen3_5_moe_text"}
# One method of each family: the RAM family, stream (elementwise), scan (rank statistics) and
# spectral (a decomposition per matrix).
METHODS = [
    ["--method", "ram"],
    ["--method", "ram+", "--scope", "layer"],
    ["--method", "ram+", "--scope", "module"],
    ["--method", "task_arithmetic", "--param", "weight=0.5"],
    ["--method", "ties", "--param", "weight=0.5", "--param", "density=0.5"],
    ["--method", "dare_ties", "--param", "weight=0.5", "--param", "density=0.5", "--seed", "1"],
    ["--method", "della", "--param", "weight=0.5", "--param", "density=0.5", "--param", "epsilon=0.1",
     "--seed", "1"],
    ["--method", "iso_c"],
    ["--method", "tsv"],
]


def model_class(config):
    if hasattr(config, "vision_config"):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def mtp_tensors(arch, state, config):
    """The MTP layer a real checkpoint of `arch` carries, as random tensors of its shapes."""
    text = getattr(config, "text_config", config)
    h, v = text.hidden_size, text.vocab_size
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    last = LAYERS - 1
    layer = {k.split(f"model.layers.{last}.", 1)[1]: t for k, t in state.items() if k.startswith(f"model.layers.{last}.")}
    if arch in MTP_AFTER_DECODER:
        prefix = f"model.layers.{LAYERS}."
        extra = {"enorm.weight": torch.ones(h), "hnorm.weight": torch.ones(h), "eh_proj.weight": rand(h, 2 * h),
                 "shared_head.norm.weight": torch.ones(h), "shared_head.head.weight": rand(v, h),
                 "embed_tokens.weight": rand(v, h)}
    else:
        prefix = "mtp."
        layer = {f"layers.0.{k}": t for k, t in layer.items()}
        extra = {"fc.weight": rand(h, 2 * h), "norm.weight": torch.ones(h),
                 "pre_fc_norm_embedding.weight": torch.ones(h), "pre_fc_norm_hidden.weight": torch.ones(h)}
    return {prefix + k: t.clone() for k, t in {**layer, **extra}.items()}


def write_model(folder, config_dir, state):
    shutil.copytree(config_dir, folder)
    os.remove(folder / "model.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """arch -> (base, [agents]) folders, built on first use."""
    cache = {}

    def build(arch):
        if arch in cache:
            return cache[arch]
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        if arch not in CONFIG_MAPPING:
            pytest.skip(f"transformers {transformers.__version__} does not know {arch}")
        root = tmp_path_factory.mktemp(arch)
        config = transformers.AutoConfig.for_model(arch, **configs()[arch])
        torch.manual_seed(0)
        model = model_class(config).from_config(config)
        model.save_pretrained(root / "saved")
        state = load_file(str(root / "saved" / "model.safetensors"))
        if arch in MTP_AFTER_DECODER | MTP_OWN_STACK:
            state.update(mtp_tensors(arch, state, config))
        write_model(root / "base", root / "saved", state)
        agents = []
        for t in range(3):
            g = torch.Generator().manual_seed(100 + t)
            changed = {}
            for k, v in state.items():
                mask = torch.rand(v.shape, generator=g) < 0.06
                changed[k] = v + mask * torch.randn(v.shape, generator=g) * 0.01
            write_model(root / f"agent{t}", root / "saved", changed)
            agents.append(root / f"agent{t}")
        cache[arch] = (root / "base", agents)
        return cache[arch]

    return build


def rlmerge(*args, ok=True):
    p = subprocess.run([pip_command(), *map(str, args)], capture_output=True, text=True)
    if ok:
        assert p.returncode == 0, f"rlmerge {' '.join(map(str, args))} failed:\n{p.stderr}"
    return p


def load(out, arch):
    """The merged model loaded by transformers (no missing keys; unexpected ones only the MTP
    layers transformers does not build), its outputs on a few tokens finite."""
    config = transformers.AutoConfig.from_pretrained(out)
    model, info = model_class(config).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], f"{arch}: missing {info['missing_keys']}"
    mtp_prefix = f"model.layers.{getattr(getattr(config, 'text_config', config), 'num_hidden_layers')}."
    unexpected = [k for k in info["unexpected_keys"] if not (k.startswith("mtp.") or k.startswith(mtp_prefix))]
    assert not unexpected, f"{arch}: unexpected {unexpected}"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all(), f"{arch}: the merged model's logits are not finite"
    return config


def tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# A tower's tensors, as transformers saves them (`visual.…`, `vision_tower.…`, with or without
# `model.`), and the final norm or output head outside the decoder's layers.
TOWER_WORDS = ("visual.", "vision_tower.", "multi_modal_projector.")
FINAL = re.compile(r"(^|\.)(lm_head|norm|embedding_norm|final_layernorm)\.weight$")


def is_tower(name):
    return any(w in name for w in TOWER_WORDS)


def decoder_prefix(names):
    """The decoder's layer prefix in saved names (`model.layers.`, `language_model.model.layers.`)."""
    prefixes = {m.group(1) for m in map(re.compile(r"^(.*\.layers\.)\d+\.").match, names) if m}
    decoder = [p for p in prefixes if not is_tower(p) and not p.startswith("mtp.")]
    assert len(decoder) == 1, f"decoder prefixes: {prefixes}"
    return decoder[0]


def text_config(config):
    return getattr(config, "text_config", config)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_family_keeps_every_tensor_and_loads(arch, built, tmp_path):
    base, agents = built(arch)
    want = tensors(base)
    for i, method in enumerate(METHODS):
        out = tmp_path / f"m{i}"
        rlmerge("merge", "--base", base, *sum((["--model", a] for a in agents), []), *method,
                "--device", "cpu", "-q", "-o", out)
        got = tensors(out)
        assert set(got) == set(want), f"{arch} {method}: tensors differ: {set(got) ^ set(want)}"
        for k, v in want.items():
            assert got[k].shape == v.shape and got[k].dtype == v.dtype, f"{arch} {method}: {k}"
        load(out, arch)
        if method[1] == "ram":
            # RAM, independently: unchanged at the base, the mean of the agents that changed
            # an element.
            for k, b in want.items():
                taus = [tensors_of(a)[k] - b for a in agents]
                changed = [t.abs() > 1e-5 for t in taus]
                count = sum(c.float() for c in changed)
                total = sum(t * c for t, c in zip(taus, changed))
                expect = b + torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(b))
                assert torch.allclose(got[k], expect, atol=1e-6), f"{arch}: ram differs at {k}"
        if method[1:] == ["ram+", "--scope", "module"]:
            groups = {g for g, _ in json.loads((out / "rlmerge_record.json").read_text())["group_lambdas"]}
            kinds = {"embed", "attn", "mlp", "norm", "lm_head", "other"}
            stacks = {f"{stack} {kind}" for stack in ("vision", "mtp") for kind in kinds}
            assert groups <= kinds | stacks, f"{arch}: module groups {groups}"
            if arch in ("mixtral", "qwen3_moe"):
                # Routers are part of the MoE block's MLP.
                assert "other" not in groups, f"{arch}: module groups {groups}"
            if "vision_config" in configs()[arch]:
                assert "vision attn" in groups and "attn" in groups, f"{arch}: {groups}"
        elif method[1] == "ram+":
            record = json.loads((out / "rlmerge_record.json").read_text())
            groups = [g for g, _ in record["group_lambdas"]]
            layers = [int(g.split()[1]) for g in groups if g.startswith("layer ")]
            assert layers == list(range(LAYERS)), f"{arch}: layer groups {groups}"
            if arch in MTP_AFTER_DECODER | MTP_OWN_STACK:
                assert "mtp" in groups, f"{arch}: {groups}"
            if "vision_config" in configs()[arch]:
                assert "vision" in groups, f"{arch}: {groups}"
    card = (tmp_path / "m0" / "README.md").read_text()
    expected_class = "AutoModelForImageTextToText" if "vision_config" in configs()[arch] else "AutoModelForCausalLM"
    assert expected_class in card, f"{arch}: the card does not load with {expected_class}"


_loaded = {}


def tensors_of(folder):
    if folder not in _loaded:
        _loaded[folder] = tensors(folder)
    return _loaded[folder]


def recipe(tmp_path, text):
    path = tmp_path / "recipe.yml"
    path.write_text(text)
    return path


def frankenmerge(tmp_path, *slices, out, ok=True):
    """A passthrough merge of `slices`, each (model, first layer, last layer + 1), into `out`."""
    sources = "".join(f"""
  - sources:
      - model: {model}
        layer_range: [{first}, {end}]""" for model, first, end in slices)
    text = f"merge_method: passthrough\nslices:{sources}\ndtype: float32\n"
    return rlmerge("run", recipe(tmp_path, text), "-o", out, "--device", "cpu", "-q", ok=ok)


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_run_over_the_decoder_layers(arch, built, tmp_path):
    """weight: [0, 1] gives decoder layer i the weight i / (layers − 1), whatever towers or MTP
    layers the model also numbers; tensors outside the decoder's layers take t = 0."""
    base, agents = built(arch)
    out = tmp_path / "out"
    rlmerge("run", recipe(tmp_path, f"""
merge_method: task_arithmetic
base_model: {base}
models:
  - model: {agents[0]}
    parameters:
      weight: [0, 1]
dtype: float32
"""), "-o", out, "--device", "cpu", "-q")
    got, b, a = tensors(out), tensors_of(base), tensors_of(agents[0])
    prefix = decoder_prefix(b)
    checked = 0
    for k in b:
        if not k.startswith(prefix):
            continue
        checked += 1
        layer = int(k[len(prefix):].split(".")[0])
        weight = layer / (LAYERS - 1) if layer < LAYERS else 0.0
        assert torch.allclose(got[k], b[k] + weight * (a[k] - b[k]), atol=1e-6), f"{arch}: {k} is not weighted {weight}"
    assert checked > LAYERS, f"{arch}: no decoder layer under {prefix}"
    load(out, arch)


def layer_lists_consistent(config, arch):
    text = text_config(config)
    n = text.num_hidden_layers
    for key in ("layer_types", "mlp_layer_types"):
        value = getattr(text, key, None)
        if isinstance(value, list):
            assert len(value) == n, f"{arch}: {key} has {len(value)} entries for {n} layers"


@pytest.mark.parametrize("arch", ARCHS)
def test_slices_and_frankenmerges(arch, built, tmp_path):
    """A frankenmerge of agent 0's first two layers and agent 1's last three: 5 layers whose
    per-layer config lists follow them; every module outside the decoder's layers whole from one
    model; the MTP layers renumbered after the last. Then a ties merge per slice."""
    base, agents = built(arch)
    out = tmp_path / "franken"
    frankenmerge(tmp_path, (agents[0], 0, 2), (agents[1], 1, LAYERS), out=out)
    config = load(out, arch)
    assert text_config(config).num_hidden_layers == 2 + LAYERS - 1
    layer_lists_consistent(config, arch)
    got, first, last = tensors(out), tensors_of(agents[0]), tensors_of(agents[1])
    owned = {"first": 0, "last": 0}
    for k, v in got.items():
        if is_tower(k) or "embed_tokens" in k and ".layers." not in k:
            assert torch.equal(v, first[k]), f"{arch}: {k} is not the first slice's model's"
            owned["first"] += 1
        elif k.startswith("mtp.") or FINAL.search(k) and ".layers." not in k:
            assert torch.equal(v, last[k]), f"{arch}: {k} is not the last slice's model's"
            owned["last"] += 1
    assert owned["first"] and owned["last"], f"{arch}: {owned}"
    if arch in MTP_AFTER_DECODER:
        for k in (k for k in last if k.startswith(f"model.layers.{LAYERS}.")):
            moved = k.replace(f"model.layers.{LAYERS}.", f"model.layers.{2 + LAYERS - 1}.", 1)
            assert torch.equal(got[moved], last[k]), f"{arch}: MTP tensor {k} not at {moved}"
    # A merge per slice, the base in each.
    out = tmp_path / "ties"
    rlmerge("run", recipe(tmp_path, f"""
merge_method: ties
base_model: {base}
parameters:
  density: 0.5
  weight: 0.5
slices:
  - sources:
      - model: {base}
        layer_range: [0, {LAYERS}]
      - model: {agents[0]}
        layer_range: [0, {LAYERS}]
      - model: {agents[1]}
        layer_range: [0, {LAYERS}]
dtype: float32
"""), "-o", out, "--device", "cpu", "-q")
    layer_lists_consistent(load(out, arch), arch)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "qwen3_moe", "glm4_moe_lite"])
def test_dense_and_moe_order(arch, built, tmp_path):
    """A MoE layer put before the dense one: a config that can only count the first k dense
    layers refuses, naming the key; one with a per-layer list or a list of dense layers follows."""
    base, agents = built(arch)
    out = tmp_path / "out"
    p = frankenmerge(tmp_path, (agents[0], 1, 3), (agents[1], 0, 1), out=out, ok=False)
    if arch in ("deepseek_v3", "glm4_moe"):
        assert p.returncode != 0 and "first_k_dense_replace" in p.stderr, p.stderr
        assert not out.exists()
    else:
        assert p.returncode == 0, p.stderr
        config = text_config(load(out, arch))
        if arch == "glm4_moe_lite":
            assert config.mlp_layer_types == ["sparse", "sparse", "dense"]
        else:
            assert config.mlp_only_layers == [2]


def with_config(src, dst, change):
    """A copy of agent folder `src` at `dst` whose config.json (its text_config where it has one)
    `change` edits."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config.get("text_config", config))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_config_differences_are_named_and_chosen(arch, built, tmp_path):
    """An agent whose config differs from the base's in a key that changes how the weights are
    used (a longer context; for two architectures a rope_theta too) is refused, naming the key,
    until --config-from says whose config the output takes, which the output then has."""
    base, agents = built(arch)
    changes = [("max_position_embeddings", lambda c: c.update(max_position_embeddings=512))]
    if arch in ("llama", "qwen2_5_vl"):
        changes.append(("rope_parameters",
                        lambda c: c.setdefault("rope_parameters", {"rope_type": "default"}).update(rope_theta=1e6)))
    for i, (key, change) in enumerate(changes):
        long = with_config(agents[2], tmp_path / f"long{i}", change)
        models = ["--model", agents[0], "--model", long]
        p = rlmerge("merge", "--base", base, *models, "--method", "ram", "-q", "-o", tmp_path / f"no{i}", ok=False)
        # Named with its path where it is nested: 'text_config.max_position_embeddings'.
        assert p.returncode == 2 and key in p.stderr and "--config-from" in p.stderr, p.stderr
        assert not (tmp_path / f"no{i}").exists()
        out = tmp_path / f"yes{i}"
        rlmerge("merge", "--base", base, *models, "--method", "ram", "--config-from", long, "-q", "-o", out)
        merged = text_config(load(out, arch))
        if key == "max_position_embeddings":
            assert merged.max_position_embeddings == 512
        else:
            assert merged.rope_parameters["rope_theta"] == 1e6


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_expert_counts_and_routing_are_architecture(arch, built, tmp_path):
    """An agent with more experts, or another number of experts per token, is another
    architecture: refused, naming the key (whichever of the expert-count keys the saved config
    uses: transformers writes Qwen3-MoE's as num_local_experts)."""
    base, agents = built(arch)
    saved = json.loads((base / "config.json").read_text())
    experts = next(k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in saved)
    for key, value in ((experts, 8), ("num_experts_per_tok", 1)):
        other = with_config(agents[0], tmp_path / key, lambda c: c.update({key: value}))
        p = rlmerge("merge", "--base", base, "--model", other, "--method", "ram", "-q", "-o", tmp_path / f"{key}-out", ok=False)
        assert p.returncode == 2 and f"'{key}'" in p.stderr, p.stderr
    # The published checkpoint's spelling (num_experts) in an agent beside transformers' in the
    # base (num_local_experts) is the same key.
    if experts == "num_local_experts":
        def respell(c):
            c["num_experts"] = 8
            del c["num_local_experts"]
        other = with_config(agents[0], tmp_path / "respelled", respell)
        p = rlmerge("merge", "--base", base, "--model", other, "--method", "ram", "-q", "-o", tmp_path / "respelled-out", ok=False)
        assert p.returncode == 2 and "'num_local_experts'" in p.stderr, p.stderr


@pytest.mark.parametrize("arch, change", [
    # Gemma-3's published configs give no layer_types: every third layer full, by index.
    ("gemma3_text", dict(sliding_window_pattern=3)),
    # Qwen2 with its window on from layer 2 (max_window_layers).
    ("qwen2", dict(use_sliding_window=True, max_window_layers=2, sliding_window=64)),
])
def test_frankenmerges_keep_each_layers_attention(arch, change, built, tmp_path):
    """Issue #50 item 2: where a config derives each layer's attention from its index, a layer a
    slice moves keeps the attention it had — transformers' own AutoConfig(...).layer_types of the
    output, layer by layer, is that of the layer each came from — and the output still loads."""
    base, agents = built(arch)

    def derived(src, dst):
        def edit(c):
            c.pop("layer_types", None)
            c.update(change)
        return with_config(src, dst, edit)

    a0, a1 = derived(agents[0], tmp_path / "a0"), derived(agents[1], tmp_path / "a1")
    slices = [(a0, 1, 3), (a1, 0, 2), (a0, 3, LAYERS)]
    out = tmp_path / "franken"
    frankenmerge(tmp_path, *slices, out=out)
    got = text_config(load(out, arch)).layer_types
    want = []
    for model, first, end in slices:
        want += text_config(transformers.AutoConfig.from_pretrained(model)).layer_types[first:end]
    assert got == want, f"{arch}: {got} != {want}"
    assert len(set(want)) > 1, "the slices move layers of both kinds"
