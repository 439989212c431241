"""What the indexes of container sources share (a Hugging Face dataset's Arrow files, WebDataset tar shards): where
an index is kept, whether the one there was made from the same files, and the work split over ranks.

An index is a parquet table as a folder scan writes (``filename``, ``width``, ``height``, ``bytes``, ``mtime``, ...)
with ``offset`` and ``length`` columns: each image is a byte range of its container. Its schema metadata holds
the signature of what it was made from (every container's name, size and time, and the choices that shape the
rows), so that the next run uses it again without reading a container, and makes it anew when one changed.
"""

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lit_dist.runtime import outage

if TYPE_CHECKING:
    from lit_dist.runtime.distributed import Comm

log = logging.getLogger(__name__)

SIGNATURE = b"lit_dist.index_source"


@dataclass(frozen=True)
class Container:
    """One file of a source: its name relative to the source's root, its split (None: by hash), size and time."""

    name: str
    split: str | None
    size: int
    mtime: float


def default_path(kind: str, source: str) -> str:
    """Where the index of ``source`` is kept: ~/.cache/lit-dist/<kind>-<hash of source>.parquet."""
    digest = hashlib.sha1(source.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~"), ".cache", "lit-dist", f"{kind}-{digest}.parquet")


def signature(containers: list[Container], choices: list) -> str:
    """What an index is made from: every container's name, size and time, and the ``choices`` that shape it."""
    return json.dumps({"files": [[c.name, c.size, c.mtime] for c in containers], "choices": choices})


def load_or_build(index_path: str, containers: list[Container], choices: list,
                  index_one: Callable[[Container], "pa.Table"], what: str,  # noqa: F821
                  comm: "Comm | None" = None) -> str:
    """Make sure ``index_path`` holds the index of ``containers``; returns it. Built anew (``index_one`` per
    container, every world-th container on each rank, rank 0 writing the table) unless the one there has the
    same signature. A collective with a ``comm`` of several ranks: every rank calls it."""

    from lit_dist.data.discovery import publish_table
    from lit_dist.runtime.distributed import Comm

    comm = comm or Comm()
    wanted = signature(containers, choices)
    if comm.broadcast(indexed_from(index_path) == wanted if comm.rank == 0 else None):
        return index_path
    if comm.rank == 0:
        log.info("lit-dist: indexing %s (%d files) into %s", what, len(containers), index_path)
    mine = containers[comm.rank :: comm.world]
    shares = comm.on_every_rank(lambda: [index_one(c) for c in mine], f"indexing {what}")
    table = None
    if comm.rank == 0:
        tables = [None] * len(containers)
        for rank, share in enumerate(shares):
            for i, part in zip(range(rank, len(containers), comm.world), share, strict=True):
                tables[i] = part
        table = concat(tables)
        table = table.replace_schema_metadata({SIGNATURE: wanted})
    publish_table(table, index_path, comm)
    return index_path


def concat(tables: list) -> "pa.Table":  # noqa: F821
    """The containers' index tables as one: a column some lack is null there, and one whose type differs between
    them (a field of WebDataset's json members that is a number in one shard and text in another) becomes text."""
    import pyarrow as pa

    types: dict[str, set] = {}
    for table in tables:
        for field in table.schema:
            types.setdefault(field.name, set()).add(field.type)
    mixed = {name for name, seen in types.items() if len(seen - {pa.null()}) > 1}
    if mixed:
        tables = [t.cast(pa.schema([pa.field(f.name, pa.string()) if f.name in mixed else f for f in t.schema]))
                  for t in tables]
    return pa.concat_tables(tables, promote_options="default")


def indexed_from(index_path: str) -> str | None:
    """The signature the index at ``index_path`` was made from; None when there is none (or it is unreadable)."""
    import pyarrow.parquet as pq

    try:
        fs, path = outage.url_to_fs(index_path)
        if not fs.exists(path):
            return None
        with fs.open(path, "rb") as f:
            metadata = pq.read_schema(f).metadata or {}
    except (OSError, ValueError) as exc:
        log.warning("lit-dist: the index %s is unreadable (%s); indexing again", index_path, exc)
        return None
    value = metadata.get(SIGNATURE)
    return value.decode() if value is not None else None


def image_size(head: bytes) -> tuple[int, int]:
    """(width, height) of an image from its first bytes; (0, 0) when they are not an image (a bad row)."""
    import io

    from lit_dist.data.discovery import header_size
    from lit_dist.reading.unreadable import BadImage

    try:
        return header_size(io.BytesIO(head))
    except BadImage:
        return 0, 0


HEADER_BYTES = 65536  # of an image, parsed for its size: as a folder scan reads
