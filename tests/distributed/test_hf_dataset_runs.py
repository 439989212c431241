"""Runs on the container sources: the quickstart learns from a Hugging Face dataset folder as from files, and two
DDP processes reading tar shards, one SIGKILLed mid-epoch, resume to exactly the weights of an uninterrupted
run."""

import pytest
import torch

from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.quickstart import check_quickstart_output

pytest.importorskip("datasets")

from tests.helpers.hf_datasets import save_shapes  # noqa: E402

pytestmark = pytest.mark.distributed

STOP, END = 7, 30  # 400 images, global batch 16: ~20 steps per epoch, so 7 is mid-epoch 0 and 30 in epoch 1


def _args(tmp_path, **source) -> list[str]:
    return ["fit", *quickstart_args(tmp_path, None, data__metadata=None, data__create_demo_if_missing=False,
                                    data__index_cache=tmp_path / "index.parquet", **source)]


@pytest.mark.slow
def test_the_quickstart_learns_from_a_hugging_face_dataset(tmp_path):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    table = tmp_path / "shapes" / "metadata.parquet"
    create_shapes_dataset(str(table), num_images=3000, seed=0)  # the quickstart's own data, as a dataset folder
    folder = save_shapes(str(table), tmp_path / "hf", rows_per_file=1000)
    out = lit_dist(*_args(tmp_path, data__hf_dataset=folder, trainer__enable_progress_bar=False), cwd=tmp_path,
                   timeout=300)
    check_quickstart_output(out, tmp_path)


@pytest.mark.slow
def test_ddp_killed_mid_epoch_on_tar_shards_resumes_bitwise(tmp_path, demo_data):
    from tests.helpers import tar_shards

    tar_shards.save_shapes(str(demo_data), tmp_path / "tars", per_shard=100)
    common = _args(tmp_path, data__webdataset=tmp_path / "tars" / "{00000..00003}.tar",
                   model__net__class_path="tests.helpers.nets.DropoutCNN", trainer__devices=2,
                 trainer__strategy="ddp", data__batch_size_per_device=8, data__num_workers=1, trainer__max_steps=END,
                 trainer__enable_progress_bar=False, checkpoint__every_n_epochs=None, checkpoint__every_n_steps=STOP)
    straight = lit_dist(*common, "--run.run_id", "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = lit_dist(*common, "--run.run_id", "resumed", "--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep",
                      "--trainer.callbacks.step", str(STOP + 1))
    assert killed.returncode == ExitCode.PROCESS_DIED, killed.stderr[-3000:]
    resumed = lit_dist(*common, "--run.run_id", "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    folder = tmp_path / "quickstart" / "resumed" / "checkpoints" / f"step-{STOP:09d}"
    assert f"resuming from {folder}" in resumed.stdout + resumed.stderr
    a = torch.load(tmp_path / "quickstart" / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "quickstart" / "resumed" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after the resume"
