#!/usr/bin/env python3
"""Developer-side oracle: run a mergekit recipe through mergekit 0.1.5 and through rlmerge, then
compare every output tensor in units of the output dtype's last place (ULP).

Not needed by CI. Set up once:
    python3 -m venv /tmp/mkvenv && /tmp/mkvenv/bin/pip install mergekit==0.1.5
Run (model names in the recipe are folders relative to --models-dir):
    /tmp/mkvenv/bin/python scripts/mergekit_oracle.py tests/fixtures/recipes/ties.yml \
        --models-dir rlmerge-demo --rlmerge target/release/rlmerge
Exit status 1 when any element differs by more than --max-ulp (default 1).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file


def load_folder(path):
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return tensors


def ordered(t):
    """Integers ordered like the floats, adjacent floats one apart."""
    if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
        bits = t.view(torch.int16).to(torch.int64)
        mag = bits & 0x7FFF
        return torch.where(bits < 0, -mag, mag)
    bits = t.to(torch.float32).view(torch.int32).to(torch.int64)
    mag = bits & 0x7FFFFFFF
    return torch.where(bits < 0, -mag, mag)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--models-dir", required=True)
    ap.add_argument("--rlmerge", default="target/release/rlmerge")
    ap.add_argument("--max-ulp", type=int, default=1)
    ap.add_argument("--keep", help="keep both outputs under this folder")
    ap.add_argument(
        "--stable-ties",
        action="store_true",
        help="run mergekit with stable sorts, so equal magnitudes rank by index as rlmerge ranks "
        "them (mergekit's default torch.argsort/torch.sort leave their order unspecified)",
    )
    args = ap.parse_args()
    rlmerge = os.path.abspath(args.rlmerge)
    work = args.keep or tempfile.mkdtemp(prefix="oracle-")
    os.makedirs(work, exist_ok=True)
    # Both tools get one recipe whose model names are absolute folders (mergekit would otherwise
    # look some names up on the Hugging Face hub).
    models_dir = os.path.abspath(args.models_dir)
    text = open(args.recipe).read()
    for name in sorted(os.listdir(models_dir), key=len, reverse=True):
        if os.path.isdir(os.path.join(models_dir, name)):
            text = re.sub(rf"(model: |base_model: ){re.escape(name)}\b", rf"\g<1>{models_dir}/{name}", text)
    recipe = os.path.join(work, os.path.basename(args.recipe))
    with open(recipe, "w") as f:
        f.write(text)
    mk_out, rl_out = os.path.join(work, "mergekit"), os.path.join(work, "rlmerge")
    for d in (mk_out, rl_out):
        shutil.rmtree(d, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.stable_ties:
        patch = (
            "import torch\n"
            "def stable(f):\n"
            "    def g(*a, **k):\n"
            "        k.setdefault('stable', True)\n"
            "        return f(*a, **k)\n"
            "    return g\n"
            "torch.argsort = stable(torch.argsort)\n"
            "torch.sort = stable(torch.sort)\n"
            "from mergekit.scripts.run_yaml import main; main()\n"
        )
        command = [sys.executable, "-c", patch]
    else:
        command = [os.path.join(os.path.dirname(sys.executable), "mergekit-yaml")]
    subprocess.run(command + [recipe, mk_out, "--quiet"], check=True, env=env)
    subprocess.run([rlmerge, "run", recipe, "-o", rl_out, "--device", "cpu", "-q"], check=True)
    mk, rl = load_folder(mk_out), load_folder(rl_out)
    if set(mk) != set(rl):
        print(f"tensor names differ: only mergekit {sorted(set(mk) - set(rl))}, only rlmerge {sorted(set(rl) - set(mk))}")
        return 1
    worst, over, total = 0, 0, 0
    for name in sorted(mk):
        a, b = mk[name], rl[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            print(f"{name}: mergekit {a.dtype} {tuple(a.shape)}, rlmerge {b.dtype} {tuple(b.shape)}")
            return 1
        ulp = (ordered(a) - ordered(b)).abs()
        m = int(ulp.max()) if ulp.numel() else 0
        n_over = int((ulp > args.max_ulp).sum())
        exact = int((ulp == 0).sum())
        total += ulp.numel()
        over += n_over
        worst = max(worst, m)
        flag = "  <-- over" if n_over else ""
        print(f"{name:55s} {str(a.dtype):15s} max {m:3d} ULP, {exact / ulp.numel():7.2%} identical{flag}")
    print(f"\n{os.path.basename(recipe)}: {total} elements, worst {worst} ULP, {over} over {args.max_ulp} ULP")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
