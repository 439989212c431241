"""FSDP2's sharded checkpoints on the local S3 server: every rank uploads its own shard file (staged in its
$TMPDIR, hashed on the way), written on a background thread; the checkpoint is complete with every file's sha256,
nothing is left in $TMPDIR or on local disk, and a run on another number of processes resumes from the store
(read by byte ranges, resharded) with the weights as saved."""

import hashlib
import json

import pytest
import torch

from lit_dist.ckpt.store import STATE, CheckpointStore, checkpoint_name
from tests.conftest import CONFIGS, lit_dist, quickstart_args
from tests.helpers.processes import left_after

pytestmark = [pytest.mark.s3, pytest.mark.distributed]

RECORD = "tests.helpers.recorder"
STOP = 7


def test_fsdp2_saves_its_shards_to_s3_in_the_background_and_resumes_from_there_on_one_process(s3, tmp_path, demo_data):
    options = {"client_kwargs": {"endpoint_url": s3.endpoint}}
    url = f"s3://{s3.bucket}/ckpt/{{run_id}}"
    staging = tmp_path / "tmpdir"
    staging.mkdir()

    def fit(devices: int, *extra: str):
        args = quickstart_args(tmp_path / "runs", demo_data, CONFIGS / "fsdp2.yaml", run__run_id="sharded",
                               trainer__devices=devices, trainer__max_steps=12, data__batch_size_per_device=8,
                               data__num_workers=0, trainer__limit_val_batches=0, trainer__num_sanity_val_steps=0,
                               trainer__enable_progress_bar=False, checkpoint__every_n_epochs=None,
                               checkpoint__every_n_steps=3, checkpoint__async_save=True, checkpoint__dirpath=url,
                               checkpoint__storage_options=json.dumps(options))
        out = lit_dist("fit", *args, *extra, env={"TMPDIR": str(staging)}, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        assert not left_after(out.pid, 10.0)
        return out

    fit(2, f"--trainer.callbacks+={RECORD}.StopAtStep", "--trainer.callbacks.step", str(STOP))
    store = CheckpointStore(f"s3://{s3.bucket}/ckpt/sharded", options)
    assert sorted(store.complete()) == [checkpoint_name(3), checkpoint_name(6), checkpoint_name(STOP)]
    name = checkpoint_name(STOP)
    files = store.manifest(name)["files"]
    assert sorted(files) == sorted(f"{STATE}/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"))
    for rel, entry in files.items():  # hashed while written, as the objects on the store are
        data = s3.cat(store.path(name, rel))
        assert (entry["size"], entry["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), rel
    assert store.problem(name) is None
    assert list(staging.iterdir()) == [], "a staged shard file was left in $TMPDIR"
    assert not (tmp_path / "runs" / "quickstart" / "sharded" / "checkpoints").exists(), "checkpoints went to local disk"

    # The weights as saved, read by lit-dist export from a copy of the checkpoint on local disk.
    s3.get(store.path(name), str(tmp_path / "copy"), recursive=True)
    out = lit_dist("export", str(tmp_path / "copy"), "--output", str(tmp_path / "saved.pt"))
    assert out.returncode == 0, out.stderr[-2000:]
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)

    out = fit(1, f"--trainer.callbacks+={RECORD}.WeightsAtStart")
    assert f"resuming from s3://{s3.bucket}/ckpt/sharded/{name}" in out.stdout + out.stderr, out.stderr[-3000:]
    resumed = torch.load(tmp_path / "runs" / "quickstart" / "sharded" / "weights-at-start.pt", weights_only=True)
    assert resumed.keys() == saved.keys()
    for key in saved:
        assert torch.equal(resumed[key], saved[key]), f"{key} differs after resharding 2 -> 1 from S3"
    assert store.find_valid()[0] == checkpoint_name(12), "the resumed run saves to the store too"
    assert list(staging.iterdir()) == []
