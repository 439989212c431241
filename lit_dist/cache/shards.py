"""Shard files: many cached samples in one Arrow IPC file, one compressed record batch per sample.

Why Arrow IPC: it is an existing container with an index (the file footer lists every
record batch), any Arrow reader opens a shard (``pyarrow.ipc.open_file(path).read_all()``),
its buffer compression is zstd (or none) per record batch, and pyarrow is already a
dependency. With one sample per record batch, a sample is one contiguous byte range of
the file: the reader keeps each sample's (shard, offset, length, crc32) and reads exactly
that range (``os.pread`` locally, one ranged GET on S3), never the whole shard.

Columns of a record batch: ``sample`` and ``key`` (uint64, see ``keys``), ``shape``
(int32 list) and ``data`` (the array's bytes, C order). The dtype is in the schema metadata.

Next to each shard, ``<name>.index.arrow`` lists its entries (sample, key, offset, length,
crc32), so opening a cache reads the small index files, not the shards. An entry of length
0 records a source that could not be decoded: it is known bad, not missing.
"""

import zlib

import numpy as np
import pyarrow as pa

DTYPES = {"uint8": np.uint8, "bf16": np.uint16, "fp16": np.float16, "fp32": np.float32}  # bf16: stored as raw 16-bit
INDEX_SCHEMA = pa.schema([("sample", pa.uint64()), ("key", pa.uint64()), ("offset", pa.uint32()),
                          ("length", pa.uint32()), ("crc32", pa.uint32())])


def schema(dtype: str) -> pa.Schema:
    return pa.schema([("sample", pa.uint64()), ("key", pa.uint64()), ("shape", pa.list_(pa.int32())), ("data", pa.binary())],
                     metadata={b"dtype": dtype.encode(), b"format": b"lit-dist cache shard 1"})


class ShardWriter:
    """Collects samples of one field into a shard in memory; ``finish`` returns its bytes and index."""

    def __init__(self, dtype: str, compression: str = "zstd", level: int = 3):
        self.dtype = dtype
        self.schema = schema(dtype)
        codec = pa.Codec("zstd", compression_level=level) if compression == "zstd" else None
        self._options = pa.ipc.IpcWriteOptions(compression=codec)
        self._sink = pa.BufferOutputStream()
        self._writer = pa.ipc.new_file(self._sink, self.schema, options=self._options)
        self._index: list[tuple[int, int, int, int]] = []  # (sample, key, end offset, 0 for a bad source)
        self.raw_bytes = 0  # uncompressed payload, for the compression ratio
        self.samples = 0

    def add(self, sample: int, key: int, array: np.ndarray | None) -> None:
        """Append one sample; ``array=None`` records a source that could not be decoded."""
        if array is None:
            self._index.append((sample, key, -1))
            return
        array = np.ascontiguousarray(array)
        batch = pa.record_batch([pa.array([sample], pa.uint64()), pa.array([key], pa.uint64()),
                                 pa.array([list(array.shape)], pa.list_(pa.int32())),
                                 pa.array([array.view(np.uint8).reshape(-1).data], pa.binary())], schema=self.schema)
        self._writer.write_batch(batch)
        self._index.append((sample, key, self._sink.tell()))
        self.raw_bytes += array.nbytes
        self.samples += 1

    @property
    def nbytes(self) -> int:
        return self._sink.tell()

    def __len__(self) -> int:
        return len(self._index)

    def finish(self) -> tuple[bytes, bytes]:
        """(the shard file's bytes, its index file's bytes)."""
        self._writer.close()
        data = self._sink.getvalue().to_pybytes()
        # The first batch was written after the file's magic and schema message: its range starts there.
        start = _first_message_end(data) if self.samples else 0
        samples, keys, offsets, lengths, crcs = [], [], [], [], []
        for sample, key, end in self._index:
            samples.append(sample)
            keys.append(key)
            if end < 0:
                offsets.append(0), lengths.append(0), crcs.append(0)
                continue
            offsets.append(start)
            lengths.append(end - start)
            crcs.append(zlib.crc32(memoryview(data)[start:end]))
            start = end
        index = pa.table([pa.array(samples, pa.uint64()), pa.array(keys, pa.uint64()), pa.array(offsets, pa.uint32()),
                          pa.array(lengths, pa.uint32()), pa.array(crcs, pa.uint32())], schema=INDEX_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, INDEX_SCHEMA) as writer:
            writer.write_table(index)
        return data, sink.getvalue().to_pybytes()


def _first_message_end(data: bytes) -> int:
    """Where the schema message that follows the 8-byte file magic ends: a continuation marker, the
    metadata length, the (padded) metadata, and no body."""
    assert data[:6] == b"ARROW1" and data[8:12] == b"\xff\xff\xff\xff", "not an Arrow IPC file"
    return 16 + int.from_bytes(data[12:16], "little")


def read_index(data: bytes) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(data)).read_all()


class CorruptEntry(Exception):
    """A cached entry's bytes do not match its crc32, or do not decode."""


def decode(data: bytes | memoryview, crc: int, dtype: str) -> np.ndarray:
    """One sample's array from its byte range, checked against its crc32."""
    if zlib.crc32(data) != crc:
        raise CorruptEntry("crc32 mismatch")
    try:
        message = pa.ipc.read_message(pa.py_buffer(data))
        batch = pa.ipc.read_record_batch(message, schema(dtype))
        shape = batch.column(2)[0].as_py()
        raw = batch.column(3)[0].as_buffer()
        return np.frombuffer(raw, dtype=DTYPES[dtype]).reshape(shape)
    except (pa.ArrowException, ValueError) as exc:
        raise CorruptEntry(str(exc)) from exc
