"""Slurm actions: this job's id and requeueing it. Reading the launch layout (Slurm, torchrun, the
DeepSpeed launcher) is lit_dist/launch.py."""

import os
import subprocess


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
