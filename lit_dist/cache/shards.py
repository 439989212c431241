"""Shard files: many cached samples in one Arrow IPC stream, one record batch (message) per sample.

Why Arrow IPC: it is an existing, documented container; any Arrow reader opens a shard
(``pyarrow.ipc.open_stream(path).read_all()``); its buffer compression is zstd, chosen per
record batch; and pyarrow is already a dependency. With one sample per record batch, a sample
is one contiguous byte range: the reader keeps each sample's (shard, offset, length, crc32)
and reads exactly that range (a slice of the memory-mapped file locally, one ranged GET on
S3), never the whole shard.

Columns of a record batch: ``sample`` and ``key`` (uint64, see ``keys``), ``shape``
(int32 list) and ``data`` (the array's bytes, C order; for multi-byte dtypes byte-shuffled, see
``shuffle``; for uint8 images, in shards whose manifest entry has a ``"layout"``, differences of rows:
``"row_tree"``, see ``difference_row_tree``, or ``"rows"``, see ``difference_rows``). The dtype is in the
schema metadata.

Compression is in the values, not in Arrow's IPC buffer compression: in shards whose manifest
entry says ``"values": "zstd"``, a ``data`` value shorter than its array's bytes is a zstd frame
of them, else the bytes themselves; the messages are uncompressed. Arrow's reader decompresses a
compressed message about 10x slower than a one-shot zstd call on the same bytes (about 120 us
against 13 us for a 180 KB image here: it sets up a decompressor per message), which was most of
what reading a cached image cost. Shards written before (no ``values`` in their entry) have
zstd-compressed messages and read as they always did.

Next to each shard, ``<name>.index.arrow`` (an Arrow IPC file) lists its entries (sample, key,
offset, length, crc32): the index a stream has no footer for, and what opening a cache reads
instead of the shards. An entry of length 0 records a source that could not be decoded: it is
known bad, not missing.
"""

import functools
import json
import math
import zlib

import numpy as np
import pyarrow as pa
import torch

from lit_dist.cache.config import CacheConfig
from lit_dist.reading.unreadable import BadSample

DTYPES = {"uint8": np.uint8, "bf16": np.uint16, "fp16": np.float16, "fp32": np.float32}  # bf16: stored as raw 16-bit
INDEX_SCHEMA = pa.schema([("sample", pa.uint64()), ("key", pa.uint64()), ("offset", pa.uint32()),
                          ("length", pa.uint32()), ("crc32", pa.uint32())])


