"""configs/latent_quickstart.yaml: a real VAE architecture (diffusers' AutoencoderKL, random weights) into an
encoder cache, and a CNN trained on the latents; the same as encoding on the fly, without the encoder's cost.
The 15-epoch accuracy and speed comparison is benchmarks/bench_cache.py (part 3)."""

import re

import pytest

from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.process
pytest.importorskip("diffusers")
LATENT = ["--config", str(CONFIGS / "latent_quickstart.yaml")]
ON_THE_FLY = [*LATENT, "--config", str(CONFIGS / "latent_on_the_fly.yaml")]


def metrics(out) -> dict[str, float]:
    assert out.returncode == 0, out.stderr[-3000:]
    return {k: float(v) for k, v in re.findall(r"(val/\w+) ([\d.]+)", out.stdout)}


def test_cached_latents_are_what_encoding_on_the_fly_computes(tmp_path, demo_data):
    data = ["--data.metadata", str(demo_data), "--data.cache.dir", str(tmp_path / "cache"), "--run.root_dir",
            str(tmp_path), "--ckpt_path", "null"]
    # fp32 entries: the cache serves exactly the encoder's outputs on the same centre crops.
    cached = metrics(lit_dist("validate", *LATENT, *data, "--data.cache.encoder_dtype", "fp32"))
    direct = metrics(lit_dist("validate", *ON_THE_FLY, *data))
    assert cached["val/loss"] == pytest.approx(direct["val/loss"], abs=1e-4)
    assert cached["val/acc"] == direct["val/acc"]


def test_the_latent_quickstart_trains_from_its_cache(tmp_path, demo_data):
    out = lit_dist("fit", *LATENT, "--data.metadata", str(demo_data), "--data.cache.dir", str(tmp_path / "cache"),
                   "--run.root_dir", str(tmp_path), "--trainer.max_epochs", "2", "--data.allow_oversubscription", "true")
    assert metrics(out)["val/acc"] > 0
    assert "encoder: 400 of 400 cached" in out.stderr + out.stdout


def test_a_denoiser_of_latents_samples_images_through_the_vaes_decoder(tmp_path, demo_data):
    """Flow matching on the cached latents (4 x 16 x 16 for 32-pixel images), conditioned on the labels: the run's
    grids and `lit-dist sample` decode the latents with the decoder of the VAE that made the cache."""
    import torch
    from PIL import Image

    from lit_dist.cache.encoders import VAEDecoder, VAEEncoder

    labels = ["--model.net", "lit_dist.model.nets.TinyUNet", "--model.net.init_args.in_channels", "4",
              "--model.net.init_args.channels", "[16, 32]", "--model.net.init_args.num_classes", "4",
              "--model.objective", "lit_dist.model.objectives.FlowMatching", "--model.objective.init_args.condition",
              "label", "--model.objective.init_args.null_label", "4", "--model.lr_scheduler", "null"]
    out = lit_dist("fit", *LATENT, *labels, "--data.metadata", str(demo_data), "--data.cache.dir",
                   str(tmp_path / "cache"), "--run.root_dir", str(tmp_path), "--run.run_id", "r", "--trainer.max_steps",
                   "4", "--trainer.limit_val_batches", "0", "--samples.prompts", "[circle, square]", "--samples.per_prompt",
                   "3", "--samples.steps", "2", "--data.allow_oversubscription", "true")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "latent_quickstart" / "r"
    assert Image.open(run_dir / "samples" / "step-000000004.png").size == (3 * 32, 2 * 32)  # decoded: 32 pixels a side

    out = lit_dist("sample", "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoints"),
                   "--prompt", "0; 3", "--num", "2", "--steps", "2", "--output", str(tmp_path / "grid.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert Image.open(tmp_path / "grid.png").size == (2 * 32, 2 * 32)

    # The decoder is the encoder's own VAE: built from the same config and seed, the same weights.
    config = {"block_out_channels": [32], "down_block_types": ["DownEncoderBlock2D"],
              "up_block_types": ["UpDecoderBlock2D"], "latent_channels": 4, "norm_num_groups": 8}
    from diffusers import AutoencoderKL

    torch.manual_seed(3)
    whole = AutoencoderKL(**config).state_dict()
    for half in (VAEEncoder(config=config, seed=3), VAEDecoder(config=config, seed=3)):
        state = half.vae.state_dict()
        assert state and all(torch.equal(whole[k], v) for k, v in state.items())
    assert any(k.startswith("decoder.") for k in state) and VAEDecoder(config=config).latent_shape_factor == (4, 1)
