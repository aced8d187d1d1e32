"""The Python package: the API merges, analyzes, verifies and lists methods through the same
library as the command; errors are the binding's MergeError/UsageError with the library's message and leave
nothing behind; the pip-installed command equals the cargo-built binary byte for byte."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import rlmerge
from conftest import cargo_binary, pip_command


def folder_bytes(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix == ".safetensors"}


def test_merge_returns_the_record_and_verifies(demo, tmp_path):
    root, base, agents = demo
    out = tmp_path / "merged"
    summary = rlmerge.merge(base, agents, out=out)
    assert summary["out"] == str(out)
    assert summary["method"]["method"] == "ram+"
    lambdas = [a["lambda"] for a in summary["agents"]]
    assert len(lambdas) == 3 and all(1.0 <= l <= 1.2 for l in lambdas), lambdas
    assert summary["shards"] == ["model.safetensors"]
    assert all("crc32" in o for o in summary["outputs"])
    assert (out / "overlap.svg").exists()
    result = rlmerge.verify(out)
    assert result["ok"] and result["checks"] and result["problems"] == [], result


def test_api_and_command_give_the_same_bytes(demo, tmp_path):
    """The API (a recipe from keywords) and both commands (flags) write the same tensors."""
    root, base, agents = demo
    for method, params, flags in [
        ("ram+", {}, []),
        ("ram", {"shared": "consensus"}, ["--shared", "consensus"]),
        ("ties", {"density": 0.5, "weight": [0.7, 0.2, 0.1]}, None),
    ]:
        api = tmp_path / f"api-{method}"
        rlmerge.merge(base, agents, method=method, out=api, device="cpu", **params)
        outputs = [folder_bytes(api)]
        if flags is not None:
            for binary in (pip_command(), cargo_binary()):
                out = tmp_path / f"cli-{method}-{len(outputs)}"
                cmd = [binary, "merge", "-q", "--device", "cpu", "--method", method,
                       "--base", str(base), "-o", str(out), *flags]
                for a in agents:
                    cmd += ["--model", str(a)]
                subprocess.run(cmd, check=True)
                outputs.append(folder_bytes(out))
        assert all(o == outputs[0] for o in outputs), method
        assert outputs[0], method


def test_pip_command_equals_cargo_binary(demo, tmp_path):
    """Same bytes out, same output and exit codes, from the pip-installed command and the binary."""
    root, base, agents = demo
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(
        "merge_method: ties\n"
        f"base_model: {base}\n"
        "parameters:\n  density: 0.4\n"
        "models:\n" + "".join(f"  - model: {a}\n    parameters:\n      weight: 0.5\n" for a in agents)
    )
    results = []
    for i, binary in enumerate((pip_command(), cargo_binary())):
        out = tmp_path / f"run-{i}"
        subprocess.run([binary, "run", str(recipe), "-q", "-o", str(out)], check=True)
        analyze = subprocess.run([binary, "analyze", "--json", "-q", "--base", str(base),
                                  "--model", str(agents[0]), "--model", str(agents[1])],
                                 check=True, capture_output=True, text=True).stdout
        bad = subprocess.run([binary, "merge", "--bogus"], capture_output=True, text=True)
        missing = subprocess.run([binary, "merge", "-q", "--base", str(base), "--model",
                                  str(tmp_path / "nowhere"), "-o", str(tmp_path / f"x{i}")],
                                 capture_output=True, text=True)
        results.append((folder_bytes(out), analyze, bad.returncode, missing.returncode,
                        missing.stderr))
    assert results[0] == results[1]
    # A missing folder is a usage error (issue #45), as a bad flag is.
    assert results[0][2:4] == (2, 2)


def test_analyze_is_the_commands_json(demo):
    root, base, agents = demo
    report = rlmerge.analyze(base, agents, per_tensor=True, device="cpu")
    cli = subprocess.run([cargo_binary(), "analyze", "--json", "--per-tensor", "-q", "--device",
                          "cpu", "--base", str(base)] + sum((["--model", str(a)] for a in agents), []),
                         check=True, capture_output=True, text=True).stdout
    assert report == json.loads(cli)
    assert [a["agent"] for a in report["agents"]] == [str(a) for a in agents]


def test_analyze_retention_and_plots(demo, tmp_path):
    root, base, agents = demo
    merged = tmp_path / "ta"
    rlmerge.merge(base, agents, method="task_arithmetic", out=merged, weight=0.5)
    report = rlmerge.analyze(base, agents, merged=merged, plot=tmp_path / "plots")
    for a in report["retention"]["agents"]:
        assert abs(a["unique"]["retention"] - 0.5) < 0.05, a
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["layers.svg", "overlap.svg", "retention.svg"]


def test_methods_lists_every_method_with_its_parameters():
    methods = {m["name"]: m for m in rlmerge.methods()}
    assert {"ram", "ram+", "ties", "della", "slerp"} <= set(methods)
    ram_plus = {p["name"]: p for p in methods["ram+"]["parameters"]}
    assert {"rule", "scope", "shared", "epsilon"} <= set(ram_plus)
    assert ram_plus["scope"]["default"] == "global"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(method="nope"), rlmerge.UsageError, ["unknown method 'nope'"]),
        (dict(method="svc"), rlmerge.UsageError, ["svc=ALPHA"]),
        # Issue #45: a missing parameter is named as this function's keyword, not a flag.
        (dict(method="ties"), rlmerge.UsageError, ["keyword weight=VALUE of rlmerge.merge"]),
        (dict(method="ties", weight=1, density=2.0), rlmerge.UsageError, ["density", "[0, 1]"]),
        (dict(method="ties", weight=[1, 2]), rlmerge.UsageError, ["2 values for 3 models"]),
        (dict(method="ties", weight={"stranger": 1}), rlmerge.UsageError, ["stranger"]),
        (dict(method="ram", device="tpu"), rlmerge.UsageError, ["tpu"]),
        (dict(method="ram", scope="layer"), rlmerge.UsageError, ["scope"]),
    ],
)
def test_bad_requests_raise_usage_errors_and_write_nothing(demo, tmp_path, kwargs, error, words):
    root, base, agents = demo
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        rlmerge.merge(base, agents, out=out, **kwargs)
    assert isinstance(info.value, ValueError)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert not str(info.value).startswith("error:")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_scoped_lambdas_are_given_per_group(demo, tmp_path):
    root, base, agents = demo
    for scope, some_key in [("layer", "layer 0"), ("module", "mlp")]:
        summary = rlmerge.merge(base, agents, method="ram+", scope=scope,
                                out=tmp_path / scope, device="cpu")
        for agent in summary["agents"]:
            assert agent["lambda"] is None
            lambdas = agent["lambdas"]
            assert some_key in lambdas, sorted(lambdas)
            assert all(value >= 1.0 for value in lambdas.values())
    # Global scope: one λ, no groups.
    summary = rlmerge.merge(base, agents, method="ram+", out=tmp_path / "global", device="cpu")
    assert all(a["lambda"] >= 1.0 and "lambdas" not in a for a in summary["agents"])


def test_failures_raise_merge_error_naming_the_problem(demo, tmp_path):
    root, base, agents = demo
    with pytest.raises(rlmerge.MergeError) as info:
        rlmerge.merge(base, [tmp_path / "missing-agent"], out=tmp_path / "out")
    assert "missing-agent" in str(info.value)
    assert not isinstance(info.value, ValueError) or isinstance(info.value, rlmerge.UsageError)
    assert not (tmp_path / "out").exists()
    # A merge into an existing folder it did not write: refused, the folder untouched.
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(rlmerge.UsageError):
        rlmerge.merge(base, agents, out=keep, force=True)
    assert (keep / "notes.txt").read_text() == "mine"
    with pytest.raises(rlmerge.MergeError, match="nothing-here"):
        rlmerge.verify(tmp_path / "nothing-here")


# A merge of the 64 MiB example that runs for seconds on any machine, so it can be seen running
# and signalled: Iso-C takes an SVD per matrix. (These tests used DELLA until its statistics scan
# got fast enough to end before the signal came.)
SLOW = {"method": "iso_c"}
SLOW_ARGS = ["--method", "iso_c"]


@pytest.fixture(scope="module")
def big_demo(tmp_path_factory):
    """A 64 MiB example, so a merge runs long enough to be seen running."""
    root = tmp_path_factory.mktemp("big")
    subprocess.run([pip_command(), "demo", str(root), "--write-only", "--quiet",
                    "--model-size", "64MiB"], check=True)
    return root, root / "base", [root / a for a in ("coding-agent", "tool-agent", "memory-agent")]


def test_the_gil_is_released_while_merging(big_demo, tmp_path):
    root, base, agents = big_demo
    span = {}

    def work():
        span["start"] = time.monotonic()
        rlmerge.merge(base, agents, out=tmp_path / "m", device="cpu", threads=1, **SLOW)
        span["end"] = time.monotonic()

    t = threading.Thread(target=work)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.monotonic())
        time.sleep(0.001)
    t.join()
    assert "end" in span, "the merge failed"
    inside = [x for x in ticks if span["start"] + 0.05 < x < span["end"] - 0.05]
    assert span["end"] - span["start"] > 0.2
    assert len(inside) > 10, "Python code could not run while the merge ran"


def test_ctrl_c_stops_a_merge_and_leaves_nothing(big_demo, tmp_path):
    root, base, agents = big_demo
    parent = tmp_path / "outs"
    parent.mkdir()
    # Ctrl-C's handler, also where this suite runs with SIGINT ignored (a background job of a
    # shell inherits that, and Python then installs no handler).
    script = (
        "import signal, sys, rlmerge\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"rlmerge.merge({str(base)!r}, {[str(a) for a in agents]!r}, "
        f"out={str(parent / 'merged')!r}, device='cpu', threads=1, **{SLOW!r})\n"
        "print('finished')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(parent.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the merge ended before it could be interrupted"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0, stdout
    assert "KeyboardInterrupt" in stderr, stderr
    assert "finished" not in stdout
    assert sorted(os.listdir(parent)) == [], "a scratch or output folder was left"


@pytest.mark.parametrize("tool", ["moe", "extract_lora"])
def test_ctrl_c_stops_mergekits_other_tools_within_a_second(big_demo, tmp_path, tool):
    """rlmerge.moe and rlmerge.extract_lora answer Ctrl-C as merge does, within a second:
    KeyboardInterrupt, nothing at or beside the output (their work runs on a pool of its own,
    which takes the call's cancellation; noise on every expert weight, or a rank-32 extraction,
    keeps one thread busy for seconds)."""
    root, base, agents = big_demo
    parent = tmp_path / "outs"
    parent.mkdir()
    out = str(parent / "out")
    if tool == "moe":
        config = {"base_model": str(base), "architecture": "qwen", "gate_mode": "random",
                  "shared_experts": [{"source_model": str(base)}],
                  "experts": [{"source_model": str(a), "noise_scale": 0.01} for a in agents]}
        call = f"rlmerge.moe({config!r}, {out!r}, threads=1)"
    else:
        call = f"rlmerge.extract_lora({str(base)!r}, {str(agents[2])!r}, {out!r}, rank=32, threads=1)"
    script = (
        "import signal, sys, rlmerge\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"{call}\n"
        "print('finished')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(parent.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, f"{tool} finished before it could be interrupted"
    time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - started < 1.0, "Ctrl-C took more than a second"
    assert proc.returncode != 0, stdout
    assert "KeyboardInterrupt" in stderr, stderr
    assert "finished" not in stdout
    assert sorted(os.listdir(parent)) == [], "a scratch or output folder was left"


def test_lora_agents_merge_from_python(tmp_path):
    """A PEFT adapter folder, and mergekit's BASE+ADAPTER, are agents from Python too."""
    models = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "mergekit" / "models"
    base = models / "base"
    agents = [models / "coder-lora", f"{base}+{models / 'tools-lora'}"]
    summary = rlmerge.merge(base, agents, method="ties", out=tmp_path / "lora",
                            density=0.5, weight=1.0)
    assert [Path(a["path"]).name for a in summary["agents"]] == ["coder-lora", "tools-lora"]
    assert rlmerge.verify(tmp_path / "lora", against=True)["ok"]
    with pytest.raises(rlmerge.UsageError, match="is not the merge's base"):
        rlmerge.merge(base, [f"{models / 'tools'}+{models / 'coder-lora'}"], method="ram",
                      out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_tokenizer_sources_from_python(tmp_path):
    """Agents that added tokens merge token by token from Python: tokenizer_source="union" equals
    the command's --tokenizer-source union, and the tokenizer section's tokens and padding reach
    the output's vocabulary and config."""
    models = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "mergekit" / "models"
    base, agents = models / "base", [models / "tools-tok", models / "coder-tok"]
    api = tmp_path / "api"
    rlmerge.merge(base, agents, method="ties", out=api, device="cpu", density=0.5, weight=1.0,
                  tokenizer_source="union")
    cli = tmp_path / "cli"
    cmd = [cargo_binary(), "merge", "-q", "--device", "cpu", "--method", "ties", "--param",
           "density=0.5", "--param", "weight=1", "--tokenizer-source", "union", "--base",
           str(base), "--model", str(agents[0]), "--model", str(agents[1]), "-o", str(cli)]
    subprocess.run(cmd, check=True)
    assert folder_bytes(api) == folder_bytes(cli)
    assert json.loads((api / "config.json").read_text())["vocab_size"] == 52
    padded = tmp_path / "padded"
    rlmerge.merge(base, agents, method="task_arithmetic", out=padded, weight=0.5,
                  tokenizer={"source": "base", "pad_to_multiple_of": 16,
                             "tokens": {"<tool_call>": {"source": str(agents[0])},
                                        "<x>": {"source": {"kind": "zero"}}}})
    added = json.loads((padded / "tokenizer.json").read_text())["added_tokens"]
    assert [a["content"] for a in added][-2:] == ["<tool_call>", "<x>"]
    assert json.loads((padded / "config.json").read_text())["vocab_size"] == 64
    assert rlmerge.verify(padded, against=True)["ok"]
    report = rlmerge.analyze(base, agents, tokenizer_source="union", merged=api, device="cpu")
    assert len(report["agents"]) == 2
    with pytest.raises(rlmerge.UsageError, match="pad_to_multiple_of"):
        rlmerge.merge(base, agents, method="ties", out=tmp_path / "bad", weight=1.0,
                      tokenizer={"pad_to_multiple_of": -3})
    assert not (tmp_path / "bad").exists()


def test_paths_are_str_bytes_or_pathlike_and_nothing_else(demo, tmp_path):
    """out=, plot=, base and models take str, bytes and os.PathLike alike (decoded as the OS
    does); any other type is a UsageError before anything is written."""
    root, base, agents = demo
    out = tmp_path / "bytes-out"
    summary = rlmerge.merge(os.fsencode(base), [os.fsencode(a) for a in agents], method="ram",
                            out=os.fsencode(out))
    assert summary["out"] == str(out)
    assert (out / "model.safetensors").exists()
    assert not any("b'" in p.name for p in tmp_path.iterdir())
    plot = tmp_path / "figs"
    rlmerge.analyze(base, agents, plot=os.fsencode(plot))
    assert (plot / "overlap.svg").exists()
    for bad in (123, 1.5, ["x"], None):
        with pytest.raises(rlmerge.UsageError, match="must be a path"):
            rlmerge.merge(base, agents, method="ram", out=bad if bad is not None else 0)
    with pytest.raises(rlmerge.UsageError, match="must be a path"):
        rlmerge.analyze(base, agents, plot=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bytes-out", "figs"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(method="ties", weight=None), ["'weight' is None"]),
        (dict(method="ties", weight=[1, None, 1]), ["'weight' is None"]),
        (dict(method="ram", threads=-1), ["threads", "≥ 0"]),
        (dict(method="ram", threads="2"), ["threads"]),
        (dict(method="ram", device=None), ["device"]),
        (dict(method="ties", weight=object()), ["'weight'", "a number"]),
    ],
)
def test_arguments_are_checked_in_the_apis_own_words(demo, tmp_path, kwargs, words):
    root, base, agents = demo
    with pytest.raises(rlmerge.UsageError) as info:
        rlmerge.merge(base, agents, out=tmp_path / "out", **kwargs)
    for w in words:
        assert w in str(info.value), str(info.value)
    for foreign in ("untagged enum", "unexpected argument", "line ", "rlmerge-recipe-"):
        assert foreign not in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_missing_folder_is_a_usage_error_naming_it(demo, tmp_path):
    root, base, agents = demo
    with pytest.raises(rlmerge.UsageError, match="no such folder") as info:
        rlmerge.merge(tmp_path / "no-base", agents, method="ram", out=tmp_path / "out")
    assert "no-base" in str(info.value)
    with pytest.raises(rlmerge.UsageError, match="no such folder"):
        rlmerge.analyze(base, [tmp_path / "no-agent"])
    # A recipe error names no line of a recipe the caller never wrote.
    with pytest.raises(rlmerge.UsageError) as info:
        rlmerge.merge(base, agents, method="ties", out=tmp_path / "out", weight=1, densty=0.5)
    assert "line" not in str(info.value) and "densty" in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


