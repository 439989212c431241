"""The vectorised string kernels against plain-Python answers on random and edge-case names."""

import random

import numpy as np
import pyarrow as pa
import pytest

from lit_dist.reading.names import duplicates, name_hashes, scan

pytestmark = pytest.mark.unit

EDGE = ["", "a", "a" * 7, "a" * 8, "a" * 9, "a" * 16, "a" * 17, "..", "../x", "x/..", "a..b", "c:/x", "s3://b/k",
        "/abs", "\\abs", "é/ü.png", "x.", ".y", "img/0001.jpg", "img/0001.jpg\x00"]


def random_names(rng: random.Random, n: int, alphabet: str = "ab./:\\é") -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(n)]


def chunked(names: list[str], size: int) -> pa.ChunkedArray:
    """Chunks that are slices of one buffer (non-zero offsets), as pyarrow hands them out after a slice."""
    whole = pa.array(["pad"] + names + ["pad"])
    return pa.chunked_array([whole.slice(1 + i, min(size, len(names) - i)) for i in range(0, len(names), size)], pa.string())


@pytest.mark.parametrize("seed", range(6))
def test_duplicates_match_python_for_sorted_and_unsorted_tables(seed):
    rng = random.Random(seed)
    names = random_names(rng, 3000, alphabet="ab") + EDGE + EDGE[:5]  # short names over two letters repeat often
    for table in (names, sorted(names)):
        expected, seen = [], set()
        for name in table:
            expected.append(name in seen)
            seen.add(name)
        got = duplicates(chunked(table, 257))
        assert got.tolist() == expected


def test_duplicates_skip_ignored_rows_and_find_hash_collisions_exactly():
    names = pa.array(["b", "a", "b", "a", "c"])
    assert duplicates(names, ignore=np.array([True, False, False, False, False])).tolist() == [False, False, False, True, False]
    # Forced equal hashes for different names: only really equal names count.
    assert duplicates(names, hashes=np.zeros(5, dtype=np.uint64)).tolist() == [False, False, True, True, False]


def test_hashes_depend_on_the_bytes_alone():
    rng = random.Random(0)
    names = random_names(rng, 2000) + EDGE
    one = name_hashes(pa.array(names))
    assert np.array_equal(name_hashes(chunked(names, 101)), one)
    assert np.array_equal(name_hashes(pa.array(names[::-1], pa.large_string())), one[::-1])
    by_name = {}
    for name, h in zip(names, one.tolist(), strict=True):
        assert by_name.setdefault(name, h) == h
    assert len(set(by_name.values())) == len(by_name), "distinct names collided"


def test_scan_flags_missing_names_and_exactly_those_worth_a_regex():
    rng = random.Random(1)
    names = random_names(rng, 3000) + EDGE + [None]
    missing, suspicious = scan(chunked(names, 333))
    assert missing.tolist() == [not n for n in names]
    expected = [bool(n) and (n.startswith(("/", "\\")) or ":" in n or ".." in n) for n in names]
    assert suspicious.tolist() == expected
