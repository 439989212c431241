"""A rank that cannot see the checkpoint folder rank 0 writes stops the run at the start, on every rank.

Rank 1 runs in its own mount namespace with an empty tmpfs over the run's folder: the same path,
other files, as on a node where the shared filesystem is missing.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.helpers.ports import free_port

pytestmark = pytest.mark.distributed


def torchrun_env(run_id: str) -> dict:
    """What torchrun gives two processes on one machine (each adds its RANK and LOCAL_RANK)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_RUN_ID=run_id, PYTHONPATH=str(REPO))
    return env


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a mount namespace")
def test_a_rank_without_the_shared_folder_fails_early_with_a_clear_error(tmp_path, demo_data):
    root = tmp_path / "shared"
    root.mkdir()
    env = torchrun_env("blind")
    command = [sys.executable, "-m", "tests.helpers.blind_rank", str(root), str(demo_data)]
    procs = []
    for rank in (0, 1):
        run = command if rank == 0 else ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                         f'mount -t tmpfs tmpfs "{root}" && exec "$@"', "sh", *command]
        procs.append(subprocess.Popen(run, cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 2, output[-3000:]
        assert f"rank {rank}: lit-dist: error: checkpoint.dirpath: {root / 'ckpt'} is not shared: rank 1 on" in output
        assert "shared filesystem" in output
    assert not list(root.rglob("step-*")), "nothing was trained or saved"


def test_processes_that_chose_different_run_directories_are_told_to_share_a_run_id(tmp_path, demo_data):
    # As with torchrun on two machines without --rdzv-id: each launcher names the run after itself.
    env = torchrun_env("none")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.blind_rank", str(tmp_path / f"run-{rank}"),
                               str(demo_data)], cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 2, output[-3000:]
        assert "chose different run directories (rank 0: " in output and "same run.run_id" in output
