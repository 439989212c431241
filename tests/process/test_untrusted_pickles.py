"""Checkpoints are pickles: lit-dist unpickles only the types its own checkpoints hold, unless told to trust a file.

A planted object's ``__reduce__`` writes a marker file when the checkpoint is unpickled, as a malicious
checkpoint would do anything else: refused, no marker; trusted explicitly, it loads.
"""

import hashlib
import json
import pickle

import pytest
import torch

from lit_dist.ckpt.store import MARKER, STATE
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.planted import Planted

pytestmark = pytest.mark.process


def fit(tmp_path, demo_data, run_id="run", *extra):
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, run__run_id=run_id, trainer__max_steps=3,
                                           trainer__limit_val_batches=0, data__num_workers=0,
                                           data__batch_size_per_device=8), *extra)
    return out, tmp_path / "quickstart" / run_id


def test_export_refuses_a_checkpoint_that_would_run_code_and_loads_it_when_trusted(tmp_path):
    marker, checkpoint, output = tmp_path / "marker", tmp_path / "downloaded.ckpt", tmp_path / "model.pt"
    weights = {"net.fc.weight": torch.ones(2, 3)}
    torch.save({"state_dict": weights, "hyper_parameters": {"config": Planted(marker)}}, checkpoint)

    out = lit_dist("export", str(checkpoint), "--output", str(output))
    assert out.returncode == 3, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "builtins.exec" in lines[0] and "--trust_pickle true" in lines[0], out.stderr
    assert not marker.exists(), "the planted object ran"
    assert not output.exists()

    out = lit_dist("export", str(checkpoint), "--output", str(output), "--trust_pickle", "true")
    assert out.returncode == 0, out.stderr
    assert marker.exists(), "trusted, the file is a full pickle"
    torch.testing.assert_close(torch.load(output, weights_only=True), {"fc.weight": torch.ones(2, 3)})


def planted_deepspeed_folder(folder, marker):
    pytest.importorskip("deepspeed")
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    torch.save({"module": {}, "buffer_names": [], "client": Planted(marker)},
               folder / "checkpoint" / "mp_rank_00_model_states.pt")


def planted_sharded_folder(folder, marker):
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Planted(marker)))


@pytest.mark.parametrize("make", [planted_deepspeed_folder, planted_sharded_folder], ids=["deepspeed", "sharded"])
def test_export_refuses_checkpoint_folders_whose_pickles_would_run_code(tmp_path, make):
    # DeepSpeed's converter and torch.distributed.checkpoint's reader unpickle these files in full.
    marker, folder = tmp_path / "marker", tmp_path / "state.ckpt"
    make(folder, marker)
    out = lit_dist("export", str(folder), "--output", str(tmp_path / "model.pt"))
    assert out.returncode == 3, out.stderr
    assert "builtins.exec" in out.stderr and "--trust_pickle true" in out.stderr, out.stderr
    assert not marker.exists(), "the planted object ran"


def test_a_run_s_own_checkpoint_exports_and_resumes_without_trusting_it(tmp_path, demo_data):
    out, run = fit(tmp_path, demo_data)
    assert out.returncode == 0, out.stderr[-3000:]
    out = lit_dist("export", str(run / "checkpoints"), "--output", str(tmp_path / "exported.pt"))
    assert out.returncode == 0, out.stderr
    torch.testing.assert_close(torch.load(tmp_path / "exported.pt", weights_only=True),
                               torch.load(run / "model.pt", weights_only=True))
    out, _ = fit(tmp_path, demo_data, "run", "--trainer.max_steps", "5")
    assert out.returncode == 0 and "resuming from" in out.stdout + out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_resuming_from_a_checkpoint_that_would_run_code_needs_weights_only_false(tmp_path, demo_data):
    out, run = fit(tmp_path, demo_data)
    assert out.returncode == 0, out.stderr[-3000:]
    # The run's newest checkpoint, rewritten by someone else with a planted object, its manifest to match.
    marker = tmp_path / "marker"
    folder = sorted((run / "checkpoints").glob("step-*"))[-1]
    state = torch.load(folder / STATE, weights_only=True)
    state["planted"] = Planted(marker)
    torch.save(state, folder / STATE)
    manifest = json.loads((folder / MARKER).read_text())
    data = (folder / STATE).read_bytes()
    manifest["files"][STATE] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MARKER).write_text(json.dumps(manifest))

    out, _ = fit(tmp_path, demo_data, "run", "--trainer.max_steps", "5")
    assert out.returncode == 3, out.stderr[-3000:]
    assert "lit-dist: error:" in out.stderr and "builtins.exec" in out.stderr and "--weights_only false" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not marker.exists(), "the planted object ran"

    out, _ = fit(tmp_path, demo_data, "run", "--trainer.max_steps", "5", "--weights_only", "false")
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.exists(), "trusted, the file is a full pickle"

    # The same file sent by someone, given explicitly: Lightning reads its hyperparameters before anything
    # else, with a torch.load of its own that had no opt-in and made the refusal a traceback.
    marker.unlink()
    sent = tmp_path / "sent.ckpt"
    sent.write_bytes(data)
    out, _ = fit(tmp_path, demo_data, "other", "--ckpt_path", str(sent))
    assert out.returncode == 3, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"lit-dist: error: {sent} holds builtins.exec" in lines[0], out.stderr[-3000:]
    assert "--weights_only false" in lines[0] and not marker.exists()
    out, _ = fit(tmp_path, demo_data, "other", "--ckpt_path", str(sent), "--weights_only", "false",
                 "--trainer.max_steps", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.exists(), "trusted, the file is a full pickle"
