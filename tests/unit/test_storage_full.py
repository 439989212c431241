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
