"""Discovery scan (image headers only) vs a scan that fully decodes each image, as SimpleTuner's does.

Same files (``--images`` JPEGs of 1200x900 or 900x1200, about 1 MP), same number of processes, same run.
Target (issue 3): >= 100x the images/s.

A second figure, reported beside it (no target): ``lit-dist index`` started as one process vs as
several (``--split-processes``, 2) under torchrun, which split the header reads among them, on a folder of
``--split-images`` small JPEGs (64..127 px); the two alternate, the best of ``--repeats`` (3) runs each. Both
the rate inside the command (after start-up) and the wall clock of the whole command are shown; on
a machine with few cores the split cannot gain much, since one process already uses them all.

    .venv/bin/python -m benchmarks.bench_discovery [--images 2000] [--workers 2] [--split-images 4000] [--repeats 3]
                                                   [--short]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.common import ROOT, SHORT_HELP, machine, result_line


def make_images(root: str, count: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, size=(900, 1200, 3), dtype=np.uint8)  # ~1 MP, photo-like entropy
    for i in range(count):
        w, h = (1200, 900) if i % 2 else (900, 1200)
        img = Image.fromarray(np.roll(base, i * 7, axis=1)[:900, :1200] if i % 2 else np.roll(base, i, axis=0).transpose(1, 0, 2)[:1200, :900])
        img.resize((w, h)).save(os.path.join(root, f"{i:05d}.jpg"), quality=90)


def make_small_images(root: str, count: int) -> None:
    """``count`` small JPEGs (64..127 x 48..111 pixels) in 10 folders: many files, little data each."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    for i in range(count):
        folder = os.path.join(root, f"class{i % 10}")
        os.makedirs(folder, exist_ok=True)
        pixels = rng.integers(0, 256, size=(48 + i % 64, 64 + i % 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:06d}.jpg"), quality=85)


def index_command(root: str, output: str, processes: int) -> tuple[float, float, str]:
    """(images/s inside the command, wall-clock seconds with start-up, stdout) of one ``lit-dist index``."""
    index = ["-m", "lit_dist", "index", root, "--output", output, "--labels_from_folders", "true"]
    if processes == 1:
        cmd = [sys.executable, *index]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), f"--nproc-per-node={processes}",
               "--standalone", *index]  # a free port: a fixed one may be another job's store
    # Outside any Slurm job or torchrun of the caller's: the baseline must run as one process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    started = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return float(re.search(r"\((\d+) images/s\)", out.stdout).group(1)), wall, out.stdout


def split_index(count: int, processes: int, repeats: int) -> dict:
    """Best of ``repeats`` for one process and for ``processes`` processes, alternating, on the same folder."""
    import pyarrow.parquet as pq

    best = {1: (0.0, float("inf")), processes: (0.0, float("inf"))}
    with tempfile.TemporaryDirectory(prefix="lit-dist-bench-") as tmp:
        root = os.path.join(tmp, "images")
        make_small_images(root, count)
        tables = {}
        for r in range(repeats):  # alternating, so a slow spell of the machine hits both alike
            for n in best:
                output = os.path.join(tmp, f"index-{n}-{r}.parquet")  # a new file: nothing reused
                rate, wall, _ = index_command(root, output, n)
                best[n] = (max(best[n][0], rate), min(best[n][1], wall))
                tables[n] = pq.read_table(output)
        identical = tables[1].equals(tables[processes])
    return {"best": best, "identical": identical}


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
    parser.add_argument("--split-images", type=int, default=4000, help="small JPEGs for lit-dist index 1 vs N processes")
    parser.add_argument("--split-processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each lit-dist index case (best is shown)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:
        args.images, args.split_images, args.repeats = 40, 100, 1
    # Imports before any timing, for both sides: this measures scanning, not interpreter start-up.
    import PIL.Image  # noqa: F401
    import pyarrow  # noqa: F401
    import tqdm  # noqa: F401

    import lit_dist.runtime.distributed  # noqa: F401  (imports torch, which a scan in a training process has paid for)
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
    n = args.split_processes
    split = split_index(args.split_images, n, args.repeats)
    (rate_1, wall_1), (rate_n, wall_n) = split["best"][1], split["best"][n]
    print(f"lit-dist index, {args.split_images} small JPEGs (64..127 px), 1 process vs {n} under torchrun, "
          f"best of {args.repeats}; default workers ({os.cpu_count()} cores per node, shared by its processes)")
    print(f"  1 process:   {rate_1:9.0f} images/s in the command, {wall_1:5.1f} s wall clock with start-up")
    print(f"  {n} processes: {rate_n:9.0f} images/s in the command, {wall_n:5.1f} s wall clock with start-up")
    print(f"  {n} vs 1: {rate_n / rate_1:.2f}x in the command, {wall_1 / wall_n:.2f}x wall clock; "
          f"tables {'identical' if split['identical'] else 'DIFFERENT'}")
    result_line("discovery", round(ratio, 1), ">= 100", ratio >= 100, header_images_per_s=round(ours),
                decode_images_per_s=round(decoding), images=args.images,
                index_rate_ratio=round(rate_n / rate_1, 3), index_wall_ratio=round(wall_1 / wall_n, 3),
                index_tables_identical=split["identical"], index_processes=n, short=args.short)


if __name__ == "__main__":
    main()
