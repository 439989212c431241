"""A disk that fills during a checkpoint, made for real: the run directory on a small tmpfs, the real command line.

The quickstart's checkpoint is about 322 KB; in an 800 KiB filesystem (the run's logs take a few KB) the
saves at steps 2 and 4 fit and the one at step 6 does not. The run must end with one line and exit 16,
leave no partial save, warn after its first save that fewer than two checkpoints fit, and resume from a
copy of its run directory on a bigger disk.
"""

import errno
import pickle
import re
import shutil
import traceback

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from lit_dist.ckpt.saver import _described
from lit_dist.ckpt.space import full_error, os_errors
from lit_dist.ckpt.store import CheckpointStore, checkpoint_name
from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.small_fs import RUN, check_ended_full, mounter


@pytest.fixture
def small_fs(tmp_path):
    yield from mounter(tmp_path)


@pytest.mark.process
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_ends_with_one_line_and_exit_16_and_the_run_resumes_on_a_bigger_one(async_save, small_fs, tmp_path,
                                                                                          demo_data):
    small = small_fs("small", 800)
    args = quickstart_args(small, demo_data, checkpoint__async_save=async_save, **RUN)
    out = lit_dist("fit", *args, timeout=180)
    run_dir = small / "quickstart" / "full"
    line = check_ended_full(out, run_dir / "checkpoints", failed=6, newest=4)
    assert f"the filesystem at {small} has" in line, line
    # Said once, after the first save, while there was still room for one more: early enough to act.
    warnings = [line for line in out.stderr.splitlines() if "is running out of room" in line]
    assert len(warnings) == 1, out.stderr[-4000:]
    figures = re.search(rf"the filesystem at {small} has (\d+) KB free, less than two checkpoints of (\d+) KB", warnings[0])
    assert figures, warnings
    free, size = map(int, figures.groups())
    assert size < free < 2 * size, warnings

    big = tmp_path / "big"
    shutil.copytree(run_dir, big / "quickstart" / "full")
    resumed = lit_dist("fit", *quickstart_args(big, demo_data, checkpoint__async_save=async_save, **RUN), timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    checkpoints = big / "quickstart" / "full" / "checkpoints"
    assert f"resuming from {checkpoints / checkpoint_name(4)}" in resumed.stdout + resumed.stderr
    assert CheckpointStore(str(checkpoints)).find_valid()[0] == checkpoint_name(10)
    assert "running out of room" not in resumed.stderr


@pytest.mark.process
def test_an_index_that_does_not_fit_ends_with_one_line_naming_it_and_exit_16(small_fs, demo_data):
    small = small_fs("small", 16)
    (small / "filler").write_bytes(b"\0" * 12 * 1024)  # room for less than the index of the demo's images
    out = lit_dist("index", str(demo_data.parent), "--output", str(small / "metadata.parquet"), timeout=180)
    assert out.returncode == ExitCode.STORAGE_FULL, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 1 and re.fullmatch(
        re.escape(f"lit-dist: error: No space left on device writing {small / 'metadata.parquet'} (the filesystem at "
                  f"{small} has ") + r"\d+ (bytes|KB) free\)\. Free space there or write elsewhere, then run the same "
        r"command again \(a training run resumes from its newest complete checkpoint\)", errors[0]), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    assert sorted(p.name for p in small.iterdir()) == ["filler"], "a half-written index was left"


@pytest.mark.process
def test_a_first_checkpoint_that_does_not_fit_says_its_size_from_the_state_in_memory(small_fs, demo_data):
    small = small_fs("small", 300)  # less than one checkpoint
    out = lit_dist("fit", *quickstart_args(small, demo_data, **RUN), timeout=180)
    assert out.returncode == ExitCode.STORAGE_FULL, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-4000:]
    size = re.search(r"a checkpoint takes about (\d+) KB; no checkpoint is complete yet\..*: it starts from the "
                     r"beginning$", errors[0])
    assert size and 250 < int(size.group(1)) < 400, errors  # the state in memory; a checkpoint file is 322 KB
    assert list((small / "quickstart" / "full" / "checkpoints").iterdir()) == [], "the partial save stayed"


@pytest.mark.process
def test_an_export_that_does_not_fit_says_so_and_how_to_write_it_from_the_last_checkpoint(small_fs, tmp_path,
                                                                                          demo_data):
    # Training is complete when the export runs: a rerun of the finished run trains nothing and exports nothing,
    # so the line gives the `lit-dist export` command, and that command works.
    small = small_fs("small", 80)  # the run's logs fit, its 97 KB network does not
    checkpoints = tmp_path / "checkpoints"
    out = lit_dist("fit", *quickstart_args(small, demo_data, **{**RUN, "trainer__max_steps": 4}),
                   "--checkpoint.dirpath", str(checkpoints), timeout=180)
    assert out.returncode == ExitCode.STORAGE_FULL, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-4000:]
    model = small / "quickstart" / "full" / "model.pt"
    line = re.fullmatch(re.escape(f"lit-dist: error: the trained network (97 KB) does not fit in {model} (No space "
                                  f"left on device: the filesystem at {small} has ") + r"\d+ KB free\)\. Training is "
                        r"complete; free space there, then write it from its last checkpoint: lit-dist export (\S+) "
                        + re.escape(f"--output {model}"), errors[0])
    assert line and line.group(1) == str(checkpoints / checkpoint_name(4)), errors[0]
    assert not [p for p in model.parent.iterdir() if p.name.startswith((".model.pt", "model.pt"))], "a partial export"
    exported = lit_dist("export", line.group(1), "--output", str(tmp_path / "model.pt"), timeout=120)
    assert exported.returncode == 0 and (tmp_path / "model.pt").stat().st_size > 90_000, exported.stderr[-3000:]


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a test: the exception is what it inspects
        return caught


