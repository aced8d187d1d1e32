"""README.md's and docs/'s Python examples run as written on the demo (issue #26): every ``python`` block, and
every ``python -c`` line of its ``sh`` blocks, with the installed package, in a folder holding
``rlmerge-demo/`` (what ``rlmerge demo`` writes). tests/readme.rs runs the command-line ones."""

import os
import pathlib
import re
import shlex
import subprocess
import sys

from conftest import pip_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
# README.md and every page under docs/ (issue #45).
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def blocks():
    """The fenced blocks of README and the docs pages as (info string, body)."""
    found, info, body = [], None, []
    lines = [line for page in PAGES for line in page.read_text(encoding="utf-8").splitlines()]
    for line in lines:
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                found.append((info, "\n".join(body) + "\n"))
                info = None
        elif info is not None:
            body.append(line)
    return found


def examples():
    """The Python code README gives: each python block, and each `python -c` line's code."""
    code = []
    for info, body in blocks():
        if info == "python":
            code.append(body)
        elif info == "sh":
            for line in body.splitlines():
                line = re.sub(r"\s{2,}#.*$", "", line).strip()
                if line.startswith(("python -c ", "python3 -c ")):
                    code.append(shlex.split(line)[2])
    return code


def test_every_readme_python_example_runs_on_the_demo(tmp_path):
    subprocess.run([pip_command(), "demo", "rlmerge-demo", "--write-only", "--quiet"],
                   cwd=tmp_path, check=True)
    code = examples()
    assert len(code) >= 2, "README's Python examples were not found"
    for n, source in enumerate(code):
        done = subprocess.run([sys.executable, "-c", source], cwd=tmp_path,
                              capture_output=True, text=True, env={**os.environ,
                                                                   "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, f"README example {n} failed:\n{source}\n{done.stderr}"


def test_the_demo_tokenizer_encodes_and_decodes_text(tmp_path):
    """The demo ships a real byte-level BPE: the official tokenizers library loads it, encodes
    text into known tokens and decodes it back."""
    tokenizers = __import__("pytest").importorskip("tokenizers")
    subprocess.run([pip_command(), "demo", str(tmp_path / "d"), "--write-only", "--quiet"],
                   check=True)
    for model in ("base", "coding-agent"):
        tok = tokenizers.Tokenizer.from_file(str(tmp_path / "d" / model / "tokenizer.json"))
        for text in ["hello world", "The merged model writes code: print(\"hi\") # 42\n\té 中"]:
            encoding = tok.encode(text)
            assert encoding.ids and 0 not in encoding.ids, encoding.tokens  # 0: <unk>
            assert tok.decode(encoding.ids) == text
        assert len(tok.encode("the agents merge").ids) < len("the agents merge")
        assert tok.token_to_id("</s>") == 2
