"""Caches, measured against what they replace, each in the same run:

1. loader: samples/s of the train loader reading a pixel cache (stored in data.cache.pixel_layout's
   default, row_tree) vs decoding the source JPEGs (about 1 MP each, into ~256^2 buckets, as many loader
   workers: threads reading the cache, processes decoding), an epoch of each in turn, five times: the
   median of the five ratios. Interleaved because a shared VM's speed drifts by up to 40 % within an
   hour: a round's two epochs are seconds apart. Target >= 8x.
2. build: `lit-dist cache` samples/s on 2 processes vs 1 (decoding in each rank's own process,
   so a rank is one core here, as a GPU rank has its own cores), the best of five runs each, in
   turn (what else runs on the machine slows a run, two-process runs most, and never speeds one up).
   Target >= 1.7x.
3. latent: steps/s of configs/latent_quickstart.yaml (CNN on cached VAE latents) vs the same
   frozen VAE encoding every step (configs/latent_on_the_fly.yaml), 15 epochs each (steps/s of the
   first seed, after 20 warm-up steps), and the validation accuracy both reach: mean over seeds (2
   each), on 6,000 shapes of which half are for validation, so that 1 point is 30 images and not the
   3 of the quickstart's 282 (where another seed alone moves the accuracy 5 points). Reported beside:
   a cache of fp32 latents (one seed). Target >= 3x, accuracy within 1 point.
4. compression: zstd (per sample, as the cache stores it) vs gzip (Python's gzip.compress at its
   default level 9, per sample: SimpleTuner's --compress_disk_cache gzips each file) on the same
   cached pixels and on VAE latents of 100 of the photos at 256^2 (4 x 128 x 128 bf16, the size of SD
   latents of a 1024^2 image); pixels as stored by default (data.cache.pixel_layout row_tree), and
   reported beside them, stored plain and as row differences (rows). zstd at data.cache's level (1),
   multi-byte dtypes byte-shuffled; gzip on the plain bytes. zstd's decompression time includes undoing
   the layout in place (un-shuffling, the row tree, the running sum down the rows), as a reader does.
   Also reported, to tell codec from layout: gzip on the stored bytes, and zstd's decompression alone
   vs gzip's on them. Target: zstd's ratio at least gzip's, decompression >= 3x faster.
5. S3: requests to read one sample from a shard on the local S3 server (moto), over 20 reads: each must
   be one ranged GET. Target 1.
6. memory: bytes a run keeps per sample for a pixel + encoder cache, from a synthetic cache of
   1 M entries (index files only): the slope from 250 K to 1 M entries. Target <= 32.

    .venv/bin/python -m benchmarks.bench_cache [--images 600] [--workers 2] [--rounds 5] [--epochs 15] [--skip-latent]
                                               [--photos DIR] [--short]

``--photos DIR`` adds part 4 on the images of DIR (your own photos), resized to cover 256 on their
short side as the pixel cache stores them; reported, not checked. The real-photo figures of
docs/benchmarks.md are ten sample photos (`pip download --no-deps scikit-image matplotlib`): astronaut,
chelsea, coffee, hubble_deep_field, ihc, motorcycle_left, motorcycle_right, retina and rocket from
scikit-image 0.26's skimage/data, and grace_hopper.jpg from matplotlib 3.11's mpl-data/sample_data.
"""

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import ROOT, SHORT_HELP, command, lit_dist, local_s3, machine, result_line

RESOLUTION = 256


