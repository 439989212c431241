"""Files that are either complete or absent, with their sha256 computed while they are written.

Local and shared filesystems: the file is written under a temporary name **in the same folder**
(around the page cache where the filesystem allows it: ``DurableFile``), fsynced, renamed, and the folder
is fsynced. Lightning's own atomic save (fsspec's
transaction) puts the temporary file in ``$TMPDIR``; when that is another filesystem (local /tmp,
checkpoints on NFS or Lustre) the final step is a copy, and a kill during it leaves a truncated file
at the final path.

Object stores (``s3://...`` through fsspec): an object only becomes visible when its upload
completes, so writing straight to the final key is already all-or-nothing, provided an upload that
failed half-way is thrown away rather than closed (closing publishes what was written so far).
Every remote operation of the checkpoint code goes through ``through_outage``: one upload, listing,
read or deletion, retried whole through an outage of the store (``lit_dist.runtime.outage``).
"""

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from lit_dist.ckpt.space import os_errors
from lit_dist.runtime import outage

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
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; 0 elsewhere: buffered writes
_ALIGN = 4096  # what O_DIRECT asks of a buffer's address, a write's offset and length (a logical block, at most 4 KiB)


class DurableFile:
    """A new local file, written around the page cache (O_DIRECT) from an aligned buffer; on disk once ``close()``
    returns (its tail written, its size set, fsynced).

    Why around the cache: on the 2-core VM, two processes each writing 265 MB through the page cache ran at about
    300 MB/s each, 250 MB/s with the fsync a checkpoint needs; around the cache, 1,000 MB/s each, fsync included,
    and a sharded save 1.5x a bare torch.save (docs/benchmarks.md). A buffered write pays for page-cache pages and
    then for the kernel's write-back, both on the cores that train; a direct write is one copy into this buffer
    and a DMA. Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some network filesystems; at open or
    at the first write), and for a file read again soon (``through_cache``), the writes are buffered, and the
    kernel is asked to start writing pages out every ``_WRITEBACK_EVERY_BYTES`` so that the final fsync finds
    little left. Bytes reach the file as the buffer fills and at ``close()``, not at ``flush()``: a direct write
    cannot end mid-block. A with-block that raises closes the file unfinished.
    """

    def __init__(self, path: str, buffer_bytes: int = _CHUNK, through_cache: bool = False):
        """``through_cache``: buffered on purpose, for a file read again soon (a cache shard every rank reads next)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        self.path = path
        self.fd, self.direct = None, bool(_O_DIRECT) and not through_cache
        if self.direct:
            try:
                self.fd = os.open(path, flags | _O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd is None:
            self.fd = os.open(path, flags, 0o666)
        self._buffer = mmap.mmap(-1, buffer_bytes)  # anonymous memory: page-aligned
        self._view = memoryview(self._buffer)
        self._filled = 0  # bytes in the buffer
        self.size = 0  # bytes written into the file so far, the buffer's included
        self._out = 0  # bytes handed to the kernel (a direct tail's padding included)
        self._synced = 0  # buffered: bytes the kernel was asked to write out

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        while view.nbytes:
            k = min(view.nbytes, len(self._view) - self._filled)
            self._view[self._filled : self._filled + k] = view[:k]
            self._filled += k
            view = view[k:]
            if self._filled == len(self._view):
                self._named(self._drain)
        self.size += n
        return n

    def flush(self) -> None:
        pass  # see the class: bytes reach the file when the buffer fills and at close()

    def fileno(self) -> int:
        return self.fd

    def _drain(self) -> None:
        length = self._filled
        if self.direct and length % _ALIGN:  # only the tail, at close(): padded, then cut back to size
            length += _ALIGN - length % _ALIGN
            self._view[self._filled : length] = bytes(length - self._filled)
        done = 0
        while done < length:
            with self._view[done:length] as pending:  # released even when the write raises (see _release)
                try:
                    written = os.write(self.fd, pending)
                except OSError as exc:
                    if not (self.direct and exc.errno == errno.EINVAL):
                        raise
                    self._go_buffered()  # the device wants a larger alignment, or the filesystem refuses now
                    continue
            done += written
            if self.direct and done < length and written % _ALIGN:
                self._go_buffered()  # a short write left the offset mid-block
        self._filled = 0
        self._out += length
        if not self.direct and _SYNC_FILE_RANGE and self._out - self._synced >= _WRITEBACK_EVERY_BYTES:
            _SYNC_FILE_RANGE(self.fd, self._synced, self._out - self._synced, _SYNC_FILE_RANGE_WRITE)
            self._synced = self._out

    def _go_buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False

    def close(self) -> None:
        """Write the tail, set the size, fsync, close: the file is on disk when this returns."""
        if self.fd is None:
            return
        try:
            self._named(self._finish)
        finally:
            self._release()

    def _finish(self) -> None:
        if self._filled:
            self._drain()
        if self._out != self.size:  # the tail's padding
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)

    def _named(self, work: Callable[[], None]) -> None:
        """``work()``; its OSError names this file (os.write's and fsync's name none: a full disk's line would
        not say which file did not fit)."""
        try:
            work()
        except OSError as exc:
            if exc.filename is None:
                exc.filename = self.path
            raise

    def _release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        self._view.release()
        self._buffer.close()  # no view of it is left: each one was released (else BufferError)

    def __enter__(self) -> "DurableFile":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._release()  # unfinished: whoever opened it deletes it


class HashingWriter:
    """A file-like object for ``torch.save``: writes go to ``file`` while a helper thread hashes them.

    torch.save hands over each tensor's bytes in one ``write``; hashing them on another thread while
    this one copies them into the file's buffer costs max(write, hash) instead of their sum (hashlib and
    file writes both release the GIL).
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

    def __init__(self, file: BinaryIO):
        self.file = file
        self.sha = hashlib.sha256()
        self.size = 0

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


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[HashingWriter], None],
                     through_cache: bool = False) -> FileEntry:
    """Call ``write(file)`` so that ``path`` ends up complete or absent; returns its size and sha256.
    ``through_cache``: a local file is written through the page cache (``DurableFile``), to be read again soon."""
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
        with DurableFile(tmp, through_cache=through_cache) as f:
            writer = HashingWriter(f)
            write(writer)
        os.replace(tmp, path)
        renamed = True
    except Exception as exc:
        _rename_in(exc, tmp, path)  # the name the user knows: the temporary one is removed below
        raise
    finally:
        if not renamed and os.path.exists(tmp):  # whatever stopped it (a full disk, Ctrl-C), no temporary file stays
            os.unlink(tmp)
    fsync_dir(folder)
    return writer.entry()


def _rename_in(exc: BaseException, old: str, new: str) -> None:
    """Make the OSErrors in ``exc``'s chain (``space.os_errors``) that name ``old`` name ``new``."""
    for error in os_errors(exc):
        if error.filename == old:
            error.filename = new


def _throw_away(f) -> None:
    """Abandon an upload that failed half-way. fsspec's ``__exit__`` (and the garbage collector) would close the
    file, and closing completes the upload with the parts written so far: a truncated object at the final key."""
    if not isinstance(f, AbstractBufferedFile) or f.closed:
        return  # not a buffered upload, or the failure was in completing it (nothing was published)
    f.closed = True  # never completed later
    # s3fs aborts the multipart upload. If that fails too (the store is away), the error is raised with the
    # write's as its context; the parts stay invisible until the bucket's lifecycle rule removes them.
    f.discard()


def write_bytes_atomically(fs: fsspec.AbstractFileSystem, path: str, data: bytes, through_cache: bool = False) -> FileEntry:
    return write_atomically(fs, path, lambda f: f.write(data), through_cache)


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

