"""Processes that die or stop on 2 ranks started by Lightning's own launcher (rank 0 the parent of rank 1),
made the way a bad day makes them: a real SIGKILL of a rank or of a loader worker, a rank stuck in C holding
the interpreter lock. Each ends with one line naming what failed and a documented exit code, and within
``BOUND_S`` of the job's exit no process of it is left (counted by session, never by name)."""

import re
import socket

import pytest

from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.processes import left_after

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BOUND_S = 10.0  # docs/slurm.md, "A rank that hangs": every process of a run is gone this long after the job exits


def run(tmp_path, demo_data, *extra: str, workers: int = 0, timeout: float = 240):
    """A 2-process DDP quickstart that trains until a fault ends it; returns (result, processes left)."""
    args = quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, data__num_workers=workers,
                           trainer__devices=2, trainer__strategy="ddp", trainer__max_epochs=1000,
                           trainer__enable_progress_bar=False, run__run_id="r")
    out = lit_dist("fit", *args, *extra, timeout=timeout)
    return out, left_after(out.pid, BOUND_S)


def test_a_rank_killed_by_sigkill_is_named_with_its_signal_and_nothing_is_left(tmp_path, demo_data):
    out, left = run(tmp_path, demo_data, "--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep",
                    "--trainer.callbacks.step", "4", workers=1)
    assert out.returncode == ExitCode.PROCESS_DIED, out.stderr[-3000:]
    assert re.search(r"lit-dist: error: rank 1 \(pid \d+ on \S+\) was killed by SIGKILL", out.stderr), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not left, left


def test_a_loader_worker_killed_by_sigkill_is_named_with_its_rank_and_nothing_is_left(tmp_path, demo_data):
    out, left = run(tmp_path, demo_data, "--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep",
                    "--trainer.callbacks.step", "4", "--trainer.callbacks.what", "worker", workers=1)
    assert out.returncode == ExitCode.PROCESS_DIED, out.stderr[-3000:]
    assert re.search(r"lit-dist: error: rank 1: data loader worker \(pid \d+\) was killed by SIGKILL", out.stderr), \
        out.stderr[-3000:]
    assert "data.num_workers" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not left, left


@pytest.mark.serial  # step limits of a few seconds
def test_a_rank_stuck_holding_the_gil_dumps_its_stack_and_every_process_ends(tmp_path, demo_data):
    # A step here takes well under a second: 4 s without one is a hang. Rank 1's last resort dumps its stacks
    # from C 4 + 2 x 1 + 5 = 11 s after its last step (watchdog.last_resort_after_s).
    out, left = run(tmp_path, demo_data, "--watchdog.timeout_s", "4", "--watchdog.heartbeat_s", "1",
                    "--trainer.callbacks+=tests.helpers.recorder.HoldGilAtStep", "--trainer.callbacks.step", "6",
                    workers=1)
    assert out.returncode == ExitCode.HUNG, out.stderr[-3000:]
    assert re.search(r"ranks behind: 1 \(\S+\);", out.stderr), out.stderr[-3000:]
    dump = (tmp_path / "quickstart" / "r" / "hang" / "rank-1.txt").read_text()
    assert "in on_train_batch_start" in dump and "in _hold" in dump, dump  # the stuck frames, dumped from C
    assert not left, left


@pytest.mark.serial  # step limits of a few seconds
def test_a_rank_stuck_before_its_first_step_is_named_within_the_startup_deadline(tmp_path, demo_data):
    # Rank 1 holds the interpreter lock within a second of fit's start (before its watchdog's first heartbeat,
    # hence "never published"); 8 s leaves it room on a loaded machine. Its last resort dumps 8 + 2 x 1 + 5 s in.
    out, left = run(tmp_path, demo_data, "--watchdog.startup_timeout_s", "8", "--watchdog.heartbeat_s", "1",
                    "--trainer.callbacks+=tests.helpers.recorder.HoldGilAtStep", "--trainer.callbacks.step", "-1")
    assert out.returncode == ExitCode.HUNG, out.stderr[-3000:]
    assert "ranks behind: 1;" in out.stderr and "rank 1: never published its progress" in out.stderr, out.stderr[-3000:]
    assert "in on_train_start" in (tmp_path / "quickstart" / "r" / "hang" / "rank-1.txt").read_text()
    assert not left, left


