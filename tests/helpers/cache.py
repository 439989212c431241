"""Caches as the tests build and check them: a data module over a cache, and every published entry decoded."""

import os

from lit_dist.cache.config import CacheConfig
from lit_dist.cache.reader import FieldIndex
from lit_dist.cache.shards import decode
from lit_dist.cache.store import CacheStore
from lit_dist.data.datamodule import BucketDataModule


def identity_table(tmp_path, num_images: int = 120):
    """Demo images whose table has bytes and mtime columns (as scans write them), under ``tmp_path``; returns the
    table's path."""
    from lit_dist.data.demo.shapes import create_shapes_dataset

    path = tmp_path / "shapes" / "metadata.parquet"
    create_shapes_dataset(str(path), num_images=num_images, seed=1)
    add_identity_columns(path)
    return path


def add_identity_columns(path) -> None:
    """Each file's size and modification time, as the table's bytes and mtime columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    stats = [os.stat(path.parent / name) for name in table.column("filename").to_pylist()]
    table = table.append_column("bytes", pa.array([s.st_size for s in stats], pa.int64()))
    pq.write_table(table.append_column("mtime", pa.array([s.st_mtime for s in stats], pa.float64())), path)


def data_module(path, cache: CacheConfig | None, **overrides) -> BucketDataModule:
    """The table at ``path`` with ``cache`` (None: none), small and in this process; ``overrides`` win."""
    kwargs = dict(metadata=str(path), resolution=32, batch_size_per_device=8, num_workers=0, seed=3,
                  allow_oversubscription=True)
    return BucketDataModule(**{**kwargs, **overrides, "cache": cache})


def entries(cache_dir, fields=("pixels", "encoder")) -> dict:
    """(field, sample, key) -> the decoded array, for every published entry."""
    store = CacheStore(str(cache_dir))
    out = {}
    for field in fields:
        shards = store.manifest(field)["shards"]
        index = FieldIndex(store, field, shards)
        for i in range(len(index.sample)):
            path = store.shard_url(field, shards[index.shard[i]]["name"])
            with open(path, "rb") as f:
                f.seek(int(index.offset[i]))
                data = f.read(int(index.length[i]))
            dtype = "uint8" if field == "pixels" else "bf16"
            out[(field, int(index.sample[i]), int(index.key[i]))] = decode(data, int(index.crc[i]), dtype, shards[index.shard[i]]) if len(data) else None
    return out
