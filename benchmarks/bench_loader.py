"""Images/s through BucketDataModule's train loader vs a bare Pillow loop doing the same work.

Both decode the same JPEGs (768x512, 512x768 and 640x640), resize them to cover their ~256^2
bucket and crop, in batches of 16, with the same number of processes (loader workers vs a
multiprocessing pool); a pass of each in turn, ``--rounds`` times, the best of each. The loader's
workers start as lit-dist starts them (data.worker_start auto: from a fork server on Pythons whose
fork can hang, 3.11.7 among them); the pool forks. Target (issue 3): >= 0.9x.

    .venv/bin/python -m benchmarks.bench_loader [--images 1200] [--workers 2] [--rounds 3] [--short]
"""

import argparse
import os
import tempfile
import time
from multiprocessing import get_context

from benchmarks.common import SHORT_HELP, machine, result_line

RESOLUTION = 256


def make_dataset(root: str, count: int) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=(512, 768, 3), dtype=np.uint8)
    rows = {"filename": [], "width": [], "height": [], "label": []}
    for i in range(count):
        w, h = [(768, 512), (512, 768), (640, 640)][i % 3]
        Image.fromarray(np.resize(np.roll(base, i, axis=1), (h, w, 3))).save(os.path.join(root, f"{i:05d}.jpg"), quality=90)
        rows["filename"].append(f"{i:05d}.jpg")
        rows["width"].append(w)
        rows["height"].append(h)
        rows["label"].append(i % 10)
    path = os.path.join(root, "meta.parquet")
    pq.write_table(pa.table(rows), path)
    return path


def _bare(job):
    """Decode, resize to cover, centre-crop: the same work as the loader, in a plain loop."""
    import numpy as np
    from PIL import Image

    paths, (bw, bh) = job
    out = []
    for path in paths:
        with Image.open(path) as img:
            img.draft("RGB", (bw, bh))
            img = img.convert("RGB")
            scale = max(bw / img.width, bh / img.height)
            size = (max(bw, round(img.width * scale)), max(bh, round(img.height * scale)))
            img = img.resize(size, Image.BILINEAR, reducing_gap=3.0)
            left, top = (size[0] - bw) // 2, (size[1] - bh) // 2
            out.append(np.asarray(img.crop((left, top, left + bw, top + bh))))
    return np.stack(out)  # (B, H, W, C) uint8, handed to the consumer like the loader's batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="passes of each, in turn (the best is shown)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:
        args.images, args.rounds = 48, 1
    from lit_dist.data.datamodule import BucketDataModule

    with tempfile.TemporaryDirectory(prefix="lit-dist-bench-") as root:
        meta = make_dataset(root, args.images)
        dm = BucketDataModule(meta, resolution=RESOLUTION, batch_size_per_device=args.batch, val_fraction=0.0,
                              num_workers=args.workers, random_crop=False)
        dm.setup("fit")
        loader = dm.train_dataloader()
        dataset, sampler = loader.dataset, loader.sampler
        jobs = [([os.path.join(root, dataset.filenames[i].as_py()) for i in batch],
                 tuple(int(v) for v in dataset.bucket_sizes[dataset.bucket_ids[batch[0]]]))
                for _epoch, batch, _w in sampler]
        images = sum(len(j[0]) for j in jobs)

        results = {"lit-dist loader": [], "bare Pillow": []}
        for _ in range(args.rounds):
            started = time.perf_counter()
            seen = sum(len(b["image"]) for b in dm.train_dataloader())
            results["lit-dist loader"].append(seen / (time.perf_counter() - started))
            with get_context("fork").Pool(args.workers) as pool:
                started = time.perf_counter()
                seen = sum(len(batch) for batch in pool.imap(_bare, jobs))
                results["bare Pillow"].append(seen / (time.perf_counter() - started))
            assert seen == images
    best = {k: max(v) for k, v in results.items()}
    ratio = best["lit-dist loader"] / best["bare Pillow"]
    print(f"machine: {machine()}; {images} JPEGs (768x512, 512x768, 640x640) -> ~{RESOLUTION}^2 buckets, "
          f"{args.workers} processes each, best of {args.rounds}")
    for name, value in best.items():
        print(f"  {name:16s} {value:8.0f} images/s")
    print(f"ratio: {ratio:.2f}  (target >= 0.9) {'OK' if ratio >= 0.9 else 'MISSED'}")
    result_line("loader", round(ratio, 3), ">= 0.9", ratio >= 0.9,
                lit_dist_images_per_s=round(best["lit-dist loader"], 1),
                bare_pillow_images_per_s=round(best["bare Pillow"], 1), images=images, workers=args.workers,
                short=args.short)


if __name__ == "__main__":
    main()
