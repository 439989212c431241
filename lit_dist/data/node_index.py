"""One metadata index per node: the table read and indexed once per node, its columns mapped by every rank.

Each rank used to read the metadata table and build the same index: at 1 B rows (docs/scaling.md) 8 ranks of a
node held 8 copies and read the table 8 times. Here the node's first rank (the lowest global rank with its host
name) reads and indexes the tables, writes the columns into a folder of node-local shared memory (``/dev/shm``
by default): numpy arrays as ``.npy`` files, Arrow columns (file names, sizes, passed-through columns such as
captions) as uncompressed Arrow IPC files. Every rank of the node, that one included, then maps them
(``np.load(mmap_mode="r")``, ``pa.memory_map``): their pages exist once per node. Each rank plans its epoch from
the same columns, so every rank's batches are what its own reading would have given.

The folder lives only from the write to the moment every rank has mapped it: the first rank then removes it
(mapped pages stay valid until unmapped). A folder that a killed run left in between is removed by the next
start on the node (its owner process is gone), and at exit otherwise. A node without a usable folder (missing,
not writable, too small: Docker's /dev/shm is 64 MB) falls back to every rank reading, and says so.
"""

import atexit
import json
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Callable

import numpy as np

from lit_dist.errors import LitDistError
from lit_dist.runtime.distributed import Comm
from lit_dist.runtime.processes import alive

PREFIX = "lit-dist-index-"
_OWNER = "owner.json"
_INFO = "index.json"  # written last: a folder without it is incomplete
_ARRAYS = ("rows", "labels", "splits", "identity", "members")


def shared_index(read: Callable[[], tuple[list, list | None]], folder_root: str | None, comm: Comm
                 ) -> tuple[list, list | None]:
    """``read()`` -> (parts, classes), done once per node and shared; a collective of ``comm`` (every rank calls
    it). ``parts``: per dataset (Metadata, bucket ids, splits), as ``BucketDataModule.read`` makes them. On one
    process, or with ``folder_root`` None, every rank calls ``read()`` itself."""
    if comm.world == 1 or folder_root is None:
        return read()
    token = comm.broadcast(uuid.uuid4().hex[:12])
    hosts = comm.all_gather(socket.gethostname())
    host = hosts[comm.rank]
    first = hosts.index(host)  # the node's first rank reads
    node = sorted(set(hosts), key=hosts.index).index(host)
    folder = os.path.join(folder_root, f"{PREFIX}{token}-node{node}")
    result, error, fallback = None, None, None
    if comm.rank == first:
        try:  # whatever either step raises, the other ranks hear it in gather_or_raise instead of waiting there
            result = read()
            fallback = _write_or_why_not(folder_root, folder, result)
        except Exception as exc:  # noqa: BLE001 - sent to every rank by gather_or_raise, then raised here
            error = exc
    why = comm.gather_or_raise(fallback, error, "reading the metadata")[first]
    # Every rank runs the same collectives from here whatever its node does: nodes may differ (one falls back).
    loaded = None
    if why is None:
        result = None  # the first rank's own copy: from here on it maps the shared one like the others
        _release_arrow_memory()
        try:
            loaded = load(folder)
        except (OSError, ValueError, KeyError) as exc:
            error = LitDistError(f"mapping the node's metadata index in {folder} failed: {type(exc).__name__}: {exc}")
    elif comm.rank == first:
        print(f"lit-dist: node {host}: every rank reads the metadata itself (no shared index: {why}); set "
              "data.node_index_dir to a writable node-local folder, or to null to silence this", file=sys.stderr,
              flush=True)
        loaded = result
    else:
        try:
            loaded = read()
        except Exception as exc:  # noqa: BLE001 - sent to every rank by gather_or_raise, then raised here
            error = exc
    try:  # also the barrier after which no rank opens the folder any more
        comm.gather_or_raise(None, error, "mapping or reading the node's metadata index")
    finally:
        if comm.rank == first and why is None:
            _remove(folder)
    return loaded


