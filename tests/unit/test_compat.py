"""One test per Lightning internal lit-dist touches (lit_dist/runtime/compat.py), against the installed Lightning:
an upgrade that changes one fails here, by name."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from lit_dist.runtime import compat

BATCHES = 6


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return BATCHES * 4

    def __getitem__(self, i):
        return {"image": torch.randn(3, 16, 16), "label": i % 2}


class Probe(Callback):
    """Reads the internals at every batch end (and shifts the count after the first batch, when asked)."""

    def __init__(self, shift_after_first: int = 0):
        self.rows, self.checkpoints, self.shift_after_first = [], [], shift_after_first

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.shift_after_first and batch_idx == 0:
            compat.shift_batches_done(trainer, self.shift_after_first)
        self.rows.append((trainer.current_epoch, batch_idx, compat.batches_done(trainer), compat.is_last_batch(trainer)))
        if compat.is_last_batch(trainer):
            self.checkpoints.append(compat.dump_checkpoint(trainer))

    def on_train_epoch_end(self, trainer, pl_module):
        self.rows.append(("next", compat.next_epoch(trainer)))


def fit(probe, epochs=2):
    seed_everything(0)
    model = LitModel(SimpleCNN(num_classes=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    loader = torch.utils.data.DataLoader(Data(), batch_size=4)
    trainer = Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[probe], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, loader)
    return trainer


def test_batch_counters_last_batch_and_next_epoch():
    probe = Probe()
    fit(probe)
    first = [r for r in probe.rows if r[0] == 0]
    assert [done for _, _, done, _ in first] == list(range(1, BATCHES + 1)), "batches done count the one just ended"
    assert [last for *_, last in first] == [False] * (BATCHES - 1) + [True]
    assert ("next", 1) in probe.rows and ("next", 2) in probe.rows


def test_dump_checkpoint_and_the_next_epoch_start_surgery():
    probe = Probe()
    fit(probe, epochs=1)
    checkpoint = probe.checkpoints[0]
    assert {"state_dict", "loops", "optimizer_states"} <= set(checkpoint)
    loop = checkpoint["loops"]["fit_loop"]
    compat.as_next_epoch_start(loop)
    assert loop["epoch_loop.batch_progress"]["current"]["processed"] == 0
    assert loop["epoch_loop.batch_progress"]["is_last_batch"] is False
    epoch = loop["epoch_progress"]["current"]
    assert epoch["ready"] == epoch["started"] == epoch["processed"] == epoch["completed"] == 1


def test_shifting_the_batch_count_ends_the_epoch_that_much_earlier():
    probe = Probe(shift_after_first=2)
    fit(probe, epochs=1)
    assert len([r for r in probe.rows if r[0] == 0]) == BATCHES - 2


def test_which_strategies_let_rank_zero_write_the_whole_checkpoint():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from lit_dist.strategies.fsdp import FSDP2Strategy

    assert compat.rank_zero_writes(DDPStrategy())
    assert compat.rank_zero_writes(FSDPStrategy(state_dict_type="full"))
    assert not compat.rank_zero_writes(FSDPStrategy(state_dict_type="sharded"))
    assert not compat.rank_zero_writes(FSDP2Strategy(save_distributed_checkpoint=True))
    assert compat.rank_zero_writes(FSDP2Strategy(save_distributed_checkpoint=False))
    # Only FSDP2's sharded folder is written by lit-dist itself (lit_dist/ckpt/sharded.py).
    assert compat.writes_dcp_shards(FSDP2Strategy(save_distributed_checkpoint=True))
    assert not compat.writes_dcp_shards(FSDP2Strategy(save_distributed_checkpoint=False))
    assert not compat.writes_dcp_shards(FSDPStrategy(state_dict_type="sharded"))
    assert not compat.writes_dcp_shards(DDPStrategy())


def test_data_parallel_sizes_of_a_model_parallel_strategy():
    from lit_dist.strategies.fsdp import FSDP2Strategy

    strategy = FSDP2Strategy()
    compat.set_data_parallel(strategy, 8)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (8, 1)


def test_the_collective_timeout_of_a_strategy():
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    assert compat.collective_timeout_s(DDPStrategy()) == 1800.0  # Lightning's default
    assert compat.collective_timeout_s(DDPStrategy(timeout=timedelta(minutes=5))) == 300.0
    assert compat.collective_timeout_s(SingleDeviceStrategy("cpu")) == 1800.0


def test_collectives_issued_counts_this_ranks_collectives(tmp_path):
    import torch.distributed as dist

    assert compat.collectives_issued() == -1  # no process group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        before = compat.collectives_issued()
        dist.all_reduce(torch.ones(2))
        dist.barrier()
        assert compat.collectives_issued() == before + 2
    finally:
        dist.destroy_process_group()


def test_a_changed_internal_fails_with_one_clear_message():
    class Renamed:  # a Trainer whose loop internals moved
        fit_loop = object()

    with pytest.raises(compat.LightningChanged, match=r"relies on Lightning's trainer.fit_loop.epoch_loop.batch_progress.*"
                                                      r"tested with Lightning 2\.6"):
        compat.is_last_batch(Renamed())


def test_observe_child_ranks_replaces_the_observer_lightnings_launcher_starts():
    from lightning.pytorch.strategies.launchers import subprocess_script

    original = subprocess_script._launch_process_observer
    seen = []
    try:
        compat.observe_child_ranks(seen.append)
        subprocess_script._launch_process_observer(["the children"])  # what launch() calls after starting them
    finally:
        subprocess_script._launch_process_observer = original
    assert seen == [["the children"]]


def test_plain_console_makes_lightning_choose_tqdm_and_the_plain_summary_with_rich_installed():
    pytest.importorskip("rich")
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar
    from lightning.pytorch.callbacks.rich_model_summary import RichModelSummary
    from lightning.pytorch.trainer.connectors import callback_connector

    original = callback_connector._RICH_AVAILABLE
    try:
        compat.plain_console()
        trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    finally:
        callback_connector._RICH_AVAILABLE = original
    kinds = [type(c) for c in trainer.callbacks]
    assert TQDMProgressBar in kinds and ModelSummary in kinds and RichModelSummary not in kinds, kinds


def test_optimizer_steps_now_is_false_for_the_micro_batches_a_strategy_accumulates_itself():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class Accumulating(SingleDeviceStrategy):  # as DeepSpeed: the loop calls optimizer_step for every micro-batch
        @property
        def handles_gradient_accumulation(self) -> bool:
            return True

    class Recording(LitModel):
        calls: list = []

        def optimizer_step(self, *args, **kwargs):
            super().optimizer_step(*args, **kwargs)
            self.calls.append((self.trainer.global_step, compat.optimizer_steps_now(self.trainer)))

    seed_everything(0)
    model = Recording(SimpleCNN(num_classes=2), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_steps=2, accumulate_grad_batches=3, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      limit_val_batches=0, strategy=Accumulating(torch.device("cpu")))
    trainer.fit(model, torch.utils.data.DataLoader(Data(), batch_size=4))
    assert model.calls == [(0, False), (0, False), (0, True), (1, False), (1, False), (1, True)]


def test_launch_local_ranks_with_replaces_only_the_launchers_popen(monkeypatch):
    import subprocess

    from lightning.pytorch.strategies.launchers import subprocess_script

    monkeypatch.setattr(subprocess_script, "subprocess", subprocess)  # put back after the test
    started = []
    compat.launch_local_ranks_with(lambda command, env=None, cwd=None: started.append((command, cwd)))
    subprocess_script.subprocess.Popen(["python", "-m", "lit_dist", "fit"], env={}, cwd="/tmp")
    assert started == [(["python", "-m", "lit_dist", "fit"], "/tmp")]
    assert subprocess_script.subprocess.TimeoutExpired is subprocess.TimeoutExpired and subprocess.Popen is not None
