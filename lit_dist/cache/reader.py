"""Looking samples up in a cache: the published index of a field, matched against what a run needs.

A run keeps, per cached field and sample, 14 bytes: the shard (int16, -1 when absent; int32
past 32 K shards), the entry's offset and length in it and its crc32 (uint32 each). Reading a sample reads
that byte range and nothing else: a slice of the memory-mapped shard locally, one ranged
GET on an object store.
"""

import dataclasses
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lit_dist.cache.keys import _combine
from lit_dist.cache.shards import ENCODING_KEYS, CorruptEntry, decode, read_index
from lit_dist.reading.unreadable import MISSING as FILE_MISSING
from lit_dist.reading.unreadable import BadSample
from lit_dist.runtime import outage

MISSING = -1


@dataclass
class Coverage:
    """How much of what a run needs a field's cache holds."""

    field: str
    needed: int = 0
    hits: int = 0
    stale: int = 0  # the sample has entries, but none with today's key (source, transform or encoder changed)
    unreadable: int = 0  # known bad sources (recorded while building): replaced at load like bad images
    other_configs: tuple = ()  # fingerprints of the stale entries' configurations
    damaged: dict = dataclasses.field(default_factory=dict)  # shard name -> why it is not read: its samples count as missing

    @property
    def missing(self) -> int:
        return self.needed - self.hits - self.unreadable

    def add(self, other: "Coverage") -> None:
        self.needed += other.needed
        self.hits += other.hits
        self.stale += other.stale
        self.unreadable += other.unreadable
        self.other_configs = tuple(sorted(set(self.other_configs) | set(other.other_configs)))
        self.damaged = {**self.damaged, **other.damaged}

    def summary(self) -> str:
        damaged = "; ".join(f"shard {name} {problem}" for name, problem in sorted(self.damaged.items())[:3])
        if len(self.damaged) > 3:
            damaged += f"; {len(self.damaged) - 3} more damaged shards"
        return (f"{self.field}: {self.hits} of {self.needed} cached ({self.hits / max(self.needed, 1):.1%}), "
                f"{self.missing} missing ({self.stale} of them stale), {self.unreadable} unreadable sources"
                + (f" (damaged, not read: {damaged})" if damaged else ""))


class FieldIndex:
    """Every published entry of one field, sorted for lookups."""

    def __init__(self, store, field: str, shards: list[dict]):
        self.store, self.field = store, field
        # A shard whose data or index file is missing, of another size or unreadable is left out (its samples are
        # missing: mode read refuses to start, a build rebuilds them), not found in the middle of an epoch.
        self.damaged: dict[str, str] = {}
        sizes = store.file_sizes(field) if shards else {}  # one listing, not a request per file
        usable = []
        for s in shards:
            if problem := store.shard_problem(field, s, False, sizes):
                self.damaged[s["name"]] = f"{problem} ({s['samples']} samples)"
            else:
                usable.append(s)

        def read(shard: dict):
            try:
                return read_index(store.read_index(field, shard))
            except (FileNotFoundError, ValueError) as exc:  # gone meanwhile; not its sha256; not an index
                return exc

        with ThreadPoolExecutor(8) as pool:  # object stores: the index files are read concurrently
            tables, self.shards = [], []
            for s, table in zip(usable, pool.map(read, usable), strict=True):
                if isinstance(table, Exception):
                    self.damaged[s["name"]] = f"index file unreadable: {table} ({s['samples']} samples)"
                else:
                    tables.append(table)
                    self.shards.append(s)
        shards = self.shards
        self.fingerprints = np.array([s["fingerprint"] for s in shards]) if shards else np.zeros(0, dtype="<U16")
        count = sum(t.num_rows for t in tables)
        self.sample = np.empty(count, dtype=np.uint64)
        self.key = np.empty(count, dtype=np.uint64)
        self.shard = np.empty(count, dtype=np.int32)
        self.offset = np.empty(count, dtype=np.uint32)
        self.length = np.empty(count, dtype=np.uint32)
        self.crc = np.empty(count, dtype=np.uint32)
        at = 0
        for i, table in enumerate(tables):
            n = table.num_rows
            for name in ("sample", "key", "offset", "length"):
                getattr(self, name)[at : at + n] = table.column(name).to_numpy()
            self.crc[at : at + n] = table.column("crc32").to_numpy()
            self.shard[at : at + n] = i
            at += n
        self._combined = _combine(self.sample, self.key)
        self._order = np.argsort(self._combined, kind="stable")
        self._sorted = self._combined[self._order]
        self._samples = np.unique(self.sample)

    def match(self, samples: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, Coverage]:
        """Per needed sample, the entry position in this index (-1 if none), and the coverage."""
        coverage = Coverage(self.field, needed=len(samples), damaged=dict(self.damaged))
        if not len(self._sorted):
            found = np.full(len(samples), MISSING, dtype=np.int64)
            return found, coverage
        wanted = _combine(samples, keys)
        at = np.minimum(np.searchsorted(self._sorted, wanted), len(self._sorted) - 1)
        entry = self._order[at]
        hit = (self._sorted[at] == wanted) & (self.sample[entry] == samples) & (self.key[entry] == keys)
        found = np.where(hit, entry, MISSING)
        bad = hit & (self.length[entry] == 0)
        coverage.hits = int((hit & ~bad).sum())
        coverage.unreadable = int(bad.sum())
        stale = ~hit & np.isin(samples, self._samples)
        coverage.stale = int(stale.sum())
        if coverage.stale:
            mine = np.isin(self.sample, samples[stale])
            coverage.other_configs = tuple(sorted(set(self.fingerprints[np.unique(self.shard[mine])].tolist())))
        return found, coverage

    def view(self, found: np.ndarray, dtype: str, orders: int = 1) -> "FieldView":
        """The entries ``found`` (``match``'s) as a view; ``orders``: entries per row, order-major (caption tag
        orders)."""
        ok = found >= 0
        entry = np.where(ok, found, 0)
        shard_type = np.int16 if len(self.shards) < 2**15 else np.int32  # 2 bytes a sample saved below 32 K shards
        if not len(self.shard):
            return FieldView(self.field, dtype, [], self.store.fs.storage_options, np.full(len(found), MISSING, shard_type),
                             *(np.zeros(len(found), np.uint32) for _ in range(3)),  # three arrays, not one thrice
                             orders=orders)
        return FieldView(
            self.field, dtype, [self.store.shard_url(self.field, s["name"]) for s in self.shards],
            self.store.fs.storage_options,
            np.where(ok, self.shard[entry], MISSING).astype(shard_type),
            np.where(ok, self.offset[entry], 0).astype(np.uint32),
            np.where(ok, self.length[entry], 0).astype(np.uint32),
            np.where(ok, self.crc[entry], 0).astype(np.uint32),
            [{k: s[k] for k in ENCODING_KEYS if k in s} for s in self.shards],
            orders=orders,
        )


