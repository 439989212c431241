"""Discovery: build a metadata table by scanning a folder of images, local or remote.

Only each image's header is read (Pillow parses the size without decoding the
pixels), which is two orders of magnitude faster than decoding every image the
way SimpleTuner's discovery does. The result is cached as a parquet table with
each file's size and modification time, so the next scan reads headers only
for new or changed files; ``preserve_cache`` skips the rescan entirely.
"""

import hashlib
import logging
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np

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
):
    """Index every image under ``root``; returns a pyarrow table.

    Columns: ``filename`` (relative to root), ``width``, ``height`` (after EXIF
    rotation), ``label`` (the first folder level, when asked), and ``bytes`` and
    ``mtime`` used to reuse rows of ``previous`` (an earlier result) unchanged.
    Unreadable files get width and height 0, so the normal bad-row check counts them.
    """
    import fsspec
    import pyarrow as pa

    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    base = base.rstrip("/")
    listing = fs.find(base, detail=True)
    names = sorted(n for n in listing if n.lower().endswith(IMAGE_EXTENSIONS) and not os.path.basename(n).startswith("."))
    filenames = [n[len(base) + 1 :] for n in names]
    sizes = np.array([int(listing[n].get("size") or 0) for n in names], dtype=np.int64)
    mtimes = np.array([_mtime(listing[n]) for n in names], dtype=np.float64)

    widths = np.zeros(len(names), dtype=np.int32)
    heights = np.zeros(len(names), dtype=np.int32)
    todo = np.ones(len(names), dtype=bool)
    if previous is not None and len(previous):
        known = {f: i for i, f in enumerate(previous.column("filename").to_pylist())}
        prev_bytes = previous.column("bytes").to_numpy()
        prev_mtime = previous.column("mtime").to_numpy()
        prev_w, prev_h = previous.column("width").to_numpy(), previous.column("height").to_numpy()
        for i, name in enumerate(filenames):
            j = known.get(name)
            if j is not None and prev_bytes[j] == sizes[i] and prev_mtime[j] == mtimes[i]:
                widths[i], heights[i], todo[i] = prev_w[j], prev_h[j], False
    pending = np.flatnonzero(todo)
    if len(pending):
        for i, (w, h) in zip(pending, _read_sizes(fs, [names[i] for i in pending], workers, progress), strict=True):
            widths[i], heights[i] = w, h
    columns = {"filename": pa.array(filenames, pa.string()), "width": widths, "height": heights}
    if labels_from_folders:
        columns["label"] = pa.array([f.split("/", 1)[0] if "/" in f else "" for f in filenames], pa.string())
    columns["bytes"] = sizes
    columns["mtime"] = mtimes
    log.info("lit-dist: indexed %d images under %s (%d headers read, %d reused)", len(names), root, len(pending),
             len(names) - len(pending))
    return pa.table(columns)


def _mtime(info: dict) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0)


def _read_sizes(fs, paths: list[str], workers: int | None, progress: bool) -> list[tuple[int, int]]:
    from tqdm import tqdm

    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    workers = workers or (os.cpu_count() or 1 if local else 32)
    # Several chunks per worker keep them all busy to the end; 16..256 paths amortise the hand-off.
    chunk = min(256, max(16, -(-len(paths) // (workers * 4))))
    chunks = [paths[i : i + chunk] for i in range(0, len(paths), chunk)]
    # Header parsing is Python code under the GIL: processes for local disks; threads for object
    # stores, where the time goes into waiting for the network.
    if local:
        # Below a few thousand files, starting processes costs more than it saves (~30 us per header).
        pool = ProcessPoolExecutor(workers) if workers > 1 and len(paths) >= 5000 else None
        job = _header_sizes_local
        args = chunks
    else:
        pool = ThreadPoolExecutor(workers)
        job = _header_sizes_remote
        args = [(fs, c) for c in chunks]
    results: list[tuple[int, int]] = []
    with tqdm(total=len(paths), desc="lit-dist: reading image headers", unit="img", disable=not progress, mininterval=1) as bar:
        mapped = pool.map(job, args) if pool else map(job, args)
        for sizes in mapped:
            results.extend(sizes)
            bar.update(len(sizes))
    if pool:
        pool.shutdown()
    return results


def header_size(f) -> tuple[int, int]:
    """(width, height) of an open image file as displayed (EXIF rotation applied), from its header alone."""
    head = f.read(8192)  # the frame header usually sits in the first few KB
    if head[:2] == b"\xff\xd8":
        size = _jpeg_size(head)
        if size is None and len(head) == 8192:  # a large EXIF block (thumbnail) came first
            head += f.read(65536 - 8192)
            size = _jpeg_size(head)
        if size is not None:
            return size
    f.seek(0)
    from PIL import Image

    with Image.open(f) as img:
        width, height = img.size
        if img.format in ("JPEG", "TIFF", "WEBP", "PNG"):
            orientation = img.getexif().get(0x0112)
            if orientation in _TRANSPOSED:
                width, height = height, width
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
    out = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                out.append(header_size(f))
        except Exception:  # unreadable: reported as a bad row (size 0) by the metadata check
            out.append((0, 0))
    return out


def _header_sizes_remote(job) -> list[tuple[int, int]]:
    fs, paths = job
    out = []
    for path in paths:
        try:
            with fs.open(path, "rb", block_size=64 * 1024) as f:  # a header fits in the first block
                out.append(header_size(f))
        except Exception:
            out.append((0, 0))
    return out


def load_or_scan(root: str, cache_path: str, storage_options: dict | None = None, labels_from_folders: bool = False,
                 preserve_cache: bool = False, workers: int | None = None, progress: bool = True) -> str:
    """Make sure ``cache_path`` holds the index of ``root``; returns ``cache_path``."""
    import fsspec
    import pyarrow.parquet as pq

    cache_fs, cache_file = fsspec.core.url_to_fs(cache_path)
    previous = None
    if cache_fs.exists(cache_file):
        if preserve_cache:
            log.info("lit-dist: using the cached index %s as it is (preserve_cache)", cache_path)
            return cache_path
        previous = pq.read_table(cache_file, filesystem=cache_fs)
    table = scan_folder(root, storage_options, labels_from_folders, workers, previous, progress)
    write_table_atomically(table, cache_path)
    return cache_path


def write_table_atomically(table, path: str) -> None:
    """Write a parquet file under a temporary name in the same folder, then rename it into place."""
    import fsspec
    import pyarrow.parquet as pq

    fs, target = fsspec.core.url_to_fs(path)
    parent = os.path.dirname(target)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    pq.write_table(table, tmp, filesystem=fs)
    fs.mv(tmp, target)
