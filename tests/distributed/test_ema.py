"""model.ema on two CPU processes: under DDP a whole average per rank that DDP does not broadcast, under FSDP2
the parameters' shards; stopped mid-epoch (with validations on the average and checkpoints between) and resumed,
both end with the uninterrupted run's weights and average, bitwise, and `lit-dist export --ema` writes it.
Validations (on the average) and checkpoints fall on the same steps: the saves hold the raw weights."""

import json

import pytest
import torch

from lit_dist.ckpt.export import load_checkpoint_state
from lit_dist.model.nets import SimpleCNN
from tests.conftest import CONFIGS, lit_dist, quickstart_args

pytestmark = pytest.mark.distributed

STOP, END = 6, 10  # 400 images at a global batch of 16: ~23 steps an epoch, so both are mid-epoch 0
STRATEGIES = {"ddp": ["--trainer.strategy", "ddp"], "fsdp2": ["--config", str(CONFIGS / "fsdp2.yaml")]}


def fit(tmp_path, demo_data, strategy, run_id, *extra):
    args = quickstart_args(tmp_path, demo_data, trainer__devices=2, data__batch_size_per_device=8,
                           data__num_workers=0, trainer__max_steps=END, trainer__enable_progress_bar=False,
                           trainer__val_check_interval=4, trainer__limit_val_batches=2,
                           checkpoint__every_n_epochs=None, checkpoint__every_n_steps=4, run__run_id=run_id)
    out = lit_dist("fit", *args, *STRATEGIES[strategy], "--model.net.init_args.norm", "group", "--model.ema.decay",
                   "0.9", "--model.ema.start_step", "3", "--trainer.callbacks+=tests.helpers.recorder.EMAPlacement",
                   *extra, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp_path / "quickstart" / run_id


def checkpointed(run_dir) -> dict:
    """The newest checkpoint's LitModel state (a sharded one consolidated), as lit-dist export reads it."""
    return load_checkpoint_state(str(run_dir / "checkpoints"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_average_lives_with_the_parameters_and_resumes_bitwise(strategy, tmp_path, demo_data):
    straight = fit(tmp_path, demo_data, strategy, "straight")
    fit(tmp_path, demo_data, strategy, "resumed", "--trainer.callbacks+=tests.helpers.recorder.StopAtStep",
        "--trainer.callbacks.step", str(STOP))
    resumed = fit(tmp_path, demo_data, strategy, "resumed")

    placement = [json.loads((straight / f"ema-rank{r}.json").read_text()) for r in range(2)]
    if strategy == "ddp":
        assert all(p["local"] == p["full"] and not p["broadcast"] for p in placement), placement
    else:
        assert all(p["local"] <= 0.55 * p["full"] for p in placement), placement
        assert sum(p["local"] for p in placement) == placement[0]["full"], "the shards add up to the whole"

    state, again = checkpointed(straight), checkpointed(resumed)
    averaged = [k for k in state if k.startswith("ema.average.")]
    assert averaged and state.keys() == again.keys()
    for key in state:  # the weights and the average
        assert torch.equal(state[key], again[key]), f"{key} differs after the resume"

    out = lit_dist("export", str(straight / "checkpoints"), "--ema", "true", "--output", str(tmp_path / "ema.pt"))
    assert out.returncode == 0, out.stderr[-3000:]
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    net = SimpleCNN(num_classes=4, norm="group")
    net.load_state_dict(exported)  # a plain network, every key
    assert all(torch.equal(exported[k.removeprefix("ema.average.")], state[k]) for k in averaged)
    assert any(not torch.equal(state[k], state["net." + k.removeprefix("ema.average.")]) for k in averaged), \
        "the average is not the weights"


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [True, False])
def test_an_fsdp2_resume_turns_the_average_on_or_off_and_a_changed_network_gets_one_line(sharded, tmp_path,
                                                                                        demo_data):
    def resume(max_steps, *extra):
        args = quickstart_args(tmp_path, demo_data, CONFIGS / "fsdp2.yaml", trainer__devices=2,
                               data__batch_size_per_device=8, data__num_workers=0, trainer__max_steps=max_steps,
                               trainer__enable_progress_bar=False, trainer__limit_val_batches=0,
                               checkpoint__every_n_epochs=None, checkpoint__every_n_steps=4, run__run_id="r",
                               export__filename=None)
        return lit_dist("fit", *args, "--model.net.init_args.norm", "group", "--trainer.strategy.init_args."
                        "save_distributed_checkpoint", str(sharded).lower(), *extra, timeout=300)

    checkpoints = tmp_path / "quickstart" / "r" / "checkpoints"
    assert resume(4).returncode == 0
    out = resume(8, "--model.ema.start_step", "100")  # turned on here; not updated before step 100
    assert out.returncode == 0, out.stderr[-3000:]
    assert "has no weight average (model.ema): it starts from its weights" in out.stderr
    saved, now = (load_checkpoint_state(str(checkpoints / f"step-{s:09d}")) for s in (4, 8))
    averaged = [k for k in now if k.startswith("ema.average.")]
    assert averaged and all(torch.equal(now[k], saved["net." + k.removeprefix("ema.average.")]) for k in averaged), \
        "the average starts from the weights the run resumed with"
    out = lit_dist("export", str(checkpoints / "step-000000008"), "--ema", "true", "--output", str(tmp_path / "m.pt"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "has had no update yet (it starts after optimizer step 100)" in out.stderr, out.stderr[-3000:]

    out = resume(12)  # turned off again: the saved average is left behind
    assert out.returncode == 0, out.stderr[-3000:]
    assert not any(k.startswith("ema.") for k in load_checkpoint_state(str(checkpoints / "step-000000012")))

    out = resume(16, "--model.net.init_args.num_classes", "7")
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 2 and "holds net.head.weight of shape (4, 64), this model's is (7, 64)" in errors[0], errors


@pytest.mark.slow
def test_with_gradient_accumulation_the_average_moves_once_per_optimizer_step_under_deepspeed_and_ddp(tmp_path,
                                                                                                      demo_data):
    # DeepSpeed accumulates gradients itself: Lightning calls the optimizer hook for every micro-batch, and the average
    # moved on each of them (A times per step, A - 1 of them towards unchanged weights).
    pytest.importorskip("deepspeed")
    strategies = {"zero2": ["--config", str(CONFIGS / "deepspeed_zero2.yaml"), "--trainer.accelerator", "cpu"],
                  "ddp": ["--trainer.strategy", "ddp"]}
    averages = {}
    constant = tmp_path / "ema.yaml"  # no warm-up: every update keeps 0.9 of the average
    constant.write_text("model:\n  ema:\n    decay: 0.9\n    start_step: 3\n    warmup_power: null\n")
    for name, strategy in strategies.items():
        args = quickstart_args(tmp_path / name, demo_data, constant, trainer__devices=2, data__batch_size_per_device=8,
                               data__num_workers=0, trainer__max_steps=8, trainer__accumulate_grad_batches=2,
                               trainer__enable_progress_bar=False, trainer__limit_val_batches=0,
                               checkpoint__every_n_epochs=None, export__filename=None, run__run_id="r")
        out = lit_dist("fit", *args, *strategy, "--model.net.init_args.norm", "group",
                       "--trainer.callbacks+=tests.helpers.recorder.AverageByHand", timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        run_dir = tmp_path / name / "quickstart" / "r"
        for rank in range(2):
            by_hand = json.loads((run_dir / f"by-hand-rank{rank}.json").read_text())
            assert by_hand["updates"] == 6, (name, by_hand)  # steps 3 to 8, one each
            assert by_hand["worst"] < 1e-6, (name, by_hand)
        averages[name] = torch.load(run_dir / "average.pt", weights_only=True)
    for key, value in averages["ddp"].items():  # the same run, two strategies: the same average
        torch.testing.assert_close(averages["zero2"][key], value, rtol=1e-3, atol=1e-4)  # ZeRO sums in its own order


@pytest.mark.slow
def test_fsdp2_validating_on_the_average_trains_bitwise_as_without_validation(tmp_path, demo_data):
    # With reshard_after_forward false, a forward without gradients leaves FSDP2's gathered parameters in place: the
    # average swapped in for validation stayed there, and the first training step after each validation trained on
    # it. Validating on the average must leave the trained weights bitwise those of a run that never validates.
    runs = {"never": ("true", 0), "resharded": ("true", 2), "gathered": ("false", 2)}
    weights = {}
    for name, (reshard, batches) in runs.items():
        args = quickstart_args(tmp_path / name, demo_data, CONFIGS / "fsdp2.yaml", trainer__devices=2,
                               data__batch_size_per_device=8, data__num_workers=0, trainer__max_steps=8,
                               trainer__val_check_interval=3, trainer__limit_val_batches=batches,
                               trainer__num_sanity_val_steps=0, trainer__enable_progress_bar=False,
                               checkpoint__every_n_epochs=None, run__run_id="r")
        out = lit_dist("fit", *args, "--model.net.init_args.norm", "group", "--model.ema.decay", "0.5",
                       "--trainer.strategy.init_args.reshard_after_forward", reshard, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        assert ("validation at step 6" in out.stderr + out.stdout) == bool(batches)
        weights[name] = torch.load(tmp_path / name / "quickstart" / "r" / "model.pt", weights_only=True)
    for name in ("resharded", "gathered"):
        for key, value in weights["never"].items():
            assert torch.equal(weights[name][key], value), f"{name}: {key} differs from the run that never validates"
