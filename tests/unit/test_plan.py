from types import SimpleNamespace

import pytest

from lit_dist.errors import ExitCode
from lit_dist.runtime.launch import world_size
from tests.conftest import lit_dist, quickstart_args


def plan(*args, demo_data):
    return lit_dist("plan", *quickstart_args(None, demo_data), *args)


@pytest.mark.process
def test_plan_prints_batches_lr_steps_and_buckets(demo_data):
    out = plan("--trainer.devices", "2", "--data.batch_size_per_device", "4", demo_data=demo_data)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world size          2 (2 devices x 1 nodes)" in out.stdout
    assert "global 8, effective 8" in out.stdout
    assert "0.003 -> 0.0015 (sqrt scaling against base batch 32)" in out.stdout
    assert "buckets (train)" in out.stdout and "no problems found" in out.stdout


@pytest.mark.process
def test_plan_fails_before_anything_starts_when_buckets_are_too_small(demo_data):
    out = plan("--trainer.devices", "8", "--trainer.num_nodes", "4", demo_data=demo_data)
    assert out.returncode == ExitCode.DATA_ERROR
    assert "fewer than one global batch of 1024" in out.stdout and "data.repeats >=" in out.stdout
    out = plan("--trainer.devices", "8", "--trainer.num_nodes", "4", "--data.allow_oversubscription", "true",
               demo_data=demo_data)
    assert out.returncode == 0, out.stdout
    assert "no problems found" in out.stdout


def test_world_size_follows_the_config_then_the_launcher_or_allocation():
    trainer = SimpleNamespace(devices=4, num_nodes=2, accelerator="auto")
    assert world_size(trainer, {}) == (8, 4, 2)
    auto = SimpleNamespace(devices="auto", num_nodes=1, accelerator="auto")
    # An salloc shell: the allocation, read as fit reads it inside the job step.
    allocation = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "interactive", "SLURM_NNODES": "3", "SLURM_NTASKS_PER_NODE": "8"}
    assert world_size(auto, allocation) == (24, 8, 3)
    step = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "6", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_TASKS_PER_NODE": "3(x2)"}
    assert world_size(auto, step) == (6, 3, 2)
    torchrun = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"}
    assert world_size(auto, torchrun) == (8, 4, 2)
    assert world_size(SimpleNamespace(devices=[0, 1], num_nodes=1, accelerator="gpu"), {}) == (2, 2, 1)


@pytest.mark.process
def test_the_demos_verdict_does_not_depend_on_whether_it_was_generated_yet(tmp_path):
    from lit_dist.data.demo.shapes import DEMO_METADATA, create_shapes_dataset

    # A fresh clone: 3,000 demo images cannot fill one global batch of 16,384.
    args = ("plan", *quickstart_args(trainer__num_nodes=64, trainer__devices=8))
    before = lit_dist(*args, cwd=tmp_path)
    assert not (tmp_path / "data").exists(), "plan must not generate the demo"
    create_shapes_dataset(str(tmp_path / DEMO_METADATA))
    after = lit_dist(*args, cwd=tmp_path)
    assert before.returncode == after.returncode == ExitCode.DATA_ERROR, before.stdout + after.stdout
    assert "fewer than one global batch of 16384" in before.stdout
    buckets = [line for line in before.stdout.splitlines() if " x " in line and "world size" not in line]
    assert buckets and buckets == [line for line in after.stdout.splitlines() if " x " in line and "world size" not in line]