def _write_or_why_not(folder_root: str, folder: str, result: tuple[list, list | None]) -> str | None:
    """Write the index into ``folder``; None, or why the node's ranks must each read the table instead."""
    if not os.path.isdir(folder_root) or not os.access(folder_root, os.W_OK):
        return f"{folder_root} is not a writable folder"
    remove_stale(folder_root)
    try:
        write(folder, *result)
    except OSError as exc:  # no room (a small /dev/shm), no inodes: reading on every rank still works
        _remove(folder)
        return f"writing it into {folder_root} failed: {exc.strerror or exc}"
    atexit.register(_remove, folder)  # should this process end before every rank has mapped it
    return None


def write(folder: str, parts: list, classes: list | None) -> None:
    """Every column of ``parts`` into ``folder`` (made here, private to this user), the description last."""
    import pyarrow as pa

    os.makedirs(folder, mode=0o700)
    with open(os.path.join(folder, _OWNER), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    described = []
    for i, (meta, buckets, _) in enumerate(parts):  # the third part is meta.splits (BucketDataModule.read)
        _write_arrow(os.path.join(folder, f"{i}-filenames.arrow"), pa.table({"filename": meta.filenames}))
        _write_arrow(os.path.join(folder, f"{i}-sizes.arrow"), meta.sizes)
        for k, (name, column) in enumerate(meta.extra.items()):
            _write_arrow(os.path.join(folder, f"{i}-extra{k}.arrow"), pa.table({name: column}))
        if meta.masks is not None:
            _write_arrow(os.path.join(folder, f"{i}-masks.arrow"), pa.table({"mask": meta.masks}))
        arrays = {"buckets": buckets, **{name: getattr(meta, name) for name in _ARRAYS}}
        for name, array in arrays.items():
            if array is not None:
                np.save(os.path.join(folder, f"{i}-{name}.npy"), array)
        described.append({"source": meta.source, "classes": meta.classes, "extra": list(meta.extra),
                          "masks": meta.masks is not None,
                          "bad": [meta.bad.counts, meta.bad.examples],
                          "arrays": [name for name, array in arrays.items() if array is not None]})
    with open(os.path.join(folder, _INFO), "w") as f:
        json.dump({"classes": classes, "parts": described}, f)


def load(folder: str) -> tuple[list, list | None]:
    """(parts, classes) from ``folder``, every column mapped, none copied."""
    from lit_dist.data.metadata import BadRows, Metadata

    with open(os.path.join(folder, _INFO)) as f:
        info = json.load(f)
    parts = []
    for i, part in enumerate(info["parts"]):
        arrays = {name: np.load(os.path.join(folder, f"{i}-{name}.npy"), mmap_mode="r") for name in part["arrays"]}
        extra = {}
        for k, name in enumerate(part["extra"]):
            column = _read_arrow(os.path.join(folder, f"{i}-extra{k}.arrow")).column(0)
            extra[name] = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        masks = None
        if part.get("masks"):
            column = _read_arrow(os.path.join(folder, f"{i}-masks.arrow")).column(0)
            masks = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        meta = Metadata(filenames=_read_arrow(os.path.join(folder, f"{i}-filenames.arrow")).column(0),
                        sizes=_read_arrow(os.path.join(folder, f"{i}-sizes.arrow")),
                        rows=arrays.get("rows"), labels=arrays.get("labels"), classes=part["classes"],
                        splits=arrays.get("splits"), extra=extra, identity=arrays.get("identity"),
                        members=arrays.get("members"), masks=masks, bad=BadRows(*part["bad"]), source=part["source"])
        parts.append((meta, arrays["buckets"], meta.splits))
    return parts, info["classes"]


def remove_stale(folder_root: str) -> list[str]:
    """Remove the index folders in ``folder_root`` whose owner process on this host is gone (a killed run's)."""
    removed = []
    host = socket.gethostname()
    for name in os.listdir(folder_root):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(folder_root, name)
        try:
            with open(os.path.join(path, _OWNER)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # being made right now, or not ours
        pid = owner.get("pid") if isinstance(owner, dict) else None
        if not isinstance(pid, int) or owner.get("host") != host:
            continue  # not an owner file this code wrote, or another node's
        if pid <= 0 or not alive(pid):  # a zombie is no owner either
            _remove(path)
            removed.append(path)
    return removed


def _release_arrow_memory() -> None:
    """Hand the memory of freed Arrow buffers back to the system (Arrow's allocator keeps it for reuse)."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _write_arrow(path: str, table) -> None:
    import pyarrow as pa

    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _read_arrow(path: str):
    import pyarrow as pa

    return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
