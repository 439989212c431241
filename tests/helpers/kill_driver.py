"""Kills ``lit-dist fit`` with SIGKILL at random moments, most of them during a checkpoint save.

    python -m tests.helpers.kill_driver ROOT METADATA KILLS SEED [CHECKPOINT_URL STORAGE_OPTIONS_JSON]

Imports lit-dist once, then forks one training process per round (so a round costs the training,
not the imports). Rounds alternate: a random moment into a save (on local disk), a random moment
after the round's first new checkpoint, and any moment at all. After each kill it checks what a
user would rely on: every checkpoint at a final path matches its manifest, ``latest`` names a
complete checkpoint, and ``ckpt_path: auto`` finds one. Prints a JSON summary on its last line.

The parent never runs a torch operation: forking after one would copy a started OpenMP pool.
"""

import json
import os
import random
import signal
import sys
import time

import lit_dist.callbacks.checkpoint  # noqa: F401 - imported once here, not in every child
import lit_dist.data.datamodule  # noqa: F401
import lit_dist.model.module  # noqa: F401
from lit_dist.ckpt.store import LATEST, PARTIAL, CheckpointStore
from lit_dist.cli.app import main as lit_dist_main

ARGS = ["fit", "--config", "configs/quickstart.yaml", "--model.net.class_path", "tests.helpers.nets.WideHeadCNN",
        "--data.batch_size_per_device", "8", "--data.num_workers", "0", "--trainer.max_epochs", "1000",
        "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false", "--run.run_id", "kill",
        "--checkpoint.every_n_steps", "1", "--checkpoint.keep_last_n", "2", "--export.filename", "null"]


def train(root: str, metadata: str, async_save: bool, extra: list[str]) -> None:
    """The child: a real lit-dist fit that resumes with ckpt_path: auto and saves after every step."""
    os.setpgid(0, 0)  # its own process group (the parent does the same: whichever runs first)
    log = os.open(os.path.join(root, "child.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        lit_dist_main([*ARGS, "--run.root_dir", root, "--data.metadata", metadata, "--checkpoint.async_save", str(async_save).lower(),
                       *extra])
    except SystemExit as exit:
        os._exit(exit.code or 0)
    os._exit(0)


def saving(folder: str) -> bool:
    """Whether a save is under way (a staging folder or a temporary file exists)."""
    try:
        return any(e.startswith(PARTIAL) or ".tmp-" in e for e in os.listdir(folder))
    except FileNotFoundError:
        return False


def check(store: CheckpointStore) -> list[str]:
    """Problems a user would hit after the kill."""
    complete = store.complete()
    problems = [f"{name}: {problem}" for name in complete if (problem := store.problem(name))]
    if store.local:  # on disk, a checkpoint reaches its final name only complete
        problems += [f"{name}: at a final path without its marker" for name in sorted(set(store.names()) - set(complete))]
    if store.fs.exists(store.path(LATEST)):
        with store.fs.open(store.path(LATEST), "rb") as f:
            latest = f.read().decode().strip()
        if latest not in complete:
            problems.append(f"latest names {latest!r}, which is not a complete checkpoint")
    if complete and store.find_valid()[0] is None:  # unfinished saves alone: the next run starts over
        problems.append("ckpt_path: auto would find no usable checkpoint")
    return problems


def main(root: str, metadata: str, kills: int, seed: int, url: str | None = None, options: dict | None = None) -> dict:
    rng = random.Random(seed)
    folder = os.path.join(root, "quickstart", "kill", "checkpoints")
    store = CheckpointStore(url or folder, options)
    extra = ["--checkpoint.dirpath", url, "--checkpoint.storage_options", json.dumps(options)] if url else []
    summary = {"kills": 0, "during_save": 0, "problems": [], "checkpoints_seen": 0}
    for round in range(kills):
        pid = os.fork()
        if pid == 0:
            train(root, metadata, round % 3 == 2, extra)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child did it first
        deadline = time.monotonic() + 60
        # An object store shows no upload in progress: there, those rounds kill at a random moment.
        if round % 2 and store.local:  # wait for a save to start, then kill a random moment into it
            while saving(folder) and time.monotonic() < deadline:
                time.sleep(0.0005)  # what the last kill left is not this run's save: it cleans that first
            while not saving(folder) and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(rng.uniform(0, 0.05))
        elif round % 4 == 2:  # after this run's first new checkpoint: training, saving or cleaning up
            # On a loaded machine start-up alone can outlast any fixed wait, and kills that all land
            # before the first save test nothing about resuming from one.
            newest = max(store.complete(), default="")
            while max(store.complete(), default="") <= newest and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.5))
        else:  # any moment: start-up, loading, training or saving
            time.sleep(rng.uniform(1.0, 4.0))
        during = saving(folder)
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        summary["kills"] += 1
        summary["during_save"] += during
        summary["problems"] += [f"round {round}: {p}" for p in check(store)]
        summary["checkpoints_seen"] = max(summary["checkpoints_seen"], len(store.complete()))
    return summary


if __name__ == "__main__":
    root, metadata, kills, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    url, options = (sys.argv[5], json.loads(sys.argv[6])) if len(sys.argv) > 6 else (None, None)
    print(json.dumps(main(root, metadata, kills, seed, url, options)))
