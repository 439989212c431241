"""Data where users keep it: WebDataset tar shards and a Hugging Face dataset folder against the same images as
files in a folder (a parquet table of file names), read by the training loader.

The demo shapes (PNG) written three ways: files, tar shards (tests/helpers/tar_shards.py: png, txt, cls per sample)
and a ``save_to_disk`` folder written by ``datasets`` (tests/helpers/hf_datasets.py). Each is indexed first (not
timed here); then images/s of the training loader (``--workers`` loader workers, every image decoded, resized and
cropped to its bucket), after a first pass of each that starts its workers and fills the page cache: medians of
``--rounds`` interleaved epochs.

1. tar shards over files, local disk, each epoch after the page cache is dropped (a dataset larger than memory,
   the case shards are for): target >= 1.5. The shards are read two ways: shuffled sample by sample (one open
   descriptor and a ``pread`` per image, where a file is an open, its inode and a read), and with
   ``data.shuffle_block`` (``--shuffle-block``, the batch size by default: a batch is a run of neighbours in a
   shard, read with one ``pread``); the target's ratio is the second's, the files' shuffled sample by sample as a
   folder of files is. The same with the page cache warm is reported too (decoding dominates it: a 6 kB PNG reads
   in 49 us and decodes in 0.7 ms). Dropping the cache needs root; without it the cold figures are left out and
   say so.
2. the same on the local S3 server (moto, as the tests use): target >= 3 (one ranged GET per image, or per run of
   neighbours in blocks, where s3fs opens a file with a HEAD before its GET).
3. building the shards' index (every member's header) on 2 processes against 1: target >= 1.7 (``lit-dist
   index``'s way: the shards split over ranks).
4. the Hugging Face folder over files, local disk (page cache dropped, as 1.): target >= 1.0.

    .venv/bin/python -m benchmarks.bench_sources [--images 20000] [--rounds 5] [--short]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import SHORT_HELP, checks, local_s3, machine, result_line, s3_credentials

TARGETS = {"tar_local_ratio": (">=", 1.5), "tar_s3_ratio": (">=", 3.0), "index_2_over_1": (">=", 1.7),
           "hf_local_ratio": (">=", 1.0)}
SETTINGS = dict(resolution=32, batch_size_per_device=32, val_fraction=0.0, allow_oversubscription=True, cache=None,
                node_index_dir=None)


def loader(workers: int, **source):
    from lit_dist.data.datamodule import BucketDataModule

    dm = BucketDataModule(num_workers=workers, **SETTINGS, **source)
    dm.prepare_data()
    dm.setup("fit")
    return dm.train_dataloader()


def epoch_rate(loader_, epoch: int, limit: int | None = None) -> float:
    """Images/s of one pass of ``loader_`` (its first ``limit`` batches)."""
    loader_.sampler.set_epoch(epoch)
    started, seen = time.perf_counter(), 0
    for i, batch in enumerate(loader_):
        seen += len(batch["image"])
        if limit is not None and i + 1 >= limit:
            break
    return seen / (time.perf_counter() - started)


def interleaved(loaders: dict, rounds: int, limit: int | None = None, cold: bool = False) -> dict:
    """{name: [images/s per round]}: a first pass of each not counted, then ``rounds`` epochs of each in turn
    (``cold``: each after the page cache is dropped)."""
    for one in loaders.values():
        epoch_rate(one, 0, limit)
    rates = {name: [] for name in loaders}
    for epoch in range(1, rounds + 1):
        for name, one in loaders.items():
            if cold:
                drop_page_cache()
            rates[name].append(epoch_rate(one, epoch, limit))
    return rates


def drop_page_cache() -> bool:
    """Whether the kernel dropped its page cache (clean pages; written ones synced first): root only."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def index_seconds(pattern: str, tmp: str, processes: int) -> float:
    """Seconds to index the shards of ``pattern`` on ``processes`` ranks (gloo, as a run's ranks do)."""
    code = f"""
import os, sys, time, torch.distributed as dist
from lit_dist.data.webdataset import load_or_index
from lit_dist.runtime.distributed import Comm
if int(os.environ["WORLD_SIZE"]) > 1:
    dist.init_process_group("gloo")
comm = Comm.current()
comm.barrier()
started = time.perf_counter()
load_or_index({pattern!r}, os.path.join({tmp!r}, "index-{processes}.parquet"), comm=comm)
if comm.rank == 0:
    print("SECONDS", time.perf_counter() - started, flush=True)
if dist.is_initialized():  # gloo's threads left to the interpreter's exit abort it ("terminate called ...")
    comm.barrier()
    dist.destroy_process_group()
"""
    import socket

    with socket.socket() as free:  # a port nobody holds (the suite runs other ranks beside this)
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(processes),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(processes)]
    outs = [p.communicate(timeout=3600) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"indexing on {processes} processes failed: {[err[-2000:] for _, err in outs]}")
    return float(outs[0][0].split("SECONDS")[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000, help="demo shapes read by the loaders")
    parser.add_argument("--index-images", type=int, default=100000, help="demo shapes in the shards indexed")
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--s3-batches", type=int, default=40, help="batches of each S3 epoch timed")
    parser.add_argument("--shuffle-block", type=int, default=32, help="data.shuffle_block of the shards read in blocks")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:
        args.images, args.index_images, args.per_shard, args.rounds, args.s3_batches = 128, 256, 32, 1, 2
        args.workers = 1
    print(f"machine: {machine()}; {args.images} demo shapes, {args.workers} loader workers, {args.rounds} rounds")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-sources-")
    try:
        figures = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    met = checks(figures, TARGETS)
    # The cold ratio is the target's; a short run (or one without root) has only the warm one.
    ratio = figures["tar_local_ratio"] if figures["tar_local_ratio"] is not None else figures["tar_local_warm_ratio"]
    result_line("sources", ratio, ">= 1.5", all(met.values()) and len(met) == len(TARGETS),
                checks=met, machine=machine(),
                **figures, short=args.short)


def run(args, tmp: str) -> dict:
    from lit_dist.data.demo.shapes import create_shapes_dataset
    from tests.helpers import hf_datasets, tar_shards

    s3_credentials()  # before the first loader's workers start: the S3 part's fork from the same server
    table = os.path.join(tmp, "shapes", "metadata.parquet")
    create_shapes_dataset(table, num_images=args.images, seed=0)
    shards = tar_shards.save_shapes(table, os.path.join(tmp, "tars"), per_shard=args.per_shard)
    pattern = os.path.join(tmp, "tars", f"{{{0:05d}..{len(shards) - 1:05d}}}.tar")
    hf = hf_datasets.save_shapes(table, os.path.join(tmp, "hf"), splits=False)
    tars = dict(webdataset=pattern, index_cache=os.path.join(tmp, "tars.parquet"))
    local = {"files": loader(args.workers, metadata=table), "tars": loader(args.workers, **tars),
             "tars_blocks": loader(args.workers, shuffle_block=args.shuffle_block, **tars),
             "hf": loader(args.workers, hf_dataset=hf, index_cache=os.path.join(tmp, "hf.parquet"))}
    rates = interleaved(local, args.rounds)
    print(f"local, warm page cache, images/s: files {rates['files']}, tar shards {rates['tars']}, in blocks "
          f"{rates['tars_blocks']}, Hugging Face {rates['hf']}", flush=True)
    # Not in a short run: the suite's other tests read files beside it.
    cold = interleaved(local, args.rounds, cold=True) if not args.short and drop_page_cache() else None
    if cold is None:
        print("local, page cache dropped: not measured (a short run; or not root: dropping it needs root)",
              flush=True)
    else:
        print(f"local, page cache dropped before each epoch, images/s: files {cold['files']}, tar shards "
              f"{cold['tars']}, in blocks {cold['tars_blocks']}, Hugging Face {cold['hf']}", flush=True)
    del local
    warm = {name: statistics.median(r) for name, r in rates.items()}
    medians = {name: statistics.median(r) for name, r in cold.items()} if cold else None

    with local_s3() as options:
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("bench-sources")
        fs.put(os.path.dirname(table), "bench-sources/shapes", recursive=True)
        fs.put(os.path.join(tmp, "tars"), "bench-sources/tars", recursive=True)
        remote_tars = dict(webdataset=f"s3://bench-sources/tars/{os.path.basename(pattern)}",
                           index_cache=os.path.join(tmp, "tars-s3.parquet"), storage_options=options)
        remote = {"files": loader(args.workers, metadata="s3://bench-sources/shapes/metadata.parquet",
                                  storage_options=options),
                  "tars": loader(args.workers, **remote_tars),
                  "tars_blocks": loader(args.workers, shuffle_block=args.shuffle_block, **remote_tars)}
        s3_rates = interleaved(remote, args.rounds, limit=args.s3_batches)
        del remote
    print(f"S3, images/s over {args.s3_batches} batches: files {s3_rates['files']}, tar shards {s3_rates['tars']}, "
          f"in blocks {s3_rates['tars_blocks']}", flush=True)

    big = os.path.join(tmp, "big", "metadata.parquet")
    create_shapes_dataset(big, num_images=args.index_images, seed=1)
    many = tar_shards.save_shapes(big, os.path.join(tmp, "big-tars"), per_shard=args.per_shard)
    big_pattern = os.path.join(tmp, "big-tars", f"{{{0:05d}..{len(many) - 1:05d}}}.tar")
    seconds = {n: index_seconds(big_pattern, tmp, n) for n in (1, 2)}
    print(f"indexing {args.index_images} images in {len(many)} shards: 1 process {seconds[1]:.1f} s, 2 processes "
          f"{seconds[2]:.1f} s", flush=True)
    s3 = {name: statistics.median(r) for name, r in s3_rates.items()}
    return {
        "tar_local_ratio": medians["tars_blocks"] / medians["files"] if medians else None,
        "tar_local_sample_by_sample_ratio": medians["tars"] / medians["files"] if medians else None,
        "hf_local_ratio": medians["hf"] / medians["files"] if medians else None,
        "tar_local_warm_ratio": warm["tars_blocks"] / warm["files"], "hf_local_warm_ratio": warm["hf"] / warm["files"],
        "local_cold_images_per_s": cold,
        "tar_s3_ratio": s3["tars_blocks"] / s3["files"], "tar_s3_sample_by_sample_ratio": s3["tars"] / s3["files"],
        "index_2_over_1": seconds[1] / seconds[2],
        "local_images_per_s": rates, "s3_images_per_s": s3_rates, "index_seconds": seconds,
    }


if __name__ == "__main__":
    main()
