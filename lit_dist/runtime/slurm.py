"""Slurm actions: this job's id and requeueing it. Reading the launch layout (Slurm, torchrun, the
DeepSpeed launcher) is lit_dist/runtime/launch.py."""

import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterable

# What "stop soon" is to lit-dist by default: Slurm's warning before a time limit or preemption (--signal), and
# the SIGTERM of a preemption, scancel or Kubernetes. The training process acts on them; its helpers ignore them.
STOP_SIGNALS = ("SIGUSR1", "SIGTERM")


def job_id(environ: dict | None = None) -> str | None:
    """The id ``scontrol requeue`` takes: ARRAYJOB_TASK for an array task, else the job id."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def excluding(setting: bool | None) -> bool:
    """Whether a component's ``exclude_node`` setting (None: in a Slurm job) means excluding nodes here."""
    return bool(setting) if setting is not None else job_id() is not None


def check_exclusion(field: str, setting: bool | None) -> None:
    """Excluding nodes was asked for explicitly but this is no Slurm job: a configuration error."""
    if setting and job_id() is None:
        from lit_dist.errors import ConfigError

        raise ConfigError(f"{field} = true: excluding a node needs a Slurm job (scontrol update ExcNodeList), and this "
                          "process runs outside one (no SLURM_JOB_ID). Remove the setting (or set it to false) here.")


def requeue(timeout_s: float = 30, exclude: Iterable[str] = ()) -> str:
    """Requeue this job (array-aware) with ``scontrol requeue``; returns what happened, for the log.

    ``exclude``: Slurm node names the job must not run on again. They are added to the job's excluded
    nodes (what the user excluded stays), with the job held in between, so that it cannot start again
    before the update: ``scontrol requeuehold``, ``scontrol update JobId=... ExcNodeList=...``,
    ``scontrol release``.
    """
    job = job_id()
    if job is None:
        return "not a Slurm job: nothing to requeue"
    exclude = sorted(set(exclude))
    if not exclude:
        return _scontrol(["requeue", job], timeout_s) or f"job {job} requeued"
    with _ignoring_stop_signals():  # Slurm stops the job's processes as it requeues it: this one too
        return _requeue_excluding(job, exclude, timeout_s)


def _requeue_excluding(job: str, exclude: list[str], timeout_s: float) -> str:
    held = _scontrol(["requeuehold", job], timeout_s)
    if held:
        return held
    notes = []
    try:
        merged = sorted(set(excluded_nodes(job, timeout_s)) | set(exclude))
    except RuntimeError as exc:
        merged = exclude
        notes.append(f"its excluded nodes could not be read ({exc}): only these are excluded now")
    updated = _scontrol(["update", f"JobId={job}", f"ExcNodeList={','.join(merged)}"], timeout_s)
    released = _scontrol(["release", job], timeout_s)
    if released:  # held, it would never start again: say how to start it
        return f"job {job} requeued but still held ({released}); run `scontrol release {job}`"
    if updated:
        return f"job {job} requeued, but not without {', '.join(exclude)}: {updated}"
    nodes = f"node{'s' if len(exclude) > 1 else ''} {', '.join(exclude)}"
    return f"job {job} requeued without {nodes}" + "".join(f"; {note}" for note in notes)


def excluded_nodes(job: str, timeout_s: float = 30) -> list[str]:
    """The nodes job ``job`` excludes (``--exclude``, and what was added since), one name each; RuntimeError
    when scontrol cannot say."""
    found = re.search(r"\bExcNodeList=(\S+)", _scontrol_output(["show", "job", "--oneliner", job], timeout_s))
    if found is None or found.group(1) == "(null)":
        return []
    return _scontrol_output(["show", "hostnames", found.group(1)], timeout_s).split()


def _scontrol_output(args: list[str], timeout_s: float) -> str:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"scontrol {' '.join(args)}: {exc}") from exc
    if out.returncode != 0:
        raise RuntimeError((out.stderr or out.stdout).strip())
    return out.stdout


@contextlib.contextmanager
def _ignoring_stop_signals():
    """Holding the job, Slurm sends SIGTERM to every process of it, this one included; one that ended before
    ``scontrol release`` would leave the job held for ever. From the main thread the signals are ignored
    meanwhile (the process is ending: they say nothing new); from another thread the main thread's handlers
    (lit-dist's preemption handler, which only sets a flag) stay in charge."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in (getattr(signal, n) for n in STOP_SIGNALS)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _scontrol(args: list[str], timeout_s: float) -> str | None:
    """Run ``scontrol ARGS``; None if it worked, else what went wrong."""
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol {' '.join(args)} failed: {exc}"
    if out.returncode != 0:
        return f"scontrol {' '.join(args)} failed: {(out.stderr or out.stdout).strip()}"
    return None
