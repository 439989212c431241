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


@pytest.mark.parametrize("preset", ["fsdp.yaml", "deepspeed_zero3.yaml"])
def test_samples_are_drawn_where_the_denoiser_calls_gather_parameters(preset, tmp_path, demo_data):
    """FSDP1 keeps parameters flat outside the wrapped forward (samples gather them); ZeRO-3 gathers in hooks."""
    from PIL import Image

    from tests.distributed.test_samples import LABELS, SAMPLES

    blocks = ["--trainer.strategy.init_args.block_classes", "[lit_dist.models.denoiser.Block]"] \
        if preset == "fsdp.yaml" else []
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / preset), *LABELS,
                   *SAMPLES, *blocks, "--data.metadata", str(demo_data),
                   "--data.batch_size_per_device", "8", "--trainer.devices", "1", "--trainer.max_steps", "6",
                   "--run.root_dir", str(tmp_path), "--run.run_id", "gpu", "--trainer.enable_progress_bar", "false",
                   timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    grids = sorted((tmp_path / "quickstart" / "gpu" / "samples").glob("step-*.png"))
    assert [g.name for g in grids] == ["step-000000003.png", "step-000000006.png"]
    assert Image.open(grids[-1]).size == (2 * 32, 3 * 32)