def test_ctrl_c_stops_only_the_call_it_reaches(big_demo, tmp_path):
    """Cancellation is per call: Ctrl-C in the main thread stops the main thread's merge, and a
    merge another thread runs at the same time finishes, complete and verified."""
    root, base, agents = big_demo
    done = {}

    def background():
        try:
            done["summary"] = rlmerge.merge(base, agents, out=tmp_path / "bg", device="cpu",
                                            threads=1, **SLOW)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            done["error"] = e

    t = threading.Thread(target=background)
    t.start()
    time.sleep(0.3)
    # Ctrl-C's handler, also where this suite runs with SIGINT ignored (a background job of a
    # shell inherits that, and Python then installs no handler).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            rlmerge.merge(base, agents, out=tmp_path / "fg", device="cpu", threads=1, **SLOW)
    finally:
        signal.signal(signal.SIGINT, before)
    t.join()
    assert "error" not in done, done.get("error")
    assert not (tmp_path / "fg").exists()
    assert rlmerge.verify(tmp_path / "bg")["ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bg"]


def _signal_the_pip_command(big_demo, parent, sig, disposition):
    """Starts the pip-installed command's slow merge into ``parent / "merged"`` with ``sig`` at
    ``disposition``, sends ``sig`` once the merge is under way, and returns (exit code,
    stderr)."""
    root, base, agents = big_demo
    cmd = [pip_command(), "merge", "-q", "--device", "cpu", "--threads", "1", *SLOW_ARGS,
           "--base", str(base)]
    for a in agents:
        cmd += ["--model", str(a)]
    proc = subprocess.Popen(cmd + ["-o", str(parent / "merged")], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, disposition))
    deadline = time.monotonic() + 60
    while not any(parent.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the merge ended before it could be signalled"
    time.sleep(0.2)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_the_pip_command_cleans_up_on_sigterm_and_sighup(big_demo, tmp_path, sig):
    """The pip-installed command, like the binary, removes its scratch folder and exits 130."""
    parent = tmp_path / "outs"
    parent.mkdir()
    # The signal at its default in the command, whatever this suite inherited (under `nohup`,
    # SIGHUP is ignored, and the command keeps what it starts with ignored).
    code, stderr = _signal_the_pip_command(big_demo, parent, sig, signal.SIG_DFL)
    assert code == 130, stderr
    assert "interrupted" in stderr, stderr
    assert sorted(os.listdir(parent)) == [], "a scratch or output folder was left"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_the_pip_command_keeps_signals_ignored_at_start(big_demo, tmp_path, sig):
    """Under `nohup` (SIGHUP ignored) or as a shell's background job (SIGINT ignored), the
    command keeps the signal ignored, as the binary does: the merge runs on and completes."""
    parent = tmp_path / "outs"
    parent.mkdir()
    code, stderr = _signal_the_pip_command(big_demo, parent, sig, signal.SIG_IGN)
    assert code == 0, stderr
    assert sorted(os.listdir(parent)) == ["merged"]
    assert rlmerge.verify(parent / "merged")["ok"]


def _drop_tensor(src: Path, dst: Path, drop: str) -> None:
    """A copy of model folder ``src`` (one model.safetensors) without tensor ``drop``, written
    with the safetensors format by hand: 8-byte header size, JSON header, data."""
    import shutil
    import struct
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    raw = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out_header, chunks, at = {}, [], 0
    for name, entry in header.items():
        if name == "__metadata__":
            out_header[name] = entry
            continue
        if name == drop:
            continue
        a, b = entry["data_offsets"]
        chunks.append(data[a:b])
        out_header[name] = dict(entry, data_offsets=[at, at + (b - a)])
        at += b - a
    text = json.dumps(out_header).encode()
    text += b" " * (-len(text) % 8)
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def test_missing_tensors_are_refused_unless_allowed(demo, tmp_path):
    root, base, agents = demo
    partial = tmp_path / "partial"
    _drop_tensor(agents[0], partial, "model.norm.weight")
    with pytest.raises(rlmerge.UsageError) as info:
        rlmerge.merge(base, [partial, agents[1]], method="ram", out=tmp_path / "out")
    assert "allow_missing_tensors=True" in str(info.value), str(info.value)
    assert "--allow" not in str(info.value)
    assert not (tmp_path / "out").exists()
    summary = rlmerge.merge(base, [partial, agents[1]], method="ram", out=tmp_path / "out",
                            allow_missing_tensors=True)
    assert any("model.norm.weight" in w for w in summary["warnings"]), summary["warnings"]
    assert rlmerge.verify(tmp_path / "out", against=True)["ok"]


def test_verify_returns_what_it_found(demo, tmp_path):
    root, base, agents = demo
    out = tmp_path / "m"
    rlmerge.merge(base, agents, method="ram", out=out)
    found = rlmerge.verify(out)
    assert found["ok"] and found["problems"] == [] and len(found["checks"]) > 3, found
    shard = out / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    found = rlmerge.verify(out)
    assert not found["ok"], found
    assert any("model.safetensors" in p for p in found["problems"]), found


def test_the_recipe_a_call_saves_remakes_the_merge(demo, tmp_path):
    """merge()'s keywords reach the library as a recipe value; the recipe it saves
    (mergekit_config.yml, serde_yaml's text of that value) run as a file gives the same bytes,
    and the record returned is the one on disk."""
    root, base, agents = demo
    first = tmp_path / "api"
    summary = rlmerge.merge(base, agents[:2], method="ties", out=first, device="cpu",
                            density=0.5, weight={agents[0].name: 0.7, agents[1].name: 0.3})
    saved = (first / "mergekit_config.yml").read_text()
    assert "merge_method: ties" in saved and "density: 0.5" in saved, saved
    again = rlmerge.run(first / "mergekit_config.yml", out=tmp_path / "run", device="cpu")
    assert folder_bytes(first) == folder_bytes(tmp_path / "run")
    on_disk = json.loads((first / "rlmerge_record.json").read_text())
    assert {k: v for k, v in summary.items() if k in on_disk} == on_disk
    assert again["method"] == summary["method"]


def test_exceptions_are_the_bindings_own(demo, tmp_path):
    """The exception classes come from the native module; messages carry no command-line
    prefix, and a request error raised there is also a ValueError."""
    from rlmerge import _rlmerge

    assert rlmerge.MergeError is _rlmerge.MergeError
    assert rlmerge.UsageError is _rlmerge.UsageError
    assert issubclass(rlmerge.UsageError, (rlmerge.MergeError)) and issubclass(rlmerge.UsageError, ValueError)
    root, base, agents = demo
    with pytest.raises(rlmerge.UsageError) as info:
        rlmerge.merge(base, agents, method="tie", out=tmp_path / "x")
    # In the API's words (issue #45): its keyword is `method`, not a recipe's merge_method.
    assert str(info.value).startswith("unknown method 'tie'"), str(info.value)
    assert "did you mean 'ties'" in str(info.value)
    assert not (tmp_path / "x").exists()


def test_analyze_and_methods_are_typed_calls(demo, tmp_path):
    """analyze and methods call the library with typed requests (no command line): a bad
    epsilon is a UsageError in the API's words, and the results are the command's JSON."""
    from rlmerge import _rlmerge

    root, base, agents = demo
    with pytest.raises(rlmerge.UsageError) as info:
        rlmerge.analyze(base, agents, epsilon=-1.0)
    assert str(info.value) == "epsilon: parameter 'epsilon' must be ≥ 0, got -1", str(info.value)
    # Issue #42: 1e39 is a finite Python float and +inf as the f32 ε is compared in; refused from
    # every front end, as the flag is.
    with pytest.raises(rlmerge.UsageError, match="infinite as an f32"):
        rlmerge.analyze(base, agents, epsilon=1e39)
    with pytest.raises(rlmerge.UsageError, match="infinite as an f32"):
        rlmerge.merge(base, agents, method="ram", epsilon=1e39, out=tmp_path / "inf")
    assert not (tmp_path / "inf").exists()
    assert not hasattr(_rlmerge, "command")
    report = rlmerge.analyze(base, agents[:2], epsilon=1e-4, device="cpu")
    assert report["epsilon"] == pytest.approx(1e-4)
    assert [m["name"] for m in rlmerge.methods()][:2] == ["ram", "ram+"]


@pytest.mark.parametrize("method, key, value", [("iso_c", "scaling_factor", 1.5),
                                               ("tsv", "scaling_factor", 1.5),
                                               ("resmerge", "head_ratio_budget", 0.3)])
def test_spectral_methods_from_python_equal_the_command(demo, tmp_path, method, key, value):
    """Iso-C, TSV-M and ResMerge (SPEC §4c, §4d, §4f) from the API's keywords write the
    command's bytes."""
    root, base, agents = demo
    api = tmp_path / "api"
    rlmerge.merge(base, agents, method=method, out=api, device="cpu", **{key: value})
    cmd = [cargo_binary(), "merge", "-q", "--device", "cpu", "--method", method,
           "--param", f"{key}={value}", "--base", str(base), "-o", str(tmp_path / "cli")]
    for a in agents:
        cmd += ["--model", str(a)]
    subprocess.run(cmd, check=True)
    assert folder_bytes(api) == folder_bytes(tmp_path / "cli")
    assert f"merge_method: {method}" in (api / "mergekit_config.yml").read_text()


def test_svc_from_python_equals_the_command(demo, tmp_path):
    """SVC (SPEC §4e) after any method: svc=α from the API writes --svc α's bytes, and the
    record keeps α; a bad α is a UsageError naming svc, nothing written."""
    root, base, agents = demo
    api = tmp_path / "api"
    record = rlmerge.merge(base, agents, method="task_arithmetic", out=api, device="cpu",
                           weight=1.0, svc=0.2)
    assert record["svc"] == pytest.approx(0.2)
    cmd = [cargo_binary(), "merge", "-q", "--device", "cpu", "--method", "task_arithmetic",
           "--param", "weight=1", "--svc", "0.2", "--base", str(base),
           "-o", str(tmp_path / "cli")]
    for a in agents:
        cmd += ["--model", str(a)]
    subprocess.run(cmd, check=True)
    assert folder_bytes(api) == folder_bytes(tmp_path / "cli")
    for bad in (-1.0, 0.0, float("nan"), "much"):
        with pytest.raises(rlmerge.UsageError) as info:
            rlmerge.merge(base, agents, method="ram", out=tmp_path / "bad", device="cpu", svc=bad)
        assert "svc" in str(info.value)
        assert not (tmp_path / "bad").exists()


def test_recipe_values_that_never_end_are_usage_errors(demo, tmp_path):
    """Issue #42: a tokenizer section that contains itself, or nests 5,000 lists deep, is a
    UsageError naming where — not a stack overflow that kills the interpreter (as json.dumps
    raises for the same values); a parameter nesting lists past a per-model gradient is too."""
    root, base, agents = demo
    loop = {"source": "base"}
    loop["tokens"] = loop
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    for tokenizer, words in [(loop, "contains itself"),
                             ({"source": "base", "tokens": deep}, "nested more than 64")]:
        with pytest.raises(rlmerge.UsageError, match=words) as info:
            rlmerge.merge(base, agents, method="ram", out=tmp_path / "x", tokenizer=tokenizer)
        assert "tokenizer.tokens" in str(info.value), str(info.value)
    with pytest.raises(rlmerge.UsageError, match="more than two deep"):
        rlmerge.merge(base, agents, method="ties", out=tmp_path / "x", weight=[[[1.0]]])
    assert not (tmp_path / "x").exists()


def test_a_ctrl_c_as_the_merge_ends_says_which_happened(demo, tmp_path):
    """Issue #42: Ctrl-C at any moment of a merge — even as it finishes — raises a
    KeyboardInterrupt that says which happened: nothing written at the output path, or the
    output complete there (and then it verifies). A bare interrupt comes only once the call has
    returned."""
    root, base, agents = demo
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = time.monotonic()
        rlmerge.merge(base, agents, out=tmp_path / "timed", device="cpu")
        span = time.monotonic() - start
        seen = set()
        for i in range(20):
            out = tmp_path / f"m{i}"
            timer = threading.Timer(span * (0.3 + i / 12), os.kill,
                                    (os.getpid(), signal.SIGINT))
            returned = False
            try:
                timer.start()
                rlmerge.merge(base, agents, out=out, device="cpu")
                returned = True
                time.sleep(span * 2)
            except KeyboardInterrupt as e:
                message = str(e)
                if returned:
                    seen.add("after")
                elif "is complete" in message:
                    assert str(out) in message, message
                    assert rlmerge.verify(out)["ok"]
                    seen.add("complete")
                else:
                    assert "nothing was written" in message, repr(message)
                    assert not out.exists()
                    seen.add("stopped")
            finally:
                timer.cancel()
        assert seen, "no interrupt landed"
    finally:
        signal.signal(signal.SIGINT, before)


def test_verify_names_scratch_a_killed_merge_left(demo, tmp_path):
    """Issue #42: scratch that a killed merge left beside a folder is named by verify, with its
    size and how to remove it."""
    root, base, agents = demo
    rlmerge.merge(base, agents, out=tmp_path / "done", device="cpu")
    dead = tmp_path / ".gone.rlmerge-tmp-999999-00000000deadbeef"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 300_000)
    (tmp_path / (dead.name + ".lock")).write_bytes(b"")
    found = rlmerge.verify(tmp_path / "done")
    assert found["ok"]
    assert len(found["notes"]) == 1 and dead.name in found["notes"][0], found["notes"]
    assert "rm -rf" in found["notes"][0] and "kB" in found["notes"][0]


