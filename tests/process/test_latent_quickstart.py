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