def from_stored(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A stored array as a tensor of its dtype, without a copy (``lit_dist.cache.build._stored``'s inverse)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.bfloat16) if dtype == "bf16" else tensor  # bf16 is stored as raw 16-bit words


@functools.cache
def schema(dtype: str) -> pa.Schema:
    return pa.schema([("sample", pa.uint64()), ("key", pa.uint64()), ("shape", pa.list_(pa.int32())), ("data", pa.binary())],
                     metadata={b"dtype": dtype.encode(), b"format": b"lit-dist cache shard 3",
                               b"layout": b"C order; bytes shuffled by position for multi-byte dtypes; "
                                          b"uint8 images as differences of rows where the manifest gives a layout; "
                                          b"a value shorter than its array's bytes is a zstd frame of them"})


VALUES = "zstd"  # a shard's values: zstd frames where shorter than the array's bytes (module docstring)
ENCODING_KEYS = ("values", "layout")  # of a manifest entry: how its shard stores values (ShardWriter.encoding)
_ZSTD = pa.Codec("zstd")  # for decompressing: one-shot calls, no state kept between them


class ShardWriter:
    """Collects samples of one field into a shard in memory; ``finish`` returns its bytes and index.

    The shard is an Arrow IPC stream: the schema message, one record batch message per sample, the
    end-of-stream marker. Each sample's value is a zstd frame, or its bytes as they are when zstd
    saves less than ``min_savings`` of them (near-incompressible photos: reading is then no copy at
    all, the array is a view of the mapped shard).
    """

    def __init__(self, dtype: str, compression: str = CacheConfig.compression,
                 level: int = CacheConfig.compression_level, min_savings: float = CacheConfig.min_savings,
                 layout: str = CacheConfig.pixel_layout):
        self.dtype = dtype
        # Images (uint8, rows first) as differences of rows unless plain: zstd stores photos' plain bytes 1.11x
        # (gzip 1.13x), their differences 1.45x (row_tree) and 1.82x (rows) (benchmarks/bench_cache.py).
        self.layout = layout if layout != PLAIN and dtype == "uint8" else None
        self.encoding = {"values": VALUES, **({"layout": self.layout} if self.layout else {})}  # its manifest entry's
        self.schema = schema(dtype)
        self.codec = pa.Codec("zstd", compression_level=level) if compression == "zstd" else None
        self.min_savings = min_savings
        self._parts = [_message(self.schema, None)]
        self.nbytes = len(self._parts[0])
        self._index: list[tuple[int, int, int, int, int]] = []  # (sample, key, offset, length, crc32)
        self.raw_bytes = 0  # uncompressed payload, for the compression ratio
        self.samples = 0

    def add(self, sample: int, key: int, array: np.ndarray | None) -> None:
        """Append one sample; ``array=None`` records a source that could not be decoded."""
        if array is None:
            self._index.append((sample, key, 0, 0, 0))
            return
        array = np.ascontiguousarray(array)
        value = raw = stored(array, self.layout)
        if self.codec is not None:
            packed = self.codec.compress(raw, asbytes=True)
            # Strictly shorter, always: a value as long as the array's bytes is the bytes (what decode relies on).
            if len(packed) < len(raw) and len(packed) <= (1 - self.min_savings) * len(raw):
                value = packed
        batch = pa.record_batch([pa.array([sample], pa.uint64()), pa.array([key], pa.uint64()),
                                 pa.array([list(array.shape)], pa.list_(pa.int32())), pa.array([value], pa.binary())],
                                schema=self.schema)
        message = _message(self.schema, batch)
        self._index.append((sample, key, self.nbytes, len(message), zlib.crc32(message)))
        self._parts.append(message)
        self.nbytes += len(message)
        self.raw_bytes += array.nbytes
        self.samples += 1

    def __len__(self) -> int:
        return len(self._index)

    def finish(self) -> tuple[bytes, bytes]:
        """(the shard file's bytes, its index file's bytes)."""
        data = b"".join([*self._parts, _END_OF_STREAM])
        columns = list(zip(*self._index, strict=True)) if self._index else [[]] * 5
        index = pa.table([pa.array(c, f.type) for c, f in zip(columns, INDEX_SCHEMA, strict=True)], schema=INDEX_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
            writer.write_table(index)
        return data, sink.getvalue().to_pybytes()


_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _message(schema: pa.Schema, batch: pa.RecordBatch | None) -> bytes:
    """The encapsulated IPC message of ``batch`` (or of the schema, for None) as a stream writer writes it."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        if batch is not None:
            writer.write_batch(batch)
    data = sink.getvalue().to_pybytes()[: -len(_END_OF_STREAM)]
    schema_end = 8 + int.from_bytes(data[4:8], "little")  # continuation marker, metadata length, metadata
    return data[:schema_end] if batch is None else data[schema_end:]


ROWS = "rows"  # a shard's layout: uint8 arrays stored as row differences (difference_rows)
ROW_TREE = "row_tree"  # a shard's layout: uint8 arrays stored as row differences along a binary tree (difference_row_tree)
PLAIN = "plain"  # data.cache.pixel_layout: pixels stored as they are (no layout in the manifest entry)


def _filter(layout: str | None, dtype: np.dtype, ndim: int):
    """(difference, undo) for such an array in a shard of ``layout``; None where it is stored as it is
    (layouts are for images: uint8, rows first)."""
    if layout in (None, PLAIN) or dtype != np.uint8 or ndim < 2:
        return None
    if layout not in _FILTERS:
        raise ValueError(f"unknown layout {layout!r}")  # decode: a corrupt entry, never pixels served as they are
    return _FILTERS[layout]


def stored(array: np.ndarray, layout: str | None):
    """The bytes a shard of ``layout`` stores for ``array`` (before compression)."""
    image_filter = _filter(layout, array.dtype, array.ndim)
    if image_filter is not None:
        return image_filter[0](array).reshape(-1).data
    return shuffle(array)


def restored(raw: np.ndarray, dtype: np.dtype, shape: list[int], layout: str | None,
             in_place: bool = False) -> np.ndarray:
    """``stored`` undone: the array from the bytes (uint8, decompressed) a shard of ``layout`` stores.
    ``in_place``: ``raw`` is the caller's own scratch (a fresh decompression), so the undoing may overwrite it."""
    array = unshuffle(raw, dtype.itemsize).view(dtype).reshape(shape)
    image_filter = _filter(layout, dtype, array.ndim)
    if image_filter is None:
        return array
    return image_filter[1](array, out=array if in_place and array.flags.writeable else None)


@functools.cache
def _tree_steps(rows: int) -> tuple[int, ...]:
    """The distances of ``difference_row_tree``: 1, 2, 4, ... below ``rows``."""
    return tuple(1 << k for k in range(max(rows - 1, 0).bit_length()))


def difference_row_tree(array: np.ndarray) -> np.ndarray:
    """Row r (r > 0) minus row r - lowbit(r), modulo 256, where lowbit(r) is r's lowest set bit: odd rows
    minus the row above, rows 2 mod 4 minus the row two above, rows 4 mod 8 minus the row four above, and so on;
    row 0 as it is. Half the rows are differenced from their neighbour, as in ``difference_rows``, the rest
    from rows further up, so it compresses less (photos: 1.45-1.53x with zstd, against 1.74-1.87x and gzip's
    1.13-1.34x on the plain bytes), but ``sum_row_tree`` undoes it in log2(rows) vectorised adds, each over
    whole rows, with no running sum: half the time of ``sum_rows``, and the train loader reads such a cache
    1.2x as fast as one of row differences. These are the predict steps of a Haar wavelet's lifting scheme,
    without its update steps."""
    out = array.copy()
    rows = len(array)
    for step in _tree_steps(rows):
        np.subtract(array[step::2 * step], array[: rows - step : 2 * step], out=out[step::2 * step])
    return out


def sum_row_tree(array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``difference_row_tree`` undone into ``out`` (a new array if None; ``array`` itself to undo it in place):
    the largest distance first, so that every row a difference refers to is already restored."""
    if out is None:
        out = array.copy()
    elif out is not array:
        out[...] = array
    rows = len(out)
    for step in reversed(_tree_steps(rows)):
        np.add(out[step::2 * step], out[: rows - step : 2 * step], out=out[step::2 * step])
    return out


def difference_rows(array: np.ndarray) -> np.ndarray:
    """Each row minus the row above, modulo 256 (PNG's Up filter): neighbouring rows of an image are alike, so
    the differences are small numbers that compress, where the pixels themselves (noise, texture) do not.
    ``sum_rows`` undoes it."""
    out = np.empty_like(array)
    out[0] = array[0]
    np.subtract(array[1:], array[:-1], out=out[1:])
    return out


def sum_rows(array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``difference_rows`` undone: a running sum down the rows, modulo 256, into ``out`` (a new array if None;
    ``array`` itself to sum in place).

    ``np.cumsum(axis=0)`` adds one byte at a time (about 1 GB/s here, slower than zstd decompresses); a row
    at a time is one vectorised add per row, but a Python call per row. So the rows are cut into about
    sqrt(rows) blocks of about sqrt(rows) rows: the i-th rows of all blocks are summed together (one add per
    row position), then each block gets the last row of the one before (one add per block): 2 sqrt(rows)
    vectorised adds, 3-4x faster than cumsum on a 256^2 image. Summing into the decompressed buffer rather
    than a new array matters as much: new arrays of a few hundred KB came from the operating system page by
    page here (8,600 page faults reading 60 images, against 27 in place), and reads took 1.6-1.9x as long.
    """
    src = array.reshape(len(array), -1)
    if out is None:
        out = np.empty_like(array)
    dst = out.reshape(len(out), -1)
    rows = len(src)
    size = max(1, math.isqrt(rows))
    count = rows // size
    blocks, sums = src[: count * size].reshape(count, size, -1), dst[: count * size].reshape(count, size, -1)
    if dst is not src:
        sums[:, 0] = blocks[:, 0]
    for i in range(1, size):
        np.add(blocks[:, i], sums[:, i - 1], out=sums[:, i])
    for j in range(1, count):
        np.add(sums[j], sums[j - 1, -1], out=sums[j])
    for r in range(count * size, rows):  # the rows after the last whole block
        np.add(src[r], dst[r - 1], out=dst[r])
    return out


_FILTERS = {ROWS: (difference_rows, sum_rows), ROW_TREE: (difference_row_tree, sum_row_tree)}  # layout: (do, undo)


def shuffle(array: np.ndarray):
    """The array's bytes, for multi-byte dtypes grouped by byte position (all first bytes, then all second
    bytes, ...), as HDF5's and Blosc's shuffle filters do: the exponent bytes of floats repeat a lot and
    compress well once they stand together, the mantissa bytes do not."""
    if array.itemsize == 1:
        return array.reshape(-1).data
    return array.view(np.uint8).reshape(-1, array.itemsize).T.copy().reshape(-1).data


def unshuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """``shuffle`` undone: the byte planes of ``raw`` (uint8) put back together as little-endian words.

    Shifting and or-ing whole planes as wide integers runs about 13 times faster than numpy's strided
    transpose of the bytes (24 us against 323 us for 256 KB here): reading a shuffled entry stays cheap.
    """
    if itemsize == 1:
        return raw
    planes = raw.reshape(itemsize, -1)
    word = np.dtype(f"<u{itemsize}")
    out = planes[0].astype(word)
    for i in range(1, itemsize):
        out |= planes[i].astype(word) << np.uint8(8 * i)
    return out


def read_index(data: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(data)).read_all()


DESCRIPTION = b"lit-dist shard"  # schema metadata key of an index file: its shard's manifest entry, as JSON


def described_index(index: bytes, entry: dict) -> bytes:
    """An index file's bytes with its shard's manifest entry (name, fingerprint, size, sha256, encoding, counts)
    in its schema's metadata: a shard and its index then describe themselves, and a damaged or lost manifest is
    rebuilt from the index files (``CacheStore.manifest``). Readers that do not look for it read it as before."""
    table = read_index(index).replace_schema_metadata({DESCRIPTION: json.dumps(entry, sort_keys=True).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def index_description(index: pa.Table) -> dict | None:
    """The manifest entry an index file carries (``described_index``); None for index files written before."""
    raw = (index.schema.metadata or {}).get(DESCRIPTION)
    if raw is None:
        return None
    entry = json.loads(raw)
    return entry if isinstance(entry, dict) else None


class CorruptEntry(BadSample):
    """A cached entry's bytes do not match its crc32, or do not decode: replaced like a bad image."""


def decode(data: bytes | memoryview, crc: int, dtype: str, encoding: dict | None = None) -> np.ndarray:
    """One sample's array from its byte range, checked against its crc32. ``encoding``: the ``values`` and
    ``layout`` of its shard's manifest entry (none for shards written before either)."""
    if zlib.crc32(data) != crc:
        raise CorruptEntry("crc32 mismatch")
    encoding = encoding or {}
    try:
        message = pa.ipc.read_message(pa.py_buffer(data))
        batch = pa.ipc.read_record_batch(message, schema(dtype))
        shape = batch.column(2)[0].as_py()
        value = batch.column(3)[0].as_buffer()
        kind = np.dtype(DTYPES[dtype])
        # Only a decompression is surely ours to overwrite (pyarrow 26 copies a message it reads, but does not
        # document it; a zero-copy read would make ``value`` a view of the caller's ``data``).
        decompressed = False
        if encoding.get("values") == VALUES:
            size = math.prod(shape) * kind.itemsize
            if len(value) < size:
                value, decompressed = _ZSTD.decompress(value, decompressed_size=size), True
            elif len(value) > size:
                raise CorruptEntry(f"{len(value)} bytes for an array of {size}")
        return restored(np.frombuffer(value, dtype=np.uint8), kind, shape, encoding.get("layout"), in_place=decompressed)
    except (pa.ArrowException, ValueError) as exc:
        raise CorruptEntry(str(exc)) from exc
