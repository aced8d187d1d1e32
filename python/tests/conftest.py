import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pip_command() -> str:
    """The `rlmerge` command pip installed beside this interpreter."""
    here = Path(sys.executable).parent / "rlmerge"
    found = str(here) if here.exists() else shutil.which("rlmerge")
    assert found, "the rlmerge command is not installed (pip install .)"
    return found


def cargo_binary() -> str:
    """The binary cargo built: $RLMERGE_BIN, else target/release or target/debug."""
    env = os.environ.get("RLMERGE_BIN")
    candidates = [Path(env)] if env else [REPO / "target" / p / "rlmerge" for p in ("release", "debug")]
    for c in candidates:
        if c.exists():
            return str(c)
    raise AssertionError(f"no cargo-built rlmerge binary at {candidates}; run cargo build or set RLMERGE_BIN")


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The built-in example (base + 3 agents), written by the pip-installed command."""
    root = tmp_path_factory.mktemp("demo")
    subprocess.run([pip_command(), "demo", str(root), "--write-only", "--quiet"], check=True)
    agents = [root / a for a in ("coding-agent", "tool-agent", "memory-agent")]
    return root, root / "base", agents
