"""Slurm: check the allocation against the config before any process group starts, and requeue.

A multi-node start where ``--ntasks-per-node`` differs from ``trainer.devices``, or the node
count from ``trainer.num_nodes``, waits for ranks that never come (Lightning #8707, #10098): on
GPUs it hangs until the collective timeout. The values are all in the environment of every task,
so the check needs no communication and fails in seconds.
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


def check_allocation(trainer: dict, environ: dict | None = None) -> list[str]:
    """Fill ``num_nodes`` and ``devices`` from the allocation where the config leaves them at their
    defaults; return what the lines to set them say (empty outside Slurm). Raise ConfigError when
    the config and the allocation disagree, naming both values and the fix."""
    env = os.environ if environ is None else environ
    if not in_slurm_step(env):
        return []
    per_node = tasks_per_node(env)
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    problems, filled = [], []
    if len(set(per_node)) > 1:
        problems.append(f"the Slurm allocation has unequal tasks per node ({env.get('SLURM_TASKS_PER_NODE')}); every "
                        "node must run the same number of tasks (one per GPU), so ask for "
                        "--nodes=N --ntasks-per-node=G with the same G GPUs on every node")
    tasks = per_node[0] if per_node else int(env.get("SLURM_NTASKS", 1)) // max(nodes, 1)
    devices = trainer.get("devices", "auto")
    if devices in (None, "auto"):
        trainer["devices"] = tasks
        filled.append(f"trainer.devices {tasks} (Slurm tasks per node)")
    elif _count(devices) != tasks:
        problems.append(f"trainer.devices: {devices} but Slurm runs {tasks} tasks per node (--ntasks-per-node); "
                        f"they must be equal: set trainer.devices: {tasks}, or submit with --ntasks-per-node={_count(devices)}")
    num_nodes = trainer.get("num_nodes", 1)
    if num_nodes in (None, 1) and nodes != 1:
        trainer["num_nodes"] = nodes
        filled.append(f"trainer.num_nodes {nodes} (Slurm nodes)")
    elif num_nodes not in (None, 1) and num_nodes != nodes:
        problems.append(f"trainer.num_nodes: {num_nodes} but the Slurm job step has {nodes} nodes; set "
                        f"trainer.num_nodes: {nodes}, or submit with --nodes={num_nodes}")
    ConfigError.collect(problems)
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
