"""data.webdataset: tar shards are indexed once and read as a table of files is: the same batches as the same
images in files, mixed with a table and a Hugging Face dataset, a missing shard a data error, cut shards and
members that are not images counted."""

import logging
import os
import tarfile

import pyarrow.parquet as pq
import pytest
import torch

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.data.sources import DatasetSource
from lit_dist.data.webdataset import common_root, expand, load_or_index
from lit_dist.errors import DataError
from tests.helpers.tar_shards import save_shapes

SETTINGS = dict(batch_size_per_device=4, resolution=32, num_workers=0, allow_oversubscription=True, cache=None,
                node_index_dir=None)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """The shapes without a split column: every row trains, in the tables and in the shards alike."""
    from lit_dist.data.demo.shapes import create_shapes_dataset

    table = tmp_path_factory.mktemp("shapes") / "metadata.parquet"
    create_shapes_dataset(str(table), num_images=96, seed=4)
    pq.write_table(pq.read_table(table).drop_columns(["split"]), table)
    return table


def test_brace_patterns_expand_as_webdataset_s_do():
    assert expand("s/{008..011}.tar") == ["s/008.tar", "s/009.tar", "s/010.tar", "s/011.tar"]
    assert expand("{a,b}/{0..1}.tar") == ["a/0.tar", "a/1.tar", "b/0.tar", "b/1.tar"]
    assert expand("s3://bucket/x.tar") == ["s3://bucket/x.tar"]
    assert common_root(["/d/a/0.tar", "/d/b/1.tar"]) == "/d" and common_root(["s3://b/s/0.tar"]) == "s3://b/s"


@pytest.mark.parametrize("shuffle_block", [1, 4])
def test_shards_give_the_batches_their_images_give_as_files(shapes, tmp_path, monkeypatch, shuffle_block):
    save_shapes(str(shapes), tmp_path / "tars", per_shard=30)
    files = BucketDataModule(metadata=str(shapes), val_fraction=0.0, shuffle_block=shuffle_block, **SETTINGS)
    files.setup("fit")
    tars = BucketDataModule(webdataset=str(tmp_path / "tars" / "{00000..00003}.tar"), val_fraction=0.0,
                            index_cache=str(tmp_path / "index.parquet"), shuffle_block=shuffle_block, **SETTINGS)
    tars.prepare_data()
    tars.setup("fit")
    reads = []
    pread = os.pread
    monkeypatch.setattr("lit_dist.reading.members.os.pread", lambda *a: reads.append(a) or pread(*a))
    ours, theirs = list(tars.train_dataloader()), list(files.train_dataloader())
    assert len(ours) == len(theirs) > 0
    if shuffle_block > 1:  # a batch of 4 neighbours is one read, two where it crosses into the next shard
        assert len(reads) <= 1.5 * len(ours), f"{len(reads)} reads for {len(ours)} batches of 4"
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
        assert a["caption"] == b["caption"]
    index = pq.read_table(tmp_path / "index.parquet").to_pylist()
    assert len(index) == 96 and index[31]["filename"] == "00001.tar#sample000031"
    made = os.stat(tmp_path / "index.parquet").st_mtime_ns
    load_or_index(str(tmp_path / "tars" / "{00000..00003}.tar"), str(tmp_path / "index.parquet"))
    assert os.stat(tmp_path / "index.parquet").st_mtime_ns == made, "indexed again though no shard changed"


