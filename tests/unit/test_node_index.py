"""The node index's files: every column of a read table written once and mapped back unchanged, without a
copy; a folder too small for it is one reason to read on every rank, and leaves nothing behind."""

import numpy as np
import pytest

from lit_dist.data import node_index
from lit_dist.data.datamodule import BucketDataModule
from tests.helpers.small_fs import mounter

pytestmark = pytest.mark.unit


@pytest.fixture
def small_fs(tmp_path):
    yield from mounter(tmp_path)


def test_every_column_comes_back_mapped_and_equal(tmp_path, demo_data):
    dm = BucketDataModule(str(demo_data), resolution=32, num_workers=0, extra_columns=["caption"])
    parts, classes = dm._read_tables()
    node_index.write(str(tmp_path / "index"), parts, classes)
    loaded, loaded_classes = node_index.load(str(tmp_path / "index"))
    assert loaded_classes == classes and len(classes) == 4
    (meta, buckets, splits), (back, back_buckets, back_splits) = parts[0], loaded[0]
    assert isinstance(back_buckets, np.memmap) and isinstance(back.labels, np.memmap), "mapped, not read into memory"
    assert np.array_equal(back_buckets, buckets) and np.array_equal(back_splits, splits)
    assert np.array_equal(back.labels, meta.labels) and back.classes == meta.classes
    assert back.filenames.equals(meta.filenames) and back.sizes.equals(meta.sizes)
    assert back.extra.keys() == {"caption"} and back.extra["caption"].equals(meta.extra["caption"])
    assert (back.rows, back.identity, back.source) == (meta.rows, meta.identity, meta.source)


def test_a_folder_too_small_is_a_reason_to_read_on_every_rank_and_is_left_empty(small_fs, demo_data):
    shm = small_fs("shm", 16)
    dm = BucketDataModule(str(demo_data), resolution=32, num_workers=0)
    why = node_index._write_or_why_not(str(shm), str(shm / "lit-dist-index-x-node0"), dm._read_tables())
    assert why is not None and "No space left on device" in why, why
    assert list(shm.iterdir()) == []