def test_no_space_is_found_inside_a_sharded_save_failure_and_a_chain():
    # How torch.distributed.checkpoint reports a rank's failed write: every rank raises this, the OSError inside.
    enospc = raised(OSError(errno.ENOSPC, "No space left on device"))
    dcp = CheckpointException("save failed", {1: (enospc, traceback.extract_tb(enospc.__traceback__))})
    assert full_error(dcp) is enospc
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    chained = RuntimeError("while saving")
    chained.__cause__ = quota
    assert full_error(chained) is quota
    other = OSError(errno.EACCES, "Permission denied")
    assert full_error(other) is None and os_errors(other) == [other]
    assert full_error(ValueError("a bug")) is None


def test_a_short_write_that_dcp_reported_without_its_cause_counts_as_full_only_on_a_full_disk(small_fs, tmp_path):
    # What rank 0 of an FSDP2 save got in CI: torch's zip writer's error for a short write, pickled by
    # torch.distributed.checkpoint for every rank, which dropped the ENOSPC it followed.
    short = raised(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    dcp = pickle.loads(pickle.dumps(CheckpointException("save failed", {0: (short, None)})))
    assert full_error(dcp) is None
    full = small_fs("full", 64)
    with pytest.raises(OSError) as filling:
        (full / "filler").write_bytes(b"x" * 128 * 1024)
    assert filling.value.errno == errno.ENOSPC
    assert _described(dcp, 300_000, str(full)) == ("full", "No space left on device")
    kind, text = _described(dcp, 300_000, str(tmp_path))
    assert kind == "storage" and "unexpected pos 704 vs 598" in text, text
    assert _described(RuntimeError("a bug"), 300_000, str(full))[0] == "bug"


def test_tensorboard_first_used_on_a_full_disk_stops_writing_instead_of_raising(small_fs, caplog):
    # What rank 0 of an FSDP2 run met in CI: the first value logged after a checkpoint had filled the disk, so the
    # events file's first record did not fit while the writer was being made; Lightning turned that into a
    # ValueError, rank 0 ended alone with it and the other rank never said why.
    from lit_dist.watch.tensorboard import TensorBoardLogger

    full = small_fs("full", 64)
    with pytest.raises(OSError) as filling:
        (full / "filler").write_bytes(b"x" * 128 * 1024)
    assert filling.value.errno == errno.ENOSPC
    logger = TensorBoardLogger(save_dir=str(full), name="run", version="v")
    logger.log_metrics({"data/bad_samples": 0.0}, step=4)
    assert logger._full() is not None and logger._full().errno == errno.ENOSPC
    assert "TensorBoard stopped writing (making its events file" in caplog.text, caplog.text
    logger.log_metrics({"train/lr": 0.1}, step=5)  # nothing more: no second attempt, no error
    logger.finalize("failed")
    assert caplog.text.count("TensorBoard stopped writing") == 1, caplog.text


def test_a_background_save_that_failed_as_the_run_ended_otherwise_is_logged_in_one_line(tmp_path, caplog):
    # A sharded save's error holds every rank's traceback in its text: logged whole, a run stopped for another
    # reason ended with two tracebacks under its one line.
    from lit_dist.callbacks.checkpoint import Checkpointing
    from lit_dist.ckpt.io import AtomicCheckpointIO
    from lit_dist.ckpt.saver import Rotation, Saver, _in_background

    enospc = raised(OSError(errno.ENOSPC, "No space left on device"))
    summary = traceback.extract_tb(enospc.__traceback__)
    dcp = CheckpointException("save failed", {0: (enospc, summary), 1: (enospc, summary)})
    assert "Traceback" in str(dcp)
    callback = Checkpointing(dirpath=str(tmp_path), async_save=True)
    callback._saver = Saver(CheckpointStore(str(tmp_path)), AtomicCheckpointIO(), Rotation(), async_save=True)

    def fail():
        raise dcp

    callback._saver._pending = _in_background(fail)
    callback.on_exception(None, None, RuntimeError("the run's own error"))
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["lit-dist: the background checkpoint save failed too: No space left on device"], logged
    assert not any(r.exc_info for r in caplog.records)

    def bug():
        raise TypeError("a bug in the save")

    callback._saver._pending = _in_background(bug)
    callback.teardown(None, None, "fit")
    assert caplog.records[-1].getMessage() == "lit-dist: the background checkpoint save failed: TypeError: a bug in the save"
    assert caplog.records[-1].exc_info is not None  # a bug keeps its traceback


def test_an_export_that_does_not_fit_in_a_run_without_checkpoints_says_there_is_none_to_write_it_from(tmp_path):
    import torch

    from lit_dist.callbacks.export import _did_not_fit

    line = _did_not_fit(str(tmp_path / "model.pt"), {"w": torch.ones(250)}, None, OSError(errno.ENOSPC, "full"))
    assert line.startswith(f"the trained network (1 KB) does not fit in {tmp_path / 'model.pt'} (No space "
                           "left on device: the filesystem at "), line
    assert line.endswith("This run wrote no checkpoint to write it from: free space there and run it again"), line
    assert "lit-dist export" not in line
