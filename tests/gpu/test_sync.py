"""On a GPU: lit-dist's callbacks and run control add no host-device synchronisation to a training step."""

import json

from tests.conftest import CONFIGS, lit_dist


def test_no_sync_from_lit_dist_in_steady_state_steps(tmp_path, demo_data):
    # Every per-step participant on: run control, preemption, checkpointing's timer, the circuit breaker on
    # real NVML, the bad-sample count. Saves and the export (which must copy to the host) are off.
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
                   "--data.batch_size_per_device", "8", "--trainer.devices", "1", "--trainer.max_steps", "60",
                   "--trainer.limit_val_batches", "0", "--checkpoint.every_n_epochs", "null",
                   "--checkpoint.every_n_minutes", "30", "--checkpoint.save_last", "false", "--export.filename", "null",
                   "--run.root_dir", str(tmp_path), "--run.run_id", "sync", "--trainer.enable_progress_bar", "false",
                   "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
                   "--trainer.callbacks.poll_interval_s", "0.2",
                   "--trainer.callbacks+=tests.helpers.recorder.SyncWatch", "--trainer.callbacks.after", "10",
                   timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    syncs = json.loads((tmp_path / "quickstart" / "sync" / "syncs-rank0.json").read_text())
    assert syncs == [], f"host-device synchronisations from lit-dist during steps: {syncs[:10]}"
