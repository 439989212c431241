"""The hang watchdog's settings and its timeout (the 2-process hang is tests/distributed/test_watchdog.py)."""

import pytest
import torch
from lightning.pytorch import Trainer

from lit_dist.callbacks.watchdog import HangWatchdog
from lit_dist.errors import ConfigError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from lit_dist.runtime.control import RunControl

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"timeout_s": 0}, r"watchdog.timeout_s = 0: must be positive"),
    ({"timeout_s": 10, "heartbeat_s": 6}, r"heartbeat must be at most half the timeout"),
    ({"step_factor": 1.5}, r"watchdog.step_factor = 1.5: below 2"),
    ({"min_timeout_s": -1}, r"watchdog.min_timeout_s = -1: must be positive"),
])
def test_settings_that_could_never_work_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HangWatchdog(**kwargs)


def test_the_timeout_follows_the_slowest_step_within_its_bounds_and_relaxes_for_saves_and_validation():
    dog = HangWatchdog()
    dog._limit = 900.0  # half of a 30-minute collective timeout
    assert dog.timeout() == 900.0  # before the first step: the start-up deadline, half the collective timeout
    assert HangWatchdog(startup_timeout_s=120).timeout() == 120
    dog._armed = True  # the first step finished
    assert dog.timeout() == 300.0  # nothing measured yet: the floor
    dog._slowest = 20.0
    assert dog.timeout() == 400.0  # 20 x the slowest step
    dog._slowest = 100.0
    assert dog.timeout() == 900.0  # never past half the collective timeout
    dog._slowest, dog._relaxed = 1.0, True
    assert dog.timeout() == 900.0  # in a save or a validation
    fixed = HangWatchdog(timeout_s=60)
    fixed._armed = True
    assert fixed.timeout() == 60


def test_a_timeout_at_or_above_the_collective_timeout_is_refused_at_the_start(tmp_path):
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      callbacks=[RunControl(), HangWatchdog(timeout_s=1800)], default_root_dir=tmp_path)
    data = [{"image": torch.randn(3, 32, 32), "label": 0}] * 8
    with pytest.raises(ConfigError, match=r"watchdog.timeout_s = 1800: at or above the collective timeout \(1800 s\)"):
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
