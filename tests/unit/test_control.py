"""The run control on one process: facts agreed at every step, actions in their documented order, the most
severe stop wins, events reach every subscriber."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lit_dist.callbacks.circuit_breaker import GPUFault
from lit_dist.errors import ConfigError, DataError, Preempted
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from lit_dist.runtime.control import Event, RunControl, Stop


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"image": torch.randn(3, 16, 16), "label": i % 2}


class Participant(Callback):
    """Shares a flag that turns on at ``step`` and asks for ``stop`` (or a save) when it is agreed."""

    def __init__(self, name, step, journal, stop=None, save=None):
        self.name, self.step, self.journal, self.stop, self.save = name, step, journal, stop, save
        self.raised = False

    def connect(self, control):
        self.control = control
        control.share(self.name, "max", lambda: 1.0 if self.raised else 0.0)
        control.on_agreed(self.decide)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.raised = trainer.global_step + 1 >= self.step  # known during the step that ends at `step`

    def decide(self, trainer, agreed):
        if agreed[self.name] and not self.journal.count(f"asked {self.name}"):
            self.journal.append(f"asked {self.name}")
            if self.save:
                self.control.request_save(self.save)
            if self.stop:
                self.control.request_stop(Stop(self.stop, save=self.name,
                                               announce=lambda t, saved: self.journal.append(f"announce {self.name} {saved}")))


class Saver:
    def __init__(self, journal):
        self.journal = journal

    def save(self, trainer, reason):
        self.journal.append(f"save {reason} at {trainer.global_step}")
        return f"ckpt-{trainer.global_step}"

    def wait_for_save(self, trainer):
        self.journal.append("waited")


class Sink:
    def __init__(self):
        self.events, self.flushes = [], 0

    def send(self, event):
        self.events.append(event)

    def flush(self, timeout_s=None):
        self.flushes += 1
        return True


def fit(*callbacks, control=None, journal=None, sink=None):
    seed_everything(0)
    control = control or RunControl()
    if journal is not None:
        control.set_saver(Saver(journal))
    if sink is not None:
        control.subscribe(sink)
    model = LitModel(SimpleCNN(num_classes=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[control, *callbacks], num_sanity_val_steps=0,
                      limit_val_batches=0)
    trainer.fit(model, torch.utils.data.DataLoader(Data(), batch_size=4))
    return trainer


def test_save_then_announce_then_stop_and_the_most_severe_stop_wins():
    journal, sink = [], Sink()
    preempt = Participant("preempt", 5, journal, stop=Preempted("preempted"))
    fault = Participant("fault", 5, journal, stop=GPUFault("gpu"))
    with pytest.raises(GPUFault):
        fit(preempt, fault, journal=journal, sink=sink)
    # One process: agreed at the step of the cause; one save (the winning stop's), waited for, then its announcement.
    assert journal == ["asked preempt", "asked fault", "save fault at 5", "waited", "announce fault ckpt-5"]
    assert sink.flushes >= 1, "events are flushed before the stop"
    assert [e.type for e in sink.events if e.type.startswith("run.")] == ["run.started", "run.progress", "run.failed"]


def test_a_requested_save_alone_does_not_stop_and_a_data_error_beats_a_preemption():
    journal = []
    trainer = fit(Participant("due", 4, journal, save="time"), journal=journal)
    assert trainer.global_step == 12 and "save time at 4" in journal
    journal = []
    with pytest.raises(DataError):
        fit(Participant("preempt", 3, journal, stop=Preempted("p")), Participant("bad", 3, journal, stop=DataError("d")),
            journal=journal)


def test_events_reach_every_subscriber_and_a_failing_one_does_not_stop_the_run():
    class Broken(Sink):
        def send(self, event):
            raise RuntimeError("sink bug")

    good = Sink()
    control = RunControl()
    control.subscribe(Broken())
    fit(control=control, sink=good)
    control.publish(Event("gpu.warning", "warning", "GPU 0 thermal slowdown", "hot"))
    assert [e.type for e in good.events][-2:] == ["run.finished", "gpu.warning"]


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="control.sync_every_n_steps: 0 must be at least 1"):
        RunControl(sync_every_n_steps=0)
    with pytest.raises(ConfigError, match="Preemption needs lit_dist.runtime.control.RunControl"):
        from lit_dist.callbacks.preemption import Preemption

        seed_everything(0)
        model = LitModel(SimpleCNN(num_classes=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
        Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                callbacks=[Preemption()]).fit(model, torch.utils.data.DataLoader(Data(), batch_size=4))


def test_a_full_disk_beats_a_preemption_and_every_stop_has_its_place():
    from lit_dist.errors import ExitCode, StorageFull
    from lit_dist.runtime.control import STOP_PRIORITY

    journal = []
    with pytest.raises(StorageFull):  # a preempted run's save and requeue would meet the same full disk
        fit(Participant("preempt", 3, journal, stop=Preempted("p")), Participant("full", 3, journal, stop=StorageFull("f")),
            journal=journal)
    order = [Stop(error).rank for error in (GPUFault("g"), DataError("d"), StorageFull("f"), Preempted("p"))]
    assert order == sorted(order) and len(set(order)) == 4 and ExitCode.STORAGE_FULL in STOP_PRIORITY
