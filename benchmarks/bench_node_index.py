"""One metadata index per node vs one per rank: 2 processes on one machine (one node), a 10 M-row table with
captions.

Each case starts 2 fresh ranks under ``torchrun --standalone`` that read the table through
``BucketDataModule.read`` and plan their epoch (each rank its own batches): ``shared`` with the index built by the
node's first rank in /dev/shm and mapped by both (``data.node_index_dir``, the default), ``private`` with every
rank reading the table itself (``data.node_index_dir: null``, as before).

- memory of the node's index: each rank's private memory (``Private_Clean + Private_Dirty`` of
  /proc/self/smaps_rollup) grown since before the read, summed over the ranks, plus the shared index files mapped
  (once, however many ranks map them). Target: shared <= 0.6x private.
- start-up to the first batch: from both ranks being ready to the slower rank having its epoch's first batch
  (the images are not read: the table's files do not exist). Target: shared <= 1.05x private.
- the epochs: each rank's batches in both cases must be identical (checked on every run).

Cases alternate over ``--repeats`` rounds, so a slow spell of the machine hits both alike; best of the rounds.

    .venv/bin/python -m benchmarks.bench_node_index [--rows 10000000] [--repeats 3] [--short]
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

from benchmarks.bench_index import make_table
from benchmarks.common import SHORT_HELP, machine, result_line, run_bench

PREFIX = "lit-dist-index-"


def _memory() -> tuple[int, dict[str, int]]:
    """(this process's private bytes, {path: bytes} of the index files it maps)."""
    private, shared, path = 0, {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                path = fields[5] if len(fields) > 5 and PREFIX in line else None
            elif fields[0] in ("Private_Clean:", "Private_Dirty:"):
                private += int(fields[1]) * 1024
            elif fields[0] == "Size:" and path is not None:
                shared[path] = shared.get(path, 0) + int(fields[1]) * 1024
    return private, shared


def child(mode: str, path: str) -> None:
    import torch.distributed as dist

    from lit_dist.data.datamodule import BucketDataModule
    from lit_dist.data.sampler import BucketBatchSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dm = BucketDataModule(path, resolution=512, alignment=64, batch_size_per_device=32, num_workers=0,
                          node_index_dir="/dev/shm" if mode == "shared" else None)
    before, _ = _memory()
    dist.barrier()
    started = time.perf_counter()
    parts = dm.read(shared=True)
    meta, buckets, splits = parts[0]
    rows = (splits == 0).nonzero()[0]
    sampler = BucketBatchSampler(buckets[rows], 32, world, rank, seed=0)
    first = next(iter(sampler))[1]
    ready = time.perf_counter() - started
    private, shared = _memory()
    plan = sampler._train_batches()
    digest = hashlib.sha256(plan.tobytes()).hexdigest()
    assert first == plan[0].tolist()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"ready_s": ready, "private": private - before, "shared": shared,
                                      "epoch": digest, "rows": len(meta)})
    if rank == 0:
        print("BENCH " + json.dumps({"ranks": everyone}), flush=True)
    dist.destroy_process_group()


def measure(mode: str, path: str) -> dict:
    ranks = run_bench([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "benchmarks.bench_node_index", "--child", mode, "--path", path])["ranks"]
    files = {p: size for r in ranks for p, size in r["shared"].items()}
    return {"ready_s": max(r["ready_s"] for r in ranks), "memory": sum(r["private"] for r in ranks) + sum(files.values()),
            "shared": sum(files.values()), "epochs": [r["epoch"] for r in ranks], "rows": ranks[0]["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--path")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path)
        return
    if args.short:
        args.rows, args.repeats = 50_000, 1
    folder = tempfile.mkdtemp(prefix="lit-dist-bench-node-index-")
    try:
        path = os.path.join(folder, "table.parquet")
        make_table(path, args.rows)
        results = {"shared": [], "private": []}
        for _ in range(args.repeats):
            for mode in results:
                results[mode].append(measure(mode, path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    epochs = {tuple(r["epochs"]) for rs in results.values() for r in rs}
    assert len(epochs) == 1, f"the ranks' epochs differ between the cases: {epochs}"
    ready = {mode: min(r["ready_s"] for r in rs) for mode, rs in results.items()}
    memory = {mode: min(r["memory"] for r in rs) for mode, rs in results.items()}
    memory_ratio = memory["shared"] / memory["private"]
    ready_ratio = ready["shared"] / ready["private"]
    print(f"machine: {machine()}; {args.rows:,} rows (with captions), 2 ranks on one node; best of {args.repeats}")
    for mode in results:
        print(f"  {mode:8s} start-up to the first batch {ready[mode]:6.2f} s   node memory {memory[mode] / 2**20:7.0f} MiB"
              + (f" (of which mapped once: {min(r['shared'] for r in results[mode]) / 2**20:.0f} MiB)" if mode == "shared" else ""))
    print(f"node memory shared / private = {memory_ratio:.2f} (target <= 0.6); start-up = {ready_ratio:.2f} "
          "(target <= 1.05); every rank's epoch identical in both: yes")
    result_line("node_index", round(memory_ratio, 3), "<= 0.6", memory_ratio <= 0.6 and ready_ratio <= 1.05,
                startup_ratio=round(ready_ratio, 3), startup_target="<= 1.05",
                shared_mib=round(memory["shared"] / 2**20), private_mib=round(memory["private"] / 2**20),
                shared_ready_s=round(ready["shared"], 3), private_ready_s=round(ready["private"], 3),
                epochs_identical=True, rows=args.rows, short=args.short)


if __name__ == "__main__":
    main()
