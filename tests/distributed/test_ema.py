"""model.ema on two CPU processes: under DDP a whole average per rank that DDP does not broadcast, under FSDP2
the parameters' shards; stopped mid-epoch (with validations on the average and checkpoints between) and resumed,
both end with the uninterrupted run's weights and average, bitwise, and `lit-dist export --ema` writes it."""

import json

import pytest
import torch

from lit_dist.models import SimpleCNN
from tests.conftest import CONFIGS, lit_dist, quickstart_args

pytestmark = pytest.mark.distributed

STOP, END = 7, 14  # 400 images at a global batch of 16: ~23 steps an epoch, so both are mid-epoch 0
STRATEGIES = {"ddp": ["--trainer.strategy", "ddp"], "fsdp2": ["--config", str(CONFIGS / "fsdp2.yaml")]}


def fit(tmp_path, demo_data, strategy, run_id, *extra):
    args = quickstart_args(tmp_path, demo_data, trainer__devices=2, data__batch_size_per_device=8,
                           data__num_workers=0, trainer__max_steps=END, trainer__enable_progress_bar=False,
                           trainer__val_check_interval=5, trainer__limit_val_batches=2,
                           checkpoint__every_n_epochs=None, checkpoint__every_n_steps=5, run__run_id=run_id)
    out = lit_dist("fit", *args, *STRATEGIES[strategy], "--model.net.init_args.norm", "group", "--model.ema.decay",
                   "0.9", "--model.ema.start_step", "3", "--trainer.callbacks+=tests.helpers.recorder.EMAPlacement",
                   *extra, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp_path / "quickstart" / run_id


def export(run_dir, ema: bool) -> dict:
    out_file = run_dir / ("ema.pt" if ema else "raw.pt")
    out = lit_dist("export", str(run_dir / "checkpoints"), "--ema", str(ema).lower(), "--output", str(out_file))
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(out_file, weights_only=True)


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

    raw, ema = export(straight, False), export(straight, True)
    for name, state in (("weights", raw), ("average", ema)):
        again = export(resumed, name == "average")
        assert state.keys() == again.keys()
        for key in state:
            assert torch.equal(state[key], again[key]), f"{key} of the {name} differs after the resume"
    moved = [k for k in ema if not torch.equal(ema[k], raw[k])]
    assert moved, "the average is not the weights"
    net = SimpleCNN(num_classes=4, norm="group")
    net.load_state_dict(ema)  # a plain network, every key
