"""FP8 block-scaled bases, as DeepSeek-V3/R1 and Kimi K2 ship them: the projections stored as
float8_e4m3fn with a float32 `weight_scale_inv` per block, `quant_method: fp8` in the config.
rlmerge reads such a base as DeepSeek's `weight_dequant` (fp8_cast_bf16.py) converts it — each
byte widened, times its block's scale in f32, rounded once to bf16 — so bf16 agents trained from
the dequantized model merge against it as against the dequantized folder, for every method; the
output has no scales and no quantization_config, and transformers loads it. Broken scales are
named, nothing written."""

import json
import shutil

import pytest

from test_trainer_formats import merges_alike, run, weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

BLOCK = (32, 48)  # not square, and not dividing the matrices: partial blocks at the edges
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config():
    return transformers.AutoConfig.for_model(
        "qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=101, tie_word_embeddings=False)


def quantize(w):
    """DeepSeek's block quantization: per block, scale = amax / 448, q = w / scale in fp8."""
    rows, cols = w.shape
    br, bc = BLOCK
    scales = torch.empty((rows + br - 1) // br, (cols + bc - 1) // bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            scale = block.abs().max().clamp(min=1e-12) / 448.0
            scales[i, j] = scale
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (block / scale).to(torch.float8_e4m3fn)
    return q, scales


def weight_dequant(q, s):
    """DeepSeek's weight_dequant, restated: the byte widened times its block's scale, in f32,
    rounded to bf16."""
    rows, cols = q.shape
    full = s.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return (q.float() * full).to(torch.bfloat16)


def save(folder, state, cfg, quantization=None):
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    cfg = cfg.to_dict()
    if quantization:
        cfg["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config()).to(torch.bfloat16)
    quantized, dequantized = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(".weight") and any(p in k for p in QUANTIZED):
            q, s = quantize(v)
            quantized[k], quantized[k + "_scale_inv"] = q, s
            dequantized[k] = weight_dequant(q, s)
        else:
            quantized[k] = dequantized[k] = v
    save(root / "base-fp8", quantized, config(), {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": list(BLOCK)})
    save(root / "base-bf16", dequantized, config())
    g = torch.Generator().manual_seed(1)
    for a in ("coder", "tools"):
        agent = {}
        for k, v in dequantized.items():
            changed = torch.rand(v.shape, generator=g) < 0.2
            agent[k] = (v.float() + changed * torch.randn(v.shape, generator=g) * 0.02).to(v.dtype)
        save(root / a, agent, config())
    return root


def test_an_fp8_base_converts_as_deepseeks_dequantization_writes_it(fp8, tmp_path):
    out = tmp_path / "out"
    p = run("convert", fp8 / "base-fp8", "-o", out)
    assert "FP8 block-scaled safetensors" in p.stderr, p.stderr
    got, want = load_file(out / "model.safetensors"), load_file(fp8 / "base-bf16" / "model.safetensors")
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 101)
    run("verify", out, "--against")


def test_the_same_bytes_on_any_thread_count_and_tile(fp8, tmp_path):
    outs = []
    for threads, tile in ((1, "7"), (3, "4096")):
        outs.append(tmp_path / f"t{threads}")
        run("merge", "--base", fp8 / "base-fp8", "--model", fp8 / "coder", "--model", fp8 / "tools",
            "--method", "ram", "--threads", threads, "--tile-elems", tile, "-q", "-o", outs[-1])
    assert weights(outs[0]) == weights(outs[1])


def test_every_method_merges_over_an_fp8_base_as_over_the_dequantized_one(fp8, tmp_path):
    agents = [fp8 / "coder", fp8 / "tools"]
    merges_alike(tmp_path, (fp8 / "base-bf16", agents), (fp8 / "base-fp8", agents),
                 extra=["--allow-dense-agents"])


@pytest.mark.parametrize("damage, words", [
    ("no scales", ["model.layers.0.mlp.up_proj.weight", "no 'model.layers.0.mlp.up_proj.weight_scale_inv'"]),
    ("scales of another shape", ["up_proj.weight_scale_inv' is [3, 2]", "need [5, 2]"]),
    ("scales without a matrix", ["'stray.weight_scale_inv' scales no FP8 tensor"]),
    ("a nan scale", ["down_proj.weight_scale_inv", "must be finite"]),
    ("no quantization config", ["unsupported dtype F8_E4M3", "quant_method fp8"]),
    ("a nan weight", ["model.layers.0.mlp.up_proj.weight", "model.safetensors",
                      "non-finite value (NaN)"]),
])
def test_broken_fp8_checkpoints_are_named_and_nothing_is_written(fp8, tmp_path, damage, words):
    folder = tmp_path / "base"
    shutil.copytree(fp8 / "base-fp8", folder)
    state = load_file(folder / "model.safetensors")
    up = "model.layers.0.mlp.up_proj.weight_scale_inv"
    if damage == "no scales":
        del state[up]
    elif damage == "scales of another shape":
        state[up] = state[up][:3]
    elif damage == "scales without a matrix":
        state["stray.weight_scale_inv"] = torch.ones(1, 1)
    elif damage == "a nan weight":
        state["model.layers.0.mlp.up_proj.weight"].view(torch.uint8).view(-1)[7] = 0x7F
    elif damage == "a nan scale":
        state["model.layers.1.mlp.down_proj.weight_scale_inv"][0, 0] = float("nan")
    else:
        config = json.loads((folder / "config.json").read_text())
        del config["quantization_config"]
        (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors")
    out = tmp_path / "out"
    p = run("convert", folder, "-q", "-o", out, code=1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()
