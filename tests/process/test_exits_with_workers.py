"""A one-process run whose loader workers are alive when a fault ends it: the quickstart as it ships (one process,
loader workers), its workers blocked in reads that never return (the images turned into FIFOs that nobody writes to).
Whatever the fault, the process is gone within seconds of its one error line, with its documented code, and
nothing of it is left. Before lit-dist ended its workers itself at exit (lit_dist/reading/workers.py: end_helpers),
each of these runs waited for ever in multiprocessing's exit handler, which joins workers that ignore its SIGTERM.
The outage case, with the object store gone, is in tests/s3/test_outage.py."""

import shutil

import pytest

from lit_dist.errors import ExitCode
from tests.conftest import LEFT_BOUND_S, quickstart_args, start_module
from tests.helpers.processes import Output, left_after
from tests.helpers.small_fs import mounter

pytestmark = pytest.mark.process

STALL = 3  # the step after which every read blocks; the faults come after it
GONE_S = 8.0  # from the error line to the exit


@pytest.fixture
def small_fs(tmp_path):
    yield from mounter(tmp_path)


FAULTS = {
    # A fault the run finds late, raised in the training process (a config or data error of a later step).
    "config": (ExitCode.CONFIG_ERROR, ["--trainer.callbacks+=tests.helpers.recorder.RaiseAtStep",
                                       "--trainer.callbacks.step", str(STALL + 1)]),
    "data": (ExitCode.DATA_ERROR, ["--trainer.callbacks+=tests.helpers.recorder.RaiseAtStep",
                                   "--trainer.callbacks.step", str(STALL + 1), "--trainer.callbacks.error", "DataError"]),
    # The batches made before the stall run out, the next never comes: the hang watchdog ends the run.
    "hang": (ExitCode.HUNG, ["--watchdog.timeout_s", "4", "--watchdog.heartbeat_s", "1"]),
    # The checkpoint after the stall does not fit its disk.
    "full": (ExitCode.STORAGE_FULL, ["--checkpoint.every_n_steps", str(STALL + 1)]),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_with_workers_blocked_in_reads_ends_the_process_within_seconds(fault, tmp_path, demo_data, small_fs):
    code, extra = FAULTS[fault]
    data = tmp_path / "shapes"
    shutil.copytree(demo_data.parent, data)
    if fault == "full":
        extra = [*extra, "--checkpoint.dirpath", str(small_fs("checkpoints", 128))]
    args = quickstart_args(tmp_path, data / "metadata.parquet", data__batch_size_per_device=8, data__num_workers=2,
                           trainer__max_steps=1000, trainer__limit_val_batches=0, trainer__num_sanity_val_steps=0,
                           trainer__enable_progress_bar=False, checkpoint__every_n_epochs=None,
                           export__filename=None, run__run_id="r")
    proc = start_module("lit_dist", "fit", *args, *extra, "--trainer.callbacks+=tests.helpers.recorder.StallReadsAtStep",
                        "--trainer.callbacks.step", str(STALL), "--trainer.callbacks.folder", str(data))
    output = Output(proc)
    returncode, _, err = output.finish(timeout=180)
    left = left_after(proc.pid, LEFT_BOUND_S)
    said = "lit-dist: hang:" if fault == "hang" else "lit-dist: error:"
    errors = [line for line in err.splitlines() if line.startswith(said)]
    assert returncode == code and len(errors) == 1, err[-3000:]
    assert err.count(errors[0].split(": ", 2)[2][:40]) == 1, err[-3000:]  # said once, not again by the console
    assert "Traceback" not in err, err[-3000:]
    assert output.seconds_after(said) < GONE_S, err[-3000:]
    assert not left, left
