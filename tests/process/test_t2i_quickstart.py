"""configs/t2i_quickstart.yaml: captions through a frozen T5 encoder (random weights, byte tokenizer) into the
cache with the pixels, a TinyUNet trained on both by flow matching, and `lit-dist sample` drawing a grid of
prompted images from its checkpoint. The shapes come as WebDataset tar shards (one config key instead of
data.metadata; the table's own path is every other recipe's), read in blocks of a batch."""

import json
import re

import pytest

from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.process
pytest.importorskip("transformers")
T2I = ["--config", str(CONFIGS / "t2i_quickstart.yaml")]


@pytest.mark.slow
def test_the_t2i_quickstart_trains_from_its_caption_cache_and_samples_a_grid(tmp_path, demo_data):
    from tests.helpers.tar_shards import save_shapes

    save_shapes(str(demo_data), tmp_path / "tars", per_shard=100)
    shards = ["--data.metadata", "null", "--data.create_demo_if_missing", "false",
              "--data.webdataset", str(tmp_path / "tars" / "{00000..00003}.tar"),
              "--data.index_cache", str(tmp_path / "index.parquet"), "--data.shuffle_block", "32"]
    out = lit_dist("plan", *T2I, *shards, "--data.allow_oversubscription", "true")  # indexes the shards, once
    assert out.returncode == 0 and "no problems found" in out.stdout, out.stdout + out.stderr[-2000:]
    assert f"400 usable rows of the tar shards {tmp_path / 'tars'}" in out.stdout, out.stdout
    prompts = ["a red circle on a white background", "a blue cross on a yellow background"]
    out = lit_dist("fit", *T2I, *shards, "--data.cache.dir", str(tmp_path / "cache"),
                   "--run.root_dir", str(tmp_path), "--run.run_id", "r", "--trainer.max_epochs", "3",
                   "--data.allow_oversubscription", "true", "--samples.prompts", json.dumps(prompts),
                   "--samples.batch_size", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "caption_encoder: 400 of 400 cached" in out.stderr + out.stdout, out.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"validation at step \d+: val/loss ([\d.]+)", out.stdout + out.stderr)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses  # 1.337, 1.202, 1.112 here

    from PIL import Image

    run_dir = tmp_path / "t2i_quickstart" / "r"
    # The run's own grid at its end, drawn with its weight average (model.ema), in groups of 3: `lit-dist sample` with
    # the run's config and last checkpoint draws it again, bitwise (its prompts, seed, steps, average and groups).
    out = lit_dist("sample", "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoints"),
                   "--output", str(tmp_path / "again.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    last = sorted((run_dir / "samples").glob("step-*.png"))[-1]
    assert (tmp_path / "again.png").read_bytes() == last.read_bytes(), f"not the run's own {last.name}"
    assert "with the weight average (" in out.stdout and " updates) on cpu" in out.stdout, out.stdout
    grids = []
    for name in ("a.png", "b.png"):
        out = lit_dist("sample", "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoints"),
                       "--prompt", "a red circle on a white background; a blue cross on a yellow background",
                       "--num", "3", "--steps", "4", "--output", str(tmp_path / name))
        assert out.returncode == 0, out.stderr[-3000:]
        assert "6 images (2 prompts x 3, 4 steps, guidance 4.0, seed 0) with the weight average" in out.stdout
        assert f"on cpu -> {tmp_path / name}" in out.stdout, out.stdout
        grids.append((tmp_path / name).read_bytes())
        assert Image.open(tmp_path / name).size == (3 * 32, 2 * 32)  # one row per prompt
    assert grids[0] == grids[1]  # the same seed, the same images
    out = lit_dist("sample", "--config", str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoints"),
                   "--samples.prompts", "null")
    assert out.returncode == 2 and "give --prompt" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
