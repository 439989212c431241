"""The run control on two processes: one exchange per window in steady state, and stops on every rank at
the same step, within sync_every_n_steps + 1 steps of their cause."""

import json

import pytest

from lit_dist.ckpt.store import CheckpointStore, checkpoint_name
from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args

pytestmark = pytest.mark.distributed


def fit(tmp_path, demo_data, *extra, timeout=300, env=None):
    return lit_dist("fit", *quickstart_args(tmp_path, demo_data, data__num_workers=0, trainer__devices=2,
                                            trainer__strategy="ddp", run__run_id="r", trainer__enable_progress_bar=False),
                    *extra, timeout=timeout, env=env)


def rank_json(tmp_path, name):
    return [json.loads((tmp_path / "quickstart" / "r" / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]


def test_lit_dist_issues_one_collective_per_window_in_steady_state(tmp_path, demo_data):
    # Every lit-dist component that takes part in the run control is on: preemption, checkpointing with a
    # timer, the GPU circuit breaker (on the NVML test double), webhooks, the bad-sample count.
    state = tmp_path / "nvml.json"
    state.write_text('{"0": {}}')
    out = fit(tmp_path, demo_data, "--data.batch_size_per_device", "4", "--trainer.max_steps", "300",
              "--control.sync_every_n_steps", "10", "--checkpoint.every_n_minutes", "30",
              "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
              "--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml", "--trainer.callbacks.device_index", "0",
              "--trainer.callbacks.poll_interval_s", "0.05",
              "--trainer.callbacks+=tests.helpers.recorder.CollectiveCounter", env={"FAKE_NVML_STATE": str(state)})
    assert out.returncode == 0, out.stderr[-3000:]
    for rows in rank_json(tmp_path, "collectives"):
        clean = [(step, count) for step, count, is_clean in rows if is_clean]
        assert len(clean) > 200, "most steps are steady-state steps"
        # One asynchronous all-gather per 10 optimizer steps, always at the same step of the window (the
        # counter sees it in the next step's interval: it runs before the run control), none on other steps.
        assert max(count for _, count in clean) == 1
        (phase,) = {step % 10 for step, count in clean if count}
        windows = sum(1 for step, _ in clean if step % 10 == phase)
        total = sum(count for _, count in clean)
        assert total == windows > 20, f"{total} collectives from lit-dist in {len(clean)} steady-state steps"


def test_a_signal_on_one_rank_stops_both_at_the_same_step_within_the_window(tmp_path, demo_data):
    out = fit(tmp_path, demo_data, "--data.batch_size_per_device", "8", "--trainer.max_epochs", "20",
              "--control.sync_every_n_steps", "5", "--checkpoint.every_n_epochs", "null",
              "--trainer.callbacks+=tests.helpers.recorder.SignalRankAtStep", "--trainer.callbacks.step", "7",
              "--trainer.callbacks+=tests.helpers.recorder.StopStep")
    assert out.returncode == ExitCode.PREEMPTED, out.stderr[-3000:]
    stops = rank_json(tmp_path, "stop")
    assert stops[0] == stops[1], f"both ranks stop at the same step: {stops}"
    assert stops[0]["error"] == "Preempted"
    # Signal after step 7; facts of step 10 travel then, and are read at step 11: 7 < 11 <= 7 + 5 + 1.
    assert 7 < stops[0]["step"] <= 7 + 5 + 1
    store = CheckpointStore(str(tmp_path / "quickstart" / "r" / "checkpoints"))
    assert store.complete() == [checkpoint_name(stops[0]["step"])]
    assert store.manifest(checkpoint_name(stops[0]["step"]))["reason"] == "preemption"
