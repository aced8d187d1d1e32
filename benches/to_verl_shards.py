#!/usr/bin/env python3
"""Saves a safetensors model folder as verl's FSDP trainer saves an actor: its weights as fp32
master weights, each tensor a DTensor cut Shard(0) over 2 gloo ranks (torch's
`distribute_tensor` on a ("fsdp",) mesh, as FSDP2 cuts them), one torch.save per rank
(`model_world_size_2_rank_R.pt`), the config and tokenizer in `huggingface/`. Needs torch and
safetensors (benches/end_to_end.sh with BENCH_SET=verl runs it with $BENCH_PYTHON).

    benches/to_verl_shards.py SRC DST
"""
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def save_rank(rank, src, dst, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    state = {}
    for shard in sorted(Path(src).glob("*.safetensors")):
        for name, t in load_file(shard).items():
            state[name] = distribute_tensor(t.float(), mesh, [Shard(0)])
    torch.save(state, Path(dst) / f"model_world_size_{WORLD}_rank_{rank}.pt")
    dist.destroy_process_group()


def main(src: Path, dst: Path) -> None:
    hf = dst / "huggingface"
    hf.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, hf / f.name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(save_rank, args=(str(src), str(dst), port), nprocs=WORLD)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
