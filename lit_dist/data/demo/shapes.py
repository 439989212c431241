"""The demo dataset: small PNG images of four shapes at varied sizes and aspect ratios.

Real files and a real parquet table, read through the same path as any user
dataset. Generated once, deterministically from a seed, into a temporary folder
that is renamed into place, so a crash or a concurrent generator on another
node never leaves a half-written dataset behind.
"""

import logging
import os
import shutil
import sys
import tempfile

import numpy as np

log = logging.getLogger(__name__)

CLASSES = ("circle", "cross", "square", "triangle")
COLOURS = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 200), "yellow": (220, 200, 40),
           "white": (235, 235, 235), "black": (20, 20, 20), "purple": (140, 50, 160), "orange": (230, 130, 30)}


# The demo's one place, as configs/quickstart.yaml names it: data.create_demo_if_missing generates it
# here and nowhere else, so a mistyped data.metadata is a data error, not a quiet run on shapes.
DEMO_METADATA = "data/shapes/metadata.parquet"


def is_demo_place(metadata_path: str) -> bool:
    """Whether ``metadata_path`` is where the demo dataset lives (DEMO_METADATA, relative to the working folder)."""
    return os.path.abspath(metadata_path) == os.path.abspath(DEMO_METADATA)


def create_shapes_dataset(metadata_path: str, num_images: int = 3000, seed: int = 0, val_fraction: float = 0.1) -> None:
    """Write ``num_images`` PNGs next to ``metadata_path`` and the parquet table at it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    root = os.path.dirname(os.path.abspath(metadata_path))
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    try:
        rows = {"filename": [], "width": [], "height": [], "label": [], "caption": [], "split": []}
        samples = _samples(num_images, seed, val_fraction, draw=True)
        # A bar only in a terminal: in a log file its redraws are noise.
        for row, image in tqdm(samples, total=num_images, desc="lit-dist: generating demo images", unit="img",
                               mininterval=1.0, disable=not sys.stderr.isatty()):
            os.makedirs(os.path.join(tmp, row["label"]), exist_ok=True)
            image.save(os.path.join(tmp, row["filename"]))
            for key, value in row.items():
                rows[key].append(value)
        pq.write_table(pa.table(rows), os.path.join(tmp, os.path.basename(metadata_path)))
        try:
            os.rename(tmp, root)
        except OSError:
            if not os.path.exists(metadata_path):  # not another process winning the race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("lit-dist: demo dataset of %d images written to %s", num_images, root)


def demo_table(num_images: int = 3000, seed: int = 0, val_fraction: float = 0.1):
    """The metadata table create_shapes_dataset writes, row for row, without drawing an image (about 0.2 s
    for 3,000): what ``lit-dist plan`` plans from before the demo is generated."""
    import pyarrow as pa

    rows = [row for row, _ in _samples(num_images, seed, val_fraction, draw=False)]
    return pa.Table.from_pylist(rows)


def _samples(num_images: int, seed: int, val_fraction: float, draw: bool):
    """(table row, image or None) per demo image. Sizes and pixels come from one random stream, so the
    rows are the same whether the images are drawn or not."""
    rng = np.random.default_rng(seed)
    colour_names = list(COLOURS)
    for i in range(num_images):
        shape = CLASSES[i % len(CLASSES)]
        aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
        area = rng.uniform(36, 72) ** 2
        width, height = max(16, int(np.sqrt(area * aspect))), max(16, int(np.sqrt(area / aspect)))
        bg, fg = rng.choice(len(colour_names), size=2, replace=False)
        image = _draw(shape, width, height, COLOURS[colour_names[bg]], COLOURS[colour_names[fg]], rng, draw)
        row = {"filename": f"{shape}/{i:06d}.png", "width": width, "height": height, "label": shape,
               "caption": f"a {colour_names[fg]} {shape} on a {colour_names[bg]} background",
               "split": "val" if rng.random() < val_fraction else "train"}
        yield row, image


def _draw(shape: str, width: int, height: int, bg: tuple, fg: tuple, rng: np.random.Generator, render: bool = True):
    """The image, or None without ``render``; either way it takes the same numbers from ``rng``."""
    from PIL import Image, ImageDraw

    size = rng.uniform(0.45, 0.8) * min(width, height)
    cx = rng.uniform(size / 2, width - size / 2)
    cy = rng.uniform(size / 2, height - size / 2)
    if not render:
        rng.integers(-12, 13, size=(height, width, 3))  # the noise's numbers, so later rows stay the same
        return None
    img = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(img)
    r = size / 2
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:  # cross
        t = r / 3
        draw.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fg)
        draw.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fg)
    noise = rng.integers(-12, 13, size=(height, width, 3))
    return Image.fromarray(np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8))