def test_a_mistyped_folder_names_the_folder_meant(demo, tmp_path):
    """Issue #45: a mistyped folder is neither a folder nor a cached Hub id, with the sibling
    folder meant — not a Hub lookup ending in a network error."""
    root, base, agents = demo
    cwd = os.getcwd()
    os.chdir(root.parent)
    try:
        for typo in [f"{root.name}/codng-agent", str(root / "codng-agent")]:
            with pytest.raises(rlmerge.UsageError) as info:
                rlmerge.merge(base, [typo], method="ram", out=tmp_path / "out")
            assert "coding-agent'?" in str(info.value), str(info.value)
            assert "neither a folder nor a" in str(info.value), str(info.value)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "out").exists()


def test_seed_and_dense_agents_from_python(demo, tmp_path):
    """Issue #45: DARE's masks follow ``seed`` from Python as from ``--seed``; the dense-agent
    warning can be silenced by keyword."""
    root, base, agents = demo
    made = {}
    for name, seed in [("a", 1), ("b", 1), ("c", 2)]:
        rlmerge.merge(base, agents, method="dare_ties", weight=1.0, density=0.5, seed=seed,
                      allow_dense_agents=True, out=tmp_path / name, device="cpu")
        made[name] = folder_bytes(tmp_path / name)
    assert made["a"] == made["b"] and made["a"] != made["c"]
    cli = tmp_path / "cli"
    cmd = [cargo_binary(), "merge", "-q", "--device", "cpu", "--method", "dare_ties", "--param",
           "weight=1", "--param", "density=0.5", "--seed", "2", "--base", str(base), "-o", str(cli)]
    for a in agents:
        cmd += ["--model", str(a)]
    subprocess.run(cmd, check=True)
    assert folder_bytes(cli) == made["c"]
    with pytest.raises(rlmerge.UsageError, match="seed"):
        rlmerge.merge(base, agents, method="dare_ties", weight=1.0, seed=-1, out=tmp_path / "d")


