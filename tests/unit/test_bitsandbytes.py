"""bitsandbytes' 8-bit AdamW named by class_path: its states are 8-bit and a run resumes bitwise; DeepSpeed's ZeRO
takes it (and any optimizer outside DeepSpeed's own list) unless the run's JSON says otherwise."""

import pytest
import torch

from tests.helpers.training import run

bnb = pytest.importorskip("bitsandbytes")


def adamw_8bit():
    # min_8bit_size 256: DropoutCNN's larger tensors get 8-bit states (bitsandbytes keeps 32-bit ones below it)
    return lambda params: bnb.optim.AdamW8bit(params, lr=1e-3, min_8bit_size=256)


def test_an_8bit_adamw_run_resumes_bitwise(tmp_path, demo_data):
    stop, end = 4, 7
    straight, trainer, _ = run(tmp_path / "a", demo_data, max_steps=end, optimizer=adamw_8bit())
    states = [s for s in trainer.optimizers[0].state.values() if "state1" in s]
    assert any(s["state1"].dtype == torch.uint8 for s in states), "no 8-bit state: no test"
    run(tmp_path / "b", demo_data, max_steps=end, stop=stop, optimizer=adamw_8bit())
    resumed, _, checkpointing = run(tmp_path / "b", demo_data, max_steps=end, resume=True, optimizer=adamw_8bit())
    assert checkpointing.resumed_from == f"step-{stop:09d}"
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"


@pytest.mark.parametrize(("json", "allowed"), [({"zero_optimization": {"stage": 2}}, True),
                                               ({"zero_allow_untested_optimizer": False}, False)])
def test_zero_takes_optimizers_outside_deepspeeds_list_unless_the_json_says_not(json, allowed):
    pytest.importorskip("deepspeed")
    from lit_dist.strategies.deepspeed import DeepSpeedStrategy

    assert DeepSpeedStrategy(config=json).config["zero_allow_untested_optimizer"] is allowed
