"""Files that are either complete or absent, with their sha256 computed while they are written.

Local and shared filesystems: the file is written under a temporary name **in the same folder**,
flushed, fsynced, renamed, and the folder is fsynced. Lightning's own atomic save (fsspec's
transaction) puts the temporary file in ``$TMPDIR``; when that is another filesystem (local /tmp,
checkpoints on NFS or Lustre) the final step is a copy, and a kill during it leaves a truncated file
at the final path.

Object stores (``s3://...`` through fsspec): an object only becomes visible when its upload
completes, so writing straight to the final key is already all-or-nothing, provided an upload that
failed half-way is thrown away rather than closed (closing publishes what was written so far).
Every remote operation of the checkpoint code goes through ``through_outage``: one upload, listing,
read or deletion, retried whole through an outage of the store (``lit_dist.outage``).
"""

import ctypes
import hashlib
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from lit_dist import outage

T = TypeVar("T")

_HASH_IN_PARALLEL_BYTES = 1 << 20  # smaller writes are hashed inline: a thread hand-off costs more
_WRITEBACK_EVERY_BYTES = 64 << 20
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """Size and sha256 of one written file, as the manifest records them."""

    size: int
    sha256: str


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path on it) for a local path or an fsspec URL."""
    return outage.url_to_fs(url, **(storage_options or {}))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def through_outage(fs: fsspec.AbstractFileSystem, operation: Callable[[], T], verb: str, what: str,
                   deadline_s: float = outage.DEADLINE_S, who: str = "") -> T:
    """``operation()``: once on a local filesystem; on an object store, retried through an outage for up to
    ``deadline_s`` seconds from its first failure, then ``StoreUnreachable`` (exit 17) saying "``verb`` ``what``".
    ``operation`` must be idempotent as a whole (one upload, listing, read or deletion): it may run again after
    any part of it ran."""
    if is_local(fs):
        return operation()
    return outage.call(operation, what, deadline_s, who, verb=verb, knob="checkpoint.outage_deadline_s")


def _sync_file_range():
    """Linux's sync_file_range, to start writing pages to disk while more are written; None elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class HashingWriter:
    """A file-like object for ``torch.save``: writes go to ``file`` while a helper thread hashes them.

    torch.save hands over each tensor's bytes in one ``write``; hashing them on another thread while
    this one copies them into the page cache costs max(write, hash) instead of their sum (hashlib and
    file writes both release the GIL). Every ``_WRITEBACK_EVERY_BYTES`` the kernel is asked to start
    writing the pages out, so that the final fsync finds little left to do.
    """

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit-dist-sha256")  # its thread starts when used

    _pool = _new_pool()

    @classmethod
    def _after_fork(cls) -> None:
        # A forked child has the parent's pool but not its thread: a hash handed to it would never run, and
        # the child's first large write would wait for it forever.
        cls._pool = cls._new_pool()

    def __init__(self, file: BinaryIO, fd: int | None = None):
        self.file, self.fd = file, fd
        self.sha = hashlib.sha256()
        self.size = 0
        self._synced = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _HASH_IN_PARALLEL_BYTES:
            # The view may point into memory torch frees after write() returns: wait before returning.
            hashing = self._pool.submit(self.sha.update, view)
            self.file.write(view)
            hashing.result()
        else:
            self.sha.update(view)
            self.file.write(view)
        self.size += view.nbytes
        if self.fd is not None and _SYNC_FILE_RANGE and self.size - self._synced >= _WRITEBACK_EVERY_BYTES:
            self.file.flush()
            _SYNC_FILE_RANGE(self.fd, self._synced, self.size - self._synced, _SYNC_FILE_RANGE_WRITE)
            self._synced = self.size
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> FileEntry:
        return FileEntry(self.size, self.sha.hexdigest())


os.register_at_fork(after_in_child=HashingWriter._after_fork)


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; the rename itself is still atomic
    finally:
        os.close(fd)


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[HashingWriter], None]) -> FileEntry:
    """Call ``write(file)`` so that ``path`` ends up complete or absent; returns its size and sha256."""
    if not is_local(fs):
        f = fs.open(path, "wb")
        uploaded = False
        try:
            writer = HashingWriter(f)
            write(writer)
            f.close()  # completes the upload: the object appears, whole, at its key
            uploaded = True
        finally:
            if not uploaded:
                _throw_away(f)
        return writer.entry()
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    renamed = False
    try:
        with open(tmp, "wb", buffering=_CHUNK) as f:
            writer = HashingWriter(f, f.fileno())
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        renamed = True
    finally:
        if not renamed and os.path.exists(tmp):  # whatever stopped it (a full disk, Ctrl-C), no temporary file stays
            os.unlink(tmp)
    fsync_dir(folder)
    return writer.entry()


def _throw_away(f) -> None:
    """Abandon an upload that failed half-way. fsspec's ``__exit__`` (and the garbage collector) would close the
    file, and closing completes the upload with the parts written so far: a truncated object at the final key."""
    if not isinstance(f, AbstractBufferedFile) or f.closed:
        return  # not a buffered upload, or the failure was in completing it (nothing was published)
    f.closed = True  # never completed later
    # s3fs aborts the multipart upload. If that fails too (the store is away), the error is raised with the
    # write's as its context; the parts stay invisible until the bucket's lifecycle rule removes them.
    f.discard()


def write_bytes_atomically(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> FileEntry:
    return write_atomically(fs, path, lambda f: f.write(data))


def hash_file(fs: fsspec.AbstractFileSystem, path: str, fsync: bool = False) -> FileEntry:
    """Size and sha256 of a written file; ``fsync`` also makes a local file durable (for files other code wrote)."""
    sha, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
        if fsync and is_local(fs):
            os.fsync(f.fileno())
    return FileEntry(size, sha.hexdigest())

