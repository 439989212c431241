import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.data.dataset import BucketImageDataset
from lit_dist.data.metadata import read_metadata
from lit_dist.errors import DataError
from tests.conftest import CONFIGS


def test_missing_metadata_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"data.metadata = .*nope.parquet.*no parquet file.*create_demo_if_missing"):
        read_metadata(str(tmp_path / "nope.parquet"))


def test_missing_columns_are_named(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"filename": ["a.png"], "w": [3]}), path)
    with pytest.raises(DataError, match="lacks the required column.*width, height"):
        read_metadata(str(path))


def test_bad_rows_are_skipped_and_counted_and_string_labels_mapped(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({
        "filename": ["a.png", "b.png", None, "d.png", "e.png"],
        "width": [10, 0, 10, 10, None],
        "height": [10, 10, 10, 10, 10],
        "label": ["dog", "cat", "cat", "cat", "dog"],
    }), path)
    meta = read_metadata(str(path))
    assert meta.bad.total == 3
    assert meta.filenames.to_pylist() == ["a.png", "d.png"]
    assert list(meta.rows) == [0, 3]
    assert meta.classes == ["cat", "dog"] and list(meta.labels) == [1, 0]


def test_batches_are_uint8_bucket_sized_and_crops_repeat_per_seed_epoch_index(demo_data):
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    request = next(iter(loader.sampler))
    first, again = loader.dataset[request], loader.dataset[request]
    width, height = dm.bucket_sizes[loader.dataset.bucket_ids[request[1][0]]]
    assert first["image"].dtype == torch.uint8 and first["image"].shape == (8, height, width, 3)
    assert torch.equal(first["image"], again["image"])
    later = loader.dataset[(request[0] + 1, request[1], 1.0)]
    assert not torch.equal(first["image"], later["image"]), "random crops should change with the epoch"
    normalised = dm.on_after_batch_transfer(dict(first), 0)["image"]
    assert normalised.shape == (8, 3, height, width)
    assert normalised.dtype == torch.float32 and -1.01 <= normalised.min() and normalised.max() <= 1.01


def test_crop_offsets_are_uniform_and_independent_over_positions_and_of_each_other():
    from lit_dist.reading.crops import crop_offsets

    free = 10  # 11 positions each way, 121 (left, top) cells
    offsets = np.array([crop_offsets(seed, epoch, index, free, free)
                        for seed in (0, 7) for epoch in (0, 1) for index in range(6050)])
    assert offsets.min() == 0 and offsets.max() == free
    cells = np.bincount(offsets[:, 0] * (free + 1) + offsets[:, 1], minlength=(free + 1) ** 2)
    expected = len(offsets) / len(cells)  # 200 a cell
    chi2 = ((cells - expected) ** 2 / expected).sum()
    assert chi2 < 180, f"(left, top) not uniform: chi-square {chi2:.0f} over 120 degrees of freedom"
    wide = {crop_offsets(s, e, i, 999, 999) for s in range(3) for e in range(3) for i in range(3)}
    assert len(wide) == 27, "another seed, epoch or index should give another crop"
    assert {crop_offsets(1, 2, 3, 0, 5)[0], crop_offsets(1, 2, 3, 5, 0)[1]} == {0}, "no room: offset 0"


def test_a_corrupt_image_is_replaced_by_another_of_its_bucket(demo_data, tmp_path, caplog):
    meta = read_metadata(str(demo_data))
    bucket_sizes = np.array([[32, 32]])
    dataset = BucketImageDataset(str(demo_data.parent), meta.filenames, bucket_sizes, np.zeros(len(meta), dtype=np.int64))
    broken = demo_data.parent / meta.filenames[0].as_py()
    original = broken.read_bytes()
    try:
        broken.write_bytes(b"not an image")
        batch = dataset[(0, [0, 1], 1.0)]
    finally:
        broken.write_bytes(original)
    assert batch["image"].shape == (2, 32, 32, 3)
    assert batch["bad_samples"] == 1
    assert batch["row"].tolist() == [1, 1], "the bad sample is replaced by the next one of the same bucket"
    warned = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(warned) == 1 and f"cannot read {broken} (cannot identify image file)" in warned[0], warned


