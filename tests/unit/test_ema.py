"""model.ema: the schedule against diffusers' EMAModel, the average a Trainer keeps against one computed by hand
from the weights after every optimizer step (gradient accumulation included), validation on the average once it
has started and on the raw weights before, the raw weights back bitwise after it, frozen parameters left out,
export and sample flags, bad settings."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lit_dist.ckpt.export import network_state
from lit_dist.errors import ConfigError, DataError
from lit_dist.model.ema import EMA
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN


def test_the_schedule_matches_diffusers_ema_model():
    diffusers = pytest.importorskip("diffusers.training_utils")
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    ours = EMA(decay=0.999, start_step=3, warmup_power=0.75)
    ours.attach(net)
    # diffusers copies the weights until update_after_step + 1, then warms up as update 1, 2, ...
    theirs = diffusers.EMAModel(net.parameters(), decay=0.999, min_decay=0.0, update_after_step=2, use_ema_warmup=True,
                                inv_gamma=1.0, power=0.75)
    for step in range(1, 40):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ours.update(step)
        theirs.step(net.parameters())
    for name, shadow in zip(ours.names, theirs.shadow_params, strict=True):
        torch.testing.assert_close(ours.average.get_buffer(name), shadow, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("start", "every", "first"), [(0, 1, 1), (5, 1, 5), (5, 4, 8), (8, 4, 8)])
def test_the_first_update_copies_and_comes_at_the_first_due_step(start, every, first):
    ema = EMA(decay=0.9, start_step=start, every_n_steps=every, warmup_power=None)
    assert ema.first_step == first
    assert [s for s in range(1, 20) if ema.weight(s) is not None][0] == first
    assert ema.weight(first) == 1.0 and ema.weight(first + every) == pytest.approx(0.1)
    assert all(ema.weight(s) is None for s in range(first + 1, first + every))


class Snapshots(Callback):
    """The trainable weights after every optimizer step; at each validation batch, the weights validated with."""

    def __init__(self):
        self.after_step, self.validated, self.before_validation, self.after_validation = {}, [], [], []
        self._seen = None

    @staticmethod
    def weights(pl_module):
        return [p.detach().clone() for p in pl_module.net.parameters() if p.requires_grad]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._seen:
            self._seen = trainer.global_step
            self.after_step[trainer.global_step] = self.weights(pl_module)

    def on_validation_start(self, trainer, pl_module):
        self.before_validation.append((trainer.global_step, self.weights(pl_module)))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.validated.append((trainer.global_step, self.weights(pl_module)))

    def on_validation_end(self, trainer, pl_module):
        self.after_validation.append(self.weights(pl_module))


class FrozenStem(nn.Module):
    """A frozen first layer (as a VAE or text encoder would be) before a trainable network."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 1).requires_grad_(False)
        self.body = SimpleCNN(num_classes=4)

    def forward(self, x):
        return self.body(self.stem(x))


