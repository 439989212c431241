"""A schedule-free optimizer (schedulefree's AdamWScheduleFree) steps at its training point, and evaluates, saves and
exports its average: validation sees the average, a checkpoint holds it, a resume is bitwise the run that went on,
and what it cannot be combined with is refused."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.callbacks.export import ExportModel
from lit_dist.ckpt.store import STATE
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import ConfigError
from lit_dist.model.ema import EMA
from lit_dist.model.module import LitModel
from lit_dist.model.optimizers import evaluation_point, notes, schedule_free
from lit_dist.runtime.control import RunControl
from tests.helpers.nets import DropoutCNN
from tests.helpers.recorder import StopAtStep

schedulefree = pytest.importorskip("schedulefree")


def adamw_sf(params):
    return schedulefree.AdamWScheduleFree(params, lr=3e-3, warmup_steps=2)


def adamw_sf_factory():
    """adamw_sf as the model's optimizer, by a lambda as a config's class_path becomes one: a checkpoint's hparams
    then name no function of this module, which a resume would refuse to unpickle."""
    return lambda params: adamw_sf(params)


class ValidationMode(Callback):
    """Records, at every validation batch, whether the optimizer is in eval mode and the net's first weight."""

    def __init__(self):
        self.modes, self.weights = [], []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.optimizers:
            self.modes.append(trainer.optimizers[0].param_groups[0]["train_mode"])
            self.weights.append(next(pl_module.net.parameters()).detach().clone())


def fit(root, demo_data, max_steps, stop=None, resume=False, ema=None, every=3, extra=()):
    seed_everything(0)
    model = LitModel(DropoutCNN(num_classes=4), optimizer=adamw_sf_factory(), ema=ema)
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, val_fraction=0.1)
    checkpointing = Checkpointing(dirpath=str(root / "ckpt"), every_n_steps=every, every_n_epochs=None)
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[RunControl(), checkpointing, *([StopAtStep(stop)] if stop else []), *extra],
                      num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=4, default_root_dir=root)
    ckpt_path = checkpointing.resolve_ckpt_path(trainer, "auto") if resume else None
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer, checkpointing


def test_evaluation_point_moves_a_schedule_free_optimizer_only_and_puts_it_back():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16))
    optimizer = adamw_sf([w])
    optimizer.train()
    for _ in range(3):
        w.grad = torch.randn(16)
        optimizer.step()
    trained = w.detach().clone()
    expected = trained.lerp(optimizer.state[w]["z"], 1 - 1 / 0.9)  # x from y and z, as its eval() computes it
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with evaluation_point([optimizer, plain]):
        assert not optimizer.param_groups[0]["train_mode"]
        assert torch.equal(w, expected) and not torch.equal(w, trained)
    assert optimizer.param_groups[0]["train_mode"]
    assert torch.allclose(w, trained, atol=1e-6)
    assert schedule_free(optimizer) and not schedule_free(plain)


def test_validation_and_checkpoints_see_the_average_and_training_goes_on_at_its_training_point(tmp_path, demo_data):
    seen = ValidationMode()
    model, trainer, checkpointing = fit(tmp_path, demo_data, max_steps=9, extra=[seen, ExportModel("model.pt")])
    assert trainer.global_step == 9  # a step in eval mode would have raised: training went back to train mode
    assert seen.modes and not any(seen.modes), "validation ran at the training point"
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["train_mode"]
    trained = {k: v.clone() for k, v in model.net.state_dict().items()}
    optimizer.eval()
    average = model.net.state_dict()
    # The save moved the parameters to the average and back, which rounds: the average computed again here from the
    # point it went back to is equal to a float's last bits, and far from the training point.
    apart = max((trained[k] - average[k]).abs().max().item() for k in trained)
    assert apart > 1e-4, "the two points are the same: no test"
    saved = torch.load(f"{checkpointing.last_path}/{STATE}", weights_only=True)
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    for key, value in average.items():
        for where, held in (("the checkpoint", saved["state_dict"][f"net.{key}"]), ("model.pt", exported[key])):
            assert (held - value).abs().max() <= 1e-6, f"{where}'s {key} is not the average"
    assert not saved["optimizer_states"][0]["param_groups"][0]["train_mode"]


def test_a_schedule_free_run_resumes_bitwise(tmp_path, demo_data):
    # Checkpoints every 3 steps, validation every 4: the run that went on and the one stopped after step 6 (a
    # checkpoint) switch points at the same steps.
    straight, _, _ = fit(tmp_path / "a", demo_data, max_steps=11)
    _, stopped, _ = fit(tmp_path / "b", demo_data, max_steps=11, stop=6)
    assert stopped.global_step == 6
    resumed, trainer, checkpointing = fit(tmp_path / "b", demo_data, max_steps=11, resume=True)
    assert checkpointing.resumed_from == "step-000000006" and trainer.global_step == 11
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"


def test_a_schedule_free_optimizer_with_a_weight_average_is_refused(tmp_path, demo_data):
    with pytest.raises(ConfigError, match="model.ema would average the training point"):
        fit(tmp_path, demo_data, max_steps=2, ema=EMA(decay=0.9))


def test_a_decaying_lr_with_a_schedule_free_optimizer_is_told():
    optimizer = adamw_sf([torch.nn.Parameter(torch.ones(2))])
    assert notes(optimizer, "none", 0) == []
    (said,) = notes(optimizer, "none", 10, lr_decay="cosine")
    assert "AdamWScheduleFree is schedule-free" in said and "model.lr_decay: none" in said
