"""Fine-tuning a pretrained pipeline, measured against diffusers' own training loop for it.

An SDXL-shaped pipeline folder (two CLIP text encoders, a VAE, a U-Net of three levels with cross-attention and
SDXL's added conditioning; random weights, written with save_pretrained, loaded by path) fine-tuned on the demo
shapes by `lit-dist fit --pipeline.path` and by benchmarks/diffusers_loop.py (written as diffusers'
train_text_to_image_sdxl.py: accelerate, the same U-Net, data, batch, resolution and precision, the VAE latents and
caption encodings precomputed before training). Validation, samples and checkpoints are off in both: the baseline
has none.

``--repeats`` rounds, each a run of lit-dist from an empty cache, then one of the baseline:

1. step: steps/s after ``--warmup-steps``, medians of the rounds: lit-dist's over the baseline's, target >= 1.0.
2. start: seconds from the command's start to the first training step, both from nothing cached (lit-dist builds
   its cache of latents and caption encodings in that time, the baseline its in-memory ones), medians of the
   rounds: lit-dist's over the baseline's, target <= 1.25. A last, short lit-dist run on the last round's cache
   gives its later starts (its cache read, not built; the baseline encodes at every start).

    .venv/bin/python -m benchmarks.bench_pipeline [--images 4096] [--resolution 64] [--batch 8] [--steps 60]
                                                  [--warmup-steps 10] [--repeats 3] [--short]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import torch

from benchmarks.common import SHORT_HELP, checks, machine, result_line, run_bench

TARGETS = {"step_ratio": (">=", 1.0), "start_ratio": ("<=", 1.25)}


def write_pipeline(folder: str, channels: tuple[int, ...]) -> None:
    """The tests' tiny SDXL folder (its tokenizers and text encoders) with a U-Net of ``channels`` levels."""
    from diffusers import UNet2DConditionModel

    from tests.helpers.pipelines import save_pipeline

    save_pipeline("sdxl", folder)
    levels = len(channels)
    unet = UNet2DConditionModel(
        block_out_channels=channels, layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (levels - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (levels - 1) + ("UpBlock2D",),
        attention_head_dim=tuple(max(1, c // 32) for c in channels), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, transformer_layers_per_block=1,
        projection_class_embeddings_input_dim=80, cross_attention_dim=48, norm_num_groups=32)
    shutil.rmtree(os.path.join(folder, "unet"))
    unet.save_pretrained(os.path.join(folder, "unet"), safe_serialization=True)


def lit_dist_run(args, folder: str, table: str, cache: str, root: str, run_id: str, *extra: str) -> dict:
    return run_bench([sys.executable, "-m", "lit_dist", "fit", "--pipeline.path", folder, "--data.metadata", table,
                      "--data.resolution", str(args.resolution), "--data.batch_size_per_device", str(args.batch),
                      "--data.num_workers", "1", "--data.allow_oversubscription", "true", "--data.random_crop", "false",
                      "--data.max_aspect", "1.0",
                      "--data.cache.dir", cache, "--model.optimizer.init_args.lr", "1e-4",
                      "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
                      "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
                      "--trainer.accelerator", "cpu" if not torch.cuda.is_available() else "auto",
                      "--trainer.devices", "1", "--samples.at_validation", "false", "--samples.at_end", "false",
                      "--checkpoint.every_n_epochs", "null", "--checkpoint.save_last", "false",
                      "--export.filename", "null", "--run.root_dir", root, "--run.run_id", run_id,
                      "--trainer.callbacks+=benchmarks.common.StepTimer",
                      "--trainer.callbacks.warmup_steps", str(args.warmup_steps), *extra])


def baseline_run(args, folder: str, table: str, *extra: str) -> dict:
    return run_bench([sys.executable, "-m", "benchmarks.diffusers_loop", "--pipeline", folder, "--metadata", table,
                      "--resolution", str(args.resolution), "--batch-size", str(args.batch), "--steps", str(args.steps),
                      "--warmup-steps", str(args.warmup_steps), *extra])


def add_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The sizes of a run on the SDXL-shaped folder (this benchmark's, and bench_lora's)."""
    parser.add_argument("--images", type=int, default=4096, help="demo shapes: a fine-tuning set")
    parser.add_argument("--resolution", type=int, default=64, help="pixels a side (latents half that)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved rounds: a run of each side")
    parser.add_argument("--channels", type=int, nargs="+", default=[64, 128, 256], help="the U-Net's levels")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)


def shorten(args: argparse.Namespace) -> None:
    """--short: every part at tiny sizes."""
    args.images, args.resolution, args.batch, args.steps, args.warmup_steps = 32, 32, 4, 4, 2
    args.repeats, args.channels = 1, [32, 64]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=3)  # each round from nothing cached
    args = parser.parse_args()
    if args.short:
        shorten(args)
    torch.set_num_threads(torch.get_num_threads())
    print(f"machine: {machine()}; U-Net levels {args.channels}, batch {args.batch}, {args.resolution} pixels, "
          f"{args.images} demo shapes")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-pipeline-")
    folder, table = os.path.join(tmp, "sdxl"), os.path.join(tmp, "shapes", "metadata.parquet")
    from lit_dist.data.demo.shapes import create_shapes_dataset

    create_shapes_dataset(table, num_images=args.images, seed=0)
    write_pipeline(folder, tuple(args.channels))

    # Every round from an empty cache (one start alone varies by 10 % on a shared machine: medians of the rounds).
    ours, base = [], []
    for i in range(args.repeats):
        cache = os.path.join(tmp, f"cache{i}")
        ours.append(lit_dist_run(args, folder, table, cache, os.path.join(tmp, "runs"), f"cold{i}"))
        base.append(baseline_run(args, folder, table))
    warm = {"to_first_step_s": None}
    if not args.short:  # (the tests' short run: one start less)
        warm = lit_dist_run(argparse.Namespace(**{**vars(args), "steps": args.warmup_steps + 2}), folder, table, cache,
                            os.path.join(tmp, "runs"), "warm")
    median = {key: {side: statistics.median(run[key] for run in runs) for side, runs in (("ours", ours), ("base", base))}
              for key in ("steps_per_s", "to_first_step_s")}
    figures = {
        "step_ratio": median["steps_per_s"]["ours"] / median["steps_per_s"]["base"],
        "start_ratio": median["to_first_step_s"]["ours"] / median["to_first_step_s"]["base"],
        "lit_dist_steps_per_s": [run["steps_per_s"] for run in ours],
        "baseline_steps_per_s": [run["steps_per_s"] for run in base],
        "lit_dist_first_step_s": [run["to_first_step_s"] for run in ours],
        "baseline_first_step_s": [run["to_first_step_s"] for run in base],
        "lit_dist_warm_first_step_s": warm["to_first_step_s"],
    }
    later = "not run" if warm["to_first_step_s"] is None else f"{warm['to_first_step_s']:.1f} s"
    print(f"step: lit-dist {median['steps_per_s']['ours']:.3f} steps/s, diffusers' loop "
          f"{median['steps_per_s']['base']:.3f} (x{figures['step_ratio']:.3f}); first step after "
          f"{median['to_first_step_s']['ours']:.1f} s (cache built) vs {median['to_first_step_s']['base']:.1f} s "
          f"(x{figures['start_ratio']:.3f}), medians of {args.repeats}; lit-dist's later start {later}")
    shutil.rmtree(tmp, ignore_errors=True)
    met = checks(figures, TARGETS)
    result_line("pipeline", figures["step_ratio"], ">= 1.0", all(met.values()), checks=met,
                machine=machine(), **figures, short=args.short)


if __name__ == "__main__":
    main()
