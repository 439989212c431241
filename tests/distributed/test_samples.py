"""samples on two CPU processes: the grid of fixed prompts and seeds is the same after a resume and at any world
size (1 or 2 processes, DDP or FSDP2), the run trains bitwise the same with samples as without, and the grid
of a model trained on VAE latents is decoded into images."""

import json

import pytest
import torch
from PIL import Image

from lit_dist.ckpt.export import load_checkpoint_state
from lit_dist.errors import ExitCode
from tests.conftest import CONFIGS, lit_dist, quickstart_args

pytestmark = pytest.mark.distributed

STOP, END = 4, 6
# A TinyUNet conditioned on the quickstart's labels, by flow matching on its 32-pixel images.
LABELS = ["--model.net", "lit_dist.model.nets.TinyUNet", "--model.net.init_args.channels", "[8, 16]",
          "--model.net.init_args.num_classes", "4", "--model.net.init_args.embed_dim", "16",
          "--model.objective", "lit_dist.model.objectives.FlowMatching", "--model.objective.init_args.condition", "label",
          "--model.objective.init_args.null_label", "4"]
# 3 prompts x 2 images = 6, in groups of 4: group 0 on rank 0, group 1 on rank 1 of 2.
SAMPLES = ["--samples.num_prompts", "3", "--samples.per_prompt", "2", "--samples.steps", "3", "--samples.batch_size", "4",
           "--samples.every_n_steps", "3"]


def args(tmp_path, demo_data, run_id, devices=2, **overrides):
    return quickstart_args(tmp_path, demo_data, trainer__devices=devices, data__batch_size_per_device=8,
                           data__num_workers=0, trainer__max_steps=END, trainer__enable_progress_bar=False,
                           trainer__limit_val_batches=0, checkpoint__every_n_epochs=None, checkpoint__every_n_steps=2,
                           export__filename=None, run__run_id=run_id, **overrides)


def fit(tmp_path, demo_data, run_id, *extra):
    out = lit_dist("fit", *args(tmp_path, demo_data, run_id), "--trainer.strategy", "ddp", *LABELS, *extra, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp_path / "quickstart" / run_id


def grids(run_dir) -> dict[str, bytes]:
    return {p.name: Image.open(p).tobytes() for p in sorted((run_dir / "samples").glob("step-*.png"))}


@pytest.mark.slow
def test_the_grid_is_the_same_after_a_resume_and_the_run_the_same_as_without_samples(tmp_path, demo_data):
    straight = fit(tmp_path, demo_data, "straight", *SAMPLES)
    fit(tmp_path, demo_data, "resumed", *SAMPLES, "--trainer.callbacks+=tests.helpers.recorder.StopAtStep",
        "--trainer.callbacks.step", str(STOP))
    resumed = fit(tmp_path, demo_data, "resumed", *SAMPLES)
    plain = fit(tmp_path, demo_data, "plain", "--samples.at_validation", "false", "--samples.at_end", "false")

    made = grids(straight)
    assert list(made) == ["step-000000003.png", "step-000000006.png"], list(made)
    assert Image.open(straight / "samples" / "step-000000006.png").size == (2 * 32, 3 * 32)  # a row per prompt
    assert grids(resumed) == made  # step 3 before the stop, step 6 after the resume
    assert made["step-000000003.png"] != made["step-000000006.png"]
    assert not (plain / "samples").exists()

    state, again, without = (load_checkpoint_state(str(run / "checkpoints")) for run in (straight, resumed, plain))
    for key in state:  # sampling used its own random numbers: training is the same with or without it
        assert torch.equal(state[key], without[key]) and torch.equal(state[key], again[key]), key

    # The prompts chosen once, in the checkpoint: a resume draws them from there, not again.
    from lit_dist.ckpt import pickles
    from lit_dist.ckpt.io import TRUST

    saved = pickles.load(str(sorted((straight / "checkpoints").glob("step-*/state.ckpt"))[-1]), TRUST)
    chosen = next(v for k, v in saved["callbacks"].items() if k.startswith("Samples"))
    assert len(chosen["prompts"]) == 3 and chosen["condition"].dtype == torch.int64


@pytest.mark.parametrize("how", [["--trainer.devices", "1"], ["--trainer.devices", "2", "--trainer.strategy", "ddp"],
                                 ["--trainer.devices", "2", "--config", str(CONFIGS / "fsdp2.yaml"),
                                  "--trainer.strategy.init_args.block_classes", "[lit_dist.model.nets.denoiser.Block]"]],
                         ids=["1-process", "ddp-2", "fsdp2-2"])
def test_a_checkpoints_grid_is_the_same_at_any_world_size(how, tmp_path, demo_data, trained_labels):
    """`lit-dist validate` of one checkpoint (samples at every validation) on 1 or 2 processes, DDP or FSDP2."""
    checkpoint, expected = trained_labels
    out = lit_dist("validate", *args(tmp_path, demo_data, "v"), *LABELS, *SAMPLES, *how,
                   "--trainer.limit_val_batches", "1", "--ckpt_path", str(checkpoint), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert grids(tmp_path / "quickstart" / "v") == expected


@pytest.fixture(scope="module")
def trained_labels(tmp_path_factory, demo_data):
    """A checkpoint of the label model (2 processes, DDP) and the grid a 1-process validate of it draws."""
    tmp = tmp_path_factory.mktemp("labels")
    run = fit(tmp, demo_data, "trained")
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1] / "state.ckpt"
    out = lit_dist("validate", *args(tmp, demo_data, "reference", devices=1), *LABELS, *SAMPLES,
                   "--trainer.limit_val_batches", "1", "--ckpt_path", str(checkpoint), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    made = grids(tmp / "quickstart" / "reference")
    assert list(made) == [f"step-{END:09d}.png"], list(made)
    return checkpoint, made


def test_prompts_rank_0_cannot_encode_end_every_rank_with_exit_2(tmp_path, demo_data):
    """Rank 0 encodes the prompts; its error reaches the other rank, which would otherwise wait for the embeddings."""
    out = lit_dist("fit", *args(tmp_path, demo_data, "bad"), "--trainer.strategy", "ddp", *LABELS,
                   "--samples.prompts", "[circle, hexagon]", "--samples.every_n_steps", "1", timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "samples.prompts has 'hexagon': a label-conditioned model takes class numbers or the names" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_prompts_the_caption_encoder_cannot_read_end_every_rank_with_one_line(tmp_path, demo_data):
    # Rank 0 alone encodes the prompts; an error other than a ConfigError there left rank 1 in the broadcast until the
    # process group's timeout.
    net = {"class_path": "lit_dist.model.nets.TinyUNet", "init_args": {"channels": [8, 16], "context_dim": 8, "embed_dim": 16,
                                                                 "num_classes": None}}  # not the quickstart's 4
    captions = ["--model.net", json.dumps(net), "--model.objective", "lit_dist.model.objectives.FlowMatching", "--data.cache.dir", str(tmp_path / "cache"),
                "--data.cache.caption_encoder", json.dumps({"class_path": "tests.helpers.encoders.ByteCaptionEncoder",
                                                            "init_args": {"dim": 8, "unreadable": "boom"}}),
                "--samples.prompts", '["a boom"]',
                "--samples.steps", "2", "--samples.every_n_steps", "2"]
    out = lit_dist("fit", *args(tmp_path, demo_data, "r"), "--trainer.strategy", "ddp", *captions, timeout=180)
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert out.returncode == ExitCode.DATA_ERROR and "Traceback" not in out.stderr, out.stderr[-4000:]
    assert len(errors) == 2 and all("tokenizer/boom.json" in line for line in errors), errors
