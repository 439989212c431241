"""A Hugging Face dataset as a source (``data.hf_dataset``): a folder written by ``save_to_disk`` (local or on an
object store), or what ``datasets.load_dataset`` opens (parquet files with an image column, a folder of them as
the hub lays them out, a hub id), indexed once into a table as a scanned folder is, then read as any table is.

``load_dataset`` turns parquet files and hub datasets into Arrow files in the Hugging Face cache
(``HF_DATASETS_CACHE``) once: lit-dist indexes those, named by their absolute path under the root ``/``. Rank 0
loads first, the other ranks then find the cache filled; it must be on storage every rank sees.

The folder is a ``Dataset`` (``state.json`` naming its Arrow files) or a ``DatasetDict`` (``dataset_dict.json``
and a folder per split). Its Arrow files are IPC streams, the image column a struct of ``bytes`` and ``path``
(``datasets.Image``) or plain binary. The index has a row per example:

- ``filename``: ``<Arrow file, relative to the folder>#<row>``, the sample's name for caches and messages;
- ``width``, ``height``: from the image's header, parsed from its bytes (never a full decode);
- ``offset``, ``length``: where the image's bytes lie in the Arrow file, so that reading a sample is one ranged
  read (``lit_dist.reading.members``), no Arrow reader opened in a loader worker;
- ``bytes``, ``mtime``: the image's length and its file's modification time, the caches' identity;
- ``caption``, ``label``, ``split``: from the dataset's columns (``caption_column``, ``label_column``; the split
  folders train, validation and test).

The index is kept beside lit-dist's other indexes and used again while the folder's files (names, sizes, times)
and the chosen columns are the same. Several ranks index a file each in turn; rank 0 writes the table.
"""

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lit_dist.data.indexes import HEADER_BYTES, Container, default_path, image_size, load_or_build
from lit_dist.errors import ConfigError, DataError
from lit_dist.reading.presence import mtime
from lit_dist.runtime import outage

if TYPE_CHECKING:
    from lit_dist.runtime.distributed import Comm

log = logging.getLogger(__name__)

# The split folders of a DatasetDict that a run uses, and the split each is.
SPLITS = {"train": "train", "validation": "val", "valid": "val", "val": "val", "dev": "val", "test": "test"}
CAPTION_COLUMNS = ("caption", "text", "prompt")  # tried in this order when caption_column is unset


def default_index_path(folder: str) -> str:
    """Where the index of ``folder`` is kept: ~/.cache/lit-dist/hf-<hash of folder>.parquet."""
    return default_path("hf", folder)


def is_saved(source: str) -> bool:
    """Whether ``source`` is a folder written by ``save_to_disk`` (a URL always is: only those are read from an
    object store); else it is what ``load_dataset`` opens."""
    if "://" in source:
        return True
    return any(os.path.isfile(os.path.join(source, name)) for name in ("dataset_dict.json", "state.json"))


def root_of(source: str) -> str:
    """The folder the index's file names are relative to: the saved folder, or ``/`` for the Arrow files
    ``load_dataset`` left in the Hugging Face cache (named by their absolute paths)."""
    return source if is_saved(source) else "/"


def containers(source: str, storage_options: dict | None = None, comm: "Comm | None" = None) -> list[Container]:
    """The Arrow files of ``source`` in the dataset's order: a saved folder's, or those ``load_dataset`` makes of
    it (rank 0 first). A collective with a ``comm`` of several ranks."""
    from lit_dist.runtime.distributed import Comm

    if is_saved(source):
        return list_files(source, storage_options)
    comm = comm or Comm()
    comm.on_rank_zero(lambda: _loaded(source), f"loading {source} with datasets.load_dataset")
    found = comm.on_every_rank(lambda: _loaded(source), f"loading {source} with datasets.load_dataset")
    if any(files != found[0] for files in found):
        raise DataError(f"data.hf_dataset = {source!r}: load_dataset put its Arrow files in different places on "
                        "different ranks (a Hugging Face cache on each node's own disk): set HF_DATASETS_CACHE to a "
                        "folder every node sees, or save_to_disk the dataset there and name that folder")
    return found[0]


