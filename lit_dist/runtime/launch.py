"""The launch topology, read in one place: how many processes on how many nodes, and who started them.

Slurm (``srun``, the batch step), torchrun and the DeepSpeed launcher each put the layout in the
environment of every process. ``lit-dist plan`` reads it to size a run (``world_size``); ``fit`` and
the other commands check it against the config before any process group starts
(``apply_launch_layout``), and commands without a Trainer join the launched processes through
``launcher_environment``. The Slurm actions (job id, requeue) are in lit_dist/runtime/slurm.py.

A multi-node start where ``--ntasks-per-node`` differs from ``trainer.devices``, or the node
count from ``trainer.num_nodes``, waits for ranks that never come (Lightning #8707, #10098): on
GPUs it hangs until the collective timeout. Under torchrun, a config left at one node trains one
independent copy per node. The values are all in the environment of every process, so the check
needs no communication and fails in seconds.
"""

import os
import re

from lit_dist.errors import ConfigError


def in_slurm_job(environ: dict | None = None) -> bool:
    """Whether this process runs inside a Slurm job (an allocation, a batch script or a job step)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID"))


def in_slurm_step(environ: dict | None = None) -> bool:
    """Whether this process is a task of a Slurm job step (started by srun, or the batch step)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_NTASKS")) and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def tasks_per_node(environ: dict) -> list[int]:
    """Tasks on each node of the step, from SLURM_TASKS_PER_NODE (e.g. '2(x3),1' -> [2, 2, 2, 1])."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    counts = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_layout(environ: dict) -> tuple[int, list[int]] | None:
    """(nodes, tasks on each node) of this Slurm job step, or of the job's allocation when read outside a
    step (an ``salloc`` shell); None outside a Slurm job."""
    if not in_slurm_job(environ):
        return None
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
    per_node = tasks_per_node(environ)
    if not per_node and environ.get("SLURM_NTASKS_PER_NODE"):
        per_node = [int(environ["SLURM_NTASKS_PER_NODE"].split("(")[0])] * nodes
    return nodes, per_node or [max(int(environ.get("SLURM_NTASKS", 1)) // max(nodes, 1), 1)]


def launcher_layout(environ: dict) -> tuple[str, int, list[int]] | None:
    """(launcher, nodes, processes per node) from the environment Slurm, the DeepSpeed launcher or torchrun
    gives each process; None without one of them."""
    if in_slurm_step(environ):
        return "Slurm", *slurm_layout(environ)
    if environ.get("CROSS_SIZE") and environ.get("LOCAL_SIZE") and environ.get("LOCAL_RANK") is not None:
        nodes = int(environ["CROSS_SIZE"])
        return "DeepSpeed launcher", nodes, [int(environ["LOCAL_SIZE"])] * nodes
    if environ.get("LOCAL_WORLD_SIZE") and environ.get("WORLD_SIZE") and environ.get("GROUP_RANK") is not None:
        local, world = int(environ["LOCAL_WORLD_SIZE"]), int(environ["WORLD_SIZE"])
        return "torchrun", max(world // local, 1), [local] * max(world // local, 1)
    return None


def world_size(trainer_config, environ: dict | None = None) -> tuple[int, int, int]:
    """(world size, devices per node, nodes) a run will have: from the trainer config, else the launcher's
    layout or the Slurm allocation this runs in, else this machine."""
    env = os.environ if environ is None else environ
    layout = launcher_layout(env)
    if layout is None and (allocation := slurm_layout(env)):  # planning from an salloc shell or a batch script
        layout = ("Slurm", *allocation)
    devices = trainer_config.devices
    if isinstance(devices, (list, tuple)):
        per_node = len(devices)
    elif isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        per_node = int(devices)
    elif isinstance(devices, int):
        per_node = devices
    else:
        per_node = -1
    if per_node == -1:  # "auto" or -1: the launcher or allocation says, else what this machine has
        if layout is not None:
            per_node = layout[2][0]
        else:
            import torch

            accelerator = str(trainer_config.accelerator)
            per_node = torch.cuda.device_count() if accelerator in ("auto", "gpu", "cuda") else 1
            per_node = max(per_node, 1)
    nodes = int(trainer_config.num_nodes or 1)
    if nodes == 1 and layout is not None:
        nodes = layout[1]
    return per_node * nodes, per_node, nodes


_HOW = {"Slurm": ("tasks per node", "--ntasks-per-node", "the Slurm job step has", "submit with --nodes="),
        "torchrun": ("processes per node", "--nproc-per-node", "torchrun runs on", "start torchrun with --nnodes="),
        "DeepSpeed launcher": ("processes per node", "--num_gpus", "the DeepSpeed launcher runs on",
                               "start it with --num_nodes=")}


def check_allocation(trainer: dict, environ: dict | None = None) -> list[str]:
    """Fill ``num_nodes`` and ``devices`` from Slurm's or torchrun's layout where the config leaves them
    at their defaults; return what was filled (empty without a launcher). Raise ConfigError when the
    config and the layout disagree, naming both values and the fix."""
    env = os.environ if environ is None else environ
    layout = launcher_layout(env)
    if layout is None:
        return []
    launcher, nodes, per_node = layout
    per, flag, has, resubmit = _HOW[launcher]
    problems, filled = [], []
    if len(set(per_node)) > 1:
        problems.append(f"the Slurm allocation has unequal tasks per node ({env.get('SLURM_TASKS_PER_NODE')}); every "
                        "node must run the same number of tasks (one per GPU), so ask for "
                        "--nodes=N --ntasks-per-node=G with the same G GPUs on every node")
    tasks = per_node[0]
    devices = trainer.get("devices", "auto")
    if devices in (None, "auto"):
        trainer["devices"] = tasks
        filled.append(f"trainer.devices {tasks} ({launcher} {per})")
    elif _count(devices) != tasks:
        problems.append(f"trainer.devices: {devices} but {launcher} runs {tasks} {per} ({flag}); they must be equal: "
                        f"set trainer.devices: {tasks}, or start with {flag}={_count(devices)}")
    num_nodes = trainer.get("num_nodes", 1)
    if num_nodes in (None, 1) and nodes != 1:
        trainer["num_nodes"] = nodes
        filled.append(f"trainer.num_nodes {nodes} ({launcher} nodes)")
    elif num_nodes not in (None, 1) and num_nodes != nodes:
        problems.append(f"trainer.num_nodes: {num_nodes} but {has} {nodes} nodes; set trainer.num_nodes: {nodes}, "
                        f"or {resubmit}{num_nodes}")
    ConfigError.collect(problems)
    return filled


def apply_launch_layout(trainer) -> list[str]:
    """check_allocation, plus what the launchers need of the config: the DeepSpeed launcher's node rank
    under the name Lightning reads, and under Slurm Lightning's auto_requeue off (it saves inside the
    signal handler, which can hang; the Preemption callback does it instead)."""
    from jsonargparse import Namespace

    if os.environ.get("CROSS_RANK") and "NODE_RANK" not in os.environ:
        os.environ["NODE_RANK"] = os.environ["CROSS_RANK"]
    filled = check_allocation(trainer)
    if in_slurm_step():
        plugins = trainer.plugins
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
        if not any("Environment" in str(getattr(p, "class_path", "")) for p in plugins):
            plugins.append(Namespace(class_path="lightning.pytorch.plugins.environments.SLURMEnvironment",
                                     init_args=Namespace(auto_requeue=False)))
        trainer.plugins = plugins
    return filled


def launcher_environment():
    """Lightning's cluster environment of the launcher that started this process (torchrun, srun), or None
    when it was started alone. Inside a Trainer Lightning picks it itself; commands without one ask here."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    # torchrun first: started inside an srun task, its own RANK and WORLD_SIZE are the ones that count.
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if in_slurm_step():
        return SLURMEnvironment(auto_requeue=False)
    return None


def _count(devices) -> int:
    """How many devices a Trainer ``devices`` value means (an int, '2', or a list of indices)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return int(devices)
