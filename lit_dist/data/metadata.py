"""The metadata table: one row per image, ``filename, width, height`` plus optional columns.

``filename`` is relative to the dataset root. ``label`` (int, or strings mapped
to sorted class indices) and ``caption`` are optional; a ``split`` column with
``train`` / ``val`` / ``test`` values overrides the hash split.
"""

import zlib
from dataclasses import dataclass

import numpy as np

from lit_dist.errors import DataError

REQUIRED_COLUMNS = ("filename", "width", "height")


@dataclass
class Metadata:
    """The columns a run needs, as numpy arrays (one entry per usable row)."""

    filenames: np.ndarray  # object array of str
    widths: np.ndarray  # int64
    heights: np.ndarray  # int64
    labels: np.ndarray | None  # int64 class indices
    classes: list[str] | None  # names of the classes when labels were strings
    splits: np.ndarray | None  # object array of "train" / "val" / "test"
    rows: np.ndarray | None = None  # int64 row number of each entry in the parquet table
    skipped_rows: int = 0  # rows without a filename or with a non-positive size

    def __len__(self) -> int:
        return len(self.filenames)


def read_metadata(path: str, storage_options: dict | None = None) -> Metadata:
    """Read and check a parquet metadata table at a local path or fsspec URL."""
    import fsspec
    import pyarrow.parquet as pq

    fs, fs_path = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if not fs.exists(fs_path):
        raise DataError(
            f"data.metadata = {path!r}: no such file. Point it at a parquet table with columns "
            f"{', '.join(REQUIRED_COLUMNS)}, or set data.create_demo_if_missing: true to generate the demo dataset there."
        )
    try:
        schema = pq.read_schema(fs_path, filesystem=fs)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"data.metadata = {path!r} is not a readable parquet file ({exc})") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise DataError(
            f"data.metadata = {path!r} lacks the required column(s) {', '.join(missing)} "
            f"(it has: {', '.join(schema.names)}). Add them: filename relative to data.root, width and height in pixels."
        )
    columns = [c for c in (*REQUIRED_COLUMNS, "label", "split") if c in schema.names]
    table = pq.read_table(fs_path, columns=columns, filesystem=fs)

    widths = table.column("width").to_numpy(zero_copy_only=False)
    heights = table.column("height").to_numpy(zero_copy_only=False)
    filenames = table.column("filename").to_numpy(zero_copy_only=False)
    bad = ~(np.isfinite(widths.astype(np.float64)) & np.isfinite(heights.astype(np.float64)))
    bad |= (np.nan_to_num(widths.astype(np.float64)) <= 0) | (np.nan_to_num(heights.astype(np.float64)) <= 0)
    bad |= np.array([not isinstance(f, str) or not f for f in filenames], dtype=bool)
    if bad.all():
        raise DataError(f"data.metadata = {path!r}: none of its {len(bad)} rows has a filename and positive width/height")
    keep = ~bad

    labels, classes = None, None
    if "label" in table.column_names:
        raw = table.column("label").to_numpy(zero_copy_only=False)[keep]
        if raw.dtype.kind in "iu":
            labels = raw.astype(np.int64)
        else:
            classes = sorted({str(v) for v in raw})
            lookup = {name: i for i, name in enumerate(classes)}
            labels = np.array([lookup[str(v)] for v in raw], dtype=np.int64)
    splits = table.column("split").to_numpy(zero_copy_only=False)[keep] if "split" in table.column_names else None
    return Metadata(
        filenames=filenames[keep],
        widths=np.nan_to_num(widths[keep].astype(np.float64)).astype(np.int64),
        heights=np.nan_to_num(heights[keep].astype(np.float64)).astype(np.int64),
        labels=labels,
        classes=classes,
        splits=splits,
        rows=np.flatnonzero(keep),
        skipped_rows=int(bad.sum()),
    )


def hash_split(filenames: np.ndarray, val_fraction: float) -> np.ndarray:
    """A split that depends only on each filename, so it is the same on every rank and every run."""
    threshold = int(val_fraction * 2**32)
    is_val = np.fromiter((zlib.crc32(f.encode()) < threshold for f in filenames), dtype=bool, count=len(filenames))
    return np.where(is_val, "val", "train").astype(object)
