"""The metadata table: one row per image, ``filename, width, height`` plus optional columns.

A table is one parquet file, a folder of them, or a glob, at a local path or an
fsspec URL (``s3://bucket/meta/``). ``filename`` is relative to the dataset
root. ``label`` (int, or strings mapped to sorted class indices), ``caption``
and any other columns are optional; a ``split`` column with ``train`` / ``val``
/ ``test`` values overrides the hash split.

Everything here is vectorised with pyarrow.compute: checking tens of millions
of rows must take seconds, not a Python loop per row. Filenames stay a pyarrow
array (one buffer, shared by forked loader workers without copies) instead of
a numpy array of Python strings.
"""

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from lit_dist.errors import DataError

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("filename", "width", "height")
SPLITS = ("train", "val", "test")
_GLOB_CHARS = set("*?[")
_UNSAFE_REASONS = {
    "URL instead of a relative path": r"^[A-Za-z][A-Za-z0-9+.-]*://",
    "absolute path": r"^(/|\\|[A-Za-z]:[\\/])",
    "'..' in the path (would escape the dataset root)": r"(^|[\\/])\.\.([\\/]|$)",
}
_UNSAFE = "|".join(f"({p})" for p in _UNSAFE_REASONS.values())


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
    widths: np.ndarray  # int32
    heights: np.ndarray  # int32
    rows: np.ndarray  # int32 (int64 past 2**31 rows) row number of each entry in the (concatenated) table
    labels: np.ndarray | None = None  # int64 class indices
    classes: list[str] | None = None  # names of the classes when labels were strings
    splits: np.ndarray | None = None  # int8 index into SPLITS
    extra: dict = field(default_factory=dict)  # name -> pyarrow array, passed through to batches
    bad: BadRows = field(default_factory=BadRows)
    source: str = ""

    def __len__(self) -> int:
        return len(self.widths)


def list_parquet_files(path: str, storage_options: dict | None = None) -> tuple["fsspec.AbstractFileSystem", list[str]]:  # noqa: F821
    """The parquet files that ``path`` names: a file, a folder (searched recursively) or a glob."""
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if _GLOB_CHARS & set(fs_path):
        files = sorted(fs.glob(fs_path))
    elif fs.isdir(fs_path):
        files = sorted(f for f in fs.find(fs_path) if f.endswith(".parquet"))
    elif fs.exists(fs_path):
        files = [fs_path]
    else:
        files = []
    if not files:
        raise DataError(
            f"data.metadata = {path!r}: no parquet file there. Point it at a parquet table (a file, a folder of "
            f".parquet files or a glob) with columns {', '.join(REQUIRED_COLUMNS)}, scan an image folder instead "
            "with data.scan_root, or set data.create_demo_if_missing: true to generate the demo dataset there."
        )
    return fs, files


def read_metadata(
    path: str,
    storage_options: dict | None = None,
    extra_columns: list[str] | None = None,
    strict: bool = False,
) -> Metadata:
    """Read, check and clean a metadata table.

    Args:
        path: File, folder or glob, local or fsspec URL.
        storage_options: fsspec options (endpoint, region; credentials come from the environment).
        extra_columns: Columns passed through to batches; None: ``caption`` if the table has it.
        strict: Raise on any bad row instead of skipping it.
    """
    import pyarrow.parquet as pq

    fs, files = list_parquet_files(path, storage_options)
    try:
        schema = pq.read_schema(files[0], filesystem=fs)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"data.metadata = {path!r}: {files[0]} is not a readable parquet file ({exc})") from exc
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise DataError(
            f"data.metadata = {path!r} lacks the required column(s) {', '.join(missing)} (it has: "
            f"{', '.join(schema.names)}). Add them: filename relative to data.root, width and height in pixels."
        )
    if extra_columns is None:
        extra_columns = ["caption"] if "caption" in schema.names else []
    absent = [c for c in extra_columns if c not in schema.names]
    if absent:
        raise DataError(f"data.extra_columns names {absent}, which {path!r} lacks (it has: {', '.join(schema.names)})")
    wanted = [*REQUIRED_COLUMNS, *(c for c in ("label", "split") if c in schema.names), *extra_columns]
    try:
        table = pq.read_table(files if len(files) > 1 else files[0], columns=list(dict.fromkeys(wanted)), filesystem=fs)
    except Exception as exc:
        raise DataError(f"data.metadata = {path!r}: cannot read the table ({exc})") from exc
    return clean_table(table, source=path, extra_columns=extra_columns, strict=strict)


