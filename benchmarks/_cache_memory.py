"""Helper of bench_cache: the bytes a run keeps per sample for a pixel + encoder cache.

    python benchmarks/_cache_memory.py TMP SAMPLES            # prints one JSON line (slope from SAMPLES/4 to SAMPLES)
"""

import gc
import hashlib
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

ENCODER = {"class_path": "torch.nn.Identity"}


def module(table: str, cache_dir: str | None):
    from lit_dist.cache.config import CacheConfig
    from lit_dist.data.datamodule import BucketDataModule

    cache = CacheConfig(dir=cache_dir, mode="read", encoder=ENCODER) if cache_dir else None
    return BucketDataModule(table, root="/nonexistent", resolution=256, batch_size_per_device=16, num_workers=0,
                            val_fraction=0, allow_oversubscription=True, cache=cache)


def release() -> None:
    """Hand freed memory back (Arrow's pool and glibc's malloc keep it otherwise)."""
    import ctypes

    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def synthetic(tmp: str, samples: int) -> tuple[str, str]:
    """A table of ``samples`` rows and a cache whose index files list an entry for every row and field (its data
    files are empty)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lit_dist.cache.shards import INDEX_SCHEMA
    from lit_dist.cache.store import CacheStore

    rng = np.random.default_rng(0)
    sizes = np.array([(1152, 864), (864, 1152), (1024, 1024), (1280, 720)])[rng.integers(0, 4, samples)]
    table = os.path.join(tmp, "memory.parquet")
    names = pa.array([f"img/{i:08d}.jpg" for i in range(samples)])
    pq.write_table(pa.table({"filename": names, "width": sizes[:, 0], "height": sizes[:, 1],
                             "bytes": rng.integers(1e5, 1e6, samples), "mtime": np.full(samples, 1.7e9)}), table)
    cache_dir = os.path.join(tmp, "memory-cache")
    dm = module(table, cache_dir)
    plan = dm.cache_plan(dm.read())
    plan.store.check(create=True)
    need = plan.needs[0]
    for field in plan.fields:
        shards, per_shard = [], 100_000
        for lo in range(0, samples, per_shard):
            hi = min(samples, lo + per_shard)
            index = pa.table([pa.array(need.samples[lo:hi]), pa.array(need.keys[field][lo:hi]),
                              pa.array(np.arange(hi - lo, dtype=np.uint32) * 100), pa.array(np.full(hi - lo, 100, np.uint32)),
                              pa.array(np.zeros(hi - lo, np.uint32))], schema=INDEX_SCHEMA)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
                writer.write_table(index)
            data = sink.getvalue().to_pybytes()
            name = f"synthetic-{lo:09d}"
            os.makedirs(plan.store.path(field, "shards"), exist_ok=True)
            with open(plan.store.path(field, "shards", f"{name}.index.arrow"), "wb") as f:
                f.write(data)
            # An empty data file, as the manifest says (0 bytes): a reader refuses a shard whose data file is missing.
            open(plan.store.path(field, "shards", f"{name}.arrow"), "wb").close()
            shards.append({"name": name, "fingerprint": plan.fingerprints[field], "bytes": 0, "sha256": "",
                           "raw_bytes": 0, "samples": hi - lo, "entries": hi - lo, "index_bytes": len(data),
                           "index_sha256": hashlib.sha256(data).hexdigest()})
        CacheStore(cache_dir)._write_json({"format": 1, "shards": shards}, field, "manifest.json")
    return table, cache_dir


def measure(table: str, cache_dir: str | None) -> dict:
    """The bytes a data module over ``table`` (and the cache at ``cache_dir``) holds in its buffers once set up
    (numpy's, as tracemalloc sees them, and Arrow's), and those of its cache lookups."""
    import tracemalloc

    import pyarrow as pa

    # The code both runs may touch is loaded first: what is traced after is data, not modules.
    import lit_dist.cache.build  # noqa: F401
    import lit_dist.data.datamodule  # noqa: F401
    from lit_dist.cache.encoders import load_encoder

    load_encoder(ENCODER)
    tracemalloc.start()  # numpy reports its buffers to tracemalloc; Arrow counts its own
    dm = module(table, cache_dir)
    if cache_dir is None:  # the table's images do not exist: its memory is measured, not its files
        dm.check_roots = lambda parts: None
    dm.setup("fit")
    live = tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes()
    views = dm._cache_views[0] if dm._cache_views else {}
    view_bytes = sum(sum(a.nbytes for a in (v.shard, v.offset, v.length, v.crc)) for v in views.values())
    return {"live": live, "view_bytes": view_bytes}


def forked(fn, *args) -> dict:
    """``fn(*args)`` in a fork of this process (its exception, traceback and all, raised here)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    tmp, samples = sys.argv[1], int(sys.argv[2])
    # Two sizes: the slope is what each further sample costs, without the constant cost of the code itself.
    made = {}
    for size in (samples // 4, samples):
        folder = os.path.join(tmp, f"memory-{size}")
        os.makedirs(folder, exist_ok=True)
        made[size] = synthetic(folder, size)
    # Each measure in a fork of this process, all four from the same state (what they inherit cancels out of the
    # slope): a new interpreter each would import torch and lit-dist again, 5 s of CPU apiece.
    release()
    runs = {}
    for size, (table, cache_dir) in made.items():
        for name, extra in (("plain", None), ("cache", cache_dir)):
            runs[name, size] = forked(measure, table, extra)
    small, large = samples // 4, samples

    def slope(key: str) -> float:
        grow = {n: runs[n, large][key] - runs[n, small][key] for n in ("plain", "cache")}
        return (grow["cache"] - grow["plain"]) / (large - small)

    print(json.dumps({"samples": samples, "bytes_per_sample": slope("live"),
                      "view_bytes_per_sample": runs["cache", large]["view_bytes"] / large}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
