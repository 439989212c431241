"""SIGKILL during cache builds, many times: no torn or unlisted shard is ever trusted, and the build finishes.

4 kills by default (``LIT_DIST_KILLS`` for more), each at a random moment of a `lit-dist cache` run
(start-up, the index, decoding, writing a shard, publishing). After each kill every shard that the
manifest or a pending list names must match its sha256; the next build goes on from there.
"""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.conftest import REPO, lit_dist

pytestmark = [pytest.mark.process, pytest.mark.slow]


def write_config(path, demo_data, cache_dir) -> str:
    config = {"trainer": {"accelerator": "cpu"},
              "model": {"net": {"class_path": "lit_dist.model.nets.SimpleCNN", "init_args": {"num_classes": 4}}},
              "data": {"metadata": str(demo_data), "resolution": 192, "batch_size_per_device": 8, "num_workers": 1,
                       "cache": {"dir": str(cache_dir), "shard_size_mb": 1}}}
    path.write_text(yaml.safe_dump(config))
    return str(path)


def listed_shards(cache_dir) -> list[dict]:
    """Every shard the manifest or a pending list names."""
    field = cache_dir / "pixels"
    lists = [field / "manifest.json", *sorted((field / "pending").glob("*.json"))] if field.exists() else []
    return [s for path in lists if path.exists() for s in json.loads(path.read_text())["shards"]]


def _count(cache_dir) -> int:
    try:
        return len(listed_shards(cache_dir))
    except (json.JSONDecodeError, FileNotFoundError):  # a list replaced while read
        return 0


def problems(cache_dir) -> list[str]:
    out = []
    for shard in listed_shards(cache_dir):
        for suffix, size, sha in ((".arrow", "bytes", "sha256"), (".index.arrow", "index_bytes", "index_sha256")):
            path = cache_dir / "pixels" / "shards" / (shard["name"] + suffix)
            if not path.exists():
                out.append(f"{path.name} is listed but missing")
            elif path.stat().st_size != shard[size] or hashlib.sha256(path.read_bytes()).hexdigest() != shard[sha]:
                out.append(f"{path.name} is listed but torn")
    return out


def test_killed_builds_never_leave_a_trusted_torn_shard_and_the_rebuild_finishes(tmp_path):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    kills = int(os.environ.get("LIT_DIST_KILLS", 4))
    demo_data = tmp_path / "shapes" / "metadata.parquet"
    images = 1200
    create_shapes_dataset(str(demo_data), num_images=images, seed=3)  # about 3 s of building, across several runs
    config = write_config(tmp_path / "cfg.yaml", demo_data, tmp_path / "cache")
    rng = random.Random(0)
    seen_listed, during_build = [], 0
    for round_ in range(kills):
        before = len(listed_shards(tmp_path / "cache"))
        proc = subprocess.Popen([sys.executable, "-m", "lit_dist", "cache", "--config", config], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if round_ % 4 == 3:  # any moment: start-up, reading the index, cleaning
            time.sleep(rng.uniform(0.5, 5.0))
        else:  # while shards are written: a few more listed, then a moment later
            target = before + rng.randint(1, 12)
            while proc.poll() is None and _count(tmp_path / "cache") < target:
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the process and its loader worker
            during_build += 1
        proc.communicate()
        found = problems(tmp_path / "cache")
        assert not found, found
        seen_listed.append(len(listed_shards(tmp_path / "cache")))
        if proc.returncode == 0:
            break
    print({"kills": during_build, "listed_after_each": seen_listed})
    # Every kill but perhaps the one at "any moment" (the fourth) lands during a build.
    assert during_build >= min(kills - 1, 5), "the kills did not land during builds"
    assert seen_listed[-1] > seen_listed[0] or seen_listed[0] > 0, "no build made progress between kills"

    out = lit_dist("cache", "--config", config, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    out = lit_dist("cache", "--config", config, "--check", cwd=tmp_path)
    assert out.returncode == 0 and f"pixels: {images} of {images} cached" in out.stdout, out.stdout + out.stderr[-2000:]
    leftovers = [p.name for p in (tmp_path / "cache" / "pixels" / "shards").iterdir()
                 if p.name.removesuffix(".index.arrow").removesuffix(".arrow")
                 not in {s["name"] for s in listed_shards(tmp_path / "cache")}]
    assert not leftovers, leftovers

    # The entries equal those of a build that was never interrupted.
    from tests.helpers.cache import entries

    clean = write_config(tmp_path / "clean.yaml", demo_data, tmp_path / "clean")
    assert lit_dist("cache", "--config", clean, cwd=tmp_path).returncode == 0
    a, b = entries(tmp_path / "cache", ("pixels",)), entries(tmp_path / "clean", ("pixels",))
    assert a.keys() == b.keys() and all(np.array_equal(v, b[k]) for k, v in a.items())


def test_sigusr1_stops_a_build_between_batches_keeps_its_shards_and_exits_preempted(tmp_path):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    demo_data = tmp_path / "shapes" / "metadata.parquet"
    create_shapes_dataset(str(demo_data), num_images=2000, seed=4)
    config = write_config(tmp_path / "cfg.yaml", demo_data, tmp_path / "cache")
    proc = subprocess.Popen([sys.executable, "-m", "lit_dist", "cache", "--config", config], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while proc.poll() is None and _count(tmp_path / "cache") < 5:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGUSR1)  # as Slurm's --signal=USR1@120 reaches every process of the task
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 11, stderr[-3000:]
    assert "stopped on SIGUSR1" in stderr and "not a Slurm job: nothing to requeue" in stderr
    manifest = json.loads((tmp_path / "cache" / "pixels" / "manifest.json").read_text())
    kept = sum(s["samples"] for s in manifest["shards"])
    assert kept >= 5 and not list((tmp_path / "cache" / "pixels" / "pending").iterdir()), "published on the way out"
    assert not problems(tmp_path / "cache")
    out = lit_dist("cache", "--config", config, cwd=tmp_path)
    assert out.returncode == 0 and f"built {2000 - kept} samples" in out.stdout, out.stdout + out.stderr[-2000:]
