"""A preemption signal becomes an agreed checkpoint at the next step boundary and exit code 11; the
run started again resumes from it and ends with the weights of an uninterrupted run."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.callbacks.preemption import Preemption
from lit_dist.ckpt.store import CheckpointStore, checkpoint_name
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import ConfigError, Preempted
from lit_dist.model.module import LitModel
from lit_dist.runtime.control import RunControl
from tests.conftest import REPO, quickstart_args
from tests.helpers.nets import DropoutCNN
from tests.helpers.recorder import SignalAtStep


def run(root, demo_data, max_steps, signal_at=None, resume=False):
    seed_everything(0)
    model = LitModel(DropoutCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, val_fraction=0.1)
    checkpointing = Checkpointing(dirpath=str(root / "ckpt"), every_n_epochs=None)
    callbacks = ([SignalAtStep(signal_at)] if signal_at else []) + [RunControl(), Preemption(), checkpointing]
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root)
    trainer.fit(model, dm, ckpt_path=checkpointing.resolve_ckpt_path(trainer, "auto") if resume else None)
    return model


def test_sigusr1_saves_at_the_next_step_and_the_resumed_run_is_the_same_run(tmp_path, demo_data):
    straight = run(tmp_path / "a", demo_data, max_steps=30)
    with pytest.raises(Preempted, match="preempted at step 11"):
        run(tmp_path / "b", demo_data, max_steps=30, signal_at=11)
    store = CheckpointStore(str(tmp_path / "b" / "ckpt"))
    assert store.names() == [checkpoint_name(11)], "saved at the step the signal came in, nothing lost"
    assert store.manifest(checkpoint_name(11))["reason"] == "preemption"
    assert signal.getsignal(signal.SIGUSR1) is not Preemption._handler, "handlers are given back"
    resumed = run(tmp_path / "b", demo_data, max_steps=30, resume=True)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} differs after the preemption"


def test_the_preemption_reaches_the_webhooks_as_run_preempted_not_run_failed(tmp_path, demo_data, monkeypatch):
    from lit_dist.callbacks.webhooks import WebhookNotifier, WebhookSink
    from tests.helpers.http_server import Recorder

    server = Recorder()
    monkeypatch.setenv("HOOK_URL", server.url("/hook"))
    try:
        seed_everything(0)
        model = LitModel(DropoutCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0)
        callbacks = [SignalAtStep(3), WebhookNotifier([WebhookSink(kind="raw", url_env="HOOK_URL")]), RunControl(), Preemption(),
                     Checkpointing(dirpath=str(tmp_path / "ckpt"), every_n_epochs=None)]
        trainer = Trainer(max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path)
        with pytest.raises(Preempted):
            trainer.fit(model, dm)
        events = {e["type"]: e for e in server.bodies("/hook")}
    finally:
        server.shutdown()
    assert "run.failed" not in events
    preempted = events["run.preempted"]
    assert preempted["data"]["step"] == 3 and preempted["data"]["signal"] == "SIGUSR1"
    assert preempted["data"]["checkpoint"].endswith(checkpoint_name(3))
    assert events["checkpoint.saved"]["data"]["reason"] == "preemption"


def test_unknown_signal_names_are_a_config_error():
    with pytest.raises(ConfigError, match="preemption.signals: 'SIGNOPE'"):
        Preemption(signals=["SIGNOPE"])


@pytest.mark.process
def test_sigterm_outside_slurm_saves_and_exits_11(tmp_path, demo_data):
    # What Kubernetes does before it kills a pod: SIGTERM, then a grace period.
    cmd = [sys.executable, "-m", "lit_dist", "fit",
           *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, trainer__max_epochs=200, run__run_id="k8s",
                            trainer__enable_progress_bar=False)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    folder = tmp_path / "quickstart" / "k8s" / "checkpoints"
    deadline = time.monotonic() + 120
    while not list(folder.glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    exited = time.monotonic() - sent
    assert proc.returncode == 11, output[-3000:]
    assert "lit-dist: preempted (SIGTERM) at step" in output and "not requeued" in output
    # The behaviour under test: saved and gone within Kubernetes' default grace period (30 s, then SIGKILL).
    assert exited < 20, f"took {exited:.1f} s from SIGTERM to exit"
    newest = CheckpointStore(str(folder)).find_valid()[0]
    manifest = json.loads((folder / newest / "COMPLETE.json").read_text())
    assert manifest["reason"] == "preemption"
    assert not (tmp_path / "quickstart" / "k8s" / "model.pt").exists(), "a preempted run exports no final model"
