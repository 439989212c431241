"""FSDP2's sharded checkpoints on CPU processes, written on a background thread by every rank: complete with
every shard's sha256, and resumed on another number of processes (torch.distributed.checkpoint reshards)
with the weights as saved and the interrupted epoch's samples neither repeated nor skipped."""

import hashlib
import json
import re
import shutil
import socket

import pytest
import torch

from lit_dist.ckpt.store import MARKER, STATE, checkpoint_name, share_of
from tests.conftest import CONFIGS, lit_dist, quickstart_args
from tests.helpers.processes import left_after

pytestmark = pytest.mark.distributed

STOP = 7  # mid-epoch 0 (about 22 steps of 16 samples)
RECORD = "tests.helpers.recorder"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fit(tmp_path, demo_data, run_id: str, devices: int, max_steps: int, *extra: str, code: int = 0):
    args = quickstart_args(tmp_path, demo_data, CONFIGS / "fsdp2.yaml", run__run_id=run_id, trainer__devices=devices,
                           trainer__max_steps=max_steps, data__batch_size_per_device=8, data__num_workers=0,
                           trainer__limit_val_batches=0, trainer__num_sanity_val_steps=0,
                           trainer__enable_progress_bar=False, checkpoint__every_n_epochs=None,
                           checkpoint__every_n_steps=3, checkpoint__async_save=True)
    out = lit_dist("fit", *args, f"--trainer.callbacks+={RECORD}.RowRecorder", "--trainer.callbacks.tag", run_id,
                   *extra, timeout=300)
    assert out.returncode == code, out.stderr[-4000:]
    assert not left_after(out.pid, 10.0)
    return tmp_path / "quickstart" / run_id, out


@pytest.mark.slow
def test_an_async_sharded_save_resumes_on_three_processes_and_on_one(tmp_path, demo_data):
    two, _ = fit(tmp_path, demo_data, "two", 2, 100, f"--trainer.callbacks+={RECORD}.StopAtStep",
                 "--trainer.callbacks.step", str(STOP), f"--trainer.callbacks+={RECORD}.EpochSize")
    checkpoint = two / "checkpoints" / checkpoint_name(STOP)
    manifest = json.loads((checkpoint / MARKER).read_text())
    files = manifest["files"]
    assert sorted(files) == sorted(f"{STATE}/{name}" for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"))
    for name, entry in files.items():  # hashed while written, as the bytes on disk are
        assert (entry["size"], entry["sha256"]) == ((checkpoint / name).stat().st_size, sha256(checkpoint / name)), name
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == sorted(
        ["latest", checkpoint_name(3), checkpoint_name(6), checkpoint_name(STOP)]), "nothing partial is left"

    out = lit_dist("export", str(checkpoint), "--output", str(tmp_path / "saved.pt"))
    assert out.returncode == 0, out.stderr[-2000:]
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    epoch_size = json.loads((two / "epoch-size-rank0.json").read_text())
    before = [row for rank in (0, 1) for epoch, rows in json.loads((two / f"two-rank{rank}.json").read_text())
              for row in rows if epoch == 0]
    assert len(before) == 16 * STOP

    for devices in (3, 1):
        shutil.rmtree(tmp_path / "quickstart" / f"on{devices}", ignore_errors=True)
        run_dir, out = fit(tmp_path, demo_data, f"on{devices}", devices, 100, "--ckpt_path", str(checkpoint),
                           f"--trainer.callbacks+={RECORD}.WeightsAtStart", f"--trainer.callbacks+={RECORD}.StopAfterEpoch",
                           "--trainer.callbacks.epoch", "0")
        resumed = torch.load(run_dir / "weights-at-start.pt", weights_only=True)
        assert resumed.keys() == saved.keys()
        for key in saved:
            assert torch.equal(resumed[key], saved[key]), f"{key} differs after resharding 2 -> {devices}"
        after = [row for rank in range(devices) for epoch, rows in
                 json.loads((run_dir / f"on{devices}-rank{rank}.json").read_text()) for row in rows if epoch == 0]
        epoch0 = before + after
        assert len(epoch0) == len(set(epoch0)), f"2 -> {devices}: a sample trained twice in the interrupted epoch"
        waiting = re.search(r"\((\d+) that fill no whole batch wait for a later epoch\)", out.stderr)
        assert waiting, out.stderr[-3000:]
        assert len(epoch0) + int(waiting.group(1)) == epoch_size, f"2 -> {devices}: samples of the epoch skipped"
        assert (run_dir / "checkpoints" / "latest").exists(), "the resumed run saves too"


def test_each_rank_verifies_its_share_and_a_damaged_shard_is_marked_then_passed_over(tmp_path, demo_data):
    run_dir, _ = fit(tmp_path, demo_data, "share", 2, 6)  # saves at steps 3 and 6
    newest = run_dir / "checkpoints" / checkpoint_name(6)
    files = json.loads((newest / MARKER).read_text())["files"]
    theirs = share_of({rel: entry["size"] for rel, entry in files.items()}, 1, 2)
    assert theirs and set(theirs) != set(files), "rank 1 verifies some files, not all"
    damaged = newest / theirs[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only rank 1's sha256 sees it
    damaged.write_bytes(bytes(data))

    _, out = fit(tmp_path, demo_data, "share", 2, 9, code=1)
    line = (f"checkpoint {newest} is damaged: rank 1 on {socket.gethostname()} found {theirs[0]} does not match its "
            f"sha256 (corrupted); it is now marked damaged in its {MARKER}")
    assert line in out.stderr and "Traceback" not in out.stderr, out.stderr[-4000:]
    assert f"rank 1 on {socket.gethostname()} found {theirs[0]}" in json.loads((newest / MARKER).read_text())["damaged"]

    _, out = fit(tmp_path, demo_data, "share", 2, 9)
    assert f"{checkpoint_name(6)} is unusable: marked damaged: rank 1" in out.stderr, out.stderr[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / checkpoint_name(3)}" in out.stderr
