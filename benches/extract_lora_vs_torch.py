#!/usr/bin/env python3
"""mergekit-extract-lora's arithmetic in torch, timed on the same CPU as `rlmerge extract-lora`.

    benches/extract_lora_vs_torch.py BASE_DIR MODEL_DIR RANK [THREADS]

For every 2-D tensor of BASE_DIR's model.safetensors but the input embeddings (which mergekit
saves whole by default), the update Δ = model − base in f32 and its rank-RANK factors from a full
`torch.linalg.svd` (mergekit's `low_rank_decomposition`), as mergekit-extract-lora computes
them, one matrix at a time; prints the time, peak RSS and, per module, ‖Δ_r‖/‖Δ‖. Needs torch and
safetensors. It stands in for mergekit itself where mergekit is not installed: the SVDs are its
time.
"""
import resource
import sys
import time

import torch
from safetensors import safe_open


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__.strip().splitlines()[2].strip())
    base, model, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if len(sys.argv) == 5:
        torch.set_num_threads(int(sys.argv[4]))
    start = time.time()
    kept = []
    with safe_open(f"{base}/model.safetensors", "pt") as b, safe_open(f"{model}/model.safetensors", "pt") as m:
        for name in b.keys():
            t = b.get_tensor(name)
            if t.dim() != 2 or name.endswith("embed_tokens.weight"):
                continue
            delta = m.get_tensor(name).float() - t.float()
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)
            r = min(rank, s.numel())
            root = torch.sqrt(s[:r])
            lora_a = root[:, None] * vh[:r]
            lora_b = u[:, :r] * root[None, :]
            kept.append((name, float(torch.sqrt((s[:r] ** 2).sum() / (s ** 2).sum()))))
            del u, s, vh, lora_a, lora_b
    seconds = time.time() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch full SVDs: {len(kept)} matrices, {seconds:.1f} s, peak RSS {rss:.0f} MB")
    for name, k in kept:
        print(f"  kept {100 * k:6.2f} %  {name}")


if __name__ == "__main__":
    main()
