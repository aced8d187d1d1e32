"""Writes a torch Distributed Checkpoint (DCP) as FSDP trainers save one, for the tests: the
tiny tied-embedding Qwen2 base and agents of verl_shards.py, the RL-like agent's fp32 masters
sharded by FSDP2 (`fully_shard`) over 2 gloo ranks on the CPU and saved with
`torch.distributed.checkpoint.save` as accelerate and NeMo-RL save them — `{"model": state dict}`,
and with `optim` beside it the optimizer's state (Adam after one step) — into `dcp/` (the
`.metadata` and each rank's `__R_0.distcp`), with the model's config.json copied in.

    python dcp_shards.py OUT [optim]
"""

import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from verl_shards import WORLD, config, models_and_port


def shard(rank, out, port, optim):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    model = AutoModelForCausalLM.from_config(config()).float()
    model.load_state_dict(torch.load(f"{out}/agent_masters.pt"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": get_model_state_dict(model)}
    if optim:
        opt = torch.optim.Adam(model.parameters(), lr=1e-9)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        opt.step()
        # The masters as they were saved: the optimizer moved them by far below a bf16 step.
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=f"{out}/dcp")
    dist.destroy_process_group()


def main(out, optim):
    port = models_and_port(out)
    mp.spawn(shard, args=(out, port, optim), nprocs=WORLD)
    shutil.copy(f"{out}/base/config.json", f"{out}/dcp/config.json")


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "optim")