def clean_table(table, source: str = "", extra_columns: list[str] = (), strict: bool = False) -> Metadata:
    """Drop and count bad rows; convert the columns a run needs."""
    import pyarrow as pa

    # Chunked as read (one chunk per row group): combining 10 M strings would copy them all.
    filenames = table.column("filename")
    if not pa.types.is_string(filenames.type) and not pa.types.is_large_string(filenames.type):
        raise DataError(f"{source}: column filename has type {filenames.type}; it must hold strings")
    widths = _as_number(table.column("width"), "width", source)
    heights = _as_number(table.column("height"), "height", source)
    # The duplicate check (a sort of all names, which releases the GIL) runs beside the others.
    with ThreadPoolExecutor(1) as pool:
        duplicates = pool.submit(_duplicates, filenames)
        bad, report = _path_and_size_checks(filenames, widths, heights)
        duplicate = duplicates.result() & ~bad

    _note(report, "duplicate filename (first kept)", duplicate, filenames)
    bad |= duplicate
    if strict and report.total:
        raise DataError(f"{source}: {report.total} bad rows and data.strict is true: {report.summary()}")
    if bad.all():
        raise DataError(f"{source}: none of its {len(bad)} rows is usable: {report.summary() or 'the table is empty'}")

    index_type = np.int32 if len(bad) < 2**31 else np.int64
    if bad.any():
        keep = np.flatnonzero(~bad).astype(index_type)
        kept = table.take(pa.array(keep))
        widths, heights = widths.take(pa.array(keep)), heights.take(pa.array(keep))
    else:  # the usual case: no copies
        keep, kept = np.arange(len(bad), dtype=index_type), table
    meta = Metadata(
        filenames=kept.column("filename"),
        widths=widths.to_numpy(zero_copy_only=False).astype(np.int32),
        heights=heights.to_numpy(zero_copy_only=False).astype(np.int32),
        rows=keep,
        bad=report,
        source=source,
    )
    if "label" in kept.column_names:
        meta.labels, meta.classes = _labels(kept.column("label").combine_chunks(), source)
    if "split" in kept.column_names:
        meta.splits = _splits(kept.column("split").combine_chunks(), source)
    meta.extra = {name: kept.column(name).combine_chunks() for name in extra_columns}
    return meta


def _path_and_size_checks(filenames, widths, heights) -> tuple[np.ndarray, BadRows]:
    """Rows with a missing or unsafe filename or an unusable size, by reason."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bad = np.zeros(len(filenames), dtype=bool)
    report = BadRows()
    missing = pc.fill_null(pc.equal(pc.binary_length(filenames), 0), True).to_numpy(zero_copy_only=False)
    _note(report, "missing filename", missing, filenames)
    bad |= missing
    # Cheap scans pick the few candidates; the regexes then run on those alone and sort them into reasons.
    leading = pc.or_(pc.starts_with(filenames, "/"), pc.starts_with(filenames, "\\"))
    candidates = (pc.fill_null(leading, False).to_numpy(zero_copy_only=False) | _rows_containing(filenames, (b":", b".."))) & ~bad
    unsafe = np.zeros(len(bad), dtype=bool)
    if candidates.any():
        where = np.flatnonzero(candidates)
        unsafe[where] = pc.match_substring_regex(filenames.take(pa.array(where)), _UNSAFE).to_numpy(zero_copy_only=False)
    if unsafe.any():
        suspects = filenames.filter(pa.array(unsafe))
        where = np.flatnonzero(unsafe)
        for reason, pattern in _UNSAFE_REASONS.items():
            hit = pc.match_substring_regex(suspects, pattern).to_numpy(zero_copy_only=False)
            mask = np.zeros(len(bad), dtype=bool)
            mask[where[hit]] = True
            mask &= ~bad
            _note(report, reason, mask, filenames)
            bad |= mask
    sizes = pc.or_(pc.fill_null(pc.less_equal(widths, 0), True), pc.fill_null(pc.less_equal(heights, 0), True))
    sizes = sizes.to_numpy(zero_copy_only=False) & ~bad
    _note(report, "missing or non-positive width/height", sizes, filenames)
    bad |= sizes
    return bad, report


def _offsets(chunk) -> np.ndarray:
    """The byte offsets of a pyarrow string array's values (n + 1 of them), as a view of its buffer."""
    import pyarrow as pa

    width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
    return np.frombuffer(chunk.buffers()[1], dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]


