"""Hub ids downloaded through HF_ENDPOINT from a local server speaking the Hub's file API (checked
with the official huggingface_hub client against the same server): the files a merge needs land
in the standard cache layout, give the bytes of the same merge from folders, send HF_TOKEN, and
serve later merges offline; a cache the Python client wrote serves rlmerge as it is."""

import os
import subprocess

import pytest

from conftest import cargo_binary, pip_command
from hub_server import HubServer, Repo

import huggingface_hub  # noqa: E402  (scripts/test-all installs it)

COMMITS = {"org/base": "a" * 40, "org/coder": "b" * 40, "team/tools": "c" * 40}


def repos(demo):
    root, base, agents = demo
    junk = {"pytorch_model.bin": b"not needed", "README.md": b"# card", ".gitattributes": b"*"}
    return {
        "org/base": Repo(base, COMMITS["org/base"], extra_files=junk),
        "org/coder": Repo(agents[0], COMMITS["org/coder"], branches=("main", "v1")),
        "team/tools": Repo(agents[1], COMMITS["team/tools"]),
    }


def folder_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix == ".safetensors"}


def merge(binary, out, base, models, env):
    cmd = [binary, "merge", "-q", "--method", "ram+", "--base", str(base), "-o", str(out)]
    for m in models:
        cmd += ["--model", str(m)]
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full.update(env)
    return subprocess.run(cmd, env=full, capture_output=True, text=True)


def test_the_server_speaks_the_hub_protocol_to_the_official_client(demo, tmp_path):
    root, base, agents = demo
    with HubServer(repos(demo)) as hub:
        path = huggingface_hub.snapshot_download(
            "org/coder", revision="v1", endpoint=hub.url, cache_dir=str(tmp_path / "py-cache"),
            token=False)
    assert path.endswith(os.path.join("models--org--coder", "snapshots", COMMITS["org/coder"]))
    for f in agents[0].iterdir():
        assert (tmp_path / "py-cache").joinpath(
            "models--org--coder", "snapshots", COMMITS["org/coder"], f.name).read_bytes() == f.read_bytes()
    assert (tmp_path / "py-cache" / "models--org--coder" / "refs" / "v1").read_text() == COMMITS["org/coder"]


def test_ids_download_what_a_merge_needs_into_the_cache(demo, tmp_path):
    root, base, agents = demo
    want = tmp_path / "from-folders"
    assert merge(cargo_binary(), want, base, agents[:2], {}).returncode == 0
    cache = tmp_path / "cache"
    with HubServer(repos(demo)) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "hf_secret"}
        done = merge(pip_command(), tmp_path / "online", "org/base", ["org/coder@v1", "team/tools"], env)
        assert done.returncode == 0, done.stderr
        assert any(auth == "Bearer hf_secret" for _, _, auth in hub.requests), hub.requests
        # Only weights, index, config, tokenizer and generation files were fetched.
        fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
        assert "pytorch_model.bin" not in fetched and "README.md" not in fetched, fetched
        # An id the server does not have: exit 1 naming it.
        missing = merge(pip_command(), tmp_path / "x", "org/base", ["org/ghost"], env)
        assert missing.returncode == 1 and "org/ghost" in missing.stderr, missing.stderr
        assert not (tmp_path / "x").exists()
    assert folder_bytes(tmp_path / "online") == folder_bytes(want)
    snapshot = cache / "models--org--base" / "snapshots" / COMMITS["org/base"]
    assert (snapshot / "model.safetensors").is_symlink() or (snapshot / "model.safetensors").is_file()
    assert not (snapshot / "pytorch_model.bin").exists()
    assert (cache / "models--org--coder" / "refs" / "v1").read_text().strip() == COMMITS["org/coder"]
    # The server is gone: offline, the same ids come from the cache.
    again = merge(cargo_binary(), tmp_path / "offline", "org/base", ["org/coder@v1", "team/tools"],
                  {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert again.returncode == 0, again.stderr
    assert folder_bytes(tmp_path / "offline") == folder_bytes(want)


def test_a_cache_written_by_the_official_client_serves_rlmerge_offline(demo, tmp_path):
    root, base, agents = demo
    want = tmp_path / "from-folders"
    assert merge(cargo_binary(), want, base, agents[:2], {}).returncode == 0
    cache = tmp_path / "py-cache"
    with HubServer(repos(demo)) as hub:
        for repo in ("org/base", "org/coder", "team/tools"):
            huggingface_hub.snapshot_download(repo, endpoint=hub.url, cache_dir=str(cache), token=False)
    done = merge(pip_command(), tmp_path / "out", "org/base", ["org/coder", "team/tools"],
                 {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert folder_bytes(tmp_path / "out") == folder_bytes(want)
