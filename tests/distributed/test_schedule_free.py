"""A schedule-free optimizer on two FSDP2 processes: its two points are the parameters' shards, validation and
checkpoints use its average, and a run stopped mid-epoch resumes to the weights of the run that went on, bitwise."""

import pytest
import torch

from lit_dist.ckpt.export import load_checkpoint_state
from tests.conftest import CONFIGS, lit_dist, quickstart_args

pytestmark = pytest.mark.distributed
pytest.importorskip("schedulefree")

STOP, END = 8, 10  # checkpoints every 4 steps, validation every 3: mid-epoch 0 (~23 steps an epoch)


def fit(tmp_path, demo_data, run_id, *extra):
    args = quickstart_args(tmp_path, demo_data, CONFIGS / "fsdp2.yaml", trainer__devices=2,
                           data__batch_size_per_device=8, data__num_workers=0, trainer__max_steps=END,
                           trainer__enable_progress_bar=False, trainer__val_check_interval=3,
                           trainer__limit_val_batches=2, checkpoint__every_n_epochs=None, checkpoint__every_n_steps=4,
                           run__run_id=run_id, model__lr_scaling="none", model__warmup_steps=0)
    out = lit_dist("fit", *args, "--model.net.init_args.norm", "group", "--model.optimizer",
                   "schedulefree.AdamWScheduleFree", "--model.optimizer.lr", "0.003", *extra, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out, tmp_path / "quickstart" / run_id


@pytest.mark.slow
def test_an_fsdp2_run_with_a_schedule_free_optimizer_resumes_bitwise_and_keeps_its_average(tmp_path, demo_data):
    out, straight = fit(tmp_path, demo_data, "straight")
    assert "val/acc" in out.stdout + out.stderr
    fit(tmp_path, demo_data, "resumed", "--trainer.callbacks+=tests.helpers.recorder.StopAtStep",
        "--trainer.callbacks.step", str(STOP))
    _, resumed = fit(tmp_path, demo_data, "resumed")
    state, again = (load_checkpoint_state(str(run / "checkpoints")) for run in (straight, resumed))
    weights = [k for k in state if k.startswith("net.")]
    assert weights and state.keys() == again.keys()
    for key in weights:
        assert torch.equal(state[key], again[key]), f"{key} differs after the resume"
    # The export at the end is the checkpoint's weights, the average (to a float's last bits: the last save moved the
    # parameters there and back, and the export moved them there again); the training point is ~1e-3 away.
    exported = torch.load(straight / "model.pt", weights_only=True)
    for key in weights:
        apart = (exported[key.removeprefix("net.")] - state[key]).abs().max()
        assert apart <= 1e-6, f"model.pt's {key} is not the checkpoint's"