def test_a_table_a_hugging_face_dataset_and_shards_mix_in_one_run(shapes, tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa

    from tests.helpers import hf_datasets

    # Integer labels in each (a shard's cls is one): the table's names as their sorted indices.
    rows = pq.read_table(shapes)
    names = sorted(set(rows.column("label").to_pylist()))
    table = tmp_path / "shapes" / "metadata.parquet"
    table.parent.mkdir()
    for name in os.listdir(shapes.parent):
        if os.path.isdir(shapes.parent / name):
            os.symlink(shapes.parent / name, table.parent / name)
    pq.write_table(rows.set_column(rows.schema.get_field_index("label"), "label",
                                   pa.array([names.index(v) for v in rows.column("label").to_pylist()])), table)
    save_shapes(str(table), tmp_path / "tars", per_shard=50)
    hf = hf_datasets.save_shapes(str(table), tmp_path / "hf", splits=False)
    dm = BucketDataModule(datasets=[
        DatasetSource(metadata=str(table), weight=1),
        DatasetSource(hf_dataset=str(hf), index_cache=str(tmp_path / "hf.parquet"), weight=1),
        DatasetSource(webdataset=[str(tmp_path / "tars" / "00000.tar"), str(tmp_path / "tars" / "00001.tar")],
                      index_cache=str(tmp_path / "wds.parquet"), weight=2),
    ], **SETTINGS)
    dm.prepare_data()
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    counts = torch.bincount(torch.stack([b["dataset"][0] for b in batches]), minlength=3)
    assert (counts > 0).all() and counts[2] > counts[0], counts
    assert len({tuple(b["image"].shape) for b in batches}) > 1, "one bucket only"


def test_a_missing_shard_is_a_data_error_before_training(shapes, tmp_path):
    save_shapes(str(shapes), tmp_path / "tars", per_shard=30)
    dm = BucketDataModule(webdataset=str(tmp_path / "tars" / "{00000..00005}.tar"),
                          index_cache=str(tmp_path / "index.parquet"), **SETTINGS)
    with pytest.raises(DataError, match=r"data.webdataset: 2 of 6 shards are not there \(e.g. .*00004.tar, "
                                        r".*00005.tar\); check the pattern"):
        dm.prepare_data()


@pytest.mark.parametrize("shuffle_block", [1, 4])
def test_cut_shards_and_members_that_are_not_images_are_counted(shapes, tmp_path, caplog, shuffle_block):
    paths = save_shapes(str(shapes), tmp_path / "tars", per_shard=48)
    with tarfile.open(paths[0], "a") as tar:  # a sample whose image is text
        info = tarfile.TarInfo("zzz.png")
        info.size = 12
        tar.addfile(info, __import__("io").BytesIO(b"not an image"))
    with open(paths[1], "r+b") as f:  # the second shard cut in the middle of a member
        f.truncate(os.path.getsize(paths[1]) // 2 + 100)
    pattern = str(tmp_path / "tars" / "{00000..00001}.tar")
    with caplog.at_level(logging.WARNING, logger="lit_dist.data.webdataset"):
        dm = BucketDataModule(webdataset=pattern, index_cache=str(tmp_path / "index.parquet"),
                              shuffle_block=shuffle_block, **SETTINGS)
        dm.prepare_data()
        dm.setup("fit")
    assert any("00001.tar is damaged after its first" in r.getMessage() for r in caplog.records), caplog.text
    meta = dm.read()[0][0]
    assert meta.bad.counts == {"missing or non-positive width/height": 1}
    assert meta.bad.examples["missing or non-positive width/height"] == ["00000.tar#zzz"]
    assert 48 + 10 < len(meta) < 96, "the cut shard's first samples are kept, the rest left out"
    offsets = sorted(meta.members[:, 0][meta.members[:, 0] < os.path.getsize(paths[0])])
    with open(paths[0], "r+b") as f:  # cut after the index was made: its last images are bad samples
        f.truncate(int(offsets[-4]))
    batches = list(dm.train_dataloader())
    assert sum(int(b["bad_samples"]) for b in batches) > 0 and all(b["image"].shape[0] == 4 for b in batches)


def test_a_pixel_cache_builds_from_shards_and_gives_their_batches(shapes, tmp_path):
    from lit_dist.cache.config import CacheConfig

    save_shapes(str(shapes), tmp_path / "tars", per_shard=40)
    source = {"webdataset": str(tmp_path / "tars" / "{00000..00002}.tar"), "index_cache": str(tmp_path / "i.parquet")}
    plain = BucketDataModule(val_fraction=0.0, **{**SETTINGS, **source})
    cached = BucketDataModule(val_fraction=0.0, **{**SETTINGS, **source,
                                                   "cache": CacheConfig(dir=str(tmp_path / "cache"), mode="build")})
    for dm in (plain, cached):
        dm.prepare_data()
        dm.setup("fit")
    assert cached._cache_views is not None, "no cache opened"
    for a, b in zip(plain.train_dataloader(), cached.train_dataloader(), strict=True):
        assert torch.equal(a["image"], b["image"])


def test_json_members_give_columns_and_the_caption_a_shard_without_txt_lacks(shapes, tmp_path):
    import json

    paths = save_shapes(str(shapes), tmp_path / "tars", per_shard=48, json=True)
    save_shapes(str(shapes), tmp_path / "bare", per_shard=48, json=True, txt=False)
    os.replace(tmp_path / "bare" / "00001.tar", paths[1])  # the second shard's captions are in its json only
    with tarfile.open(paths[0], "a") as tar:  # a field that is text here and a number in the other shard
        data = json.dumps({"similarity": "high", "caption": "ignored: this sample has a txt"}).encode()
        for name, body in (("zzz.png", open(shapes.parent / pq.read_table(shapes)["filename"][0].as_py(), "rb").read()),
                           ("zzz.txt", b"a txt caption"), ("zzz.cls", b"0"), ("zzz.json", data)):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, __import__("io").BytesIO(body))
    dm = BucketDataModule(webdataset=str(tmp_path / "tars" / "{00000..00001}.tar"), val_fraction=0.0,
                          index_cache=str(tmp_path / "index.parquet"), extra_columns=["caption", "url", "similarity"],
                          **SETTINGS)
    dm.prepare_data()
    dm.setup("fit")
    index = pq.read_table(tmp_path / "index.parquet")
    assert {"url", "similarity", "original_width", "status"} <= set(index.column_names)
    assert "exif" not in index.column_names and "key" in index.column_names  # null fields make no column
    rows = {r["filename"]: r for r in index.to_pylist()}
    table = pq.read_table(shapes).to_pylist()
    assert rows["00001.tar#sample000050"]["caption"] == table[50]["caption"], "the json's caption, no txt there"
    assert rows["00000.tar#zzz"]["caption"] == "a txt caption" and rows["00000.tar#zzz"]["similarity"] == "high"
    assert rows["00000.tar#sample000003"]["similarity"] == "0.35", "a number in one shard, text in another: text"
    batch = next(iter(dm.train_dataloader()))
    assert all(u.startswith("https://example.com/sample") or u is None for u in batch["url"]), batch["url"]
    assert len(batch["similarity"]) == 4 and all(c for c in batch["caption"])


@pytest.mark.process
def test_lit_dist_index_makes_the_index_a_run_then_uses_as_it_is(shapes, tmp_path):
    from tests.conftest import lit_dist

    save_shapes(str(shapes), tmp_path / "tars", per_shard=40)
    pattern, index = str(tmp_path / "tars" / "{00000..00002}.tar"), tmp_path / "index.parquet"
    out = lit_dist("index", "--webdataset", pattern, "--output", str(index))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"lit-dist index: 96 samples of the tar shards {pattern} -> {index}" in out.stdout, out.stdout
    made = os.stat(index).st_mtime_ns
    dm = BucketDataModule(webdataset=pattern, index_cache=str(index), **SETTINGS)
    dm.prepare_data()
    dm.setup("fit")
    assert os.stat(index).st_mtime_ns == made, "the run indexed the shards again"
    both = lit_dist("index", str(tmp_path), "--webdataset", pattern)
    assert both.returncode == 2 and "lit-dist index takes one dataset" in both.stderr, both.stderr[-2000:]
    assert "Traceback" not in both.stderr
