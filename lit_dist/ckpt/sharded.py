"""Sharded checkpoints (FSDP2) written by lit-dist through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shard files in parallel, hashing each byte on the way (no file is read back to
hash it), each on disk when it is closed (``DurableFile``); rank 0 writes DCP's ``.metadata`` once every
rank's writes are in, then Lightning's ``meta.pt`` (loops, callbacks, random states) through lit-dist's
atomic writer. The folder is the layout Lightning's ``ModelParallelStrategy`` loads, so a resume reshards
it onto any number of processes.

Synchronous, this runs on the training thread over the run's process group. Asynchronous, the training
thread only copies the shards aside (``Snapshot``) and this runs on a background thread over a process group
of its own (gloo, made once by every rank), as torchtitan does: collectives of the background save never
interleave with the training step's on the same group.

On an object store (``StoreFileSystem``) each rank writes its shard file into a temporary file of its own
(``$TMPDIR``, hashed on the way) and uploads it whole, retried through an outage of the store like every other
checkpoint upload; a resume reads the byte ranges it needs, each request retried the same way.
"""

import io
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
from torch.utils.serialization import config as serialization_config

from lit_dist.ckpt.files import DurableFile, FileEntry, HashingWriter

T = TypeVar("T")
# ``retry(operation, verb, what)``: ``operation()`` retried through an outage of the store (CheckpointStore.remote).
Retry = Callable[[Callable[[], T], str, str], T]

META = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.strategies.model_parallel)


class _HashingStream(HashingWriter):
    """A file DCP writes into: HashingWriter plus what DCP's writer asks of a stream (``tell``, ``close``)."""

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        self.file.flush()


class HashingFileSystem(FileSystem):
    """DCP's local filesystem, recording each written file's size and sha256 (by path) as it is written."""

    def __init__(self):
        super().__init__()
        self.entries: dict[str, FileEntry] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with DurableFile(str(path)) as f:  # on disk when the block ends; unfinished when it raises
            stream = _HashingStream(f)
            yield stream
        with self._lock:
            self.entries[str(path)] = stream.entry()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP's `.metadata.tmp` -> `.metadata`
        with self._lock:
            if str(path) in self.entries:
                self.entries[str(new_path)] = self.entries.pop(str(path))


class StoreFileSystem(FileSystemBase):
    """DCP's filesystem on an object store (an fsspec filesystem): a file is written into a local temporary file,
    hashed on the way, then uploaded whole; a file is read by byte ranges. Every request goes through ``retry``,
    so an outage of the store is waited out (up to its deadline) one idempotent request at a time."""

    def __init__(self, fs, retry: Retry, describe: Callable[[str], str] | None = None):
        super().__init__()
        self.fs, self.retry, self.describe = fs, retry, describe
        self.entries: dict[str, FileEntry] = {}
        self._lock = threading.Lock()

    def url(self, path) -> str:
        """``path``'s URL, or what ``describe`` makes of it (an outage's message: "step 10 to s3://...")."""
        return self.describe(str(path)) if self.describe else self.fs.unstrip_protocol(str(path))

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        path = str(path)
        if "w" not in mode:
            size = self.retry(lambda: self.fs.size(path), "reading", self.url(path))
            yield ranged(lambda start, end: self.retry(lambda: self.fs.cat_file(path, start=start, end=end),
                                                       "reading", self.url(path)), size)
            return
        fd, staged = tempfile.mkstemp(prefix="lit-dist-shard-")
        try:
            with os.fdopen(fd, "wb", buffering=8 << 20) as f:
                stream = _HashingStream(f)
                yield stream
                f.flush()
            self.retry(lambda: self.fs.put_file(staged, path), "saving", self.url(path))
        finally:
            with suppress(FileNotFoundError):
                os.unlink(staged)
        with self._lock:
            self.entries[path] = stream.entry()

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        self.retry(lambda: self.fs.mv(str(path), str(new_path)), "saving", self.url(new_path))
        with self._lock:
            if str(path) in self.entries:
                self.entries[str(new_path)] = self.entries.pop(str(path))

    def mkdir(self, path) -> None:
        pass  # an object store has no folders: a key's prefix exists once an object is under it

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never picked by DCP itself: lit-dist hands it to a writer or reader

    def exists(self, path) -> bool:
        return self.retry(lambda: self.fs.exists(str(path)), "reading", self.url(path))

    def rm_file(self, path) -> None:
        self.retry(lambda: self.fs.rm(str(path)), "deleting", self.url(path))

    def ls(self, path) -> list[str]:
        return self.retry(lambda: self.fs.ls(str(path), detail=False), "reading", self.url(path))


class RangedReader(io.RawIOBase):
    """A seekable binary file whose every read is one ranged request (``read_range(start, end)``). Wrapped in
    ``io.BufferedReader`` (``ranged``), torch.load's small reads of a tensor's zip headers come from one block."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int):
        super().__init__()
        self._read_range, self.size, self._pos = read_range, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self._pos)
        if n <= 0:
            return 0
        memoryview(buffer).cast("B")[:n] = self._read_range(self._pos, self._pos + n)
        self._pos += n
        return n


def ranged(read_range: Callable[[int, int], bytes], size: int, block: int = 8 << 20) -> io.BufferedReader:
    """A buffered file over ``RangedReader``: reads under ``block`` bytes fetch a whole block, larger ones go
    straight through."""
    return io.BufferedReader(RangedReader(read_range, size), buffer_size=block)


class ShardWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank) through a ``HashingFileSystem`` (each file on disk when it is
    closed: ``DurableFile``), or a ``StoreFileSystem`` (uploaded whole). DCP's own fsync is off: it would run
    before a ``DurableFile`` writes its tail."""

    def __init__(self, path: str, store_fs: StoreFileSystem | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=False, overwrite=False)
        self.fs = HashingFileSystem() if store_fs is None else store_fs
        self.path = self.fs.init_path(path)

    def files(self, root: str) -> dict[str, FileEntry]:
        """Every file this rank wrote, by path relative to ``root``."""
        return {os.path.relpath(path, root): entry for path, entry in self.fs.entries.items()}