def _rows_containing(strings, needles: tuple[bytes, ...]) -> np.ndarray:
    """True for each string that contains any of ``needles``.

    pyarrow's match_substring takes about 35 ns per row; ``bytes.find`` over each chunk's
    whole character buffer runs at memchr speed and, in the usual case of no match at
    all, answers for a million rows at once.
    """
    import pyarrow as pa

    mask = np.zeros(len(strings), dtype=bool)
    done = 0
    for chunk in strings.chunks if isinstance(strings, pa.ChunkedArray) else [strings]:
        if len(chunk):
            offsets = _offsets(chunk)
            data = chunk.buffers()[2].to_pybytes() if chunk.buffers()[2] else b""
            first, last = int(offsets[0]), int(offsets[-1])
            ends = offsets[1:]
            for needle in needles:
                at = data.find(needle, first, last)
                while at != -1:
                    row = int(np.searchsorted(ends, at, side="right"))  # the string whose bytes hold `at`
                    if at + len(needle) <= ends[row]:  # not straddling two strings
                        mask[done + row] = True
                    at = data.find(needle, at + 1, last)
        done += len(chunk)
    return mask


def _as_number(column, name: str, source: str):
    import pyarrow as pa

    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise DataError(f"{source}: column {name} has type {column.type}; it must hold numbers (pixels)")
    return column


def _note(report: BadRows, reason: str, mask: np.ndarray, filenames) -> None:
    count = int(mask.sum())
    if count:
        report.counts[reason] = count
        report.examples[reason] = [filenames[int(i)].as_py() for i in np.flatnonzero(mask)[:3]]


def _duplicates(filenames) -> np.ndarray:
    """True for every occurrence of a filename after its first.

    Sorting is about three times faster than pyarrow's hash-based dictionary_encode
    or unique on long unique strings (measured at 10 M rows), and a stable sort
    keeps equal names in row order, so the first of each run is the one kept.
    """
    import pyarrow.compute as pc

    duplicate = np.zeros(len(filenames), dtype=bool)
    if len(filenames) < 2:
        return duplicate
    order = pc.sort_indices(filenames)
    ordered = filenames.take(order)
    same = pc.fill_null(pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1)), False)
    same = same.to_numpy(zero_copy_only=False)
    if same.any():
        duplicate[order.to_numpy()[1:][same]] = True
    return duplicate


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


def _hash_unit(chunk) -> np.ndarray:
    """A number in [0, 1) per string of a pyarrow string array, from its bytes alone."""

    offsets = _offsets(chunk).astype(np.int64)
    data = np.frombuffer(chunk.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].astype(np.uint64)
    starts = offsets[:-1] - offsets[0]
    position = np.arange(len(data), dtype=np.uint64) - np.repeat(starts, np.diff(offsets)).astype(np.uint64)
    # Position-dependent per-byte mix, summed per string, then the splitmix64 finaliser.
    mixed = ((data + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)) ^ ((position + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9))
    h = np.add.reduceat(mixed, starts)
    h ^= h >> np.uint64(31)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(29)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def hash_split(filenames, val_fraction: float, chunk_rows: int = 1 << 20) -> np.ndarray:
    """0 (train) or 1 (val) from a hash of each filename's bytes: the same on every rank and every run.

    pyarrow exposes no per-row hash, and a Python loop (zlib.crc32) takes seconds
    per million rows, so this hashes the string buffer in numpy, a chunk of rows
    at a time to bound memory.
    """
    import pyarrow as pa

    pieces = filenames.chunks if isinstance(filenames, pa.ChunkedArray) else [filenames]
    out = np.empty(len(filenames), dtype=np.int8)
    done = 0
    for piece in pieces:
        for lo in range(0, len(piece), chunk_rows):
            chunk = piece.slice(lo, chunk_rows)
            out[done : done + len(chunk)] = _hash_unit(chunk) < val_fraction
            done += len(chunk)
    return out
