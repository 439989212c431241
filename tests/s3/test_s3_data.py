"""The same data through S3 as through the local disk: tables, discovery, batches, a training run."""

import json
import logging

import pytest
import torch

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.data.discovery import scan_folder
from lit_dist.data.metadata import read_metadata
from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.s3


@pytest.fixture
def remote_demo(s3, demo_data):
    s3.put(str(demo_data.parent), f"{s3.bucket}/shapes", recursive=True)
    return f"s3://{s3.bucket}/shapes", {"client_kwargs": {"endpoint_url": s3.endpoint}}


def test_table_and_batches_from_s3_equal_the_local_ones(remote_demo, demo_data):
    url, options = remote_demo
    local = read_metadata(str(demo_data))
    remote = read_metadata(f"{url}/metadata.parquet", options)
    assert remote.filenames.equals(local.filenames) and remote.sizes.equals(local.sizes)
    batches = []
    for metadata, opts in ((str(demo_data), None), (f"{url}/metadata.parquet", options)):
        dm = BucketDataModule(metadata, resolution=32, batch_size_per_device=4, num_workers=0, storage_options=opts)
        dm.setup("fit")
        batches.append(next(iter(dm.train_dataloader())))
    assert torch.equal(batches[0]["image"], batches[1]["image"]) and torch.equal(batches[0]["label"], batches[1]["label"])


def test_a_folder_of_tables_on_s3(s3, remote_demo, demo_data):
    url, options = remote_demo
    s3.put(str(demo_data), f"{s3.bucket}/meta/part-0.parquet")
    meta = read_metadata(f"s3://{s3.bucket}/meta/", options)
    assert len(meta) == 400


def test_discovery_on_s3_matches_the_local_scan(remote_demo, demo_data):
    url, options = remote_demo
    local = scan_folder(str(demo_data.parent), labels_from_folders=True, progress=False)
    remote = scan_folder(url, options, labels_from_folders=True, progress=False)
    for column in ("filename", "width", "height", "label"):
        assert remote.column(column).equals(local.column(column)), column


def test_fit_reads_its_data_from_s3(remote_demo, tmp_path):
    url, options = remote_demo
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", f"{url}/metadata.parquet",
                   "--data.create_demo_if_missing", "false", "--data.storage_options",
                   json.dumps(options),
                   "--data.batch_size_per_device", "8", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
                   "--run.root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
                   env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "val/acc" in out.stdout



@pytest.mark.parametrize("layout", ["hf_dataset", "webdataset"])
def test_a_container_source_on_s3_gives_the_local_index_and_batches(layout, s3, demo_data, tmp_path, caplog):
    """A save_to_disk folder or tar shards on the store: indexed from it (each file read once), the same table as
    the local copy's but for the files' times, and each image read as one ranged GET of its file."""
    import pyarrow.parquet as pq

    if layout == "hf_dataset":
        pytest.importorskip("datasets")
        from tests.helpers.hf_datasets import save_shapes

        save_shapes(str(demo_data), tmp_path / "data", rows_per_file=150)
        name = ""
    else:
        from tests.helpers.tar_shards import save_shapes

        save_shapes(str(demo_data), tmp_path / "data", per_shard=150)
        name = "/{00000..00002}.tar"
    s3.put(str(tmp_path / "data"), f"{s3.bucket}/data", recursive=True)
    options = {"client_kwargs": {"endpoint_url": s3.endpoint}}
    batches, indexes = [], []
    for i, (where, opts) in enumerate(((str(tmp_path / "data"), None), (f"s3://{s3.bucket}/data", options))):
        index = str(tmp_path / f"index-{i}.parquet")
        # Shards in blocks: a batch is a run of a shard's neighbours, read with one ranged GET.
        dm = BucketDataModule(**{layout: where + name}, index_cache=index, resolution=32, batch_size_per_device=4,
                              num_workers=0, storage_options=opts, node_index_dir=None,
                              shuffle_block=4 if layout == "webdataset" else 1)
        dm.prepare_data()
        dm.setup("fit")
        with caplog.at_level(logging.INFO):
            batches.append(list(dm.train_dataloader())[:5])
        indexes.append(pq.read_table(index).drop_columns(["mtime"]))
    assert indexes[0].equals(indexes[1]) and indexes[0].num_rows == 400
    # Read sample by sample from the store, a run is told of data.shuffle_block; in blocks it is not.
    hinted = [r for r in caplog.records if "data.shuffle_block: 4 reads a batch's neighbours" in r.getMessage()]
    assert len(hinted) == (1 if layout == "hf_dataset" else 0), [r.getMessage() for r in caplog.records]
    for local, remote in zip(*batches, strict=True):
        assert torch.equal(local["image"], remote["image"]) and local["caption"] == remote["caption"]
