"""MXFP4 bases, as gpt-oss ships its experts: `*_blocks` (32 FP4 E2M1 values a block, two a
byte) and `*_scales` (an E8M0 exponent a block), `quant_method: mxfp4` in the config. rlmerge
reads each pair as the bf16 tensor transformers' `convert_moe_packed_tensors` makes — same name,
transposed layout, same values — so bf16 agents trained from the dequantized model merge against
it as against the dequantized folder, for every method; broken pairs are named, nothing written."""

import json
import shutil

import pytest

from test_trainer_formats import merges_alike, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
from safetensors.torch import load_file, save_file  # noqa: E402

LUT = torch.tensor(mxfp4.FP4_VALUES)


def config():
    return transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=101, head_dim=16)


def quantize(w):
    """A transformers-layout expert tensor [E, K, N] as gpt-oss stores it: rows (e, n) of K
    values, in blocks of 32 with a power-of-two scale each, each value its nearest FP4."""
    rows = w.float().transpose(1, 2).contiguous()  # [E, N, K]
    e, n, k = rows.shape
    blocks = rows.view(e, n, k // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exp)[..., None]
    nibbles = (scaled[..., None] - LUT).abs().argmin(-1).to(torch.uint8)
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).to(torch.bfloat16)
    quantized, dequantized = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize(v)
            quantized[k + "_blocks"], quantized[k + "_scales"] = blocks, scales
            dequantized[k] = mxfp4.convert_moe_packed_tensors(blocks, scales)
        else:
            quantized[k] = dequantized[k] = v
    for name, state, quant in (("base-mxfp4", quantized, True), ("base-bf16", dequantized, False)):
        folder = root / name
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        cfg = config().to_dict()
        if quant:
            cfg["quantization_config"] = {"quant_method": "mxfp4",
                                          "modules_to_not_convert": ["model.layers.*.self_attn"]}
        (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(1)
    for a in ("coder", "tools"):
        agent = {k: (v.float() + (torch.rand(v.shape, generator=g) < 0.2) * 0.01).to(v.dtype)
                 for k, v in dequantized.items()}
        (root / a).mkdir()
        save_file(agent, root / a / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(root / "base-bf16" / "config.json", root / a / "config.json")
    return root


def test_an_mxfp4_base_converts_as_transformers_dequantizes_it(mx, tmp_path):
    out = tmp_path / "out"
    p = run("convert", mx / "base-mxfp4", "-o", out)
    assert "MXFP4 safetensors" in p.stderr, p.stderr
    got, want = load_file(out / "model.safetensors"), load_file(mx / "base-bf16" / "model.safetensors")
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 101)
    run("verify", out, "--against")


def test_every_method_merges_over_an_mxfp4_base_as_over_the_dequantized_one(mx, tmp_path):
    agents = [mx / "coder", mx / "tools"]
    merges_alike(tmp_path, (mx / "base-bf16", agents), (mx / "base-mxfp4", agents),
                 extra=["--allow-dense-agents"], got_extra=["--threads", "3", "--tile-elems", "777"])


@pytest.mark.parametrize("damage, words", [
    ("no scales", ["gate_up_proj", "no 'model.layers.0.mlp.experts.gate_up_proj_scales'"]),
    ("scales of another shape", ["down_proj", "[E, N, G, 16] and [E, N, G]"]),
    ("stray bytes", ["'stray' is stored as bytes (U8)"]),
])
def test_broken_mxfp4_checkpoints_are_named_and_nothing_is_written(mx, tmp_path, damage, words):
    folder = tmp_path / "base"
    shutil.copytree(mx / "base-mxfp4", folder)
    state = load_file(folder / "model.safetensors")
    prefix = "model.layers.0.mlp.experts."
    if damage == "no scales":
        del state[prefix + "gate_up_proj_scales"]
    elif damage == "scales of another shape":
        state[prefix + "down_proj_scales"] = state[prefix + "down_proj_scales"][:, :3].contiguous()
    else:
        state["stray"] = torch.zeros(3, dtype=torch.uint8)
    save_file(state, folder / "model.safetensors")
    out = tmp_path / "out"
    p = run("convert", folder, "-q", "-o", out, code=1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()