def make_photos(root: str, count: int) -> str:
    """``count`` JPEGs of about 1 MP with photo-like content (smooth light, texture, edges); returns the table."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    rows = {"filename": [], "width": [], "height": [], "label": [], "bytes": [], "mtime": []}
    for i in range(count):
        w, h = [(1152, 864), (864, 1152), (1024, 1024)][i % 3]
        low = rng.random((h // 64 + 2, w // 64 + 2, 3)) * 255  # smooth light: a coarse grid, upsampled
        img = np.asarray(Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BICUBIC), dtype=np.int16)
        img += rng.normal(0, 4, (h, w, 1)).astype(np.int16)  # sensor-like texture, as a q90 JPEG keeps it
        y, x = rng.integers(0, h // 2), rng.integers(0, w // 2)
        img[y : y + h // 3, x : x + w // 3] = rng.integers(0, 256, 3)  # an object with hard edges
        name = f"{i:05d}.jpg"
        path = os.path.join(root, name)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=90)
        stat = os.stat(path)
        for key, value in (("filename", name), ("width", w), ("height", h), ("label", i % 4), ("bytes", stat.st_size),
                           ("mtime", stat.st_mtime)):
            rows[key].append(value)
    path = os.path.join(root, "meta.parquet")
    pq.write_table(pa.table(rows), path)
    return path


def epoch_rate(loader, epoch: int) -> float:
    """Samples/s of one full pass of ``loader``."""
    loader.sampler.set_epoch(epoch)
    started = time.perf_counter()
    seen = sum(len(b["image"]) for b in loader)
    return seen / (time.perf_counter() - started)


def bench_loader(table: str, cache_dir: str, workers: int, rounds: int) -> dict:
    """Decoding and the cache, interleaved: after a first pass of each (which starts the decoding workers and
    brings the cache into the page cache), ``rounds`` times an epoch decoding then an epoch from the cache. The
    ratio is the median of the rounds' ratios: the two epochs of a round are a second or two apart, so the
    speed of this shared VM, which drifts by up to 40 % within an hour, moves both of them alike."""
    from lit_dist.cache.config import CacheConfig
    from lit_dist.data.datamodule import BucketDataModule

    def loader(cache):
        dm = BucketDataModule(table, resolution=RESOLUTION, batch_size_per_device=16, num_workers=workers, val_fraction=0,
                              allow_oversubscription=True, cache=cache)
        dm.setup("fit")
        return dm.train_dataloader()

    decoding = loader(None)
    started = time.perf_counter()
    loader(CacheConfig(dir=cache_dir, mode="build"))  # built in this process (cores: its loader workers)
    built = time.perf_counter() - started
    cached = loader(CacheConfig(dir=cache_dir, mode="read"))
    epoch_rate(decoding, 0)  # not counted: starts the workers
    epoch_rate(cached, 0)  # not counted: brings the shards into the page cache
    pairs = [(epoch_rate(decoding, epoch), epoch_rate(cached, epoch)) for epoch in range(1, rounds + 1)]
    ratios = sorted(c / d for d, c in pairs)
    return {"decode_samples_per_s": float(np.median([d for d, _ in pairs])),
            "cache_samples_per_s": float(np.median([c for _, c in pairs])), "ratio": float(np.median(ratios)),
            "round_ratios": [round(r, 2) for r in ratios], "build_in_process_s": built}


def bench_build(table: str, tmp: str, rounds: int) -> dict:
    import yaml

    config = os.path.join(tmp, "build.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"trainer": {"accelerator": "cpu"},
                        "model": {"net": {"class_path": "lit_dist.model.nets.SimpleCNN"}},
                        "data": {"metadata": table, "resolution": RESOLUTION, "num_workers": 0,
                                 "allow_oversubscription": True, "cache": {"dir": "", "mode": "build"}}}, f)
    runs = []  # samples/s of each run, 1 and 2 processes in turn
    # Interleaved, the best of ``rounds`` (five) runs each, as timeit takes the best of its repeats: what else runs
    # on this VM slows single runs (two-process runs of the same build here: 277-355 samples/s), never speeds them up.
    for ranks in (1, 2) * rounds:
        extra = ["--trainer.devices", "2", "--trainer.strategy", "ddp"] if ranks == 2 else []
        out = command([sys.executable, "-m", "lit_dist", "cache", "--config", config, "--data.cache.dir",
                       os.path.join(tmp, f"build-{ranks}-{time.monotonic_ns()}"), *extra])
        found = re.search(r"built (\d+) samples on (\d+) ranks in [\d.]+ s \((\d+) samples/s\)", out.stdout)
        if not found:
            raise RuntimeError(f"lit-dist cache failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        runs.append(int(found.group(3)))
    one, two = max(runs[0::2]), max(runs[1::2])
    return {"one_process_samples_per_s": one, "two_processes_samples_per_s": two, "ratio": two / one, "runs": runs}


def bench_latent(tmp: str, epochs: int, seeds: int, images: int, warmup_steps: int) -> dict:
    """The shipped latent config from its cache (bf16 latents, ``seeds`` seeds; fp32 latents, one) vs the same
    frozen VAE encoding every step (``seeds`` seeds) on ``images`` shapes (half for validation): steps/s of the
    first seed after ``warmup_steps``, accuracy means over seeds."""
    import pyarrow.parquet as pq

    from lit_dist.data.demo.shapes import create_shapes_dataset

    table = os.path.join(tmp, "shapes", "metadata.parquet")
    create_shapes_dataset(table, num_images=images, seed=0, val_fraction=0.5)
    train_rows = pq.read_table(table, columns=["split"]).column("split").to_pylist().count("train")
    steps = epochs * (train_rows // 32)  # batch 32, one bucket, the last partial batch dropped
    cache = os.path.join(tmp, "latent-cache")
    # Oversubscription: a short run's few images leave a bucket under one batch (6,000 leave none).
    base = ["--config", "configs/latent_quickstart.yaml", "--data.metadata", table, "--data.cache.dir", cache,
            "--data.allow_oversubscription", "true"]
    lit_dist("cache", *base)
    # Validation every 5 epochs, or at the end of a shorter run: the accuracy is read from the last one.
    common = ["--trainer.max_epochs", str(epochs), "--trainer.enable_progress_bar", "false",
              "--model.lr_scheduler.init_args.T_max", str(steps),
              "--trainer.check_val_every_n_epoch", str(min(5, epochs)),
              "--trainer.callbacks+=benchmarks.common.StepTimer", "--trainer.callbacks.warmup_steps", str(warmup_steps),
              "--run.root_dir", os.path.join(tmp, "runs")]
    fp32 = ["--data.cache.encoder_dtype", "fp32", "--data.cache.dir", cache + "-fp32"]
    runs = [("cache", s, []) for s in range(seeds)] + [("cache_fp32", 0, fp32)]
    runs += [("on_the_fly", s, ["--config", "configs/latent_on_the_fly.yaml"]) for s in range(seeds)]
    results: dict[str, dict] = {}
    for name, seed, extra in runs:
        out = command([sys.executable, "-m", "lit_dist", "fit", *base, *extra, *common, "--seed_everything",
                       str(seed)])
        bench = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("BENCH "))[6:])
        acc = float(re.search(r"fit finished: val/acc ([\d.]+)", out.stdout).group(1))  # the last validation's
        got = results.setdefault(name, {"steps_per_s": bench["steps_per_s"], "val_acc": []})
        got["val_acc"].append(acc)
    for got in results.values():
        got["mean_val_acc"] = sum(got["val_acc"]) / len(got["val_acc"])
    points = {name: 100 * (results[name]["mean_val_acc"] - results["on_the_fly"]["mean_val_acc"]) for name in results}
    every = [a for name in ("cache", "on_the_fly") for a in results[name]["val_acc"]]
    return {**results, "ratio": results["cache"]["steps_per_s"] / results["on_the_fly"]["steps_per_s"],
            "acc_points": points["cache"], "acc_points_fp32": points["cache_fp32"],
            "seed_spread_points": 100 * (max(every) - min(every)), "validation_images": images - train_rows}


def entries(cache_dir: str, field: str, limit: int) -> list[np.ndarray]:
    """The arrays of up to ``limit`` entries of a cache field, as a reader gets them."""
    from lit_dist.cache.reader import FieldIndex
    from lit_dist.cache.shards import decode
    from lit_dist.cache.store import CacheStore

    store = CacheStore(cache_dir)
    shards = store.manifest(field)["shards"]
    index = FieldIndex(store, field, shards)
    out = []
    dtype = "uint8" if field == "pixels" else "bf16"
    for i in range(min(limit, len(index.sample))):
        with open(store.shard_url(field, shards[index.shard[i]]["name"]), "rb") as f:
            f.seek(int(index.offset[i]))
            out.append(decode(f.read(int(index.length[i])), int(index.crc[i]), dtype, shards[index.shard[i]]))
    return out


def photo_latents(table: str, cache_dir: str, count: int) -> list[np.ndarray]:
    """Latents of the first ``count`` photos at 256^2 from the latent quickstart's VAE, as cached (bf16)."""
    import pyarrow.parquet as pq
    import torch
    import yaml

    from lit_dist.cache.config import CacheConfig
    from lit_dist.data.datamodule import BucketDataModule

    subset = os.path.join(os.path.dirname(cache_dir), "photo-subset.parquet")
    pq.write_table(pq.read_table(table).slice(0, count), subset)
    with open(os.path.join(ROOT, "configs", "latent_quickstart.yaml")) as f:
        vae = yaml.safe_load(f)["data"]["cache"]["encoder"]
    dm = BucketDataModule(subset, root=os.path.dirname(table), resolution=RESOLUTION, num_workers=0, val_fraction=0,
                          cache=CacheConfig(dir=cache_dir, pixels=False, encoder=vae))
    dm.build_cache(torch.device("cpu"))
    return entries(cache_dir, "encoder", count)


