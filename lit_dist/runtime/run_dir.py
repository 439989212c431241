"""Where a run writes: ``{root_dir}/{name}/{run_id}`` holds its logs, config and checkpoints.

The run id must be the same on every process of a run, including the ones
Lightning starts itself for ``--trainer.devices N`` on one machine (they re-run
the command line) and every task of a Slurm job, and it must survive a requeue
of the same Slurm job, so that the job resumes into the same folder.
"""

import os
import time

from lit_dist.runtime.processes import started_at

RUN_ID_ENV = "LIT_DIST_RUN_ID"


class RunConfig:
    """Names and places the run directory."""

    def __init__(self, name: str = "default", root_dir: str = "runs", run_id: str | None = None):
        """Run directory settings.

        Args:
            name: Experiment name; runs of one experiment share {root_dir}/{name}.
            root_dir: Folder of all runs (local path); on several nodes it must be on a shared filesystem.
            run_id: Id of this run (the last folder level); default: the Slurm job id, else a timestamp.
        """
        self.name = name
        self.root_dir = root_dir
        self.run_id = run_id


def resolve_run_id(run_id: str | None, environ: dict | None = None) -> str:
    """The configured id, else one every process of this run agrees on without talking to the others."""
    env = os.environ if environ is None else environ
    if run_id:
        return run_id
    if env.get(RUN_ID_ENV):  # set by the first process for the processes it starts
        return env[RUN_ID_ENV]
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if env.get("LOCAL_RANK") is not None and (launcher := _launcher_id(env)):
        return launcher
    return time.strftime("%Y%m%d-%H%M%S")


def _launcher_id(env) -> str | None:
    """For processes an external launcher started on this machine (torchrun without --rdzv-id, the DeepSpeed
    launcher): the launcher's own start time and pid, which all its processes read alike. Processes on other
    machines have another launcher: there, run.run_id (or torchrun --rdzv-id) must be given."""
    parent = os.getppid()
    started = started_at(parent)
    if started is None:
        return None
    kind = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "launch"
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}-{parent}"



def run_dir(config: RunConfig, environ: dict | None = None) -> tuple[str, str]:
    """(run_id, run directory) for ``config``; exports the id so child processes reuse it."""
    run_id = resolve_run_id(config.run_id, environ)
    os.environ[RUN_ID_ENV] = run_id
    return run_id, os.path.join(config.root_dir, config.name, run_id)


def check_writable(path: str) -> None:
    """Refuse in one line (ConfigError) a run directory ``path`` that this process cannot make or write: a
    read-only filesystem, another user's folder, a file on the way. Every rank writes its own files there while
    it sets up (its hang file): one failing there mid-setup would leave the others waiting for it."""
    folder = os.path.abspath(path)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        why = "is not a folder"
    elif os.access(folder, os.W_OK | os.X_OK):
        return
    else:
        try:
            read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "is on a read-only filesystem" if read_only else "is not writable by this user"
    from lit_dist.errors import ConfigError

    raise ConfigError(f"run.root_dir: the run directory {path} cannot be made or written here: {folder} {why}. Set "
                      "--run.root_dir to a folder this user can write (on several nodes, one they share)")

