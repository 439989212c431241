"""On a GPU: lit-dist's callbacks and run control add no host-device synchronisation to a training step."""

import json

from tests.conftest import lit_dist, quickstart_args


def test_no_sync_from_lit_dist_in_steady_state_steps(tmp_path, demo_data):
    # Every per-step participant on: run control, preemption, checkpointing's timer, the circuit breaker on
    # real NVML, the bad-sample count. Saves and the export (which must copy to the host) are off.
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, trainer__devices=1,
                                           trainer__max_steps=60, trainer__limit_val_batches=0,
                                           checkpoint__every_n_epochs=None, checkpoint__every_n_minutes=30,
                                           checkpoint__save_last=False, export__filename=None, run__run_id="sync",
                                           trainer__enable_progress_bar=False),
                   "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
                   "--trainer.callbacks.poll_interval_s", "0.2",
                   "--trainer.callbacks+=tests.helpers.recorder.SyncWatch", "--trainer.callbacks.after", "10",
                   timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    syncs = json.loads((tmp_path / "quickstart" / "sync" / "syncs-rank0.json").read_text())
    assert syncs == [], f"host-device synchronisations from lit-dist during steps: {syncs[:10]}"
