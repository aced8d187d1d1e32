#!/usr/bin/env python3
"""The spectral methods at 7B scale, rlmerge against the same rules in torch (issue #43).

    benches/spectral_vs_torch.py RLMERGE DIR [THREADS=2] [METHODS=iso_c,tsv,svc]

Writes, once, a slice of a Llama-2-7B model into DIR — one 4096 × 4096 attention projection and
one 11008 × 4096 MLP projection, each a base and 3 sparse RL-like agents (bf16; each agent moves
5 %, 25 % and 50 % of the elements by 1-4 bf16 steps, as RL fine-tuning does) — then for each
method, side by side:

- rlmerge (the binary RLMERGE, `--device cpu --threads THREADS`): wall time, peak RSS, and any
  warning that a matrix fell back to the elementwise rule;
- the FusionBench code path in torch f32 on THREADS threads (`torch.linalg.svd`, full_matrices
  False): Iso-C's one SVD of the summed task vectors, TSV-M's T + 2 SVDs, SVC's SVD of task
  arithmetic's sum and its projections — loading included, as its scripts load;
- how far apart the two updates are: ‖Δ_rlmerge − Δ_torch‖_F / ‖Δ_torch‖_F, both after the
  output's bf16 rounding.

Each matrix is merged on its own, so the 7B estimate (32 layers of 4 attention and 3 MLP
projections, and the 32000 × 4096 embeddings and head, scaled from the MLP matrix by their rows)
comes from measured parts. Needs numpy and torch (the bench's own environment, not rlmerge's).
"""
import json
import os
import resource
import struct
import subprocess
import sys
import time

import numpy as np
import torch

MATRICES = {
    "attn": ("model.layers.0.self_attn.q_proj.weight", (4096, 4096)),
    "mlp": ("model.layers.0.mlp.up_proj.weight", (11008, 4096)),
}
DENSITIES = (0.05, 0.25, 0.50)
AGENTS = ("agent-1", "agent-2", "agent-3")
SVC_ALPHA = 0.1
METHODS = {
    "iso_c": ["--method", "iso_c"],
    "tsv": ["--method", "tsv"],
    "svc": ["--method", "task_arithmetic", "--param", "weight=1", "--svc", str(SVC_ALPHA)],
}


def write_model(folder, name, bits):
    """A model folder holding one bf16 tensor `name` (uint16 bits), with a Llama config."""
    os.makedirs(folder, exist_ok=True)
    header = {name: {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [0, bits.nbytes]}}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.write(bits.astype("<u2").tobytes())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 1,
              "vocab_size": 32000, "torch_dtype": "bfloat16"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def read_tensor(folder):
    """The one tensor of a folder rlmerge wrote (or this script), as float32."""
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        (name, entry), = [(k, v) for k, v in header.items() if k != "__metadata__"]
        start, end = entry["data_offsets"]
        f.seek(8 + size + start)
        bits = np.frombuffer(f.read(end - start), dtype="<u2").reshape(entry["shape"])
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_bits(values):
    """float32 values rounded to bf16 (nearest, ties to even), as uint16 bits."""
    x = values.astype(np.float32).view(np.uint32)
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)


def write_slice(root):
    rng = np.random.default_rng(43)
    for key, (name, shape) in MATRICES.items():
        base = bf16_bits(rng.standard_normal(shape, dtype=np.float32) * 0.02)
        write_model(os.path.join(root, key, "base"), name, base)
        for agent, density in zip(AGENTS, DENSITIES):
            # Steps of the bits move a value by 1-4 units in its last place; zeros (and the
            # subnormals beside them) stay, so no step crosses zero into a NaN's bits.
            moved = (rng.random(shape, dtype=np.float32) < density) & ((base & 0x7FFF) >= 8)
            steps = rng.integers(1, 5, shape).astype(np.int32)
            signs = np.where(rng.random(shape, dtype=np.float32) < 0.5, -1, 1).astype(np.int32)
            bits = base.astype(np.int32) + np.where(moved, steps * signs, 0)
            write_model(os.path.join(root, key, agent), name, bits.astype(np.uint16))
    with open(os.path.join(root, ".written"), "w") as f:
        f.write("ok\n")


def run_rlmerge(binary, folder, out, args, threads):
    """Wall time, peak RSS (bytes) and stderr of one merge, run through a wrapper process so the
    RSS is that merge's alone."""
    cmd = [binary, "merge", "-q", "--device", "cpu", "--threads", str(threads), "--force",
           "--base", os.path.join(folder, "base")]
    for agent in AGENTS:
        cmd += ["--model", os.path.join(folder, agent)]
    cmd += ["-o", out] + args
    wrapper = ("import resource, subprocess, sys, time, json\n"
               "t = time.monotonic()\n"
               "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
               "print(json.dumps([time.monotonic() - t, "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, r.returncode, "
               "r.stderr]))\n")
    done = subprocess.run([sys.executable, "-c", wrapper] + cmd, capture_output=True, text=True,
                          check=True)
    seconds, rss, code, stderr = json.loads(done.stdout)
    if code != 0:
        sys.exit(f"rlmerge failed ({code}): {stderr}")
    return seconds, rss, stderr


