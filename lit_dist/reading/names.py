"""Vectorised work over a pyarrow string column: unsafe-path candidates, hashes, duplicates.

pyarrow's string kernels take 10-40 ns per row, and hashing or sorting tens of
millions of names with them takes seconds. These functions read each chunk's
offsets and character buffer with numpy (views, no per-row Python) and leave
exact per-row answers (regexes, string equality) to pyarrow on the few rows
that need one.
"""

import numpy as np

from lit_dist.reading.hashing import GOLDEN_GAMMA, MIX1, MIX2

# Odd 64-bit constants of splitmix64 / the golden ratio: multiplication by them spreads every input bit upward.
_M1, _M2, _M3 = np.uint64(GOLDEN_GAMMA), np.uint64(MIX1), np.uint64(MIX2)
_COLON, _DOT, _SLASH, _BACKSLASH = 58, 46, 47, 92


def chunks_of(strings) -> list:
    import pyarrow as pa

    return strings.chunks if isinstance(strings, pa.ChunkedArray) else [strings]


def _offsets(chunk) -> np.ndarray:
    """The n + 1 byte offsets of a string array's values into its character buffer (a view, int32 or int64)."""
    import pyarrow as pa

    width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
    return np.frombuffer(chunk.buffers()[1], dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]


def _layout(chunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each string's start and length (int64) in ``data``, the chunk's characters (a uint8 view)."""
    offsets = _offsets(chunk).astype(np.int64)
    first, last = int(offsets[0]), int(offsets[-1])
    buffer = chunk.buffers()[2]
    data = np.frombuffer(buffer, dtype=np.uint8)[first:last] if buffer is not None else np.zeros(0, np.uint8)
    return offsets[:-1] - first, np.diff(offsets), data


class Scratch:
    """Work arrays reused from chunk to chunk.

    A few MB of numpy temporaries per chunk would each be a fresh allocation, which
    glibc maps and unmaps every time: tens of thousands of page faults per 10 M names.
    Arrays of at least 4 MB also get transparent huge pages from numpy.
    """

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int, dtype) -> np.ndarray:
        array = self._arrays.get(name)
        if array is None or len(array) < size or array.dtype != dtype:
            array = self._arrays[name] = np.empty(max(size, (4 << 20) // np.dtype(dtype).itemsize), dtype=dtype)
        return array[:size]


def scan(strings) -> tuple[np.ndarray, np.ndarray]:
    """Two masks: names missing (null or empty), and names worth a closer look as unsafe paths.

    The second is True for every name that starts with ``/`` or ``\\`` or contains ``:``
    or ``..`` (a superset of unsafe paths). A few byte comparisons per chunk into reused
    arrays; in the usual table no byte matches and no row needs a closer look.
    """
    missing = np.empty(len(strings), dtype=bool)
    suspicious = np.empty(len(strings), dtype=bool)
    scratch = Scratch()
    done = 0
    for chunk in chunks_of(strings):
        n = len(chunk)
        absent, mask = missing[done : done + n], suspicious[done : done + n]  # views: written in place
        done += n
        offsets = _offsets(chunk)
        lengths = np.subtract(offsets[1:], offsets[:-1], out=scratch.get("lengths", n, offsets.dtype))
        np.equal(lengths, 0, out=absent)
        if chunk.null_count:
            absent |= chunk.is_null().to_numpy(zero_copy_only=False)
        buffer = chunk.buffers()[2]
        if buffer is None or not buffer.size:
            mask[:] = False
            continue
        everything = np.frombuffer(buffer, dtype=np.uint8)  # offsets index this buffer directly
        lead = np.take(everything, offsets[:-1], out=scratch.get("lead", n, np.uint8), mode="clip")
        np.equal(lead, _SLASH, out=mask)
        mask |= np.equal(lead, _BACKSLASH, out=scratch.get("flag", n, bool))
        mask &= ~absent  # the byte read for an empty name belongs to a neighbour
        first, last = int(offsets[0]), int(offsets[-1])
        data = everything[first:last]
        colons = np.equal(data, _COLON, out=scratch.get("colons", len(data), bool))
        dots = np.equal(data, _DOT, out=scratch.get("dots", len(data), bool))
        pairs = np.logical_and(dots[:-1], dots[1:], out=scratch.get("pairs", max(len(data) - 1, 0), bool))
        for hits, width in ((colons, 1), (pairs, 2)):
            if hits.any():
                at = np.flatnonzero(hits) + first
                # The string holding each hit: the last one starting at or before it (empty ones start there too).
                rows = np.searchsorted(offsets[:-1], at, side="right") - 1
                inside = at + width <= offsets[rows + 1]  # not a pair across two names
                mask[rows[inside]] = True
    return missing, suspicious


def name_hashes(strings) -> np.ndarray:
    """A 64-bit hash of each string's bytes (uint64), independent of its row, chunk or table.

    Each string is read as 8-byte words (unaligned loads from a strided view of the
    buffer, the last word masked to the string's length), combined with a
    multiply-xorshift and finished with the splitmix64 finaliser. Cost: a few numpy
    operations per 8 bytes of the longest names, only over the rows that long.
    """
    out = np.empty(len(strings), dtype=np.uint64)
    scratch = Scratch()
    done = 0
    for chunk in chunks_of(strings):
        _chunk_hashes(chunk, out[done : done + len(chunk)], scratch)
        done += len(chunk)
    return out


def _chunk_hashes(chunk, h: np.ndarray, scratch: Scratch) -> None:
    """Write the hashes of one chunk's strings into ``h``."""
    starts, lengths, raw = _layout(chunk)
    data = scratch.get("bytes", len(raw) + 16, np.uint8)  # 8-byte loads at the last strings stay inside
    data[: len(raw)] = raw
    data[len(raw) :] = 0
    words = np.ndarray((len(data) - 7,), dtype=np.uint64, buffer=data, offset=0, strides=(1,))  # words[p]: bytes p..p+7
    h[:] = lengths  # (int64 times uint64 would promote to float64)
    h *= _M1
    if not len(h):
        return
    # Words every string has in full need no masks and no row selection: the bulk of the work.
    shortest = int(lengths.min())
    for word in range(shortest // 8):
        _mix(h, words[starts + 8 * word])
    word = shortest // 8
    rows = np.flatnonzero(lengths > 8 * word)
    while len(rows):
        left = lengths[rows] - 8 * word
        w = words[starts[rows] + 8 * word]
        short = left < 8
        if short.any():
            w[short] &= (np.uint64(1) << (left[short].astype(np.uint64) * np.uint64(8))) - np.uint64(1)
        x = h[rows]
        _mix(x, w)
        h[rows] = x
        word += 1
        rows = rows[left > 8]
    h ^= h >> np.uint64(32)
    h *= _M3
    h ^= h >> np.uint64(29)


def _mix(h: np.ndarray, w: np.ndarray) -> None:
    """Fold one word per row into the running hashes, in place."""
    h ^= w
    h *= _M2
    h ^= h >> np.uint64(29)


def sorted_duplicates(strings) -> np.ndarray | None:
    """For a table sorted by name (as scans write them), its duplicates, found in two comparison passes; else None.

    True marks every occurrence of a name after its first: equal names are neighbours.
    """
    import pyarrow.compute as pc

    n = len(strings)
    if n < 2:
        return np.zeros(n, dtype=bool)
    head, tail = strings.slice(0, n - 1), strings.slice(1)
    if strings.null_count or pc.any(pc.less(tail, head)).as_py():
        return None
    out = np.zeros(n, dtype=bool)
    out[1:] = pc.equal(tail, head).to_numpy(zero_copy_only=False)
    return out


def duplicates(strings, hashes: np.ndarray | None = None, ignore: np.ndarray | None = None) -> np.ndarray:
    """True for every occurrence of a string after its first (by row).

    A table sorted by name is checked by :func:`sorted_duplicates`. Otherwise equal hashes
    pick the candidates (usually none) and pyarrow compares just those: sorting all names
    instead takes several seconds at 10 M unordered rows. Rows in ``ignore`` (already bad)
    are never candidates, and ``hashes`` (from :func:`name_hashes`) are reused when given.
    """
    found = sorted_duplicates(strings)
    return found if found is not None else hashed_duplicates(strings, hashes, ignore)


def hashed_duplicates(strings, hashes: np.ndarray | None = None, ignore: np.ndarray | None = None) -> np.ndarray:
    """:func:`duplicates` for names in any order: equal hashes pick the candidates, pyarrow compares those."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = np.zeros(len(strings), dtype=bool)
    if hashes is None:
        hashes = name_hashes(strings)
    repeated = _repeated(hashes if ignore is None else hashes[~ignore])
    if not len(repeated):
        return out
    at = np.minimum(np.searchsorted(repeated, hashes), len(repeated) - 1)
    candidates = repeated[at] == hashes
    if ignore is not None:
        candidates &= ~ignore
    rows = np.flatnonzero(candidates)
    names = strings.take(pa.array(rows))
    order = pc.sort_indices(names).to_numpy()  # stable: equal names keep row order, so the first is kept
    sorted_names = names.take(pa.array(order))
    same = pc.fill_null(pc.equal(sorted_names.slice(1), sorted_names.slice(0, len(rows) - 1)), False)
    out[rows[order[1:][same.to_numpy(zero_copy_only=False)]]] = True
    return out


def _repeated(values: np.ndarray) -> np.ndarray:
    """The values (uint64) that occur more than once, sorted.

    Sorting is the one O(n log n) step; the two halves of the value range sort on two
    threads (numpy's sort releases the GIL), which halves the wait on two or more cores.
    """
    from concurrent.futures import ThreadPoolExecutor

    high = values >= np.uint64(1 << 63)
    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(np.sort, (values[~high], values[high])))
    return np.concatenate([np.unique(s[1:][s[1:] == s[:-1]]) for s in halves])
