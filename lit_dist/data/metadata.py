"""The metadata table: one row per image, ``filename, width, height`` plus optional columns.

A table is one parquet file, a folder of them, or a glob, at a local path or an
fsspec URL (``s3://bucket/meta/``). ``filename`` is relative to the dataset
root. ``label`` (int, or strings mapped to sorted class indices), ``caption``
and any other columns are optional; a ``split`` column with ``train`` / ``val``
/ ``test`` values overrides the hash split.

Everything here is vectorised (pyarrow.compute, and numpy over the string
buffers in ``names``): checking tens of millions of rows must take a fraction
of a second, not a Python loop per row. Filenames stay a pyarrow array (one
buffer, shared by forked loader workers without copies) instead of a numpy
array of Python strings.
"""

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from lit_dist.cache.keys import identity_hash
from lit_dist.errors import DataError
from lit_dist.runtime import outage


def _unreadable() -> tuple[type[BaseException], ...]:
    """What pyarrow raises for a file that is no (complete) parquet table: its own ArrowException family (some
    also ValueError or OSError) and OSError for a failed read. An outage of the store is told apart before."""
    import pyarrow as pa

    return (pa.ArrowException, OSError, ValueError, EOFError)

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("filename", "width", "height")
IDENTITY_COLUMNS = ("bytes", "mtime", "etag")  # optional: which version of each file (scans write bytes and mtime)
MEMBER_COLUMNS = ("offset", "length")  # optional, together: each image is this byte range of the file its name's
# part before "#" names (the index of a Hugging Face dataset writes them)
SPLITS = ("train", "val", "test")
_GLOB_CHARS = set("*?[")
_UNSAFE_REASONS = {
    # "::" chains fsspec filesystems (file::/etc/passwd, simplecache::s3://...) wherever a URL is opened.
    "URL instead of a relative path": r"^[A-Za-z][A-Za-z0-9+.-]*://|::",
    "absolute path": r"^(/|\\|[A-Za-z]:[\\/])",
    "'..' in the path (would escape the dataset root)": r"(^|[\\/])\.\.([\\/]|$)",
}
_UNSAFE = "|".join(f"({p})" for p in _UNSAFE_REASONS.values())
_DUPLICATE = "duplicate filename (first kept)"