def _loaded(source: str) -> list[Container]:
    """The Arrow files ``load_dataset`` makes of ``source`` (a parquet file or glob, a folder, a hub id)."""
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"data.hf_dataset = {source!r} is no save_to_disk folder, and loading it needs the datasets "
                          "package: pip install datasets (or name a folder written by save_to_disk)") from exc
    parquet = source.endswith(".parquet") or (any(c in source for c in "*?[") and ".parquet" in source)
    try:
        loaded = datasets.load_dataset("parquet", data_files=source) if parquet else datasets.load_dataset(source)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as exc:
        raise DataError(f"data.hf_dataset = {source!r}: datasets.load_dataset cannot open it ({exc}). Name a folder "
                        "written by save_to_disk, parquet files with an image column, or a hub id reachable from "
                        "here") from exc
    out = []
    for name, split in loaded.items():
        if name not in SPLITS:
            log.info("lit-dist: data.hf_dataset: the split %r of %s is not used (train, validation and test are)",
                     name, source)
            continue
        for entry in split.cache_files:
            path = os.path.abspath(entry["filename"])
            info = os.stat(path)
            out.append(Container(path.lstrip("/"), SPLITS[name] if len(loaded) > 1 or name != "train" else None,
                                 info.st_size, info.st_mtime))
    if not out:
        raise DataError(f"data.hf_dataset = {source!r}: load_dataset found no split train, validation or test in it")
    return out


def list_files(folder: str, storage_options: dict | None = None) -> list[Container]:
    """The Arrow files of a ``save_to_disk`` folder, in the dataset's order; a DataError naming the folder when it
    is none."""
    fs, base = outage.url_to_fs(folder, **(storage_options or {}))
    base = base.rstrip("/")

    def read_json(path: str) -> dict | None:
        try:
            with fs.open(path, "r") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError(f"data.hf_dataset = {folder!r}: {path} is not JSON ({exc}); write the folder again with "
                            "save_to_disk") from exc

    def listed() -> list[tuple[str, str | None]]:
        splits = read_json(f"{base}/dataset_dict.json")
        if splits is not None:
            out = []
            for name in splits.get("splits", []):
                if name not in SPLITS:
                    log.info("lit-dist: data.hf_dataset: the split %r of %s is not used (train, validation and test "
                             "are)", name, folder)
                    continue
                out += [(f"{name}/{file}", SPLITS[name]) for file in _state_files(read_json, f"{base}/{name}", folder)]
            return out
        return [(file, None) for file in _state_files(read_json, base, folder)]

    names = outage.call(listed, folder, outage.DEADLINE_S)
    if not names:
        raise DataError(f"data.hf_dataset = {folder!r}: the folder holds no split train, validation or test")
    infos = outage.call(lambda: [fs.info(f"{base}/{name}") for name, _ in names], folder, outage.DEADLINE_S)
    return [Container(name, split, int(info.get("size") or 0), mtime(info))
            for (name, split), info in zip(names, infos, strict=True)]


def _state_files(read_json, folder_path: str, folder: str) -> list[str]:
    state = read_json(f"{folder_path}/state.json")
    if state is None:
        raise DataError(f"data.hf_dataset = {folder!r}: no state.json or dataset_dict.json in {folder_path}: not a "
                        "folder written by save_to_disk (Dataset.save_to_disk or DatasetDict.save_to_disk)")
    return [entry["filename"] for entry in state.get("_data_files", [])]


@dataclass(frozen=True)
class Columns:
    """The dataset's columns a run reads."""

    image: str = "image"
    caption: str | None = None
    label: str | None = None

    def resolved(self, names: list[str], folder: str) -> "Columns":
        """These columns checked against the dataset's ``names``; an unset caption or label taken from the usual
        names when the dataset has one. One ConfigError naming every wrong field."""
        problems = []
        for field, value in (("image_column", self.image), ("caption_column", self.caption),
                             ("label_column", self.label)):
            if value is not None and value not in names:
                problems.append(f"data.{field} = {value!r}: {folder} has no such column (it has: {', '.join(names)})")
        ConfigError.collect(problems)
        caption = self.caption or next((c for c in CAPTION_COLUMNS if c in names), None)
        label = self.label or ("label" if "label" in names else None)
        return Columns(self.image, caption, label)


def _index_file(folder: str, file: Container, columns: Columns, storage_options: dict | None):
    """The index rows of one Arrow file: each message of the stream read in turn, where each image's bytes lie in
    the file told from the message body's position and the buffer's place in it."""
    import pyarrow as pa

    fs, base = outage.url_to_fs(folder, **(storage_options or {}))
    path = f"{base.rstrip('/')}/{file.name}"
    local = _is_local(fs)
    source = pa.memory_map(path) if local else pa.PythonFile(fs.open(path, "rb"), mode="r")
    parts = []
    with source:
        reader = pa.ipc.MessageReader.open_stream(source)
        schema = None
        row = 0
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as exc:  # a truncated or damaged file: what came before it is kept
                log.warning("lit-dist: %s is damaged after its first %d rows (%s); its other rows are left out",
                            path, row, exc)
                break
            if message.type == "schema":
                schema = pa.ipc.read_schema(message)
                continue
            if message.type != "record batch":
                continue
            body_start = source.tell() - message.body.size
            batch = pa.ipc.read_record_batch(message, schema)
            parts.append(_batch_rows(batch, body_start, message.body, file, row, columns, folder))
            row += batch.num_rows
    if not parts:
        return _empty_index(columns)
    return pa.concat_tables(parts)


