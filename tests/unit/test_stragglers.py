"""Straggler detection: its settings, the per-rank comparison over windows, and the timings of a real fit
(3 processes with one slow rank: tests/distributed/test_stragglers.py)."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer

from lit_dist.callbacks.stragglers import _FACTS, StragglerDetector
from lit_dist.errors import ConfigError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from lit_dist.runtime.control import Agreed, RunControl
from tests.helpers.recorder import SleepInStep

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": 1.0}, r"straggler.threshold = 1.0: the slowest rank is always at least the other ranks' median"),
    ({"threshold": 0.5}, r"straggler.threshold = 0.5"),
    ({"windows": 0}, r"straggler.windows = 0: must be at least 1"),
    ({"window_steps": 0}, r"straggler.window_steps = 0: must be at least 1"),
])
def test_thresholds_that_always_trip_and_empty_windows_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StragglerDetector(**kwargs)


class Events:
    def __init__(self):
        self.sent = []

    def send(self, event):
        self.sent.append(event)

    def flush(self, timeout_s=None):
        return True


def _exchanges(detector, per_step_by_window, steps_per_window=10, world=3):
    """Feed the detector the exchanges of several windows: ``per_step_by_window[w][rank]`` seconds of work per
    step (split evenly between data and forward), as the run control would agree them."""
    control, events = RunControl(), Events()
    control.subscribe(events)
    control._where = [{"host": f"node-{r}", "node": f"node-{r}", "gpu": None} for r in range(world)]
    detector.connect(control)
    trainer = SimpleNamespace(world_size=world, is_global_zero=True, logger=None)
    layout = {name: (i, "max") for i, name in enumerate(_FACTS)}
    totals = torch.zeros(world, len(_FACTS), dtype=torch.float64)
    step = 0
    detector._agreed(trainer, Agreed(step, layout, totals.clone()))
    for per_step in per_step_by_window:
        for rank, work in enumerate(per_step):
            totals[rank, 0] += work / 2 * steps_per_window
            totals[rank, 1] += work / 2 * steps_per_window
            totals[rank, -1] += steps_per_window
        step += steps_per_window
        detector._agreed(trainer, Agreed(step, layout, totals.clone()))
    return [e for e in events.sent if e.type == "run.straggler"]


def test_a_rank_slower_by_30_percent_for_k_windows_is_named_once_with_its_parts_against_the_median():
    detector = StragglerDetector(window_steps=10, threshold=1.2, windows=3)
    sent = _exchanges(detector, [[0.10, 0.10, 0.13]] * 6)
    assert len(sent) == 1, "once per episode, not every window"
    event = sent[0]
    assert event.severity == "warning" and event.data["rank"] == 2 and event.data["host"] == "node-2"
    assert event.data["slowest_over_median"] == pytest.approx(1.3)
    assert event.data["seconds_per_step"]["data"] == pytest.approx(0.065)
    assert event.data["median_seconds_per_step"]["forward"] == pytest.approx(0.05)
    assert "rank 2 (node-2) does 1.30x the other ranks' median work" in event.message
    assert detector.last["slowest_rank"] == 2


def test_with_two_ranks_the_slower_is_measured_against_the_other_not_against_their_mean():
    # Rank 1 does 1.5x rank 0's work: the median of both (their mean) would make that 1.2x and a 1.2 threshold
    # would barely name it; against the other rank it is what it costs, 1.5x.
    detector = StragglerDetector(window_steps=10, threshold=1.3, windows=2)
    sent = _exchanges(detector, [[0.10, 0.15]] * 3, world=2)
    assert detector.last["slowest_rank"] == 1
    assert detector.last["slowest_over_median"] == pytest.approx(1.5)
    assert len(sent) == 1 and sent[0].data["rank"] == 1, sent
    assert sent[0].data["slowest_over_median"] == pytest.approx(1.5)
    assert sent[0].data["median_seconds_per_step"]["data"] == pytest.approx(0.05), "rank 0's figures"
    assert "rank 1 (node-1) does 1.50x the other ranks' median work" in sent[0].message
    # Any threshold can be reached with 2 ranks now: 2.5x the other's work trips a threshold of 2.
    assert len(_exchanges(StragglerDetector(window_steps=10, threshold=2.0, windows=1), [[0.1, 0.25]], world=2)) == 1
    # Nearly equal ranks stay under the default threshold.
    assert not _exchanges(StragglerDetector(window_steps=10, windows=1), [[0.100, 0.103]] * 3, world=2)


def test_with_four_ranks_the_slowest_is_compared_with_the_median_of_the_other_three():
    detector = StragglerDetector(window_steps=10, threshold=1.2, windows=1)
    sent = _exchanges(detector, [[0.10, 0.12, 0.11, 0.16]], world=4)
    assert len(sent) == 1 and sent[0].data["rank"] == 3
    assert detector.last["slowest_over_median"] == pytest.approx(0.16 / 0.11), "not 0.16 / 0.115, the median of all 4"


def test_equal_ranks_a_short_slow_spell_or_a_changing_slowest_rank_name_nobody():
    assert not _exchanges(StragglerDetector(window_steps=10, windows=3), [[0.10, 0.101, 0.099]] * 6)
    # Slow for two windows, then recovered, then slow for two again: never three in a row.
    spell = [[0.1, 0.1, 0.14]] * 2 + [[0.1, 0.1, 0.1]] + [[0.1, 0.1, 0.14]] * 2
    assert not _exchanges(StragglerDetector(window_steps=10, windows=3), spell)
    # A different rank slow in each window: no single rank to blame.
    assert not _exchanges(StragglerDetector(window_steps=10, windows=3),
                          [[0.14, 0.1, 0.1], [0.1, 0.14, 0.1], [0.1, 0.1, 0.14]] * 2)


def test_windows_span_window_steps_and_a_recovered_rank_that_slows_again_is_named_again():
    detector = StragglerDetector(window_steps=20, threshold=1.2, windows=2)
    # Exchanges every 10 steps, windows of 20: four slow exchanges are two windows.
    sent = _exchanges(detector, [[0.1, 0.1, 0.13]] * 4 + [[0.1, 0.1, 0.1]] * 2 + [[0.1, 0.1, 0.13]] * 4)
    assert [e.data["step"] for e in sent] == [40, 100]


def test_one_process_fit_times_its_parts_with_one_gradient_hook_after_the_first_step(tmp_path):
    from lightning.pytorch import Callback

    detector = StragglerDetector()
    hooks = []

    class CountHooks(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            hooks.append(len(detector._hooks))

    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_steps=6, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      callbacks=[RunControl(), detector, SleepInStep(0.02), CountHooks()], default_root_dir=tmp_path)
    data = [{"image": torch.randn(3, 32, 32), "label": 0}] * 24
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    data_s, forward_s, backward_s, optimizer_s, steps = detector._totals
    assert steps == 6
    # The sleep in on_before_backward is the rank's own work: in the forward or the backward, by callback order.
    assert forward_s + backward_s >= 6 * 0.02, (forward_s, backward_s)
    assert forward_s > 0 and backward_s > 0 and optimizer_s > 0 and data_s > 0
    trainable = sum(p.requires_grad for p in model.parameters())
    assert hooks == [trainable] + [1] * 5, "a hook per parameter for the first step, then one"
    # Backward runs in reverse: the gradient accumulated last is the first layer's (its weight or bias).
    assert detector._sentinel in (0, 1), detector._sentinel
    assert not detector._hooks, "hooks are removed at the end of training"


@pytest.mark.parametrize("make", [
    lambda: StragglerDetector(exclude_node=True),
    lambda: __import__("lit_dist.callbacks.watchdog", fromlist=["HangWatchdog"]).HangWatchdog(exclude_node=True),
    lambda: __import__("lit_dist.callbacks.circuit_breaker", fromlist=["GPUCircuitBreaker"]).GPUCircuitBreaker(
        exclude_node=True),
], ids=["straggler", "watchdog", "circuit_breaker"])
def test_excluding_a_node_outside_slurm_is_a_config_error(make, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"exclude_node = true: excluding a node needs a Slurm job") as raised:
        make()
    assert raised.value.exit_code == 2


def test_with_exclude_node_every_rank_asks_to_save_and_stop_with_exit_13_naming_the_node(monkeypatch):
    from lit_dist.errors import ExitCode

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    detector = StragglerDetector(window_steps=10, threshold=1.2, windows=2, exclude_node=True)
    sent = _exchanges(detector, [[0.10, 0.10, 0.13]] * 3)
    assert len(sent) == 1 and sent[0].data["node"] == "node-2" and sent[0].data["exclude_node"] is True
    assert "stopping to requeue without node node-2" in sent[0].message
    stops = detector._control._stops
    assert len(stops) == 1 and stops[0].save == "straggler"
    error = stops[0].make_error("ckpt/step-000000020")
    assert error.exit_code == ExitCode.STRAGGLER == 13
    assert "rank 2 on node node-2 did 1.30x the other ranks' median" in str(error) and "saved ckpt/step-000000020" in str(error)