def split(checkpoint: dict) -> tuple[dict, dict]:
    """(the tensors DCP writes, the rest for ``meta.pt``), in Lightning's layout: the module's state dict under
    ``state_dict``, optimizer ``i``'s under ``optimizer_i``."""
    rest = dict(checkpoint)
    tensors = {"state_dict": rest.pop("state_dict")}
    tensors.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
    return tensors, rest


def write(tensors: dict, folder: str, group=None, store_fs: StoreFileSystem | None = None) -> dict[str, FileEntry]:
    """Write ``tensors`` as a DCP checkpoint in ``folder`` (a collective of ``group``: every rank calls it), a local
    path, or with ``store_fs`` a path on that object store; this rank's files with their sizes and sha256, by path
    relative to ``folder``'s parent."""
    import torch.distributed.checkpoint as dcp

    writer = ShardWriter(folder, store_fs)
    # DCP writes each tensor with torch.save, whose zip records each carry a crc32 computed byte by byte: a second
    # checksum of every byte beside the manifest's sha256 (verified before a resume; crc32 never is), and a sixth of
    # a sharded save's time on 2 CPU processes (bench_sharded_checkpoint: 0.53 -> 0.64 of bare torch.save).
    # torch.load reads records without one. A process-wide switch, for the duration of the save.
    with serialization_config.patch({"save.compute_crc32": False}):
        dcp.save(tensors, storage_writer=writer, process_group=group)
    return writer.files(os.path.dirname(folder.rstrip("/")))


def background_group(timeout_s: float):
    """A gloo process group of every rank, for the collectives of a save running beside training.
    A collective: every rank calls it at the same point."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))



class ShardReader(FileSystemReader):
    """DCP's reader whose ``.metadata`` goes through lit-dist's restricted unpickler (``pickles``): torch's
    ``pickle.load`` would run whatever a crafted file names. ``store_fs``: read from an object store."""

    def __init__(self, path: str, opt_in: str, trust: bool = False, store_fs: StoreFileSystem | None = None):
        super().__init__(path)
        if store_fs is not None:
            self.fs, self.path = store_fs, store_fs.init_path(path)
        self.opt_in, self.trust = opt_in, trust

    def open(self, relative: str):
        """One file of the checkpoint, by path relative to its folder (a context manager)."""
        return self.fs.create_stream(self.fs.concat_path(self.path, relative), "rb")

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        from lit_dist.ckpt import pickles

        where = self.fs.fs.unstrip_protocol(self.path) if isinstance(self.fs, StoreFileSystem) else str(self.path)
        with self.open(".metadata") as f:
            metadata = pickles.load_dcp_metadata(f, f"{where}/.metadata", self.opt_in, trust=self.trust)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def store_reader(location: str, checkpoint_io, opt_in: str, trust: bool = False) -> ShardReader | None:
    """A reader of the sharded checkpoint at ``location`` when it is on an object store, its requests retried as
    the checkpoint store's (storage options, outage deadline: lit-dist's ``AtomicCheckpointIO``'s); None for a
    local path."""
    from lit_dist.ckpt.store import CheckpointStore
    from lit_dist.runtime import outage

    store = CheckpointStore(location, getattr(checkpoint_io, "storage_options", None),
                            getattr(checkpoint_io, "outage_deadline_s", outage.DEADLINE_S))
    if store.local:
        return None
    store.who = getattr(checkpoint_io, "who", "")
    return ShardReader(store.root, opt_in, trust, StoreFileSystem(store.fs, store.remote))


def saved_shapes(reader: ShardReader) -> dict:
    """The module tensors' global shapes in the checkpoint (Lightning keeps the module under ``state_dict``)."""
    entries = reader.read_metadata().state_dict_metadata
    return {key.removeprefix("state_dict."): tuple(entry.size) if hasattr(entry, "size") else None
            for key, entry in entries.items() if key.startswith("state_dict.")}


def load(strategy, reader: ShardReader, load_meta: Callable[[str], dict]) -> dict:
    """Lightning's load of a sharded checkpoint (``ModelParallelStrategy.load_checkpoint``) through ``reader``:
    the module's and each optimizer's shards, resharded onto this run's ranks, then ``meta.pt`` through
    ``load_meta(url)``, returned as Lightning's own load returns it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    module = strategy.lightning_module
    state = {"state_dict": get_model_state_dict(module)}
    dcp.load(state, storage_reader=reader)
    module.load_state_dict(state["state_dict"], strict=module.strict_loading)
    for i, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{i}"
        state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(state, storage_reader=reader)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return load_meta(reader.fs.fs.unstrip_protocol(reader.fs.concat_path(reader.path, META)))
