"""Datasets with loss masks, as the tests make them: each image's mask is its own red channel, so that a batch's mask
must equal its image's red channel wherever the two were resized and cropped alike."""

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def masked_copy(table: Path, dest: Path, how: str = "column", unmasked_every: int = 0) -> Path:
    """A copy of ``table``'s folder at ``dest`` whose images have masks: ``how`` column (a ``mask`` column naming
    ``masks/<filename>``, grey PNGs) or alpha (the images rewritten as RGBA). With ``unmasked_every`` k, every k-th row
    has none (an empty name, or no alpha channel). Returns the new table's path."""
    shutil.copytree(table.parent, dest)
    path = dest / table.name
    rows = pq.read_table(path)
    names = []
    for i, name in enumerate(rows.column("filename").to_pylist()):
        image = Image.open(dest / name).convert("RGB")
        red = image.getchannel("R")
        if unmasked_every and i % unmasked_every == 0:
            names.append("")
            continue
        if how == "alpha":
            image.putalpha(red)
            image.save(dest / name)  # PNG: the alpha channel is kept
        else:
            target = dest / "masks" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            red.save(target)
        names.append(f"masks/{name}" if how == "column" else "")
    if how == "column":
        rows = rows.append_column("mask", pa.array(names, pa.string()))
    for column in ("bytes", "mtime"):  # the images may have been rewritten: their identity columns again
        if column in rows.column_names:
            rows = rows.drop_columns([column])
    pq.write_table(rows, path)
    if "bytes" in pq.read_schema(table).names:
        from tests.helpers.cache import add_identity_columns

        add_identity_columns(path)
    return path


def red(image) -> np.ndarray:
    """A batch's images (B, H, W, 3) uint8: their red channels, what their masks must be."""
    return np.asarray(image[..., 0])