@dataclass
class BadRows:
    """Rows that were skipped, by reason, with a few examples of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return "; ".join(
            f"{n} {reason} (e.g. {', '.join(repr(e) for e in self.examples[reason])})" for reason, n in self.counts.items()
        )


@dataclass
class Metadata:
    """The usable rows of a table, as columns."""

    filenames: "pa.ChunkedArray"  # noqa: F821 - pyarrow strings, one buffer per chunk
    sizes: "pa.Table"  # noqa: F821 - columns width and height (positive), as read: no copies
    rows: np.ndarray | None  # int32 (int64 past 2**31 rows) table row of each entry; None: all rows, in order
    labels: np.ndarray | None = None  # int64 class indices
    classes: list[str] | None = None  # names of the classes when labels were strings
    splits: np.ndarray | None = None  # int8 index into SPLITS, one per row
    extra: dict = field(default_factory=dict)  # name -> pyarrow array, passed through to batches
    identity: np.ndarray | None = None  # uint64 per row from the bytes and mtime (or etag) columns, for caches
    members: np.ndarray | None = None  # (N, 2) int64 offset and length per row: images that are byte ranges of a file
    masks: object = None  # pyarrow strings: each row's loss mask file (data mask_column), relative to the image root
    bad: BadRows = field(default_factory=BadRows)
    source: str = ""

    def __len__(self) -> int:
        return len(self.filenames)

    def bucket_ids(self, buckets: np.ndarray) -> np.ndarray:
        """The bucket (index into ``buckets``) of each row, a record batch at a time: no copy of the sizes."""
        from lit_dist.data.buckets import assign_buckets

        out = np.empty(len(self), dtype=np.int16 if len(buckets) < 2**15 else np.int64)
        for part, widths, heights in _pixel_batches(self.sizes, self.source):
            out[part] = assign_buckets(widths, heights, buckets)
        return out


def list_parquet_files(path: str, storage_options: dict | None = None) -> tuple["fsspec.AbstractFileSystem", list[str]]:  # noqa: F821
    """The parquet files that ``path`` names: a file, a folder (searched recursively) or a glob."""

    fs, fs_path = outage.url_to_fs(path, **(storage_options or {}))

    def listed() -> list[str]:
        if _GLOB_CHARS & set(fs_path):
            return sorted(fs.glob(fs_path))
        if fs.isdir(fs_path):
            return sorted(f for f in fs.find(fs_path) if f.endswith(".parquet"))
        return [fs_path] if fs.exists(fs_path) else []

    files = outage.call(listed, path, outage.DEADLINE_S)  # an outage is waited out, not "no parquet file there"
    if not files:
        raise DataError(
            f"data.metadata = {path!r}: no parquet file there. Point it at a parquet table (a file, a folder of "
            f".parquet files or a glob) with columns {', '.join(REQUIRED_COLUMNS)}, scan an image folder instead "
            "with data.scan_root, or for the demo dataset leave data.metadata at data/shapes/metadata.parquet with "
            "data.create_demo_if_missing: true (it is generated there and nowhere else)."
        )
    return fs, files


def read_metadata(
    path: str,
    storage_options: dict | None = None,
    extra_columns: list[str] | None = None,
    strict: bool = False,
    val_fraction: float = 0.0,
    identity: bool = False,
    caption_column: str | None = None,
    mask_column: str | None = None,
) -> Metadata:
    """Read, check and clean a metadata table.

    Args:
        path: File, folder or glob, local or fsspec URL.
        storage_options: fsspec options (endpoint, region; credentials come from the environment).
        extra_columns: Columns passed through to batches; None: ``caption`` if the table has it.
        caption_column: The column read as the captions, passed to batches as ``caption``; None: ``caption``.
        mask_column: The column of each image's loss mask file, read into ``Metadata.masks``; None: no masks.
        strict: Raise on any bad row instead of skipping it.
        val_fraction: Share of rows for validation, by filename hash, when the table has no split column.
        identity: Also read each file's version (bytes and mtime, or etag columns) into ``Metadata.identity``.
    """
    import pyarrow.parquet as pq
    from fsspec.implementations.local import LocalFileSystem

    fs, files = list_parquet_files(path, storage_options)
    if isinstance(fs, LocalFileSystem):
        fs = None  # pyarrow's own local reads: through fsspec's file objects, the same read costs twice the time
    try:
        schema = outage.call(lambda: pq.read_schema(files[0], filesystem=fs), files[0], outage.DEADLINE_S)
    except _unreadable() as exc:
        raise DataError(f"data.metadata = {path!r}: {files[0]} is not a readable parquet file ({exc}): it is damaged "
                        "(truncated, empty) or not parquet; write it again (for a table of `lit-dist index`: run it "
                        "again)") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise DataError(
            f"data.metadata = {path!r} lacks the required column(s) {', '.join(missing)} (it has: "
            f"{', '.join(schema.names)}). Add them: filename relative to data.root, width and height in pixels."
        )
    renamed = caption_column not in (None, "caption")
    if renamed and caption_column not in schema.names:
        raise DataError(f"caption_column = {caption_column!r}: {path!r} has no such column (it has: "
                        f"{', '.join(schema.names)})")
    if extra_columns is None:
        extra_columns = ["caption"] if "caption" in schema.names else []
    if renamed:  # the captions travel as `caption` whatever the table calls them
        extra_columns = [c for c in extra_columns if c not in ("caption", caption_column)] + [caption_column]
    if mask_column is not None and mask_column not in schema.names:
        raise DataError(f"mask_column = {mask_column!r}: {path!r} has no such column (it has: "
                        f"{', '.join(schema.names)})")
    absent = [c for c in extra_columns if c not in schema.names]
    if absent:
        raise DataError(f"data.extra_columns names {absent}, which {path!r} lacks (it has: {', '.join(schema.names)})")
    optional = ("label", "split", *MEMBER_COLUMNS, *(IDENTITY_COLUMNS if identity else ()))
    wanted = [*REQUIRED_COLUMNS, *(c for c in optional if c in schema.names), *extra_columns,
              *([mask_column] if mask_column is not None else [])]
    try:
        table = outage.call(lambda: pq.read_table(files if len(files) > 1 else files[0],
                                                  columns=list(dict.fromkeys(wanted)), filesystem=fs),
                            path, outage.DEADLINE_S)
    except _unreadable() as exc:
        raise DataError(f"data.metadata = {path!r}: cannot read the table ({exc})") from exc
    meta = clean_table(table, source=path, extra_columns=extra_columns, strict=strict, val_fraction=val_fraction,
                       identity=identity, mask_column=mask_column)
    if renamed:
        meta.extra["caption"] = meta.extra.pop(caption_column)
    return meta


def clean_table(table, source: str = "", extra_columns: list[str] = (), strict: bool = False,
                val_fraction: float = 0.0, identity: bool = False, mask_column: str | None = None) -> Metadata:
    """Drop and count bad rows; convert the columns a run needs; split rows into train/val/test.

    The split comes from a ``split`` column when the table has one, else from a hash of
    each filename (``val_fraction`` of the rows to validation), else all rows train.
    """
    import pyarrow as pa

    from lit_dist.reading.names import hashed_duplicates, name_hashes, sorted_duplicates

    # Chunked as read (one chunk per row group): combining 10 M strings would copy them all.
    filenames = table.column("filename")
    if not pa.types.is_string(filenames.type) and not pa.types.is_large_string(filenames.type):
        raise DataError(f"{source}: column filename has type {filenames.type}; it must hold strings")
    hashing = val_fraction > 0 and "split" not in table.column_names

    def order_and_hashes():
        # Hashes are needed for the split, and to find the duplicates of a table not sorted by name.
        found = sorted_duplicates(filenames)
        return found, name_hashes(filenames) if hashing or found is None else None

    # pyarrow's comparisons and numpy's hashing release the GIL: they run on a second thread beside the checks.
    with ThreadPoolExecutor(1) as pool:
        in_order = pool.submit(order_and_hashes)
        bad, report = _path_and_size_checks(filenames, table.select(["width", "height"]), source)
        duplicate, hashes = in_order.result()
    if duplicate is None:
        duplicate = hashed_duplicates(filenames, hashes, ignore=bad)
    duplicate &= ~bad
    _note(report, _DUPLICATE, duplicate, filenames)
    bad |= duplicate
    if strict and report.total:  # nothing is kept: no "(first kept)" here
        summary = report.summary().replace(_DUPLICATE, "duplicate filename")
        raise DataError(f"{source}: {report.total} bad rows and data.strict is true: {summary}")
    if bad.all():
        raise DataError(f"{source}: none of its {len(bad)} rows is usable: {report.summary() or 'the table is empty'}")

    index_type = np.int32 if len(bad) < 2**31 else np.int64
    if bad.any():
        keep = np.flatnonzero(~bad).astype(index_type)
        kept = table.take(pa.array(keep))
        hashes = None if hashes is None else hashes[keep]
    else:  # the usual case: no copies
        keep, kept = None, table
    meta = Metadata(filenames=kept.column("filename"), sizes=kept.select(["width", "height"]), rows=keep, bad=report,
                    source=source)
    if "label" in kept.column_names:
        meta.labels, meta.classes = _labels(kept.column("label").combine_chunks(), source)
    if "split" in kept.column_names:
        meta.splits = _splits(kept.column("split").combine_chunks(), source)
    elif hashing:
        meta.splits = hash_split(meta.filenames, val_fraction, hashes)
    else:
        meta.splits = np.zeros(len(meta), dtype=np.int8)
    meta.extra = {name: kept.column(name).combine_chunks() for name in extra_columns}
    meta.identity = _identity(kept) if identity else None
    if mask_column is not None:
        masks = kept.column(mask_column).combine_chunks()
        if not (pa.types.is_string(masks.type) or pa.types.is_large_string(masks.type) or pa.types.is_null(masks.type)):
            raise DataError(f"{source}: mask_column {mask_column!r} has type {masks.type}; it must hold paths (strings) "
                            "relative to the image root")
        meta.masks = masks.cast(pa.string())
    if set(MEMBER_COLUMNS) <= set(kept.column_names):
        meta.members = np.stack([kept.column(name).to_numpy().astype(np.int64) for name in MEMBER_COLUMNS], 1)
    return meta


def _identity(table) -> np.ndarray | None:
    """Each file's version from the table's bytes and mtime (or etag) columns; None when it has neither."""
    names = set(table.column_names)
    if "etag" in names:
        sizes = table.column("bytes").to_numpy() if "bytes" in names else None
        return identity_hash(sizes, etags=table.column("etag"))
    if "bytes" in names:
        mtimes = table.column("mtime").to_numpy() if "mtime" in names else None
        return identity_hash(table.column("bytes").to_numpy(), mtimes)
    return None


def _path_and_size_checks(filenames, sizes, source: str) -> tuple[np.ndarray, BadRows]:
    """Rows with a missing or unsafe filename or an unusable size, by reason."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from lit_dist.reading.names import Scratch, scan

    report = BadRows()
    bad, suspicious = scan(filenames)
    _note(report, "missing filename", bad, filenames)
    # A byte scan picked the few candidates; the regexes run on those alone and sort them into reasons.
    where = np.flatnonzero(suspicious)
    where = where[~bad[where]]
    if len(where):
        unsafe = pc.match_substring_regex(filenames.take(pa.array(where)), _UNSAFE).to_numpy(zero_copy_only=False)
        where = where[unsafe]
        suspects = filenames.take(pa.array(where))
        for reason, pattern in _UNSAFE_REASONS.items():
            hit = pc.match_substring_regex(suspects, pattern).to_numpy(zero_copy_only=False)
            mask = np.zeros(len(bad), dtype=bool)
            mask[where[hit]] = True
            mask &= ~bad
            _note(report, reason, mask, filenames)
            bad |= mask
    unusable = np.empty(len(bad), dtype=bool)
    scratch = Scratch()
    for part, widths, heights in _pixel_batches(sizes, source):
        np.less_equal(widths, 0, out=unusable[part])
        unusable[part] |= np.less_equal(heights, 0, out=scratch.get("flag", len(widths), bool))
    if unusable.any():
        unusable &= ~bad
        _note(report, "missing or non-positive width/height", unusable, filenames)
        bad |= unusable
    return bad, report


