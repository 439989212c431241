"""samples in one process: grids to PNG and TensorBoard at the asked steps, the time in the goodput ledger, the
prompts kept for a resume, adherence from a judge, and one clear error for each bad setting."""

import tempfile
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_dist.callbacks.progress import Progress
from lit_dist.callbacks.samples import Samples
from lit_dist.data.demo.judge import ShapesJudge
from lit_dist.errors import ConfigError
from lit_dist.model.ema import EMA
from lit_dist.model.judge import Judge
from lit_dist.model.module import LitModel
from lit_dist.model.nets import TinyUNet
from lit_dist.model.objectives import FlowMatching
from lit_dist.model.sampling import encode_prompts
from lit_dist.runtime.control import RunControl
from lit_dist.watch.tensorboard import TensorBoardLogger

pytestmark = pytest.mark.unit


class Labelled(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"image": torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i)), "label": i % 4}


class FirstHalf(Judge):
    """Accepts the images of the first half of the prompts."""

    def __call__(self, pixels, prompts):
        return torch.tensor([p in ("circle", "0") for p in prompts])


def fit(samples: Samples | None, root: str, steps: int = 4, ema: EMA | None = None):
    seed_everything(0)
    model = LitModel(TinyUNet(channels=(8, 16), num_classes=4, embed_dim=16),
                     objective=FlowMatching(condition="label", null_label=4), ema=ema,
                     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    progress = Progress()
    callbacks = [RunControl(), progress, *([samples] if samples else [])]
    trainer = Trainer(max_steps=steps, logger=TensorBoardLogger(root, name="", version=""), enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks,
                      num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=2, default_root_dir=root,
                      accelerator="cpu")
    trainer.fit(model, torch.utils.data.DataLoader(Labelled(), batch_size=8))
    return model, progress


def test_grids_at_the_asked_steps_in_png_and_tensorboard_with_their_time_and_adherence():
    root = tempfile.mkdtemp()
    samples = Samples(prompts=["0", "3"], per_prompt=3, steps=2, every_n_steps=2, size=16, batch_size=4,
                      judge=FirstHalf())
    model, progress = fit(samples, root)
    grids = sorted(p.name for p in (Path(root) / "samples").iterdir())
    # The end (step 4) was sampled once; each grid's prompts beside it, one per row.
    assert grids == ["step-000000002.png", "step-000000002.txt", "step-000000004.png", "step-000000004.txt"]
    assert (Path(root) / "samples" / "step-000000004.txt").read_text().splitlines() == samples._chosen
    assert Image.open(samples.last_path).size == (3 * 16, 2 * 16)  # a row per prompt, per_prompt columns

    events = EventAccumulator(root, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert [e.step for e in events.Images("samples")] == [2, 4]
    assert [e.value for e in events.Scalars("samples/adherence")] == [0.5, 0.5]  # 3 of 6 images judged correct
    assert progress.ledger().seconds["sampling"] > 0
    assert samples.state_dict()["prompts"] == ["0", "3"] and samples.state_dict()["condition"].tolist() == [0, 3]

    # The same run without samples: the same weights (sampling drew from its own generators).
    plain, _ = fit(None, tempfile.mkdtemp())
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_grid_of_several_groups_swaps_the_average_in_once(monkeypatch):
    # Each swap copies every local parameter (under ZeRO-3 it gathers twice): once per grid, not once per group.
    swaps = []
    monkeypatch.setattr(EMA, "swap_in", lambda self, real=EMA.swap_in: (swaps.append(1), real(self))[1])
    samples = Samples(prompts=["0", "1", "2"], per_prompt=2, steps=2, every_n_steps=2, size=16, batch_size=2,
                      at_end=False)
    fit(samples, tempfile.mkdtemp(), steps=2, ema=EMA(decay=0.5))
    assert samples.last_path is not None and len(swaps) == 1  # 3 groups of 2 images, one grid


def test_a_classifier_run_makes_no_samples():
    from lit_dist.model.nets import SimpleCNN

    root = tempfile.mkdtemp()
    seed_everything(0)
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[RunControl(), Samples(every_n_steps=1, size=16)],
                      limit_val_batches=0, default_root_dir=root, accelerator="cpu")
    trainer.fit(LitModel(SimpleCNN(num_classes=4)), torch.utils.data.DataLoader(Labelled(), batch_size=8))
    assert not (Path(root) / "samples").exists()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_prompts": 0}, "samples.num_prompts = 0"),
    ({"per_prompt": 0}, "samples.per_prompt = 0"),
    ({"steps": 0}, "samples.steps = 0"),
    ({"batch_size": 0}, "samples.batch_size = 0"),
    ({"every_n_steps": 0}, "samples.every_n_steps = 0"),
    ({"size": 4}, "samples.size = 4"),
    ({"prompts": []}, "samples.prompts is an empty list"),
])
def test_bad_settings_are_one_config_error_each(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Samples(**kwargs)


def test_label_prompts_are_class_numbers_or_names():
    objective = FlowMatching(condition="label", null_label=4)
    objective.bind("image", "label")

    class Data:
        classes = ["circle", "cross", "square", "triangle"]

    shown, labels, empty = encode_prompts(objective, Data(), ["square", "1"])
    assert shown == ["square", "cross"] and labels.tolist() == [2, 1] and empty is None
    with pytest.raises(ConfigError, match="'hexagon': a label-conditioned model takes class numbers or the names"):
        encode_prompts(objective, Data(), ["hexagon"])


def test_the_shapes_judge_says_what_it_needs(tmp_path):
    with pytest.raises(ConfigError, match="does not exist: export the quickstart's classifier first"):
        ShapesJudge(str(tmp_path / "missing.pt"))
    from lit_dist.model.nets import SimpleCNN

    torch.save(SimpleCNN(num_classes=4).state_dict(), tmp_path / "model.pt")
    judge = ShapesJudge(str(tmp_path / "model.pt"))
    pixels = torch.zeros(1, 3, 16, 16, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="reads prompts like 'a red circle on a white background', not 'a cat'"):
        judge(pixels, ["a cat"])
    # Colours: a white border, a red centre -> (red, white), whatever the classifier says.
    pixels[:] = torch.tensor([235, 235, 235], dtype=torch.uint8).view(1, 3, 1, 1)
    pixels[:, :, 5:11, 5:11] = torch.tensor([200, 40, 40], dtype=torch.uint8).view(1, 3, 1, 1)
    fg, bg = judge.colours(pixels)
    assert (judge.names[fg[0]], judge.names[bg[0]]) == ("red", "white")


def test_validation_captions_are_picked_the_same_way_every_time(demo_data):
    from lit_dist.data.datamodule import BucketDataModule

    data = BucketDataModule(metadata=str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0)
    data.setup("fit")
    first, again, other = data.pick("caption", 5, 0), data.pick("caption", 5, 0), data.pick("caption", 5, 1)
    assert first == again and first != other and len(first) == 5
    assert all(c.startswith("a ") and c.endswith(" background") for c in first)
    assert len(data.pick("label", 10_000, 0)) == len(data._splits["val"])  # fewer rows than asked: all of them
    assert data.pick("no_such_column", 3, 0) == []
