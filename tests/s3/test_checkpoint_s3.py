"""Checkpoints on the local S3 server: saved as objects with the marker last, resumed, damaged ones
skipped, interrupted uploads ignored and cleaned, and SIGKILLs during uploads."""

import json
import subprocess
import sys

import pytest

from lit_dist.ckpt.store import MARKER, STATE, CheckpointStore, checkpoint_name
from tests.conftest import CONFIGS, REPO, lit_dist

pytestmark = pytest.mark.s3


def args(s3, tmp_path, demo_data, *extra):
    return ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
            "--data.batch_size_per_device", "8", "--run.root_dir", str(tmp_path), "--run.run_id", "s3run",
            "--trainer.enable_progress_bar", "false", "--checkpoint.dirpath", f"s3://{s3.bucket}/ckpt/{{run_id}}",
            "--checkpoint.storage_options", json.dumps({"client_kwargs": {"endpoint_url": s3.endpoint}}), *extra]


def test_checkpoints_go_to_s3_and_resume_skips_damaged_and_unfinished_ones(s3, tmp_path, demo_data):
    first = lit_dist(*args(s3, tmp_path, demo_data, "--trainer.max_epochs", "2"))
    assert first.returncode == 0, first.stderr[-3000:]
    store = CheckpointStore(f"s3://{s3.bucket}/ckpt/s3run", {"client_kwargs": {"endpoint_url": s3.endpoint}})
    older, newest = sorted(store.complete())
    assert store.problem(newest) is None and store.problem(older) is None
    assert not (tmp_path / "quickstart" / "s3run" / "checkpoints").exists(), "nothing is written to local disk"

    # The newest is damaged (same size, one byte flipped), and a later save was cut off before its marker.
    data = bytearray(s3.cat(store.path(newest, STATE)))
    data[len(data) // 2] ^= 0xFF
    s3.pipe(store.path(newest, STATE), bytes(data))
    unfinished = checkpoint_name(10_000)
    s3.pipe(store.path(unfinished, STATE), b"half an upload")

    second = lit_dist(*args(s3, tmp_path, demo_data, "--trainer.max_epochs", "3"))
    assert second.returncode == 0, second.stderr[-3000:]
    output = second.stdout + second.stderr
    assert f"{unfinished} is unusable: no {MARKER}" in output
    assert f"{newest} is unusable: {STATE} does not match its sha256" in output
    assert f"resuming from s3://{s3.bucket}/ckpt/s3run/{older}" in output
    assert unfinished not in store.names(), "an interrupted upload is removed when the next run starts"
    latest = store.find_valid()[0]
    assert latest > newest and store.manifest(latest)["epoch"] == 2


def test_killed_uploads_never_leave_a_checkpoint_that_passes_for_complete(s3, tmp_path, demo_data):
    options = json.dumps({"client_kwargs": {"endpoint_url": s3.endpoint}})
    url = f"s3://{s3.bucket}/kill"
    out = subprocess.run([sys.executable, "-m", "tests.helpers.kill_driver", str(tmp_path), str(demo_data), "8", "1",
                          url, options], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["kills"] == 8 and summary["problems"] == [], summary
    assert summary["checkpoints_seen"] >= 1, "no checkpoint was completed between kills"


def test_stopped_and_resumed_through_s3_ends_bitwise_equal_to_an_uninterrupted_run(s3, tmp_path, demo_data):
    import torch

    from tests.helpers.training import run, steps_per_epoch

    url, options = f"s3://{s3.bucket}/bitwise", {"client_kwargs": {"endpoint_url": s3.endpoint}}
    per_epoch = steps_per_epoch(demo_data)
    stop, end = per_epoch // 2, per_epoch + 3
    straight, _, _ = run(tmp_path / "a", demo_data, max_steps=end)
    run(tmp_path / "b", demo_data, max_steps=end, stop=stop, dirpath=url, storage_options=options)
    resumed, _, again = run(tmp_path / "b", demo_data, max_steps=end, resume=True, dirpath=url, storage_options=options)
    assert again.resumed_from == checkpoint_name(stop) and again.last_path.startswith(url)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} differs after a resume from S3"
