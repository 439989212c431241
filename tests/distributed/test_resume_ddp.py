"""Two DDP processes on CPU, stopped mid-epoch and resumed with ``ckpt_path: auto``, end with exactly
the weights of an uninterrupted run (bitwise), with dropout drawing from every rank's RNG."""

import json

import pytest
import torch

from tests.conftest import lit_dist, quickstart_args

pytestmark = pytest.mark.distributed

STOP, END = 7, 30  # 400 images, global batch 16: ~20 steps per epoch, so 7 is mid-epoch 0 and 30 in epoch 1


@pytest.mark.slow
def test_ddp_stopped_mid_epoch_and_resumed_equals_an_uninterrupted_run_bitwise(tmp_path, demo_data):
    common = ["fit", *quickstart_args(tmp_path, demo_data, model__net__class_path="tests.helpers.nets.DropoutCNN",
                                      trainer__devices=2, trainer__strategy="ddp", data__batch_size_per_device=8,
                                      data__num_workers=1, trainer__max_steps=END, trainer__enable_progress_bar=False,
                                      checkpoint__every_n_epochs=None)]
    straight = lit_dist(*common, "--run.run_id", "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = lit_dist(*common, "--run.run_id", "resumed", "--trainer.callbacks+=tests.helpers.recorder.StopAtStep",
                       "--trainer.callbacks.step", str(STOP))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    folder = tmp_path / "quickstart" / "resumed" / "checkpoints" / f"step-{STOP:09d}"
    manifest = json.loads((folder / "COMPLETE.json").read_text())
    assert manifest["world_size"] == 2 and manifest["epoch"] == 0
    saved = torch.load(folder / "state.ckpt", weights_only=True)
    assert len(saved["lit_dist"]["rng"]) == 2, "each rank's random state is saved"

    resumed = lit_dist(*common, "--run.run_id", "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {folder}" in resumed.stdout + resumed.stderr
    a = torch.load(tmp_path / "quickstart" / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "quickstart" / "resumed" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"


def test_two_processes_resumed_on_one_finish_the_epoch_without_repeats(tmp_path, demo_data):
    # A requeue onto fewer GPUs: the global batch changes (16 -> 8), so the epoch's rest is regrouped.
    common = ["fit", *quickstart_args(tmp_path, demo_data, trainer__strategy="ddp", data__batch_size_per_device=8,
                                      data__num_workers=0, trainer__enable_progress_bar=False,
                                      checkpoint__every_n_epochs=None, trainer__max_steps=60,
                                      trainer__limit_val_batches=0, run__run_id="elastic")]
    two = lit_dist(*common, "--trainer.devices", "2", "--trainer.callbacks+=tests.helpers.recorder.StopAtStep",
                   "--trainer.callbacks.step", str(STOP), "--trainer.callbacks+=tests.helpers.recorder.RowRecorder",
                   "--trainer.callbacks.tag", "two")
    assert two.returncode == 0, two.stderr[-3000:]
    one = lit_dist(*common, "--trainer.devices", "1", "--trainer.callbacks+=tests.helpers.recorder.RowRecorder",
                   "--trainer.callbacks.tag", "one")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resuming epoch 0 with a global batch of 8 samples" in one.stderr and "the checkpoint's was 16" in one.stderr
    run_dir = tmp_path / "quickstart" / "elastic"
    batches = [b for name in ("two-rank0", "two-rank1", "one-rank0") for b in json.loads((run_dir / f"{name}.json").read_text())]
    assert sum(1 for name in ("two-rank0", "two-rank1") for _ in json.loads((run_dir / f"{name}.json").read_text())) == 2 * STOP
    epoch0 = [r for epoch, rows in batches if epoch == 0 for r in rows]
    assert len(epoch0) == len(set(epoch0)), "no sample trained twice in the interrupted epoch"
    assert any(epoch == 1 for epoch, _ in batches), "the resumed run went on into the next epoch"
