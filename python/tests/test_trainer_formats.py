"""Checkpoints as trainers and older tools write them, read directly: `pytorch_model.bin` (whole,
and sharded with its index) and PEFT's `adapter_model.bin`, written here by torch.save itself.
Every method's merge from them equals, byte for byte, the same merge from safetensors; what
rlmerge reads equals what torch.load gives; a pickle that would run a command is refused, never
run; damaged files are named and nothing is written."""

import json
import os
import pickle
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

import rlmerge
from conftest import cargo_binary

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

MODELS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "mergekit" / "models"

# Agents each method takes besides the base (3 where the method takes any number).
AGENTS = {"slerp": 1, "nearswap": 1, "arcee_fusion": 1, "passthrough": 1, "nuslerp": 2}
# Values for the parameters a method requires.
REQUIRED = {"weight": "0.5", "t": "0.3"}


def run(*args, code=0):
    # A run that blocked (on a FIFO, say) fails the test instead of hanging the suite.
    p = subprocess.run([cargo_binary(), *map(str, args)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == code, f"{args}: exit {p.returncode}: {p.stderr}"
    return p


def copy_side_files(src: Path, dst: Path):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, dst / f.name)


def to_bin(src: Path, dst: Path, shards: int = 1) -> Path:
    """`src`'s weights saved as transformers saves them without safetensors: torch.save of the
    state dict, in `shards` files with `pytorch_model.bin.index.json` when more than one."""
    copy_side_files(src, dst)
    state = safetensors_torch.load_file(src / "model.safetensors")
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, dst / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (dst / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return dst


def weights(out: Path) -> dict:
    """Every tensor of the folder `out` as its dtype, shape and bytes, and its config.json (the
    order of tensors in the file follows the base's files, which differ between the two)."""
    found = {"config.json": (out / "config.json").read_bytes()}
    for p in sorted(out.glob("*.safetensors")):
        for k, t in safetensors_torch.load_file(p).items():
            found[k] = (t.dtype, tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
    return found


def method_args():
    for m in rlmerge.methods():
        if m.get("modifier") or m["name"] == "fisher":  # svc is run below; fisher needs Fisher files
            continue
        args = ["--method", m["name"], "--seed", "5"]
        for p in m["parameters"]:
            if p["default"] == "required":
                args += ["--param", f"{p['name']}={REQUIRED[p['name']]}"]
        yield m["name"], args


def merges_alike(tmp_path, want, got, *, extra=(), got_extra=(), methods=None):
    """Every method (`methods`, else each of method_args()) merges `got` — (base, agents) — to
    the same tensors, byte for byte, as `want`; each takes as many agents as it merges (at most
    those given). `extra` goes to both merges, `got_extra` to got's. The outputs are
    tmp_path/want-NAME and tmp_path/got-NAME."""
    methods = list(method_args()) if methods is None else methods
    assert len(methods) >= 20
    for name, args in methods:
        n = min(AGENTS.get(name, 3), len(want[1]))
        outs = []
        for label, (base, agents), more in (("want", want, ()), ("got", got, got_extra)):
            outs.append(tmp_path / f"{label}-{name}")
            run("merge", "--base", base, *sum((["--model", a] for a in agents[:n]), []), *args,
                "-q", *extra, *more, "-o", outs[-1])
        assert weights(outs[1]) == weights(outs[0]), name
        assert len(weights(outs[0])) > 5, name


def test_every_method_merges_bins_as_it_merges_safetensors(demo, tmp_path):
    """Base sharded in 2 `.bin` files, one agent a whole `.bin`, one sharded in 3, one left as
    safetensors: every method's output holds the same tensors, byte for byte, as from the
    safetensors folders."""
    root, base, agents = demo
    bins = [to_bin(base, tmp_path / "base", 2), to_bin(agents[0], tmp_path / "a0"),
            to_bin(agents[1], tmp_path / "a1", 3), agents[2]]
    methods = list(method_args()) + [("ram+svc", ["--method", "ram+", "--svc", "0.2"])]
    assert len(methods) >= 25
    merges_alike(tmp_path, (base, agents), (bins[0], bins[1:]), methods=methods)
    assert rlmerge.verify(tmp_path / "got-ram+", against=True)["ok"]


def test_what_is_read_from_a_bin_is_what_torch_load_gives(tmp_path):
    """Passthrough of a `.bin` agent holding bf16, f16 and f32 tensors, a view sharing its
    storage with another tensor, and an nn.Parameter: each tensor equals torch.load's."""
    state = {
        "a.weight": torch.randn(5, 7, dtype=torch.bfloat16),
        "h.weight": torch.randn(3, 4).half(),
        "f.bias": torch.randn(11),
        "p.weight": torch.nn.Parameter(torch.randn(4, 2)),
    }
    wide = torch.randn(4, 6)
    state["v.weight"] = wide[1:3]  # rows 1–2 of another storage: offset and shared storage
    state["w.weight"] = wide
    model = tmp_path / "m"
    model.mkdir()
    torch.save(state, model / "pytorch_model.bin")
    (model / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "x"}))
    base = tmp_path / "base"
    base.mkdir()
    safetensors_torch.save_file({k: torch.zeros_like(v.detach()) for k, v in state.items()},
                                base / "model.safetensors")
    shutil.copy(model / "config.json", base / "config.json")
    out = tmp_path / "out"
    run("merge", "--base", base, "--model", model, "--method", "passthrough", "-q", "-o", out)
    got = safetensors_torch.load_file(out / "model.safetensors")
    want = torch.load(model / "pytorch_model.bin", weights_only=True)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v.detach()), k


