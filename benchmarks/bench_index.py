"""Indexing a 10 M-row metadata table into buckets and per-rank shards vs pyarrow just reading it.

Target (issue 3): lit-dist's whole indexing (read + bad-row checks + buckets + this
rank's epoch plan) <= 2.5x the time pyarrow takes to read the needed columns, and
<= 32 bytes of memory per row beyond the table itself. Each side runs in a fresh
process, so peak RSS is comparable.

    .venv/bin/python -m benchmarks.bench_index [--rows 10000000] [--world 64]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import machine


def make_table(path: str, rows: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    names = pa.array([f"shard-{i // 10000:04d}/{i:09d}.jpg" for i in range(rows)], pa.string())
    table = pa.table({
        "filename": names,
        "width": rng.integers(256, 4096, rows, dtype=np.int32),
        "height": rng.integers(256, 4096, rows, dtype=np.int32),
        "label": rng.integers(0, 1000, rows, dtype=np.int32),
        "caption": pa.array(np.full(rows, "a photo of something, as its caption says"), pa.string()),
    })
    pq.write_table(table, path, row_group_size=1 << 20)


def child(mode: str, path: str, world: int) -> None:
    # Imports first: the comparison is of the work, not of interpreter start-up (torch's import
    # alone takes seconds, and a training process has paid it already).
    import numpy as np
    import pyarrow.parquet as pq

    from lit_dist.data.buckets import assign_buckets, make_buckets
    from lit_dist.data.metadata import read_metadata
    from lit_dist.data.sampler import BucketBatchSampler

    base = _peak_rss()
    started = time.perf_counter()
    if mode == "pyarrow":
        table = pq.read_table(path, columns=["filename", "width", "height", "label"])
        rows = table.num_rows
    else:
        meta = read_metadata(path, extra_columns=[])
        bucket_ids = assign_buckets(meta.widths, meta.heights, make_buckets(512, 64, 2.0))
        sampler = BucketBatchSampler(bucket_ids, 32, world, 0, seed=0)
        plan = sampler._train_batches()  # this rank's whole epoch: (batches, batch size)
        rows = len(meta)
        assert plan.shape[1] == 32 and np.unique(plan).size == plan.size
    elapsed = time.perf_counter() - started
    print(json.dumps({"seconds": elapsed, "peak_rss": _peak_rss() - base, "rows": rows}))


def _peak_rss() -> int:
    """Peak resident memory of this process (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(mode: str, path: str, world: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_index", "--child", mode, "--path", path,
                          "--world", str(world)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path, args.world)
        return
    with tempfile.TemporaryDirectory(prefix="lit-dist-bench-") as tmp:
        path = os.path.join(tmp, "meta.parquet")
        make_table(path, args.rows)
        runs = {"pyarrow": [], "lit-dist": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(measure(mode, path, args.world))
    best = {mode: min(r["seconds"] for r in rs) for mode, rs in runs.items()}
    peak = {mode: max(r["peak_rss"] for r in rs) for mode, rs in runs.items()}
    ratio = best["lit-dist"] / best["pyarrow"]
    per_row = (peak["lit-dist"] - peak["pyarrow"]) / args.rows
    print(f"machine: {machine()}; {args.rows:,} rows, world size {args.world}, best of {args.repeats}")
    print(f"  pyarrow read (filename, width, height, label): {best['pyarrow']:.2f} s, peak RSS +{peak['pyarrow'] / 2**20:.0f} MiB")
    print(f"  lit-dist index (read, check, bucket, shard):   {best['lit-dist']:.2f} s, peak RSS +{peak['lit-dist'] / 2**20:.0f} MiB")
    print(f"time ratio (lit-dist / pyarrow): {ratio:.2f}  (target <= 2.5) {'OK' if ratio <= 2.5 else 'MISSED'}")
    print(f"memory beyond the table: {per_row:.1f} bytes/row  (aim <= 32) {'OK' if per_row <= 32 else 'MISSED'}")


if __name__ == "__main__":
    main()
