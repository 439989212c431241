"""Sharded checkpoints (FSDP2) written by lit-dist through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shard files in parallel, hashing each byte on the way (no file is read back to
hash it), and fsyncs them; rank 0 writes DCP's ``.metadata`` once every rank's writes are in, then
Lightning's ``meta.pt`` (loops, callbacks, random states) through lit-dist's atomic writer. The folder is the
layout Lightning's ``ModelParallelStrategy`` loads, so a resume reshards it onto any number of processes.

Synchronous, this runs on the training thread over the run's process group. Asynchronous, the training
thread only copies the shards aside (``Snapshot``) and this runs on a background thread over a process group
of its own (gloo, made once by every rank), as torchtitan does: collectives of the background save never
interleave with the training step's on the same group.
"""

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lit_dist.ckpt.files import FileEntry, HashingWriter

META = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.strategies.model_parallel)


class _HashingStream(HashingWriter):
    """A file DCP writes into: HashingWriter plus what DCP's writer asks of a stream (``tell``, ``fileno``)."""

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.fd

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
        with open(path, mode, buffering=8 << 20) as f:
            stream = _HashingStream(f, f.fileno())
            yield stream
            f.flush()
        with self._lock:
            self.entries[str(path)] = stream.entry()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP's `.metadata.tmp` -> `.metadata`
        with self._lock:
            if str(path) in self.entries:
                self.entries[str(new_path)] = self.entries.pop(str(path))


class ShardWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank, fsynced) through a ``HashingFileSystem``."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.fs = HashingFileSystem()
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


def write(tensors: dict, folder: str, group=None) -> dict[str, FileEntry]:
    """Write ``tensors`` as a DCP checkpoint in ``folder`` (a collective of ``group``: every rank calls it);
    this rank's files with their sizes and sha256, by path relative to ``folder``'s parent."""
    import torch.distributed.checkpoint as dcp

    writer = ShardWriter(folder)
    dcp.save(tensors, storage_writer=writer, process_group=group)
    return writer.files(os.path.dirname(folder.rstrip("/")))


def background_group(timeout_s: float):
    """A gloo process group of every rank, for the collectives of a save running beside training.
    A collective: every rank calls it at the same point."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

