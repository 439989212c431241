"""Slurm (and torchrun): check the launch against the config before any process group starts; requeue.

A multi-node start where ``--ntasks-per-node`` differs from ``trainer.devices``, or the node
count from ``trainer.num_nodes``, waits for ranks that never come (Lightning #8707, #10098): on
GPUs it hangs until the collective timeout. Under torchrun, a config left at one node trains one
independent copy per node. The values are all in the environment of every process, so the check
needs no communication and fails in seconds.
"""

import os
import re
import subprocess

from lit_dist.errors import ConfigError


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


def launcher_layout(environ: dict) -> tuple[str, int, list[int]] | None:
    """(launcher, nodes, processes per node) from the environment Slurm, the DeepSpeed launcher or torchrun
    gives each process; None without one of them."""
    if in_slurm_step(environ):
        per_node = tasks_per_node(environ)
        nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
        return "Slurm", nodes, per_node or [int(environ.get("SLURM_NTASKS", 1)) // max(nodes, 1)]
    if environ.get("CROSS_SIZE") and environ.get("LOCAL_SIZE") and environ.get("LOCAL_RANK") is not None:
        nodes = int(environ["CROSS_SIZE"])
        return "DeepSpeed launcher", nodes, [int(environ["LOCAL_SIZE"])] * nodes
    if environ.get("LOCAL_WORLD_SIZE") and environ.get("WORLD_SIZE") and environ.get("GROUP_RANK") is not None:
        local, world = int(environ["LOCAL_WORLD_SIZE"]), int(environ["WORLD_SIZE"])
        return "torchrun", max(world // local, 1), [local] * max(world // local, 1)
    return None


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


def _count(devices) -> int:
    """How many devices a Trainer ``devices`` value means (an int, '2', or a list of indices)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return int(devices)


def job_id(environ: dict | None = None) -> str | None:
    """The id ``scontrol requeue`` takes: ARRAYJOB_TASK for an array task, else the job id."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def requeue(timeout_s: float = 30) -> str:
    """Requeue this job (array-aware) with ``scontrol requeue``; returns what happened, for the log."""
    job = job_id()
    if job is None:
        return "not a Slurm job: nothing to requeue"
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed: {exc}"
    if out.returncode != 0:
        return f"scontrol requeue {job} failed: {(out.stderr or out.stdout).strip()}"
    return f"job {job} requeued"
