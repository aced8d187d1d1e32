"""torch Distributed Checkpoints (DCP), read straight from the folder `dcp.save` writes: FSDP2
over 2 gloo ranks (written by dcp_shards.py, the model under `model` and Adam's state under
`optim`, as accelerate and NeMo-RL save them). What rlmerge reads equals what `dcp.load` gives
(through `dcp_to_torch_save`), in the stored dtype; every method merges the checkpoint as it
merges the converted folder; malformed checkpoints are named, nothing written, and a pickle that
would run a command is never run."""

import os
import pickle
import shutil
from pathlib import Path

import pytest

from test_trainer_formats import merges_alike, run, weights
from test_verl import write_with_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

HERE = Path(__file__).resolve().parent
UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp")
    write_with_ranks(HERE / "dcp_shards.py", out, "optim")
    return out


def dcp_load(folder: Path, tmp: Path) -> dict:
    """The model's state dict as `dcp.load` gives it (torch's own DCP → torch.save converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(folder, tmp / "all.pt")
    return torch.load(tmp / "all.pt", weights_only=False)["model"]


def converted(folder: Path, out: Path, tmp: Path) -> Path:
    """The DCP checkpoint as a Hugging Face folder: `dcp.load`'s model tensors saved as
    transformers saves them (the tied head once), with the checkpoint's config."""
    out.mkdir()
    state = dcp_load(folder, tmp)
    state.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    shutil.copy(folder / "config.json", out / "config.json")
    return out


def test_a_dcp_checkpoint_reads_as_dcp_load_gives_it(ckpt, tmp_path):
    out = tmp_path / "out"
    p = run("convert", ckpt / "dcp", "-o", out)
    assert "torch DCP checkpoint" in p.stderr and "2 .distcp" in p.stderr, p.stderr
    assert "entries that are not the model's tensors are not read ('optim." in p.stderr, p.stderr
    got = load_file(out / "model.safetensors")
    want = dcp_load(ckpt / "dcp", tmp_path)
    assert set(want) - set(got) == {"lm_head.weight"}, "the tied head is written once"
    assert torch.equal(want["lm_head.weight"], want["model.embed_tokens.weight"])
    for k, v in got.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k]), k
    card = (out / "README.md").read_text()
    assert "torch DCP checkpoint" in card
    run("verify", out, "--against")


def test_every_method_merges_a_dcp_agent_as_the_converted_folder(ckpt, tmp_path):
    folder = converted(ckpt / "dcp", tmp_path / "converted", tmp_path)
    merges_alike(tmp_path, (ckpt / "base", [folder, ckpt / "other"]),
                 (ckpt / "base", [ckpt / "dcp", ckpt / "other"]), extra=["--allow-dense-agents"])
    run("verify", tmp_path / "got-ram+", "--against")


def test_the_same_bytes_on_any_thread_count(ckpt, tmp_path):
    outs = []
    for threads, tile in ((1, "5"), (3, "4096")):
        outs.append(tmp_path / f"t{threads}")
        run("merge", "--base", ckpt / "base", "--model", ckpt / "dcp", "--model", ckpt / "other",
            "--method", "ties", "--param", "weight=1", "--param", "density=0.5", "--threads",
            threads, "--tile-elems", tile, "--allow-dense-agents", "-q", "-o", outs[-1])
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()


def single_process_dcp(state: dict, out: Path, config: Path) -> Path:
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=out, no_dist=True)
    shutil.copy(config, out / "config.json")
    return out


def test_a_flat_single_process_checkpoint_keeps_its_names(ckpt, tmp_path):
    state = load_file(ckpt / "other" / "model.safetensors")
    folder = single_process_dcp(dict(state), tmp_path / "flat", ckpt / "base" / "config.json")
    out = tmp_path / "out"
    run("convert", folder, "-q", "-o", out)
    assert weights(out) | {"config.json": b""} == weights(ckpt / "other") | {"config.json": b""}


class _Runs:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("damage, words", [
    ("missing file", ["__1_0.distcp", "cannot open"]),
    ("fifo", ["__1_0.distcp", "not a regular file"]),
    ("truncated file", ["__1_0.distcp", "not a zip archive"]),
    ("overlapping chunks", ["model.norm.weight", "overlap"]),
    ("column chunks", [UP, "dimension 1", "tensor parallelism"]),
    ("chunk outside the folder", ["no .distcp file of the folder"]),
    ("nan", [UP, "non-finite value (NaN)"]),
    ("command", ["names the global 'posix.system'"]),
])
def test_malformed_checkpoints_are_named_and_nothing_is_written(ckpt, tmp_path, damage, words):
    folder = tmp_path / "dcp"
    shutil.copytree(ckpt / "dcp", folder)
    meta_path = folder / ".metadata"
    marker = tmp_path / "ran"
    if damage == "missing file":
        (folder / "__1_0.distcp").unlink()
    elif damage == "fifo":
        (folder / "__1_0.distcp").unlink()
        os.mkfifo(folder / "__1_0.distcp")
    elif damage == "truncated file":
        f = folder / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[:20000])  # into the model's chunks
    elif damage == "nan":
        state = dcp_load(ckpt / "dcp", tmp_path)
        state[UP].view(-1)[5] = float("nan")
        shutil.rmtree(folder)
        single_process_dcp({"model": state}, folder, ckpt / "dcp" / "config.json")
    elif damage == "command":
        meta_path.write_bytes(pickle.dumps(_Runs(marker)))
    else:
        meta = pickle.loads(meta_path.read_bytes())
        if damage == "chunk outside the folder":
            for index, info in meta.storage_data.items():
                info.relative_path = "../" + info.relative_path
        elif damage == "overlapping chunks":
            chunk = meta.state_dict_metadata["model.model.norm.weight"].chunks[1]
            chunk.offsets = torch.Size([chunk.offsets[0] - 1])
        else:
            entry = meta.state_dict_metadata["model." + UP]
            rows, cols = entry.size
            entry.chunks[0].sizes = entry.chunks[1].sizes = torch.Size([rows, cols // 2])
            entry.chunks[1].offsets = torch.Size([0, cols // 2])
        meta_path.write_bytes(pickle.dumps(meta))
    out = tmp_path / "out"
    p = run("convert", folder, "-q", "-o", out, code=2 if damage == "command" else 1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()
    assert not marker.exists()
