"""Discovery scan (image headers only) vs a scan that fully decodes each image, as SimpleTuner's does.

Same files, same number of processes, same run. Target (issue 3): >= 100x the images/s.

    .venv/bin/python -m benchmarks.bench_discovery [--images 2000] [--workers 2]
"""

import argparse
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.common import machine


def make_images(root: str, count: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=(900, 1200, 3), dtype=np.uint8)  # ~1 MP, photo-like entropy
    for i in range(count):
        w, h = (1200, 900) if i % 2 else (900, 1200)
        img = Image.fromarray(np.roll(base, i * 7, axis=1)[:900, :1200] if i % 2 else np.roll(base, i, axis=0).transpose(1, 0, 2)[:1200, :900])
        img.resize((w, h)).save(os.path.join(root, f"{i:05d}.jpg"), quality=90)


def _decode_sizes(paths: list[str]) -> list[tuple[int, int]]:
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as img:
            out.append(img.convert("RGB").size)  # decodes every pixel
    return out


def decode_scan(root: str, workers: int) -> int:
    paths = sorted(os.path.join(root, n) for n in os.listdir(root))
    chunks = [paths[i : i + 64] for i in range(0, len(paths), 64)]
    with ProcessPoolExecutor(workers) as pool:
        return sum(len(c) for c in pool.map(_decode_sizes, chunks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    # Imports before any timing, for both sides: this measures scanning, not interpreter start-up.
    import PIL.Image  # noqa: F401
    import pyarrow  # noqa: F401
    import tqdm  # noqa: F401

    from lit_dist.data.discovery import scan_folder

    with tempfile.TemporaryDirectory(prefix="lit-dist-bench-") as root:
        make_images(root, args.images)
        started = time.perf_counter()
        table = scan_folder(root, workers=args.workers, progress=False)
        ours = args.images / (time.perf_counter() - started)
        assert table.num_rows == args.images and (table.column("width").to_numpy() > 0).all()
        started = time.perf_counter()
        assert decode_scan(root, args.workers) == args.images
        decoding = args.images / (time.perf_counter() - started)
    ratio = ours / decoding
    print(f"machine: {machine()}; {args.images} JPEGs of 1200x900, {args.workers} processes each")
    print(f"  lit-dist header scan: {ours:9.0f} images/s")
    print(f"  full-decode scan:     {decoding:9.0f} images/s")
    print(f"speed ratio: {ratio:.0f}x  (target >= 100x) {'OK' if ratio >= 100 else 'MISSED'}")


if __name__ == "__main__":
    main()
