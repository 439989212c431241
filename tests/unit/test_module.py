import math

import pytest
import torch
from lightning.pytorch import Trainer

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import ConfigError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN


def test_simple_cnn_takes_any_size_and_aspect():
    net = SimpleCNN(num_classes=5)
    for h, w in [(32, 32), (24, 48), (64, 16), (17, 33)]:
        assert net(torch.randn(2, 3, h, w)).shape == (2, 5)


def attach(model, devices_batch=16, world=1, accumulate=1, steps=float("inf")):
    class FakeTrainer:
        world_size = world
        accumulate_grad_batches = accumulate
        estimated_stepping_batches = steps
        logger = None

        class datamodule:
            batch_size_per_device = devices_batch

    model._trainer = FakeTrainer()  # only what lr_scale and the lr decay read
    return model


@pytest.mark.parametrize("mode,expected", [("none", 1.0), ("linear", 16 * 4 * 2 / 32), ("sqrt", math.sqrt(16 * 4 * 2 / 32))])
def test_lr_scales_with_the_effective_batch(mode, expected):
    model = attach(LitModel(SimpleCNN(), lr_scaling=mode, base_batch_size=32), devices_batch=16, world=4, accumulate=2)
    assert model.effective_batch_size() == 128
    assert model.lr_scale() == pytest.approx(expected)


def lrs_of(model, steps: int) -> list[float]:
    """The lr of each of ``steps`` optimizer steps under the model's optimizer and schedule."""
    config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_then_the_configured_schedule(tmp_path):
    model = LitModel(
        SimpleCNN(num_classes=4),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        warmup_steps=4,
    )
    lrs = lrs_of(attach(model), 7)
    assert lrs[:5] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])
    assert lrs[5] < 0.1 and lrs[6] < lrs[5], "after warmup the configured scheduler takes over"


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_warmup_then_decay_to_the_floor_at_the_runs_last_step(kind):
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), warmup_steps=4,
                     lr_decay=kind, min_lr_ratio=0.1)
    lrs = lrs_of(attach(model, steps=15), 15)
    assert lrs[:5] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1]), "warmup, then decay starts from the full lr"
    assert all(b < a for a, b in zip(lrs[4:-1], lrs[5:], strict=True)), lrs
    assert lrs[-1] == pytest.approx(0.01), "the floor is reached at the last step, not before or after"
    assert lrs[9] == pytest.approx(0.055), "halfway through the decay: half way to the floor, linear and cosine alike"


def test_adam_runs_fused_unless_the_config_chose_an_implementation_and_resumes_from_either():
    torch.manual_seed(0)
    net = SimpleCNN(num_classes=4)
    fused = attach(LitModel(net, optimizer=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.05),
                            lr_scaling="none")).configure_optimizers()
    assert fused.defaults["fused"] is True and fused.param_groups[0]["weight_decay"] == 0.05
    for chosen in ({"foreach": False}, {"foreach": True}, {"fused": False}):
        kept = attach(LitModel(net, optimizer=lambda p, c=chosen: torch.optim.AdamW(p, lr=0.1, **c),
                               lr_scaling="none")).configure_optimizers()
        assert kept.defaults["fused"] in (None, False) and {k: kept.defaults[k] for k in chosen} == chosen
    sgd = attach(LitModel(net, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), lr_scaling="none")).configure_optimizers()
    assert type(sgd) is torch.optim.SGD

    # The same steps as torch's loop, to float tolerance; a loop's state loads into the fused one and goes on alike.
    loop = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.05, foreach=False)
    start = [p.detach().clone() for p in net.parameters()]
    after = []
    for optimizer in (loop, fused):
        with torch.no_grad():
            for p, s in zip(net.parameters(), start, strict=True):
                p.copy_(s)
        optimizer.state.clear()
        for step in range(3):
            for p in net.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            optimizer.step()
        after.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*after, strict=True):
        torch.testing.assert_close(a, b)
    fused.load_state_dict(loop.state_dict())
    fused.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_lr_decay_needs_a_run_length_and_no_second_scheduler():
    model = attach(LitModel(SimpleCNN(), lr_decay="cosine"))
    with pytest.raises(ConfigError, match="trainer.max_steps or trainer.max_epochs"):
        model.configure_optimizers()
    with pytest.raises(ConfigError, match="model.lr_decay = 'cosine' and model.lr_scheduler"):
        LitModel(SimpleCNN(), lr_decay="cosine", lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    with pytest.raises(ConfigError, match="model.min_lr_ratio = 2"):
        LitModel(SimpleCNN(), lr_decay="linear", min_lr_ratio=2)


class Regression(LitModel):
    """Subclasses override one method to train something else."""

    def compute_loss(self, batch):
        out = self.net(batch["image"]).mean(dim=1)
        return torch.nn.functional.mse_loss(out, batch["label"].float()), {}


def test_a_subclass_trains_with_its_own_loss_and_eval_counts_every_sample_once(demo_data, tmp_path):
    model = Regression(SimpleCNN(num_classes=1))
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=16, num_workers=0, val_fraction=0.2)
    trainer = Trainer(max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, dm)
    assert "val/loss" in trainer.callback_metrics and "train/loss" in trainer.callback_metrics
    # The logged validation loss is the per-sample mean over the whole validation split.
    model.eval()
    dm.setup("validate")
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            batch = dm.on_after_batch_transfer(batch, 0)
            loss, _ = model.compute_loss(batch)
            total += float(loss) * float(batch["weight"].sum())
            count += int(batch["weight"].sum())
    assert count == len(dm._splits["val"])
    assert float(trainer.callback_metrics["val/loss"]) == pytest.approx(total / count, rel=1e-4)


