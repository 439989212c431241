"""Discovery: build a metadata table by scanning a folder of images, local or remote.

Only each image's header is read (Pillow parses the size without decoding the
pixels), which is two orders of magnitude faster than decoding every image the
way SimpleTuner's discovery does. The result is cached as a parquet table with
each file's size and modification time, so the next scan reads headers only
for new or changed files; ``preserve_cache`` skips the rescan entirely.

Run by several processes (every rank of a multi-process run, or ``lit-dist index`` under
srun/torchrun), the header reads are split among them and rank 0 merges the results: the
table is identical to the one a single process writes.
"""

import contextlib
import hashlib
import logging
import os
import socket
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lit_dist.errors import DataError
from lit_dist.reading.presence import mtime
from lit_dist.reading.unreadable import MISSING, BadImage, decode_errors, permission_denied
from lit_dist.reading.workers import context, ignore_stop_signals
from lit_dist.runtime import outage

if TYPE_CHECKING:
    from lit_dist.runtime.distributed import Comm

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_TRANSPOSED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


def default_cache_path(root: str) -> str:
    """Where the index of ``root`` is cached: ~/.cache/lit-dist/index-<hash of root>.parquet."""
    digest = hashlib.sha1(root.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~"), ".cache", "lit-dist", f"index-{digest}.parquet")


def scan_folder(
    root: str,
    storage_options: dict | None = None,
    labels_from_folders: bool = False,
    workers: int | None = None,
    previous=None,
    progress: bool = True,
    comm: "Comm | None" = None,
):
    """Index every image under ``root``; returns a pyarrow table (None on the ranks of ``comm`` other than 0).

    Columns: ``filename`` (relative to root), ``width``, ``height`` (after EXIF
    rotation), ``label`` (the first folder level, when asked), and ``bytes`` and
    ``mtime`` used to reuse rows of ``previous`` (an earlier result) unchanged.
    Unreadable files get width and height 0, so the normal bad-row check counts them.

    With a ``comm`` of several ranks this is a collective (every rank calls it): rank 0 lists the
    folder and reuses what it can of ``previous`` (only rank 0 looks at it), each rank reads the
    headers of every world-th file left, and rank 0 puts them back in listing order, so its table
    is identical to a one-process scan.
    """

    from lit_dist.runtime.distributed import Comm

    comm = comm or Comm()
    fs, base = outage.url_to_fs(root, **(storage_options or {}))
    listing = None

    def list_once() -> list[str]:
        nonlocal listing
        try:
            listing = _reuse(_list_images(fs, base.rstrip("/")), previous)
        except PermissionError as exc:  # wrong credentials, or a policy without listing: the user's fix
            raise permission_denied(root, exc) from exc
        if not listing.names:  # a mistyped path lists nothing too: never an empty table that "worked"
            what = (f"no images under {root} (files ending in {', '.join(IMAGE_EXTENSIONS)})"
                    if fs.exists(base) else f"{root} does not exist")
            raise DataError(f"{what}: give the folder that holds the images")
        return [listing.names[i] for i in listing.pending]

    # One listing, sent to every rank: listings taken by each rank could differ while files are being added.
    pending = comm.on_rank_zero(list_once, f"listing the images under {root}")
    # The ranks of one node share its cores: each starts its share of the local header readers.
    hosts = comm.all_gather(socket.gethostname())
    ranks_here = hosts.count(hosts[comm.rank])
    # Rank 0's progress bar shows its share: the other ranks' shares are the same size, +-1.
    title = "lit-dist: reading image headers" + (f" (rank 0's share of {comm.world})" if comm.world > 1 else "")
    shares = comm.on_every_rank(
        lambda: _read_sizes(fs, pending[comm.rank :: comm.world], workers,
                            title if progress and comm.rank == 0 else None, ranks_here),
        f"reading the image headers under {root}")
    if comm.rank != 0:
        return None
    for i, (w, h) in zip(listing.pending, merge_shares(shares), strict=True):
        listing.widths[i], listing.heights[i] = w, h
    log.info("lit-dist: indexed %d images under %s (%d headers read by %d processes, %d reused)", len(listing.names),
             root, len(pending), comm.world, len(listing.names) - len(pending))
    return listing.table(labels_from_folders)


def merge_shares(shares: list[list]) -> list:
    """Undo the split ``items[rank::world]``: the items of every rank's share back in their original order."""
    merged = [None] * sum(len(share) for share in shares)
    for rank, share in enumerate(shares):
        merged[rank :: len(shares)] = share
    return merged


@dataclass
class _Listing:
    """The images under a root in sorted order, with what is known of their sizes so far."""

    names: list[str]  # full paths, as the filesystem takes them
    filenames: list[str]  # relative to root: the table's filename column
    sizes: np.ndarray  # bytes, (N,) int64
    mtimes: np.ndarray  # (N,) float64
    widths: np.ndarray  # (N,) int32, 0 until known
    heights: np.ndarray  # (N,) int32
    pending: np.ndarray  # rows whose header must be read: new, or changed since the previous index

    def table(self, labels_from_folders: bool):
        import pyarrow as pa

        columns = {"filename": pa.array(self.filenames, pa.string()), "width": self.widths, "height": self.heights}
        if labels_from_folders:
            columns["label"] = pa.array([f.split("/", 1)[0] if "/" in f else "" for f in self.filenames], pa.string())
        columns["bytes"] = self.sizes
        columns["mtime"] = self.mtimes
        return pa.table(columns)


def _list_images(fs, base: str) -> _Listing:
    listing = fs.find(base, detail=True)
    names = sorted(n for n in listing if n.lower().endswith(IMAGE_EXTENSIONS) and not os.path.basename(n).startswith("."))
    n = len(names)
    return _Listing(
        names=names,
        filenames=[name[len(base) + 1 :] for name in names],
        sizes=np.array([int(listing[name].get("size") or 0) for name in names], dtype=np.int64),
        mtimes=np.array([mtime(listing[name]) for name in names], dtype=np.float64),
        widths=np.zeros(n, dtype=np.int32),
        heights=np.zeros(n, dtype=np.int32),
        pending=np.arange(n),
    )


def _reuse(listing: _Listing, previous) -> _Listing:
    """Take width and height from ``previous`` for files with the same name, byte size and mtime."""
    if previous is None or not len(previous):
        return listing
    known = {f: i for i, f in enumerate(previous.column("filename").to_pylist())}
    prev_bytes, prev_mtime = previous.column("bytes").to_numpy(), previous.column("mtime").to_numpy()
    prev_w, prev_h = previous.column("width").to_numpy(), previous.column("height").to_numpy()
    todo = np.ones(len(listing.names), dtype=bool)
    for i, name in enumerate(listing.filenames):
        j = known.get(name)
        if j is not None and prev_bytes[j] == listing.sizes[i] and prev_mtime[j] == listing.mtimes[i]:
            listing.widths[i], listing.heights[i], todo[i] = prev_w[j], prev_h[j], False
    listing.pending = np.flatnonzero(todo)
    return listing


def _read_sizes(fs, paths: list[str], workers: int | None, progress_title: str | None = None,
                ranks_here: int = 1) -> list[tuple[int, int]]:
    """(width, height) of each of ``paths``, under a progress bar if it has a title; ``ranks_here``:
    processes of the scan on this node, which share its cores."""
    from lit_dist.runtime.counter import counter

    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    workers = workers or (max(1, (os.cpu_count() or 1) // ranks_here) if local else 32)
    # Several chunks per worker keep them all busy to the end; 16..256 paths amortise the hand-off.
    chunk = min(256, max(16, -(-len(paths) // (workers * 4))))
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    # Header parsing is Python code under the GIL: processes for local disks; threads for object
    # stores, where the time goes into waiting for the network.
    if local:
        # Below a few thousand files, starting processes costs more than it saves (~30 us per header).
        pool = (ProcessPoolExecutor(workers, mp_context=context(), initializer=ignore_stop_signals)
                if workers > 1 and len(paths) >= 5000 else None)
        job = _header_sizes_local
        args = chunks
    else:
        pool = ThreadPoolExecutor(workers)
        job = _header_sizes_remote
        args = [(fs, c) for c in chunks]
    results: list[tuple[int, int]] = []
    try:
        with counter(len(paths), progress_title or "", "img", show=progress_title is not None) as bar:
            mapped = pool.map(job, args) if pool else map(job, args)
            for sizes in mapped:
                results.extend(sizes)
                bar.update(len(sizes))
    finally:
        if pool:  # after an error (credentials, an outage) the chunks not started are dropped, not read in vain
            pool.shutdown(cancel_futures=True)
    return results


def header_size(f) -> tuple[int, int]:
    """(width, height) of an open image file as displayed (EXIF rotation applied), from its header alone.

    The bytes are read first and parsed from memory, so an error of the storage (raised by ``f.read``: a
    permission, an outage) is never taken for an image that does not decode (``BadImage``, from the parsing).
    """
    head = f.read(8192)  # the frame header usually sits in the first few KB
    if head[:2] == b"\xff\xd8":
        size = _jpeg_size(head)
        if size is None and len(head) == 8192:  # a large EXIF block (thumbnail) came first
            head += f.read(65536 - 8192)
            size = _jpeg_size(head)
        if size is not None:
            return size
    if len(head) == 8192:
        head += f.read(65536 - len(head))
    try:
        return _pillow_size(head)
    except BadImage:
        if len(head) < 65536:  # that was the whole file
            raise
    return _pillow_size(head + f.read())  # a header past the first 64 KB (a TIFF's directory at its end)


def _pillow_size(data: bytes) -> tuple[int, int]:
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if img.format in ("JPEG", "TIFF", "WEBP", "PNG"):
                orientation = img.getexif().get(0x0112)
                if orientation in _TRANSPOSED:
                    width, height = height, width
    except decode_errors() as exc:
        raise BadImage(str(exc)) from exc
    return width, height


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Size and EXIF orientation from JPEG markers; None if anything is unusual (Pillow decides then).

    Pillow's JPEG opener also parses quantisation and Huffman tables in Python, which is most
    of its time per file; a scan needs only the SOF and APP1 markers, about 5x faster.
    """
    pos, orientation, n = 2, 1, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _SOF_MARKERS:
            if pos + 9 > n:
                return None
            height = int.from_bytes(data[pos + 5 : pos + 7], "big")
            width = int.from_bytes(data[pos + 7 : pos + 9], "big")
            if not width or not height:
                return None
            return (height, width) if orientation in _TRANSPOSED else (width, height)
        if marker == 0xE1 and data[pos + 4 : pos + 10] == b"Exif\0\0":
            orientation = _exif_orientation(data[pos + 10 : pos + 2 + length])
        if marker == 0xDA:  # start of scan before any frame header: not a JPEG we understand
            return None
        pos += 2 + length
    return None


_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _exif_orientation(tiff: bytes) -> int:
    """The orientation tag (0x0112) of IFD0 of an EXIF TIFF block, 1 if absent or unreadable."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    for i in range(int.from_bytes(tiff[ifd : ifd + 2], order)):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            return 1
        if int.from_bytes(tiff[entry : entry + 2], order) == 0x0112:
            return int.from_bytes(tiff[entry + 8 : entry + 10], order)
    return 1


def _header_sizes_local(paths: list[str]) -> list[tuple[int, int]]:
    return [_size_or_zero(lambda p=path: open(p, "rb"), path) for path in paths]


def _header_sizes_remote(job) -> list[tuple[int, int]]:
    fs, paths = job
    # A header fits in the first block of 64 KB: one request per file.
    return [_size_or_zero(lambda p=path: fs.open(p, "rb", block_size=64 * 1024), fs.unstrip_protocol(path))
            for path in paths]


def _size_or_zero(opener, path: str) -> tuple[int, int]:
    """(width, height) of one file; (0, 0) for an image that does not decode or a file gone since the listing,
    which the metadata check reports as a bad row. A permission error is a data error naming the file (wrong
    credentials fail every file: one message, not a table of bad rows); any other error of the storage (an
    outage) propagates."""
    try:
        with opener() as f:
            return header_size(f)
    except (BadImage, *MISSING):
        return (0, 0)
    except PermissionError as exc:
        raise permission_denied(path, exc) from exc


def load_or_scan(root: str, cache_path: str, storage_options: dict | None = None, labels_from_folders: bool = False,
                 preserve_cache: bool = False, workers: int | None = None, progress: bool = True,
                 comm: "Comm | None" = None) -> str:
    """Make sure ``cache_path`` holds the index of ``root``; returns ``cache_path``.

    With a ``comm`` of several ranks a collective (every rank calls it): the header reads are split
    among the ranks, rank 0 writes the table, and every rank can read it when this returns.
    """

    from lit_dist.runtime.distributed import Comm

    comm = comm or Comm()
    cache_fs, cache_file = outage.url_to_fs(cache_path)
    if preserve_cache:
        # Decided together: every rank must take the same branch, and with node-local cache folders
        # (the default ~/.cache on nodes without a shared home) some ranks may lack the file. A damaged
        # copy (truncated, empty) counts as none: the folder is scanned again, never a run stopped on it.
        if all(comm.all_gather(cache_fs.exists(cache_file) and _readable_index(cache_path))):
            if comm.rank == 0:
                log.info("lit-dist: using the cached index %s as it is (preserve_cache)", cache_path)
            return cache_path
    previous = read_previous_index(cache_path) if comm.rank == 0 else None
    table = scan_folder(root, storage_options, labels_from_folders, workers, previous, progress, comm)
    publish_table(table, cache_path, comm)
    return cache_path


def _readable_index(path: str) -> bool:
    """Whether ``path`` is a whole index table (its parquet footer and columns read), warning when it is not."""
    import pyarrow.parquet as pq

    try:
        fs, file = outage.url_to_fs(path)
        with fs.open(file, "rb") as f:
            names = pq.read_schema(f).names
    except (OSError, ValueError) as exc:  # pyarrow's errors for a file that is not parquet are both
        log.warning("lit-dist: the cached index %s is damaged (%s); scanning the folder again (data.preserve_cache "
                    "keeps only a readable index)", path, exc)
        return False
    return {"filename", "width", "height"} <= set(names)


def read_previous_index(path: str):
    """The index written at ``path`` by an earlier scan, or None: missing, unreadable, or not an index
    (without bytes/mtime columns). Never raises, so rank 0 can call it alone before a collective: without
    it the scan just reads every header."""
    import pyarrow.parquet as pq

    try:
        fs, file = outage.url_to_fs(path)
        if not fs.exists(file):
            return None
        table = pq.read_table(file, filesystem=fs)
    except Exception as exc:  # noqa: BLE001 - rank 0 alone, before a collective: a damaged index costs a rescan
        log.warning("lit-dist: cannot read the earlier index %s (%s); reading every header again", path, exc)
        return None
    return table if {"filename", "width", "height", "bytes", "mtime"} <= set(table.column_names) else None


def publish_table(table, path: str, comm: "Comm") -> None:
    """Rank 0 writes ``table`` (the others pass None) atomically at ``path``; every rank returns once it can
    read it there. A rank that cannot see rank 0's file (node-local storage) writes its own copy."""

    comm.on_rank_zero(lambda: write_table_atomically(table, path), f"writing the index {path}")
    fs, file = outage.url_to_fs(path)
    missing = comm.all_gather(not fs.exists(file))
    if any(missing):
        table = comm.broadcast(table)
        comm.on_every_rank(lambda: write_table_atomically(table, path) if missing[comm.rank] else None,
                           f"writing a node-local copy of the index {path}")


def write_table_atomically(table, path: str) -> None:
    """Write a parquet file under a temporary name in the same folder, then rename it into place."""
    import pyarrow.parquet as pq

    fs, target = outage.url_to_fs(path)
    parent = os.path.dirname(target)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    # Host and pid: writers on several nodes of a shared folder never share a temporary file.
    tmp = f"{target}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        pq.write_table(table, tmp, filesystem=fs)
    except OSError as exc:  # a full disk: no half-written file stays, and the error names the one that did not fit
        with contextlib.suppress(OSError):
            fs.rm(tmp)
        raise OSError(exc.errno, exc.strerror or str(exc), path) from exc
    fs.mv(tmp, target)