def _pixel_batches(sizes, source: str):
    """Yield (rows slice, widths, heights) a record batch at a time: int32 views, no copy of whole columns."""
    done = 0
    for batch in sizes.to_batches(max_chunksize=1 << 20):
        widths, heights = (_pixels(batch.column(i), name, source) for i, name in enumerate(("width", "height")))
        yield slice(done, done + len(batch)), widths, heights
        done += len(batch)


def _pixels(column, name: str, source: str) -> np.ndarray:
    """A width or height column as int32; missing, non-finite or negative sizes become 0 (a bad row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise DataError(f"{source}: column {name} has type {column.type}; it must hold numbers (pixels)")
    values = (pc.fill_null(column, 0) if column.null_count else column).to_numpy(zero_copy_only=False)
    if values.dtype == np.int32:
        return values
    if values.dtype.kind == "f":
        values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
    return np.clip(values, 0, 2**31 - 1).astype(np.int32)


def _note(report: BadRows, reason: str, mask: np.ndarray, filenames) -> None:
    count = int(np.count_nonzero(mask))
    if count:
        report.counts[reason] = count
        report.examples[reason] = [filenames[int(i)].as_py() for i in np.flatnonzero(mask)[:3]]


def _labels(column, source: str) -> tuple[np.ndarray, list[str] | None]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if column.null_count:
        raise DataError(f"{source}: {column.null_count} rows have no label; fill them or drop the label column")
    if pa.types.is_integer(column.type):
        return column.to_numpy().astype(np.int64), None
    encoded = pc.cast(column, pa.string()).dictionary_encode()
    classes = encoded.dictionary.to_pylist()
    order = np.argsort(classes)
    rank = np.empty(len(classes), dtype=np.int64)
    rank[order] = np.arange(len(classes))
    return rank[encoded.indices.to_numpy(zero_copy_only=False)], sorted(classes)


def _splits(column, source: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    index = pc.index_in(pc.cast(column, pa.string()), value_set=pa.array(SPLITS)).to_numpy(zero_copy_only=False)
    unknown = np.isnan(index.astype(np.float64))
    if unknown.any():
        examples = sorted({str(v) for v in column.filter(pa.array(unknown)).to_pylist()[:50]})[:5]
        raise DataError(f"{source}: column split has values {examples}; use train, val or test")
    return index.astype(np.int8)


def hash_split(filenames, val_fraction: float, hashes: np.ndarray | None = None) -> np.ndarray:
    """1 (val) or 0 (train) from a hash of each filename's bytes: the same on every rank, run and table order."""
    from lit_dist.reading.names import name_hashes

    hashes = name_hashes(filenames) if hashes is None else hashes
    # The top 53 bits as a fraction in [0, 1): compared with the fraction, not a modulus, so 5 % means 5 %.
    return ((hashes >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction).astype(np.int8)