def test_demo_dataset_is_generated_once_with_a_table_that_reads_back(tmp_path, monkeypatch):
    from lit_dist.data.demo.shapes import DEMO_METADATA, demo_table

    monkeypatch.chdir(tmp_path)
    path = tmp_path / DEMO_METADATA
    dm = BucketDataModule(DEMO_METADATA, create_demo_if_missing=True, demo_num_images=40, resolution=32)
    dm.prepare_data()
    assert pq.read_table(path).equals(demo_table(40, seed=0)), "plan's table of the demo is the table generated"
    meta = read_metadata(str(path))
    assert len(meta) == 40 and meta.bad.total == 0
    assert sorted(meta.classes) == ["circle", "cross", "square", "triangle"]
    assert all((path.parent / f).is_file() for f in meta.filenames.to_pylist())
    mtime = path.stat().st_mtime_ns
    dm.prepare_data()
    assert path.stat().st_mtime_ns == mtime, "an existing dataset must not be regenerated"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".demo-")], "temporary folder left behind"
    assert (CONFIGS / "quickstart.yaml").read_text().count(f"metadata: {DEMO_METADATA}\n") == 1


def test_the_demo_is_generated_only_at_its_own_place(tmp_path):
    # A mistyped data.metadata next to create_demo_if_missing: true must not become a run on shapes.
    path = tmp_path / "some" / "where" / "meta.parquet"
    dm = BucketDataModule(str(path), create_demo_if_missing=True, demo_num_images=40, resolution=32)
    dm.prepare_data()
    assert not (tmp_path / "some").exists()
    with pytest.raises(DataError, match=r"data.metadata = .*meta.parquet.*no parquet file.*data/shapes/metadata.parquet"):
        dm.read()


def test_a_decompression_bomb_is_refused_and_replaced(tmp_path):
    from PIL import Image

    root = tmp_path / "imgs"
    root.mkdir()
    Image.new("RGB", (400, 400)).save(root / "big.png")  # 160,000 pixels: a "bomb" under a 50,000 limit
    Image.new("RGB", (100, 100), (255, 0, 0)).save(root / "small.png")
    names = pa.array(["big.png", "small.png"])
    dataset = BucketImageDataset(str(root), names, np.array([[32, 32]]), np.zeros(2, dtype=np.int64),
                                 max_image_pixels=50_000)
    batch = dataset[(0, [0], 1.0)]
    assert batch["row"].tolist() == [1] and batch["bad_samples"] == 1
    assert batch["image"][0, 0, 0].tolist() == [255, 0, 0]


def test_every_split_serves_each_sample_its_own_row_label_and_caption(demo_data, tmp_path):
    import pickle

    table = pq.read_table(demo_data)
    names = table.column("filename").to_pylist()
    n = len(names)
    labels = table.column("label").to_pylist()
    widths = table.column("width").to_pylist()
    widths[3] = 0  # a bad row: table rows and kept positions differ from here on
    table = pa.table({"filename": names, "width": widths, "height": table.column("height"), "label": labels,
                      "caption": [f"{name}|{label}" for name, label in zip(names, labels, strict=True)],
                      "split": ["val" if i % 5 == 0 else "train" for i in range(n)]})
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    dm = BucketDataModule(metadata=str(path), root=str(demo_data.parent), batch_size_per_device=4, resolution=32, num_workers=0)
    dm.setup("fit")
    for split, expected in (("train", n - n // 5 - 1), ("val", (n + 4) // 5), ("predict", n - 1)):
        dataset = dm._splits[split]
        assert len(dataset) == expected, split
        batch = dataset[(0, list(range(0, len(dataset), 7)), 1.0)]
        for row, label, caption in zip(batch["row"].tolist(), batch["label"].tolist(), batch["caption"], strict=True):
            assert row != 3 and caption == f"{names[row]}|{labels[row]}", split
            assert label == (dm.classes.index(labels[row]) if dm.classes else labels[row]), split
        if split != "predict":
            assert all(("val" if r % 5 == 0 else "train") == split for r in batch["row"].tolist())
    # A spawned loader worker gets the split pickled: its own rows only, serving the same batches.
    val = dm._splits["val"]
    sent = pickle.dumps(val)
    assert len(sent) < len(pickle.dumps(dm._splits["predict"])) / 3
    request = (0, list(range(0, len(val), 3)), 1.0)
    a, b = val[request], pickle.loads(sent)[request]
    assert a["caption"] == b["caption"] and all(torch.equal(a[k], b[k]) for k in ("row", "label", "image"))


@pytest.mark.process
def test_no_allocator_thread_that_a_forked_loader_worker_could_deadlock_on():
    # A process forked while pyarrow's jemalloc background thread holds a lock can deadlock; lit-dist turns
    # the thread off before pyarrow is imported (the fork server in test_workers.py has no thread at all).
    import os
    import subprocess
    import sys

    code = ("import glob, lit_dist, pyarrow.parquet; "
            "print(sorted(open(p).read().strip() for p in glob.glob('/proc/self/task/*/comm')))")
    env = {k: v for k, v in os.environ.items() if k != "JE_ARROW_MALLOC_CONF"}
    threads = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "jemalloc_bg_thd" not in threads, threads
