"""Two real DDP processes; only rank 1's (test double) GPU faults. Both stop together with exit code 10."""

import json
import time

import pytest

from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.http_server import Recorder

pytestmark = [pytest.mark.distributed, pytest.mark.serial]  # polls on a clock


def test_a_fault_on_rank_1_stops_both_ranks_and_rank_1_reports_it(tmp_path, demo_data):
    server = Recorder()
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"0": {}, "1": {"ecc_after_polls": 3, "ecc": 2}}))
    started = time.monotonic()
    try:
        out = lit_dist(
            "fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, data__num_workers=0,
                                    trainer__devices=2, trainer__strategy="ddp", trainer__max_epochs=1000,
                                    trainer__enable_progress_bar=False),
            "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
            "--trainer.callbacks.poll_interval_s", "0.2", "--control.sync_every_n_steps", "5",
            "--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml", "--trainer.callbacks.device_index", "0",
            "--trainer.callbacks+=lit_dist.callbacks.webhooks.WebhookNotifier",
            "--trainer.callbacks.sinks", '[{"kind": "raw", "url_env": "HOOK_URL"}]', "--run.run_id", "r",
            "--trainer.callbacks+=tests.helpers.recorder.StopStep",
            env={"FAKE_NVML_STATE": str(state), "HOOK_URL": server.url("/hook")}, timeout=180)
        elapsed = time.monotonic() - started
        faults = [e for e in server.bodies("/hook") if e["type"] == "gpu.fault"]
    finally:
        server.shutdown()
    assert out.returncode == ExitCode.GPU_FAULT, out.stderr[-3000:]
    # The behaviour under test: only the breaker ends this 1000-epoch run, a few steps in; 120 s is start-up with
    # room for a loaded machine.
    assert elapsed < 120
    assert len(faults) == 1 and faults[0]["rank"] == 1 and faults[0]["severity"] == "critical"
    assert faults[0]["data"]["uuid"] == "GPU-fake-1" and "ECC" in faults[0]["data"]["reason"]
    assert "GPU fault on another rank's GPU" in out.stderr or "GPU fault on this rank's GPU" in out.stderr
    stops = [json.loads((tmp_path / "quickstart" / "r" / f"stop-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert stops[0] == stops[1] and stops[0]["error"] == "GPUFault", f"both ranks stop at the same step: {stops}"


def test_without_nvml_each_rank_warns_that_its_gpu_is_not_watched_and_training_goes_on(tmp_path, demo_data):
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"0": {"fail_init": True}, "1": {"fail_init": True}}))
    out = lit_dist(
        "fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, data__num_workers=0,
                                trainer__devices=2, trainer__strategy="ddp", trainer__max_steps=3,
                                trainer__max_epochs=None, trainer__limit_val_batches=0,
                                trainer__enable_progress_bar=False),
        "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
        "--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml", "--trainer.callbacks.device_index", "0",
        env={"FAKE_NVML_STATE": str(state)}, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "GPUCircuitBreaker disabled: NVML unavailable" in line]
    assert sorted(line.split(" (")[0] for line in lines) == ["lit-dist: rank 0", "lit-dist: rank 1"], lines
    assert all("this rank's GPU is not watched" in line for line in lines), lines