def test_rank_0_killed_by_sigkill_leaves_no_process_behind(tmp_path, demo_data):
    out, left = run(tmp_path, demo_data, "--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep",
                    "--trainer.callbacks.step", "4", "--trainer.callbacks.rank", "0", workers=1)
    assert out.returncode == -9, out.stderr[-3000:]
    assert not left, left


@pytest.mark.parametrize("code", [ExitCode.OK, ExitCode.DATA_ERROR])
def test_a_run_that_ends_leaves_no_process_behind(tmp_path, demo_data, code):
    extra = ["--trainer.max_steps", "6"] if code == ExitCode.OK else \
        ["--trainer.callbacks+=tests.helpers.recorder.RaiseDataErrorAtStep", "--trainer.callbacks.step", "4"]
    out, left = run(tmp_path, demo_data, *extra, workers=1)
    assert out.returncode == code, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not left, left
    assert not (tmp_path / "quickstart" / "r" / "hang").exists()  # no hang: no (empty) dump files either


@pytest.mark.serial  # step limits of a few seconds
def test_a_read_that_blocks_in_a_loader_worker_is_named_with_the_workers_stack_and_file(tmp_path, demo_data):
    # Every tenth training image becomes a FIFO nobody writes: a read of it blocks, as one on a hung mount does.
    import os
    import shutil

    import pyarrow.parquet as pq

    data = tmp_path / "shapes"
    shutil.copytree(demo_data.parent, data)
    rows = pq.read_table(data / "metadata.parquet").to_pylist()
    blocked = [r["filename"] for r in rows if r["split"] == "train"][::10]
    for name in blocked:
        os.remove(data / name)
        os.mkfifo(data / name)
    # 8 s, not the 4 s of the tests above: a loader worker on a loaded machine can take 4 s for a batch before it
    # reaches a FIFO (seen once in CI: the dump came while the worker was still reading real files).
    out, left = run(tmp_path, data / "metadata.parquet", "--watchdog.timeout_s", "8", "--watchdog.heartbeat_s", "2",
                    "--watchdog.startup_timeout_s", "20", workers=1)
    assert out.returncode == ExitCode.HUNG, out.stderr[-3000:]
    assert "waiting for the batch" in out.stderr, out.stderr[-3000:]
    behind = int(re.search(r"ranks behind: (\d)", out.stderr).group(1))
    hang = tmp_path / "quickstart" / "r" / "hang"
    for rank in (0, 1):  # each rank lists (and signals) its own workers only, though rank 0 is rank 1's parent
        listed = re.findall(r"helper process pid \d+ .*", (hang / f"rank-{rank}.txt").read_text())
        assert listed and all(f"rank-{rank}-worker-pid-" in line and f"rank-{1 - rank}-" not in line
                              for line in listed), listed
    dump = (hang / f"rank-{behind}.txt").read_text()
    pids = re.findall(r"helper process pid (\d+) ", dump)  # its loader workers (one of them sleeping in a read)
    workers = [(hang / f"rank-{behind}-worker-pid-{pid}.txt").read_text() for pid in pids]
    stuck = [w for w in workers if any(f"reading: {data / name}" in w for name in blocked)]
    assert len(stuck) == 1, (dump, workers)  # the worker says which file it is blocked on
    assert "in covering" in stuck[0], stuck[0]  # and its own stack, written from C while it is blocked
    assert not left, left


def test_a_peer_killed_under_torchrun_is_named_in_one_line_by_the_rank_left_and_nothing_is_left(tmp_path, demo_data):
    import sys
    from pathlib import Path

    from tests.helpers.ports import free_port

    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node=2", f"--master-port={free_port()}"]
    args = quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, data__num_workers=1,
                           trainer__max_epochs=1000, trainer__strategy="ddp", trainer__enable_progress_bar=False,
                           run__run_id="r")
    out = lit_dist("fit", *args, "--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep",
                   "--trainer.callbacks.step", "4", launcher=torchrun, timeout=180)
    output = out.stdout + out.stderr
    assert out.returncode != 0, output[-3000:]  # torchrun's own code (1): it reports the failed rank itself
    # Rank 0 is not rank 1's parent here: it learns who went away from the job's rendezvous store.
    named = re.search(r"lit-dist: error: rank 0: a collective failed because rank 1 \(pid (\d+) on (\S+)\) went away",
                      output)
    assert named and named.group(2) == socket.gethostname(), output[-5000:]
    assert f"(pid: {named.group(1)})" in output, output[-5000:]  # the pid torchrun saw die
    assert "[rank0]: Traceback" not in output, output[-5000:]