def torch_update(method, taus):
    """FusionBench's rule for `method` over task vectors `taus` (torch f32 matrices)."""
    svd = lambda x: torch.linalg.svd(x, full_matrices=False)
    if method == "iso_c":
        u, s, vh = svd(sum(taus))
        return s.mean() * (u @ vh)
    if method == "tsv":
        k = min(taus[0].shape) // len(taus)
        us, ss, vs = [], [], []
        for tau in taus:
            u, s, vh = svd(tau)
            us.append(u[:, :k])
            ss.append(s[:k])
            vs.append(vh[:k, :])
        u_u, _, vh_u = svd(torch.cat(us, dim=1))
        u_v, _, vh_v = svd(torch.cat(vs, dim=0))
        return torch.linalg.multi_dot((u_u, vh_u, torch.diag(torch.cat(ss)), u_v, vh_v))
    merged = sum(taus)  # task_arithmetic, weights 1, then SVC
    u, s, vh = svd(merged)
    total = torch.zeros_like(s)
    for tau in taus:
        a = u.T @ tau  # row r: model t's response along u_r
        norm2 = (a * a).sum(dim=1)
        coef = (s[:, None] * vh * a).sum(dim=1) / norm2
        total += torch.where(norm2 > 0, coef.clamp(min=SVC_ALPHA), torch.full_like(s, SVC_ALPHA))
    gamma = len(taus) / total
    return u @ torch.diag(gamma * s) @ vh


def torch_run(method, folder):
    """Seconds (loading included) and the merged tensor rounded to bf16, as float32."""
    start = time.monotonic()
    base = torch.from_numpy(read_tensor(os.path.join(folder, "base")))
    taus = [torch.from_numpy(read_tensor(os.path.join(folder, a))) - base for a in AGENTS]
    merged = base + torch_update(method, taus)
    seconds = time.monotonic() - start
    rounded = (bf16_bits(merged.numpy()).astype(np.uint32) << 16).view(np.float32)
    return seconds, rounded


def main():
    if not 3 <= len(sys.argv) <= 5:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    binary, root = sys.argv[1], sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    methods = sys.argv[4].split(",") if len(sys.argv) > 4 else list(METHODS)
    if unknown := [m for m in methods if m not in METHODS]:
        sys.exit(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if not os.path.exists(os.path.join(root, ".written")):
        print(f"writing the 7B slice into {root} …", flush=True)
        write_slice(root)
    torch.set_num_threads(threads)
    print(f"threads {threads}, torch {torch.__version__}; times in s, RSS in MB", flush=True)
    print("| method | matrix | rlmerge | torch | rlmerge / torch | update vs torch | peak RSS | "
          "fallback |")
    print("|---|---|---|---|---|---|---|---|")
    totals = {}
    for method in methods:
        for key in MATRICES:
            folder = os.path.join(root, key)
            out = os.path.join(root, f"out-{method}-{key}")
            ours, rss, stderr = run_rlmerge(binary, folder, out, METHODS[method], threads)
            theirs, reference = torch_run(method, folder)
            base = read_tensor(os.path.join(folder, "base"))
            got = read_tensor(out) - base
            want = reference - base
            gap = float(np.linalg.norm((got - want).astype(np.float64)) /
                        np.linalg.norm(want.astype(np.float64)))
            fallback = "yes" if "elementwise rule" in stderr else "no"
            totals.setdefault(method, {})[key] = (ours, theirs)
            print(f"| {method} | {key} {MATRICES[key][1][0]}×{MATRICES[key][1][1]} | {ours:.1f} | "
                  f"{theirs:.1f} | {ours / theirs:.2f} | {gap:.1e} | {rss / 1e6:.0f} | "
                  f"{fallback} |", flush=True)
    print()
    for method, parts in totals.items():
        ours = sum(o for o, _ in parts.values())
        theirs = sum(t for _, t in parts.values())
        line = f"{method}: slice {ours:.1f} s against torch's {theirs:.1f} s ({ours / theirs:.2f}×)"
        if set(parts) == set(MATRICES):
            attn, mlp = parts["attn"][0], parts["mlp"][0]
            embed = mlp * 32000 / 11008
            line += f"; a 7B model, estimated: {(32 * (4 * attn + 3 * mlp) + 2 * embed) / 3600:.1f} h"
        print(line)


if __name__ == "__main__":
    main()
