import shutil

import pytest
import torch

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.data.sources import DatasetSource
from lit_dist.errors import ConfigError
from tests.conftest import lit_dist, quickstart_args


@pytest.fixture
def two_tables(demo_data, tmp_path):
    first = tmp_path / "a"
    shutil.copytree(demo_data.parent, first)
    return demo_data, first / "metadata.parquet"


def test_two_datasets_mix_by_weight_and_keep_their_roots(two_tables):
    a, b = two_tables
    dm = BucketDataModule(datasets=[DatasetSource(metadata=str(a), weight=3), DatasetSource(metadata=str(b), weight=1)],
                          resolution=32, batch_size_per_device=4, num_workers=0)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    per_dataset = torch.bincount(torch.stack([batch["dataset"][0] for batch in batches]), minlength=2)
    assert abs(per_dataset[0].item() / len(batches) - 0.75) < 0.02
    assert all(len(set(batch["dataset"].tolist())) == 1 for batch in batches), "a batch mixes datasets"
    val = list(dm.val_dataloader())
    assert sum(int(batch["weight"].sum()) for batch in val) == 2 * len(dm._splits["val"].parts[0])


def test_datasets_and_metadata_together_are_refused(demo_data):
    with pytest.raises(ConfigError, match="data.datasets is set together with data.metadata"):
        BucketDataModule(metadata=str(demo_data), datasets=[DatasetSource(metadata=str(demo_data))])
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].weight = 0"):
        BucketDataModule(datasets=[DatasetSource(metadata=str(demo_data), weight=0)])


@pytest.mark.process
def test_plan_lists_each_dataset_from_yaml(two_tables, tmp_path):
    a, b = two_tables
    config = tmp_path / "mix.yaml"
    config.write_text(f"data:\n  metadata: null\n  create_demo_if_missing: false\n  batch_size_per_device: 4\n"
                      f"  datasets:\n    - metadata: {a}\n      weight: 0.7\n    - metadata: {b}\n      weight: 0.3\n")
    out = lit_dist("plan", *quickstart_args(None, None, config))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dataset 0" in out.stdout and "dataset 1" in out.stdout and "weight 0.3" in out.stdout