class SelfAccumulating(SingleDeviceStrategy):
    """A strategy that accumulates gradients itself, as DeepSpeed does: Lightning calls the optimizer hook for every
    micro-batch and counts a step only at the accumulation boundary."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


def fit_with_ema(tmp_path, ema, accumulate=1, steps=12, strategy="auto"):
    torch.manual_seed(0)
    data = [{"image": torch.randn(3, 16, 16), "label": i % 4} for i in range(64)]
    model = LitModel(FrozenStem(), ema=ema, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    snaps = Snapshots()
    trainer = Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accumulate_grad_batches=accumulate, val_check_interval=4 * accumulate,
                      limit_val_batches=1, num_sanity_val_steps=1, callbacks=[snaps], default_root_dir=tmp_path,
                      strategy=strategy)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer.fit(model, loader, loader)
    return model, snaps


@pytest.mark.parametrize(("accumulate", "by_strategy"), [(1, False), (2, False), (2, True)])
def test_the_average_is_the_hand_computed_one_and_validation_uses_it_once_started(tmp_path, accumulate, by_strategy):
    ema = EMA(decay=0.8, start_step=3, every_n_steps=2, warmup_power=0.5)
    strategy = SelfAccumulating(torch.device("cpu")) if by_strategy else "auto"
    model, snaps = fit_with_ema(tmp_path, ema, accumulate, strategy=strategy)
    assert ema.count() == ema.updates_by(12) == 5  # steps 4, 6, 8, 10, 12: once per optimizer step
    assert ema.names == [n for n, p in model.net.named_parameters() if p.requires_grad]
    assert not any(n.startswith("stem.") for n in ema.names), "a frozen parameter has no average"

    expected = None  # the average after each step, from the weights after each step, in float64
    for step in sorted(snaps.after_step):
        weight = ema.weight(step)
        if weight is not None:
            now = [w.double() for w in snaps.after_step[step]]
            expected = now if expected is None else [e + weight * (w - e) for e, w in zip(expected, now, strict=True)]
    averages = [ema.average.get_buffer(n) for n in ema.names]
    for got, want in zip(averages, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, w) for a, w in zip(averages, snaps.after_step[12], strict=True)), "it moved apart"

    assert [step for step, _ in snaps.validated] == [0, 4, 8, 12]
    for (step, validated), (_, before), after in zip(snaps.validated, snaps.before_validation, snaps.after_validation,
                                                     strict=True):
        if step <= ema.first_step:  # the sanity check at step 0: raw; the first update (step 4) copied them
            assert all(torch.equal(v, b) for v, b in zip(validated, before, strict=True))
        else:
            assert not any(torch.equal(v, b) for v, b in zip(validated, before, strict=True)), f"step {step}: raw"
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "raw weights back, bitwise"
    final = snaps.validated[-1][1]  # validated at the last step: the final average
    assert all(torch.equal(v, a) for v, a in zip(final, averages, strict=True))


def test_evaluate_false_validates_the_raw_weights(tmp_path):
    _, snaps = fit_with_ema(tmp_path, EMA(decay=0.8, evaluate=False))
    for (_, validated), (_, before) in zip(snaps.validated, snaps.before_validation, strict=True):
        assert all(torch.equal(v, b) for v, b in zip(validated, before, strict=True))


def test_the_state_dict_names_the_average_like_the_parameters_and_export_picks_it(tmp_path):
    model, _ = fit_with_ema(tmp_path, EMA(decay=0.8))
    state = model.state_dict()
    assert {k for k in state if k.startswith("ema.")} == {f"ema.average.{n}" for n in model.ema.names} | \
        {"ema.updates", "ema.starts_at"}
    assert int(state["ema.updates"]) == 12 and int(state["ema.starts_at"]) == 1  # every step from the first
    assert all(state[f"ema.average.{n}"].dtype == torch.float32 for n in model.ema.names)
    raw, averaged = network_state(state), network_state(state, ema=True)
    assert raw.keys() == averaged.keys()  # frozen stem and batch-norm statistics come from the network
    assert torch.equal(averaged["stem.weight"], raw["stem.weight"])
    assert torch.equal(averaged["body.head.weight"], state["ema.average.body.head.weight"])
    assert not torch.equal(averaged["body.head.weight"], raw["body.head.weight"])
    with pytest.raises(DataError, match="no weight average"):
        network_state({k: v for k, v in state.items() if not k.startswith("ema.")}, ema=True)


def test_an_average_before_its_first_update_is_refused_by_export_and_unused_by_evaluation(tmp_path):
    # Saved before model.ema.start_step: the buffers hold the weights the run started from, not an average.
    model, snaps = fit_with_ema(tmp_path, EMA(decay=0.8, start_step=100), steps=4)
    state = model.state_dict()
    assert int(state["ema.updates"]) == 0 and int(state["ema.starts_at"]) == 100
    with pytest.raises(ConfigError, match=r"--ema: the checkpoint's weight average has had no update yet \(it starts "
                                          r"after optimizer step 100\)"):
        network_state(state, ema=True)
    for (_, validated), (_, before) in zip(snaps.validated, snaps.before_validation, strict=True):
        assert all(torch.equal(v, b) for v, b in zip(validated, before, strict=True)), "validated on the copy"
    assert model.weights_used() == "the trained weights (the average starts after optimizer step 100)"
    # A checkpoint of an older lit-dist (no count): the schedule's count at its step.
    again = LitModel(FrozenStem(), ema=EMA(decay=0.8, start_step=2))
    again.configure_model()
    older = {k: v for k, v in state.items() if k not in ("ema.updates", "ema.starts_at")}
    again.on_load_checkpoint({"state_dict": older, "global_step": 4})
    again.load_state_dict(older)
    assert again.ema.count() == 3 and again.averaged()  # steps 2, 3, 4


def test_a_checkpoint_without_an_average_starts_it_from_its_weights_and_one_with_it_loads_without(tmp_path):
    model, _ = fit_with_ema(tmp_path, EMA(decay=0.8))
    saved = {"state_dict": dict(model.state_dict())}
    plain = {"state_dict": {k: v for k, v in saved["state_dict"].items() if not k.startswith("ema.")}}
    again = LitModel(FrozenStem(), ema=EMA(decay=0.8))
    again.configure_model()
    again.on_load_checkpoint(plain)
    again.load_state_dict(plain["state_dict"])  # strict
    assert torch.equal(again.ema.average.get_buffer("body.head.weight"), plain["state_dict"]["net.body.head.weight"])
    without = LitModel(FrozenStem())
    without.on_load_checkpoint(saved)
    without.load_state_dict(saved["state_dict"])  # strict: the average dropped


def test_a_checkpoint_of_another_network_is_one_clear_error_naming_the_first_difference(tmp_path):
    model, _ = fit_with_ema(tmp_path, EMA(decay=0.8))
    state = dict(model.state_dict())
    wider = {**state, "net.body.head.weight": torch.zeros(9, *state["net.body.head.weight"].shape[1:])}
    with pytest.raises(ConfigError, match=r"being loaded holds net.body.head.weight of shape \(9, "):
        LitModel(FrozenStem(), ema=EMA(decay=0.8)).on_load_checkpoint({"state_dict": wider})
    fewer = {k: v for k, v in state.items() if k != "net.body.head.bias"}
    with pytest.raises(ConfigError, match="has no net.body.head.bias: it was saved by another model.net"):
        LitModel(FrozenStem()).on_load_checkpoint({"state_dict": fewer})
    more = {**state, "net.extra.weight": torch.zeros(1)}
    with pytest.raises(ConfigError, match="holds net.extra.weight, which this model does not have"):
        LitModel(FrozenStem()).on_load_checkpoint({"state_dict": more})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("decay", 1.0, "model.ema.decay = 1.0: must be in [0, 1)"),
    ("every_n_steps", 0, "model.ema.every_n_steps = 0: must be >= 1"),
    ("start_step", -1, "model.ema.start_step = -1: must be >= 0"),
    ("warmup_power", 0.0, "model.ema.warmup_power = 0.0: must be > 0"),
])
def test_bad_settings_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        EMA(**{field: value})


def test_a_network_with_nothing_to_train_is_refused():
    with pytest.raises(ConfigError, match="no trainable parameters"):
        EMA().attach(nn.Linear(2, 2).requires_grad_(False))


def test_parameters_moved_or_an_average_cast_after_attach_are_refused_not_averaged():
    # A strategy that empties the parameters after the average was made (ZeRO-3 does, and the average follows it
    # through ds_tensor, below); an older DeepSpeed cast buffers.
    ema = EMA(decay=0.5)
    net = nn.Linear(3, 2)
    ema.attach(net)
    net.weight.data = torch.empty(0)
    with pytest.raises(ConfigError, match=r"model.ema: the average of weight is \(2, 3\) torch.float32 where the "
                                          r"parameter is \(0,\) torch.float32"):
        ema.update(1)
    ema = EMA(decay=0.5)
    ema.attach(nn.Linear(3, 2))
    ema.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="torch.bfloat16 where the parameter is"):
        ema.update(1)


def _as_zero3_rank_1_of_2(net: nn.Module) -> list[torch.Tensor]:
    """What DeepSpeed's ZeRO-3 engine leaves of each parameter on rank 1 of 2: the parameter emptied, the rank's flat
    slice (the second half, padded to equal halves) in ``ds_tensor``."""
    for p in net.parameters():
        flat = p.data.flatten()
        half = (flat.numel() + 1) // 2
        p.ds_tensor = torch.cat([flat[half:], flat.new_zeros(2 * half - flat.numel())])
        p.data = torch.empty(0)
    return [p.ds_tensor for p in net.parameters()]


def test_under_zero3_the_average_is_of_this_ranks_partitions_and_never_of_whole_parameters():
    ema, net = EMA(decay=0.5, warmup_power=None), nn.Linear(3, 3)
    ema.attach(net, partitioned_later=True)
    assert [ema.average.get_buffer(n).numel() for n in ema.names] == [0, 0], "no whole copy before the engine starts"
    parts = _as_zero3_rank_1_of_2(net)
    ema.update(1)  # the first update copies
    assert [ema.average.get_buffer(n).shape for n in ema.names] == [(5,), (2,)]
    before = [part.clone() for part in parts]
    for part in parts:
        part.add_(1.0)
    ema.update(2)
    for name, old in zip(ema.names, before, strict=True):
        torch.testing.assert_close(ema.average.get_buffer(name), old + 0.5)
    ema.swap_in()
    assert all(torch.equal(part, ema.average.get_buffer(n)) for part, n in zip(parts, ema.names, strict=True))
    ema.swap_out()
    assert all(torch.equal(part, old + 1.0) for part, old in zip(parts, before, strict=True))
    # A resumed rank: the engine partitions before the checkpoint is loaded into the empty average.
    resumed, again = EMA(decay=0.5), nn.Linear(3, 3)
    resumed.attach(again, partitioned_later=True)
    _as_zero3_rank_1_of_2(again)
    resumed.load_state_dict(ema.state_dict())
    assert all(torch.equal(resumed.average.get_buffer(n), ema.average.get_buffer(n)) for n in ema.names)