class MissingEntry(BadSample):
    """No usable entry for a sample: not built, or its source could not be decoded when it was."""


class FieldView:
    """One field's entries for the samples of one dataset, by table position; safe to pickle to loader workers.
    A caption field holds ``orders`` entries per sample (its tag orders, reading/tags.py), order-major."""

    outage_deadline_s = outage.DEADLINE_S  # how long a read waits out a store that does not answer (the dataset sets its own)

    def __init__(self, field: str, dtype: str, urls: list[str], storage_options: dict, shard: np.ndarray,
                 offset: np.ndarray, length: np.ndarray, crc: np.ndarray, encodings: list[dict] | None = None,
                 orders: int = 1):
        self.field, self.dtype, self.urls, self.storage_options = field, dtype, urls, storage_options
        self.shard, self.offset, self.length, self.crc = shard, offset, length, crc
        self.encodings = encodings or [{}] * len(urls)  # per shard, from its manifest entry (shards.decode)
        self.orders = orders
        self._files, self._pid, self._fs = {}, None, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}, "_pid": None, "_fs": None}

    @property
    def rows(self) -> int:
        return len(self.shard) // self.orders

    def take(self, positions: np.ndarray) -> "FieldView":
        """The entries of ``positions`` only (for a split pickled to a spawned worker), every order of each."""
        if self.orders > 1:
            positions = np.concatenate([np.asarray(positions) + k * self.rows for k in range(self.orders)])
        return FieldView(self.field, self.dtype, self.urls, self.storage_options, self.shard[positions],
                         self.offset[positions], self.length[positions], self.crc[positions], self.encodings,
                         self.orders)

    def read(self, position: int, order: int = 0) -> np.ndarray:
        """The cached array of the sample at table ``position`` (in tag order ``order``); MissingEntry or
        CorruptEntry otherwise."""
        position += order * self.rows
        shard = int(self.shard[position])
        length = int(self.length[position])
        if shard < 0 or length == 0:
            raise MissingEntry("not in the cache" if shard < 0 else "its source could not be decoded when the cache was built")
        offset = int(self.offset[position])
        return decode(self._read(shard, offset, length), int(self.crc[position]), self.dtype, self.encodings[shard])

    def _read(self, shard: int, offset: int, length: int) -> bytes | memoryview:
        if self._pid != os.getpid():  # handles are opened per process (s3fs clients do not survive a fork)
            self._files, self._pid, self._fs = {}, os.getpid(), None
        url = self.urls[shard]
        if "://" not in url:
            # Mapped, not read: the sample's bytes are decoded straight from the page cache, no copy first.
            mapped = self._files.get(url)  # by path: an ondemand run re-numbers the shards when it publishes new ones
            if mapped is None:
                try:
                    with open(url, "rb") as f:
                        mapped = self._files[url] = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                except FILE_MISSING as exc:  # removed since the run started: its entries are bad, not the run
                    raise CorruptEntry(f"its shard {url} is missing") from exc
            if offset + length > len(mapped):
                raise CorruptEntry(f"{url} is shorter than its index says")
            return mapped[offset : offset + length]
        if self._fs is None:

            self._fs = outage.url_to_fs(url, **self.storage_options)[0]
        try:  # one ranged GET; an outage is waited out, never a bad entry
            return outage.call(lambda: self._fs.cat_file(url, start=offset, end=offset + length),
                               f"{url} (cache field {self.field})", self.outage_deadline_s)
        except FILE_MISSING as exc:  # any other error (an outage, credentials) is not the entry's: it propagates
            raise CorruptEntry(f"its shard {url} is missing") from exc


__all__ = ["Coverage", "CorruptEntry", "FieldIndex", "FieldView", "MissingEntry"]
