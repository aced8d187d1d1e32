"""verl's FSDP checkpoints, read straight from the trainer's shards: DTensors of fp32 masters over
2 gloo ranks (written by verl_shards.py with torch's FSDP2). What rlmerge reads equals what
verl's converter (`verl.model_merger merge --backend fsdp`) writes — each rank's local piece
`.bfloat16()`, `Shard(0)` pieces concatenated in mesh order, `Replicate` rank 0's — and every
method merges the shards as it merges that converted folder; malformed shard sets are named
and nothing is written."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_trainer_formats import merges_alike, method_args, run, to_bin, weights

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=["fsdp", "ddp,fsdp"])
def verl(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("verl")
    write_with_ranks(HERE / "verl_shards.py", out, request.param)
    return out


def write_with_ranks(script: Path, out: Path, *args: str):
    """Runs a fixture writer that spawns gloo ranks on a free local port. The port is free when
    chosen but may be taken before the ranks bind it (or a rank's connection reset on a loaded
    machine): a failed run is retried once in a fresh folder; a second failure shows its stderr."""
    for attempt in range(2):
        if attempt:
            shutil.rmtree(out)
            out.mkdir()
        p = subprocess.run([sys.executable, str(script), str(out), *args], capture_output=True,
                           text=True)
        if p.returncode == 0:
            return
    raise AssertionError(f"{script.name} failed twice:\n{p.stderr[-4000:]}")


def rank_files(actor: Path):
    return sorted(actor.glob("model_world_size_*_rank_*.pt"),
                  key=lambda f: int(f.stem.rsplit("_", 1)[1]))


def verls_rule(actor: Path, bf16=True) -> dict:
    """The state dict verl's converter builds from the rank files (its rule, restated)."""
    ranks = [torch.load(f, weights_only=False) for f in rank_files(actor)]
    state = {}
    for k, t in ranks[0].items():
        cast = (lambda x: x.bfloat16()) if bf16 else (lambda x: x)
        placement = t.placements[-1]
        pieces = [cast(r[k]._local_tensor) for r in ranks]
        state[k] = pieces[0] if placement.is_replicate() else torch.cat(pieces, placement.dim)
    return state


def converted(actor: Path, out: Path) -> Path:
    """The folder verl's converter writes: the state dict saved as transformers saves it (the
    tied lm_head dropped), with the config of `huggingface/`."""
    out.mkdir()
    state = verls_rule(actor)
    state.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(actor / "huggingface" / "config.json", out / "config.json")
    return out