def test_compile_keeps_parameter_names_so_checkpoints_stay_portable():
    plain = LitModel(SimpleCNN(num_classes=3))
    compiled = LitModel(SimpleCNN(num_classes=3), compile=True)
    compiled.configure_model()
    assert list(compiled.state_dict()) == list(plain.state_dict())


def test_exported_state_is_the_network_alone_whatever_wrapped_it():
    import torch

    from lit_dist.ckpt.export import strip_prefix, to_full_precision

    w = torch.ones(2, dtype=torch.bfloat16)
    # LitModel's own keys, an old Lightning DeepSpeed wrapper's, and a network saved bare.
    for state in ({"net.fc.weight": w, "loss_fn.weight": w}, {"_forward_module.net.fc.weight": w}, {"fc.weight": w}):
        exported = to_full_precision(strip_prefix(state))
        assert list(exported) == ["fc.weight"] and exported["fc.weight"].dtype == torch.float32


def test_float32_matmul_precision_applies_on_gpu_machines_only(monkeypatch):
    import pytest
    import torch

    from lit_dist.errors import ConfigError
    from lit_dist.model.module import LitModel
    from lit_dist.model.nets import SimpleCNN

    before = torch.get_float32_matmul_precision()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        LitModel(SimpleCNN(), float32_matmul_precision="medium")
        assert torch.get_float32_matmul_precision() == before, "CPU runs are left as they are"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        LitModel(SimpleCNN())
        assert torch.get_float32_matmul_precision() == "high", "TF32 tensor cores by default on GPUs"
        with pytest.raises(ConfigError, match="float32_matmul_precision = 'fast'"):
            LitModel(SimpleCNN(), float32_matmul_precision="fast")
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("bar", [False, True])
def test_the_loss_is_copied_to_the_host_every_step_only_for_a_progress_bar(bar, tmp_path):
    # Lightning turns every prog_bar metric into a Python float after every batch, bar or no bar: on a GPU a
    # host-device sync per step. Without a bar the loss must not be one (tests/gpu/test_sync.py sees the sync).
    data = [{"image": torch.randn(3, 16, 16), "label": i % 4} for i in range(16)]
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=bar,
                      enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    assert ("train/loss" in trainer.progress_bar_metrics) is bar
    assert "train/loss" in trainer.callback_metrics, "the plain progress lines and run.progress events read it"


def test_an_optimizer_that_sets_its_own_step_keeps_its_lr_and_is_told_what_does_not_fit(recwarn):
    prodigyopt = pytest.importorskip("prodigyopt")
    from lit_dist.model.optimizers import notes

    def configured(**settings):
        model = LitModel(SimpleCNN(), optimizer=lambda p: prodigyopt.Prodigy(p, lr=1.0), base_batch_size=32,
                         **settings)
        out = attach(model, devices_batch=16, world=4, accumulate=2).configure_optimizers()
        return out["optimizer"] if isinstance(out, dict) else out

    recwarn.clear()
    assert configured(lr_scaling="sqrt").param_groups[0]["lr"] == 1.0, "scaled: x2 the step Prodigy estimates"
    told = [str(w.message) for w in recwarn]
    assert any("Prodigy estimates its own step size: model.lr_scaling sqrt is not applied" in m for m in told), told
    recwarn.clear()
    assert configured(lr_scaling="none").param_groups[0]["lr"] == 1.0
    assert not [w for w in recwarn if "lit-dist: model.optimizer" in str(w.message)], "nothing to say of a fit"
    net = SimpleCNN()
    assert notes(prodigyopt.Prodigy(net.parameters(), lr=1.0, safeguard_warmup=True), "none", 20) == []
    said = notes(prodigyopt.Prodigy(net.parameters(), lr=0.01), "none", 20)
    assert len(said) == 2 and "run at lr 1.0" in said[0] and "safeguard_warmup: true" in said[1], said
    assert notes(torch.optim.AdamW(net.parameters(), lr=0.01), "sqrt", 20) == []