def folder_pixels(folder: str) -> list[np.ndarray]:
    """The images of ``folder`` as a pixel cache stores them at RESOLUTION: resized to cover it (short side)."""
    from PIL import Image

    arrays = []
    for name in sorted(os.listdir(folder)):
        try:
            with Image.open(os.path.join(folder, name)) as img:
                img = img.convert("RGB")
        except OSError:
            continue  # not an image
        scale = RESOLUTION / min(img.size)
        size = (max(RESOLUTION, round(img.width * scale)), max(RESOLUTION, round(img.height * scale)))
        arrays.append(np.asarray(img.resize(size, Image.BILINEAR)))
    if not arrays:
        raise SystemExit(f"--photos {folder}: no images there")
    return arrays


def bench_compression(arrays: list[np.ndarray], layout: str | None = None) -> dict:
    """zstd at data.cache's default level on the bytes as the cache stores them (images in ``layout``,
    data.cache.pixel_layout's default if None; multi-byte dtypes byte-shuffled) vs gzip on the plain bytes (what
    gzipping each file stores); also zstd on the plain bytes and gzip on the stored bytes, to separate codec and
    layout. zstd's decompression times include undoing the layout into the decompressed buffer, as a reader does;
    gzip's include making its bytes (Python's gzip.decompress, as a reader of gzipped files does). The codec
    speedup compares the two decompressions alone, on the same stored bytes."""
    import pyarrow as pa

    from lit_dist.cache.config import CacheConfig
    from lit_dist.cache.shards import restored, stored

    zstd = pa.Codec("zstd", compression_level=CacheConfig.compression_level)
    layout = layout or CacheConfig.pixel_layout
    payloads = [a.tobytes() for a in arrays]
    raw = sum(len(p) for p in payloads)
    plain_zstd = raw / sum(len(zstd.compress(p, asbytes=True)) for p in payloads)
    as_stored = [bytes(stored(a, layout)) for a in arrays]
    z = [zstd.compress(s, asbytes=True) for s in as_stored]
    g = [gzip.compress(p) for p in payloads]  # Python's default level, 9
    g_stored = [gzip.compress(s) for s in as_stored]

    def unpack_zstd(blob: bytes, array: np.ndarray) -> np.ndarray:
        data = zstd.decompress(blob, decompressed_size=array.nbytes)
        return restored(np.frombuffer(data, np.uint8), array.dtype, array.shape, layout, in_place=True)

    for blob, array in zip(z[:3], arrays[:3], strict=False):
        assert np.array_equal(unpack_zstd(blob, array), array), "the stored layout must round-trip"
    timings = {}
    for name, blobs, unpack in (("zstd", z, unpack_zstd), ("gzip", g, lambda b, a: gzip.decompress(b)),
                                ("zstd_codec", z, lambda b, a: zstd.decompress(b, decompressed_size=a.nbytes)),
                                ("gzip_stored", g_stored, lambda b, a: gzip.decompress(b))):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for blob, array in zip(blobs, arrays, strict=True):
                unpack(blob, array)
            best = min(best, time.perf_counter() - started)
        timings[name] = best
    return {"zstd_ratio": raw / sum(map(len, z)), "gzip_ratio": raw / sum(map(len, g)), "zstd_plain_ratio": plain_zstd,
            "zstd_decompress_MBps": raw / timings["zstd"] / 1e6, "gzip_decompress_MBps": raw / timings["gzip"] / 1e6,
            "decompress_speedup": timings["gzip"] / timings["zstd"],
            "gzip_stored_ratio": raw / sum(map(len, g_stored)), "codec_speedup": timings["gzip_stored"] / timings["zstd_codec"]}