class _Runs:
    """What a hostile pickle would call: os.system, creating a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_bin_whose_pickle_runs_a_command_is_refused_and_never_run(demo, tmp_path):
    root, base, agents = demo
    evil = to_bin(agents[0], tmp_path / "evil")
    marker = tmp_path / "ran"
    payload = pickle.dumps({"x": _Runs(marker)}, protocol=2)
    with zipfile.ZipFile(evil / "pytorch_model.bin", "w", zipfile.ZIP_STORED) as z:
        z.writestr("pytorch_model/data.pkl", payload)
        z.writestr("pytorch_model/byteorder", "little")
    out = tmp_path / "out"
    p = run("merge", "--base", base, "--model", evil, "--model", agents[1], "-q", "-o", out, code=2)
    assert "system'" in p.stderr and "pytorch_model.bin" in p.stderr, p.stderr
    assert not marker.exists(), "the pickle ran"
    assert not out.exists()
    with pytest.raises(rlmerge.UsageError, match="system'"):
        rlmerge.merge(base, [evil], method="ram", out=tmp_path / "out2")
    assert not marker.exists() and not (tmp_path / "out2").exists()


@pytest.mark.parametrize("damage, words", [
    ("truncate", ["pytorch_model.bin", "not a zip archive"]),
    ("transpose", ["pytorch_model.bin", "not contiguous", "save it after .contiguous()"]),
    ("float64", ["pytorch_model.bin", "torch.DoubleStorage"]),
    ("index", ["pytorch_model.bin.index.json", "which does not contain it"]),
    ("nan", ["pytorch_model.bin", "non-finite value (NaN)", "--allow-nonfinite"]),
])
def test_damaged_bins_are_named_and_nothing_is_written(demo, tmp_path, damage, words):
    root, base, agents = demo
    bad = to_bin(agents[0], tmp_path / "bad")
    file = bad / "pytorch_model.bin"
    state = torch.load(file, weights_only=True)
    name = sorted(k for k, v in state.items() if v.dim() == 2)[0]
    if damage == "truncate":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) - 100])
    elif damage == "transpose":
        state[name] = state[name].t().contiguous().t()
        torch.save(state, file)
    elif damage == "nan":
        state[name] = state[name].clone()
        state[name].view(-1)[5] = float("nan")
        torch.save(state, file)
    elif damage == "float64":
        state[name] = state[name].double()
        torch.save(state, file)
    elif damage == "index":
        # Sharded as one file whose index maps a tensor the file does not hold.
        shard = "pytorch_model-00001-of-00001.bin"
        file.rename(bad / shard)
        (bad / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {name: shard, "not.there": shard}}))
    out = tmp_path / "out"
    p = run("merge", "--base", base, "--model", bad, "--model", agents[1], "-q", "-o", out, code=1)
    for w in words:
        assert w in p.stderr, p.stderr
    assert not out.exists()


def test_a_peft_adapter_saved_by_torch_merges_as_its_safetensors(tmp_path):
    """adapter_model.bin (PEFT before safetensors) is the same agent as adapter_model.safetensors."""
    adapter = tmp_path / "coder-lora"
    shutil.copytree(MODELS / "coder-lora", adapter)
    state = safetensors_torch.load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(state, adapter / "adapter_model.bin")
    outs = []
    for i, agent in enumerate([MODELS / "coder-lora", adapter]):
        outs.append(tmp_path / f"o{i}")
        run("merge", "--base", MODELS / "base", "--model", agent, "--model", MODELS / "tools",
            "--method", "ram", "-q", "-o", outs[-1])
    assert weights(outs[0]) == weights(outs[1])
