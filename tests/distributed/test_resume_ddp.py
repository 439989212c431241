"""Two DDP processes on CPU, stopped mid-epoch and resumed with ``ckpt_path: auto``, end with exactly
the weights of an uninterrupted run (bitwise), with dropout drawing from every rank's RNG."""

import json

import pytest
import torch

from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.distributed

STOP, END = 7, 30  # 400 images, global batch 16: ~20 steps per epoch, so 7 is mid-epoch 0 and 30 in epoch 1


def test_ddp_stopped_mid_epoch_and_resumed_equals_an_uninterrupted_run_bitwise(tmp_path, demo_data):
    common = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
              "--model.net.class_path", "tests.helpers.nets.DropoutCNN", "--trainer.devices", "2",
              "--trainer.strategy", "ddp", "--data.batch_size_per_device", "8", "--data.num_workers", "1",
              "--trainer.max_steps", str(END), "--trainer.enable_progress_bar", "false",
              "--checkpoint.every_n_epochs", "null", "--run.root_dir", str(tmp_path)]
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
