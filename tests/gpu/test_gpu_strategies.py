"""Strategies that need CUDA: a short quickstart run each, ending in a loadable model.pt."""

import pytest
import torch

from lit_dist.model.nets import SimpleCNN
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

    blocks = ["--trainer.strategy.init_args.block_classes", "[lit_dist.model.nets.denoiser.Block]"] \
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


@pytest.mark.parametrize("preset", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml"])
def test_the_weight_average_under_deepspeed_lives_where_the_weights_do_and_exports(preset, tmp_path, demo_data):
    """model.ema under DeepSpeed on a GPU (bf16 weights): the average where ZeRO keeps the weights (on the GPU, on
    the CPU where ZeRO-3 offloads them), float32, validated on, exported with --ema and different from the raw."""
    import json

    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / preset),
                   "--data.metadata", str(demo_data), "--data.batch_size_per_device", "8", "--trainer.devices", "1",
                   "--trainer.max_steps", "8", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
                   "--model.ema.decay", "0.9", "--model.ema.start_step", "2",
                   "--trainer.callbacks+=tests.helpers.recorder.EMAPlacement", "--run.root_dir", str(tmp_path),
                   "--run.run_id", "gpu", "--trainer.enable_progress_bar", "false", timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = tmp_path / "quickstart" / "gpu"
    placed = json.loads((run_dir / "ema-rank0.json").read_text())
    assert placed["devices"] == placed["weight_devices"], placed
    assert placed["local"] >= placed["full"], "one process holds every partition"
    exported = {}
    for ema in ("false", "true"):
        target = tmp_path / f"model-ema-{ema}.pt"
        done = lit_dist("export", str(run_dir / "checkpoints"), "--ema", ema, "--output", str(target))
        assert done.returncode == 0, done.stderr[-3000:]
        exported[ema] = torch.load(target, weights_only=True)
        SimpleCNN(num_classes=4).load_state_dict(exported[ema])
    assert any(not torch.equal(exported["true"][k], exported["false"][k]) for k in exported["true"])
