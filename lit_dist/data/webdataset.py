"""WebDataset tar shards as a source (``data.webdataset``): a brace pattern (``shards/{00000..00099}.tar``) or a
list of tar paths, local or URLs, indexed once into a table as a scanned folder is, then read as any table is.

A shard holds samples as consecutive members that share a key (the member's path up to the first dot of its
base name): ``abc.jpg``, ``abc.txt``, ``abc.cls``, as img2dataset and webdataset's writer make them. The index
has a row per sample with an image (jpg, jpeg, png or webp):

- ``filename``: ``<shard, relative to the shards' common folder>#<key>``;
- ``width``, ``height``: from the image's header; ``offset`` and ``length``: where its bytes lie in the shard
  (``TarInfo.offset_data``), so that reading a sample is one ranged read and no tar is opened in a loader
  worker;
- ``bytes``, ``mtime``: the image's length and the shard's time, the caches' identity;
- ``caption`` (the ``txt`` member), ``label`` (``cls``, an integer);
- the ``json`` member's fields whose values are text, numbers or booleans, each a column (``data.extra_columns``
  passes them to batches): img2dataset's ``url``, ``similarity``, ``original_width``, LAION's ``aesthetic``. Its
  ``caption`` is the sample's caption when there is no ``txt`` member. A field named as one of the columns above
  is left out.

Each shard is read once, from start to end (a stream: the same on an object store), by one rank; several ranks
share the shards. A shard cut short keeps the samples before the cut (a warning says how many were read); a member
that is not an image is a bad row; a shard that is not there stops the run before training (exit 3).
"""

import json
import logging
import re
import tarfile
from typing import TYPE_CHECKING

import numpy as np

from lit_dist.data.indexes import HEADER_BYTES, Container, default_path, image_size, load_or_build
from lit_dist.errors import DataError
from lit_dist.reading.presence import mtime
from lit_dist.runtime import outage

if TYPE_CHECKING:
    from lit_dist.runtime.distributed import Comm

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
INDEX_VERSION = 2  # what the rows hold: 2 added the json members' fields (an index of 1 is made anew)
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand(pattern: str) -> list[str]:
    """The paths of a brace pattern, as webdataset's braceexpand gives them: ``{000..012}`` a zero-padded range
    (the width of the first bound), ``{a,b}`` alternatives, several braces a product."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    ranged = _RANGE.fullmatch(match.group(0))
    if ranged:
        first, last = ranged.groups()
        step = 1 if int(last) >= int(first) else -1
        choices = [str(i).zfill(len(first)) for i in range(int(first), int(last) + step, step)]
    else:
        choices = match.group(1).split(",")
    return [path for choice in choices for path in expand(head + choice + tail)]


def shard_paths(shards: str | list[str]) -> list[str]:
    """Every shard of ``shards`` (a brace pattern, or a list of paths or patterns), in order."""
    patterns = [shards] if isinstance(shards, str) else list(shards)
    return [path for pattern in patterns for path in expand(pattern)]


def common_root(paths: list[str]) -> str:
    """The folder the shards' names are relative to: the longest common folder of every path."""
    folders = [path.rsplit("/", 1)[0] if "/" in path else "." for path in paths]
    root = folders[0]
    while any(f != root and not f.startswith(root + "/") for f in folders):
        root = root.rsplit("/", 1)[0] if "/" in root.strip("/") else ("/" if root.startswith("/") else "")
        if root in ("", "/"):
            break
    return root or "."


def default_index_path(shards: str | list[str]) -> str:
    """Where the index of ``shards`` is kept: ~/.cache/lit-dist/wds-<hash of the pattern(s)>.parquet."""
    return default_path("wds", shards if isinstance(shards, str) else "\n".join(shards))


def list_shards(shards: str | list[str], storage_options: dict | None = None) -> tuple[str, list[Container]]:
    """(root, the shards as containers relative to it); a DataError naming every shard that is not there."""
    paths = shard_paths(shards)
    if not paths:
        raise DataError(f"data.webdataset = {shards!r}: names no shard")
    root = common_root(paths)
    fs, base = outage.url_to_fs(root, **(storage_options or {}))
    base = base.rstrip("/")
    names = [path[len(root) :].lstrip("/") for path in paths]

    def look() -> list[dict | None]:
        out = []
        for name in names:
            try:
                out.append(fs.info(f"{base}/{name}"))
            except FileNotFoundError:
                out.append(None)
        return out

    infos = outage.call(look, root, outage.DEADLINE_S)
    missing = [path for path, info in zip(paths, infos, strict=True) if info is None]
    if missing:
        raise DataError(f"data.webdataset: {len(missing)} of {len(paths)} shards are not there (e.g. "
                        f"{', '.join(missing[:3])}); check the pattern, or copy the missing shards")
    return root, [Container(name, None, int(info.get("size") or 0), mtime(info))
                  for name, info in zip(names, infos, strict=True)]


