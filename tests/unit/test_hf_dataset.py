"""data.hf_dataset: a Hugging Face dataset folder (save_to_disk) is indexed once and read as a table of files is:
the same batches as the same images in files, mixed with other datasets, its index used again until its files
change, damaged images and files counted, wrong columns one line."""

import os

import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("datasets")

from lit_dist.data.datamodule import BucketDataModule  # noqa: E402
from lit_dist.data.hf_dataset import Columns, load_or_index  # noqa: E402
from lit_dist.data.sources import DatasetSource  # noqa: E402
from lit_dist.errors import ConfigError, DataError  # noqa: E402
from tests.helpers.hf_datasets import save_shapes  # noqa: E402

SETTINGS = dict(batch_size_per_device=4, resolution=32, num_workers=0, allow_oversubscription=True, cache=None,
                node_index_dir=None)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    table = tmp_path_factory.mktemp("shapes") / "metadata.parquet"
    create_shapes_dataset(str(table), num_images=96, seed=3)
    return table


def _module(tmp_path, **source) -> BucketDataModule:
    dm = BucketDataModule(**{**SETTINGS, "index_cache": str(tmp_path / "index.parquet"), **source})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_a_dataset_folder_gives_the_batches_its_images_give_as_files(shapes, tmp_path):
    folder = save_shapes(str(shapes), tmp_path / "hf", rows_per_file=20)  # several Arrow files per split
    files = BucketDataModule(metadata=str(shapes), **SETTINGS)
    files.setup("fit")
    hf = _module(tmp_path, hf_dataset=str(folder))
    for split in ("train", "val"):
        assert len(hf._splits[split]) == len(files._splits[split]) > 0, split
    for epoch in (0, 1):
        loaders = [dm.train_dataloader() for dm in (hf, files)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        ours, theirs = (list(loader) for loader in loaders)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
            assert a["caption"] == b["caption"]
    index = pq.read_table(tmp_path / "index.parquet").to_pylist()
    assert index[0]["filename"] == "train/data-00000-of-00005.arrow#0" and index[0]["split"] == "train"
    assert {r["split"] for r in index} == {"train", "val"}


def test_it_mixes_with_a_table_and_takes_the_columns_it_is_told(shapes, tmp_path):
    folder = save_shapes(str(shapes), tmp_path / "hf", splits=False, caption="text")
    dm = BucketDataModule(datasets=[DatasetSource(metadata=str(shapes)),
                                    DatasetSource(hf_dataset=str(folder), index_cache=str(tmp_path / "i.parquet"))],
                          **SETTINGS)
    dm.prepare_data()
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert {int(b["dataset"][0]) for b in batches} == {0, 1}
    assert all(b["caption"][0].startswith("a ") for b in batches), "the text column is the caption"
    with pytest.raises(ConfigError, match=r"data.caption_column = 'prompt': .* has no such column \(it has: image, "
                                          r"text, label\)"):
        _module(tmp_path, hf_dataset=str(folder), caption_column="prompt", index_cache=str(tmp_path / "j.parquet"))
    with pytest.raises(ConfigError, match=r"data.image_column = 'text': in .* it holds string, not images"):
        _module(tmp_path, hf_dataset=str(folder), image_column="text", index_cache=str(tmp_path / "k.parquet"))
    # Neither a saved folder nor anything load_dataset opens (its metadata table has no file_name): one line.
    with pytest.raises(DataError, match=r"data.hf_dataset = .*: datasets.load_dataset cannot open it .*Name a folder "
                                        r"written by save_to_disk, parquet files with an image column, or a hub id"):
        _module(tmp_path, hf_dataset=str(shapes.parent))
    with pytest.raises(ConfigError, match="set exactly one of metadata, scan_root, hf_dataset, webdataset"):
        BucketDataModule(metadata=str(shapes), hf_dataset=str(folder))


def test_the_index_is_used_again_until_a_file_changes(shapes, tmp_path):
    folder = save_shapes(str(shapes), tmp_path / "hf")
    index = str(tmp_path / "index.parquet")
    load_or_index(str(folder), Columns(), index)
    made = os.stat(index).st_mtime_ns
    load_or_index(str(folder), Columns(), index)
    assert os.stat(index).st_mtime_ns == made, "indexed again though nothing changed"
    load_or_index(str(folder), Columns(label="caption"), index)  # other columns: another index
    assert pq.read_table(index).column("label")[0].as_py().startswith("a ")
    arrow = next(folder.glob("train/*.arrow"))
    os.utime(arrow, ns=(made, made + 10**9))
    load_or_index(str(folder), Columns(), index)
    assert pq.read_table(index).column("label")[0].as_py() in ("circle", "square", "triangle", "cross")


def test_a_damaged_image_is_a_bad_row_and_a_file_cut_short_later_bad_samples(shapes, tmp_path):
    from datasets import load_from_disk

    dataset = load_from_disk(str(save_shapes(str(shapes), tmp_path / "hf", splits=False)))
    broken = dataset.cast_column("image", dataset.features["image"].__class__(decode=False))
    broken = broken.map(lambda row, i: {"image": {"bytes": b"not an image" if i == 5 else row["image"]["bytes"],
                                                  "path": None}}, with_indices=True)
    broken.save_to_disk(str(tmp_path / "broken"))
    dm = _module(tmp_path, hf_dataset=str(tmp_path / "broken"))
    meta = dm.read()[0][0]
    assert meta.bad.counts == {"missing or non-positive width/height": 1}
    assert meta.bad.examples["missing or non-positive width/height"] == ["data-00000-of-00001.arrow#5"]
    # The file cut short after the index was made (a copy that did not finish): its last images are bad samples,
    # replaced by others of their bucket and counted.
    arrow = next((tmp_path / "broken").glob("*.arrow"))
    offsets = sorted(pq.read_table(tmp_path / "index.parquet").column("offset").to_pylist())
    with open(arrow, "r+b") as f:
        f.truncate(offsets[-3])  # the last three images
    batches = list(dm.train_dataloader())
    assert sum(int(b["bad_samples"]) for b in batches) > 0, "the cut images were not counted"
    assert all(b["image"].shape[0] == 4 for b in batches)
    with open(arrow, "r+b") as f:  # most of it gone: the data, not a sample, is broken (exit 3)
        f.truncate(offsets[len(offsets) // 3])
    with pytest.raises(DataError, match="samples in a row of bucket .* could not be read, under .*broken: "
                                        r"data-00000-of-00001.arrow#\d+.* ends before this sample's bytes"):
        list(dm.train_dataloader())


def test_parquet_files_with_an_image_column_load_through_datasets_and_give_the_same_batches(shapes, tmp_path,
                                                                                             monkeypatch):
    """The hub's layout (data/train-*.parquet, data/validation-*.parquet): load_dataset makes Arrow files of them
    in the Hugging Face cache once, and lit-dist indexes those, named by their absolute paths."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    saved = datasets.load_from_disk(str(save_shapes(str(shapes), tmp_path / "hf")))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for name, split in saved.items():
        split.to_parquet(str(tmp_path / "hub" / "data" / f"{name}-00000-of-00001.parquet"))
    from_folder = _module(tmp_path, hf_dataset=str(tmp_path / "hf"), index_cache=str(tmp_path / "a.parquet"))
    from_parquet = _module(tmp_path, hf_dataset=str(tmp_path / "hub"), index_cache=str(tmp_path / "b.parquet"))
    for split in ("train", "val"):
        assert len(from_parquet._splits[split]) == len(from_folder._splits[split]) > 0
    for a, b in zip(from_folder.train_dataloader(), from_parquet.train_dataloader(), strict=True):
        assert torch.equal(a["image"], b["image"]) and a["caption"] == b["caption"]
    name = pq.read_table(tmp_path / "b.parquet").column("filename")[0].as_py()
    assert name.startswith(str(tmp_path / "hf-cache").lstrip("/")) and name.endswith(".arrow#0"), name
    # A hub id from a machine without the network (offline: no retries for half a minute first).
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"data.hf_dataset = 'lit-dist/no-such-dataset': datasets.load_dataset cannot "
                                        "open it"):
        _module(tmp_path, hf_dataset="lit-dist/no-such-dataset", index_cache=str(tmp_path / "c.parquet"))