def test_config_differences_need_config_from(demo, tmp_path):
    """Issue #44: an agent trained with another norm ε is refused until config_from says
    whose config the merged model takes; the message names the keyword, not a flag."""
    import shutil
    root, base, agents = demo
    long = tmp_path / "long-context"
    shutil.copytree(agents[0], long)
    config = json.loads((long / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config["rms_norm_eps"] != 1e-5 else 1e-6
    (long / "config.json").write_text(json.dumps(config))
    with pytest.raises(rlmerge.UsageError) as info:
        rlmerge.merge(base, [long, agents[1]], out=tmp_path / "out")
    assert "rms_norm_eps" in str(info.value) and "config_from=" in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()
    summary = rlmerge.merge(base, [long, agents[1]], out=tmp_path / "out", config_from=long)
    assert summary["config_from"] == "../long-context"
    merged = json.loads((tmp_path / "out" / "config.json").read_text())
    assert merged["rms_norm_eps"] == config["rms_norm_eps"]


@pytest.mark.parametrize(
    "call, keyword, value",
    [
        ("merge", "allow_dense_agents", "no"),
        ("merge", "allow_nonfinite", "no"),
        ("merge", "allow_missing_tensors", 1),
        ("merge", "raw_f32_agents", "yes"),
        ("merge", "quiet", "false"),
        ("merge", "force", None),
        ("merge", "svc", "0.1"),
        ("merge", "seed", True),
        ("merge", "seed", 1.5),
        ("merge", "shard_size", True),
        ("merge", "out_dtype", 16),
        ("merge", "names", {"a": 1, "b": 2, "c": 3}),
        ("merge", "names", "abc"),
        ("merge", "config_from", 3),
        ("merge", "tokenizer_source", 7),
        ("merge", "tokenizer", ["union"]),
        ("run", "force", "no"),
        ("run", "seed", "7"),
        ("analyze", "per_tensor", "no"),
        ("analyze", "epsilon", "1e-5"),
        ("analyze", "allow_dense_agents", "no"),
        ("verify", "against", "yes"),
    ],
)
def test_every_keyword_is_checked_alike(demo, tmp_path, call, keyword, value):
    """Issue #50 item 6: a keyword of the wrong type — a string for a bool, a bool for a number, a
    dict for a list — is a UsageError naming the keyword, whichever call and keyword, before
    anything is written; no message names the binding's internal structs."""
    root, base, agents = demo
    out = tmp_path / "out"
    recipe = root / "recipe.yml"
    calls = {
        "merge": lambda **k: rlmerge.merge(base, agents, out=out, **k),
        "run": lambda **k: rlmerge.run(recipe, out, **k),
        "analyze": lambda **k: rlmerge.analyze(base, agents, **k),
        "verify": lambda **k: rlmerge.verify(root, **k),
    }
    with pytest.raises(rlmerge.UsageError) as info:
        calls[call](**{keyword: value})
    message = str(info.value)
    assert keyword in message, message
    for internal in ("MergeKeywords", "AnalyzeKeywords", "failed to extract", "TypeError"):
        assert internal not in message, message
    assert not out.exists()


def test_python_merges_are_the_commands_and_their_recipes_remake_them(demo, tmp_path):
    """Issue #50 items 3 and 6: rlmerge.merge(base, models) is `rlmerge merge --base --model`
    (karcher too, whose base gives only the layout), and the recipe it saves, run from another
    folder, makes it again — seed, dtype and shard size included; a keyword given to run()
    replaces the recipe's."""
    root, base, agents = demo
    for method, kwargs, flags in [
        ("karcher", {}, []),
        ("dare_ties", dict(weight=1.0, density=0.5, seed=4, out_dtype="float32", shard_size="200KB"),
         ["--param", "weight=1", "--param", "density=0.5", "--seed", "4", "--out-dtype", "f32",
          "--shard-size", "200KB"]),
    ]:
        api = tmp_path / f"api-{method}"
        rlmerge.merge(base, agents, method=method, out=api, device="cpu", **kwargs)
        cli = tmp_path / f"cli-{method}"
        cmd = [cargo_binary(), "merge", "-q", "--device", "cpu", "--method", method, *flags,
               "--base", str(base), "-o", str(cli)]
        for a in agents:
            cmd += ["--model", str(a)]
        subprocess.run(cmd, check=True)
        assert folder_bytes(api) == folder_bytes(cli), method
        elsewhere = tmp_path / f"elsewhere-{method}"
        elsewhere.mkdir()
        cwd = os.getcwd()
        try:
            os.chdir(elsewhere)
            rlmerge.run(api / "mergekit_config.yml", "again", device="cpu")
        finally:
            os.chdir(cwd)
        assert folder_bytes(elsewhere / "again") == folder_bytes(api), method
    saved = (tmp_path / "api-dare_ties" / "mergekit_config.yml").read_text()
    assert "seed: 4" in saved and "out_dtype: float32" in saved, saved
    other = tmp_path / "other-seed"
    rlmerge.run(tmp_path / "api-dare_ties" / "mergekit_config.yml", other, seed=5, device="cpu")
    assert folder_bytes(other) != folder_bytes(tmp_path / "api-dare_ties")
    assert "seed: 5" in (other / "mergekit_config.yml").read_text()


def test_a_successful_call_prints_no_error_without_xdg_runtime_dir(demo, tmp_path):
    """With XDG_RUNTIME_DIR unset (a headless machine), Mesa's Vulkan drivers, loaded while wgpu
    lists adapters, printed 'error: XDG_RUNTIME_DIR is invalid' twice from a merge that then
    succeeded (issue #53 item 7): neither the API nor the command says 'error:' when it works."""
    root, base, agents = demo
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    code = (f"import rlmerge; rlmerge.merge({str(base)!r}, {[str(a) for a in agents[:2]]!r}, "
            f"method='iso_c', out={str(tmp_path / 'api')!r})")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "error" not in p.stderr.lower(), p.stderr
    p = subprocess.run([pip_command(), "merge", "--base", base, "--model", agents[0], "--model",
                        agents[1], "--method", "iso_c", "-q", "-o", tmp_path / "cli"],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "error" not in p.stderr.lower(), p.stderr