def index_shard(root: str, shard: Container, storage_options: dict | None = None):
    """The index rows of one shard, read from start to end."""
    import pyarrow as pa

    fs, base = outage.url_to_fs(root, **(storage_options or {}))
    path = f"{base.rstrip('/')}/{shard.name}"
    rows: list[dict] = []
    current: dict | None = None

    def close(sample: dict | None) -> None:
        if sample is not None and "offset" in sample:
            rows.append(sample)

    read = 0
    with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
        try:
            for member in tar:
                if not member.isfile():
                    continue
                folder, _, base_name = member.name.rpartition("/")
                stem, dot, extension = base_name.partition(".")
                if not dot:
                    continue
                key = f"{folder}/{stem}" if folder else stem
                if current is None or current["key"] != key:
                    close(current)
                    current = {"key": key}
                extension = extension.lower()
                if extension in IMAGE_EXTENSIONS and "offset" not in current:
                    head = tar.extractfile(member).read(HEADER_BYTES)
                    current["offset"], current["length"] = member.offset_data, member.size
                    current["width"], current["height"] = image_size(head)
                elif extension in ("txt", "caption"):
                    current["caption"] = tar.extractfile(member).read().decode("utf-8", "replace").strip()
                elif extension == "cls":
                    text = tar.extractfile(member).read().decode("ascii", "replace").strip()
                    current["label"] = int(text) if text.lstrip("-").isdigit() else None
                elif extension == "json":
                    current["json"] = _fields(tar.extractfile(member).read())
                read += 1
        except (tarfile.TarError, EOFError, OSError) as exc:  # cut short or damaged: what came before is kept
            if isinstance(exc, OSError) and not isinstance(exc, EOFError) and exc.errno is not None:
                raise  # an error of the storage (permissions, an outage), not of the shard
            log.warning("lit-dist: the shard %s is damaged after its first %d members (%s); its other samples are "
                        "left out", path, read, exc)
            current = None  # its image may be the cut one
    close(current)
    length = np.array([r["length"] for r in rows], dtype=np.int64)
    out = {
        "filename": pa.array([f"{shard.name}#{r['key']}" for r in rows], pa.string()),
        "width": np.array([r["width"] for r in rows], dtype=np.int32),
        "height": np.array([r["height"] for r in rows], dtype=np.int32),
        "offset": np.array([r["offset"] for r in rows], dtype=np.int64), "length": length,
        "bytes": length, "mtime": np.full(len(rows), shard.mtime),
    }
    if any("caption" in r for r in rows):
        out["caption"] = pa.array([r.get("caption") for r in rows], pa.string())
    if any("label" in r for r in rows):
        out["label"] = pa.array([r.get("label") for r in rows], pa.int64())
    fields = [r.get("json", {}) for r in rows]
    captions = [f.get("caption") for f in fields]
    if any(isinstance(c, str) for c in captions):
        given = out["caption"].to_pylist() if "caption" in out else [None] * len(rows)
        out["caption"] = pa.array([g if g is not None else c if isinstance(c, str) else None
                                   for g, c in zip(given, captions, strict=True)], pa.string())
    for name in dict.fromkeys(k for f in fields for k in f):
        if name not in out and name not in RESERVED:
            out[name] = json_column([f.get(name) for f in fields])
    return pa.table(out)


RESERVED = ("filename", "width", "height", "offset", "length", "bytes", "mtime", "etag", "caption", "label", "split")


def _fields(raw: bytes) -> dict:
    """The fields of a ``json`` member that a column can hold (text, numbers, booleans); {} when it is not an
    object of JSON (a damaged member costs its fields, not the sample)."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(v, str | int | float | bool)}


def json_column(values: list):
    """A column of one field of the ``json`` members: booleans, numbers (as float64: a field that is 3 in one
    sample and 3.5 in the next, or missing, stays one type in every shard) or, where the samples disagree, text."""
    import pyarrow as pa

    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.array(values, pa.bool_())
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return pa.array(values, pa.float64())
    return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values], pa.string())


def load_or_index(shards: str | list[str], index_path: str, storage_options: dict | None = None,
                  comm: "Comm | None" = None) -> str:
    """Make sure ``index_path`` holds the index of ``shards``; returns ``index_path``. A collective with a ``comm``
    of several ranks (every rank calls it): each indexes every world-th shard."""
    root, containers = list_shards(shards, storage_options)
    return load_or_build(index_path, containers, [root, INDEX_VERSION],
                         lambda shard: index_shard(root, shard, storage_options), f"the tar shards under {root}",
                         comm)
