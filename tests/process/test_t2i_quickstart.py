"""configs/t2i_quickstart.yaml: captions through a frozen T5 encoder (random weights, byte tokenizer) into the
cache with the pixels, and a TinyUNet trained on both by flow matching."""

import re

import pytest

from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.process
pytest.importorskip("transformers")
T2I = ["--config", str(CONFIGS / "t2i_quickstart.yaml")]


def test_the_t2i_quickstart_trains_from_its_caption_cache_and_its_loss_falls(tmp_path, demo_data):
    out = lit_dist("fit", *T2I, "--data.metadata", str(demo_data), "--data.cache.dir", str(tmp_path / "cache"),
                   "--run.root_dir", str(tmp_path), "--trainer.max_epochs", "3", "--data.allow_oversubscription", "true",
                   "--trainer.callbacks+=tests.helpers.recorder.LossRecorder")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "caption_encoder: 400 of 400 cached" in out.stderr + out.stdout, out.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"validation at step \d+: val/loss ([\d.]+)", out.stdout + out.stderr)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
