"""A disk that fills during a checkpoint on 2 processes (DDP, FSDP2 over gloo), made for real with a small
tmpfs: every rank ends with the same one line and exit 16, no rank waits for another (a test timeout), no
process is left, no partial save stays, and (DDP) the run resumes from a copy on a bigger disk.

- DDP: rank 0 writes the file and runs out of space (800 KiB: steps 2 and 4 fit, 6 does not).
- FSDP2, out of space: both ranks write their shards through torch.distributed.checkpoint, which reports a
  rank's failed write to every rank (700 KiB: the save at step 2 fits, 4 does not); also when the shards are
  written on a background thread (``async_save``), where the failure is agreed on at the next save.
- DDP, the run directory filling while training (checkpoints elsewhere): rank 0's TensorBoard writer fails, and
  every rank stops at the next exchange with the same line, not rank 0 alone with a traceback.
- FSDP2, out of inodes: the checkpoint folder alone on a tmpfs of 9 inodes (its root, one sharded checkpoint of
  7, ``latest``), so the save at step 4 fails when rank 0 makes its folder, before any rank writes: the other
  rank must not wait for it in a collective rank 0 never reaches.
"""

import shutil
import threading
import time

import pytest

from lit_dist.ckpt.store import CheckpointStore, checkpoint_name
from tests.conftest import CONFIGS, lit_dist, quickstart_args
from tests.helpers.processes import left_after
from tests.helpers.small_fs import RUN, check_ended_full, mounter

pytestmark = pytest.mark.distributed

BOUND_S = 10.0  # docs/slurm.md, "A rank that hangs": every process of a run is gone this long after the job exits
FSDP2 = ["--config", str(CONFIGS / "fsdp2.yaml")]


@pytest.fixture
def small_fs(tmp_path):
    yield from mounter(tmp_path)


def run(root, demo_data, *extra: str, **overrides):
    out = lit_dist("fit", *quickstart_args(root, demo_data, trainer__devices=2, **{**RUN, **overrides}), *extra,
                   timeout=180)
    return out, left_after(out.pid, BOUND_S)


def test_ddp_a_full_disk_ends_every_rank_with_exit_16_and_resumes_on_a_bigger_one(small_fs, tmp_path, demo_data):
    small = small_fs("small", 800)
    out, left = run(small, demo_data, trainer__strategy="ddp")
    run_dir = small / "quickstart" / "full"
    check_ended_full(out, run_dir / "checkpoints", failed=6, newest=4, ranks=2)
    assert not left, left

    big = tmp_path / "big"
    shutil.copytree(run_dir, big / "quickstart" / "full")
    resumed, left = run(big, demo_data, trainer__strategy="ddp")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    checkpoints = big / "quickstart" / "full" / "checkpoints"
    assert f"resuming from {checkpoints / checkpoint_name(4)}" in resumed.stdout + resumed.stderr
    assert CheckpointStore(str(checkpoints)).find_valid()[0] == checkpoint_name(10)
    assert not left, left


@pytest.mark.parametrize("async_save", [False, True])
def test_fsdp2_a_shard_that_does_not_fit_ends_every_rank_with_exit_16(small_fs, demo_data, async_save):
    small = small_fs("small", 700)
    out, left = run(small, demo_data, *FSDP2, checkpoint__async_save=async_save)
    check_ended_full(out, small / "quickstart" / "full" / "checkpoints", failed=4, newest=2, ranks=2)
    assert not left, left


def test_fsdp2_rank_0_failing_to_make_the_folder_ends_every_rank_with_exit_16(small_fs, tmp_path, demo_data):
    checkpoints = small_fs("checkpoints", 10_000, inodes=9)
    out, left = run(tmp_path, demo_data, *FSDP2, checkpoint__dirpath=checkpoints)
    line = check_ended_full(out, checkpoints, failed=4, newest=2, ranks=2)
    assert "no free inodes" in line, line
    assert not left, left


def fill_when(path_glob: str, folder, stop: threading.Event) -> None:
    """Once a file matching ``path_glob`` exists under ``folder``, write a file there until the disk is full."""
    while not stop.is_set() and not any(folder.glob(path_glob)):
        time.sleep(0.05)
    with open(folder / "filler", "wb") as f:
        try:
            while not stop.is_set():
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_ddp_tensorboard_events_that_no_longer_fit_stop_every_rank_with_exit_16(small_fs, tmp_path, demo_data):
    small = small_fs("small", 4096)
    stop = threading.Event()
    filler = threading.Thread(target=fill_when, args=("quickstart/full/events.out.tfevents.*", small, stop))
    filler.start()
    try:
        out, left = run(small, demo_data, trainer__strategy="ddp", trainer__max_steps=400, trainer__log_every_n_steps=1,
                        checkpoint__dirpath=str(tmp_path / "checkpoints"), checkpoint__every_n_steps=1000)
    finally:
        stop.set()
        filler.join()
    assert out.returncode == 16, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, (errors, out.stderr[-3000:])
    assert f"TensorBoard events no longer fit in {small / 'quickstart' / 'full'}" in errors[0], errors[0]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    assert not left, left


def test_a_run_directory_full_from_the_start_ends_every_rank_with_the_same_line(small_fs, demo_data):
    # Lightning writes config.yaml on rank 0, then broadcasts: rank 0 raised alone, and rank 1 ended with a dump of
    # C++ frames and a line blaming rank 0 for going away.
    small = small_fs("small", 16)
    with pytest.raises(OSError):
        (small / "filler").write_bytes(b"\0" * 32 * 1024)
    out, left = run(small, demo_data, trainer__strategy="ddp")
    assert out.returncode == 16, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    config = small / "quickstart" / "full" / "config.yaml"
    assert len(errors) == 2 and len(set(errors)) == 1, (errors, out.stderr[-3000:])
    assert errors[0].startswith(f"lit-dist: error: No space left on device writing {config} (the filesystem at "
                                f"{small} has 0 bytes free)"), errors[0]
    assert "Traceback" not in out.stderr and "frame #" not in out.stderr, out.stderr[-4000:]
    assert not config.exists(), "a truncated config.yaml was left"
    assert not left, left
