"""The world size a run config asks for (``lit-dist plan`` is lit_dist/commands/plan.py)."""

import os


def world_size(trainer_config, environ: dict | None = None) -> tuple[int, int, int]:
    """(world size, devices per node, nodes) from the trainer config, else the Slurm allocation, else this machine."""
    env = os.environ if environ is None else environ
    devices = trainer_config.devices
    if isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        per_node = int(devices)
    elif isinstance(devices, int):
        per_node = devices
    else:
        per_node = -1
    if per_node == -1:  # "auto" or -1: the allocation says, else what this machine has
        if env.get("SLURM_NTASKS_PER_NODE"):
            per_node = int(env["SLURM_NTASKS_PER_NODE"].split("(")[0])
        else:
            import torch

            accelerator = str(trainer_config.accelerator)
            per_node = torch.cuda.device_count() if accelerator in ("auto", "gpu", "cuda") else 1
            per_node = max(per_node, 1)
    nodes = int(trainer_config.num_nodes or 1)
    if nodes == 1 and env.get("SLURM_NNODES"):
        nodes = int(env["SLURM_NNODES"])
    return per_node * nodes, per_node, nodes
