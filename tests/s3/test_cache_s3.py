"""A cache on the local S3 server: built and read there, equal to a local cache, one ranged GET per sample."""

import pytest
import torch

from lit_dist.cache.config import CacheConfig
from lit_dist.cli.commands.cache import check_cache
from lit_dist.data.datamodule import BucketDataModule

pytestmark = pytest.mark.s3
ENCODER = {"class_path": "tests.helpers.encoders.TinyEncoder", "init_args": {"seed": 1}}


def module(metadata, cache_dir, options=None, mode="build") -> BucketDataModule:
    cache = CacheConfig(dir=cache_dir, mode=mode, encoder=ENCODER, shard_size_mb=1)
    dm = BucketDataModule(str(metadata), resolution=32, batch_size_per_device=8, num_workers=0, storage_options=options,
                          cache=cache)
    dm.setup("fit")
    return dm


def first_batches(dm, count=4) -> list[dict]:
    sampler = dm.train_sampler(1, 0)
    return [dm._splits["train"][request] for request in list(sampler)[:count]]


def test_a_cache_on_s3_equals_a_local_one_and_reads_one_range_per_sample(s3, demo_data, tmp_path, capsys):
    options = {"client_kwargs": {"endpoint_url": s3.endpoint}}
    url = f"s3://{s3.bucket}/cache"
    module(demo_data, url, options)  # built on S3: objects first, the manifest last
    assert s3.exists(f"{s3.bucket}/cache/pixels/manifest.json") and not s3.glob(f"{s3.bucket}/cache/pixels/pending/*")
    remote = module(demo_data, url, options, mode="read")
    local = module(demo_data, str(tmp_path / "cache"))
    for a, b in zip(first_batches(remote), first_batches(local), strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["latent"], b["latent"])

    view = remote._cache_views[0]["pixels"]
    view.read(0)  # opens the filesystem
    requests = []
    view._fs.s3.meta.events.register("before-send.s3", lambda request, **_: requests.append(request))
    view.read(17)
    assert len(requests) == 1, [r.url for r in requests]
    start, length = int(view.offset[17]), int(view.length[17])
    assert requests[0].method == "GET" and requests[0].headers["Range"] == f"bytes={start}-{start + length - 1}".encode()

    assert check_cache(BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, storage_options=options,
                                        cache=CacheConfig(dir=url, mode="read", encoder=ENCODER))) == 0
    assert "pixels: 400 of 400 cached" in capsys.readouterr().out
