"""Stopping mid-epoch and resuming gives the same weights as never stopping (one process)."""

import contextlib

import pytest
import torch

from lit_dist.ckpt.store import STATE
from lit_dist.data.datamodule import BucketDataModule
from tests.helpers.recorder import RowRecorder
from tests.helpers.training import run, steps_per_epoch


@pytest.mark.parametrize("where", ["mid-epoch-0", "end-of-epoch-0", "mid-epoch-1", "early-stop-after-epoch-0"])
def test_resume_matches_an_uninterrupted_run_bitwise(tmp_path, demo_data, where):
    per_epoch = steps_per_epoch(demo_data)
    stop = {"mid-epoch-0": per_epoch // 2, "end-of-epoch-0": per_epoch, "mid-epoch-1": per_epoch + per_epoch // 2,
            "early-stop-after-epoch-0": per_epoch}[where]
    end = 2 * per_epoch + 3  # ends inside epoch 2
    straight, trainer, _ = run(tmp_path / "a", demo_data, max_steps=end)
    assert trainer.global_step == end
    # Early stopping ends the run after the epoch closed: the checkpoint is written in on_train_end.
    early = where.startswith("early")
    _, stopped, checkpointing = run(tmp_path / "b", demo_data, max_steps=end, stop=None if early else stop,
                                    stop_after_epoch=0 if early else None)
    assert stopped.global_step == stop
    saved = torch.load(f"{checkpointing.last_path}/{STATE}", weights_only=True)  # no pickled objects needed
    position = {"epoch": stop // per_epoch, "batches_done": stop % per_epoch, "global_batch_size": 8}
    assert saved["BucketDataModule"] == position
    assert len(saved["lit_dist"]["rng"]) == 1
    resumed, again_trainer, again = run(tmp_path / "b", demo_data, max_steps=end, resume=True)
    assert again.resumed_from == f"step-{stop:09d}"
    assert again_trainer.global_step == end and again_trainer.current_epoch == trainer.current_epoch
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"


@pytest.mark.parametrize("kind", ["flow", "diffusion"])
def test_a_generative_run_with_noise_offset_and_input_perturbation_resumes_bitwise(tmp_path, demo_data, kind):
    from lit_dist.model.objectives import Diffusion, FlowMatching

    def objective():  # labels as the condition (null label 4 for the dropped ones): draws of every kind each step
        knobs = dict(condition="label", null_label=4, noise_offset=0.1, noise_offset_probability=0.5,
                     input_perturbation=0.1)
        return FlowMatching(**knobs) if kind == "flow" else Diffusion(**knobs)

    stop, end = 5, 9
    straight, _, _ = run(tmp_path / "a", demo_data, max_steps=end, objective=objective())
    run(tmp_path / "b", demo_data, max_steps=end, stop=stop, objective=objective())
    resumed, _, _ = run(tmp_path / "b", demo_data, max_steps=end, resume=True, objective=objective())
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"


def test_without_the_saved_random_state_dropout_would_differ(tmp_path, demo_data):
    # The counter-check of the test above: the RNG state in the checkpoint is what makes it pass.
    per_epoch = steps_per_epoch(demo_data)
    stop, end = per_epoch // 2, per_epoch // 2 + 5
    straight, _, _ = run(tmp_path / "a", demo_data, max_steps=end)
    run(tmp_path / "b", demo_data, max_steps=end, stop=stop)
    resumed, _, _ = run(tmp_path / "b", demo_data, max_steps=end, resume=True, restore_rng=False)
    assert any(not torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True))


def test_loader_worker_seeds_follow_seed_and_epoch_not_the_global_rng(demo_data):
    # A resumed run reaches an epoch's loader at another point of the global RNG stream than the
    # uninterrupted run; worker seeds (random augmentation in workers) must not depend on it.
    def base_seed(global_seed: int, epoch: int) -> int:
        dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, seed=7)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        seed = iter(loader)._base_seed
        assert torch.equal(before, torch.get_rng_state()), "starting an epoch must not draw from the global RNG"
        return seed

    assert base_seed(1, epoch=3) == base_seed(2, epoch=3) != base_seed(1, epoch=4)


@pytest.mark.parametrize("parts", [[(8, 22), (4, None)], [(8, 10), (16, 3), (16, None)], [(8, 10), (16, 3), (4, None)]],
                         ids=["smaller", "larger-then-same", "larger-then-smaller"])
def test_resuming_with_another_global_batch_finishes_the_epoch_without_repeats(tmp_path, demo_data, parts):
    # Another world size (a requeue onto other nodes) or batch size: the epoch's plan depends on the
    # global batch, so the rest of the interrupted epoch is regrouped rather than skipped by count.
    recorders, step = [], 0
    for i, (batch_size, steps) in enumerate(parts):
        recorders.append(RowRecorder())
        step = step + steps if steps else None
        changed = i > 0 and batch_size != parts[i - 1][0]
        with pytest.warns(UserWarning, match=f"resuming epoch 0 with a global batch of {batch_size}") if changed \
                else contextlib.nullcontext():
            _, trainer, _ = run(tmp_path, demo_data, max_steps=10_000, stop=step, resume=i > 0, batch_size=batch_size,
                                stop_after_epoch=None if step else 1, extra=[recorders[-1]])
    batches = [b for r in recorders for b in r.batches]
    epoch0 = [rows for epoch, rows in batches if epoch == 0]
    seen = [r for rows in epoch0 for r in rows]
    assert len(seen) == len(set(seen)), "no sample trained twice in the interrupted epoch"
    assert len(seen) > 8 * steps_per_epoch(demo_data) - 3 * 16, "and the epoch's samples trained but a few"
    last = parts[-1][0]
    epoch1 = [rows for epoch, rows in batches if epoch == 1]
    assert len(epoch1) == steps_per_epoch(demo_data, last) and all(len(rows) == last for rows in epoch1)
    assert trainer.global_step == len(epoch0) + len(epoch1)