def test_shards_read_as_verls_converter_writes_them(verl, tmp_path):
    out = tmp_path / "out"
    p = run("merge", "--base", verl / "base", "--model", verl / "actor", "--method", "passthrough",
            "-q", "-o", out)
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    want = verls_rule(verl / "actor")
    assert set(want) - set(got) == {"lm_head.weight"}, "the tied head is read once"
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, want[k]), k
    assert "verl FSDP shards" in p.stderr and "tied weights" in p.stderr, p.stderr
    record = json.loads((out / "rlmerge_record.json").read_text())
    assert "verl FSDP shards" in record["inputs"][1]["format"]
    assert [f["file"] for f in record["inputs"][1]["files"]][:2] == [
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    assert "verl FSDP shards" in (out / "README.md").read_text()


def test_every_method_merges_shards_as_the_converted_folder(verl, tmp_path):
    """Base + the verl actor + a Hugging Face agent, against base + verl's converted folder + the
    same agent: the same tensors, byte for byte, for every method."""
    folder = converted(verl / "actor", tmp_path / "converted")
    methods = list(method_args()) + [("ram+svc", ["--method", "ram+", "--svc", "0.2"])]
    merges_alike(tmp_path, (verl / "base", [folder, verl / "other"]),
                 (verl / "base", [verl / "actor", verl / "other"]),
                 extra=["--allow-dense-agents"], methods=methods)
    run("verify", tmp_path / "got-ram+", "--against")


def test_the_same_bytes_on_any_thread_count(verl, tmp_path):
    """A verl actor and a `.bin` agent, merged on 1 and on 3 threads: the same files."""
    agent = to_bin(verl / "other", tmp_path / "other-bin")
    outs = []
    for threads in (1, 3):
        outs.append(tmp_path / f"t{threads}")
        run("merge", "--base", verl / "base", "--model", verl / "actor", "--model", agent,
            "--method", "ties", "--param", "weight=1", "--param", "density=0.5",
            "--threads", threads, "--allow-dense-agents", "-q", "-o", outs[-1])
    assert weights(outs[0]) == weights(outs[1])
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()


def test_raw_f32_agents_keeps_the_masters(verl, tmp_path):
    out = tmp_path / "raw"
    run("merge", "--base", verl / "base", "--model", verl / "actor", "--method", "passthrough",
        "--raw-f32-agents", "--out-dtype", "f32", "-q", "-o", out)
    got = load_file(out / "model.safetensors")
    for k, v in verls_rule(verl / "actor", bf16=False).items():
        if k != "lm_head.weight":
            assert v.dtype == torch.float32 and torch.equal(got[k], v), k


@pytest.mark.parametrize("damage, words", [
    ("missing rank", ["model_world_size_2_rank_1.pt is missing"]),
    ("two world sizes", ["world sizes 2 and 4", "ambiguous"]),
    ("truncated rank", ["model_world_size_2_rank_1.pt", "not a zip archive"]),
    ("rank lacks a tensor", ["rank 1's file lacks 'model.norm.weight'"]),
    ("pieces disagree", ["model.norm.weight", "pieces hold"]),
    ("nan in a rank", ["model.layers.0.mlp.up_proj.weight", "model_world_size_2_rank_1.pt",
                       "non-finite value (NaN)"]),
])
def test_malformed_shard_sets_are_named_and_nothing_is_written(verl, tmp_path, damage, words):
    actor = tmp_path / "actor"
    shutil.copytree(verl / "actor", actor)
    rank1 = actor / "model_world_size_2_rank_1.pt"
    if damage == "missing rank":
        rank1.unlink()
    elif damage == "two world sizes":
        shutil.copy(rank1, actor / "model_world_size_4_rank_0.pt")
    elif damage == "truncated rank":
        rank1.write_bytes(rank1.read_bytes()[:-200])
    else:
        state = torch.load(rank1, weights_only=False)
        if damage == "rank lacks a tensor":
            del state["model.norm.weight"]
        elif damage == "nan in a rank":
            state["model.layers.0.mlp.up_proj.weight"]._local_tensor.view(-1)[3] = float("nan")
        else:
            t = state["model.norm.weight"]
            t._local_tensor = torch.cat([t._local_tensor, t._local_tensor])
        torch.save(state, rank1)
    out = tmp_path / "out"
    p = run("merge", "--base", verl / "base", "--model", actor, "--model", verl / "other", "-q",
            "-o", out, code=1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()


def test_a_moe_takes_an_expert_straight_from_the_shards(verl, tmp_path):
    """`rlmerge moe` with the verl actor as an expert writes what it writes from verl's converted
    folder: the same files, byte for byte (a Qwen2-MoE, the base as shared expert, random
    routers from one seed)."""
    import rlmerge

    folder = converted(verl / "actor", tmp_path / "converted")

    def config(actor):
        return {"base_model": verl / "base", "architecture": "qwen", "gate_mode": "random",
                "shared_experts": [{"source_model": verl / "base"}],
                "experts": [{"source_model": actor}, {"source_model": verl / "other"}]}

    rlmerge.moe(config(verl / "actor"), tmp_path / "from-shards", seed=3)
    rlmerge.moe(config(folder), tmp_path / "from-converted", seed=3)
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "from-shards" / f).read_bytes() == (tmp_path / "from-converted" / f).read_bytes(), f
    assert rlmerge.verify(tmp_path / "from-shards", against=True)["ok"]