def bench_s3(table: str, tmp: str) -> dict:
    """Requests sent to read one sample of a cache on a local S3 server (moto, as the tests use)."""
    from lit_dist.cache.config import CacheConfig
    from lit_dist.data.datamodule import BucketDataModule

    with local_s3() as options:
        import s3fs

        s3fs.S3FileSystem(**options).mkdir("bench-cache")
        cache = CacheConfig(dir="s3://bench-cache/c", mode="build")
        dm = BucketDataModule(table, resolution=RESOLUTION, batch_size_per_device=16, num_workers=0, val_fraction=0,
                              allow_oversubscription=True, storage_options=options, cache=cache)
        dm.setup("fit")
        view = dm._cache_views[0]["pixels"]
        view.read(0)  # opens the filesystem
        sent = []
        view._fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(request))
        started = time.perf_counter()
        for position in range(1, 21):
            view.read(position)
        seconds = (time.perf_counter() - started) / 20
        ranged = all(r.method == "GET" and "Range" in r.headers for r in sent)
        return {"requests_per_sample": len(sent) / 20, "all_ranged_gets": ranged, "ms_per_sample": seconds * 1000}


def bench_memory(tmp: str, samples: int) -> dict:
    """Bytes per sample a run keeps for a pixel + encoder cache: forks of one process set up the same table with
    and without a synthetic cache (index files whose keys match every row; no shard data is read)."""
    script = os.path.join(ROOT, "benchmarks", "_cache_memory.py")
    out = subprocess.run([sys.executable, script, tmp, str(samples)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="loader rounds, and build runs of 1 and of 2 processes")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--seeds", type=int, default=2, help="latent runs per arm, for the accuracy means")
    parser.add_argument("--latent-images", type=int, default=6000,
                        help="demo shapes of the latent runs, half for validation")
    parser.add_argument("--warmup-steps", type=int, default=20, help="latent steps before steps/s is timed")
    parser.add_argument("--latent-photos", type=int, default=100, help="photos whose VAE latents part 4 compresses")
    parser.add_argument("--memory-samples", type=int, default=1_000_000, help="entries of part 6's synthetic cache")
    parser.add_argument("--skip-latent", action="store_true", help="skip the latent runs (about 10 minutes)")
    parser.add_argument("--photos", help="a folder of your own photos: part 4 on them too (reported, not checked)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:  # every part; part 5 reads samples 1 to 20
        args.images, args.rounds, args.epochs, args.seeds, args.latent_images, args.warmup_steps = 24, 1, 1, 1, 128, 1
        args.latent_photos, args.memory_samples = 4, 20_000
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-cache-")
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # photos and a dozen caches: about 1 GB


def run(args: argparse.Namespace, tmp: str) -> None:
    table = make_photos(os.path.join(tmp, "photos"), args.images)
    loader = bench_loader(table, os.path.join(tmp, "pixels"), args.workers, args.rounds)
    print(f"machine: {machine()}")
    print(f"1. loader, {args.images} JPEGs of ~1 MP -> ~{RESOLUTION}^2 buckets, {args.workers} workers, medians of "
          f"{args.rounds} interleaved rounds: decoding {loader['decode_samples_per_s']:.0f} samples/s, pixel cache "
          f"{loader['cache_samples_per_s']:.0f} samples/s: {loader['ratio']:.1f}x (target >= 8; the rounds' ratios "
          f"{', '.join(f'{r:.1f}' for r in loader['round_ratios'])})")
    build = bench_build(table, tmp, args.rounds)
    print(f"2. build, lit-dist cache, decoding in each rank: 1 process {build['one_process_samples_per_s']:.0f} samples/s, "
          f"2 processes {build['two_processes_samples_per_s']:.0f}: {build['ratio']:.2f}x (target >= 1.7; samples/s of "
          f"the runs in turn, 1 and 2 processes: {', '.join(map(str, build['runs']))})")
    latent = None
    if not args.skip_latent:
        latent = bench_latent(tmp, args.epochs, args.seeds, args.latent_images, args.warmup_steps)
        accs = {name: ", ".join(f"{a:.4f}" for a in latent[name]["val_acc"]) for name in ("cache", "on_the_fly")}
        print(f"3. latent, {args.epochs} epochs: cache {latent['cache']['steps_per_s']:.1f} steps/s, on the fly "
              f"{latent['on_the_fly']['steps_per_s']:.1f} steps/s: {latent['ratio']:.1f}x (target >= 3); val/acc on "
              f"{latent['validation_images']} images, cache (bf16) {accs['cache']}, on the fly {accs['on_the_fly']}: "
              f"means {latent['acc_points']:+.2f} points apart, fp32 cache {latent['acc_points_fp32']:+.2f} (target "
              f"within 1); all seeds span {latent['seed_spread_points']:.2f} points")
    from lit_dist.cache.config import CacheConfig
    from lit_dist.cache.shards import PLAIN, ROWS

    def pixel_layouts(name: str, arrays: list[np.ndarray]) -> tuple[dict, dict]:
        """(the default layout's results, the other layouts' results)."""
        return ({f"{name} ({CacheConfig.pixel_layout})": bench_compression(arrays)},
                {f"{name} stored plain": bench_compression(arrays, PLAIN),
                 f"{name} as row differences (rows)": bench_compression(arrays, ROWS)})

    results, others = pixel_layouts("pixels", entries(os.path.join(tmp, "pixels"), "pixels", 200))
    results["latents"] = bench_compression(photo_latents(table, os.path.join(tmp, "photo-latents"), args.latent_photos))
    if args.photos:
        arrays = folder_pixels(args.photos)
        for part in pixel_layouts(f"{len(arrays)} photos of {args.photos}", arrays):
            others.update(part)
    reported = {**results, **others}  # the checks below are on the benchmark's own data, stored by default
    for name, r in reported.items():
        print(f"4. compression, {name}: zstd-{CacheConfig.compression_level} as stored {r['zstd_ratio']:.2f}x at "
              f"{r['zstd_decompress_MBps']:.0f} MB/s (on the plain bytes {r['zstd_plain_ratio']:.2f}x), "
              f"gzip {r['gzip_ratio']:.2f}x at {r['gzip_decompress_MBps']:.0f} MB/s: decompression "
              f"{r['decompress_speedup']:.1f}x faster (targets: ratio >= gzip's, >= 3x); gzip on the stored bytes {r['gzip_stored_ratio']:.2f}x, "
              f"zstd alone decompresses them {r['codec_speedup']:.1f}x faster than gzip")
    s3 = bench_s3(table, tmp)
    print(f"5. S3: {s3['requests_per_sample']:.2f} requests per sample read (ranged GETs: {s3['all_ranged_gets']}), "
          f"{s3['ms_per_sample']:.1f} ms each on the local server (target 1)")
    memory = bench_memory(tmp, args.memory_samples)
    print(f"6. memory: {memory['bytes_per_sample']:.1f} bytes per further sample kept by a run with a pixel + encoder "
          f"cache (numpy and Arrow buffers, {memory['samples'] // 4} to {memory['samples']} samples; the lookups alone "
          f"{memory['view_bytes_per_sample']:.0f}) (target <= 32)")
    checks = {
        "loader": loader["ratio"] >= 8,
        "build": build["ratio"] >= 1.7,
        "latent": latent is None or (latent["ratio"] >= 3 and abs(latent["acc_points"]) <= 1),
        "compression": all(r["zstd_ratio"] >= r["gzip_ratio"] and r["decompress_speedup"] >= 3 for r in results.values()),
        "s3": s3["requests_per_sample"] == 1 and s3["all_ranged_gets"],
        "memory": memory["bytes_per_sample"] <= 32,
    }
    result_line("cache", round(loader["ratio"], 2), ">= 8", all(checks.values()), checks=checks,
                loader_round_ratios=loader["round_ratios"],
                build_ratio=round(build["ratio"], 2), latent_ratio=None if latent is None else round(latent["ratio"], 2),
                latent_acc_points=None if latent is None else round(latent["acc_points"], 2),
                compression={k: {m: round(v, 2) for m, v in r.items()} for k, r in reported.items()},
                s3_requests_per_sample=s3["requests_per_sample"], bytes_per_sample=round(memory["bytes_per_sample"], 1),
                machine=machine(), short=args.short)


if __name__ == "__main__":
    main()
