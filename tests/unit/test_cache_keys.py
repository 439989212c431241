"""A cache entry's key follows its source file's version to the precision the filesystem's mtime reaches us with."""

import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from lit_dist.cache.keys import identity_hash, listed_identity
from tests.conftest import lit_dist

SECOND = 1_800_000_000  # 2027: float64 seconds carry about 0.24 us here


@pytest.fixture()
def photos(tmp_path):
    """Three files of equal size: a and c modified at the same instant, b one microsecond later, same second."""
    root = tmp_path / "photos"
    root.mkdir()
    Image.new("RGB", (40, 24), (200, 30, 30)).save(root / "a.jpg")
    shutil.copy(root / "a.jpg", root / "b.jpg")
    shutil.copy(root / "a.jpg", root / "c.jpg")
    for name, ns in (("a", 123_456_000), ("b", 123_457_000), ("c", 123_456_000)):
        os.utime(root / f"{name}.jpg", ns=(SECOND * 10**9, SECOND * 10**9 + ns))
    recorded = {n: os.stat(root / f"{n}.jpg").st_mtime_ns for n in "abc"}
    if recorded["a"] == recorded["b"]:
        pytest.skip(f"this filesystem records mtimes coarser than a microsecond: {recorded}")
    return root


@pytest.mark.process
def test_a_file_rewritten_within_the_same_second_is_a_new_key_in_an_indexed_table(photos, tmp_path):
    out = lit_dist("index", str(photos), "--output", str(tmp_path / "meta.parquet"))
    assert out.returncode == 0, out.stderr
    table = pq.read_table(tmp_path / "meta.parquet")
    names = table.column("filename").to_pylist()
    hashes = identity_hash(table.column("bytes").to_numpy(), table.column("mtime").to_numpy())
    keys = dict(zip(names, hashes, strict=True))
    assert keys["b.jpg"] != keys["a.jpg"], "1 us later in the same second: another version of the file"
    assert keys["c.jpg"] == keys["a.jpg"], "same size and mtime: the same version"


def test_a_file_rewritten_within_the_same_second_is_a_new_key_from_a_listing(photos):
    a, b, c = listed_identity(str(photos), ["a.jpg", "b.jpg", "c.jpg"])
    assert b != a and c == a
    assert np.array_equal(listed_identity(str(photos), ["a.jpg"]), [a]), "a key does not depend on its neighbours"