def _batch_rows(batch, body_start: int, body, file: Container, first_row: int, columns: Columns, folder: str):
    import pyarrow as pa
    import pyarrow.compute as pc

    names = batch.schema.names
    image = batch.column(columns.image)
    if pa.types.is_struct(image.type):
        if "bytes" not in [image.type.field(i).name for i in range(image.type.num_fields)]:
            raise ConfigError(f"data.image_column = {columns.image!r}: in {folder} it is a struct without bytes "
                              f"({image.type}); name the column that holds the images (datasets.Image or bytes)")
        values = image.field("bytes")
        valid = np.asarray(image.is_valid()) & np.asarray(values.is_valid())
    elif pa.types.is_binary(image.type) or pa.types.is_large_binary(image.type):
        values, valid = image, np.asarray(image.is_valid())
    else:
        raise ConfigError(f"data.image_column = {columns.image!r}: in {folder} it holds {image.type}, not images; "
                          f"name the column that holds them (datasets.Image or bytes; columns: {', '.join(names)})")
    _, offsets_buf, data_buf = values.buffers()
    kind = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=kind)[values.offset : values.offset + len(values) + 1].astype(np.int64)
    within = data_buf.address - body.address if data_buf is not None else 0
    if data_buf is not None and not 0 <= within <= body.size:  # decompressed elsewhere: no place in the file
        raise DataError(f"data.hf_dataset = {folder!r}: {file.name} is a compressed Arrow file; write the dataset "
                        "again with save_to_disk (it does not compress)")
    lengths = np.diff(offsets)
    widths = np.zeros(len(values), dtype=np.int32)
    heights = np.zeros(len(values), dtype=np.int32)
    memory = memoryview(data_buf) if data_buf is not None else memoryview(b"")
    for i in np.flatnonzero(valid & (lengths > 0)):
        start = int(offsets[i])
        widths[i], heights[i] = image_size(bytes(memory[start : start + min(int(lengths[i]), HEADER_BYTES)]))
    rows = np.arange(first_row, first_row + len(values))
    out = {
        "filename": pa.array([f"{file.name}#{r}" for r in rows], pa.string()),
        "width": widths, "height": heights,
        "offset": body_start + within + offsets[:-1], "length": lengths,
        "bytes": lengths, "mtime": np.full(len(values), file.mtime),
    }
    if columns.caption is not None:
        out["caption"] = pc.cast(batch.column(columns.caption), pa.string())
    if columns.label is not None:
        out["label"] = batch.column(columns.label)
    if file.split is not None:
        out["split"] = pa.array([file.split] * len(values), pa.string())
    return pa.table(out)


def _empty_index(columns: Columns):
    import pyarrow as pa

    fields = [("filename", pa.string()), ("width", pa.int32()), ("height", pa.int32()), ("offset", pa.int64()),
              ("length", pa.int64()), ("bytes", pa.int64()), ("mtime", pa.float64())]
    return pa.table({name: pa.array([], kind) for name, kind in fields})


def _is_local(fs) -> bool:
    from lit_dist.ckpt.files import is_local

    return is_local(fs)


def load_or_index(folder: str, columns: Columns, index_path: str, storage_options: dict | None = None,
                  comm: "Comm | None" = None) -> str:
    """Make sure ``index_path`` holds the index of ``folder`` for ``columns``; returns ``index_path``. A collective
    with a ``comm`` of several ranks (every rank calls it): each indexes every world-th Arrow file."""
    files = containers(folder, storage_options, comm)
    root = root_of(folder)
    columns = columns.resolved(_column_names(root, files[0], storage_options), folder)
    return load_or_build(index_path, files, [columns.image, columns.caption, columns.label],
                         lambda file: _index_file(root, file, columns, storage_options),
                         f"the Hugging Face dataset {folder}", comm)


def _column_names(folder: str, file: Container, storage_options: dict | None) -> list[str]:
    import pyarrow as pa

    fs, base = outage.url_to_fs(folder, **(storage_options or {}))

    def names() -> list[str]:
        with fs.open(f"{base.rstrip('/')}/{file.name}", "rb") as f:
            return pa.ipc.open_stream(f).schema.names

    return outage.call(names, folder, outage.DEADLINE_S)
