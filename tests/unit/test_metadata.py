import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lit_dist.data.metadata import hash_split, read_metadata
from lit_dist.errors import DataError


def write(path, **columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def test_a_folder_of_tables_and_a_glob_read_like_one_table(tmp_path):
    write(tmp_path / "meta" / "part-0.parquet", filename=["a.png", "b.png"], width=[10, 20], height=[10, 10])
    write(tmp_path / "meta" / "sub" / "part-1.parquet", filename=["c.png"], width=[30], height=[10])
    meta = read_metadata(str(tmp_path / "meta"))
    assert meta.filenames.to_pylist() == ["a.png", "b.png", "c.png"]
    assert meta.sizes.column("width").to_pylist() == [10, 20, 30]
    assert read_metadata(str(tmp_path / "meta" / "*.parquet")).filenames.to_pylist() == ["a.png", "b.png"]


def test_every_kind_of_bad_row_is_skipped_counted_and_shown(tmp_path):
    path = write(tmp_path / "m.parquet",
                 filename=["ok.png", "/etc/passwd", "../up.png", "a/../../b.png", "s3://x/y.png", "C:\\w.png", "", None,
                           "ok.png", "small.png", "nan.png", "fine..name.png"],
                 width=[5, 5, 5, 5, 5, 5, 5, 5, 5, 0, None, 5], height=[5] * 12)
    meta = read_metadata(str(path))
    assert meta.filenames.to_pylist() == ["ok.png", "fine..name.png"]
    assert meta.rows.tolist() == [0, 11]
    counts = meta.bad.counts
    assert counts["absolute path"] == 2 and counts["URL instead of a relative path"] == 1
    assert counts["'..' in the path (would escape the dataset root)"] == 2
    assert counts["missing filename"] == 2 and counts["duplicate filename (first kept)"] == 1
    assert counts["missing or non-positive width/height"] == 2
    assert "'/etc/passwd'" in meta.bad.summary()
    with pytest.raises(DataError, match="10 bad rows and data.strict is true") as err:
        read_metadata(str(path), strict=True)
    assert "1 duplicate filename (e.g." in str(err.value) and "first kept" not in str(err.value), "nothing is kept"


def test_fsspec_chained_names_are_counted_with_the_urls(tmp_path):
    path = write(tmp_path / "m.parquet", filename=["ok.png", "file::/etc/passwd", "simplecache::s3://b/k.png", "a/b::c.png"],
                 width=[5] * 4, height=[5] * 4)
    meta = read_metadata(str(path))
    assert meta.filenames.to_pylist() == ["ok.png"]
    assert meta.bad.counts == {"URL instead of a relative path": 3}
    assert "'file::/etc/passwd'" in meta.bad.summary()


def test_row_order_changes_neither_the_bad_rows_nor_the_split(tmp_path):
    names = [f"img/{i % 900:05d}.png" for i in range(1000)]  # 100 duplicates
    order = np.random.default_rng(0).permutation(len(names))
    sorted_path = write(tmp_path / "sorted.parquet", filename=sorted(names), width=[8] * 1000, height=[8] * 1000)
    shuffled_path = write(tmp_path / "shuffled.parquet", filename=[sorted(names)[i] for i in order],
                          width=[8] * 1000, height=[8] * 1000)
    in_order, shuffled = (read_metadata(str(p), val_fraction=0.2) for p in (sorted_path, shuffled_path))
    for meta in (in_order, shuffled):
        assert meta.bad.counts == {"duplicate filename (first kept)": 100} and len(meta) == 900
    split_of = dict(zip(in_order.filenames.to_pylist(), in_order.splits.tolist(), strict=True))
    assert all(split_of[name] == split for name, split in zip(shuffled.filenames.to_pylist(), shuffled.splits.tolist(), strict=True))
    assert 0.1 < in_order.splits.mean() < 0.3


def test_extra_columns_and_split_column(tmp_path):
    path = write(tmp_path / "m.parquet", filename=["a", "b", "c"], width=[1, 1, 1], height=[1, 1, 1],
                 caption=["x", "y", "z"], score=[0.5, 0.25, 1.0], split=["train", "val", "test"])
    meta = read_metadata(str(path))
    assert list(meta.extra) == ["caption"] and meta.splits.tolist() == [0, 1, 2]
    meta = read_metadata(str(path), extra_columns=["score", "caption"])
    assert meta.extra["score"].to_pylist() == [0.5, 0.25, 1.0]
    with pytest.raises(DataError, match=r"extra_columns names \['nope'\]"):
        read_metadata(str(path), extra_columns=["nope"])
    bad_split = write(tmp_path / "s.parquet", filename=["a"], width=[1], height=[1], split=["training"])
    with pytest.raises(DataError, match="split has values.*training.*use train, val or test"):
        read_metadata(str(bad_split))


def test_wrong_column_types_are_named(tmp_path):
    path = write(tmp_path / "m.parquet", filename=["a"], width=["wide"], height=[1])
    with pytest.raises(DataError, match="column width has type string"):
        read_metadata(str(path))


def test_hash_split_is_stable_per_name_and_near_the_fraction():
    names = pa.array([f"img/{i:07d}.jpg" for i in range(20000)])
    split = hash_split(names, 0.1)
    assert abs(split.mean() - 0.1) < 0.01
    assert np.array_equal(hash_split(names.slice(100, 50), 0.1), split[100:150])
    assert np.array_equal(hash_split(pa.array(names.to_pylist()[::-1]), 0.1), split[::-1])
