"""Strategies that need CUDA: a short quickstart run each, ending in a loadable model.pt."""

import pytest
import torch

from lit_dist.models import SimpleCNN
from tests.conftest import CONFIGS, lit_dist

PRESETS = ["ddp.yaml", "fsdp.yaml", "fsdp2.yaml", "deepspeed_zero1.yaml", "deepspeed_zero2.yaml",
           "deepspeed_zero2_offload.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml"]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_on_one_gpu_and_exports(preset, tmp_path, demo_data):
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / preset),
                   "--data.metadata", str(demo_data), "--data.batch_size_per_device", "8", "--trainer.devices", "1",
                   "--trainer.max_epochs", "1", "--run.root_dir", str(tmp_path), "--run.run_id", "gpu",
                   "--trainer.enable_progress_bar", "false", timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    state = torch.load(tmp_path / "quickstart" / "gpu" / "model.pt", weights_only=True)
    SimpleCNN(num_classes=4).load_state_dict(state)
    assert all(v.dtype in (torch.float32, torch.int64) for v in state.values())
