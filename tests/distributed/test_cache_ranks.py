"""`lit-dist cache` on two processes: each builds its share, rank 0 publishes, and the result equals a
one-process build entry for entry."""

import numpy as np
import pytest
import yaml

from lit_dist.cache.store import CacheStore
from tests.conftest import REPO, lit_dist
from tests.helpers.cache import entries

pytestmark = pytest.mark.distributed
ENV = {"PYTHONPATH": str(REPO)}  # the encoder is a test helper


def write_config(path, demo_data, cache_dir) -> str:
    config = {
        "trainer": {"max_epochs": 1, "accelerator": "cpu"},
        "model": {"net": {"class_path": "lit_dist.model.nets.SimpleCNN", "init_args": {"num_classes": 4}}},
        "data": {"metadata": str(demo_data), "resolution": 32, "batch_size_per_device": 8, "num_workers": 1,
                 "cache": {"dir": str(cache_dir), "mode": "read", "shard_size_mb": 1,
                           "encoder": {"class_path": "tests.helpers.encoders.TinyEncoder", "init_args": {"seed": 2}}}},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_two_process_build_equals_one_process_build_and_trains(tmp_path, demo_data):
    one = write_config(tmp_path / "one.yaml", demo_data, tmp_path / "one")
    two = write_config(tmp_path / "two.yaml", demo_data, tmp_path / "two")
    out = lit_dist("cache", "--config", one, cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    out = lit_dist("cache", "--config", two, "--trainer.devices", "2", "--trainer.strategy", "ddp", cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "built 400 samples on 2 ranks" in out.stdout
    a, b = entries(tmp_path / "one"), entries(tmp_path / "two")
    assert len(a) == 800 and a.keys() == b.keys()
    for key, value in a.items():
        assert np.array_equal(value, b[key]), key
    # Every rank wrote shards of its own; rank 0 listed them all and left no pending list behind.
    assert len(CacheStore(str(tmp_path / "two")).manifest("pixels")["shards"]) >= 2
    assert not list((tmp_path / "two" / "pixels" / "pending").iterdir())

    out = lit_dist("cache", "--config", two, "--check", cwd=tmp_path, env=ENV)
    assert out.returncode == 0 and "pixels: 400 of 400 cached" in out.stdout, out.stdout + out.stderr[-2000:]
    out = lit_dist("fit", "--config", two, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                   "--model.input_key", "latent", "--model.net.init_args.in_channels", "4", "--trainer.max_steps", "6",
                   "--run.root_dir", str(tmp_path / "runs"), cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]


def test_ondemand_on_two_processes_with_loader_workers_fills_the_cache(tmp_path, demo_data):
    import re

    config = write_config(tmp_path / "cfg.yaml", demo_data, tmp_path / "cache")
    out = lit_dist("fit", "--config", config, "--data.cache.mode", "ondemand", "--trainer.devices", "2",
                   "--trainer.strategy", "ddp", "--trainer.max_epochs", "2", "--run.root_dir", str(tmp_path / "runs"),
                   cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    out = lit_dist("cache", "--config", config, "--check", cwd=tmp_path, env=ENV)
    cached = {f: int(n) for f, n in re.findall(r"(pixels|encoder): (\d+) of 400 cached", out.stdout)}
    assert cached and all(n >= 350 for n in cached.values()), out.stdout  # all but samples no batch has reached yet
    assert not list((tmp_path / "cache" / "pixels" / "pending").iterdir())
