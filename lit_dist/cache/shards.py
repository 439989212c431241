"""Shard files: many cached samples in one Arrow IPC stream, one record batch (message) per sample.

Why Arrow IPC: it is an existing, documented container; any Arrow reader opens a shard
(``pyarrow.ipc.open_stream(path).read_all()``); its buffer compression is zstd, chosen per
record batch; and pyarrow is already a dependency. With one sample per record batch, a sample
is one contiguous byte range: the reader keeps each sample's (shard, offset, length, crc32)
and reads exactly that range (a slice of the memory-mapped file locally, one ranged GET on
S3), never the whole shard.

Columns of a record batch: ``sample`` and ``key`` (uint64, see ``keys``), ``shape``
(int32 list) and ``data`` (the array's bytes, C order; for multi-byte dtypes byte-shuffled, see
``shuffle``; for uint8 images, in shards whose manifest entry says ``"layout": "rows"``, each
row minus the row above, see ``difference_rows``). The dtype is in the schema metadata.

Next to each shard, ``<name>.index.arrow`` (an Arrow IPC file) lists its entries (sample, key,
offset, length, crc32): the index a stream has no footer for, and what opening a cache reads
instead of the shards. An entry of length 0 records a source that could not be decoded: it is
known bad, not missing.
"""

import zlib

import numpy as np
import pyarrow as pa

DTYPES = {"uint8": np.uint8, "bf16": np.uint16, "fp16": np.float16, "fp32": np.float32}  # bf16: stored as raw 16-bit
INDEX_SCHEMA = pa.schema([("sample", pa.uint64()), ("key", pa.uint64()), ("offset", pa.uint32()),
                          ("length", pa.uint32()), ("crc32", pa.uint32())])


def schema(dtype: str) -> pa.Schema:
    return pa.schema([("sample", pa.uint64()), ("key", pa.uint64()), ("shape", pa.list_(pa.int32())), ("data", pa.binary())],
                     metadata={b"dtype": dtype.encode(), b"format": b"lit-dist cache shard 2",
                               b"layout": b"C order; bytes shuffled by position for multi-byte dtypes; "
                                          b"uint8 images as row differences where the manifest says layout rows"})


class ShardWriter:
    """Collects samples of one field into a shard in memory; ``finish`` returns its bytes and index.

    The shard is an Arrow IPC stream: the schema message, one record batch message per sample, the
    end-of-stream marker. Each sample's message is zstd-compressed, or left uncompressed when that
    saves less than ``min_savings`` of its bytes (near-incompressible photos: reading is then a copy,
    not a decompression); Arrow readers handle both in one stream.
    """

    def __init__(self, dtype: str, compression: str = "zstd", level: int = 3, min_savings: float = 0.1,
                 row_differences: bool = False):
        self.dtype = dtype
        # Images (uint8, rows first) as row differences, if asked: zstd compresses photos' to about half, where
        # their plain bytes hardly compress (1.82x against 1.11x, benchmarks/bench_cache.py); reading costs more.
        self.layout = ROWS if row_differences and dtype == "uint8" else None
        self.schema = schema(dtype)
        self.codec = pa.Codec("zstd", compression_level=level) if compression == "zstd" else None
        self.min_savings = min_savings
        self._options = {True: pa.ipc.IpcWriteOptions(compression=self.codec), False: pa.ipc.IpcWriteOptions()}
        self._parts = [_message(self.schema, None, self._options[False])]
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
        raw = stored(array, self.layout)
        batch = pa.record_batch([pa.array([sample], pa.uint64()), pa.array([key], pa.uint64()),
                                 pa.array([list(array.shape)], pa.list_(pa.int32())), pa.array([raw], pa.binary())],
                                schema=self.schema)
        compress = self.codec is not None and len(self.codec.compress(raw)) <= (1 - self.min_savings) * len(raw)
        message = _message(self.schema, batch, self._options[compress])
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


def _message(schema: pa.Schema, batch: pa.RecordBatch | None, options: pa.ipc.IpcWriteOptions) -> bytes:
    """The encapsulated IPC message of ``batch`` (or of the schema, for None) as a stream writer writes it."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        if batch is not None:
            writer.write_batch(batch)
    data = sink.getvalue().to_pybytes()[: -len(_END_OF_STREAM)]
    schema_end = 8 + int.from_bytes(data[4:8], "little")  # continuation marker, metadata length, metadata
    return data[:schema_end] if batch is None else data[schema_end:]


ROWS = "rows"  # a shard's layout: uint8 arrays stored as row differences (difference_rows)


def stored(array: np.ndarray, layout: str | None):
    """The bytes a shard of ``layout`` stores for ``array`` (before compression)."""
    if layout == ROWS and array.dtype == np.uint8 and array.ndim >= 2:
        return difference_rows(array).reshape(-1).data
    return shuffle(array)


def difference_rows(array: np.ndarray) -> np.ndarray:
    """Each row minus the row above, modulo 256 (PNG's Up filter): neighbouring rows of an image are alike, so
    the differences are small numbers that compress, where the pixels themselves (noise, texture) do not.
    ``np.cumsum(..., axis=0, dtype=np.uint8)`` undoes it, a whole row at a time."""
    out = np.empty_like(array)
    out[0] = array[0]
    np.subtract(array[1:], array[:-1], out=out[1:])
    return out


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


class CorruptEntry(Exception):
    """A cached entry's bytes do not match its crc32, or do not decode."""


def decode(data: bytes | memoryview, crc: int, dtype: str, layout: str | None = None) -> np.ndarray:
    """One sample's array from its byte range (in a shard of ``layout``), checked against its crc32."""
    if zlib.crc32(data) != crc:
        raise CorruptEntry("crc32 mismatch")
    try:
        message = pa.ipc.read_message(pa.py_buffer(data))
        batch = pa.ipc.read_record_batch(message, schema(dtype))
        shape = batch.column(2)[0].as_py()
        raw = np.frombuffer(batch.column(3)[0].as_buffer(), dtype=np.uint8)
        array = unshuffle(raw, np.dtype(DTYPES[dtype]).itemsize).view(DTYPES[dtype]).reshape(shape)
        if layout == ROWS and array.dtype == np.uint8 and array.ndim >= 2:
            return np.cumsum(array, axis=0, dtype=np.uint8)
        return array
    except (pa.ArrowException, ValueError) as exc:
        raise CorruptEntry(str(exc)) from exc
