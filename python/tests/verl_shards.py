"""Writes a checkpoint as verl's FSDP trainer writes one, for the tests: a tiny Qwen2 (tied
embeddings) base saved by transformers in bf16; an RL-like agent of it held as fp32 master
weights, sharded by FSDP2 (`fully_shard`) over 2 gloo ranks on the CPU, each rank's state dict of
DTensors saved with torch.save as `actor/model_world_size_2_rank_R.pt` beside `actor/huggingface/`
(the config), as verl's checkpoint manager saves them; and a second agent as a plain Hugging Face
folder.

    python verl_shards.py OUT MESH      # MESH: fsdp, or ddp,fsdp (a 1 x 2 mesh)
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

WORLD = 2


def config():
    return AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                tie_word_embeddings=True)


def rl_like(base, seed):
    """An fp32 copy of `base` with 30 % of each tensor changed, and every master drifted by
    less than a bf16 step (what fp32 masters of an RL run look like)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in base.state_dict().items():
        v = v.float()
        changed = torch.rand(v.shape, generator=g) < 0.3
        step = torch.randn(v.shape, generator=g) * 0.01
        state[k] = v + changed * step + torch.randn(v.shape, generator=g) * 1e-6 * v.abs()
    return state


def shard(rank, out, mesh_dims, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,) if len(mesh_dims) == 1 else (1, WORLD),
                            mesh_dim_names=mesh_dims)
    model = AutoModelForCausalLM.from_config(config()).float()
    model.load_state_dict(torch.load(f"{out}/agent_masters.pt"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.save(model.state_dict(), f"{out}/actor/model_world_size_{WORLD}_rank_{rank}.pt")
    dist.destroy_process_group()


def models_and_port(out):
    """The bf16 base, the RL-like agent's fp32 masters (agent_masters.pt, which the ranks shard)
    and a second agent as a Hugging Face folder, written into `out`; and a free local port for
    the ranks' rendezvous."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config()).to(torch.bfloat16)
    base.save_pretrained(f"{out}/base")
    torch.save(rl_like(base, 1), f"{out}/agent_masters.pt")
    other = AutoModelForCausalLM.from_config(config())
    other.load_state_dict(rl_like(base, 2))
    other.to(torch.bfloat16).save_pretrained(f"{out}/other")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out, mesh_dims):
    os.makedirs(f"{out}/actor/huggingface", exist_ok=True)
    port = models_and_port(out)
    config().save_pretrained(f"{out}/actor/huggingface")
    mp.spawn(shard, args=(out, mesh_dims, port), nprocs=WORLD)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2].split(",")))
